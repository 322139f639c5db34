"""Greedy decoding without the CPU in the way, and a profile that shows why plain decoding is slow.

At batch 1, plain ``generate`` launches thousands of small kernels per token from Python and the GPU waits for the
CPU (notebook 09 prints the profile). ``TunedGreedy`` removes the wait with transformers' and PyTorch's own parts:
accelerate's hooks taken off once placement is fixed (each is a graph break), a ``StaticCache`` (fixed addresses a
graph can replay), and the step captured once per phase as a ``torch.cuda.CUDAGraph`` (``StepGraphs``) and replayed:
the same kernels, so the same bits. Sliding-window counters are pinned around the step so that a graph is not
recorded per token, and the PLE rows and masks are prepared outside it; ``PLE_OPTIONS`` lists ways to avoid even that.
``Decoder(host_free=True)`` takes one: the step reads its own token, gathers its rows from tables the GPU reads in
place, writes its successor and advances its own position, from which it makes its masks on the device; the host
only queues replays and never waits inside the loop.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from . import exact_cache, exact_layer, exact_nf4, exact_norm, exact_rotary, placement
from .errors import InvalidChoiceError, NoRecordError, RecordFileError, TunedDecodeError, require_bool, require_choice, require_whole_number
from .long_context import cache_argument, new_cache, require_prompt
from .noise import CPU_ENTRY_IN_MAP, HOOKED_RECOMPILES, PROFILER_MARKS, PROFILER_ONE_CYCLE, native_lines_dropped, silenced
from .quantization import QUANTS, quant_of
from .weights import meta_model

COMPILE_MODES = (None, "eager", "cudagraphs", "reduce-overhead", "inductor")
# eager: Dynamo traces the step (graph breaks show) but runs the same kernels, for the CPU;
# cudagraphs: the eager step captured in a torch.cuda.CUDAGraph (no compiler; on a CPU the same static buffers,
# run eagerly); reduce-overhead: Inductor's fused kernels in CUDA graphs;
# inductor: Inductor's fused kernels captured in this module's own CUDA graphs, as cudagraphs captures the eager
# ones (the one compiler the host-free step takes: its token, rows and masks are traced with it)
CAPTURED = ("cudagraphs", "inductor")  # the modes StepGraphs captures
# the Decoder settings that swap in exact kernels
FUSIONS = ("fused_norms", "fused_rotary", "fused_layers", "fused_activations", "fused_gemv", "fused_cache")

PLE_OPTIONS = {
    "host lookup per token (this module)":
        "argmax on the GPU, the id to the host (one device-to-host sync per token), the rows gathered on the CPU into "
        "pinned memory and copied without blocking into the input the graph reads: `rows = table.index_select(0, "
        "ids_cpu); gpu_rows.copy_(rows.pin_memory(), non_blocking=True)`",
    "zero-copy gather from pinned host memory (Decoder(host_free=True))":
        "the whole table pinned once is addressable by GPU kernels across the bus (CUDA's unified addressing), so "
        "torch's own embedding kernel reads one token's rows through a CUDA view of the pinned pages "
        "(placement.mapped_view) without the id leaving the GPU; the whole table stays locked in host memory",
    "prefetch the next rows":
        "overlap the host lookup of step t+1 with work of step t that does not need its rows: every layer needs "
        "them, so only the copy can overlap, not the sync",
    "keep the table on the GPU":
        "no host trip at all, at the table's full size in GPU memory (notebook 04 sizes it): what an 8 GB card "
        "cannot afford with E4B",
}


@dataclass(frozen=True)
class Decoder:
    """Settings of the tuned greedy decode. ``Decoder()`` replays the eager kernels of each step from a CUDA graph
    (the same logits as ``generate`` with a static cache); ``Decoder(compile="reduce-overhead")`` fuses them with
    Inductor; ``Decoder(compile=None)`` runs the same loop eagerly; ``Decoder(compile="eager")`` traces it with
    Dynamo on any device (the CPU tests)."""

    compile: str | None = "cudagraphs"
    remove_hooks: bool = True
    ple_outside: bool = True  # the PLE rows computed outside the compiled step
    fullgraph: bool = True  # a graph break is an error, not a silent slowdown
    chunk: int | None = None  # prefill chunk (None: one forward)
    host_free: bool = False  # the token, its rows, positions and masks stay on the GPU: the host never waits
    fused_norms: bool = False  # each RMSNorm of a decode step in one kernel that sums as ATen does (exact_norm)
    fused_rotary: bool = False  # each rotary embedding of a decode step in one kernel that rounds as ATen does
    fused_layers: bool = False  # each decoder layer's norm-and-residual ends in one kernel each (exact_layer)
    fused_activations: bool = False  # and each gelu with the product after it (needs fused_layers)
    fused_gemv: bool = False  # each NF4 projection in a kernel that sums as bitsandbytes' does, siblings joined (exact_nf4)
    fused_cache: bool = False  # each cache layer's write of the token and its counter in one kernel (exact_cache)

    def __post_init__(self):
        if self.compile not in COMPILE_MODES:
            require_choice(self.compile, [m for m in COMPILE_MODES if m], "compile")
        for name in ("remove_hooks", "ple_outside", "fullgraph", "host_free", *FUSIONS):
            require_bool(getattr(self, name), name)
        if self.chunk is not None:
            require_whole_number(self.chunk, "chunk", unit="tokens")
        if self.host_free and (self.compile not in (None, *CAPTURED) or not self.ple_outside):
            raise InvalidChoiceError(f"Decoder(host_free=True) runs the step eagerly or in the course's own CUDA graph "
                                     f"with the rows gathered from the step's own token: leave "
                                     f"compile={self.compile!r} and ple_outside={self.ple_outside!r} at their defaults "
                                     f"(or compile=None, or compile='inductor' for Inductor's kernels in that graph).")
        fused = next((name for name in FUSIONS if getattr(self, name)), None)
        if fused and self.compile not in (None, "cudagraphs"):
            raise InvalidChoiceError(f"Decoder({fused}=True) replays its own kernels eagerly or in a CUDA graph; "
                                     f"a compiler would trace them again: leave compile={self.compile!r} out "
                                     f"(or pass compile=None).")
        if self.fused_activations and not self.fused_layers:
            raise InvalidChoiceError("Decoder(fused_activations=True) joins each gelu inside the rewired decoder layer: "
                                     "pass fused_layers=True too.")

    def check_quant(self, quant: str) -> None:
        """Refuse, before anything is loaded, a quantization these settings cannot decode: bitsandbytes' int8 layers
        pick their outlier columns on the host at every step (``if outliers.any()`` in its ``int8_vectorwise_quant``,
        0.50), which neither a CUDA graph nor a full Dynamo graph can hold."""
        require_choice(quant, QUANTS, "quant")
        if quant == "int8" and self.compile is not None:
            raise TunedDecodeError(f"Decoder(compile={self.compile!r}) cannot run bitsandbytes' int8 layers: they decide on "
                                   f"the host at every step which columns are outliers, which a compiled or captured step "
                                   f"cannot hold; load with quant='nf4', or pass Decoder(compile=None).")

    def label(self) -> str:
        return f"compile={self.compile or 'none'}, hooks {'removed' if self.remove_hooks else 'kept'}, " \
               f"PLE {'outside' if self.ple_outside else 'inside'} the step" + (", host-free" if self.host_free else "") \
               + "".join(f", {name.replace('_', ' ')}" for name in FUSIONS if getattr(self, name))


# --------------------------------------------------------------------------- accelerate's hooks

def hooked_modules(model) -> list:
    """Names of the modules accelerate has wrapped (``_hf_hook``)."""
    placement.require_model(model)
    return [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")]


def hooks_break_graphs() -> bool:
    """Whether the installed accelerate's ``AlignDevicesHook`` is a graph break for ``torch.compile``: up to
    1.15 its ``pre_forward`` and ``post_forward`` are wrapped in ``torch.compiler.disable``; from 1.16 only its
    offloading steps are, so Dynamo traces through a hook that offloads nothing (it still runs in eager mode)."""
    from accelerate.hooks import AlignDevicesHook

    return hasattr(AlignDevicesHook.pre_forward, "__wrapped__")  # the wrapper of accelerate's _compiler_disable


def attach_placement_hooks(model):
    """Attach the hooks ``from_pretrained`` attaches on a GPU with the course's per-module map (accelerate's
    ``dispatch_model`` with the model's ``_skip_keys_device_placement``, as transformers'
    ``accelerate_dispatch`` calls it), here on whatever device the model is on: on a CPU-only machine
    transformers attaches none, so this shows the GPU's structure on the tiny model."""
    placement.require_model(model)
    from accelerate import dispatch_model

    if getattr(model, "hf_quantizer", None) is not None:
        raise TunedDecodeError("Hooks attached after loading would make accelerate move bitsandbytes' packed weights again "
                          "(and quantize them twice): load with quant='bf16' to see the hooks on the CPU.")
    device = placement.compute_device_of(model)
    device_map = placement.ple_device_map(meta_model(model.config), device.index if device.type == "cuda" else "cpu")
    table = model.get_submodule(placement.require_ple(model)[0])
    keeps_lookup = placement.has_cpu_lookup(table)
    with silenced(CPU_ENTRY_IN_MAP):  # nothing is offloaded: the "cpu" entry is the PLE table, served by its lookup
        dispatch_model(model, device_map=device_map, skip_keys=model._skip_keys_device_placement, force_hooks=True)
    if keeps_lookup:  # dispatch_model wrapped the table's forward again: take that hook off, as the loader does
        from accelerate.hooks import remove_hook_from_module

        for name in placement.ple_module_names(model):
            remove_hook_from_module(model.get_submodule(name))
    return model


