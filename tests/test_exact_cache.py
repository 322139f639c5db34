"""Issue 31: the static cache's write of one decode token in one kernel (helpers.exact_cache) leaves the cache as
transformers' own update does. Here: the kernel under Triton's interpreter against the library's update, a whole
tiny decode through it, its control, and the refusals. On a GPU: tests/gpu/test_exact_cache_gpu.py."""

import pytest
import torch
from conftest import run_interpreted

from helpers import decoding, exact_cache

INTERPRETED = """
import copy, json, types
import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
from helpers import decoding, exact_cache, loading

def bits(t):
    return t.view(torch.int16)

def layer(kind):
    return StaticLayer(max_cache_len=12) if kind == "full" else StaticSlidingWindowLayer(max_cache_len=12, sliding_window=12)

def states(tokens, seed, heads=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, tokens, d, generator=gen).bfloat16() for _ in range(2)]

found = {}
for kind in ("full", "sliding"):
    library = layer(kind)
    library.update(*states(5, 0))  # the prefill, the library's own
    ours = copy.deepcopy(library)
    swapped = decoding.write_tokens_in_one_launch(types.SimpleNamespace(layers=[ours]))  # the decoder's own swap
    assert swapped == 1 and isinstance(ours, decoding.ONE_LAUNCH_LAYERS)
    same, told_apart, launched = True, True, 0
    real = exact_cache.write_token
    def counted(*args):
        global launched
        launched += 1
        return real(*args)
    exact_cache.write_token = counted
    for step in range(6):  # to the sliding window's last free slot
        k, v = states(1, 10 + step)
        if step == 3:  # a transposed head layout, as the attention hands over
            k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        nudged = copy.deepcopy(ours)  # the control: the counter one ahead writes one slot off
        nudged.cumulative_length.add_(1)
        want = library.update(k, v)
        told_apart &= not torch.equal(bits(nudged.update(k, v)[0]), bits(want[0]))
        got = ours.update(k, v)
        same &= all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got))
        same &= torch.equal(library.cumulative_length, ours.cumulative_length)
        same &= getattr(library, "cumulative_length_int", 0) == getattr(ours, "cumulative_length_int", 0)
    exact_cache.write_token = real
    found[kind] = [same, told_apart, launched]

# a whole decode of the tiny model: the one-launch writes against the library's, logits bit for bit
model = loading.load_model("tiny", "bf16", "cpu", device="cpu")
ids = torch.tensor([[2, 10, 20, 30, 40]])
outside = decoding.supports_ple_outside(model)
plain = decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=outside)).greedy(ids, 6, keep_logits=True)
fused = decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=outside, fused_cache=True))
launched = 0
real = exact_cache.write_token
exact_cache.write_token = counted
run = fused.greedy(ids, 6, keep_logits=True)
exact_cache.write_token = real
swapped = [layer.max_cache_len for layer in fused._cache.layers if isinstance(layer, decoding.ONE_LAUNCH_LAYERS)]
found["decode"] = [run.tokens == plain.tokens and torch.equal(run.logits, plain.logits), len(set(run.tokens)), launched,
                   swapped, ids.shape[1]]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's results under TRITON_INTERPRET=1."""
    return run_interpreted(INTERPRETED, missing="triton is not installed: the cache kernel is checked where it is (and on the GPU)")


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_the_one_launch_write_leaves_the_cache_and_its_counters_as_the_librarys_update_and_one_slot_off_is_told_apart(
        interpreted, kind):
    same, told_apart, launched = interpreted[kind]
    assert launched == 2 * 6  # every one-token update went through the kernel, and each control
    assert same and told_apart


def test_a_tiny_decode_writing_each_token_in_one_launch_has_the_librarys_logits(interpreted):
    identical, distinct, launched, lengths, prompt = interpreted["decode"]
    assert identical and distinct > 1  # what was compared varies
    # each of the 5 decode steps (not the prefill) of every layer that writes, until a sliding window is full; one
    # fills during the run, so the library's roll ran in the same decode
    assert lengths and launched == sum(min(5, length - prompt) for length in lengths)
    assert any(length - prompt < 5 for length in lengths)


def test_a_cpu_update_keeps_the_librarys_path_outside_the_interpreter(monkeypatch):
    from transformers.cache_utils import StaticLayer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = StaticLayer(max_cache_len=4)
    k = torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16)
    layer.update(k, k)
    assert not exact_cache.writable(layer, k, k)


def test_bad_inputs_to_the_cache_write_get_one_sentence():
    keys = torch.zeros(1, 2, 6, 8, dtype=torch.bfloat16)
    one = torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16)
    counter = torch.tensor(0)
    with pytest.raises(exact_cache.InvalidChoiceError, match="one token"):
        exact_cache.write_token(keys, keys.clone(), torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), one, counter)
    with pytest.raises(exact_cache.InvalidChoiceError, match="share a dtype"):
        exact_cache.write_token(keys, keys.clone(), one.float(), one.float(), counter)
    with pytest.raises(exact_cache.InvalidChoiceError, match="int64 counter"):
        exact_cache.write_token(keys, keys.clone(), one, one, torch.tensor([0, 0]))
    with pytest.raises(exact_cache.InvalidChoiceError, match="contiguous"):
        exact_cache.write_token(keys.transpose(1, 2), keys.clone(), one, one, counter)


def test_swapping_the_cache_write_into_something_that_is_no_cache_gets_one_sentence():
    with pytest.raises(decoding.InvalidChoiceError, match="not a transformers cache"):
        decoding.write_tokens_in_one_launch({"layers": []})


def test_a_decoder_refuses_the_cache_write_under_a_compiler():
    with pytest.raises(decoding.InvalidChoiceError, match="fused_cache"):
        decoding.Decoder(compile="reduce-overhead", fused_cache=True)
    assert "fused cache" in decoding.Decoder(fused_cache=True).label()
