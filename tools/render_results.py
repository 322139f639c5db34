"""Render the course's results from the records in data/: docs/results.md, one block per record between its own
markers (``<!-- results:NAME ... -->``), and the README's headline block (what each card can do, three figures).
Only the blocks are rendered; the prose between them is written by hand, and a record with no block is refused.

    python tools/render_results.py          # rewrite both, whole or not at all
    python tools/render_results.py --check  # exit 1 if either file differs from what the records give
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone: helpers without an install
from helpers.paths import COURSE_RUNS_DIR, GPU_TIER_DIR, REPO_ROOT  # noqa: E402
from tools import record_nbval  # noqa: E402  (the one reader of nbval's JUnit files)

README = REPO_ROOT / "README.md"
RESULTS = REPO_ROOT / "docs" / "results.md"
# each block of docs/results.md sits between its own pair, named after the record it renders
BLOCK_START, BLOCK_END = "<!-- results:{} (tools/render_results.py) -->", "<!-- /results:{} -->"
BLOCK_NAME = re.compile(r"<!-- results:([\w.-]+) \(tools/render_results\.py\) -->")
HEADLINE_START, HEADLINE_END = "<!-- headline:start (tools/render_results.py) -->", "<!-- headline:end -->"
ROUTE_LABELS = {
    "ple-gpu": "`load_model(ple=\"gpu\")`: `device_map={\"\": 0}`",
    "ple-cpu": "`load_model(ple=\"cpu\")`: per-module map, hook off, lookup on CPU",
    "post-load": "`ple=\"gpu\"`, then `offload_ple(model)`",
    "cpu-entry": "naive: `\"cpu\"` entry in the map, accelerate hook left on",
    "no-flag": "naive: `\"cpu\"` entry without `llm_int8_enable_fp32_cpu_offload`",
    "ple-cpu-nudged": "the control: `ple=\"cpu\"` with one PLE row one bf16 ulp off",
    "ple-cpu-fp16": "`ple=\"cpu\"`, 4-bit compute in fp16 (what a T4 runs)",
}


def gb(value) -> str:
    return f"{value / 1e9:.2f}"


def seconds_per_token(record: dict) -> str:
    value = record.get("seconds_per_token")
    return f"{value:.3f}" if value is not None else "-"


def identity_verdict(record: dict) -> str:
    """What the GPU tier's bit-for-bit comparison of logits against PLE on GPU found."""
    comparison = record.get("logits_vs_ple_gpu")
    if comparison is None:
        return "not compared"
    if comparison["identical"]:
        return f"logits identical at all {comparison['steps']} steps compared"
    where = comparison.get("first_difference")
    return (f"logits differ over {comparison['steps']} steps" + (f", from step {where}" if where is not None else "")
            + f" (max abs difference {comparison['max_abs_diff']:.3g})")


def render_record_set(name: str, records: dict) -> str:
    reference = records.get("ple-gpu", {})
    any_record = next(iter(records.values()))
    context = next((p["context"] for p in reference.get("prefill", [])), None)
    # a side-by-side run nulls its timings; the column then goes, and the Speed table has them
    timed = any(r.get("seconds_per_token") is not None for r in records.values() if r)
    timing_header = " s/token |" if timed else ""
    lines = [
        f"**{name}** on {any_record['gpu']} ({any_record['date']}; torch {any_record['versions']['torch']}, "
        f"transformers {any_record['versions']['transformers']}, bitsandbytes {any_record['versions']['bitsandbytes']}), "
        f"quantization `{any_record['quant']}`. GB = 10^9 bytes.",
        "",
        f"| route | allocated after load | reserved | peak during load | peak, {context:,}-token prefill "
        f"|{timing_header} vs PLE on GPU, bit for bit |" if context
        else f"| route | allocated | reserved | peak load | peak prefill |{timing_header} vs PLE on GPU |",
        "|---|---|---|---|---|" + "---|" * (2 if timed else 1),
    ]
    for route, label in ROUTE_LABELS.items():
        record = records.get(route)
        if record is None:
            continue
        if "load_error" in record:
            lines.append(f"| {label} | refused: `{record['load_error'][:60]}...` | | | |" + " |" * (2 if timed else 1))
            continue
        prefill = record["prefill"][0] if record.get("prefill") else None
        if prefill is None:
            peak = ""
        elif prefill.get("oom"):
            peak = "OOM"
        else:
            peak = f"{gb(prefill['peak_bytes'])}" + ("" if prefill["context"] == context else f" ({prefill['context']} tokens)")
        if route == "ple-cpu-fp16":
            same = f"not meant to match (fp16 compute); every logit finite: {record.get('logits_finite')}"
        elif route == "ple-gpu":
            distinct = record.get("greedy_distinct_tokens")
            same = "reference" + (f" ({distinct} distinct tokens in {record['greedy_token_count']})" if distinct else "")
        else:
            same = identity_verdict(record)
        lines.append(
            f"| {label} | {gb(record['resident_bytes'])} | {gb(record['reserved_bytes'])} | "
            f"{gb(record['peak_load_bytes'])} | {peak} |" + (f" {seconds_per_token(record)} |" if timed else "") + f" {same} |"
        )
    command = ""
    if "ple-cpu" in records:
        command = "GPU_RECORD=1 make test-gpu-tier`, which runs `" + records["ple-cpu"]["command"].split(" --json")[0]
    how = ("one fresh process per route" if timed else
           "one fresh process per route, all side by side (so no timings here: see Speed)")
    lines += ["", f"Recorded by `{command}`, {how}." if command else ""]
    return "\n".join(lines).rstrip()


def card_order(label: str) -> float:
    return float(label.split()[0]) if label != "uncapped" else float("inf")


def render_notebooks(record: dict) -> str:
    cards = record.get("cards") or {"uncapped": record["notebooks"]}
    labels = sorted(cards, key=card_order)
    names = sorted({name for card in cards.values() for name in card})
    lines = ["| notebook | " + " | ".join(label if label == "uncapped" else f"{label} card" for label in labels) + " |",
             "|---|" + "---|" * len(labels)]
    stale = 0
    for name in names:
        cells, current = [], record_nbval.code_hash(name)
        for label in labels:
            entry = cards[label].get(name)
            old = entry is not None and entry.get("code_sha") != current
            stale += old
            cells.append("not run" if entry is None else
                         f"{entry['result']} {entry['passed']}/{entry['passed'] + entry['failed']}"
                         + (f", {entry['seconds']:.0f} s" if "seconds" in entry else "") + (", stale" if old else ""))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    entries = [entry for card in cards.values() for entry in card.values()]
    runs = sorted({(e["gpu"], e["date"], e["versions"]["transformers"], e["versions"]["bitsandbytes"], e["command"])
                   for e in entries})
    lines.append("")
    if stale:
        lines += [f"*stale* ({stale} of {len(entries)}): the notebook's code has changed since that run, or the run is older "
                  "than the stamp that tells; `python tools/card_sweep.py --todo` names the parts to rerun.", ""]
    lines += [f"On {gpu}, {date}, transformers {tf}, bitsandbytes {bnb}: `{command}`." for gpu, date, tf, bnb, command in runs]
    # a JUnit file outlives its run: name only the cells of notebooks whose entry in force failed on that card
    failed = [f"- {label}, `{name}` {cell}: `{why}`" for label in labels for name, cell, why in failed_cells(record["model"], label)
              if cards[label].get(name, {}).get("result") == "fail"]
    if failed:
        lines += ["", "Cells that failed, from the JUnit files kept beside the record:", *failed]
    return "\n".join(lines)


ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")