def check_single_device(model) -> torch.device:
    """The one device every weight but the PLE table is on; a CourseError naming the fix otherwise (weights
    accelerate offloads, weights on several devices, a PLE table on the CPU that only its hook serves)."""
    placement.require_model(model)
    offloaded = [name for name, module in model.named_modules() if getattr(getattr(module, "_hf_hook", None), "offload", False)]
    if offloaded:
        raise TunedDecodeError(f"accelerate offloads {offloaded[0]!r} (its weights live on 'meta' and its hook copies them "
                          f"in at every forward): removing the hooks would break it; load with "
                          f"loading.load_model(..., ple='cpu'), which keeps every other weight on the GPU.")
    tables = set(placement.ple_module_names(model))
    served = placement.served_from_host(model)
    devices, table_devices = set(), {}
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in tables:
            table_devices[module] = param.device
        elif not placement.within(module, served):
            devices.add(param.device)
    if len(devices) != 1:
        raise TunedDecodeError(f"The model's weights are spread over {sorted(map(str, devices))}: the hooks move them at "
                          f"every forward and cannot be removed; load everything but the PLE table on one GPU "
                          f"(loading.load_model(..., ple='cpu')).")
    device = devices.pop()
    for module, where in table_devices.items():
        if where != device and not placement.has_cpu_lookup(model.get_submodule(module)):
            raise TunedDecodeError(f"The PLE table {module!r} is on {where} without the course's lookup, so only accelerate's "
                              f"hook brings it to {device}: call placement.offload_ple(model) first, or load with "
                              f"loading.load_model(..., ple='cpu').")
    return device


def remove_hooks(model) -> int:
    """Take accelerate's hooks off every module once placement is fixed (checked by ``check_single_device``);
    the course's PLE lookup stays. Returns how many modules had one."""
    from accelerate.hooks import remove_hook_from_module

    check_single_device(model)
    hooked = len(hooked_modules(model))
    remove_hook_from_module(model, recurse=True)
    return hooked


# --------------------------------------------------------------------------- the tuned greedy loop

