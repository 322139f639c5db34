"""What the notebooks measure with: a greedy run and its logits, the comparisons that tell identical from
within rounding (each with a control that must differ), reproducible kernels, and GPU memory and prefill peaks.
The lab's runner (``lab.measure``) records whole routes with these in a fresh process."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from . import cards, placement
from .errors import InvalidChoiceError, require_bool, require_number, require_tokenizer, require_whole_number
from .long_context import LongContext

# cuBLAS picks reduction orders run to run unless its workspace is fixed (PyTorch's reproducibility notes)
DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


PROMPT_TEXT = "The per-layer embedding table is a lookup, so only the rows of these tokens are read. "


def prompt_ids(tokenizer, length: int, device) -> torch.Tensor:
    """Exactly ``length`` token ids from a fixed text (works for real and synthetic tokenizers)."""
    require_tokenizer(tokenizer)
    length = require_whole_number(length, "length", unit="tokens")
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    repeated = (ids * (length // max(len(ids), 1) + 1))[: length - 1]
    return torch.tensor([[tokenizer.bos_token_id, *repeated]], device=device)


def _generate_exactly(model, ids: torch.Tensor, new_tokens: int, keep_logits: bool = False):
    """Greedy ``generate`` of exactly ``new_tokens`` (no early stop at an end-of-turn token); with
    ``keep_logits`` also the raw logits of every step (``output_logits``, before any processor)."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, output_logits=keep_logits,
                              return_dict_in_generate=True)