def failed_cells(model: str, label: str) -> list:
    """(notebook, cell, the exception line or the failing assertion) from one card's JUnit files in data/gpu-tier."""
    card = "uncapped" if label == "uncapped" else label.split()[0]
    found = []
    for junit in sorted(GPU_TIER_DIR.glob(f"notebooks-{model}-{card}-*.nbval.xml")):
        for notebook, cell, outcome, _, failure in record_nbval.cells(junit):
            if outcome != "failed":
                continue
            text = ANSI.sub("", failure).splitlines()
            errors = [line for line in text if re.match(r"^[A-Za-z_.]+(Error|Exception)\b", line)]
            arrows = [line.split(" ", 2)[-1].strip() for line in text if line.startswith("---->")]
            why = errors[-1] if errors and not errors[-1].rstrip().endswith(":") else (arrows[-1] if arrows else "?")
            found.append((notebook, cell.lower(), why[:240]))
    return found


def placement_verdict(gpu: dict, cpu: dict) -> str:
    """What two benchmark records of the same configuration say about the two placements."""
    count = gpu.get("greedy_token_count")
    if gpu.get("logits_sha256") and cpu.get("logits_sha256"):
        same = "identical" if gpu["logits_sha256"] == cpu["logits_sha256"] else "DIFFER"
        return f"logits {same} ({count} steps, {gpu.get('greedy_distinct_tokens')} distinct tokens)"
    if gpu.get("greedy_sha256") and cpu.get("greedy_sha256"):
        same = "identical" if gpu["greedy_sha256"] == cpu["greedy_sha256"] else "DIFFER"
        return f"greedy tokens {same} ({count}; logits and distinct tokens not recorded)"
    return "not compared"


def render_determinism(record: dict) -> str:
    """The determinism probe's record (tools/determinism_probe.py)."""
    from helpers.records import first_difference_at as at

    found = [f"the same {record['model']} NF4 model, PLE on GPU, run again in the same process first differs: "
             f"{', '.join(at(r) for r in record['gpu_run_to_run'])} (of {record['new_tokens']} steps)",
             f"with cuDNN's attention allowed again, two runs first differ: {at(record['cudnn_attention_run_to_run'])}",
             f"PLE on CPU against PLE on GPU first differs: {at(record['cpu_vs_gpu_placement'])}",
             "PLE on CPU after an 8,500-token prefill, against before it and run to run: "
             f"{at(record['cpu_after_a_long_prefill_vs_before'])}, {at(record['cpu_after_a_long_prefill_run_to_run'])}"]
    checked = [record["cpu_vs_gpu_placement"], *record["gpu_run_to_run"]]
    verdict = (f"Under these settings every run agreed with itself and the placements with each other over all "
               f"{record['new_tokens']} steps; the comparisons still count only the steps where each run agrees with "
               "itself, so a GPU or a library that repeats itself less cannot turn noise into a false difference."
               if all(r["first_differing_step"] is None for r in checked)
               else "Identity between placements is therefore checked over the steps where each agrees with itself.")
    return (f"**Is the GPU bit-reproducible?** `{record['command']}` on {record['gpu']}, {record['date']} ({record['settings']}): "
            + "; ".join(found) + ". " + verdict)


CAPTURE_PROBE = "capture-probe-"  # data/gpu-tier/capture-probe-<model>[-default].json: tools/capture_probe.py


def render_capture_probe(record: dict) -> str:
    """Each quantization as the first model of a fresh process: captured or refused, logits against generate."""
    rows = []
    for result in record["results"]:
        if "refused_before_loading" in result:
            outcome = "refused before loading: " + result["refused_before_loading"].split(" (help:")[0]
        elif "crashed" in result:
            outcome = f"crashed (exit {result['crashed']})"
        else:
            same = "identical to" if result["identical"] else "DIFFERENT from"
            outcome = (f"{'captured' if result['captured'] else 'not captured'}, logits {same} `generate` with a static "
                       f"cache ({result['distinct_tokens']} distinct tokens), {result['tokens_per_s']:g} tokens/s")
        rows.append(f"| {result['case']} | {result.get('kernels', 'reproducible')} | {outcome} |")
    model = record["results"][0]["model"]
    own = [r for r in record["results"] if r["case"].endswith("-own-stream") and "captured" in r]
    if own:
        verdict = ("captured too: the first-capture failure reported earlier did not recur here" if all(r["captured"] for r in own)
                   else "failed to capture: the warm-up stream is what makes it work")
        rows += ["", "On a stream of its own (where the course captured before it moved the capture onto the warm-up "
                 f"stream) the bf16 step {verdict}."]
    return "\n".join([f"**The CUDA-graph step as the first model of a fresh process** ({model}, `{record['command'].split(' --out')[0]}`, "
                      f"{record['date']}):", "", "| case | kernels | outcome |", "|---|---|---|", *rows])


TRIM_PROBE = "static-cache-trim-"  # data/gpu-tier/static-cache-trim-<model>.json: tools/static_cache_trim_probe.py


def render_trim_probe(model: str, record: dict) -> str:
    """The static cache cut to the written positions, against plain and the tuned path as it is (a probe)."""
    runs = [name for name in ("plain", "tuned", "tuned-trimmed", "tuned-trimmed-again", "control-one-short") if name in record]
    positions = record["prompt_tokens"] + record["new_tokens"] - 1
    command = record.get("command", f"python tools/static_cache_trim_probe.py {model} {positions} {record['new_tokens']}")
    lines = [f"**A probe: the static cache cut to the written positions** (`{command}` on {record['device']}"
             + (f", {record['date']}" if record.get("date") else "") + f"; one process, uncapped, a {record['prompt_tokens']:,}-"
             f"token prompt and {record['new_tokens']} tokens decoded; not part of the tuned path). The tuned path's "
             "full-attention layers attend over the whole preallocated cache at every prefill chunk, unwritten positions "
             "only masked; cut, they attend over what is written:", "",
             "| run | seconds, prefill and decode | peak allocated | peak reserved |", "|---|---|---|---|"]
    lines += [f"| {name} | {record[name]['seconds']} | {record[name].get('peak_gb', '-')} | {record[name].get('reserved_gb', '-')} |"
              for name in runs]

    def verdict(a, b):
        check = record[f"{a} vs {b}"]
        return "identical" if check["identical"] else f"differ (max |diff| {check['max_abs_diff']:.3g})"

    cut, whole = record["tuned-trimmed"], record["tuned"]
    lines += ["", f"Logits over the decoded steps: cut against plain `generate`, {verdict('tuned-trimmed', 'plain')}; "
              f"the tuned path as it is against plain, {verdict('tuned', 'plain')}; cut, run again, "
              f"{verdict('tuned-trimmed', 'tuned-trimmed-again')}; the control, cut one position short, "
              f"{verdict('control-one-short', 'tuned-trimmed')}. Cut, it ran {whole['seconds'] / cut['seconds']:.2f}x as fast as the "
              f"tuned path as it is ({cut['seconds']} s against {whole['seconds']})"
              + (f", at {cut['peak_gb'] - whole['peak_gb']:.2f} GB more peak allocated and {cut['reserved_gb']} GB reserved "
                 f"against {whole['reserved_gb']}" if "peak_gb" in cut else "")
              + f"; the probe does not run under a card's cap, so whether the cut still fits {positions:,} positions on an 8 GB "
              "card is not measured here, and the tuned path stays as it is."]
    return "\n".join(lines)


def _peak_at(record, context):
    point = next((p for p in record.get("prefill", []) if p["context"] == context), None)
    if point is None:
        return ""
    return "OOM" if point.get("oom") else gb(point["peak_bytes"])


