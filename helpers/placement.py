"""Device maps, the PLE offload, and placement reports.

The Per-Layer-Embedding table (``embed_tokens_per_layer``) is a lookup: each forward reads
only the rows of the tokens in the batch. Keeping the table in CPU memory and moving just
the gathered rows to the GPU gives the same numbers bit for bit, at a fraction of the memory.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import cards
from .errors import (
    CudaUnavailableError,
    DeviceMapKeyError,
    HostMemoryError,
    InvalidChoiceError,
    NoPLETableError,
    require_bool,
    require_choice,
    require_model,  # noqa: F401 - placement.require_model, as the notebooks and helpers call it
    require_number,
    require_whole_number,
)
from .noise import ABSENT_DEVICE, silenced

PLE_SUFFIX = "embed_tokens_per_layer"
PEFT_PREFIX = "base_model.model."
PLACEMENTS = ("gpu", "cpu")  # where the PLE table lives
Placement = Literal["gpu", "cpu"]
# the image and audio encoders and their projections into the text model: a text conversation never calls them
TOWER_SUFFIXES = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
TOWERS = ("gpu", "cpu")  # where they live
TOKEN_TABLE_SUFFIX = "embed_tokens"  # the token embedding, which the checkpoint ties to lm_head
# "tied": the token table is also the output head, where the model runs. Otherwise the table is looked up on the
# CPU (exact, like the PLE) and the GPU keeps an output head of its own in that precision.
HEADS = ("tied", "bf16", "int8", "nf4")


# ---------------------------------------------------------------- checking arguments

def require_device(value, what: str = "device") -> torch.device:
    """The torch device for a GPU index, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; one
    sentence for anything else, for CUDA on a machine without it, and for a GPU it does not have."""
    on_a_mac = " (on a Mac, pass device='cpu')" if isinstance(value, str) and value.startswith("mps") else ""
    unsupported = InvalidChoiceError(
        f"{what}={value!r} is not supported; the course runs on 'cpu' or a CUDA GPU (0, 'cuda', 'cuda:1'){on_a_mac}.")
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)) or (isinstance(value, int) and value < 0):
        raise unsupported
    try:
        device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, ValueError):
        raise unsupported from None
    if device.type not in ("cpu", "cuda"):
        raise unsupported
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                f"{what}={value!r} asks for CUDA, which this machine does not have: pass device='cpu' (slow, for practice "
                f"on the tiny model), or on Colab choose Runtime > Change runtime type > T4 GPU.")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise CudaUnavailableError(
                f"{what}={value!r}: there is no cuda:{index}; this machine has {torch.cuda.device_count()} GPU(s): pass device=0.")
        device = torch.device("cuda", index)
    return device


def check_map_devices(device_map) -> None:
    """A device map is a dict of module names to devices this machine has (``"disk"`` too)."""
    if not isinstance(device_map, dict):
        raise InvalidChoiceError(
            f"device_map={device_map!r} is not supported; pass a dict of module names to devices, e.g. "
            f"{{'model': 0, 'lm_head': 0}}, or leave it out for the course's map.")
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise InvalidChoiceError(f"device_map key {key!r} is not a module name; use strings such as 'model.language_model'.")
        if value != "disk":
            require_device(value, f"device_map[{key!r}]")


# ---------------------------------------------------------------- finding modules

def modules_named(model, suffix: str) -> list[str]:
    """Full names of the modules whose name ends in ``suffix`` (robust to PEFT and other prefixes)."""
    require_model(model)
    return [name for name, _ in model.named_modules() if name == suffix or name.endswith("." + suffix)]


def ple_module_names(model) -> list[str]:
    """Names of the PLE tables, found by suffix so PEFT wrappers and other prefixes still match."""
    return modules_named(model, PLE_SUFFIX)


def tower_module_names(model) -> list[str]:
    """The vision and audio towers and their projections, by suffix (a text-only checkpoint has none)."""
    return [name for suffix in TOWER_SUFFIXES for name in modules_named(model, suffix)]


def token_table_names(model) -> list[str]:
    """The token embedding(s) of the text model, by suffix: ``...language_model.embed_tokens``."""
    return modules_named(model, TOKEN_TABLE_SUFFIX)


def require_ple(model) -> list[str]:
    names = ple_module_names(model)
    if not names:
        raise NoPLETableError(
            f"{type(model).__name__} has no `{PLE_SUFFIX}` module, so there is no PLE table to move; "
            f"load it with ple='gpu' (only Gemma 4 E2B/E4B-style models have one)."
        )
    return names


# ---------------------------------------------------------------- device maps

def key_for_each_name(device_map: dict, names) -> dict:
    """Which device-map key places each parameter name, by transformers' own rule
    (``expand_device_map`` in 5.5-5.24): keys are tried most dots first, then longest first, each
    as a regular expression matched at the start of the name, with no dot boundary; a name no key
    matches falls to the ``""`` key (else the CPU). ``None`` marks such names."""
    ordered = sorted((key for key in device_map if key != ""), key=lambda key: (key.count("."), len(key)), reverse=True)
    if not ordered:
        return dict.fromkeys(names)
    pattern = re.compile("|".join(f"({key})" for key in ordered))
    matched = {}
    for name in names:
        found = pattern.match(name)
        matched[name] = ordered[found.lastindex - 1] if found else None
    return matched


def modules_matched_by(key: str, names) -> list[str]:
    """The names a device-map key would catch on its own (a bare string prefix, as transformers
    matches): ``...embed_tokens`` alone also catches ``...embed_tokens_per_layer``."""
    return [name for name, found in key_for_each_name({key: 0}, names).items() if found == key or key == ""]


def nearest_names(key: str, names, n: int = 3) -> list[str]:
    """Real names a mistyped key probably meant: those ending in the key's own tail first (a key
    written for another architecture misses a level, e.g. ``model.layers.1``), then by similarity."""
    n = require_whole_number(n, "n")
    tail = key.split(".", 1)[-1]
    same_tail = [name for name in names if name == tail or name.endswith("." + tail)]
    return difflib.get_close_matches(key, same_tail or names, n=n, cutoff=0.0)


def validate_device_map(model, device_map: dict) -> None:
    """Refuse a map that would not do what it says, under the rules transformers and accelerate
    really apply: a key that names no module or parameter (transformers ignores it, accelerate only
    warns), a key that catches a parameter outside its own subtree (transformers matches by bare
    prefix: ``layers.1`` catches ``layers.10`` unless ``layers.10`` has its own key), and a
    parameter no key covers (accelerate's ``check_device_map`` refuses it after a long load)."""
    require_model(model)
    modules = [name for name, _ in model.named_modules() if name]
    tensors = list(model.state_dict().keys())
    known = set(modules) | set(tensors)
    for key in device_map:
        if key and key not in known:
            nearest = nearest_names(key, modules)
            raise DeviceMapKeyError(
                f"device_map key {key!r} names no module of {type(model).__name__}, so transformers would ignore it; "
                f"the nearest real names are {', '.join(map(repr, nearest))}."
            )
    owners = key_for_each_name(device_map, tensors)
    for tensor, key in owners.items():
        if key is not None and tensor != key and not tensor.startswith(key + "."):
            module = tensor.rsplit(".", 1)[0]
            raise DeviceMapKeyError(
                f"device_map key {key!r} also catches {tensor!r} (transformers matches keys as a bare prefix): "
                f"give {module!r} its own key."
            )
    if "" not in device_map:
        uncovered = [tensor for tensor, key in owners.items() if key is None]
        if uncovered:
            raise DeviceMapKeyError(
                f"device_map gives no device for {len(uncovered)} tensor(s), e.g. {uncovered[0]!r} (accelerate "
                f"refuses such a map after loading): add a key for its module or a \"\" key for the rest."
            )


def ple_device_map(model, compute_device, ple_device="cpu") -> dict:
    """A per-module map: the PLE table on ``ple_device``, every other part on ``compute_device``.

    Never a ``""`` key: that would place the whole model, PLE included, on the GPU while
    loading. The map names the siblings along the path to each PLE table, so every
    parameter is covered and nothing else moves.
    """
    require_model(model)
    return split_device_map(model, compute_device, dict.fromkeys(require_ple(model), ple_device))


def split_device_map(model, compute_device, elsewhere: dict) -> dict:
    """A per-module map that puts each module named in ``elsewhere`` on its device and every other part on
    ``compute_device``, naming the siblings along each path so that every parameter is covered, with no ``""`` key."""
    require_model(model)
    device_map: dict = {}
    covered_paths = set()
    for target in elsewhere:
        parts = target.split(".")
        for depth in range(len(parts)):
            parent_name = ".".join(parts[:depth])
            parent = model.get_submodule(parent_name) if parent_name else model
            on_path = ".".join(parts[: depth + 1])
            covered_paths.add(parent_name)
            for child_name, _ in parent.named_children():
                full = f"{parent_name}.{child_name}" if parent_name else child_name
                if full != on_path and full not in device_map:
                    device_map[full] = compute_device
            for tensor_name, _ in list(parent.named_parameters(recurse=False)) + list(
                parent.named_buffers(recurse=False)
            ):
                full = f"{parent_name}.{tensor_name}" if parent_name else tensor_name
                device_map.setdefault(full, compute_device)
    device_map.update(elsewhere)
    for path in covered_paths:  # a parent on some target's path is not a leaf of the map
        device_map.pop(path, None)
    return device_map


def auto_device_map(model, max_memory: dict) -> dict:
    """The map ``device_map="auto"`` would choose under ``max_memory``, computed by accelerate on
    a meta model (no GPU needed)."""
    require_model(model)
    from accelerate import infer_auto_device_map
    from accelerate.utils import convert_file_size_to_int

    budget = {k: convert_file_size_to_int(v) if isinstance(v, str) else v for k, v in max_memory.items()}
    with silenced(ABSENT_DEVICE):  # the card is hypothetical: this machine need not have it
        return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)


