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

from . import cards, loading, models, placement, quantization
from .errors import CourseError
from .host_memory import PeakSampler, peak_rss_bytes
from .planner import largest_true
from .records import environment
from .weights import meta_model

# cuBLAS picks reduction orders run to run unless its workspace is fixed: without this, two greedy runs
# of one model in one process drifted apart on the H200 (PyTorch's reproducibility notes)
DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
ROUTES = ("ple-gpu", "ple-cpu", "post-load", "cpu-entry", "no-flag", "ple-cpu-nudged", "ple-cpu-fp16")
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


def self_consistent_steps(first: torch.Tensor, second: torch.Tensor) -> int:
    """How many leading steps two runs of the same model agree on bit for bit. On the H200, E4B-shaped
    NF4 agrees with itself only up to about 256 positions (tools/determinism_probe.py): a comparison
    of two placements can claim identity only where each placement is identical to itself."""
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


def prefill_peak(model, tokenizer, context: int, device, new_tokens: int = 1) -> dict:
    """Peak GPU memory and speed of one ``generate`` prefill of ``context`` tokens (and
    ``new_tokens`` - 1 decoded after it); ``{"context", "oom": True, ...}`` when it runs out of memory."""
    ids = prompt_ids(tokenizer, context, device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        _generate_exactly(model, ids, new_tokens)
        torch.cuda.synchronize(device)
        # peak reserved is what a memory cap limits: allocated plus the allocator's fragmentation
        return {"context": context, "peak_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "tokens_per_s": round(context / (time.perf_counter() - began), 1)}
    except torch.OutOfMemoryError:
        # device_free_bytes tells a card-sized limit apart from a GPU shared with other processes
        return {"context": context, "oom": True, "device_free_bytes": torch.cuda.mem_get_info(device)[0]}
    finally:
        del ids
        torch.cuda.empty_cache()


def memory_readout(device) -> dict:
    """Three views of GPU memory: what tensors hold (allocated), what PyTorch's caching allocator
    holds (reserved), and what the whole device has in use, as nvidia-smi shows it (every process,
    plus each process's CUDA context)."""
    counters = gpu_memory(device)
    free, total = torch.cuda.mem_get_info(device)
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


def fits_context(model, tokenizer, context: int, device, decode_tokens: int = 8) -> bool:
    """Does a prefill of ``context`` tokens plus a few decoded ones run without running out of memory?"""
    return not prefill_peak(model, tokenizer, context, device, new_tokens=decode_tokens).get("oom")


def measure(source, quant: str, route: str, *, device: int = 0, new_tokens: int = 256, contexts=(), card_gb=None,
            decode_runs: int = 1, search_max_context: bool = False, max_context_limit: int | None = None,
            logits_out: Path | None = None):
    """Measure one route in this process. ``decode_runs`` > 1 adds a warm-up run and reports the
    median decode speed; ``search_max_context`` bisects the largest context that prefills and decodes,
    up to ``max_context_limit`` (default: the model's ``max_position_embeddings``); ``logits_out`` keeps
    the greedy run's logits for a bit-for-bit comparison with another route."""
    path = models.resolve(source)  # once; a synthetic checkpoint is built before any card-sized cap
    torch.cuda.init()
    index, device = device, torch.device("cuda", device)
    if card_gb is not None:
        cards.simulate(card_gb, device)
    record = {"route": route, "quant": quant, "model": str(source), "card_gb": card_gb,
              "ple": route.split("-")[1] if route.startswith("ple-") else None,
              "config_sha256": config_sha256(path)}
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        with PeakSampler() as host_load:
            model = _load(route, path, quant, index)
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
    tokenizer = loading.load_tokenizer(path)
    nudge = (ple_row_nudged(model, int(prompt_ids(tokenizer, 32, "cpu")[0, -1])) if route == "ple-cpu-nudged"
             else contextlib.nullcontext())
    with nudge:
        _measure_loaded(model, tokenizer, device, record, new_tokens=new_tokens, contexts=contexts, decode_runs=decode_runs,
                        logits_out=logits_out)
        if search_max_context:
            text_config = getattr(model.config, "text_config", model.config)
            limit = max_context_limit or text_config.max_position_embeddings
            record["max_context"] = largest_true(512, limit, lambda context: fits_context(model, tokenizer, context, device))
            record["max_context_limit"] = limit
    record["host_process_peak_bytes"] = peak_rss_bytes()
    return record


def _measure_loaded(model, tokenizer, device, record: dict, *, new_tokens: int, contexts, decode_runs: int, logits_out):
    record["prefill"] = [prefill_peak(model, tokenizer, context, device) for context in contexts]
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
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    args = parser.parse_args(argv)
    for key, value in DETERMINISTIC_CUBLAS.items():
        os.environ.setdefault(key, value)  # before the first cuBLAS call
    if not torch.cuda.is_available():
        print("helpers.measure needs a CUDA GPU; run it on a GPU machine (or Colab with a GPU runtime).")
        return 2
    record = measure(
        args.model, args.quant, args.route, new_tokens=args.new_tokens, contexts=args.context, card_gb=args.card_gb,
        decode_runs=args.decode_runs, search_max_context=args.search_max_context, logits_out=args.logits_out,
    )
    record.update(environment(), command=" ".join(["python -m helpers.measure", *(argv or sys.argv[1:])]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    summary = {k: v for k, v in record.items() if k not in ("greedy_tokens", "versions")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
