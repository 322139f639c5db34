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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from . import loading, models, placement, quantization
from .errors import CourseError
from .planner import largest_true
from .records import environment
from .weights import meta_model

ROUTES = ("ple-gpu", "ple-cpu", "post-load", "cpu-entry", "no-flag")
PROMPT_TEXT = "The per-layer embedding table is a lookup, so only the rows of these tokens are read. "


def prompt_ids(tokenizer, length: int, device) -> torch.Tensor:
    """Exactly ``length`` token ids from a fixed text (works for real and synthetic tokenizers)."""
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    repeated = (ids * (length // max(len(ids), 1) + 1))[: length - 1]
    return torch.tensor([[tokenizer.bos_token_id, *repeated]], device=device)


def _generate_exactly(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` (no early stop at an end-of-turn token)."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)


def greedy(model, tokenizer, new_tokens: int, prompt_length: int = 32) -> dict:
    """Greedy-decode exactly ``new_tokens`` after a fixed prompt; tokens, their hash and the time."""
    device = placement.compute_device_of(model)  # not the PLE table's device, which may be the CPU
    ids = prompt_ids(tokenizer, prompt_length, device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    out = _generate_exactly(model, ids, new_tokens)
    synchronize()
    tokens = out[0, ids.shape[1]:].tolist()
    return {
        "tokens": tokens,
        "sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "seconds_per_token": (time.perf_counter() - started) / len(tokens),
    }


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
    if route in ("ple-gpu", "ple-cpu"):
        return loading.load_model(source, quant=quant, ple=route.split("-")[1], device=device)
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
            decode_runs: int = 1, search_max_context: bool = False, max_context_limit: int | None = None):
    """Measure one route in this process. ``decode_runs`` > 1 adds a warm-up run and reports the
    median decode speed; ``search_max_context`` bisects the largest context that prefills and decodes,
    up to ``max_context_limit`` (default: the model's ``max_position_embeddings``)."""
    path = models.resolve(source)  # once; a synthetic checkpoint is built with the whole GPU, before any card-sized cap
    torch.cuda.init()
    index, device = device, torch.device("cuda", device)
    if card_gb is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, card_gb * 1e9 / total), device)
    record = {"route": route, "quant": quant, "model": str(source), "card_gb": card_gb,
              "ple": route.split("-")[1] if route.startswith("ple-") else None,
              "config_sha256": config_sha256(path)}
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
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
        placement=placement.report(model).as_dict()["bytes_by_device"],
    )
    tokenizer = loading.load_tokenizer(path)

    record["prefill"] = [prefill_peak(model, tokenizer, context, device) for context in contexts]

    if new_tokens:
        torch.cuda.reset_peak_memory_stats(device)
        runs = [greedy(model, tokenizer, new_tokens) for _ in range(decode_runs + (1 if decode_runs > 1 else 0))]
        timed = runs[1:] if decode_runs > 1 else runs  # the first of several is the warm-up
        speeds = sorted(1 / r["seconds_per_token"] for r in timed)
        decoded = runs[0]
        if len({r["sha256"] for r in runs}) != 1:
            record["greedy_unstable"] = True  # the same greedy run gave different tokens: a bug, not noise
        record.update(
            greedy_tokens=decoded["tokens"],
            greedy_token_count=len(decoded["tokens"]),
            greedy_sha256=decoded["sha256"],
            seconds_per_token=round(decoded["seconds_per_token"], 4),
            decode_tokens_per_s=round(speeds[len(speeds) // 2], 2),
            peak_generate_bytes=torch.cuda.max_memory_allocated(device),
        )

    if search_max_context:
        text_config = getattr(model.config, "text_config", model.config)
        limit = max_context_limit or text_config.max_position_embeddings
        record["max_context"] = largest_true(512, limit, lambda context: fits_context(model, tokenizer, context, device))
        record["max_context_limit"] = limit
    return record


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
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("helpers.measure needs a CUDA GPU; run it on a GPU machine (or Colab with a GPU runtime).")
        return 2
    record = measure(
        args.model, args.quant, args.route, new_tokens=args.new_tokens, contexts=args.context, card_gb=args.card_gb,
        decode_runs=args.decode_runs, search_max_context=args.search_max_context,
    )
    record.update(environment(), command=" ".join(["python -m helpers.measure", *(argv or sys.argv[1:])]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    summary = {k: v for k, v in record.items() if k not in ("greedy_tokens", "versions")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