def bytes_per_device(model, device_map: dict) -> dict:
    """How many bytes of weights a device map puts on each device (accelerate's module sizes)."""
    require_model(model)
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    totals: dict = defaultdict(int)
    for key, device in device_map.items():
        totals[str(device)] += sizes[key]
    return dict(totals)


# ---------------------------------------------------------------- the CPU lookup

def cpu_lookup_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    """Gather rows on the CPU, move only those rows, scale on the compute device.

    The GPU path computes ``embedding(ids, W) * scale`` on the GPU. A gather copies rows
    exactly, and the scale is applied on the same device as before, so the result is bit
    for bit the same.
    """
    rows = torch.nn.functional.embedding(input_ids.to(self.weight.device), self.weight, self.padding_idx)
    target = self._ple_compute_device
    if target.type == "cuda":
        rows = rows.pin_memory().to(target, non_blocking=True)
    else:
        rows = rows.to(target)
    scale = self._ple_scale
    return rows if scale is None else rows * scale


def install_cpu_lookup(module, compute_device) -> None:
    """Make one embedding module look up on the CPU and return rows on ``compute_device``."""
    from accelerate.hooks import remove_hook_from_module

    if hasattr(module, "_hf_hook"):
        # accelerate's offload hook keeps the weight on `meta` and would copy the whole table
        # to the GPU at every forward; detaching it restores the weight to the CPU.
        remove_hook_from_module(module)
    compute_device = torch.device(compute_device)
    with torch.no_grad():
        if module.weight.device.type != "cpu":
            module.weight.data = module.weight.data.to("cpu")
        buffer = getattr(module, "embed_scale", None)
        module._ple_scale = None if buffer is None else buffer.to(compute_device).to(module.weight.dtype)
    module._ple_compute_device = compute_device
    module.forward = types.MethodType(cpu_lookup_forward, module)