def render_benchmark() -> str:
    from helpers import cards, planner, records
    from lab import bench

    latest = records.latest_records()
    if not latest:
        return "_No benchmark records yet: run `make bench PRESET=memory` (and cards, speed) on a GPU._"
    any_record = latest[0]
    v = any_record["versions"]
    lines = [f"**Benchmark** (`make bench`, records in `data/measurements/`) on {any_record['gpu']}, torch {v['torch']}, "
             f"transformers {v['transformers']}, bitsandbytes {v['bitsandbytes']}. Peak = `max_memory_allocated` "
             "during a `generate` prefill. GB = 10^9 bytes.", "",
             "| model | quant | resident, PLE on GPU / CPU | peak 8,500 tokens, GPU / CPU | peak 32,768 tokens, GPU / CPU "
             "| PLE on GPU vs CPU |", "|---|---|---|---|---|---|"]
    for model in bench.MODELS:
        for quant in ("bf16", "int8", "nf4"):
            pair = {r["configuration"]["ple"]: r for r in latest if r.get("preset") == "memory"
                    and r["configuration"]["model"] == model and r["configuration"]["quant"] == quant}
            if set(pair) != {"gpu", "cpu"}:
                continue
            gpu, cpu = pair["gpu"], pair["cpu"]
            same = placement_verdict(gpu, cpu)
            lines.append(f"| {model} | {quant} | {gb(gpu['resident_bytes'])} / {gb(cpu['resident_bytes'])} | "
                         f"{_peak_at(gpu, 8500)} / {_peak_at(cpu, 8500)} | {_peak_at(gpu, 32768)} / {_peak_at(cpu, 32768)} | "
                         f"{same} |")
    memory_command = next((r["command"] for r in latest if r.get("preset") == "memory"), "")
    lines += ["", f"Recorded by `{memory_command}`.", ""]

    card_records = [r for r in latest if r.get("preset") == "cards"]
    if card_records:
        calibration = planner.load_calibration()
        lines += ["Largest context that prefills and decodes 8 tokens on a simulated card (the process capped with "
                  "`torch.cuda.set_per_process_memory_fraction`; bisection to 512 tokens), NF4, and what the planner "
                  "(`helpers.planner.fits`) expects, with the typical allocator margin, and promises to be safe, with the "
                  "largest margin any card needed:", "",
                  "| model | card | PLE on GPU: measured / expected / safe | PLE on CPU: measured / expected / safe |",
                  "|---|---|---|---|"]
        for model in bench.MODELS:
            for card in cards.SIMULATED_CARDS_GB:
                cells = []
                for ple in ("gpu", "cpu"):
                    record = next((r for r in card_records if r["configuration"]["model"] == model
                                   and r["configuration"]["card_gb"] == card and r["configuration"]["ple"] == ple), None)
                    if record is None:
                        cells.append("")
                        continue
                    verdict = planner.fits(model, card, "nf4", ple, calibration=calibration)
                    predicted = (f"{verdict.max_context:,} / {verdict.safe_context:,}" if verdict.loads
                                 else "does not load")
                    measured = f"{record['max_context']:,}" if record.get("max_context") else (
                        "does not load" if record.get("load_oom") else "none")
                    cells.append(f"{measured} / {predicted}")
                lines.append(f"| {model} | {card} GB | {cells[0]} | {cells[1]} |")
        cards_command = card_records[0]["command"]
        held_out = planner.holdout(latest)
        lines += ["", f"Recorded by `{cards_command}`. The planner's worst error over these records, fitted on all of "
                  "them / predicting each point from a fit without it (`planner.holdout`): prefill peak "
                  f"{held_out['peak'][0]:.1%} / {held_out['peak'][1]:.1%}, expected largest context "
                  f"{held_out['largest context'][0]:.1%} / {held_out['largest context'][1]:.1%}.", ""]

    speed = [r for r in latest if r.get("preset") == "speed"]
    if speed:
        lines += ["Speed, NF4, one process at a time (decode: median of 3 runs of 32 tokens after a warm-up):", "",
                  "| model | route | decode tokens/s | prefill tokens/s at 512 / 4,096 |", "|---|---|---|---|"]
        def speed_order(r):
            return r["configuration"]["model"], r["configuration"].get("route", ""), r["configuration"]["ple"]

        for record in sorted(speed, key=speed_order):
            c = record["configuration"]
            route = c.get("route") or f"PLE on {c['ple']}"
            rates = " / ".join(f"{p['tokens_per_s']:,.0f}" for p in record.get("prefill", []) if p.get("tokens_per_s"))
            lines.append(f"| {c['model']} | {route} | {record['decode_tokens_per_s']} | {rates} |")
        lines += ["", f"Recorded by `{speed[0]['command']}`. Ratios PLE on CPU / on GPU from the same run: "
                  + "; ".join(f"{c.model}: decode {c.ratios.get('decode_speed')}, resident {c.ratios.get('resident')}, "
                              f"greedy identical: {c.greedy_match}" for c in bench.compare(speed)) + ".", ""]

    nf4 = {r["configuration"]["ple"]: r for r in latest if r.get("preset") == "memory"
           and r["configuration"]["model"] == "e4b-shape" and r["configuration"]["quant"] == "nf4"}
    if set(nf4) == {"gpu", "cpu"}:
        planned = {ple: planner.predict("e4b-shape", "nf4", ple, 8500, keep_bf16=planner.SEED_KEEP_BF16) for ple in ("gpu", "cpu")}
        plain_forward = {ple: planner.predict("e4b-shape", "nf4", ple, 8500, keep_bf16=planner.SEED_KEEP_BF16, all_logits=True)
                         for ple in ("gpu", "cpu")}
        lines += ["**The seed issue beside ours** (E4B, NF4, GB):", "",
                  "| | seed: RTX A5000 16 GB, PLE path + towers in bf16 | ours measured: plain NF4 | planner: seed's bf16 modules "
                  "| planner: same, prefill as a plain forward (all logits) |", "|---|---|---|---|---|"]
        for ple in ("gpu", "cpu"):
            seed = planner.SEED_ISSUE[ple]
            lines.append(f"| PLE on {ple.upper()}, resident | {seed['resident_gb']} | {gb(nf4[ple]['resident_bytes'])} | "
                         f"{gb(planned[ple].resident_bytes)} | |")
            lines.append(f"| PLE on {ple.upper()}, peak 8,500-token prefill | {seed['peak_8500']} | {_peak_at(nf4[ple], 8500)} | "
                         f"{gb(planned[ple].peak_bytes)} | {gb(plain_forward[ple].peak_bytes)} |")
        lines += ["", "The resident gap is the modules the seed kept in bf16 (`" + "`, `".join(planner.SEED_KEEP_BF16) + "`): "
                  "with them the planner lands near the seed's figures. Our prefill runs through `generate`, which "
                  "computes logits for the last position only; the seed's 8.5k peak is closer to a forward that keeps "
                  "logits for every position (262,144 per token). That is an inference from the numbers: the seed "
                  "does not say how it ran the prefill."]
    return "\n".join(lines).rstrip()


