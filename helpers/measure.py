"""Measure one placement route in this process: memory after load, peak during load and
prefill, greedy tokens and their hash. Run each route in a fresh process so that peaks and
out-of-memory errors cannot leak into the next one:

    python -m helpers.measure --model e4b-shape --quant nf4 --route ple-cpu --json out.json

Routes:
  ple-gpu        the course loader, ``ple="gpu"`` (``device_map={"": 0}``)
  ple-cpu        the course loader, ``ple="cpu"`` (per-module map, hook removed, CPU lookup)
  post-load      ``ple="gpu"``, then ``placement.offload_ple`` on the loaded model
  cpu-entry      the naive route: a per-module map with the PLE on ``"cpu"`` and the offload
                 flag, accelerate's hook left in place
  no-flag        the same map without ``llm_int8_enable_fp32_cpu_offload`` (bitsandbytes refuses)
  ple-cpu-nudged the control: ``ple="cpu"`` with one PLE row moved by one bf16 ulp; its logits must
                 differ from ``ple-gpu``'s, or the identity check proves nothing
  ple-cpu-fp16   ``ple="cpu"`` with 4-bit layers computing in fp16, what a T4 (no native bf16) gets

Long prompts (``helpers.long_context``): ``--path plain`` prefills with ``generate(prefill_chunk_size=N)`` as it
comes, ``--path tuned`` with ``LongContext(chunk=N)`` (a static cache, attention without ``repeat_kv``); the
prefill peaks, the largest context and the greedy run (``--greedy-context``: its prompt length) all use it.

Decoding speed (``helpers.decoding``): ``--decode MODE`` times greedy decoding of ``--new-tokens`` after a
``--greedy-context`` prompt, twice with logits (the first also compiles) and ``--decode-runs`` more:
  generate         plain ``generate`` (its dynamic cache), accelerate's hooks in place
  generate-static  plain ``generate`` with a ``StaticCache``: the reference the tuned modes must equal
  loop             the tuned loop, eager: hooks removed, static cache, PLE rows and masks outside the step
  dynamo           the same compiled with ``backend="eager"`` (Dynamo only: graph breaks show, kernels unchanged)
  cudagraphs       the tuned loop's step captured with ``torch.cuda.CUDAGraph`` (``decoding.StepGraphs``): the eager
                   kernels replayed with one launch per token
  reduce-overhead  compiled with ``mode="reduce-overhead"``: Inductor's fused kernels in CUDA graphs
``--profile-trace PATH`` also writes a ``torch.profiler`` Chrome trace of ``--profile-steps`` decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import cards, decoding, loading, models, placement, quantization
from .errors import CourseError, InvalidChoiceError
from .host_memory import PeakSampler, peak_rss_bytes
from .long_context import DEFAULT_CHUNK, LongContext, longest_prompt
from .paths import write_text_atomically
from .planner import PATHS, decode_bytes_per_token, largest_true
from .records import environment
from .weights import meta_model

# cuBLAS picks reduction orders run to run unless its workspace is fixed (PyTorch's reproducibility notes)
DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
ROUTES = ("ple-gpu", "ple-cpu", "post-load", "cpu-entry", "no-flag", "ple-cpu-nudged", "ple-cpu-fp16")
# --decode modes: None = plain generate; otherwise decoding.Decoder's compile setting
DECODE_MODES = {"generate": None, "generate-static": None, "loop": None, "dynamo": "eager", "cudagraphs": "cudagraphs",
                "reduce-overhead": "reduce-overhead"}


def path_settings(path: str | None, chunk: int = DEFAULT_CHUNK) -> LongContext | None:
    """The long-context settings of ``--path`` (None: the prefill is one plain forward, as before)."""
    if path is None:
        return None
    return LongContext(chunk=chunk) if path == "tuned" else LongContext.plain(chunk)
PROMPT_TEXT = "The per-layer embedding table is a lookup, so only the rows of these tokens are read. "


def prompt_ids(tokenizer, length: int, device) -> torch.Tensor:
    """Exactly ``length`` token ids from a fixed text (works for real and synthetic tokenizers)."""
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
    steps = min(len(reference), len(candidate)) if steps is None else steps
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
    steps = min(len(reference), len(candidate)) if steps is None else steps
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
    return tuple(getattr(model.config, f"{kind}_token_id") for kind in ("image", "audio", "video"))


@contextlib.contextmanager
def placeholders_emitted(model, greedy_tokens, *, boost: float = 1.125):
    """A model whose greedy decoding emits every placeholder id, for an identity check that must cover them
    (random weights rarely choose one). One at a time, each placeholder's output row becomes ``boost`` times the row of
    a token greedy chose at a later step that it had not chosen before, so the placeholder wins there and the steps
    before are unchanged; ``greedy_tokens()`` runs the reference decode. Yields {placeholder id: step}; the rows (tied
    to the input embedding) are restored on exit. Fails in one sentence where no step can be forced."""
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


def _load(route: str, source, quant: str, device: int):
    if route in ("ple-gpu", "ple-cpu", "ple-cpu-nudged"):
        return loading.load_model(source, quant=quant, ple=route.split("-")[1], device=device)
    if route == "ple-cpu-fp16":
        return loading.load_model(source, quant=quant, ple="cpu", device=device, compute_dtype=torch.float16)
    if route == "post-load":
        model = loading.load_model(source, quant=quant, ple="gpu", device=device)
        return placement.offload_ple(model, torch.device("cuda", device))
    path = models.resolve(source)
    config = models.load_config(path)
    device_map = placement.ple_device_map(meta_model(config), device)
    qc = quantization.quantization_config(quant, cpu_entries=(route == "cpu-entry"))
    kwargs = {"quantization_config": qc} if qc is not None else {}
    return models.auto_class_for(config).from_pretrained(path, dtype=torch.bfloat16, device_map=device_map, **kwargs)


def config_sha256(source) -> str:
    """The hash of the checkpoint's config.json: which exact architecture a record measured."""
    return hashlib.sha256((Path(models.resolve(source)) / "config.json").read_bytes()).hexdigest()