PIN_MARGIN_BYTES = 1_000_000_000  # host RAM left free beside a table's pinned copy


def free_host_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


class _PinnedPages:
    """``__cuda_array_interface__`` over a pinned host tensor, whose address the GPU shares under CUDA's unified
    addressing; it keeps the tensor alive for as long as torch keeps the view."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i2", "version": 3,
                                         "data": (host.data_ptr(), False), "strides": None}


def mapped_view(host: torch.Tensor, device, instead: str = "") -> torch.Tensor | None:
    """A CUDA tensor over ``host``'s pinned pages: kernels on ``device`` read in place over the bus, so a gather
    moves only the rows it needs and no GPU memory is allocated. None where the GPU cannot map them (no unified
    addressing). Pinning copies an unpinned tensor once: without that much free RAM again, a ``HostMemoryError``
    whose fix ends with ``instead``. 16-bit tensors only (the tables are bf16)."""
    if host.element_size() != 2 or not host.is_contiguous():
        return None
    size, free = host.numel() * host.element_size(), free_host_bytes()
    if not host.is_pinned() and free < size + PIN_MARGIN_BYTES:
        raise HostMemoryError(f"Pinning a {size / 1e9:.1f} GB table for the GPU to read in place copies it once, and "
                              f"{free / 1e9:.1f} GB of host RAM is free (that much again and "
                              f"{PIN_MARGIN_BYTES / 1e9:.0f} GB are needed): close other programs or notebooks{instead}.")
    try:
        pinned = host if host.is_pinned() else host.pin_memory()
        view = torch.as_tensor(_PinnedPages(pinned.view(torch.int16)), device=device).view(host.dtype)
    except (RuntimeError, TypeError):
        return None
    return view if view.data_ptr() == pinned.data_ptr() and view.device == torch.device(device) else None


def install_mapped_table(module, compute_device, instead: str = "") -> bool:
    """Keep one embedding's table in pinned host memory and give its own forward a GPU view of it: the lookup runs
    on ``compute_device`` (the ids never leave it) and copies the rows exactly. False where the view is not
    possible; then the table is looked up on the CPU instead."""
    from accelerate.hooks import remove_hook_from_module

    compute_device = torch.device(compute_device)
    if compute_device.type != "cuda":
        return False
    if hasattr(module, "_hf_hook"):
        remove_hook_from_module(module)  # restores the offloaded weight to the CPU
    view = mapped_view(module.weight.data.to("cpu"), compute_device, instead)
    if view is None:
        return False
    module.weight = torch.nn.Parameter(view, requires_grad=False)
    for name, buffer in module.named_buffers(recurse=False):
        module._buffers[name] = buffer.to(compute_device)
    module._mapped_to = compute_device
    return True


def map_host_tables(model) -> list:
    """Turn every table the course looks up on the CPU into one its GPU reads in place (``install_mapped_table``),
    so that a decode step can gather rows without the ids leaving the GPU. The names of the tables changed; a
    table whose GPU cannot map host pages keeps its CPU lookup. Nothing changes on a CPU."""
    require_model(model)
    mapped = []
    for name, module in model.named_modules():
        device = getattr(module, "_ple_compute_device", None)
        if device is None or device.type != "cuda":
            continue
        lookup = module.__dict__.pop("forward")  # the class's own forward runs on the GPU view
        module._ple_compute_device = None
        done = False
        try:
            done = install_mapped_table(module, device, ", or decode with decoding.Decoder()")
        finally:
            if not done:  # refused or raised: the CPU lookup stays as it was
                module.forward, module._ple_compute_device = lookup, device
        if done:
            mapped.append(name)
    return mapped


def has_cpu_lookup(module) -> bool:
    return getattr(module, "_ple_compute_device", None) is not None


def served_from_host(model) -> list:
    """Names of the modules the course serves from host memory (a table's CPU lookup, a tower run on the CPU)."""
    require_model(model)
    return [name for name, module in model.named_modules() if runs_on_cpu(module)]


def within(name: str, modules: list) -> bool:
    """Whether the module or parameter ``name`` is one of ``modules`` or inside one."""
    return any(name == module or name.startswith(module + ".") for module in modules)


def compute_device_of(model) -> torch.device:
    """Where the decoder layers run (the first parameter that is not the PLE table or another module the course
    serves from host memory)."""
    served = served_from_host(model)
    for name, param in model.named_parameters():
        if PLE_SUFFIX in name or param.device.type == "meta" or within(name, served):
            continue
        return param.device
    return torch.device("cpu")


def served_from_host_last(model) -> None:
    """Move the modules the course serves from host memory to the end of their parents' children. transformers'
    ``model.device`` is the first parameter's device, and ``generate`` moves its inputs there: with the vision tower
    (registered first) or the token table on the CPU, that would be the CPU."""
    require_model(model)
    for name, module in list(model.named_modules()):
        if name and runs_on_cpu(module):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            parent._modules[child] = parent._modules.pop(child)  # a dict keeps the order things are put in


class ReservedMemoryNotice(UserWarning):
    """The caching allocator keeps memory reserved after a tensor leaves the GPU."""


def offload_ple(model, compute_device=None, *, release_cached: bool = False):
    """Move the PLE table(s) of an already loaded model to the CPU and look up there.

    Works on any model holding modules named ``*embed_tokens_per_layer`` (PEFT-wrapped too).
    The freed memory stays *reserved* by PyTorch's caching allocator: it is free for
    PyTorch to reuse but ``nvidia-smi`` still counts it. Pass ``release_cached=True`` to hand
    it back to the driver with ``torch.cuda.empty_cache()``.
    """
    require_model(model)
    require_bool(release_cached, "release_cached")
    compute_device = require_device(compute_device) if compute_device is not None else compute_device_of(model)
    names = require_ple(model)
    for name in names:
        install_cpu_lookup(model.get_submodule(name), compute_device)
    if compute_device.type == "cuda":
        if release_cached:
            torch.cuda.empty_cache()
        else:
            reserved = torch.cuda.memory_reserved(compute_device)
            allocated = torch.cuda.memory_allocated(compute_device)
            warnings.warn(
                f"The PLE table left the GPU, but PyTorch's caching allocator still reserves "
                f"{reserved / 1e9:.2f} GB ({allocated / 1e9:.2f} GB allocated); nvidia-smi shows the reserved "
                f"figure. Call torch.cuda.empty_cache() or offload_ple(..., release_cached=True) to return it.",
                ReservedMemoryNotice,
                stacklevel=2,
            )
    return model


def install_cpu_tower(module, compute_device) -> None:
    """Keep a tower in host memory while the conversation is text. When a picture or a sound arrives, the tower
    visits ``compute_device`` for that call where the card has room: its weights are copied over, run there with the
    kernels of a resident tower (the same bits), and dropped after, the host copy kept. Where the card has no room,
    or the tower is being trained, it runs where it waits, on the CPU (other kernels: within rounding). accelerate's
    offload hooks come off first; a text conversation never calls the tower. ``tests/gpu/test_towers_gpu.py``
    times both ways."""
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import send_to_device

    remove_hook_from_module(module, recurse=True)
    module.to("cpu")
    compute_device = torch.device(compute_device)
    run = getattr(module, "_tower_run", None) or module.forward  # the forward as loaded, whatever wraps it later

    def forward(*args, **kwargs):
        if _tower_may_visit(module, compute_device):
            try:
                with _visiting(module, compute_device):
                    output = run(*send_to_device(args, compute_device), **send_to_device(kwargs, compute_device))
                module._tower_last_run = "visit"
                return output
            except torch.OutOfMemoryError:  # less room than the budget said: free what the try took, then the CPU
                torch.cuda.empty_cache()
        module._tower_last_run = "cpu"
        return send_to_device(run(*send_to_device(args, "cpu"), **send_to_device(kwargs, "cpu")), compute_device)

    module.forward, module._tower_run = forward, run
    module._tower_compute_device, module._tower_visits, module._tower_last_run = compute_device, True, None
    for part in module.modules():
        part._in_cpu_tower = compute_device  # where its tower visits


def _tower_may_visit(module, device: torch.device) -> bool:
    """A visit needs a GPU with room for the tower's weights, and no gradient to keep (a visit's copy is dropped)."""
    if device.type != "cuda" or not module._tower_visits:
        return False
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return False
    return cards.budget_bytes(device) > sum(t.numel() * t.element_size() for t in _tensors_of(module))


def _tensors_of(module) -> list:
    return [*module.parameters(), *module.buffers()]


@contextlib.contextmanager
def _visiting(module, device: torch.device):
    """The module's weights on ``device`` within the block, its host tensors back in place after (even on error)."""
    kept = [(tensor, tensor.data) for tensor in _tensors_of(module)]
    try:
        for tensor, host in kept:
            tensor.data = host.to(device, copy=True)  # a copy even on the same device: the host's stays as it is
        yield
    finally:
        for tensor, host in kept:
            tensor.data = host


@contextlib.contextmanager
def towers_stay_in_host_memory(model, names=None):
    """Within the block, the towers that wait in host memory (``towers="cpu"``; ``names``: some of them, e.g. the
    vision tower and ``embed_vision``) run on the CPU even where the card has room for a visit: the other way to
    meet a picture, for comparing the two."""
    require_model(model)
    waiting = [name for name in tower_module_names(model) if runs_on_cpu(model.get_submodule(name))]
    names = waiting if names is None else list(names)
    for name in names:
        if name not in waiting:
            raise InvalidChoiceError(f"{name!r} is not a tower waiting in host memory; pass some of {waiting} "
                                     f"(load with towers='cpu').")
    modules = [model.get_submodule(name) for name in names]
    before = [module._tower_visits for module in modules]
    try:
        for module in modules:
            module._tower_visits = False
        yield modules
    finally:
        for module, visits in zip(modules, before):
            module._tower_visits = visits


def runs_on_cpu(module) -> bool:
    """True for a module the course serves from host memory: a table's CPU lookup or a tower run on the CPU."""
    return has_cpu_lookup(module) or getattr(module, "_tower_compute_device", None) is not None


def install_output_head(model, head: str, compute_device) -> None:
    """Untie the output head from the token table: the table stays in host memory, read in place by the GPU (or
    looked up on the CPU where it cannot be; the rows gathered are exact either way), and ``lm_head`` becomes a head
    of its own on ``compute_device``, copied from the table in bf16 (the same logits) or quantized by bitsandbytes
    to ``int8`` or ``nf4`` (a quarter to a half of the bytes, not the same logits).

    The table cannot simply stay on the CPU: Gemma 4's multimodal forward reads its pad row
    (``embed_tokens.weight[pad_token_id]``) into a ``torch.where`` with the GPU's embeddings."""
    require_model(model)
    require_choice(head, HEADS[1:], "head")
    compute_device = torch.device(compute_device)
    tables = token_table_names(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if len(tables) != 1 or output is None:
        raise InvalidChoiceError(f"head={head!r} unties a single token table from its output head, and "
                                 f"{type(model).__name__} has {len(tables)} table(s): load it with head='tied'.")
    table = model.get_submodule(tables[0])
    if not install_mapped_table(table, compute_device, ", or load with head='tied'"):
        if compute_device.type == "cuda":
            raise InvalidChoiceError(f"head={head!r} needs the GPU to read the token table in host memory in place, and "
                                     f"{torch.cuda.get_device_name(compute_device)} cannot map host pages here: load "
                                     f"with head='tied'.")
        install_cpu_lookup(table, compute_device)  # on a CPU the table is already where its rows are used
    weight = table.weight.detach()
    model.set_output_embeddings(output_head(weight, head, compute_device))
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False  # a later tie_weights() must not put the table back on the GPU


HEAD_ROWS_PER_STEP = 8192  # rows of the table quantized at a time: the bf16 table never lands on the GPU whole
HEAD_BLOCKSIZE = 64  # NF4 weights per absmax, bitsandbytes' default


def output_head(weight: torch.Tensor, head: str, device: torch.device) -> torch.nn.Module:
    """A bias-free linear head holding ``weight`` (vocabulary x hidden) on ``device`` in bf16, int8 or NF4.
    bitsandbytes quantizes a weight where it lands, so the quantized heads are built a slice of rows at a time: a
    4 GB card could not hold the bf16 table (1.3 GB for E4B) beside the model. Int8 scales each row; NF4 blocks of
    64 never span two rows when the hidden size is a multiple of 64, so the slices give the whole table's bits."""
    require_choice(head, HEADS[1:], "head")
    vocab, hidden = weight.shape
    if head == "bf16":
        layer = torch.nn.Linear(hidden, vocab, bias=False, device="meta", dtype=weight.dtype)
        layer.weight = torch.nn.Parameter(weight.to(device, copy=True), requires_grad=False)
        return layer
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    step = HEAD_ROWS_PER_STEP if hidden % HEAD_BLOCKSIZE == 0 else vocab
    if head == "int8":
        rows = torch.empty(vocab, hidden, dtype=torch.int8, device=device)
        scales = torch.empty(vocab, dtype=torch.float32, device=device)
        for start in range(0, vocab, step):
            part = weight[start:start + step].to(device, torch.float16)
            rows[start:start + step], scales[start:start + step], _ = bnb_functional.int8_vectorwise_quant(part)
        layer = bnb.nn.Linear8bitLt(hidden, vocab, bias=False, has_fp16_weights=False, device="meta")
        layer.weight = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False)
        layer.weight.CB, layer.weight.SCB = rows, scales
        return layer
    packed = torch.empty(vocab * hidden // 2, 1, dtype=torch.uint8, device=device)
    absmax = torch.empty(-(-vocab * hidden // HEAD_BLOCKSIZE), dtype=torch.float32, device=device)
    for start in range(0, vocab, step):
        part = weight[start:start + step].to(device)
        bits, state = bnb_functional.quantize_4bit(part, blocksize=HEAD_BLOCKSIZE, quant_type="nf4")
        first = start * hidden
        packed[first // 2:first // 2 + bits.shape[0]] = bits
        absmax[first // HEAD_BLOCKSIZE:first // HEAD_BLOCKSIZE + state.absmax.numel()] = state.absmax
    state = bnb_functional.QuantState(absmax=absmax, shape=torch.Size([vocab, hidden]), code=state.code,
                                      blocksize=HEAD_BLOCKSIZE, quant_type="nf4", dtype=weight.dtype)
    layer = bnb.nn.Linear4bit(hidden, vocab, bias=False, compute_dtype=weight.dtype, quant_type="nf4", device="meta")
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=HEAD_BLOCKSIZE,
                                     compress_statistics=False, quant_type="nf4", module=layer, bnb_quantized=True)
    layer.quant_state = state
    return layer


# ---------------------------------------------------------------- reports

def part_of(name: str) -> str:
    """The course's coarse part for a parameter name (decoder layers, PLE, towers, ...)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    parts = name.split(".")
    if "language_model" in parts:
        i = parts.index("language_model")
        return ".".join(parts[: i + 2])
    return ".".join(parts[:2])


def _where(module, tensor_name: str, tensor: torch.Tensor) -> str:
    hook = getattr(module, "_hf_hook", None)
    if getattr(hook, "offload", False):
        return f"cpu (offload hook: copied to {hook.execution_device} at every forward)"
    if has_cpu_lookup(module) and tensor_name == "weight":
        return f"cpu (lookup on cpu, rows to {module._ple_compute_device})"
    if getattr(module, "_mapped_to", None) is not None and tensor_name == "weight":
        return f"cpu (pinned: {module._mapped_to} reads the rows it needs in place)"
    if tensor.device.type == "cpu" and getattr(module, "_in_cpu_tower", None) is not None:
        return (f"cpu (visits {module._in_cpu_tower} for a picture or sound where the card has room, "
                f"else runs on the cpu)")
    return str(tensor.device)


def human_bytes(size: float) -> str:
    require_number(size, "size")
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


@dataclass
class PlacementReport:
    """Bytes per device for each part of a model; works whether or not ``hf_device_map`` exists."""

    model_class: str
    parts: dict = field(default_factory=dict)  # part -> {where: bytes}
    hf_device_map: dict | None = None

    def as_dict(self) -> dict:
        return {
            "model_class": self.model_class,
            "parts": {part: dict(where) for part, where in self.parts.items()},
            "bytes_by_device": self.bytes_by_device(),
            "hf_device_map": self.hf_device_map,
        }

    def bytes_by_device(self) -> dict:
        totals: dict = defaultdict(int)
        for where in self.parts.values():
            for place, size in where.items():
                totals[place.split(" ")[0]] += size
        return dict(totals)

    def device_of(self, part_suffix: str) -> set:
        return {place for part, where in self.parts.items() if part.endswith(part_suffix) for place in where}

    def __str__(self) -> str:
        width = max((len(p) for p in self.parts), default=4)
        lines = [f"{self.model_class}: where each part lives", f"{'part':<{width}}  {'size':>10}  device"]
        for part, where in self.parts.items():
            for place, size in where.items():
                lines.append(f"{part:<{width}}  {human_bytes(size):>10}  {place}")
        totals = ", ".join(f"{d}: {human_bytes(b)}" for d, b in self.bytes_by_device().items())
        lines.append(f"total by device: {totals}")
        if self.hf_device_map is None:
            lines.append("(model.hf_device_map is absent: transformers sets it only when the device map spans more than one device)")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def unique_tensors(model):
    """Each parameter and buffer once, as ``(module_name, module, tensor_name, tensor)``: tied
    weights share storage and are yielded once (on ``meta``, where there is no storage, by identity)."""
    require_model(model)
    seen: set = set()
    for module_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for tensor_name, tensor in tensors:
            if tensor is None:
                continue
            key = id(tensor) if tensor.device.type == "meta" else (tensor.device, tensor.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            yield module_name, module, tensor_name, tensor


def report(model) -> PlacementReport:
    """Where each top-level part lives, in bytes per device; tied weights are counted once."""
    require_model(model)
    parts: dict = defaultdict(lambda: defaultdict(int))
    for module_name, module, tensor_name, tensor in unique_tensors(model):
        full = f"{module_name}.{tensor_name}" if module_name else tensor_name
        size = tensor.numel() * tensor.element_size()
        hook = getattr(module, "_hf_hook", None)
        if tensor.device.type == "meta" and getattr(hook, "offload", False):
            stored = hook.weights_map.get(tensor_name) if hook.weights_map is not None else None
            if stored is not None:
                size = stored.numel() * stored.element_size()
        parts[part_of(full)][_where(module, tensor_name, tensor)] += size
    return PlacementReport(
        model_class=type(model).__name__,
        parts={p: dict(w) for p, w in parts.items()},
        hf_device_map=getattr(model, "hf_device_map", None),
    )