def language_model(model):
    """The text decoder (``Gemma4TextModel``) that computes the per-layer inputs."""
    placement.require_model(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model.language_model
    return getattr(decoder, "language_model", decoder)


def text_ids(model, ids: torch.Tensor) -> torch.Tensor:
    """The ids the model's own forward looks up for ``ids``: ``Gemma4Model.forward`` (5.5.2 to 5.24) takes the image,
    audio and video placeholders, found by its ``get_placeholder_mask``, as the text config's pad token."""
    placement.require_model(model)
    base = getattr(model, "model", None)
    if not hasattr(base, "get_placeholder_mask"):
        return ids  # a text-only model looks up the ids as they are
    image, video, audio = base.get_placeholder_mask(input_ids=ids)
    return torch.where(image | video | audio, model.config.get_text_config().pad_token_id, ids)


def text_inputs(model, ids: torch.Tensor) -> dict:
    """``inputs_embeds`` and ``per_layer_inputs`` of ``ids`` as the model's own forward computes them from
    ``input_ids`` (placeholders as the pad token), for a step that takes them from outside."""
    ids = text_ids(model, ids)
    embeds = model.get_input_embeddings()(ids)
    return {"inputs_embeds": embeds, "per_layer_inputs": language_model(model).get_per_layer_inputs(ids, embeds)}


def supports_ple_outside(model) -> bool:
    """Whether this transformers release lets the multimodal model take ``per_layer_inputs`` (5.17 and
    later here; 5.5.2's ``Gemma4ForConditionalGeneration.forward`` has no such argument)."""
    placement.require_model(model)
    return "per_layer_inputs" in inspect.signature(model.forward).parameters


@dataclass
class GreedyRun:
    tokens: list
    logits: torch.Tensor | None  # (steps, vocabulary) float32 on the CPU: the raw logits of each step
    prefill_s: float
    decode_s: float  # the new tokens after the first (each one a decode step)
    compiled_graphs: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s else float("nan")


def synchronize(device) -> None:
    """Wait for the GPU (a no-op on the CPU): timings must include the kernels they started."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class HostReads:
    """What ``count_host_reads`` counted: tensor values read into Python, each a wait for the device."""
    reads: int = 0


HOST_READS = ("item", "__bool__", "__int__", "__float__", "tolist")


@contextlib.contextmanager
def count_host_reads():
    """Count, inside the block, every tensor value read into Python (``item``, ``bool``, ``int``, ``float``,
    ``tolist``): on a GPU each one makes the host wait until the device has computed it."""
    counter = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(original):
        def read(self, *args, **kwargs):
            counter.reads += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def pinned_sliding_counters(cache, new_tokens: int = 1):
    """While one decode step runs, show each ``StaticSlidingWindowLayer`` a counter that selects the branch its
    real count selects (``update`` reads it only for ``is_full``; positions come from its tensor counter), so
    the compiled step sees constants; afterwards the real count, advanced by ``new_tokens``."""
    if not isinstance(getattr(cache, "layers", None), list):
        raise InvalidChoiceError(f"cache={type(cache).__name__} is not a transformers cache; pass the StaticCache "
                                 f"the decode runs with (long_context.new_cache(model, 'static', length)).")
    new_tokens = require_whole_number(new_tokens, "new_tokens", minimum=0, unit="tokens")
    layers = [layer for layer in cache.layers if hasattr(layer, "cumulative_length_int")]
    real = [layer.cumulative_length_int for layer in layers]
    for layer, count in zip(layers, real):
        layer.cumulative_length_int = layer.max_cache_len if count >= layer.max_cache_len else 0
    try:
        yield
    finally:
        for layer, count in zip(layers, real):
            layer.cumulative_length_int = count + new_tokens


class FullWindowIndexedLayer(StaticSlidingWindowLayer):
    """``StaticSlidingWindowLayer`` whose one-token update of a full window indexes with a tensor made once: the
    library's ``update`` makes ``torch.tensor([-1], device=...)`` there at every token (transformers 5.5.2, 5.17.0
    and 5.24.0), a copy from the host that a CUDA graph cannot capture. The same operations otherwise, so the same
    bits (``tests/test_decoding.py``)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not (self.is_initialized and key_states.shape[-2] == 1 and self.cumulative_length_int >= self.max_cache_len):
            return super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length_int += 1
        new_keys, new_values = self.keys.roll(-1, dims=-2), self.values.roll(-1, dims=-2)
        new_keys[:, :, self.last_index] = key_states
        new_values[:, :, self.last_index] = value_states
        self.keys.copy_(new_keys)  # in place: the captured graph keeps these addresses
        self.values.copy_(new_values)
        return self.keys, self.values


def index_full_windows_once(cache) -> int:
    """Make the initialised sliding layers of ``cache`` ``FullWindowIndexedLayer``s (their index on their device);
    how many were changed."""
    changed = 0
    for layer in cache.layers:
        if type(layer) is StaticSlidingWindowLayer and layer.is_initialized:
            _index_full_window(layer, FullWindowIndexedLayer)
            changed += 1
    return changed


def _index_full_window(layer, cls: type) -> None:
    """Make an initialised sliding layer a ``cls`` (a ``FullWindowIndexedLayer``) with its index on its device."""
    if not hasattr(layer, "last_index"):
        layer.last_index = torch.tensor([-1], dtype=torch.long, device=layer.device)
    layer.__class__ = cls


def _one_launch(base: type) -> type:
    """``base`` whose one-token update is ``exact_cache.write_token``'s one launch where it can take it (the library's
    five kernels otherwise): the same copies and the same counters, so the same bits."""

    class OneLaunch(base):
        def update(self, key_states, value_states, *args, **kwargs):
            if not exact_cache.writable(self, key_states, value_states):
                return super().update(key_states, value_states, *args, **kwargs)
            if hasattr(self, "cumulative_length_int"):
                self.cumulative_length_int += 1  # the sliding layer's int, as its own update counts
            exact_cache.write_token(self.keys, self.values, key_states, value_states, self.cumulative_length)
            return self.keys, self.values

    OneLaunch.__name__ = OneLaunch.__qualname__ = f"OneLaunch{base.__name__}"
    return OneLaunch


OneLaunchStaticLayer = _one_launch(StaticLayer)
OneLaunchSlidingLayer = _one_launch(FullWindowIndexedLayer)
ONE_LAUNCH_LAYERS = (OneLaunchStaticLayer, OneLaunchSlidingLayer)