def render_long_context_and_speed() -> str:
    """Long prompts and decoding speed: the planner's prediction (derived, not measured) and whatever the long-context
    and decode-speed presets have recorded; what is not measured yet says so, with the command that measures it."""
    from helpers import long_context, measure, planner, records

    lines = ["**Long prompts** (E4B-shaped, NF4, PLE on the CPU, prefill in chunks of "
             f"{long_context.DEFAULT_CHUNK:,} tokens). Plain: `generate(prefill_chunk_size=...)` as it comes; tuned: "
             "`helpers.long_context.LongContext()` (a `StaticCache`, attention without `repeat_kv`). Peak GB allocated "
             "(and reserved by PyTorch's caching allocator, uncapped):", "",
             "| context | planner, plain | planner, tuned | measured, plain | measured, tuned |", "|---|---|---|---|---|"]
    recorded = records.preset_records("long-context")
    measured = {name: {p["context"]: p for p in recorded.get(name, {}).get("prefill", [])} for name in ("plain", "tuned")}

    def cell(point) -> str:
        if point is None:
            return "not measured"
        if point.get("oom"):
            return "OOM"
        reserved = point.get("peak_reserved_bytes")
        return gb(point["peak_bytes"]) + (f" ({gb(reserved)})" if reserved else "")

    predicted = planner.chunked_peaks(records.LONG_CONTEXTS, prefill_chunk=long_context.DEFAULT_CHUNK)
    for context in records.LONG_CONTEXTS:
        cells = [cell(measured[name].get(context)) for name in ("plain", "tuned")]
        lines.append(f"| {context:,} | {gb(predicted['plain'][context])} | {gb(predicted['tuned'][context])} | {cells[0]} | {cells[1]} |")
    goal = records.long_context_goal()
    if not goal:
        lines += ["", "Not yet measured on a GPU: `make bench PRESET=long-context` (and `long-context-8gb`, "
                  "`long-context-cards`). The planner's columns come from `planner.predict(..., prefill_chunk=..., path=...)`; "
                  "its chunked terms are derived from the shapes transformers hands to attention and await these records."]
    else:
        lines += ["", f"Recorded by `{recorded['tuned-128k-8gb']['command']}`:", ""] + [f"- {line}" for line in goal]
    reached = records.largest_contexts()
    ways = sorted(dict.fromkeys(how for card in sorted(reached.values(), key=len, reverse=True) for how in card),
                  key=lambda how: how.endswith("text only"))  # the columns of the card measured most ways first
    if any("chunks" in how for how in ways):
        lines += ["", f"The largest prompt each simulated card prefilled and decoded {measure.FIT_DECODE_TOKENS} tokens after "
                  f"(bisected to 512 tokens; * stopped at the model's {records.LONG_CONTEXTS[-1]:,} positions, not at the card):", "",
                  "| card | " + " | ".join(ways) + " |", "|---" * (len(ways) + 1) + "|"]
        for card, by_way in reached.items():
            row = [("-" if way not in by_way else f"{by_way[way][0]:,}" + ("*" if by_way[way][1] else "")) for way in ways]
            lines.append(f"| {card:g} GB | " + " | ".join(row) + " |")
        lines += ["", "Recorded by `python -m lab.bench cards`, `long-context-8gb`, `long-context-cards` and "
                  "`long-context-small-cards` (text only: `planner.TEXT_ONLY`, the towers and head off the GPU). The seed "
                  "issue's 16 GB card ran out of memory at an 8,500-token prefill (PLE on the GPU, modules kept in bf16)."]
        smaller = records.largest_contexts("e2b-shape")
        if smaller:
            card = min(smaller)
            lines += ["", f"E2B-shaped on its smallest recorded card, {card:g} GB: " + "; ".join(
                f"{how}: {tokens:,} tokens" + ("*" if stopped else "") for how, (tokens, stopped) in smaller[card].items()) + "."]
        lines += render_fragmentation(reached)
    speed = records.preset_records("decode-speed")
    lines += ["", "**Decoding speed** (E4B-shaped, NF4, PLE on the CPU, batch 1, 256 tokens after a 32-token prompt):", ""]
    if not speed:
        lines.append("Not yet measured on a GPU: `make bench PRESET=decode-speed` (and `decode-speed-inductor`, "
                     "`decode-speed-more`, `decode-speed-e2b`).")
        return "\n".join(lines)
    lines.append(records.table("decode-speed").markdown())
    profiled = next((r for r in speed.values() if r.get("profile")), {})
    lines += ["", f"Recorded by `{next(iter(speed.values()))['command']}`. The profile covers {records.profile_covers(profiled)}; "
              "GPU busy is the time the GPU worked over the wall time; its Chrome trace is written "
              "under `build/traces/` (open it at https://ui.perfetto.dev)."]
    cited = records.cited_decode_speeds()
    tuned = speed.get("cudagraphs", {})
    if tuned.get("decode_tokens_per_s") and tuned.get("bandwidth_limit_tokens_per_s"):
        lines += ["", f"The CUDA-graph step reaches {tuned['decode_tokens_per_s'] / tuned['bandwidth_limit_tokens_per_s']:.1%} "
                  f"of the bandwidth limit. Beside it, {cited_speeds()} ({cited['source']})."]
    return "\n".join(lines + render_host_free() + render_fused_norms() + render_fused_step() + render_gemv_step()
                     + render_host_free_inductor() + render_goal_run() + render_decode_on_cards(tuned)
                     + render_inductor() + render_decode_elsewhere())


def render_step_run(preset: str, step: str, heading: str, not_yet: str) -> list:
    """One preset's run of a decode step beside today's CUDA-graph step of the same run, once recorded: its table, the
    command and the ratio; ``not_yet`` where the preset has not run."""
    from helpers import records

    run = records.preset_records(preset)
    if not run:
        return ["", not_yet]
    rates = {name: record.get("decode_tokens_per_s") for name, record in run.items()}
    ratio = (f" It ran {rates[step] / rates['cudagraphs']:.2f}x the CUDA-graph step of the same run."
             if rates.get(step) and rates.get("cudagraphs") else "")
    timing = records.kernel_time_share(run.get(step, {}))
    untraced = (f" Traced, a step of {step} took {timing['traced_ms']:.2f} ms, {timing['kernel_ms']:.2f} ms of it in "
                f"kernels; untraced it took {timing['untraced_ms']:.2f} ms, so its kernels fill {timing['share']:.0%} of "
                "the untraced step (the tracer's own gaps between kernels left out)." if timing else "")
    sampled, beside = records.sampled_busy(run.get(step, {})), records.sampled_busy(run.get("cudagraphs", {}))
    periods = (run.get(step) or {}).get("gpu_busy_sampled") or {}
    driver = (f" The driver's own sampler (NVML, no tracer attached) found the GPU busy {sampled:.0%} of "
              f"{step}'s timed decode ({periods['samples']} whole periods of {periods['period_ms']:g} ms)"
              + (f", against {beside:.0%} for the CUDA-graph step." if beside is not None else ".")
              if sampled is not None else "")
    return ["", heading, "", records.table(preset).markdown(), "",
            f"Recorded by `{next(iter(run.values()))['command']}`.{ratio} The profile covers "
            f"{records.profile_covers(next((r for r in run.values() if r.get('profile')), {}))}.{untraced}{driver}"]


def cited_speeds() -> str:
    """The published decode speeds of other routes, one clause each, as the results page and the README cite them."""
    from helpers import records

    return "; ".join(f"{row['route']} on an {row['gpu']}: about {row['decode_tokens_per_s']} tokens/s"
                     for row in records.cited_decode_speeds()["rows"])


def render_host_free() -> list:
    return render_step_run(
        "decode-host-free", "host-free",
        "**Decoding without the host in the loop** (`Decoder(host_free=True)`: the tables read in place from pinned host "
        "memory, the token, positions and masks on the GPU):",
        "The host-free step (`Decoder(host_free=True)`): not yet measured (`make bench PRESET=decode-host-free`).")


def render_fused_norms() -> list:
    from helpers import records

    lines = render_step_run(
        "decode-fused-norms", "host-free-fused",
        "**Each norm in one kernel** (`Decoder(host_free=True, fused_norms=True)`: the host-free step with each RMSNorm's "
        "nine kernels in one that sums as ATen's CUDA mean does):",
        "Each norm in one kernel (`Decoder(fused_norms=True)`, `helpers.exact_norm`): not yet measured "
        "(`make bench PRESET=decode-fused-norms`); `tools/exact_norm_probe.py` checks its bits per shape.")
    run = records.preset_records("decode-fused-norms")
    kernels = {name: records.kernels_per_step(run.get(name, {})) for name in ("host-free-fused", "cudagraphs")}
    if run.get("host-free-fused") and "norms_fused" not in run["host-free-fused"] and all(kernels.values()):
        lines[-1] += (f" This run predates the fix that fuses the norms accelerate had hooked: it fused only the few that "
                      f"never had a hook ({kernels['host-free-fused']:,.0f} kernels a step against the CUDA-graph step's "
                      f"{kernels['cudagraphs']:,.0f}), so its speed is the host-free step's, not the fused norms'.")
    return lines