def greedy(model, tokenizer, new_tokens: int, prompt_length: int = 32, *, keep_logits: bool = False) -> dict:
    """Greedy-decode exactly ``new_tokens`` after a fixed prompt: the tokens, their hash, how many
    distinct ones (a random-weight model that repeats one token proves nothing) and the time; with
    ``keep_logits`` the full logits of every step (float32, on the CPU) and their hash."""
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    require_bool(keep_logits, "keep_logits")
    device = placement.compute_device_of(model)  # not the PLE table's device, which may be the CPU
    ids = prompt_ids(tokenizer, prompt_length, device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    out = _generate_exactly(model, ids, new_tokens, keep_logits)
    synchronize()
    seconds = time.perf_counter() - started
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    result = {
        "tokens": tokens,
        "sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "distinct_tokens": len(set(tokens)),
        "seconds_per_token": seconds / len(tokens),
    }
    if keep_logits:
        logits = torch.stack([step[0] for step in out.logits]).float().cpu()
        result.update(logits=logits, logits_sha256=hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
                      logits_finite=bool(torch.isfinite(logits).all()))
    return result


def reproducible_kernels() -> str:
    """Make two runs of one model compute bit for bit the same on a GPU, so that a comparison of two
    placements can claim identity: cuBLAS with a fixed workspace (read at its first call, so call this
    before the first matmul) and scaled-dot-product attention kept off cuDNN. With cuDNN's attention, two
    greedy runs of E4B-shaped NF4 in one process on the H200 drifted apart after about 230 steps; with the
    flash, memory-efficient and math kernels they repeat exactly (``tools/determinism_probe.py``).
    Returns what it set, for the notebook to print."""
    for key, value in DETERMINISTIC_CUBLAS.items():
        os.environ.setdefault(key, value)
    settings = [f"{key}={os.environ[key]}" for key in DETERMINISTIC_CUBLAS]
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
        settings.append("attention off cuDNN (torch.backends.cuda.enable_cudnn_sdp(False))")
    if not torch.cuda.is_available():
        return "No CUDA GPU: the CPU's kernels repeat run to run by themselves (the GPU settings are made all the same)."
    return "Reproducible GPU kernels: " + "; ".join(settings)


def math_attention():
    """Attention through the math kernel only, for comparing two decode paths bit for bit. A fused kernel
    (the CPU's flash attention) rounds by the keys' length and by how the step was traced: on tiny, a step
    traced by dynamo differed from the same step run eagerly by one bf16 ulp in some logits, and a static
    cache's padded keys changed plain ``generate``'s bits; under the math kernel both are identical
    (``tests/test_decoding.py``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor, steps: int | None = None) -> dict:
    """Bit-for-bit comparison of two runs' logits, every vocabulary entry of the first ``steps``
    steps (all by default), and the first step where they differ (None: nowhere)."""
    steps = min(len(reference), len(candidate)) if steps is None else require_whole_number(steps, "steps")
    reference, candidate = reference[:steps], candidate[:steps]
    if reference.shape != candidate.shape:
        return {"identical": False, "max_abs_diff": float("inf"), "steps": steps, "first_difference": 0}
    differing = [step for step in range(steps) if not torch.equal(reference[step], candidate[step])]
    return {"identical": not differing, "max_abs_diff": (reference - candidate).abs().max().item(), "steps": steps,
            "first_difference": differing[0] if differing else None}


ROUNDING_BOUND = 0.1  # of the reference logits' standard deviation: what rounding differently may cost
# judged on the root mean square difference, not the largest: over every vocabulary entry of many steps (E4B: 262,144
# entries a step) the largest is the far tail of the rounding and grows with the count; the mean square is its size.
# (The first E4B Inductor run, judged on the largest, was outside the bound at 0.162 x spread 1.00: that record
# keeps its own rule, "statistic" absent.)
ROUNDING_STATISTIC = "rms"


def compare_rounding(reference: torch.Tensor, candidate: torch.Tensor, steps: int | None = None) -> dict:
    """Logits of kernels that round differently (Inductor's fused ones) against a reference. They need not be
    equal; while both runs still feed the model the same tokens, their root mean square difference must stay below
    ``ROUNDING_BOUND`` of the reference's spread (the largest is reported beside it). From the step after their
    greedy tokens part they are two
    different conversations, so those steps are not compared (``tokens_part_at``: None when they never part)."""
    steps = min(len(reference), len(candidate)) if steps is None else require_whole_number(steps, "steps")
    reference, candidate = reference[:steps].float().reshape(steps, -1), candidate[:steps].float()
    if candidate.numel() != reference.numel():
        return {"steps": steps, "first_difference": 0, "tokens_part_at": 0, "compared_steps": 0,
                "max_abs_diff": float("inf"), "rms_diff": float("inf"), "reference_std": None, "bound": ROUNDING_BOUND,
                "statistic": ROUNDING_STATISTIC, "within_rounding": False}
    candidate = candidate.reshape(steps, -1)
    parted = (reference.argmax(-1) != candidate.argmax(-1)).nonzero()
    tokens_part_at = int(parted[0, 0]) if len(parted) else None
    same_inputs = steps if tokens_part_at is None else tokens_part_at + 1  # that step's input was still shared
    gap = reference[:same_inputs] - candidate[:same_inputs]
    rms, spread = gap.square().mean().sqrt().item(), reference[:same_inputs].std().item()
    return {"steps": steps, "first_difference": compare_logits(reference, candidate)["first_difference"],
            "tokens_part_at": tokens_part_at, "compared_steps": same_inputs, "max_abs_diff": gap.abs().max().item(),
            "rms_diff": rms, "reference_std": spread, "bound": ROUNDING_BOUND, "statistic": ROUNDING_STATISTIC,
            "within_rounding": rms <= ROUNDING_BOUND * spread}


def self_consistent_steps(first: torch.Tensor, second: torch.Tensor) -> int:
    """How many leading steps two runs of the same model agree on bit for bit: a comparison of two
    placements can claim identity only where each placement is identical to itself. With
    ``reproducible_kernels()`` that is every step on the H200; without it, about 230 of E4B-shaped NF4's."""
    first_difference = compare_logits(first, second)["first_difference"]
    return min(len(first), len(second)) if first_difference is None else first_difference


@contextlib.contextmanager
def ple_row_nudged(model, token_id: int):
    """The control for an identity check: one PLE row moved by one bf16 ulp (its bit pattern + 1),
    restored on exit. A comparison that cannot tell this model from the original proves nothing."""
    tables = [model.get_submodule(name).weight for name in placement.require_ple(model)]
    token_id = require_whole_number(token_id, "token_id", minimum=0, maximum=tables[0].shape[0] - 1,
                                    maximum_is="the last row of the PLE table")
    originals = [table.data[token_id].clone() for table in tables]
    with torch.no_grad():
        for table in tables:
            table.data[token_id].view(torch.int16).add_(1)
    try:
        yield model
    finally:
        with torch.no_grad():
            for table, original in zip(tables, originals):
                table.data[token_id].copy_(original)


def placeholder_ids(model) -> tuple:
    """The image, audio and video placeholder ids the model's forward looks up as the pad token."""
    placement.require_model(model)
    return tuple(getattr(model.config, f"{kind}_token_id") for kind in ("image", "audio", "video"))


@contextlib.contextmanager
def placeholders_emitted(model, greedy_tokens, *, boost: float = 1.125):
    """A model whose greedy decoding emits every placeholder id, for an identity check that must cover them
    (random weights rarely choose one). One at a time, each placeholder's output row becomes ``boost`` times the row of
    a token greedy chose at a later step that it had not chosen before, so the placeholder wins there and the steps
    before are unchanged; ``greedy_tokens()`` runs the reference decode. Yields {placeholder id: step}; the rows (tied
    to the input embedding) are restored on exit. Fails in one sentence where no step can be forced."""
    placement.require_model(model)
    boost = require_number(boost, "boost", minimum=1.0)
    head = model.get_output_embeddings().weight
    placeholders = placeholder_ids(model)
    saved = {token: head.data[token].clone() for token in placeholders}
    forced = {}
    try:
        tokens = greedy_tokens()
        first = 1
        for placeholder in placeholders:
            for step in range(first, len(tokens)):
                chosen = tokens[step]
                if chosen in tokens[:step] or chosen in placeholders:
                    continue
                with torch.no_grad():
                    head.data[placeholder] = (head.data[chosen].float() * boost).to(head.dtype)
                again = greedy_tokens()
                if again[:step] == tokens[:step] and again[step] == placeholder:
                    forced[placeholder], tokens, first = step, again, step + 2
                    break
                with torch.no_grad():
                    head.data[placeholder] = saved[placeholder]
            else:
                raise InvalidChoiceError(f"No step of {len(tokens)} could be made to emit placeholder {placeholder}; decode more "
                                  f"tokens.")
        yield forced
    finally:
        with torch.no_grad():
            for token, row in saved.items():
                head.data[token] = row


def gpu_memory(device) -> dict:
    """Allocated, reserved and peak bytes on a CUDA device ({} elsewhere)."""
    if torch.device(device).type != "cuda":
        return {}
    return {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "reserved_bytes": torch.cuda.memory_reserved(device),
        "peak_bytes": torch.cuda.max_memory_allocated(device),
    }


FIT_DECODE_TOKENS = 8  # a context fits when its prefill and this many decoded tokens run


@dataclasses.dataclass(frozen=True)
class PrefillPeak:
    """One prefill's peak GPU memory and speed, or that it ran out of memory. ``peak_reserved_bytes`` is what a
    memory cap limits: allocated plus the allocator's fragmentation."""
    context: int
    peak_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    tokens_per_s: float | None = None
    oom: bool = False
    device_free_bytes: int | None = None  # after an out-of-memory: a card-sized limit or a GPU shared with others

    def __str__(self) -> str:
        if self.oom:
            return f"{self.context:>6,} tokens: out of memory"
        return (f"{self.context:>6,} tokens: peak {self.peak_bytes / 1e9:.2f} GB "
                f"(reserved {self.peak_reserved_bytes / 1e9:.2f}), {self.tokens_per_s:,.0f} tokens/s of prefill")

    def record(self) -> dict:
        """The fields a benchmark record keeps (those that apply)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and (k != "oom" or v)}


def prefill_peak(model, tokenizer, context: int, device, new_tokens: int = 1,
                 settings: LongContext | None = None) -> PrefillPeak:
    """Peak GPU memory and speed of one ``generate`` prefill of ``context`` tokens (and ``new_tokens`` - 1 decoded
    after it), plain or with long-context ``settings``; an out-of-memory is a result, not an error."""
    placement.require_model(model)
    device = cards.require_cuda_gpu(device, "prefill_peak")
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    ids = prompt_ids(tokenizer, context, device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        if settings is None:
            _generate_exactly(model, ids, new_tokens)
        else:
            settings.generate(model, ids, new_tokens)
        torch.cuda.synchronize(device)
        return PrefillPeak(context, peak_bytes=torch.cuda.max_memory_allocated(device),
                           peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                           tokens_per_s=round(context / (time.perf_counter() - began), 1))
    except torch.OutOfMemoryError:
        return PrefillPeak(context, oom=True, device_free_bytes=cards.whole_gpu_memory(device)[0])
    finally:
        del ids
        torch.cuda.empty_cache()


def memory_readout(device) -> dict:
    """Three views of GPU memory: what tensors hold (allocated), what PyTorch's caching allocator
    holds (reserved), and what the whole device has in use, as nvidia-smi shows it (every process,
    plus each process's CUDA context)."""
    counters = gpu_memory(device)
    free, total = cards.whole_gpu_memory(device)
    return {"allocated": counters["allocated_bytes"], "reserved": counters["reserved_bytes"],
            "device in use (nvidia-smi)": total - free, "device total": total}


def snapshot_prefill(model, tokenizer, context: int, path, device) -> Path:
    """Record every allocation of one prefill and save it for https://pytorch.org/memory_viz."""
    placement.require_model(model)
    device = cards.require_cuda_gpu(device, "snapshot_prefill")
    context = require_whole_number(context, "context", unit="tokens")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        prefill_peak(model, tokenizer, context, device)
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def fits_context(model, tokenizer, context: int, device, decode_tokens: int = FIT_DECODE_TOKENS,
                 settings: LongContext | None = None) -> bool:
    """Does a prefill of ``context`` tokens plus a few decoded ones run without running out of memory?"""
    decode_tokens = require_whole_number(decode_tokens, "decode_tokens", unit="tokens")
    return not prefill_peak(model, tokenizer, context, device, new_tokens=decode_tokens, settings=settings).oom