def write_tokens_in_one_launch(cache) -> int:
    """Make the initialised static layers of ``cache`` write a decode token in one launch (``ONE_LAUNCH_LAYERS``); a
    sliding layer also indexes its full window with a tensor made once, as ``index_full_windows_once`` does. How
    many were changed."""
    if not isinstance(getattr(cache, "layers", None), list):
        raise InvalidChoiceError(f"cache={type(cache).__name__} is not a transformers cache; pass the StaticCache the "
                                 f"decode runs with (long_context.new_cache(model, 'static', length)).")
    changed = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or not isinstance(getattr(layer, "cumulative_length", None),
                                                                         torch.Tensor):
            continue
        if type(layer) is StaticLayer:
            layer.__class__ = OneLaunchStaticLayer
        elif type(layer) in (StaticSlidingWindowLayer, FullWindowIndexedLayer):
            _index_full_window(layer, OneLaunchSlidingLayer)
        else:
            continue
        changed += 1
    return changed


def _tensors(inputs: dict, prefix: tuple = ()):
    for name, value in inputs.items():
        if isinstance(value, dict):
            yield from _tensors(value, prefix + (name,))
        elif isinstance(value, torch.Tensor):
            yield prefix + (name,), value


def _static_copy(inputs: dict) -> dict:
    return {name: _static_copy(value) if isinstance(value, dict) else value.clone() if isinstance(value, torch.Tensor)
            else value for name, value in inputs.items()}


def _at(inputs: dict, path: tuple):
    for name in path:
        inputs = inputs[name]
    return inputs


class StepGraphs:
    """One decode step of ``forward`` in a CUDA graph per phase. A phase is what changes the kernels a step runs:
    whether the sliding windows are full, and the shapes of the inputs (the masks). Its first step runs eagerly
    (which also warms up what a capture needs, on a side stream as PyTorch's CUDA-graph notes ask), then the
    step is captured into a graph that reads static copies of the inputs; later steps copy their inputs into
    those buffers and replay. On a CPU nothing is captured: later steps run ``forward`` on the same static
    buffers, so the CPU tests check that every input really goes through them."""

    # Capture on the stream the first step warmed up: what a library sets up lazily for each stream (cuBLAS keeps a
    # workspace per stream) then exists before the capture. On a stream of its own (torch.cuda.graph's default), the
    # first capture of bf16 layers in a process failed ("operation failed due to a previous error during capture").
    capture_on_warmup_stream = True

    def __init__(self, forward, device):
        self.forward, self.device = forward, torch.device(device)
        self.capture = self.device.type == "cuda"
        self.phases: dict = {}  # phase -> (graph or None, static inputs, static logits or None)
        self.captured = self.replayed = 0
        self._pool = None
        self._stream = torch.cuda.Stream(self.device) if self.capture else None

    def phase(self, cache, inputs: dict) -> tuple:
        full = tuple(layer.cumulative_length_int >= layer.max_cache_len for layer in cache.layers
                     if hasattr(layer, "cumulative_length_int"))
        shapes = tuple((path, tuple(t.shape), t.dtype) for path, t in _tensors(inputs))
        masks = inputs.get("attention_mask")
        absent = tuple(sorted(name for name, mask in masks.items() if mask is None)) if isinstance(masks, dict) else ()
        return id(cache), full, shapes, absent

    def __call__(self, cache, inputs: dict) -> torch.Tensor:
        """The step's last logits (a copy: a replay overwrites the graph's output)."""
        phase = self.phase(cache, inputs)
        if phase not in self.phases:
            return self._first(phase, cache, inputs)
        graph, static, logits = self.phases[phase]
        for path, tensor in _tensors(inputs):
            _at(static, path).copy_(tensor)
        with pinned_sliding_counters(cache):
            if graph is None:
                logits = self.forward(**static).logits
            else:
                graph.replay()
        self.replayed += 1
        return logits[:, -1].clone()

    def _first(self, phase, cache, inputs: dict) -> torch.Tensor:
        index_full_windows_once(cache)
        static = _static_copy(inputs)
        if not self.capture:
            with pinned_sliding_counters(cache):
                out = self.forward(**inputs).logits[:, -1].clone()
            self.phases[phase] = (None, static, None)
            return out
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), pinned_sliding_counters(cache):
            out = self.forward(**inputs).logits[:, -1].clone()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        on = {"stream": side} if self.capture_on_warmup_stream else {}
        try:
            with pinned_sliding_counters(cache, new_tokens=0), torch.cuda.graph(graph, pool=self._pool, **on):
                logits = self.forward(**static).logits  # recorded, not run: the cache is not written twice
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TunedDecodeError(f"The decode step could not be captured in a CUDA graph ({first}): something in the "
                                   f"forward waits for the host; decode with decoding.Decoder(compile=None).") from error
        self._pool = self._pool or graph.pool()
        self.phases[phase] = (graph, static, logits)
        self.captured += 1
        return out