def render_fused_step() -> list:
    return render_step_run(
        "decode-fused", "host-free-fused-all",
        "**Every norm, rotary embedding, block end and gelu in one kernel each** (`Decoder(host_free=True, "
        "fused_norms=True, fused_rotary=True, fused_layers=True)`, then `fused_activations=True`: `helpers.exact_rotary` "
        "and `helpers.exact_layer` round each step to bf16 as ATen's kernels do):",
        "Every norm, rotary embedding, block end and gelu in one kernel each (`Decoder(fused_layers=True, "
        "fused_activations=True)`): not yet measured (`make bench PRESET=decode-fused`).")


def render_gemv_step() -> list:
    return render_step_run(
        "decode-gemv", "host-free-fused-gemv",
        "**And each NF4 projection in bitsandbytes' order** (`Decoder(..., fused_gemv=True)`: `helpers.exact_nf4` sums "
        "each output as bitsandbytes' SIMT kernel does, and runs a block's q, k, v and an MLP's gate and up as one "
        "launch each):",
        "Each NF4 projection in bitsandbytes' order (`Decoder(fused_gemv=True)`, `helpers.exact_nf4`): not yet "
        "measured (`make bench PRESET=decode-gemv`); `tools/nf4_gemv_probe.py` checks its bits per shape.")


def render_host_free_inductor() -> list:
    return render_step_run(
        "decode-host-free-inductor", "host-free-inductor",
        "**Inductor on top of the host-free step** (`Decoder(host_free=True, compile=\"inductor\")`: Inductor's fused "
        "kernels captured in the step's own graph; they round differently, so the step is held to the rounding rule, "
        "not to the bits):",
        "Inductor on top of the host-free step (`Decoder(host_free=True, compile=\"inductor\")`): not yet measured "
        "(`make bench PRESET=decode-host-free-inductor`).")


def render_goal_run() -> list:
    return render_step_run(
        "decode-goal", "host-free-fused-cache",
        "**Issue 31's run** (plain `generate`, the CUDA-graph step, the fused step before and after each cache write "
        "became one launch, and the newest step's control; each ratio and GPU-busy share of one run):",
        "Issue 31's run: not yet measured (`make bench PRESET=decode-goal`).") + render_step_run(
        "decode-goal-cards", "host-free-fused-cache-8gb",
        "**The fused step under the 8 GB cap and on bf16**, beside the CUDA-graph step of the same run (bf16 has no NF4 "
        "layer to swap: its projections stay cuBLAS's):",
        "The fused step under the 8 GB cap and on bf16: not yet measured (`make bench PRESET=decode-goal-cards`).")


def render_decode_on_cards(tuned: dict) -> list:
    """The recorded steps' speeds carried to learners' cards by the planner (derived, not measured)."""
    from helpers import planner, records

    fused = records.preset_records("decode-fused")
    steps = {"CUDA-graph step": tuned, "host-free step": records.preset_records("decode-host-free").get("host-free", {}),
             "host-free step, fused norms": records.preset_records("decode-fused-norms").get("host-free-fused", {}),
             "host-free step, norms, rotary and block ends fused": fused.get("host-free-fused-layers", {}),
             "host-free step, gelus fused too": fused.get("host-free-fused-all", {}),
             "host-free step, NF4 projections joined too":
                 records.preset_records("decode-gemv").get("host-free-fused-gemv", {}),
             "host-free step, each cache write in one launch too":
                 records.preset_records("decode-goal").get("host-free-fused-cache", {})}
    if steps["host-free step, fused norms"] and "norms_fused" not in steps["host-free step, fused norms"]:
        steps = {("host-free step, few norms fused" if name == "host-free step, fused norms" else name): record
                 for name, record in steps.items()}  # see render_fused_norms
    table = planner.decode_on_cards(steps)
    if not table:
        return []
    gpus = " and ".join(sorted({record.get("gpu", "unnamed GPU") for name, record in steps.items()
                                if name in table.columns}))
    return ["", "On a learner's card (`planner.decode_range`: the recorded bytes per token at the card's bandwidth, with "
            "the recorded step's other time hidden or added in full; derived, not measured; that other time was the "
            f"{gpus} host's):", "", *table.markdown().splitlines()]


def render_fragmentation(reached: dict) -> list:
    """What the allocator setting was worth to the plain path, against the planner's figures for that card."""
    from helpers import long_context, planner

    sentences = []
    for card, by_way in reached.items():
        default = by_way.get(f"plain, chunks of {long_context.DEFAULT_CHUNK:,}")
        expandable = by_way.get(f"plain, chunks of {long_context.DEFAULT_CHUNK:,}, expandable_segments:True")
        if not (default and expandable and default[0] and expandable[0]):
            continue
        verdict = planner.fits("e4b-shape", card, "nf4", "cpu", default[0], prefill_chunk=long_context.DEFAULT_CHUNK, path="plain")
        sentences.append(
            f"On the {card:g} GB card, `PYTORCH_ALLOC_CONF=expandable_segments:True` took the plain path from {default[0]:,} "
            f"to {expandable[0]:,} tokens ({expandable[0] / default[0]:.2f}x, the same run): every chunk's `torch.cat` of "
            "the growing history asks for a larger block, and the default allocator cannot join freed blocks that lie in "
            "separate segments. The "
            f"planner brackets both: {verdict.safe_context:,} tokens with the largest fragmentation margin it measured, "
            f"{verdict.unfragmented_context:,} with none. The tuned path reached the model's limit either way: its static "
            "cache is allocated once.")
    return ["", *sentences] if sentences else []


def render_inductor() -> list:
    """Inductor's fused kernels in CUDA graphs, against generate with a static cache of the same run."""
    from helpers import records

    run = records.preset_records("decode-speed-inductor")
    reference = run.get("generate-static", {}).get("decode_tokens_per_s")
    if not run or not reference:
        return ["", "Inductor (`torch.compile(mode=\"reduce-overhead\")`): not yet measured (`make bench "
                "PRESET=decode-speed-inductor`)."]
    lines = ["", "**Inductor**, `torch.compile(mode=\"reduce-overhead\")`: fused kernels in CUDA graphs, which round "
             "differently, so they are held to rounding rather than identity (x: against generate with a static cache "
             "of the same run):", "", records.table("decode-speed-inductor").markdown()]
    lines += ["", f"Recorded by `{next(iter(run.values()))['command']}`."]
    fused = run.get("reduce-overhead", {}).get("identity", {}).get("rounding")
    if fused and not fused["within_rounding"]:
        rule = ("" if fused["statistic"] == "rms" else
                " (judged on the largest difference, the rule when this ran; the course now judges the root mean "
                "square difference, which this record does not have: the next run of the preset decides)")
        lines += ["", "Inductor's logits moved further from the eager kernels' than the course's rounding bound allows "
                  f"before the greedy tokens parted{rule}, so its speed is shown without a correctness claim; the "
                  "CUDA-graph step above replays the eager kernels and is the one with identical logits."]
    elif fused:
        lines += ["", "Inductor stayed within the rounding bound while both runs fed the model the same tokens, and its "
                  f"greedy tokens still parted at step {fused['tokens_part_at']}: where two top logits lie closer than "
                  "the rounding, the fused kernels pick the other token and the runs write different continuations. "
                  "The course's identical-logits claim rests on the CUDA-graph step above, which replays the eager "
                  "kernels."]
    return lines