FIT_DECODE_TOKENS = 8  # a context fits when its prefill and this many decoded tokens run


def prefill_peak(model, tokenizer, context: int, device, new_tokens: int = 1, settings: LongContext | None = None) -> dict:
    """Peak GPU memory and speed of one ``generate`` prefill of ``context`` tokens (and
    ``new_tokens`` - 1 decoded after it), plain or with long-context ``settings``;
    ``{"context", "oom": True, ...}`` when it runs out of memory."""
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
        # peak reserved is what a memory cap limits: allocated plus the allocator's fragmentation
        return {"context": context, "peak_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "tokens_per_s": round(context / (time.perf_counter() - began), 1)}
    except torch.OutOfMemoryError:
        # device_free_bytes tells a card-sized limit apart from a GPU shared with other processes
        return {"context": context, "oom": True, "device_free_bytes": cards.whole_gpu_memory(device)[0]}
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
    return not prefill_peak(model, tokenizer, context, device, new_tokens=decode_tokens, settings=settings).get("oom")


def copy_bandwidth(device, size_bytes: int = 2 * 1024**3, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + write): the practical ceiling on reading weights.
    Under a simulated card the buffers take at most a quarter of what the cap leaves."""
    if torch.device(device).type == "cuda":
        size_bytes = min(size_bytes, cards.budget_bytes(device) // 4)
    source = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    decoding.synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    decoding.synchronize(device)
    seconds = time.perf_counter() - began
    del source, target
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size_bytes * repeats / seconds


def measure(source, quant: str, route: str, *, device: int = 0, new_tokens: int = 256, contexts=(), card_gb=None,
            decode_runs: int = 1, search_max_context: bool = False, max_context_limit: int | None = None,
            logits_out: Path | None = None, path: str | None = None, prefill_chunk: int = DEFAULT_CHUNK,
            decode: str | None = None, greedy_context: int = 32, profile_trace: Path | None = None,
            profile_steps: int = 16):
    """Measure one route in this process. ``decode_runs`` > 1 adds a warm-up run and reports the
    median decode speed; ``search_max_context`` bisects the largest context that prefills and decodes,
    up to ``max_context_limit`` (default: the longest prompt whose decoded tokens fit the model's
    ``max_position_embeddings``); ``logits_out`` keeps
    the greedy run's logits for a bit-for-bit comparison with another route. ``path``, ``prefill_chunk``:
    long prompts; ``decode``, ``greedy_context``, ``profile_trace``: decoding speed (the module's docstring)."""
    if DECODE_MODES.get(decode):
        decoding.Decoder(compile=DECODE_MODES[decode]).check_quant(quant)  # before anything is loaded
    checkpoint = models.resolve(source)  # once; a synthetic checkpoint is built before any card-sized cap
    torch.cuda.init()
    index, device = device, torch.device("cuda", device)
    if card_gb is not None:
        cards.simulate(card_gb, device)
    settings = path_settings(path, prefill_chunk)
    record = {"route": route, "quant": quant, "model": str(source), "card_gb": card_gb,
              "ple": route.split("-")[1] if route.startswith("ple-") else None,
              "config_sha256": config_sha256(checkpoint), "path": path,
              "prefill_chunk": prefill_chunk if path else None, "decode": decode}
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        with PeakSampler() as host_load:
            model = _load(route, checkpoint, quant, index)
    except torch.OutOfMemoryError as err:
        record.update(load_error=f"OutOfMemoryError: {str(err).splitlines()[0]}", load_oom=True)
        return record
    except CourseError as err:
        record.update(load_error=f"{type(err).__name__}: {err}", load_oom=type(err).__name__ == "InsufficientGPUMemoryError")
        return record
    except (ValueError, RuntimeError) as err:
        record["load_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        return record
    torch.cuda.synchronize(device)
    record["load_s"] = round(time.perf_counter() - started, 2)
    after_load = gpu_memory(device)
    record.update(
        resident_bytes=after_load["allocated_bytes"],
        reserved_bytes=after_load["reserved_bytes"],
        peak_load_bytes=after_load["peak_bytes"],
        host_load_anon_peak_bytes=host_load.peaks.anon_bytes,
        host_load_file_peak_bytes=host_load.peaks.file_bytes,
        placement=placement.report(model).as_dict()["bytes_by_device"],
    )
    tokenizer = loading.load_tokenizer(checkpoint)
    nudge = (ple_row_nudged(model, int(prompt_ids(tokenizer, greedy_context, "cpu")[0, -1])) if route == "ple-cpu-nudged"
             else contextlib.nullcontext())
    with nudge:
        record["prefill"] = [prefill_peak(model, tokenizer, context, device, settings=settings) for context in contexts]
        if decode is not None:
            _measure_decoding(model, tokenizer, device, record, decode=decode, new_tokens=new_tokens,
                              decode_runs=decode_runs, greedy_context=greedy_context, logits_out=logits_out,
                              profile_trace=profile_trace, profile_steps=profile_steps)
        elif settings is not None:
            _measure_long_greedy(model, tokenizer, device, record, settings=settings, new_tokens=new_tokens,
                                 greedy_context=greedy_context, logits_out=logits_out)
        else:
            _measure_loaded(model, tokenizer, device, record, new_tokens=new_tokens, decode_runs=decode_runs,
                            logits_out=logits_out)
        if search_max_context:
            text_config = getattr(model.config, "text_config", model.config)
            limit = max_context_limit or longest_prompt(text_config.max_position_embeddings, FIT_DECODE_TOKENS)
            record["max_context"] = largest_true(
                512, limit, lambda context: fits_context(model, tokenizer, context, device, settings=settings))
            record["max_context_limit"] = limit
    record["host_process_peak_bytes"] = peak_rss_bytes()
    return record


def _measure_loaded(model, tokenizer, device, record: dict, *, new_tokens: int, decode_runs: int, logits_out):
    if not new_tokens:
        return
    identity = greedy(model, tokenizer, new_tokens, keep_logits=True)  # untimed: keeping logits costs time and memory
    if logits_out is not None:  # an identity route: also how far this placement agrees with itself
        again = greedy(model, tokenizer, new_tokens, keep_logits=True)
        record["self_consistent_steps"] = self_consistent_steps(identity["logits"], again["logits"])
        torch.save(identity["logits"], logits_out)
    torch.cuda.reset_peak_memory_stats(device)
    with PeakSampler() as host_generate:
        runs = [greedy(model, tokenizer, new_tokens) for _ in range(decode_runs + (1 if decode_runs > 1 else 0))]
    timed = runs[1:] if decode_runs > 1 else runs  # the first of several is the warm-up
    speeds = sorted(1 / r["seconds_per_token"] for r in timed)
    if len({r["sha256"] for r in runs} | {identity["sha256"]}) != 1:
        record["greedy_unstable"] = True  # the same greedy run gave different tokens: a bug, not noise
    record.update(
        greedy_tokens=identity["tokens"],
        greedy_token_count=len(identity["tokens"]),
        greedy_distinct_tokens=identity["distinct_tokens"],
        greedy_sha256=identity["sha256"],
        logits_sha256=identity["logits_sha256"],
        logits_finite=identity["logits_finite"],
        seconds_per_token=round(1 / speeds[len(speeds) // 2], 4),
        decode_tokens_per_s=round(speeds[len(speeds) // 2], 2),
        peak_generate_bytes=torch.cuda.max_memory_allocated(device),
        host_generate_anon_peak_bytes=host_generate.peaks.anon_bytes,
        host_generate_file_peak_bytes=host_generate.peaks.file_bytes,
    )


def _identity_fields(record: dict, first, second, logits_out) -> None:
    """Tokens and logits of the first of two identical greedy runs, and how far the two agree."""
    tokens = first.tokens
    record.update(
        greedy_token_count=len(tokens),
        greedy_distinct_tokens=len(set(tokens)),
        greedy_sha256=hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        logits_sha256=hashlib.sha256(first.logits.numpy().tobytes()).hexdigest(),
        logits_finite=bool(torch.isfinite(first.logits).all()),
        self_consistent_steps=self_consistent_steps(first.logits, second.logits),
    )
    if logits_out is not None:
        torch.save(first.logits, logits_out)


def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peaks(device) -> dict:
    """Peak allocated and reserved GPU bytes since the last reset (nothing on the CPU)."""
    if torch.device(device).type != "cuda":
        return {}
    return {"peak_generate_bytes": torch.cuda.max_memory_allocated(device),
            "peak_generate_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def _measure_long_greedy(model, tokenizer, device, record: dict, *, settings: LongContext, new_tokens: int,
                         greedy_context: int, logits_out) -> None:
    """Twice: a prompt of ``greedy_context`` tokens prefilled with ``settings`` and ``new_tokens`` greedy tokens
    after it, logits kept; the peak of the first run."""
    if not new_tokens:
        return
    ids = prompt_ids(tokenizer, greedy_context, device)
    runs = []
    _reset_peak(device)
    try:
        for _ in range(2):
            decoding.synchronize(device)
            began = time.perf_counter()
            out = settings.generate(model, ids, new_tokens, keep_logits=True)
            decoding.synchronize(device)
            logits = torch.stack([step[0] for step in out.logits]).float().cpu()
            runs.append(decoding.GreedyRun(out.sequences[0, ids.shape[1]:].tolist(), logits, 0.0,
                                           time.perf_counter() - began))
            del out
            if len(runs) == 1:
                record.update(_peaks(device))
    except torch.OutOfMemoryError:
        record.update(greedy_oom=True, greedy_context=greedy_context)
        return
    record.update(greedy_context=greedy_context, greedy_seconds=round(runs[0].decode_s, 2))
    _identity_fields(record, runs[0], runs[1], logits_out)


def _compile_counters() -> dict:
    """What Dynamo and Inductor did in this process: graphs, graph breaks, recompilations, skipped CUDA graphs."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0)}


def _measure_decoding(model, tokenizer, device, record: dict, *, decode: str, new_tokens: int, decode_runs: int,
                      greedy_context: int, logits_out, profile_trace, profile_steps: int) -> None:
    """Greedy decoding in one ``DECODE_MODES`` mode: two runs with logits (the first compiles), ``decode_runs``
    more timed, the median tokens/s of all but the first; the physical limit beside it; a profile if asked."""
    ids = prompt_ids(tokenizer, greedy_context, device)
    counted = _compile_counters()  # process-wide counters: this mode's share is the difference
    graphs = None
    if decode in ("generate", "generate-static"):
        static = decode == "generate-static"

        def run(keep_logits: bool):
            return decoding.plain_greedy(model, ids, new_tokens, static_cache=static, keep_logits=keep_logits)
    else:
        tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=DECODE_MODES[decode]))
        record["hooks_removed"] = tuned.hooks_removed
        graphs = tuned.graphs

        def run(keep_logits: bool):
            return tuned.greedy(ids, new_tokens, keep_logits=keep_logits)
    _reset_peak(device)
    try:
        first = run(True)
        second = run(True)
        timed = [second] + [run(False) for _ in range(decode_runs)]
    except torch.OutOfMemoryError:
        record["greedy_oom"] = True
        return
    speeds = sorted(r.tokens_per_s for r in timed)
    record.update(greedy_context=greedy_context, first_run_s=round(first.prefill_s + first.decode_s, 2),
                  decode_tokens_per_s=round(speeds[len(speeds) // 2], 2),
                  decode_tokens_per_s_runs=[round(v, 2) for v in speeds],
                  prefill_s=round(second.prefill_s, 4), **_peaks(device),
                  compile={key: value - counted[key] for key, value in _compile_counters().items()}
                  if DECODE_MODES[decode] else None)
    if graphs is not None:
        record["cuda_graphs"] = {"captured": graphs.captured, "replayed": graphs.replayed, "phases": len(graphs.phases)}
    if len({json.dumps(r.tokens) for r in (first, *timed)}) != 1:
        record["greedy_unstable"] = True
    _identity_fields(record, first, second, logits_out)
    read = decode_bytes_per_token(record["model"], record["quant"], record["ple"] or "gpu", greedy_context + new_tokens)
    try:
        bandwidth = copy_bandwidth(device)
        record.update(copy_bandwidth_bytes_per_s=round(bandwidth), bytes_read_per_token=read,
                      bandwidth_limit_tokens_per_s=round(bandwidth / read, 1))
    except torch.OutOfMemoryError:
        record.update(bytes_read_per_token=read, copy_bandwidth_bytes_per_s=None)
    if profile_trace is not None:
        steps = min(profile_steps, new_tokens)

        def profiled():
            if decode in ("generate", "generate-static"):
                decoding.plain_greedy(model, ids, steps, static_cache=decode == "generate-static")
            else:  # on the timed runs' cache, so what is profiled is replays, not a capture
                tuned.greedy(ids, steps, cache_length=greedy_context + new_tokens)
        record["profile"] = decoding.profile(profiled, profile_trace, steps, device).as_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id, folder or synthetic name (default $GEMMA_MODEL or tiny)")
    parser.add_argument("--quant", default="nf4")
    parser.add_argument("--route", choices=ROUTES, required=True)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, action="append", default=[], help="prefill length (repeatable)")
    parser.add_argument("--card-gb", type=float, default=None, help="simulate a card of this many GB")
    parser.add_argument("--decode-runs", type=int, default=1, help="median decode speed over this many runs after a warm-up")
    parser.add_argument("--search-max-context", action="store_true", help="bisect the largest context that runs")
    parser.add_argument("--logits-out", type=Path, default=None, help="save the greedy run's logits (torch.save) here")
    parser.add_argument("--path", choices=PATHS, default=None, help="long prompts: chunked prefill, plain or tuned")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK, help="prefill chunk of --path (tokens)")
    parser.add_argument("--decode", choices=sorted(DECODE_MODES), default=None, help="time greedy decoding in this mode")
    parser.add_argument("--greedy-context", type=int, default=32, help="prompt length of the greedy runs")
    parser.add_argument("--profile-trace", type=Path, default=None, help="write a torch.profiler Chrome trace here")
    parser.add_argument("--profile-steps", type=int, default=16, help="decode steps the profile covers")
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    args = parser.parse_args(argv)
    reproducible_kernels()  # before the first cuBLAS call
    if not torch.cuda.is_available():
        print("helpers.measure needs a CUDA GPU; run it on a GPU machine (or Colab with a GPU runtime).")
        return 2
    record = measure(
        args.model, args.quant, args.route, new_tokens=args.new_tokens, contexts=args.context, card_gb=args.card_gb,
        decode_runs=args.decode_runs, search_max_context=args.search_max_context, logits_out=args.logits_out,
        path=args.path, prefill_chunk=args.prefill_chunk, decode=args.decode, greedy_context=args.greedy_context,
        profile_trace=args.profile_trace, profile_steps=args.profile_steps,
    )
    record.update(environment(), command=" ".join(["python -m helpers.measure", *(argv or sys.argv[1:])]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.json, json.dumps(record, indent=1))
    summary = {k: v for k, v in record.items() if k not in ("greedy_tokens", "versions")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
