"""The course's benchmark: a grid of configurations, each measured in a fresh process on a GPU,
recorded under data/measurements/, with PLE-on-CPU vs PLE-on-GPU ratios from the same run.

    python -m lab.bench quick              # or: memory, cards, speed
    python -m lab.bench memory --jobs 4    # configurations side by side (memory only, no timings)
    python -m lab.bench memory --dry-run   # list what a preset would run
    python -m lab.bench long-context       # peak vs context, plain and tuned; 128k on an 8 GB card
    python -m lab.bench decode-speed       # plain generate vs the tuned decode, logits compared

Each configuration runs ``python -m lab.measure`` in its own process, so an out-of-memory
error is recorded as a result and cannot poison the next one. Records accumulate: every run
appends one JSON line per configuration to ``data/measurements/<model>.jsonl``.

Presets with named configurations (the ``long-context`` and ``decode`` ones) compare a configuration with the one
it names as ``reference``, from the same run: logits bit for bit over the steps where both agree with themselves
(``measure.self_consistent_steps``), or within the rounding bound where it ``rounds_differently`` (Inductor's
kernels); a ``control`` must be told apart from its reference.

``--jobs N`` runs N configurations at once. Allocator statistics are per process, so memory
figures stay exact; speeds do not (the processes share the GPU), so a record made with N > 1
keeps its timing keys set to null and says ``concurrent_jobs``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from helpers import models
from helpers.cards import SIMULATED_CARDS_GB
from helpers.errors import CourseError, InvalidChoiceError
from helpers.long_context import DEFAULT_CHUNK, longest_prompt
from helpers.measure import compare_logits, compare_rounding
from helpers.paths import BUILD_DIR, MEASUREMENTS_DIR
from helpers.placement import PLACEMENTS
from helpers.records import LONG_CONTEXTS, SCHEMA, every_record, judged_difference, plain_generate_rate, rounding_sentence, speed_record

from .measure import DECODE_MODES, FUSED_NORM_MODES
from .records import HOST_PEAK_KEYS

MODELS = ("e4b-shape", "e2b-shape")
MEMORY_CONTEXTS = (512, 1024, 2048, 4096, 8500, 16384, 32768)
# the goal's conversation fills E4B's 131,072 positions: the longest prompt that leaves room for 32 decoded tokens
GOAL_NEW_TOKENS = 32
GOAL_PROMPT = longest_prompt(LONG_CONTEXTS[-1], GOAL_NEW_TOKENS)
TRACES_DIR = BUILD_DIR / "traces"  # torch.profiler traces (large; not committed)


@dataclass(frozen=True)
class Configuration:
    model: str
    quant: str
    ple: str
    card_gb: float | None = None
    contexts: tuple = ()
    new_tokens: int = 64
    decode_runs: int = 1
    search_max_context: bool = False
    route: str = ""  # a lab.measure route other than the course loader's ple-<ple>, e.g. cpu-entry
    name: str = ""  # unique within a preset; configurations compared by name rather than by placement
    path: str = ""  # long prompts: "plain" or "tuned" chunked prefill (measure --path)
    prefill_chunk: int = DEFAULT_CHUNK
    decode: str = ""  # a measure.DECODE_MODES mode (measure --decode)
    greedy_context: int = 32  # prompt length of the greedy runs
    keep_logits: bool = False  # keep the greedy logits for a comparison
    reference: str = ""  # the name of the configuration whose logits these must equal
    control: bool = False  # deliberately broken: its logits must differ from the reference's
    rounds_differently: bool = False  # other kernels (Inductor's): within rounding of the reference, not equal
    profile: bool = False  # also write a torch.profiler trace of decode steps
    allocator: str = ""  # PYTORCH_ALLOC_CONF for the process, e.g. "expandable_segments:True"

    @property
    def measured_route(self) -> str:
        return self.route or f"ple-{self.ple}"

    def trace_path(self, preset: str) -> Path:
        return TRACES_DIR / f"{preset}-{self.model}-{self.name or self.measured_route}.json"

    def command(self, json_path, logits_path=None, trace_path=None) -> list:
        cmd = [sys.executable, "-m", "lab.measure", "--model", self.model, "--quant", self.quant,
               "--route", self.measured_route, "--new-tokens", str(self.new_tokens),
               "--decode-runs", str(self.decode_runs), "--json", str(json_path)]
        if logits_path is not None:
            cmd += ["--logits-out", str(logits_path)]
        if self.path:
            cmd += ["--path", self.path, "--prefill-chunk", str(self.prefill_chunk)]
        if self.decode:
            cmd += ["--decode", self.decode]
        if self.greedy_context != 32:
            cmd += ["--greedy-context", str(self.greedy_context)]
        if trace_path is not None:
            cmd += ["--profile-trace", str(trace_path)]
        for context in self.contexts:
            cmd += ["--context", str(context)]
        if self.card_gb is not None:
            cmd += ["--card-gb", str(self.card_gb)]
        if self.search_max_context:
            cmd.append("--search-max-context")
        return cmd


def _long_context() -> list:
    """E4B NF4, PLE on the CPU: peak against context for the plain and the tuned chunked prefill (prefills only),
    then the goal: a prompt and 32 more tokens filling the model's 131,072 positions on an 8 GB card, logits equal
    to the same code uncapped beside a control that must differ, and the plain path on the same card for contrast."""
    on = {"model": "e4b-shape", "quant": "nf4", "ple": "cpu"}
    return [Configuration(**on, name="plain", path="plain", contexts=LONG_CONTEXTS, new_tokens=0),
            Configuration(**on, name="tuned", path="tuned", contexts=LONG_CONTEXTS, new_tokens=0),
            Configuration(**on, name="tuned-128k", path="tuned", greedy_context=GOAL_PROMPT, new_tokens=GOAL_NEW_TOKENS,
                          keep_logits=True),
            Configuration(**on, name="tuned-128k-8gb", card_gb=8, path="tuned", greedy_context=GOAL_PROMPT,
                          new_tokens=GOAL_NEW_TOKENS, keep_logits=True, reference="tuned-128k"),
            # the control beside that identity: the same capped run with one PLE row one bf16 ulp off
            Configuration(**on, card_gb=8, name="tuned-128k-8gb-nudged", route="ple-cpu-nudged", path="tuned",
                          greedy_context=GOAL_PROMPT, new_tokens=GOAL_NEW_TOKENS, keep_logits=True, reference="tuned-128k",
                          control=True),
            Configuration(**on, name="plain-128k-8gb", card_gb=8, path="plain", contexts=(LONG_CONTEXTS[-1],), new_tokens=0)]


def _long_context_cards(cards: tuple, plain: bool) -> list:
    """The largest context that prefills (chunked) and decodes 8 tokens on each card, tuned (and plain)."""
    on = {"model": "e4b-shape", "quant": "nf4", "ple": "cpu", "new_tokens": 0, "search_max_context": True}
    return ([Configuration(**on, name=f"tuned-{card}gb", card_gb=card, path="tuned") for card in cards]
            + ([Configuration(**on, name=f"plain-{cards[0]}gb", card_gb=cards[0], path="plain"),
                # the allocator setting: segments that grow in place instead of new blocks (less fragmentation);
                # the plain path's growing torch.cat history is where fragmentation can cost tokens
                Configuration(**on, name=f"tuned-{cards[0]}gb-expandable", card_gb=cards[0], path="tuned",
                              allocator="expandable_segments:True"),
                Configuration(**on, name=f"plain-{cards[0]}gb-expandable", card_gb=cards[0], path="plain",
                              allocator="expandable_segments:True")] if plain else []))


def _long_context_small_cards() -> list:
    """The largest context on the cards below 8 GB, tuned: E4B text only on 4 GB (the planner's choice there), E4B
    with the PLE on the CPU on 6 GB, and E2B with the PLE on the CPU on 4 GB, its smallest card."""
    on = {"quant": "nf4", "ple": "cpu", "new_tokens": 0, "search_max_context": True, "path": "tuned"}
    return [Configuration("e4b-shape", **on, name="tuned-4gb-text-only", card_gb=4, route="text-only"),
            Configuration("e4b-shape", **on, name="tuned-6gb", card_gb=6),
            Configuration("e2b-shape", **on, name="tuned-4gb", card_gb=4)]


def _decode(model="e4b-shape", ple="cpu", quant="nf4", **settings) -> Configuration:
    return Configuration(model, quant, ple, new_tokens=256, keep_logits=True, **settings)


def presets() -> dict:
    """Named parts of the grid, each meant to finish within 10 minutes on one H200 (their estimates are checked in
    tests/test_bench.py)."""
    return {
        "quick": [Configuration("e4b-shape", "nf4", ple, contexts=(512, 2048)) for ple in PLACEMENTS],
        "memory": [Configuration(model, quant, ple, contexts=MEMORY_CONTEXTS, new_tokens=32)
                   for model in MODELS for quant in ("bf16", "int8", "nf4") for ple in PLACEMENTS],
        "cards": [Configuration(model, "nf4", ple, card_gb=card, new_tokens=16, search_max_context=True)
                  for model in MODELS for card in SIMULATED_CARDS_GB for ple in PLACEMENTS],
        "speed": [Configuration(model, "nf4", ple, contexts=(512, 4096), new_tokens=32, decode_runs=3)
                  for model in MODELS for ple in PLACEMENTS]
        # the naive "cpu" device-map entry, for the time per token it costs (slow: few tokens)
        + [Configuration("e4b-shape", "nf4", "cpu", contexts=(512,), new_tokens=8, route="cpu-entry")],
        "long-context": _long_context(),
        "long-context-8gb": _long_context_cards(SIMULATED_CARDS_GB[:1], plain=True),
        "long-context-cards": _long_context_cards(SIMULATED_CARDS_GB[1:], plain=False),
        "long-context-small-cards": _long_context_small_cards(),
        # plain generate, its static-cache twin (the identity reference), the tuned decode in CUDA graphs of the
        # eager kernels, and the control: the tuned loop with one PLE row nudged by one bf16 ulp
        "decode-speed": [_decode(name="generate", decode="generate", profile=True),
                         _decode(name="generate-static", decode="generate-static"),
                         _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                         _decode(name="loop-nudged", decode="loop", route="ple-cpu-nudged",
                                 reference="generate-static", control=True)],
        # the eager tuned loop (hooks removed, static cache, nothing compiled) and Inductor's fused kernels
        "decode-speed-inductor": [_decode(name="generate-static", decode="generate-static"),
                                  _decode(name="loop", decode="loop", reference="generate-static"),
                                  _decode(name="reduce-overhead", decode="reduce-overhead", reference="generate-static",
                                          rounds_differently=True, profile=True)],
        # the same settings with the PLE on the GPU and under an 8 GB cap (plain generate both capped and not: what
        # the cap alone costs), and on E2B
        "decode-speed-more": [_decode(ple="gpu", name="e4b-gpu-generate", decode="generate"),
                              _decode(ple="gpu", name="e4b-gpu-cudagraphs", decode="cudagraphs"),
                              _decode(name="e4b-cpu-generate", decode="generate"),
                              _decode(name="e4b-cpu-generate-8gb", decode="generate", card_gb=8),
                              _decode(name="e4b-cpu-cudagraphs-8gb", decode="cudagraphs", card_gb=8)],
        # the host-free step (the token, its rows, positions and masks on the GPU) beside today's CUDA-graph step in
        # one run, with its control (one PLE row one bf16 ulp off); then under the 8 GB cap and on bf16
        "decode-host-free": [_decode(name="generate", decode="generate"),
                             _decode(name="generate-static", decode="generate-static"),
                             _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                             _decode(name="host-free", decode="host-free", reference="generate-static", profile=True),
                             _decode(name="host-free-nudged", decode="host-free", route="ple-cpu-nudged",
                                     reference="generate-static", control=True)],
        # the host-free step with each norm in one kernel (helpers.exact_norm) beside today's CUDA-graph step in one
        # run, with its control
        "decode-fused-norms": [_decode(name="generate", decode="generate", profile=True),
                               _decode(name="generate-static", decode="generate-static"),
                               _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                               _decode(name="host-free-fused", decode="host-free-fused", reference="generate-static",
                                       profile=True),
                               _decode(name="host-free-fused-nudged", decode="host-free-fused", route="ple-cpu-nudged",
                                       reference="generate-static", control=True)],
        # every norm, rotary embedding and block end fused (the norm swap had skipped the hooked ones), then each
        # gelu and its product too, beside today's CUDA-graph step in one run, with the control on the most fused;
        # plain generate is in decode-fused-norms
        "decode-fused": [_decode(name="generate-static", decode="generate-static"),
                         _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                         _decode(name="host-free-fused-layers", decode="host-free-fused-layers",
                                 reference="generate-static", profile=True),
                         _decode(name="host-free-fused-all", decode="host-free-fused-all", reference="generate-static",
                                 profile=True),
                         _decode(name="host-free-fused-all-nudged", decode="host-free-fused-all",
                                 route="ple-cpu-nudged", reference="generate-static", control=True)],
        # the fused-all step with each NF4 projection in bitsandbytes' order (helpers.exact_nf4) beside today's
        # CUDA-graph step in one run, with its control; then under the 8 GB cap (bf16 has no NF4 layer to swap)
        "decode-gemv": [_decode(name="generate-static", decode="generate-static"),
                        _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                        _decode(name="host-free-fused-gemv", decode="host-free-fused-gemv", reference="generate-static",
                                profile=True),
                        _decode(name="host-free-fused-gemv-nudged", decode="host-free-fused-gemv",
                                route="ple-cpu-nudged", reference="generate-static", control=True)],
        "decode-gemv-8gb": [_decode(name="host-free-fused-gemv-8gb", decode="host-free-fused-gemv", card_gb=8)],
        # issue 31's modes, each beside the CUDA-graph step of its own run (one device call each): plain generate, the
        # fused step before and after its cache writes were joined, and the newest with its control; then the newest
        # under the 8 GB cap and on bf16 (Inductor on the host-free step is decode-host-free-inductor's)
        "decode-goal": [_decode(name="generate", decode="generate", profile=True),
                        _decode(name="generate-static", decode="generate-static"),
                        _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static", profile=True),
                        _decode(name="host-free-fused-gemv", decode="host-free-fused-gemv", reference="generate-static",
                                profile=True),
                        _decode(name="host-free-fused-cache", decode="host-free-fused-cache", reference="generate-static",
                                profile=True),
                        _decode(name="host-free-fused-cache-nudged", decode="host-free-fused-cache",
                                route="ple-cpu-nudged", reference="generate-static", control=True)],
        "decode-goal-cards": [_decode(name="cudagraphs", decode="cudagraphs", profile=True),
                              _decode(name="host-free-fused-cache-8gb", decode="host-free-fused-cache", card_gb=8,
                                      profile=True),
                              _decode(name="host-free-fused-cache-bf16", decode="host-free-fused-cache", quant="bf16",
                                      profile=True)],
        # Inductor's kernels in the host-free step's own graph, held to the rounding rule, beside today's CUDA-graph
        # step of the same run (the host-free step alone is decode-host-free's)
        "decode-host-free-inductor": [_decode(name="generate-static", decode="generate-static"),
                                      _decode(name="cudagraphs", decode="cudagraphs", reference="generate-static",
                                              profile=True),
                                      _decode(name="host-free-inductor", decode="host-free-inductor",
                                              reference="generate-static", rounds_differently=True, profile=True)],
        "decode-host-free-more": [_decode(name="host-free-8gb", decode="host-free", card_gb=8),
                                  _decode(name="host-free-bf16", decode="host-free", quant="bf16"),
                                  _decode(name="host-free-fused-all-8gb", decode="host-free-fused-all", card_gb=8),
                                  _decode(name="host-free-fused-all-bf16", decode="host-free-fused-all", quant="bf16")],
        "decode-speed-e2b": [_decode(model="e2b-shape", name="e2b-cpu-generate", decode="generate"),
                             _decode(model="e2b-shape", name="e2b-cpu-cudagraphs", decode="cudagraphs")],
    }


# --- how long a preset takes on one H200: the recorded speeds (the speed preset) and these assumptions ---------
PROCESS_START_S = 15  # python, torch, transformers and the CUDA context, per configuration (assumed)
# Dynamo; one capture per phase; Inductor (assumed), in its graphs or in the course's
COMPILE_S = {"eager": 60, "cudagraphs": 10, "reduce-overhead": 240, "inductor": 240}
# the exact kernels' Triton builds in a fresh process, from the machine's on-disk cache: the first fused step of a
# process took 16-17 s on the H100 (2026-12-07); a machine's very first build took 138 s on the H200, once
TRITON_JIT_S = 20
ATTENTION_HALF_AT = 65536  # prefill: attention assumed to cost as much as the rest at this context
STATIC_ATTENTION = 2  # a static cache attends over its whole length at every chunk
# the profiler's overhead and its Chrome trace (70-140 MB for 16 steps of E4B): decode-speed took 385 s on the
# H200 where the estimate without this said 354 (2026-11-30)
PROFILE_S = 25


def estimate_seconds(config: Configuration, directory: Path = MEASUREMENTS_DIR) -> float:
    """An upper estimate of one configuration's time on the GPU the speed preset ran on: its recorded load time,
    prefill tokens/s at 4,096 and decode tokens/s (the slowest recorded run of the same decode mode, and a mode
    never recorded no faster than plain generate), with the assumptions above. Raises FileNotFoundError without
    speed records."""
    try:
        record = speed_record(config.model, f"ple-{config.ple}", config.quant, directory)
    except FileNotFoundError:  # only NF4 is timed by the speed preset: its speeds stand in
        record = speed_record(config.model, f"ple-{config.ple}", "nf4", directory)
    rate = next(p["tokens_per_s"] for p in record["prefill"] if p["context"] == 4096)
    attention = STATIC_ATTENTION if config.path == "tuned" else 1

    def prefill(n: int) -> float:
        return n / rate * (1 + attention * n / ATTENTION_HALF_AT)

    seconds = PROCESS_START_S + record["load_s"] + sum(prefill(n) for n in config.contexts)
    if config.search_max_context:  # bisection to 512 tokens: the two ends, then about log2(limit / 512) midpoints
        limit = models.load_config(config.model).get_text_config().max_position_embeddings
        seconds += prefill(512) + prefill(limit) + 8 * prefill(limit // 2)
    if config.new_tokens:
        runs = 2 + config.decode_runs if config.decode else 2
        decode_rate = _slowest_decode_rate(config, directory) or record["decode_tokens_per_s"]
        seconds += runs * (prefill(config.greedy_context) + config.new_tokens / decode_rate)
    if config.decode:
        seconds += COMPILE_S.get(DECODE_MODES[config.decode], 0) + TRITON_JIT_S * (config.decode in FUSED_NORM_MODES)
    if config.profile:
        seconds += PROFILE_S
    return seconds


def _slowest_decode_rate(config: Configuration, directory: Path) -> float | None:
    """The slowest decode tokens/s any recorded run of ``config``'s decode mode, model and quantization reached."""
    if not config.decode:
        return None
    rates = [record["decode_tokens_per_s"] for record in every_record(directory)
             if record.get("decode") == config.decode and record.get("decode_tokens_per_s")
             and record["configuration"]["model"] == config.model and record["configuration"]["quant"] == config.quant]
    return min(rates, default=None)


TIMING_KEYS = ("decode_tokens_per_s", "seconds_per_token")
# every record carries these, null where nothing was measured (a load that ran out of memory, a crash)
RECORD_KEYS = ("model", "quant", "ple", "card_gb", "config_sha256", "gpu", "versions", "resident_bytes", "reserved_bytes",
               "peak_load_bytes", "prefill", "max_context", "decode_tokens_per_s", "greedy_sha256", "greedy_distinct_tokens",
               "logits_sha256", *HOST_PEAK_KEYS, "command", "date")


def without_timings(record: dict, jobs: int) -> dict:
    """Null the speeds of a record measured beside other processes on the same GPU."""
    for key in TIMING_KEYS:
        if key in record:
            record[key] = None
    for point in record.get("prefill", []):
        if "tokens_per_s" in point:
            point["tokens_per_s"] = None
    record["concurrent_jobs"] = jobs
    return record


def run_in_fresh_process(config: Configuration, timeout_s: float = 540, logits_dir: Path | None = None,
                         preset: str = "") -> dict:
    """One configuration in its own ``python -m lab.measure`` process; its logits (``keep_logits``) go to
    ``logits_dir`` for the comparisons, its profile trace to ``build/traces/``."""
    logits = Path(logits_dir) / f"{config.name or config.measured_route}.pt" if config.keep_logits and logits_dir else None
    trace = config.trace_path(preset) if config.profile else None
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "record.json"
        env = {**os.environ, "PYTORCH_ALLOC_CONF": config.allocator} if config.allocator else None
        try:
            done = subprocess.run(config.command(target, logits, trace), timeout=timeout_s, capture_output=True, text=True,
                                  env=env)
        except subprocess.TimeoutExpired:
            return {"crashed": f"timed out after {timeout_s:.0f} s"}
        if done.returncode != 0 or not target.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"crashed": f"exit {done.returncode}: {last[0][:300]}"}
        record = json.loads(target.read_text())
    if logits is not None and logits.is_file():
        record["logits_file"] = str(logits)
    return record


