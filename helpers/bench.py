"""The course's benchmark: a grid of configurations, each measured in a fresh process on a GPU,
recorded under data/measurements/, with PLE-on-CPU vs PLE-on-GPU ratios from the same run.

    python -m helpers.bench quick              # or: memory, cards, speed
    python -m helpers.bench memory --jobs 4    # configurations side by side (memory only, no timings)
    python -m helpers.bench memory --dry-run   # list what a preset would run

Each configuration runs ``python -m helpers.measure`` in its own process, so an out-of-memory
error is recorded as a result and cannot poison the next one. Records accumulate: every run
appends one JSON line per configuration to ``data/measurements/<model>.jsonl``.

``--jobs N`` runs N configurations at once. Allocator statistics are per process, so memory
figures stay exact; speeds do not (the processes share the GPU), so a record made with N > 1
keeps its timing keys set to null and says ``concurrent_jobs``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import models
from .cards import SIMULATED_CARDS_GB
from .paths import MEASUREMENTS_DIR
from .placement import PLACEMENTS

MODELS = ("e4b-shape", "e2b-shape")
MEMORY_CONTEXTS = (512, 1024, 2048, 4096, 8500, 16384, 32768)


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
    route: str = ""  # a helpers.measure route other than the course loader's ple-<ple>, e.g. cpu-entry

    @property
    def measured_route(self) -> str:
        return self.route or f"ple-{self.ple}"

    def command(self, json_path, logits_path=None) -> list:
        cmd = [sys.executable, "-m", "helpers.measure", "--model", self.model, "--quant", self.quant,
               "--route", self.measured_route, "--new-tokens", str(self.new_tokens),
               "--decode-runs", str(self.decode_runs), "--json", str(json_path)]
        if logits_path is not None:
            cmd += ["--logits-out", str(logits_path)]
        for context in self.contexts:
            cmd += ["--context", str(context)]
        if self.card_gb is not None:
            cmd += ["--card-gb", str(self.card_gb)]
        if self.search_max_context:
            cmd.append("--search-max-context")
        return cmd


def presets() -> dict:
    """Named parts of the grid, each meant to finish within 10 minutes on one H200."""
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
    }


TIMING_KEYS = ("decode_tokens_per_s", "seconds_per_token")
# every record carries these, null where nothing was measured (a load that ran out of memory, a crash)
RECORD_KEYS = ("model", "quant", "ple", "card_gb", "config_sha256", "gpu", "versions", "resident_bytes", "reserved_bytes",
               "peak_load_bytes", "prefill", "max_context", "decode_tokens_per_s", "greedy_sha256", "greedy_distinct_tokens",
               "logits_sha256", "host_load_anon_peak_bytes", "host_load_file_peak_bytes", "host_generate_anon_peak_bytes",
               "host_generate_file_peak_bytes", "command", "date")


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


def run_in_fresh_process(config: Configuration, timeout_s: float = 540) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "record.json"
        try:
            done = subprocess.run(config.command(target), timeout=timeout_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"crashed": f"timed out after {timeout_s:.0f} s"}
        if done.returncode != 0 or not target.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"crashed": f"exit {done.returncode}: {last[0][:300]}"}
        return json.loads(target.read_text())


_APPEND_LOCK = threading.Lock()  # with --jobs, whole lines from one thread at a time


def append_record(record: dict, directory: Path = MEASUREMENTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{record['configuration']['model']}.jsonl"
    with _APPEND_LOCK, open(target, "a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
    return target


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
        if config.get("route"):
            continue  # only the course loader's two placements are compared
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


def run_preset(name: str, *, runner=run_in_fresh_process, directory: Path = MEASUREMENTS_DIR, command: str = "",
               jobs: int = 1) -> tuple:
    """Run every configuration of a preset (``jobs`` at a time), append its records as each one
    finishes, and compare the placements."""
    configurations = presets()[name]

    def run_one(numbered):
        number, config = numbered
        label = f"{config.model} {config.quant} {config.measured_route} card={config.card_gb}"
        print(f"[{number}/{len(configurations)}] {label}: started", flush=True)
        record = runner(config)
        if jobs > 1:
            without_timings(record, jobs)
        record.update(configuration=asdict(config), preset=name, command=command or f"python -m helpers.bench {name}",
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=sorted(presets()))
    parser.add_argument("--dry-run", action="store_true", help="list the configurations and exit")
    parser.add_argument("--jobs", type=int, default=1,
                        help="configurations measured at once (memory figures only: speeds are nulled when > 1)")
    args = parser.parse_args(argv)
    if args.dry_run:
        for config in presets()[args.preset]:
            print(" ".join(config.command("<record.json>")[1:]))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("helpers.bench measures GPU memory and speed: run it on a CUDA machine.")
        return 2
    for model in sorted({config.model for config in presets()[args.preset]}):
        # built here with one progress bar; the jobs would wait on the build lock in silence
        print(f"checkpoint {model}: {models.resolve(model)}", flush=True)
    records, comparisons = run_preset(args.preset, jobs=args.jobs, command="python -m helpers.bench " + " ".join(argv or sys.argv[1:]))
    crashed = [r for r in records if "crashed" in r]
    for comparison in comparisons:
        print(f"{comparison.model} {comparison.quant} card={comparison.card_gb}: PLE on CPU / on GPU = {comparison.ratios}; "
              f"logits identical: {comparison.logits_match}, greedy identical: {comparison.greedy_match} "
              f"({comparison.distinct_tokens} distinct tokens)")
    mismatched = [c for c in comparisons if c.greedy_match is False or c.logits_match is False]
    if mismatched or crashed:
        print(f"FAILED: {len(mismatched)} logits or greedy mismatch(es), {len(crashed)} crashed configuration(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