class TunedGreedy:
    """Greedy decoding with a ``Decoder``'s settings on a loaded model: the same tokens and raw logits as
    ``generate(..., do_sample=False, min_new_tokens=n)`` with a ``StaticCache`` (``tests/test_decoding.py``)."""

    def __init__(self, model, settings: Decoder = Decoder()):
        if not isinstance(settings, Decoder):
            raise InvalidChoiceError(f"settings={settings!r} is not a Decoder; pass decoding.Decoder(...).")
        settings.check_quant(quant_of(model))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if settings.compile is not None and head is not None and quant_of(head) == "int8":
            raise TunedDecodeError(f"Decoder(compile={settings.compile!r}) cannot run an int8 output head: bitsandbytes "
                                   f"decides on the host at every step which columns are outliers; load with "
                                   f"head='nf4' or head='bf16', or pass Decoder(compile=None).")
        if settings.ple_outside and not supports_ple_outside(model):
            import transformers

            raise TunedDecodeError(f"transformers {transformers.__version__} cannot take the PLE rows from outside the model "
                              f"(Gemma4ForConditionalGeneration.forward has no per_layer_inputs): upgrade transformers "
                              f"(5.17 or later), or pass Decoder(ple_outside=False).")
        self.model, self.settings = model, settings
        self.hooks_removed = remove_hooks(model) if settings.remove_hooks else 0
        self.device = placement.compute_device_of(model)
        eos = model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.cache_name = cache_argument(model)
        self.step_forward = model.forward if settings.compile in CAPTURED else self._compiled(model.forward)
        self.mapped_tables = []
        if settings.host_free:
            self.mapped_tables = placement.map_host_tables(model)
            looked_up = [name for name, module in model.named_modules() if placement.has_cpu_lookup(module)]
            if looked_up and self.device.type == "cuda":
                raise TunedDecodeError(f"Decoder(host_free=True) needs the GPU to read {looked_up[0]!r} in place, and it "
                                       f"cannot map that table's host pages here: decode with Decoder().")
            self.eos_index = torch.tensor(self.eos, dtype=torch.long, device=self.device)
            self.next_token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            self.position = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            self._aranges, self._mask_aranges = {}, {}
            self._mask_values = self._additive_mask_values()  # kept for good, as the aranges: a graph holds them
        self.fused_norms = None
        fused = [name for name in FUSIONS if getattr(settings, name)]
        if fused and self.device.type == "cuda" and not exact_norm.triton_available():
            raise TunedDecodeError(f"Decoder({fused[0]}=True) needs triton, which PyTorch's CUDA wheels bring: install "
                                   f"the CUDA build of torch, or leave {fused[0]} out.")
        if settings.fused_norms:
            self.fused_norms = exact_norm.fuse_norms(model)  # the fp32 weights cast once, kept for every capture
            self.fused_norms.restore()  # put in only around the decode loop: the prefill and generate keep theirs
        self.fused_rotary = None
        if settings.fused_rotary:
            self.fused_rotary = exact_rotary.fuse_rotary()  # swapped in only around the decode loop, as the norms
        self.fused_layers = None
        if settings.fused_layers:
            self.fused_layers = exact_layer.fuse_layers(model, settings.fused_activations)  # likewise
            self.fused_layers.restore()
        self.fused_gemv = None
        if settings.fused_gemv:
            self.fused_gemv = exact_nf4.fuse_gemv(model)  # likewise
            self.fused_gemv.restore()
        forward = self._host_free_forward if settings.host_free else model.forward
        if settings.compile == "inductor":
            forward = self._compiled(forward)  # the whole step, the host-free pieces too, then captured as it is
        self.graphs = StepGraphs(forward, self.device) if settings.compile in CAPTURED else None
        self._cache, self._cache_len = None, None

    def _compiled(self, forward):
        mode = self.settings.compile
        if mode in (None, "cudagraphs"):  # cudagraphs: StepGraphs captures the eager forward, no compiler
            return forward
        # dynamic=False: a changed int is a new constant, not a symbolic input (two pinned values: two graphs)
        options = {"fullgraph": self.settings.fullgraph, "dynamic": False}
        if mode == "reduce-overhead":
            return torch.compile(forward, mode="reduce-overhead", **options)
        return torch.compile(forward, backend=mode, **options)  # eager, or inductor (no CUDA graphs of its own)

    def cache(self, length: int):
        """One static cache per length, reset in place between runs: a captured graph keeps its addresses."""
        if self._cache is None or self._cache_len != length:
            self._cache, self._cache_len = new_cache(self.model, "static", length), length
        else:
            self._cache.reset()
        return self._cache

    def _next_token(self, logits: torch.Tensor) -> torch.Tensor:
        chosen = logits.clone()
        chosen[:, self.eos] = -float("inf")  # as min_new_tokens does: exactly n tokens, never an early stop
        return chosen.argmax(-1, keepdim=True)

    def _prefill(self, ids, cache) -> torch.Tensor:
        chunk = self.settings.chunk or ids.shape[1]
        for start in range(0, ids.shape[1], chunk):
            out = self.model(input_ids=ids[:, start:start + chunk], use_cache=True, logits_to_keep=1,
                             **{self.cache_name: cache})
        return out.logits[:, -1].clone()

    def _step(self, token, position: int, mask_2d, cache) -> torch.Tensor:
        positions = torch.tensor([[position]], device=self.device)
        inputs = {"attention_mask": self.model.create_masks_for_generate(
            self.model.config, torch.empty((1, 1, 0), dtype=self.model.dtype, device=self.device),
            mask_2d[:, :position + 1], cache, positions)}
        if self.settings.ple_outside:
            inputs.update(text_inputs(self.model, token))
        else:
            inputs["input_ids"] = token
        inputs.update(position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_name: cache})
        if self.graphs is not None:
            return self.graphs(cache, inputs)
        if self.settings.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with pinned_sliding_counters(cache):
            out = self.step_forward(**inputs)
        return out.logits[:, -1].clone()  # a CUDA graph's output is overwritten by its next replay

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """``_next_token`` with the stop ids as a tensor made once: no list copied from the host inside a graph."""
        return logits.clone().index_fill_(-1, self.eos_index, -float("inf")).argmax(-1, keepdim=True)

    def _host_free_forward(self, **inputs):
        """One step from the token the previous step chose, in place: its rows gathered on the GPU, its masks made
        from its position (``_graph_masks``) unless they are passed, its successor written into ``next_token`` and
        its position advanced for the next step (a captured graph reads and writes the same addresses each replay)."""
        if "attention_mask" not in inputs:
            inputs["attention_mask"] = self._graph_masks()
        out = self.model(**text_inputs(self.model, self.next_token), position_ids=self.position, **inputs)
        self.next_token.copy_(self._pick(out.logits[:, -1]))
        self.position.add_(1)
        return out

    def _graph_masks(self) -> dict:
        """Each attention mask of the step from ``position`` on the device: ``arange(size) <= position`` (keys up to
        the step's own), the rule ``_mask_sizes`` checked against transformers' masks before the loop. For sdpa, the
        additive mask sdpa would make of it in every layer (``where(mask, 0, -inf)`` in the query's dtype, three
        kernels a layer), made once per mask: the attention kernels read the same values."""
        masks = {name: None if arange is None else arange <= self.position.view(1, 1, 1, 1)
                 for name, arange in self._mask_aranges.items()}
        if self._mask_values is None:
            return masks
        return {name: None if mask is None else torch.where(mask, *self._mask_values) for name, mask in masks.items()}

    def _additive_mask_values(self) -> tuple | None:
        """(0, -inf) in the query's dtype where the attention is sdpa, which turns a boolean mask into them; None
        for any other attention (eager takes transformers' own masks, flash none)."""
        if getattr(self.model.config.get_text_config(), "_attn_implementation", None) != "sdpa":
            return None
        dtype = self.model.get_input_embeddings().weight.dtype
        return (torch.zeros((), dtype=dtype, device=self.device),
                torch.full((), float("-inf"), dtype=dtype, device=self.device))

    def _masks_at(self, cache, mask_2d, steps, start: int) -> list:
        """transformers' masks of the decode steps ``steps`` (0: the step at position ``start``), made on the host
        with the cache's counters (the layers' ``cumulative_length`` tensors and the sliding layers' ints, all the
        masks read) as they will stand at that step; the counters are put back after."""
        counters = [(layer, name, getattr(layer, name)) for layer in cache.layers
                    for name in ("cumulative_length", "cumulative_length_int") if hasattr(layer, name)]
        empty = torch.empty((1, 1, 0), dtype=self.model.dtype, device=self.device)
        masks = []
        try:
            for step in steps:
                for layer, name, count in counters:
                    setattr(layer, name, count + step)  # a new tensor for a tensor counter: the original stays as is
                position = torch.full((1, 1), start + step, dtype=torch.long, device=self.device)
                masks.append(self.model.create_masks_for_generate(self.model.config, empty,
                                                                  mask_2d[:, :start + step + 1], cache, position))
        finally:
            for layer, name, count in counters:
                setattr(layer, name, count)
        return masks

    def _masks_ahead(self, cache, mask_2d, positions: list, start: int) -> list:
        """The masks of every decode step, made before the loop (transformers reads its masks on the host,
        ``padding_mask.all()``, a wait per token inside it): where ``_mask_sizes`` finds no rule for them."""
        return self._masks_at(cache, mask_2d, range(len(positions)), start)

    def _mask_sizes(self, cache, mask_2d, start: int, new_tokens: int) -> dict | None:
        """``{mask name: its size}`` (``None`` for a mask transformers leaves out) when each of transformers' masks
        is ``arange(size) <= position``, checked at the steps where it could turn: the first two, those around
        each size (a sliding window filling) and the last; ``None`` when a mask follows another rule (other
        attention, padding), and the masks are made ahead instead."""
        if new_tokens < 2:
            return {}
        first = self._masks_at(cache, mask_2d, [0], start)[0]
        if not isinstance(first, dict):
            return None
        sizes = {}
        for name, mask in first.items():
            if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[:3]) != (1, 1, 1)):
                return None
            sizes[name] = None if mask is None else mask.shape[-1]
        turns = {0, 1, new_tokens - 2} | {size - start + d for size in sizes.values() if size for d in (-2, -1, 0)}
        steps = sorted(step for step in turns if 0 <= step < new_tokens - 1)
        for step, masks in zip(steps, self._masks_at(cache, mask_2d, steps, start)):
            if not isinstance(masks, dict) or masks.keys() != sizes.keys():
                return None
            for name, mask in masks.items():
                rule = None if sizes[name] is None else torch.arange(sizes[name], device=self.device) <= start + step
                if (mask is None) != (rule is None) or (rule is not None and not torch.equal(mask.flatten(), rule)):
                    return None
        return sizes

    def _decode_host_free(self, logits, start: int, new_tokens: int, keep_logits: bool, cache, mask_2d) -> tuple:
        """The decode loop of ``Decoder(host_free=True)`` after the prefill's ``logits``: (tokens, kept logits). The
        host only queues: each step's token, position and masks are made on the device by the step before."""
        produced = torch.zeros(new_tokens, dtype=torch.long, device=self.device)
        vocabulary = self.model.get_output_embeddings().out_features
        kept = torch.empty((new_tokens, vocabulary), dtype=torch.float32,
                           pin_memory=self.device.type == "cuda") if keep_logits else None
        sizes = self._mask_sizes(cache, mask_2d, start, new_tokens)
        masks = None
        if sizes is None:
            masks = self._masks_ahead(cache, mask_2d, list(range(new_tokens - 1)), start)
        else:  # one arange per mask, kept for good: a captured graph holds its address
            self._mask_aranges = {name: None if size is None else self._aranges.setdefault(
                size, torch.arange(size, device=self.device).view(1, 1, 1, size)) for name, size in sizes.items()}
        self.position.fill_(start)
        self.next_token.copy_(self._pick(logits))
        for step in range(new_tokens):
            produced[step:step + 1].copy_(self.next_token[0])
            if keep_logits:
                kept[step].copy_(logits[0].float(), non_blocking=True)
            if step + 1 < new_tokens:
                inputs = {"use_cache": True, "logits_to_keep": 1, self.cache_name: cache}
                if masks is not None:
                    inputs["attention_mask"] = masks[step]
                if self.graphs is not None:
                    logits = self.graphs(cache, inputs)
                else:
                    with pinned_sliding_counters(cache):
                        logits = self._host_free_forward(**inputs).logits[:, -1].clone()
        return produced.tolist(), kept  # tolist waits for the stream, so the kept logits' copies are done too

    def _decode(self, logits, start: int, new_tokens: int, keep_logits: bool, cache, mask_2d) -> tuple:
        """The decode loop after the prefill's ``logits``, each token read on the host: (tokens, kept logits)."""
        tokens, kept = [], []
        for step in range(new_tokens):
            if keep_logits:
                kept.append(logits[0].float().cpu())
            token = self._next_token(logits)
            tokens.append(int(token))  # the host needs it anyway for the PLE lookup
            if step + 1 < new_tokens:
                logits = self._step(token, start + step, mask_2d, cache)
        return tokens, torch.stack(kept) if keep_logits else None

    def greedy(self, ids: torch.Tensor, new_tokens: int, *, keep_logits: bool = False,
               cache_length: int | None = None) -> GreedyRun:
        """Exactly ``new_tokens`` greedy tokens after ``ids`` (batch 1). ``cache_length``: the static cache's length
        (default: prompt and new tokens), for a short run on the cache, and so the graphs, of a longer one; a
        different length changes the padded attention, so logits are compared only at the same length."""
        require_bool(keep_logits, "keep_logits")
        new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
        ids = require_prompt(self.model, ids).to(self.device)
        require_whole_number(ids.shape[1] + new_tokens - 1, "the prompt and new tokens",
                             maximum=self.model.config.get_text_config().max_position_embeddings,
                             maximum_is="the model's max_position_embeddings")
        total = ids.shape[1] + new_tokens
        if cache_length is not None and require_whole_number(cache_length, "cache_length", unit="tokens") < total:
            raise InvalidChoiceError(f"cache_length={cache_length} cannot hold the prompt and the new tokens ({total}): "
                                     f"pass at least {total}, or leave it out.")
        total = cache_length or total
        cache = self.cache(total)
        mask_2d = torch.ones((1, total), dtype=torch.long, device=self.device)
        decode = self._decode_host_free if self.settings.host_free else self._decode
        with torch.no_grad():
            synchronize(self.device)
            began = time.perf_counter()
            logits = self._prefill(ids, cache)
            if self.settings.fused_cache:
                write_tokens_in_one_launch(cache)  # the prefill wrote with the library's update; each step in one launch
            synchronize(self.device)
            prefilled = time.perf_counter()
            norms = self.fused_norms.installed() if self.fused_norms else contextlib.nullcontext()
            rotary = self.fused_rotary.installed() if self.fused_rotary else contextlib.nullcontext()
            layers = self.fused_layers.installed() if self.fused_layers else contextlib.nullcontext()
            gemv = self.fused_gemv.installed() if self.fused_gemv else contextlib.nullcontext()
            with torch.profiler.record_function(decode_range(new_tokens - 1)), norms, rotary, layers, gemv:
                tokens, kept = decode(logits, ids.shape[1], new_tokens, keep_logits, cache, mask_2d)
            synchronize(self.device)
            done = time.perf_counter()
        return GreedyRun(tokens, kept, prefilled - began, done - prefilled)