_APPEND_LOCK = threading.Lock()  # with --jobs, whole lines from one thread at a time


def append_record(record: dict, directory: Path = MEASUREMENTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{record['configuration']['model']}.jsonl"
    kept = {key: value for key, value in record.items() if key != "logits_file"}  # a scratch file, gone after the run
    kept["schema"] = SCHEMA
    with _APPEND_LOCK, open(target, "a+b") as handle:
        handle.seek(0)
        text = handle.read()
        if text and not text.endswith(b"\n"):  # a line a kill cut short: the records end at the last newline
            handle.truncate(text.rfind(b"\n") + 1)
        handle.write((json.dumps(kept, sort_keys=True) + "\n").encode())
    return target


def identity(reference: dict | None, candidate: dict, config: Configuration) -> dict:
    """The candidate's logits against its reference's, bit for bit over the steps where each agrees with itself;
    for a control, whether it was told apart. Never claims identity it could not check."""
    result = {"reference": config.reference, "control": config.control, "compared": False}
    files = [(record or {}).get("logits_file") for record in (reference, candidate)]
    if not all(files) or not all(Path(f).is_file() for f in files):
        result["why_not"] = "no logits to compare (a crash, an out-of-memory error, or the reference did not run)"
        return result
    first, second = torch.load(files[0]), torch.load(files[1])
    steps = min(reference.get("self_consistent_steps") or 0, candidate.get("self_consistent_steps") or 0,
                len(first), len(second))
    if steps == 0:
        result["why_not"] = "no step on which both runs agree with themselves"
        return result
    compared = compare_logits(first, second, steps)
    result.update(compared=True, steps=steps, identical=compared["identical"], first_difference=compared["first_difference"],
                  max_abs_diff=compared["max_abs_diff"], distinct_tokens=reference.get("greedy_distinct_tokens"))
    if config.control:
        result["told_apart"] = not compared["identical"]
    if config.rounds_differently:
        result["rounding"] = compare_rounding(first, second, steps)
        # the bound's own control: the reference against itself one step late, what a cache one position off
        # would give, must fall outside it on these very logits, or the bound could not catch a real fault
        result["rounding_control_caught"] = not compare_rounding(first[1:steps], first[:steps - 1])["within_rounding"]
    return result


def identity_failures(records: list) -> list:
    """Sentences for every comparison that went wrong: a configuration that should equal its reference and
    does not, or a control its reference cannot be told apart from."""
    failures = []
    for record in records:
        check = record.get("identity")
        if not check or not check.get("compared"):
            continue
        name = record["configuration"].get("name")
        rounding = check.get("rounding")
        if check["control"] and not check["told_apart"]:
            failures.append(f"control {name} gave the same logits as {check['reference']}: the comparison proves nothing")
        elif rounding is not None:
            if not rounding["within_rounding"]:
                failures.append(f"{name} is further from {check['reference']} than rounding: {judged_difference(rounding)}"
                                f" over the {rounding['compared_steps']} steps before their "
                                f"tokens part, against a bound of {rounding['bound']} x the reference's spread "
                                f"{rounding['reference_std']:.3g}")
            if not check["rounding_control_caught"]:
                failures.append(f"{check['reference']}'s logits one step late are within rounding of themselves: "
                                f"the bound beside {name} proves nothing")
        elif not check["control"] and not check["identical"]:
            failures.append(f"{name} differs from {check['reference']} at step {check['first_difference']} "
                            f"(max |diff| {check['max_abs_diff']:.3g}) within {check['steps']} self-consistent steps")
    return failures


@dataclass
class Comparison:
    """PLE on CPU against PLE on GPU, for one model, quantization and card, from the same run."""
    model: str
    quant: str
    card_gb: float | None
    ratios: dict = field(default_factory=dict)
    greedy_match: bool | None = None
    logits_match: bool | None = None  # every step's logits bit for bit (their sha256), the real identity check
    distinct_tokens: int | None = None  # of the PLE-on-GPU greedy run: a run that repeats one token proves little


def _ratio(numerator, denominator):
    return round(numerator / denominator, 3) if numerator and denominator else None


def compare(records: list) -> list:
    by_key: dict = {}
    for record in records:
        config = record["configuration"]
        if config.get("route") or config.get("name"):
            continue  # only the course loader's two placements are compared (named configurations by name)
        by_key.setdefault((config["model"], config["quant"], config["card_gb"]), {})[config["ple"]] = record
    comparisons = []
    for (model, quant, card), pair in sorted(by_key.items(), key=lambda item: str(item[0])):
        gpu, cpu = pair.get("gpu"), pair.get("cpu")
        if gpu is None or cpu is None:
            continue
        comparison = Comparison(model, quant, card)
        comparison.ratios["resident"] = _ratio(cpu.get("resident_bytes"), gpu.get("resident_bytes"))
        comparison.ratios["decode_speed"] = _ratio(cpu.get("decode_tokens_per_s"), gpu.get("decode_tokens_per_s"))
        gpu_prefill = {p["context"]: p for p in gpu.get("prefill", [])}
        for point in cpu.get("prefill", []):
            other = gpu_prefill.get(point["context"], {})
            comparison.ratios[f"peak@{point['context']}"] = _ratio(point.get("peak_bytes"), other.get("peak_bytes"))
            comparison.ratios[f"prefill_speed@{point['context']}"] = _ratio(point.get("tokens_per_s"), other.get("tokens_per_s"))
        if cpu.get("max_context") is not None or gpu.get("max_context") is not None:
            comparison.ratios["max_context"] = (gpu.get("max_context"), cpu.get("max_context"))
        if gpu.get("greedy_sha256") and cpu.get("greedy_sha256"):
            comparison.greedy_match = gpu["greedy_sha256"] == cpu["greedy_sha256"]
        if gpu.get("logits_sha256") and cpu.get("logits_sha256"):
            comparison.logits_match = gpu["logits_sha256"] == cpu["logits_sha256"]
        comparison.distinct_tokens = gpu.get("greedy_distinct_tokens")
        comparisons.append(comparison)
    return comparisons


def run_preset(name: str, *, runner=None, directory: Path = MEASUREMENTS_DIR, command: str = "", jobs: int = 1) -> tuple:
    """Run every configuration of a preset (``jobs`` at a time), append its records as each one
    finishes, and compare the placements (named configurations: each with its reference)."""
    configurations = presets()[name]
    if jobs > 1 and any(c.reference or c.decode for c in configurations):
        raise InvalidChoiceError(f"The {name} preset times decoding and compares each configuration with one run before it: "
                          f"run it with --jobs 1.")
    with tempfile.TemporaryDirectory() as scratch:
        return _run_configurations(name, configurations, runner or functools.partial(
            run_in_fresh_process, logits_dir=Path(scratch), preset=name), directory, command, jobs)


def _run_configurations(name, configurations, runner, directory, command, jobs) -> tuple:
    finished: dict = {}

    def run_one(numbered):
        number, config = numbered
        label = f"{config.model} {config.quant} {config.name or config.measured_route} card={config.card_gb}"
        print(f"[{number}/{len(configurations)}] {label}: started", flush=True)
        record = runner(config)
        if config.reference:
            record["identity"] = identity(finished.get(config.reference), record, config)
        if config.name:
            finished[config.name] = record
        if jobs > 1:
            without_timings(record, jobs)
        record.update(configuration=asdict(config), preset=name, command=command or f"python -m lab.bench {name}",
                      recorded_at=datetime.datetime.now().isoformat(timespec="seconds"))
        record.pop("greedy_tokens", None)  # the hash and the count stay
        record.update({key: record.get(key, getattr(config, key, None)) for key in RECORD_KEYS})
        record.update(prefill=record["prefill"] or [], date=record["date"] or record["recorded_at"][:10])
        append_record(record, directory)
        print(f"[{number}/{len(configurations)}] {label}: {record.get('crashed') or record.get('load_error') or 'done'}", flush=True)
        return record

    if jobs > 1:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            records = list(pool.map(run_one, enumerate(configurations, 1)))
    else:
        records = [run_one(item) for item in enumerate(configurations, 1)]
    return records, compare(records)


def summary_lines(records: list) -> list:
    """One line per named configuration: what it measured, and its ratio to plain generate where there is one."""
    named = {r["configuration"]["name"]: r for r in records if r["configuration"].get("name")}
    lines = []
    for name, record in named.items():
        parts = [name]
        if record.get("crashed") or record.get("load_error"):
            parts.append(record.get("crashed") or record.get("load_error"))
        for point in record.get("prefill") or []:
            parts.append(f"{point['context']}: " + ("OOM" if point.get("oom") else f"{point['peak_bytes'] / 1e9:.2f} GB"))
            card = record["configuration"].get("card_gb")
            if card and (point.get("peak_reserved_bytes") or 0) > card * 1e9:
                parts.append(f"reserved {point['peak_reserved_bytes'] / 1e9:.2f} GB: the {card:g} GB cap was NOT enforced")
        if record.get("max_context") is not None:
            parts.append(f"largest context {record['max_context']}")
        if record.get("greedy_oom"):
            parts.append("greedy run out of memory")
        card = record["configuration"].get("card_gb")
        if card and (record.get("peak_generate_reserved_bytes") or 0) > card * 1e9:
            parts.append(f"greedy run reserved {record['peak_generate_reserved_bytes'] / 1e9:.2f} GB: the cap was NOT enforced")
        if record.get("decode_tokens_per_s"):
            plain = plain_generate_rate(record, named.values())
            ratio = f", {record['decode_tokens_per_s'] / plain:.2f}x plain generate" if plain else ""
            parts.append(f"{record['decode_tokens_per_s']} tokens/s{ratio}, bandwidth limit "
                         f"{record.get('bandwidth_limit_tokens_per_s')} tokens/s")
        skipped = (record.get("compile") or {}).get("cudagraph_skips")
        if skipped:
            parts.append(f"CUDA graphs skipped {skipped} time(s)")
        if record.get("identity", {}).get("compared"):
            check = record["identity"]
            verdict = ("told apart" if check["told_apart"] else "NOT told apart") if check["control"] else (
                "identical" if check["identical"] else f"differs at step {check['first_difference']}")
            if check.get("rounding"):
                verdict += f" ({rounding_sentence(check)})"
            parts.append(f"logits vs {check['reference']} over {check['steps']} steps: {verdict}")
        lines.append("; ".join(parts))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=sorted(presets()))
    parser.add_argument("--dry-run", action="store_true", help="list the configurations and exit")
    parser.add_argument("--estimate", action="store_true", help="estimate each configuration's seconds on the GPU and exit")
    parser.add_argument("--jobs", type=int, default=1,
                        help="configurations measured at once (memory figures only: speeds are nulled when > 1)")
    args = parser.parse_args(argv)
    if args.dry_run:
        for config in presets()[args.preset]:
            logits = "<logits.pt>" if config.keep_logits else None
            prefix = f"PYTORCH_ALLOC_CONF={config.allocator} " if config.allocator else ""
            print(prefix + " ".join(config.command("<record.json>", logits,
                                                   config.trace_path(args.preset) if config.profile else None)[1:]))
        return 0
    if args.estimate:
        total = 0.0
        for config in presets()[args.preset]:
            seconds = estimate_seconds(config)
            total += seconds
            print(f"{config.name or config.measured_route:<24} {seconds:6.0f} s")
        print(f"{'total':<24} {total:6.0f} s (recorded speeds of the speed preset; assumptions in lab/bench.py)")
        return 0
    if not torch.cuda.is_available():
        print("lab.bench measures GPU memory and speed: run it on a CUDA machine.")
        return 2
    for model in sorted({config.model for config in presets()[args.preset]}):
        # built here with one progress bar; the jobs would wait on the build lock in silence
        print(f"checkpoint {model}: {models.resolve(model)}", flush=True)
    try:
        records, comparisons = run_preset(args.preset, jobs=args.jobs,
                                          command="python -m lab.bench " + " ".join(argv or sys.argv[1:]))
    except CourseError as err:
        print(err, file=sys.stderr)
        return 2
    crashed = [r for r in records if "crashed" in r]
    for line in summary_lines(records):
        print(line)
    failures = identity_failures(records)
    for failure in failures:
        print(f"FAILED: {failure}")
    for comparison in comparisons:
        print(f"{comparison.model} {comparison.quant} card={comparison.card_gb}: PLE on CPU / on GPU = {comparison.ratios}; "
              f"logits identical: {comparison.logits_match}, greedy identical: {comparison.greedy_match} "
              f"({comparison.distinct_tokens} distinct tokens)")
    mismatched = [c for c in comparisons if c.greedy_match is False or c.logits_match is False]
    if failures:
        return 1
    if mismatched or crashed:
        print(f"FAILED: {len(mismatched)} logits or greedy mismatch(es), {len(crashed)} crashed configuration(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
