"""Load Gemma 4 for this course: a quantization choice and a PLE placement.

``ple="cpu"`` keeps the PLE table off the GPU from the first byte: a per-module device map
(never a ``""`` key), the offload flag bitsandbytes demands for any ``"cpu"`` entry, the
accelerate offload hook taken off the table, and the lookup run on the CPU so that only
the gathered rows travel to the GPU.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cards, models, placement
from .errors import (
    BitsandbytesMissingError,
    InsufficientGPUMemoryError,
    InvalidChoiceError,
    LibraryClashError,
    OutdatedTransformersError,
    require_bool,
    require_choice,
    require_module_names,
)
from .models import Source
from .noise import CPU_ENTRY_IN_MAP, NO_KERNELS_PACKAGE, silenced
from .placement import PLACEMENTS, Placement
from .quantization import QUANTS, Quant, quantization_config
from .weights import GPU_HEADROOM_BYTES, WeightEstimate, meta_model, weight_bytes

FIRST_WITH_GEMMA4 = "5.5.0"
FIRST_WITH_NO_CACHE_FIX = "5.5.2"  # huggingface/transformers#45242, fixed by #45253
# a GPU index, "cpu", "cuda", "cuda:1" or a torch.device
Device = int | str | torch.device


def require_importable_transformers() -> None:
    """Refuse a transformers that cannot be imported beside the installed ``kernels``: kernels 0.15 made a version or
    revision mandatory, and older transformers builds its kernel table without one at import (transformers#46291)."""
    try:
        importlib.import_module("transformers.integrations.hub_kernels")
    except ModuleNotFoundError:
        return  # a release without hub kernels: nothing to clash with
    except ValueError as err:
        if "revision or a version" not in str(err):
            raise

        def installed(name):
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                return "(release unknown)"

        transformers_version, kernels_version = installed("transformers"), installed("kernels")
        raise LibraryClashError(
            f"transformers {transformers_version} cannot be imported beside kernels {kernels_version} "
            "(huggingface/transformers#46291): run `pip install -U transformers` (or `pip uninstall kernels`) "
            "and restart the kernel.") from None


def check_transformers(version: str | None = None) -> None:
    """Refuse releases without Gemma 4 or that cannot be imported; warn on those whose ``use_cache=False`` path is
    wrong."""
    from packaging.version import Version

    if version is None:
        import transformers

        require_importable_transformers()
        version = transformers.__version__
    if Version(version) < Version(FIRST_WITH_GEMMA4):
        raise OutdatedTransformersError(
            f"transformers {version} predates Gemma 4: run `pip install -U 'transformers>={FIRST_WITH_NO_CACHE_FIX}'` "
            f"and restart the kernel."
        )
    if Version(version) < Version(FIRST_WITH_NO_CACHE_FIX):
        warnings.warn(
            f"transformers {version} computes Gemma 4's KV-shared layers wrongly when use_cache=False "
            f"(huggingface/transformers#45242), which fine-tuning recipes use: upgrade to >={FIRST_WITH_NO_CACHE_FIX}.",
            stacklevel=3,
        )


def compute_device(device: Device) -> torch.device:
    """The device the decoder runs on; a clear error when CUDA is asked for but absent."""
    return placement.require_device(device, "device")


COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def require_compute_dtype(compute_dtype) -> torch.dtype | None:
    """``compute_dtype`` if it is one the course supports, or None (chosen for the GPU at load time)."""
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise InvalidChoiceError(f"compute_dtype={compute_dtype!r} is not supported; pass torch.bfloat16, or torch.float16 on a T4.")
    return compute_dtype


def require_bitsandbytes(quant: Quant) -> None:
    if require_choice(quant, QUANTS, "quant") == "bf16":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise BitsandbytesMissingError(
            f"quant={quant!r} needs bitsandbytes, which is not installed: run `pip install bitsandbytes` "
            f"and restart the kernel, or load with quant='bf16'."
        )
    with silenced(NO_KERNELS_PACKAGE):  # imported here, first, so its optional-kernel notice stays quiet
        import bitsandbytes  # noqa: F401


@dataclass
class LoadVerdict:
    """Will a load fit the GPU memory this process may still use (a card cap included)?"""
    loads: bool
    quant: str
    ple: str
    device: str
    needed_bytes: int  # weights on the GPU plus the headroom
    budget_bytes: int | None  # None: not a GPU, no GPU limit
    fix: str = ""

    def __str__(self) -> str:
        if self.budget_bytes is None:
            return f"quant={self.quant!r}, ple={self.ple!r} on {self.device}: no GPU memory limit."
        head = (f"quant={self.quant!r}, ple={self.ple!r} needs about {self.needed_bytes / 1e9:.1f} GB on {self.device} "
                f"(weights + {GPU_HEADROOM_BYTES / 1e9:.1f} GB headroom); {self.budget_bytes / 1e9:.1f} GB is free")
        return f"{head}: it loads." if self.loads else f"{head}: it does not load; use {self.fix}."


def load_verdict(estimate: WeightEstimate, device: torch.device, quant: Quant, ple: Placement, towers: str = "gpu",
                 head: str = "tied") -> LoadVerdict:
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    require_choice(towers, placement.TOWERS, "towers")
    require_choice(head, placement.HEADS, "head")
    if device.type != "cuda":
        return LoadVerdict(True, quant, ple, str(device), estimate.gpu_bytes, None)
    budget = cards.budget_bytes(device)
    needed = estimate.gpu_bytes + GPU_HEADROOM_BYTES
    hints = []
    if ple == "gpu" and estimate.cpu_bytes == 0:
        hints.append("ple='cpu'")
    if quant in ("bf16", "int8"):
        hints.append("quant='nf4'")
    if not hints and (towers, head) != ("cpu", "nf4"):
        hints.append("towers='cpu', head='nf4'")
    return LoadVerdict(needed <= budget, quant, ple, str(device), needed, budget, " or ".join(hints) or "a larger GPU")


def will_load(source: Source = None, quant: Quant = "nf4", ple: Placement = "cpu", device: Device | None = None, *,
              keep_bf16=(), double_quant: bool = False, towers: str = "gpu", head: str = "tied") -> LoadVerdict:
    """Ask before loading: do this checkpoint's weights, with this quantization, PLE placement, towers and head,
    fit what this GPU (or simulated card) has free right now? Reads only the config."""
    require_bool(double_quant, "double_quant")
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    target = compute_device(default_device() if device is None else device)
    estimate = weight_bytes(meta_model(models.load_config(source)), quant, ple, keep_bf16, double_quant, towers, head)
    return load_verdict(estimate, target, quant, ple, towers, head)


def check_fits(estimate: WeightEstimate, device: torch.device, quant: Quant, ple: Placement, towers: str = "gpu",
               head: str = "tied") -> None:
    verdict = load_verdict(estimate, device, quant, ple, towers, head)
    if not verdict.loads and device.type == "cuda":
        # a model deleted in a cycle is freed only by the garbage collector: what it holds is free for this load
        release_gpu(warn=False)
        verdict = load_verdict(estimate, device, quant, ple, towers, head)
    if not verdict.loads:
        raise InsufficientGPUMemoryError(str(verdict))


class GPUStillInUseNotice(UserWarning):
    """Memory is still allocated after release_gpu(): something still refers to a model."""


STILL_IN_USE_BYTES = 256 * 1024**2  # more than a prompt's worth of tensors: a model, or a model's outputs


class MemoryLeft(dict):
    """What ``release_gpu`` left on the GPU (``allocated_bytes``, ``reserved_bytes``; empty without one), shown as
    one sentence where a notebook cell ends with it."""

    def __str__(self) -> str:
        if not self:
            return "No CUDA GPU here: nothing to hand back."
        return (f"GPU handed back: {self['allocated_bytes'] / 1e9:.2f} GB still allocated, "
                f"{self['reserved_bytes'] / 1e9:.2f} GB reserved.")

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def release_gpu(*, warn: bool = True) -> MemoryLeft:
    """After ``del model``: collect the garbage and hand PyTorch's cached blocks back to the driver,
    so the next load starts from an empty card. Returns the bytes still allocated and reserved, and
    warns when a model's worth is still allocated (a variable still refers to it)."""
    require_bool(warn, "warn")
    gc.collect()
    if not torch.cuda.is_available():
        return MemoryLeft()
    # cuBLAS keeps a workspace per stream in the caching allocator, often carved out of a segment a
    # deleted model's weights had used; while it lives, empty_cache cannot hand that whole segment back
    # (5.5 GB of an 8 GB card after a bf16 E2B, tools/gpu_release_probe.py). torch's own helpers clear it so.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    left = MemoryLeft(allocated_bytes=torch.cuda.memory_allocated(), reserved_bytes=torch.cuda.memory_reserved())
    if warn and left["allocated_bytes"] > STILL_IN_USE_BYTES:
        warnings.warn(f"{left['allocated_bytes'] / 1e9:.2f} GB is still allocated on the GPU after release_gpu(): a "
                      f"variable still refers to a model or its outputs; `del` it, then call release_gpu() again.",
                      GPUStillInUseNotice, stacklevel=2)
    return left


class ComputeDtypeNotice(UserWarning):
    """The 4-bit compute dtype was chosen for this GPU (fp16 where bf16 is not native)."""


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """What 4-bit layers should compute in: bf16 on the CPU and on GPUs that have it natively
    (compute capability 8.0 and newer); fp16 on a T4 (7.5) and older, where bf16 is emulated."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.bfloat16
    return torch.float16


def default_device():
    """GPU 0 where CUDA exists, else the CPU (the tiny model runs there)."""
    return 0 if torch.cuda.is_available() else "cpu"


def load_model(
    source: Source = None,
    quant: Quant = "nf4",
    ple: Placement = "cpu",
    device: Device = 0,
    *,
    keep_bf16=(),
    compute_dtype: torch.dtype | None = None,
    double_quant: bool = False,
    device_map: dict | None = None,
    check_memory: bool = True,
    towers: str = "gpu",
    head: str = "tied",
    **from_pretrained_kwargs,
):
    """Load a Gemma 4 checkpoint for this course.

    ``source``: hub id, folder or synthetic name (default ``$GEMMA_MODEL`` or ``tiny``).
    ``quant``: ``bf16``, ``nf4``, ``fp4`` or ``int8``. ``ple``: ``gpu`` or ``cpu``.
    ``device``: the GPU index, or ``"cpu"`` to run everything on the CPU.
    ``keep_bf16``, ``compute_dtype``, ``double_quant``: see ``quantization.quantization_config``;
    ``compute_dtype=None`` picks bf16, or fp16 on a GPU without native bf16 (a T4), and says so.
    ``device_map``: your own map instead of the course's (checked: every key must match a module).
    ``towers="cpu"``: the vision and audio towers wait in host memory while the conversation is text (identical text
    logits). ``head``: ``"tied"`` keeps the token table as the output head; ``"bf16"`` looks the table up on the CPU
    and keeps a bf16 head on the GPU (identical logits); ``"int8"`` or ``"nf4"`` quantize that head (smaller, not
    identical).
    """
    check_transformers()
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    target = compute_device(device)
    keep_bf16 = require_module_names(keep_bf16)
    require_compute_dtype(compute_dtype)
    require_bool(double_quant, "double_quant")
    require_bool(check_memory, "check_memory")
    require_choice(towers, placement.TOWERS, "towers")
    require_choice(head, placement.HEADS, "head")
    if device_map is not None and (towers != "gpu" or head != "tied"):
        raise InvalidChoiceError("towers= and head= place modules through the course's device map: leave device_map "
                                 "out, or put those modules in your own map yourself.")
    if device_map is not None:
        placement.check_map_devices(device_map)
    require_bitsandbytes(quant)
    path = models.check_weight_files(models.resolve(source))
    config = models.load_config(path)
    skeleton = meta_model(config)
    if ple == "cpu":
        placement.require_ple(skeleton)
    course_map = device_map is None  # each of its "cpu" entries is served from the CPU after loading, below
    if course_map:
        device_map = course_device_map(skeleton, _map_value(target), ple, towers, head)
    else:
        placement.validate_device_map(skeleton, device_map)
    cpu_entries = target.type == "cuda" and "cpu" in set(device_map.values())
    if compute_dtype is None:
        compute_dtype = default_compute_dtype(target)
        if compute_dtype == torch.float16 and quant in ("nf4", "fp4"):
            warnings.warn(f"{torch.cuda.get_device_name(target)} has no native bf16: 4-bit layers compute in fp16 "
                          f"(bnb_4bit_compute_dtype=torch.float16); pass compute_dtype to choose.", ComputeDtypeNotice,
                          stacklevel=2)
    if check_memory:
        check_fits(weight_bytes(skeleton, quant, ple, keep_bf16, double_quant, towers, head), target, quant, ple,
                   towers, head)
    del skeleton
    kwargs = dict(dtype=torch.bfloat16, device_map=device_map)
    quant_config = quantization_config(quant, cpu_entries=cpu_entries, keep_bf16=keep_bf16,
                                       compute_dtype=compute_dtype, double_quant=double_quant)
    if quant_config is not None:
        kwargs["quantization_config"] = quant_config
    kwargs.update(from_pretrained_kwargs)
    model, threads_before = None, set(threading.enumerate())
    try:
        # accelerate says a "cpu" entry's weights were offloaded to meta; with the course's map that stops being true
        # once the lookups below take the weights back, so only a learner's own map hears it
        with silenced(*([CPU_ENTRY_IN_MAP] if course_map else [])):
            model = models.auto_class_for(config).from_pretrained(path, **kwargs)
        model.eval()
        if ple == "cpu":
            for name in placement.require_ple(model):
                placement.install_cpu_lookup(model.get_submodule(name), target)
        if towers == "cpu":
            for name in placement.tower_module_names(model):
                placement.install_cpu_tower(model.get_submodule(name), target)
        if head != "tied":
            placement.install_output_head(model, head, target)
        placement.served_from_host_last(model)
    except BaseException as error:  # out of memory, a hook's or the quantizer's error, a learner's interrupt
        model = None
        give_back_failed_load(error, threads_before)
        if isinstance(error, torch.OutOfMemoryError):
            raise InsufficientGPUMemoryError(
                f"Ran out of GPU memory while loading {path.name} with quant={quant!r}, ple={ple!r}: "
                f"try ple='cpu' and quant='nf4', close other notebooks, or restart the kernel to free memory."
            ) from None
        raise
    return model


def course_device_map(skeleton, compute, ple: Placement, towers: str = "gpu", head: str = "tied") -> dict:
    """The course's map: everything on ``compute`` but the PLE table (``ple="cpu"``), the towers (``towers="cpu"``)
    and, for an untied head, the token table with the checkpoint's tied ``lm_head`` (replaced after loading)."""
    require_choice(ple, PLACEMENTS, "ple")
    require_choice(towers, placement.TOWERS, "towers")
    require_choice(head, placement.HEADS, "head")
    elsewhere = {}
    if ple == "cpu":
        elsewhere.update(dict.fromkeys(placement.require_ple(skeleton), "cpu"))
    if towers == "cpu":
        elsewhere.update(dict.fromkeys(placement.tower_module_names(skeleton), "cpu"))
    if head != "tied":
        elsewhere.update(dict.fromkeys(placement.token_table_names(skeleton) + ["lm_head"], "cpu"))
    return placement.split_device_map(skeleton, compute, elsewhere) if elsewhere else {"": compute}


# how long a failed load waits for each tensor copy transformers' loader threads still have in flight
LOADER_THREAD_WAIT_S = 120


def give_back_failed_load(error: BaseException, threads_before) -> None:
    """Free what a load that failed partway had taken: the frames of its traceback still hold the half-built model
    (and a notebook keeps the last traceback), so their locals are cleared before the GPU's cache is emptied.

    transformers shuts its loader pool down without waiting (``shutdown(wait=False, cancel_futures=True)``), so the
    copies its worker threads had started still land on the GPU after the error: those threads (started since
    ``threads_before``, the threads alive when the load began) finish first, or the cache would be emptied before
    their blocks arrive. Without that snapshot an idle pool of someone else's would be waited on too."""
    import traceback

    for thread in set(threading.enumerate()) - set(threads_before):
        if thread.name.startswith("ThreadPoolExecutor-"):  # concurrent.futures' default worker names
            thread.join(timeout=LOADER_THREAD_WAIT_S)
    pending, seen = [error], set()
    while pending:  # the whole chain: an error raised while handling another keeps that one's frames too
        chained = pending.pop()
        if chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            pending += [chained.__context__, chained.__cause__]
    release_gpu(warn=False)


def _map_value(device: torch.device):
    return device.index if device.type == "cuda" else str(device)


def load_processor(source: Source = None):
    """The checkpoint's processor (``AutoProcessor``); the tokenizer where the processor cannot be built.

    Gemma 4's processor includes a video processor that needs torchvision. Without it, the
    tokenizer and its chat template still serve text chat, and a warning says so.
    """
    from transformers import AutoProcessor, AutoTokenizer

    path = models.resolve(source)
    has_processor = (Path(path) / "processor_config.json").is_file()
    if has_processor:
        try:
            return AutoProcessor.from_pretrained(path)
        except (ImportError, AttributeError, ValueError, RuntimeError) as err:
            warnings.warn(
                f"Could not build the full Gemma 4 processor ({type(err).__name__}); returning the tokenizer, "
                f"which handles text chat. For images, audio and video: pip install torchvision (matching your torch).",
                stacklevel=2,
            )
    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(source: Source = None):
    """The text tokenizer alone: the processor's own where there is a processor."""
    processor = load_processor(source)
    return getattr(processor, "tokenizer", processor)