def loop_host_reads(model, ids: torch.Tensor, settings: Decoder, new_tokens: int) -> int:
    """How many times the decode loop of ``TunedGreedy(model, settings)`` reads a tensor on the host over
    ``new_tokens`` tokens, the step itself not counted (on a GPU it is a graph replay, which reads nothing on the
    host; on a CPU it runs eagerly), nor the prefill and the masks made before the loop."""
    placement.require_model(model)
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    live = {"counter": None}

    def uncounted(function):
        @functools.wraps(function)  # the signature stays readable: TunedGreedy inspects the model's forward
        def run(*args, **kwargs):
            counter = live["counter"]
            before = counter.reads if counter else 0
            try:
                return function(*args, **kwargs)
            finally:
                if counter:
                    counter.reads = before
        return run

    own = model.__dict__.get("forward")  # an instance forward (a hook's) is put back as it was
    wrapper = model.forward = uncounted(model.forward)
    try:
        tuned = TunedGreedy(model, settings)
        tuned.greedy(ids, min(4, new_tokens))  # the first step of each phase captures: counted apart from the loop
        tuned._prefill, tuned._masks_ahead = uncounted(tuned._prefill), uncounted(tuned._masks_ahead)
        tuned._mask_sizes = uncounted(tuned._mask_sizes)  # the rule's check, before the loop
        with count_host_reads() as counter:
            live["counter"] = counter
            tuned.greedy(ids, new_tokens)
    finally:
        # only our wrapper is undone: where TunedGreedy took the hooks off, accelerate has already put the model's
        # own forward back, and the hook's forward it replaced would look for a hook that is gone
        if model.__dict__.get("forward") is wrapper:
            if own is None:
                del model.forward
            else:
                model.forward = own
    return counter.reads


