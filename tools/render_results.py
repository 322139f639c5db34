"""Render the README's results table from the GPU-tier records in data/gpu-tier/.

    python tools/render_results.py          # rewrite the block in README.md
    python tools/render_results.py --check  # exit 1 if README.md is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECORDS = ROOT / "data" / "gpu-tier"
START, END = "<!-- results:start (tools/render_results.py) -->", "<!-- results:end -->"
ROUTE_LABELS = {
    "ple-gpu": "`load_model(ple=\"gpu\")`: `device_map={\"\": 0}`",
    "ple-cpu": "`load_model(ple=\"cpu\")`: per-module map, hook off, lookup on CPU",
    "post-load": "`ple=\"gpu\"`, then `offload_ple(model)`",
    "cpu-entry": "naive: `\"cpu\"` entry in the map, accelerate hook left on",
    "no-flag": "naive: `\"cpu\"` entry without `llm_int8_enable_fp32_cpu_offload`",
}


def gb(value) -> str:
    return f"{value / 1e9:.2f}"


def greedy_verdict(record: dict, reference: dict) -> str:
    count = record["greedy_token_count"]
    if count == reference["greedy_token_count"]:
        return f"identical over {count} tokens" if record["greedy_sha256"] == reference["greedy_sha256"] else "differ"
    shown = min(count, len(record["greedy_tokens_first_16"]), len(reference["greedy_tokens_first_16"]))
    same = record["greedy_tokens_first_16"][:shown] == reference["greedy_tokens_first_16"][:shown]
    return f"{'identical' if same else 'differ'} over its first {shown} tokens"


def render_record_set(name: str, records: dict) -> str:
    reference = records.get("ple-gpu", {})
    any_record = next(iter(records.values()))
    context = next((p["context"] for p in reference.get("prefill", [])), None)
    lines = [
        f"**{name}** on {any_record['gpu']} ({any_record['date']}; torch {any_record['versions']['torch']}, "
        f"transformers {any_record['versions']['transformers']}, bitsandbytes {any_record['versions']['bitsandbytes']}), "
        f"quantization `{any_record['quant']}`. GB = 10^9 bytes.",
        "",
        f"| route | allocated after load | reserved | peak during load | peak, {context:,}-token prefill "
        f"| s/token | greedy tokens vs PLE on GPU |" if context else "| route | allocated | reserved | peak load | peak prefill | s/token | greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for route, label in ROUTE_LABELS.items():
        record = records.get(route)
        if record is None:
            continue
        if "load_error" in record:
            lines.append(f"| {label} | refused: `{record['load_error'][:60]}...` | | | | | |")
            continue
        prefill = record["prefill"][0] if record.get("prefill") else None
        if prefill is None:
            peak = ""
        elif prefill.get("oom"):
            peak = "OOM"
        else:
            peak = f"{gb(prefill['peak_bytes'])}" + ("" if prefill["context"] == context else f" ({prefill['context']} tokens)")
        if "greedy_sha256" not in record:
            same = ""
        else:
            same = "reference" if route == "ple-gpu" else greedy_verdict(record, reference)
        lines.append(
            f"| {label} | {gb(record['resident_bytes'])} | {gb(record['reserved_bytes'])} | "
            f"{gb(record['peak_load_bytes'])} | {peak} | {record['seconds_per_token']:.3f} | {same} |"
        )
    command = ""
    if "ple-cpu" in records:
        command = "GPU_RECORD=1 make test-gpu`, which runs `" + records["ple-cpu"]["command"].split(" --json")[0]
    lines += ["", f"Recorded by `{command}`, one fresh process per route." if command else ""]
    return "\n".join(lines).rstrip()


def render_notebooks(record: dict) -> str:
    lines = [f"**Notebooks under nbval** with `GEMMA_MODEL={record['model']}`:", "",
             "| notebook | result | cells passed | GPU | date | transformers | bitsandbytes |", "|---|---|---|---|---|---|---|"]
    for name, entry in sorted(record["notebooks"].items()):
        lines.append(f"| `{name}` | {entry['result']} | {entry['passed']}/{entry['passed'] + entry['failed']} | {entry['gpu']} | "
                     f"{entry['date']} | {entry['versions']['transformers']} | {entry['versions']['bitsandbytes']} |")
    return "\n".join(lines + ["", f"Recorded by `{next(iter(record['notebooks'].values()))['command']}`."])


def render() -> str:
    blocks = []
    for path in sorted(RECORDS.glob("*.json")):
        if path.stem.startswith("notebooks-"):
            blocks.append(render_notebooks(json.loads(path.read_text())))
        else:
            blocks.append(render_record_set(path.stem, json.loads(path.read_text())))
    body = "\n\n".join(blocks) if blocks else "_No GPU records yet: run `GPU_RECORD=1 make test-gpu` on a GPU._"
    return f"{START}\n{body}\n{END}"


def current_block(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main(argv) -> int:
    text = README.read_text()
    fresh = render()
    if "--check" in argv:
        if current_block(text) != fresh:
            print("README.md results are out of date: run python tools/render_results.py")
            return 1
        return 0
    README.write_text(text.replace(current_block(text), fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