def render_decode_elsewhere() -> list:
    """The tuned decode with the PLE on the GPU, under an 8 GB cap, and on E2B: each ratio against plain generate
    of the same run, placement and card, where that run has one."""
    from helpers import records

    elsewhere = records.table("decode-speed-elsewhere")
    more = records.preset_records("decode-speed-more")
    capped, uncapped = (more.get(name, {}).get("decode_tokens_per_s") for name in ("e4b-cpu-generate-8gb", "e4b-cpu-generate"))
    cap_sentence = ["", f"What the cap alone costs: plain `generate` (PLE on the CPU) ran {capped} tokens/s under the "
                    f"8 GB cap and {uncapped} uncapped in the same run (capped / uncapped {capped / uncapped:.2f})."
                    ] if capped and uncapped else []
    if not elsewhere:
        return ["", "With the PLE on the GPU, under an 8 GB cap and on E2B: not yet measured (`make bench "
                "PRESET=decode-speed-more`, `decode-speed-e2b`)."]
    return ["", "The same decode elsewhere (x: against plain `generate` of the same run, placement and card; the last "
            "column: the lowest and highest tokens/s over every recorded run of that configuration, other machines "
            "and days, which is why ratios are taken within one run):", "",
            elsewhere.markdown(),
            "", "Recorded by `python -m lab.bench decode-speed-more` (and `decode-host-free-more`, `decode-speed-e2b`).",
            *cap_sentence]


def render_gpu_run(run: dict) -> str:
    verdict = "within" if run["within_limit"] else "over"
    return (f"**`{run['command']}`**, one run: GPU tier {run['gpu_tier']}, notebooks {run['notebooks']}, "
            f"{run['seconds']} s ({verdict} the {run['limit_s']} s budget) on {run['gpu']}, {run['date']}, "
            f"transformers {run['versions']['transformers']}.")


def render_host(stem: str) -> str:
    from helpers import records

    model, quant = stem.removeprefix("host-").rsplit("-", 1)
    table, first = records.host_memory_table(model, quant), next(iter(records.gpu_tier_host(model, quant).values()))
    return "\n".join([table.markdown(), "", f"On {first['gpu']}, {first['date']}: `{table.command}`."])


def render_release_probe(probe: dict) -> str:
    steps = "; ".join(f"{s['quant']}: {gb(s['loaded']['reserved_bytes'])} reserved loaded, "
                      f"{gb(s['after_release']['reserved_bytes'])} after `release_gpu()`" for s in probe["steps"])
    return (f"**Freeing the card between models** ({probe['model']}, {probe['card_gb']:g} GB card, "
            f"`CARD_GB={probe['card_gb']:g} python tools/gpu_release_probe.py`): {steps}.")


TEXT_ONLY = "text-only-"  # data/gpu-tier/text-only-<model>.json: tests/gpu/test_text_only_gpu.py
FINE_TUNING = "fine-tuning-"  # data/gpu-tier/fine-tuning-<model>-<card>gb.json: tests/gpu/test_fine_tuning_gpu.py


TOWERS = "towers-"  # data/gpu-tier/towers-<model>.json: tests/gpu/test_towers_gpu.py


def card_runs(record: dict) -> list:
    """A GPU test's record as (label, run) for each card it ran on, beside its environment fields."""
    return [(label, run) for label, run in record.items() if isinstance(run, dict) and "card_gb" in run]


def render_towers(model: str, record: dict) -> str:
    """A picture and a sound meeting towers that wait in host memory: a visit to the GPU, the CPU, or towers living
    there."""
    lines = [f"**{model}, a picture and a sound while the towers wait in host memory** (`GPU_RECORD=1 python -m pytest "
             f"tests/gpu/test_towers_gpu.py`, {record['gpu']}, {record['date']}): NF4, `towers=\"cpu\"`, one "
             "448x448 picture through the vision tower and `embed_vision`, ten seconds of sound through the audio "
             "tower and `embed_audio`.", "",
             "| card | input | tower (GB) | visit to the GPU | run on the CPU | living on the GPU | visit peak (GB) | "
             "visit = resident, bit for bit | one-ulp control told apart | CPU vs visit (relative RMS) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, run in card_runs(record):
        for kind, found in run.items():
            if not isinstance(found, dict):  # the card's own fields; each input measured is a dict
                continue
            visited = set(found["ran"].values()) == {"visit"}
            visit = f"{found['visit_s']:.3f} s" if visited else "no room: ran on the CPU"
            same = "-" if not visited else "yes" if found["visit_identical_to_resident"] else "NO"
            lines.append(f"| {label} | {kind} | {gb(found['tower_bytes'])} | {visit} | {found['host_s']:.3f} s | "
                         f"{found['resident_s']:.3f} s | {gb(found['visit_peak_bytes'])} | {same} | "
                         f"{'yes' if not found['nudged_visit_identical'] else 'NO'} | "
                         f"{found['visit_vs_host_relative_rms']} (another {kind}: {found['other_input_relative_rms']}) |")
    return "\n".join(lines)


def render_text_only(model: str, record: dict) -> str:
    runs = card_runs(record)
    lines = [f"**{model}, text only on a small card** (`GPU_RECORD=1 python -m pytest tests/gpu/test_text_only_gpu.py`, "
             f"{record['gpu']}, {record['date']}): NF4, PLE on the CPU, an 8,192-token prompt prefilled in chunks of "
             "1,024, then 256 greedy tokens with the CUDA-graph step.", "",
             "| run | towers | head | GPU resident (GB) | peak reserved (GB) | host RSS (GB) | prefill | decode |",
             "|---|---|---|---|---|---|---|---|"]
    for label, run in runs:
        lines.append(f"| {label} | {run['towers']} | {run['head']} | {gb(run['resident_bytes'])} | "
                     f"{gb(run['peak_reserved_bytes'])} | {gb(run['host_rss_bytes'])} | {run['prefill_s']:.2f} s | "
                     f"{run['decode_tokens_per_s']:.1f} tokens/s |")
    heads = record["heads"]
    exact = "identical" if heads["bf16"]["identical"] else "NOT identical"
    control = "reported as different" if not heads["bf16-one-ulp"]["identical"] else "NOT told apart"
    lines += ["", f"The untied bf16 head gives the tied model's logits: **{exact}** over {heads['bf16']['steps']} greedy "
              f"steps ({heads['distinct_tokens']} distinct tokens); the control, one ulp in the head's first chosen row, "
              f"is {control}. The quantized heads are not exact; against the bf16 head, teacher-forced on its tokens:", "",
              "| head | top-1 agreement | RMS logit difference | largest logit difference | tokens first part at step |",
              "|---|---|---|---|---|"]
    for head in ("int8", "nf4", "nf4-shuffled-rows"):
        row = heads[head]
        label = "control: NF4, rows shuffled" if head == "nf4-shuffled-rows" else head
        parted = row.get("tokens_first_part_at", "-")
        lines.append(f"| {label} | {row['top1_agreement']:.1%} | {row['rms_logit_difference']:.3f} | "
                     f"{row['max_logit_difference']:.3f} | {'never' if parted is None else parted} |")
    return "\n".join(lines)


def loss_made(record: dict) -> str:
    chunk = record.get("loss_chunk")
    return "every logit at once" if chunk is None else f"{chunk:,} positions at a time"


def card_label(record: dict) -> str:
    return "whole GPU" if record["card_gb"] is None else f"{record['card_gb']:g} GB"


def render_fine_tuning(paths: list) -> str:
    from helpers import records

    # a record without loss_chunk predates the chunked loss: transformers' own, every logit at once
    cards = sorted((records.read_json(path) for path in paths),
                   key=lambda r: (r["card_gb"] is None, r["card_gb"] or 0, r.get("loss_chunk") is None))
    first = cards[0]
    lines = [f"**QLoRA on {first['model']}** (`GPU_RECORD=1 python -m pytest tests/gpu/test_fine_tuning_gpu.py`, "
             f"{first['gpu']}, {first['recorded_at'][:10]}, torch {first['torch']}): NF4, PLE on the CPU, LoRA on the text "
             f"decoder, gradient checkpointing, {first['optimizer']}; each card one process, sequences tried in "
             "ascending order until the first out-of-memory error, the planner's safe and largest sequence for the card "
             "among them. The whole GPU's profile is what `python -m helpers.planner calibrate` fits the planner's "
             "backward term on.", "",
             "| card | loss made | sequence | outcome | peak (GB) | planner's peak (GB) | steps/s | loss, first to last step |",
             "|---|---|---|---|---|---|---|---|"]
    for card in cards:
        for row in card["runs"]:
            measured = ["-", "-", "-"]
            if row["outcome"] == "trained":
                measured = [gb(row["peak_bytes"]), f"{row['steps_per_second']:.2f}",
                            f"{row['losses'][0]:.2f} to {row['losses'][-1]:.2f}"]
            lines.append(f"| {card_label(card)} | {loss_made(card)} | {row['sequence']:,} | {row['outcome']} | {measured[0]} | "
                         f"{gb(row['predicted_peak_bytes'])} | {measured[1]} | {measured[2]} |")
    lines += ["", "The planner's safe training sequence against the largest trained: " + ", ".join(
        f"{card['card_gb']:g} GB ({loss_made(card)}) {card['planner']['safe_context']:,} tokens against "
        f"{card['largest_sequence']:,}"
        for card in cards if card.get("planner")) + "."]
    return "\n".join(lines)


def committed_runs() -> dict:
    """Each committed notebook's name and the course run its outputs come from (metadata "course_run"), or None."""
    return {path.name: json.loads(path.read_text()).get("metadata", {}).get("course_run")
            for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))}