def plain_greedy(model, ids: torch.Tensor, new_tokens: int, *, static_cache: bool = False, keep_logits: bool = False) -> GreedyRun:
    """``generate`` as the course runs it (greedy, exactly ``new_tokens``), timed the same way as ``TunedGreedy``
    (the prefill apart: ``generate``'s first step); ``static_cache`` passes a ``StaticCache``."""
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    require_bool(static_cache, "static_cache")
    require_bool(keep_logits, "keep_logits")
    device = placement.compute_device_of(model)
    ids = require_prompt(model, ids).to(device)
    extra = {cache_argument(model): new_cache(model, "static", ids.shape[1] + new_tokens)} if static_cache else {}
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        synchronize(device)
        began = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **common,
                       **({cache_argument(model): new_cache(model, "static", ids.shape[1] + 1)} if static_cache else {}))
        synchronize(device)
        prefill = time.perf_counter() - began
        began = time.perf_counter()
        with torch.profiler.record_function(decode_range(new_tokens)):  # generate's own prefill is one of them
            out = model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 output_logits=keep_logits, **common, **extra)
        synchronize(device)
        total = time.perf_counter() - began
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float().cpu() if keep_logits else None
    return GreedyRun(tokens, logits, prefill, max(total - prefill, 0.0))


def graph_breaks(model, ids: torch.Tensor, *, ple_outside: bool = True) -> dict:
    """``torch._dynamo.explain`` of one decode step of ``model`` as it stands (hooks or not): how many graphs
    and graph breaks, and the first reasons. Nothing is compiled."""
    require_bool(ple_outside, "ple_outside")
    import torch._dynamo

    device = placement.compute_device_of(model)
    ids = ids.to(device)
    cache = new_cache(model, "static", ids.shape[1] + 2)
    name = cache_argument(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
        token = ids[:, -1:]
        positions = torch.tensor([[ids.shape[1]]], device=device)
        inputs = {"input_ids": token}
        if ple_outside and supports_ple_outside(model):
            inputs = text_inputs(model, token)
        torch._dynamo.reset()
        with silenced(HOOKED_RECOMPILES):
            explained = torch._dynamo.explain(model.forward)(position_ids=positions, use_cache=True, logits_to_keep=1,
                                                            **{name: cache}, **inputs)
        torch._dynamo.reset()
    reasons = []
    for reason in explained.break_reasons:
        text = re.sub(r" at 0x[0-9a-f]+", "", " ".join(str(reason.reason).split()))  # the same reason on every run
        if text not in reasons:
            reasons.append(text)
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count, "reasons": reasons[:5]}


