"""Measure one placement route in this process: memory after load, peak during load and
prefill, greedy tokens and their hash. Run each route in a fresh process so that peaks and
out-of-memory errors cannot leak into the next one:

    python -m lab.measure --model e4b-shape --quant nf4 --route ple-cpu --json out.json

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
  text-only      the planner's text-only choice (``planner.TEXT_ONLY``): the PLE, the towers and the token table
                 on the CPU, a quantized head on the GPU; what E4B runs on a 4 GB card

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
  host-free        the CUDA-graph step fed by the GPU: each step's token, its PLE rows (tables read in place in
                   pinned host memory), positions and masks never wait for the host, so replays queue ahead
  host-free-inductor  the host-free step compiled by Inductor (its fused kernels, which round differently) and
                   captured in the same CUDA graph
  host-free-fused  the host-free step with each RMSNorm in one kernel that sums as ATen's CUDA mean does (helpers.exact_norm)
  host-free-fused-rotary  and each rotary embedding in one kernel that rounds as ATen's bf16 kernels do
                   (helpers.exact_rotary)
  host-free-fused-layers  and each decoder layer's norm-and-residual block ends in one kernel each
                   (helpers.exact_layer)
  host-free-fused-all  and each gelu with the product after it in one kernel
  host-free-fused-gemv  and each NF4 projection in a kernel with bitsandbytes' bits, the q, k, v and the gate, up
                   projections one launch each (helpers.exact_nf4)
  host-free-fused-cache  and each cache layer's write of the token and its counter in one launch (helpers.exact_cache)
``--profile-trace PATH`` also writes a ``torch.profiler`` Chrome trace of ``--profile-steps`` decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from helpers import cards, decoding, exact_layer, exact_nf4, exact_norm, loading, models, placement, quantization
from helpers.errors import CourseError
from helpers.host_memory import PeakSampler, peak_rss_bytes
from helpers.long_context import DEFAULT_CHUNK, LongContext, longest_prompt
from helpers.measure import (
    FIT_DECODE_TOKENS,
    fits_context,
    gpu_memory,
    greedy,
    ple_row_nudged,
    prefill_peak,
    prompt_ids,
    reproducible_kernels,
    self_consistent_steps,
)
from helpers.paths import write_text_atomically
from helpers.planner import PATHS, TEXT_ONLY, decode_bytes_per_token, largest_true
from helpers.weights import meta_model

from . import gpu_busy
from .records import environment

ROUTES = ("ple-gpu", "ple-cpu", "post-load", "cpu-entry", "no-flag", "ple-cpu-nudged", "ple-cpu-fp16", "text-only")
# --decode modes: None = plain generate; otherwise decoding.Decoder's compile setting
DECODE_MODES = {"generate": None, "generate-static": None, "loop": None, "dynamo": "eager", "cudagraphs": "cudagraphs",
                "reduce-overhead": "reduce-overhead", "host-free": "cudagraphs", "host-free-inductor": "inductor",
                "host-free-fused": "cudagraphs", "host-free-fused-rotary": "cudagraphs",
                "host-free-fused-layers": "cudagraphs", "host-free-fused-all": "cudagraphs",
                "host-free-fused-gemv": "cudagraphs", "host-free-fused-cache": "cudagraphs"}
# each fusion's modes: a mode has the fusions of those above it in the docstring's list, and its own
FUSED_CACHE_MODES = ("host-free-fused-cache",)  # decoding.Decoder(fused_cache=True)
FUSED_GEMV_MODES = ("host-free-fused-gemv", *FUSED_CACHE_MODES)  # decoding.Decoder(fused_gemv=True)
FUSED_ACTIVATION_MODES = ("host-free-fused-all", *FUSED_GEMV_MODES)  # decoding.Decoder(fused_activations=True)
FUSED_LAYER_MODES = ("host-free-fused-layers", *FUSED_ACTIVATION_MODES)  # decoding.Decoder(fused_layers=True)
FUSED_ROTARY_MODES = ("host-free-fused-rotary", *FUSED_LAYER_MODES)  # decoding.Decoder(fused_rotary=True)
FUSED_NORM_MODES = ("host-free-fused", *FUSED_ROTARY_MODES)  # decoding.Decoder(fused_norms=True)
# decoding.Decoder(host_free=True): no host read inside the loop
HOST_FREE_MODES = ("host-free", "host-free-inductor", *FUSED_NORM_MODES)


def decoder(decode: str):
    """The ``decoding.Decoder`` of a tuned ``--decode`` mode."""
    return decoding.Decoder(compile=DECODE_MODES[decode], host_free=decode in HOST_FREE_MODES,
                            fused_norms=decode in FUSED_NORM_MODES, fused_rotary=decode in FUSED_ROTARY_MODES,
                            fused_layers=decode in FUSED_LAYER_MODES,
                            fused_activations=decode in FUSED_ACTIVATION_MODES, fused_gemv=decode in FUSED_GEMV_MODES,
                            fused_cache=decode in FUSED_CACHE_MODES)


def path_settings(path: str | None, chunk: int = DEFAULT_CHUNK) -> LongContext | None:
    """The long-context settings of ``--path`` (None: the prefill is one plain forward, as before)."""
    if path is None:
        return None
    return LongContext(chunk=chunk) if path == "tuned" else LongContext.plain(chunk)

def _load(route: str, source, quant: str, device: int):
    if route in ("ple-gpu", "ple-cpu", "ple-cpu-nudged"):
        return loading.load_model(source, quant=quant, ple=route.split("-")[1], device=device)
    if route == "ple-cpu-fp16":
        return loading.load_model(source, quant=quant, ple="cpu", device=device, compute_dtype=torch.float16)
    if route == "text-only":
        _, ple, towers, head = TEXT_ONLY
        return loading.load_model(source, quant=quant, ple=ple, towers=towers, head=head, device=device)
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
        decoder(decode).check_quant(quant)  # before loading
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
        record["prefill"] = [prefill_peak(model, tokenizer, context, device, settings=settings).record()
                             for context in contexts]
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
        tuned = decoding.TunedGreedy(model, decoder(decode))
        record["hooks_removed"] = tuned.hooks_removed
        if tuned.mapped_tables:
            record["tables_read_in_place"] = tuned.mapped_tables
        if tuned.fused_norms is not None:  # of all the model's norms: a swap that missed some shows here
            record["norms_fused"] = {"fused": len(tuned.fused_norms.modules), "of": len(exact_norm.norm_modules(model))}
        if tuned.fused_layers is not None:  # likewise for the decoder layers whose block ends were joined
            record["layers_fused"] = {"fused": len(tuned.fused_layers.modules), "of": len(exact_layer.layer_modules(model))}
        if decode in FUSED_GEMV_MODES:  # the kernel's geometry: its speed depends on it, its bits do not
            record["gemv_tile"] = exact_nf4.tile()
        graphs = tuned.graphs

        def run(keep_logits: bool):
            return tuned.greedy(ids, new_tokens, keep_logits=keep_logits)
    _reset_peak(device)
    busy = None
    try:
        first = run(True)
        second = run(True)
        busy = gpu_busy.Sampler.open(device)  # the runs without logits kept: what the tokens/s figure times

        def sampled():
            result = run(False)
            if busy is not None:
                busy.decoded(result.decode_s)
            return result
        timed = [second] + [sampled() for _ in range(decode_runs)]
        while busy is not None and busy.wants_more():  # enough whole sample periods; these runs are not timed
            sampled()
    except torch.OutOfMemoryError:
        record["greedy_oom"] = True
        return
    finally:
        if busy is not None:
            record["gpu_busy_sampled"] = busy.result()
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
        print("lab.measure needs a CUDA GPU; run it on a GPU machine (or Colab with a GPU runtime).")
        return 2
    record = measure(
        args.model, args.quant, args.route, new_tokens=args.new_tokens, contexts=args.context, card_gb=args.card_gb,
        decode_runs=args.decode_runs, search_max_context=args.search_max_context, logits_out=args.logits_out,
        path=args.path, prefill_chunk=args.prefill_chunk, decode=args.decode, greedy_context=args.greedy_context,
        profile_trace=args.profile_trace, profile_steps=args.profile_steps,
    )
    record.update(environment(), command=" ".join(["python -m lab.measure", *(argv or sys.argv[1:])]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.json, json.dumps(record, indent=1))
    summary = {k: v for k, v in record.items() if k not in ("greedy_tokens", "versions")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
