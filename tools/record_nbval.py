"""Turn nbval's JUnit XML from a GPU run into data/gpu-tier/notebooks-<model>.json: pass/fail, cells
and seconds per notebook and per simulated card ($CARD_GB, or the whole GPU), each with its own date,
GPU, versions and the hash of the notebook's code as it ran (an entry left from older code renders as stale).
Runs accumulate: an entry is replaced only when that notebook ran again on that card.

    python tools/record_nbval.py build/nbval-gpu.xml
    python tools/record_nbval.py run.xml --environment-from data/measurements/e4b-shape.jsonl --command "..."

The second form records a JUnit file brought back from a GPU box, with the GPU and versions of a
benchmark record made there in the same session (this machine may have no GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.paths import GPU_TIER_DIR, NOTEBOOKS_DIR  # noqa: E402
from lab.records import write_record  # noqa: E402


def cells(junit: Path):
    """(notebook, cell, outcome, seconds, the failure's text or None) for every cell nbval ran."""
    for case in ET.parse(junit).getroot().iter("testcase"):
        notebook = case.get("classname", "?").split(".ipynb")[0].split(".")[-1] + ".ipynb"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "failed" if bad is not None else "skipped" if case.find("skipped") is not None else "passed"
        text = None if bad is None else (bad.text or bad.get("message") or "")
        yield notebook, case.get("name", "?"), outcome, float(case.get("time") or 0), text


def code_hash(notebook: str, folder: Path = NOTEBOOKS_DIR) -> str | None:
    """What identifies the code a notebook runs: its code cells' sources, hashed (None where it is gone)."""
    path = folder / notebook
    if not path.is_file():
        return None
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
               for cell in cells if cell["cell_type"] == "code"]
    # a Windows checkout may carry CRLF line ends: the same code hashes the same there
    return hashlib.sha256(json.dumps([source.replace("\r\n", "\n") for source in sources]).encode()).hexdigest()[:16]


def summarise(junit: Path) -> dict:
    counts_of: dict = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    for notebook, _, outcome, seconds, _ in cells(junit):
        counts_of[notebook][outcome] += 1
        counts_of[notebook]["seconds"] += seconds
    return {name: {**counts, "seconds": round(counts["seconds"], 1), "result": "pass" if counts["failed"] == 0 else "fail"}
            for name, counts in sorted(counts_of.items())}


def card_label(card: str | None = None) -> str:
    """The column a card's runs are recorded under: ``card`` (default $CARD_GB) in GB, or "uncapped" for the whole
    GPU (no cap, or the card sweep's "uncapped")."""
    card = (os.environ.get("CARD_GB") or "") if card is None else card
    return f"{float(card):g} GB" if card and card != "uncapped" else "uncapped"


def run_date(junit: Path) -> str | None:
    suite = next(ET.parse(junit).getroot().iter("testsuite"), None)
    stamp = suite.get("timestamp") if suite is not None else None
    return stamp[:10] if stamp else None


def environment_from(path: Path) -> dict:
    line = next(line for line in path.read_text().splitlines() if line.strip())
    record = json.loads(line)
    return {key: record[key] for key in ("gpu", "gpu_total_bytes", "versions")}


def main(argv) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path)
    parser.add_argument("--environment-from", type=Path, help="a benchmark record from the same GPU session")
    parser.add_argument("--command", help="the command that produced the JUnit file")
    parser.add_argument("--model", default=os.environ.get("GEMMA_MODEL", "e4b-shape"),
                        help="the model the notebooks ran (default: $GEMMA_MODEL, else e4b-shape)")
    parser.add_argument("--card", default=os.environ.get("CARD_GB", ""),
                        help="the card cap in GB they ran under, or uncapped (default: $CARD_GB)")
    args = parser.parse_args(argv)
    model = args.model
    target = GPU_TIER_DIR / f"notebooks-{model}.json"
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):  # the cards' runs finish side by side
        record = json.loads(target.read_text()) if target.is_file() else {"model": model, "cards": {}}
        if "notebooks" in record:  # written before runs were kept per card: the whole GPU
            record.setdefault("cards", {})["uncapped"] = record.pop("notebooks")
        card = record.setdefault("cards", {}).setdefault(card_label(args.card), {})
        record_run(record, card, args, context_for(args, model))
        write_record(target, record)
    Path(str(target) + ".lock").unlink(missing_ok=True)
    print(card_label(args.card), json.dumps({name: entry["result"] for name, entry in card.items()}))
    return 0


def context_for(args, model: str) -> dict:
    if args.environment_from:
        context = environment_from(args.environment_from)
    else:
        from lab.records import environment

        context = environment()
    card = "" if args.card == "uncapped" else args.card
    context["command"] = args.command or f"GPU_RECORD=1 GEMMA_MODEL={model} CARD_GB={card} make test-gpu-notebooks"
    context["date"] = run_date(args.junit) or context.get("date")
    return context


def record_run(record: dict, card: dict, args, context: dict) -> None:
    for name, counts in summarise(args.junit).items():
        card[name] = {**counts, **context, "code_sha": code_hash(name)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