def course_run_entries() -> dict:
    """(run id, notebook) -> (the record of data/course-runs/ the notebook's run is in, its entry there)."""
    found = {}
    for path in sorted(COURSE_RUNS_DIR.glob("*.json")):
        record = json.loads(path.read_text())
        for name, entry in record["notebooks"].items():
            if entry.get("run"):
                found[entry["run"], name] = (record, entry)
    return found


def render_committed_outputs() -> str:
    import nbformat

    from tools import run_course

    entries = course_run_entries()
    by_run: dict = {}
    behind = []
    for name, run in committed_runs().items():
        by_run.setdefault(run["id"] if run else None, []).append(name[:2])
        superseded = run_course.superseded_record_outputs(nbformat.read(REPO_ROOT / "notebooks" / name, as_version=4))
        if superseded:
            tables = ", ".join(dict.fromkeys(f"`{table}`" for _, table in superseded))
            behind.append(f"- notebook {name[:2]} shows {tables} as the records stood at its run; a benchmark has "
                          f"recorded since, so the tables above are newer until the notebook runs again on a GPU")
    lines = []
    for run_id, numbers in by_run.items():
        shown = ", ".join(numbers)
        entry = next((entries[key] for key in entries if key[0] == run_id), None)
        if entry is None:
            lines.append(f"- notebooks {shown}: from no recorded run (`python tools/run_course.py --record --save-outputs`)")
            continue
        record, first = entry
        card = f"capped to {record['card_gb']:g} GB (`CARD_GB`)" if record.get("card_gb") else "with no card simulated"
        versions = ", ".join(f"{name} {first['versions'][name]}" for name in ("torch", "transformers", "bitsandbytes"))
        lines.append(f"- notebooks {shown}: run `{run_id}`, `{record['model']}` on {first['device']} {card}, "
                     f"{first['date']}; {versions}. `{course_command(first['command'])}`")
    return "\n".join(lines + behind)


def course_command(command: str) -> str:
    """A course run's command with its notebooks in order, or as `notebooks/*.ipynb` where it ran all of them."""
    from helpers.paths import NOTEBOOKS_DIR

    head, *paths = command.split(" notebooks/")
    ran = sorted(f"notebooks/{path.strip()}" for path in paths)
    every = sorted(f"notebooks/{path.name}" for path in NOTEBOOKS_DIR.glob("*.ipynb"))
    return f"{head} {'notebooks/*.ipynb' if ran == every else ' '.join(ran)}"


def render_blocks() -> dict:
    """Each block of docs/results.md by name: the benchmark, long context and speed, fine-tuning, one per GPU-tier
    record (its file's stem) and the committed outputs."""
    from helpers import records

    blocks = {"benchmark": render_benchmark(), "long-context-and-speed": render_long_context_and_speed()}
    fine_tuning = sorted(GPU_TIER_DIR.glob(f"{FINE_TUNING}*.json"))
    if fine_tuning:
        blocks["fine-tuning"] = render_fine_tuning(fine_tuning)
    for path in sorted(set(GPU_TIER_DIR.glob("*.json")) - set(fine_tuning)):
        record = records.read_json(path)  # one sentence where a kill cut it short
        if path.stem.startswith("notebooks-"):
            blocks[path.stem] = render_notebooks(record)
        elif path.stem == "make-test-gpu":
            blocks[path.stem] = render_gpu_run(record)
        elif path.stem.startswith("host-"):
            blocks[path.stem] = render_host(path.stem)
        elif path.stem.startswith("release-probe-"):
            blocks[path.stem] = render_release_probe(record)
        elif path.stem.startswith("determinism-"):
            blocks[path.stem] = render_determinism(record)
        elif path.stem.startswith(CAPTURE_PROBE):
            blocks[path.stem] = render_capture_probe(record)
        elif path.stem.startswith(TEXT_ONLY):
            blocks[path.stem] = render_text_only(path.stem.removeprefix(TEXT_ONLY), record)
        elif path.stem.startswith(TOWERS):
            blocks[path.stem] = render_towers(path.stem.removeprefix(TOWERS), record)
        elif path.stem.startswith(TRIM_PROBE):
            blocks[path.stem] = render_trim_probe(path.stem.removeprefix(TRIM_PROBE), record)
        else:
            blocks[path.stem] = render_record_set(path.stem, record)
    blocks["committed-outputs"] = render_committed_outputs()
    return blocks


def block_markers(name: str) -> tuple:
    return BLOCK_START.format(name), BLOCK_END.format(name)


def rendered_results(text: str, blocks: dict) -> str:
    """docs/results.md's text with every block rendered in place; the prose between the blocks is the author's. A
    record with no place on the page, or a place no record fills, is one sentence naming the fix."""
    placed = BLOCK_NAME.findall(text)
    missing, orphaned = [n for n in blocks if n not in placed], [n for n in placed if n not in blocks]
    if missing:
        start, end = block_markers(missing[0])
        raise SystemExit(f"docs/results.md has no place for {', '.join(missing)}: add {start} and {end} where it belongs, "
                         f"with a sentence around it, then run python tools/render_results.py")
    if orphaned:
        raise SystemExit(f"docs/results.md holds blocks that no record renders ({', '.join(orphaned)}): remove them and "
                         f"their prose, then run python tools/render_results.py")
    for name, body in blocks.items():
        start, end = block_markers(name)
        before, after = between(text, start, end, "docs/results.md")
        text = f"{before}{start}\n{body}\n{end}{after}"
    return text


def text_only_headline() -> list:
    from helpers import records

    path = GPU_TIER_DIR / f"{TEXT_ONLY}e4b-shape.json"
    if not path.exists():
        return []
    record = records.read_json(path)
    small, heads = record["4 GB, text only, nf4 head"], record["heads"]
    return [f"- **E4B on a 4 GB card:** text only with an NF4 head, {gb(small['resident_bytes'])} GB resident and "
            f"{gb(small['peak_reserved_bytes'])} GB reserved at most while it prefilled {small['prompt']:,} tokens and "
            f"decoded {small['new_tokens']} at {small['decode_tokens_per_s']} tokens/s; a bf16 head keeps the logits "
            f"{'identical' if heads['bf16']['identical'] else 'DIFFERENT'}, the NF4 head agrees on "
            f"{heads['nf4']['top1_agreement']:.0%} of top-1 tokens (`GPU_RECORD=1 python -m pytest tests/gpu/test_text_only_gpu.py`, "
            f"{record['gpu']})." + _longest_text_only()]