# --------------------------------------------------------------------------- a profile a learner can open

DECODE_RANGE = "course decode, forwards: "  # a profiler range around a decode loop, and how many forwards it holds
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch"})
COPIES = frozenset({"cudaMemcpyAsync", "cudaMemsetAsync"})  # GPU work started from the host that is no kernel
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace categories of what the GPU runs
TOP_KERNELS = 15  # the kernels a decode profile names, by GPU time: enough to see what a fusion would save


def decode_range(forwards: int) -> str:
    """The profiler range around a decode loop of ``forwards`` model calls (what the profile summary reads)."""
    return f"{DECODE_RANGE}{require_whole_number(forwards, 'forwards', minimum=0)}"


@dataclass
class ProfileSummary:
    steps: int
    wall_s: float
    device_busy_s: float  # time GPU kernels ran (0 on a CPU-only machine)
    kernels: int  # GPU kernels run
    launches: int  # kernel and graph launches the CPU made
    cpu_ops: int  # aten operators the CPU dispatched
    trace: str
    by_step: dict = field(default_factory=dict)

    @property
    def device_busy_fraction(self) -> float | None:
        return self.device_busy_s / self.wall_s if self.wall_s and self.kernels else None

    def as_dict(self) -> dict:
        return {**asdict(self), "device_busy_fraction": self.device_busy_fraction}


def profile(run, trace_path, steps: int, device) -> ProfileSummary:
    """Run ``run()`` (``steps`` decode steps) under ``torch.profiler`` and write a Chrome trace to ``trace_path``
    (open it at https://ui.perfetto.dev or chrome://tracing). The summary: wall time, how long the GPU worked, how
    many kernels and launches, how many operators the CPU dispatched. Where ``run`` decodes with ``plain_greedy``
    or ``TunedGreedy``, these figures cover their decode loops only (the prefill apart, which would otherwise
    weigh as much as many steps), divided per forward in ``by_step``; its ``top_kernels`` say where the GPU's
    time went: each one's share, runs per forward and mean time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if not callable(run):
        raise InvalidChoiceError(f"run={run!r} is not something to call; pass a function of no arguments, e.g. "
                                 f"functools.partial(decoding.plain_greedy, model, ids, 8).")
    steps = require_whole_number(steps, "steps", unit="decode steps")
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with silenced(PROFILER_ONE_CYCLE), native_lines_dropped(PROFILER_MARKS), torch_profile(activities=activities) as prof:
        synchronize(device)
        began = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - began
    prof.export_chrome_trace(str(trace_path))
    events = trace_events(trace_path)
    ranges = [(e["ts"], e["ts"] + e["dur"], int(e["name"][len(DECODE_RANGE):])) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(DECODE_RANGE)]
    if ranges:
        return _decode_loop_summary(events, ranges, steps, str(trace_path))
    busy = kernels = launches = cpu_ops = 0
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            busy += event.self_device_time_total
            kernels += event.count
        elif event.key in LAUNCHES:
            launches += event.count
        elif event.key.startswith("aten::"):
            cpu_ops += event.count
    return ProfileSummary(steps, wall, busy / 1e6, kernels, launches, cpu_ops, str(trace_path),
                          {"wall_ms": 1e3 * wall / steps, "kernels": kernels / steps, "launches": launches / steps,
                           "cpu_ops": cpu_ops / steps})


def _decode_loop_summary(events: list, ranges: list, steps: int, trace: str) -> ProfileSummary:
    """``profile``'s figures over the decode-loop ranges of a trace: the CPU's operators and launches inside them,
    the GPU work those launches started (joined by correlation id), and the wall from each range's start to the
    later of its end and its last GPU work's end."""
    def inside(event) -> int | None:
        return next((i for i, (start, end, _) in enumerate(ranges) if start <= event["ts"] <= end), None)

    launched, launches, cpu_ops = {}, 0, 0
    for event in events:
        if event.get("ph") != "X" or inside(event) is None:
            continue
        if event.get("cat") == "cuda_runtime" and event.get("name") in LAUNCHES | COPIES:
            launches += event["name"] in LAUNCHES
            launched[event.get("args", {}).get("correlation")] = inside(event)
        elif event.get("cat") == "cpu_op" and event.get("name", "").startswith("aten::"):
            cpu_ops += 1
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK
            and e.get("args", {}).get("correlation") in launched]
    ends = [end for _, end, _ in ranges]
    by_name: dict = {}  # name: [summed µs, runs]
    for e in work:
        index = launched[e["args"]["correlation"]]
        ends[index] = max(ends[index], e["ts"] + e["dur"])
        spent = by_name.setdefault(e["name"], [0.0, 0])
        spent[0], spent[1] = spent[0] + e["dur"], spent[1] + 1
    wall_us = sum(end - start for (start, _, _), end in zip(ranges, ends))
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in work])
    forwards = sum(n for _, _, n in ranges) or 1
    kernels = sum(e.get("cat") == "kernel" for e in work)
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    worked = sum(us for us, _ in by_name.values())  # each name's share of the GPU's summed work time
    return ProfileSummary(steps, wall_us / 1e6, busy_us / 1e6, kernels, launches, cpu_ops, trace,
                          {"wall_ms": wall_us / 1e3 / forwards, "kernels": kernels / forwards,
                           "launches": launches / forwards, "cpu_ops": cpu_ops / forwards, "forwards": forwards,
                           "top_kernels": [{"name": name[:120], "share": round(us / worked, 4),
                                            "per_forward": round(runs / forwards, 2), "mean_us": round(us / runs, 2)}
                                           for name, (us, runs) in top]})


def _union_us(intervals: list) -> float:
    """The time covered by ``intervals`` (start, end), overlaps counted once."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def trace_events(trace_path) -> list:
    """The events of a Chrome trace written by ``profile`` (what Perfetto shows)."""
    path = Path(trace_path)
    if not path.is_file():
        raise NoRecordError(f"No trace at {path}: profile(...) writes one and names it in its summary's trace.")
    try:
        return json.loads(path.read_text())["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RecordFileError(f"{path} is no whole Chrome trace: run profile(...) again to write it.") from None
