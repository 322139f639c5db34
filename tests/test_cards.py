"""A simulated card must look like the card to what reads free memory (transformers' allocator warm-up, accelerate's
device_map="auto"), not only to PyTorch's allocator. Checked with a stand-in for torch.cuda: no GPU needed."""

from types import SimpleNamespace

from helpers import cards

GB = 10**9
H200 = 140 * GB


def fake_torch(fraction: float, reserved: int, free: int = H200 - GB):
    cuda = SimpleNamespace(
        get_per_process_memory_fraction=lambda index: fraction,
        get_device_properties=lambda index: SimpleNamespace(total_memory=H200),
        memory_reserved=lambda index: reserved,
        current_device=lambda: 0,
    )
    cuda.mem_get_info = lambda device=None: (free, H200)
    cuda.memory = SimpleNamespace(mem_get_info=cuda.mem_get_info)
    return SimpleNamespace(cuda=cuda, device=lambda spec: SimpleNamespace(index=None))


def test_a_capped_big_gpu_reports_the_card_as_its_free_memory_not_the_whole_gpu():
    torch = fake_torch(fraction=6 * GB / H200, reserved=2 * GB)
    cards.report_the_card_as_free_memory(torch)
    free, total = torch.cuda.mem_get_info(0)
    assert total == 6 * GB
    assert free == 4 * GB  # the card less what this process reserved
    assert torch.cuda.memory.mem_get_info("cuda") == (free, total)
    assert torch.cuda.mem_get_info.whole_gpu(0) == (H200 - GB, H200)  # the device itself stays readable


def test_without_a_cap_the_reading_is_the_whole_gpu():
    torch = fake_torch(fraction=1.0, reserved=2 * GB)
    cards.report_the_card_as_free_memory(torch)
    assert torch.cuda.mem_get_info() == (H200 - GB, H200)


def test_the_card_reading_never_exceeds_what_the_device_has_free():
    # another process holds most of the GPU: the card cannot have more free than the device
    torch = fake_torch(fraction=8 * GB / H200, reserved=0, free=3 * GB)
    cards.report_the_card_as_free_memory(torch)
    assert torch.cuda.mem_get_info(0) == (3 * GB, 8 * GB)


def test_simulating_twice_does_not_wrap_the_reading_twice():
    torch = fake_torch(fraction=6 * GB / H200, reserved=0)
    cards.report_the_card_as_free_memory(torch)
    first = torch.cuda.mem_get_info
    cards.report_the_card_as_free_memory(torch)
    assert torch.cuda.mem_get_info is first


def on_a_capped_gpu(monkeypatch, *, cap: int, reserved: int, allocated: int, free: int = H200 - GB):
    """torch.cuda as a capped H200 would answer it, PyTorch's cache holding ``reserved - allocated`` free bytes."""
    import torch

    for name, value in {"is_available": lambda: True, "mem_get_info": lambda device=None: (free, H200),
                        "get_per_process_memory_fraction": lambda index: cap / H200,
                        "memory_reserved": lambda device=None: reserved,
                        "memory_allocated": lambda device=None: allocated}.items():
        monkeypatch.setattr(torch.cuda, name, value)


def test_the_budget_counts_the_free_blocks_pytorchs_cache_holds_not_only_the_memory_it_never_reserved(monkeypatch):
    # an 8 GB card after a long prefill: 7 GB reserved, 3 GB of it in use. A tower of 2 GB has room (the cache hands
    # its free blocks out again); counting only the unreserved 1 GB kept a picture's tower off the GPU
    on_a_capped_gpu(monkeypatch, cap=8 * GB, reserved=7 * GB, allocated=3 * GB)
    assert cards.budget_bytes(0) == 5 * GB
    on_a_capped_gpu(monkeypatch, cap=8 * GB, reserved=3 * GB, allocated=3 * GB)  # an empty cache: only what is unreserved
    assert cards.budget_bytes(0) == 5 * GB
    on_a_capped_gpu(monkeypatch, cap=8 * GB, reserved=7 * GB, allocated=3 * GB, free=GB // 2)  # another process holds the GPU
    assert cards.budget_bytes(0) == GB // 2 + 4 * GB
