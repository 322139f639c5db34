"""The learners' cards: the GPUs this course is for, and how to see what each of them sees.

On a big GPU an instructor can cap this process's GPU memory at a card's size (``simulate`` or
``CARD_GB=8`` in the environment) and run any notebook exactly as an RTX 4060 learner would:
PyTorch's allocator then refuses what the card could not hold, and ``torch.cuda.mem_get_info`` reports
the card's memory, as transformers' loader and accelerate read it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import CudaUnavailableError, InvalidChoiceError, SimulatedCardError, brief, require_positive_number


@dataclass(frozen=True)
class Card:
    """A GPU a learner brings: the memory the allocator may use (GB) and the memory bandwidth (GB/s, the vendor's
    figure: a laptop's maker may clock its memory lower)."""
    name: str
    memory_gb: float
    bandwidth_gb_s: float


# The learners' cards, by memory; NVIDIA's specification pages give the memory and bus (bandwidth = bus width x
# data rate). The T4 has 16 GB, of which Colab's driver leaves about 15 to PyTorch.
LEARNER_CARDS = (
    Card("GTX 1650", 4, 128),
    Card("RTX 3050 Laptop", 4, 192),
    Card("RTX 2060", 6, 336),
    Card("RTX 3050 6 GB", 6, 168),
    Card("RTX 4050 Laptop", 6, 192),
    Card("RTX 4060", 8, 272),
    Card("RTX 4060 Laptop", 8, 256),
    Card("RTX 3080", 10, 760),
    Card("RTX 3060", 12, 360),
    Card("RTX 4070", 12, 504),
    Card("Colab T4", 15, 320),
    Card("RTX 4060 Ti 16 GB", 16, 288),
    Card("RTX A5000 Laptop", 16, 448),  # the seed issue's card
    Card("RTX 3090", 24, 936),
    Card("RTX 4090", 24, 1008),
)
# every memory size a learner's card has, smallest first: what the notebooks must finish on
CARD_SIZES_GB = tuple(sorted({card.memory_gb for card in LEARNER_CARDS}))


def cards_with(memory_gb: float) -> tuple:
    """The learners' cards of this much memory."""
    require_positive_number(memory_gb, "memory_gb")
    return tuple(card for card in LEARNER_CARDS if card.memory_gb == memory_gb)


def size_label(memory_gb: float) -> str:
    """A card size named by the learners' cards of that size: "6 GB (RTX 2060, RTX 3050 6 GB, RTX 4050 Laptop)"."""
    names = ", ".join(card.name for card in cards_with(memory_gb))
    return f"{memory_gb:g} GB ({names})" if names else f"{memory_gb:g} GB"


# what the planner's card table answers for (GB the allocator may use): each size, with a card of that size
CARDS = {f"{gb:g} GB, e.g. {cards_with(gb)[0].name}": gb for gb in CARD_SIZES_GB}
# the cards the benchmark simulates on a big GPU: RTX 4060, Colab T4 (15 GB usable), the seed
# issue's 16 GB laptop card
SIMULATED_CARDS_GB = (8, 15, 16)
CARD_ENV = "CARD_GB"
# host RAM of the machines learners bring (bytes): the free Colab VM and a 16 GB laptop
MACHINES_RAM = {"Colab (12.7 GB RAM)": 12.7e9, "16 GB laptop": 16e9}
# what the operating system, the browser and Jupyter keep for themselves: an allowance, not a measurement
SYSTEM_RAM_ALLOWANCE_BYTES = 2e9


def requested_card_gb(card_gb=None) -> float | None:
    """The card to simulate: the argument, else ``$CARD_GB``, else none (the whole GPU)."""
    value = card_gb if card_gb is not None else os.environ.get(CARD_ENV) or None
    if value is None:
        return None
    if isinstance(value, bool):  # float(True) would simulate a 1 GB card
        raise SimulatedCardError(f"CARD_GB={value!r} is not a number of gigabytes: use e.g. CARD_GB=8 for an RTX 4060.")
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise SimulatedCardError(f"CARD_GB={value!r} is not a number of gigabytes: use e.g. CARD_GB=8 for an RTX 4060.") from None
    if not 1 <= gb <= 1000:
        raise SimulatedCardError(f"CARD_GB={value!r} is not a card size: use the card's memory in GB, e.g. 8, 15 or 16.")
    return gb


def require_gpu(device, what: str = "device"):
    """``device`` if it names a GPU: an index (0 for the first), ``"cuda"``, ``"cuda:1"`` or a CUDA ``torch.device``."""
    import torch

    if isinstance(device, str) and re.fullmatch(r"cuda(:\d+)?", device):
        return torch.device(device)
    if (isinstance(device, torch.device) and device.type == "cuda") or (
            isinstance(device, int) and not isinstance(device, bool) and device >= 0):
        return device
    raise InvalidChoiceError(f"{what}={brief(device)} is not a GPU; pass its index (0 for the first) or 'cuda:0'.")


def require_cuda_gpu(device, what: str):
    """``device`` as ``require_gpu`` gives it, on a machine that has CUDA: ``what`` reads a GPU's memory."""
    import torch

    device = require_gpu(device)
    if not torch.cuda.is_available():
        raise CudaUnavailableError(f"{what} reads a GPU's memory, and this machine has no CUDA GPU: on Colab choose "
                                   "Runtime > Change runtime type > T4 GPU; on a CPU the course needs no memory budget.")
    return device


def simulate(card_gb=None, device=0) -> float | None:
    """Cap this process's GPU memory at ``card_gb`` GB (10^9 bytes) so it behaves like that card;
    returns the cap in force (None: no cap). A no-op without CUDA. Call it before loading a model."""
    import torch

    device = require_gpu(device)
    gb = requested_card_gb(card_gb)
    if gb is None or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if gb * 1e9 > total:
        raise SimulatedCardError(f"This GPU has {total / 1e9:.1f} GB, less than the {gb:g} GB card asked for: "
                          f"simulate a smaller card or unset CARD_GB.")
    torch.cuda.set_per_process_memory_fraction(gb * 1e9 / total, device)
    report_the_card_as_free_memory(torch)
    return gb


def report_the_card_as_free_memory(torch) -> None:
    """Make ``torch.cuda.mem_get_info`` answer as the simulated card would: its total is the cap, and what is free is
    the cap less what this process reserved. transformers' loader sizes its allocator warm-up from it (at most the
    card less 1.2 GiB) and accelerate's ``device_map="auto"`` its budget, so without this a capped H200 runs out of
    memory at the warm-up, before anything loads, where a real card runs out partway through the weights."""
    if getattr(torch.cuda.mem_get_info, "reports_the_card", False):
        return
    whole_gpu = torch.cuda.mem_get_info

    def card_mem_get_info(device=None):
        free, total = whole_gpu(device)
        index = _device_index(torch, device)
        fraction = _memory_fraction(torch, index)
        if fraction >= 1.0:
            return free, total
        cap = int(fraction * torch.cuda.get_device_properties(index).total_memory)
        return max(0, min(free, cap - torch.cuda.memory_reserved(index))), cap

    card_mem_get_info.reports_the_card = True
    card_mem_get_info.whole_gpu = whole_gpu
    torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = card_mem_get_info


def whole_gpu_memory(device=0) -> tuple:
    """(free, total) bytes of the whole device as nvidia-smi sees it, every process included, whatever card is
    simulated: what tells a card's limit apart from a GPU shared with other processes."""
    import torch

    device = require_cuda_gpu(device, "whole_gpu_memory")
    reading = getattr(torch.cuda.mem_get_info, "whole_gpu", torch.cuda.mem_get_info)
    return reading(device)


def _memory_fraction(torch, index: int) -> float:
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get_fraction is None else get_fraction(index)


def _device_index(torch, device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def cap_in_force(device=0) -> float | None:
    """The GPU memory this process may use, in GB, when capped below the whole card (else None)."""
    import torch

    device = require_gpu(device)
    if not torch.cuda.is_available():
        return None
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else 1.0
    if fraction >= 1.0:
        return None
    return fraction * torch.cuda.get_device_properties(device).total_memory / 1e9


def budget_bytes(device) -> int:
    """Bytes this process may still allocate on ``device``: what the GPU has free (under a simulated card, what the
    cap leaves after what PyTorch reserved), and the free blocks PyTorch's cache holds, which it hands out again."""
    import torch

    device = require_gpu(device)
    free, total = whole_gpu_memory(device)
    fraction = _memory_fraction(torch, _device_index(torch, device))
    if fraction < 1.0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def max_memory(device=0) -> dict:
    """What ``device_map="auto"`` would be given on this card: the GPU's budget and the host's free RAM."""
    import psutil

    require_cuda_gpu(device, "max_memory")
    return {device: budget_bytes(device), "cpu": psutil.virtual_memory().available}


def describe(device=0) -> str:
    """One line for a notebook's first output: which GPU this kernel sees, and the card it simulates."""
    import torch

    device = require_gpu(device)
    if not torch.cuda.is_available():
        return "no CUDA GPU: the notebooks run the tiny model on the CPU"
    name = torch.cuda.get_device_name(device)
    cap = cap_in_force(device)
    if cap is None:
        total = torch.cuda.get_device_properties(device).total_memory
        return f"{name}, {total / 1e9:.1f} GB, no card simulated (set CARD_GB=8 to see what an RTX 4060 learner sees)"
    return f"{name} capped at {cap:.1f} GB: this kernel sees what a {cap:g} GB card sees"