def _longest_text_only() -> str:
    """The longest prompt the text-only route prefilled on its smallest recorded card ("" before the run)."""
    from helpers import records

    for card, ways in records.largest_contexts().items():  # smallest card first
        for how, (tokens, _) in ways.items():
            if how.endswith("text only"):
                return (f" Its longest prompt on a {card:g} GB card, in chunks on the tuned path: {tokens:,} tokens "
                        "(`make bench PRESET=long-context-small-cards`).")
    return ""


def fused_step_headline() -> list:
    """The fastest exact step: of the host-free steps with every fusion recorded identical, the one that ran faster
    in a run that measured both steps side by side; where no run measured both, the one that ran the most times
    faster than the CUDA-graph step of its own run (a ratio within one run, so runs on other GPUs compare)."""
    import functools

    from helpers import records

    candidates = (("decode-goal", "host-free-fused-cache", "every norm, rotary embedding, block end, gelu and NF4 "
                   "projection in bitsandbytes' order in its own kernels, and each cache write in one launch"),
                  ("decode-gemv", "host-free-fused-gemv", "every norm, rotary embedding, block end, gelu and NF4 "
                   "projection in bitsandbytes' order in its own kernels"),
                  ("decode-fused", "host-free-fused-all", "every norm, rotary embedding, block end and gelu in one "
                   "kernel each"))
    runs = {preset: records.preset_records(preset) for preset, _, _ in candidates}
    recorded = []
    for preset, step, what in candidates:
        fused, graphs = runs[preset].get(step, {}), runs[preset].get("cudagraphs", {})
        if fused.get("decode_tokens_per_s") and graphs.get("decode_tokens_per_s") and (
                (fused.get("identity") or {}).get("identical") or preset == "decode-fused"):
            recorded.append((fused["decode_tokens_per_s"] / graphs["decode_tokens_per_s"], preset, fused, graphs, what))
    if not recorded:
        return []
    steps = {preset: step for preset, step, _ in candidates}

    def side_by_side(a, b) -> float | None:
        """How much faster a's step ran than b's in a run of either preset that measured both, else None."""
        for preset in (a[1], b[1]):
            run = runs[preset]
            rate_a = (run.get(steps[a[1]]) or {}).get("decode_tokens_per_s")
            rate_b = (run.get(steps[b[1]]) or {}).get("decode_tokens_per_s")
            if rate_a and rate_b:
                return rate_a - rate_b
        return None

    def faster(a, b) -> float:
        measured = side_by_side(a, b)
        return measured if measured is not None else a[0] - b[0]

    _, preset, fused, graphs, what = max(recorded, key=functools.cmp_to_key(faster))
    same = fused.get("identity") or {}
    verdict = f"identical over {same['steps']} steps" if same.get("identical") else "NOT identical"
    return [f"- **Decoding without the host in the loop:** {fused['decode_tokens_per_s']} tokens/s with {what}, "
            f"{fused['decode_tokens_per_s'] / graphs['decode_tokens_per_s']:.2f}x "
            f"the CUDA-graph step of the same run, logits {verdict} to `generate` with a static cache, "
            f"{fused['decode_tokens_per_s'] / fused['bandwidth_limit_tokens_per_s']:.1%} of the bandwidth limit "
            f"(`make bench PRESET={preset}`, {fused['gpu']}). Cited beside it, not measured here: {cited_speeds()}."]


def render_headline() -> str:
    """The README's first results: what E4B-shaped NF4 with the PLE on the CPU does on each learner's card (the
    planner, calibrated on the records), and three recorded figures."""
    from helpers import cards, planner, records

    lines = [HEADLINE_START, "| card | loads E4B NF4, PLE on the CPU | text only: towers and token table on the CPU, NF4 head "
             "| longest prompt in one prefill, safe | the course's steps on E4B itself |",
             "|---|---|---|---|---|"]
    for size in cards.CARD_SIZES_GB:
        verdict = planner.fits("e4b-shape", size, "nf4", "cpu", 1024)
        quant, ple, towers, head = planner.TEXT_ONLY
        text_only = planner.fits("e4b-shape", size, quant, ple, 1024, towers=towers, head=head)
        best = verdict if verdict.loads else text_only
        plan = planner.course_plan("e4b-shape", card_gb=size, ram_bytes=64e9)
        learners = [choice for choice in plan.choices if planner.STEPS[choice.step].model is None]  # not tiny's own
        itself = sum(choice.model == "e4b-shape" for choice in learners)
        lines.append(f"| {cards.size_label(size)} | {'yes' if verdict.loads else 'no'} | {'yes' if text_only.loads else 'no'} | "
                     f"{f'{best.safe_context:,} tokens' if best.loads else '-'} | {itself} of {len(learners)} |")
    tier = records.gpu_tier("e4b-shape", "nf4")
    gpu, cpu = tier["ple-gpu"], tier["ple-cpu"]
    same = cpu["logits_vs_ple_gpu"]
    speed = records.preset_records("decode-speed")
    graphs, plain = speed.get("cudagraphs", {}), records.plain_generate_rate(speed.get("cudagraphs", {}), speed.values())
    goal = records.preset_records("long-context").get("tuned-128k-8gb", {})
    check = goal.get("identity") or {}
    lines += ["", f"- **The PLE table on the CPU:** {gb(gpu['resident_bytes'])} GB on the GPU becomes {gb(cpu['resident_bytes'])} GB, and "
              f"the logits stay {'identical' if same['identical'] else 'DIFFERENT'} over {same['steps']} steps "
              f"(`GPU_RECORD=1 make test-gpu-tier`, {cpu['gpu']}).",
              f"- **Long prompts on an 8 GB card:** {positions_of(goal)} positions filled with "
              f"{gb(goal.get('peak_generate_reserved_bytes'))} GB reserved, in chunks on the tuned path, logits "
              f"{'identical to' if check.get('identical') else 'different from'} the same code uncapped "
              f"(`make bench PRESET=long-context`).",
              f"- **Decoding:** {graphs.get('decode_tokens_per_s')} tokens/s with the CUDA-graph step against "
              f"{plain} for plain `generate`, {graphs.get('decode_tokens_per_s', 0) / plain:.1f}x in the same run "
              f"(`make bench PRESET=decode-speed`).", *fused_step_headline(), *text_only_headline(), HEADLINE_END]
    return "\n".join(lines)


def positions_of(record: dict) -> str:
    from helpers.long_context import positions_written

    c = record.get("configuration", {})
    return f"{positions_written(c['greedy_context'], c['new_tokens']):,}" if c else "no"


def between(text: str, start: str, end: str, name: str) -> tuple:
    """(before, after) the block from ``start`` to ``end``; one sentence where the markers are not there once each."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"{name} must hold {start} and {end} once each, in that order: restore them, then run "
                         f"python tools/render_results.py")
    return text[:text.index(start)], text[text.index(end) + len(end):]


def rendered(path: Path, start: str, end: str, block: str) -> str:
    """``path``'s text with its block replaced: the whole file as it should be."""
    before, after = between(path.read_text(), start, end, path.name)
    return before + block + after


def main(argv) -> int:
    from helpers.paths import write_text_atomically

    wanted = {README: rendered(README, HEADLINE_START, HEADLINE_END, render_headline()),
              RESULTS: rendered_results(RESULTS.read_text(), render_blocks())}
    if "--check" in argv:
        stale = [path.name for path, text in wanted.items() if path.read_text() != text]
        if stale:
            print(f"{', '.join(map(str, stale))} out of date with data/: run python tools/render_results.py")
            return 1
        return 0
    for path, text in wanted.items():
        write_text_atomically(path, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
