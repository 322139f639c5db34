"""Turn nbval's JUnit XML from a GPU run into data/gpu-tier/notebooks-<model>.json: pass/fail per
notebook, each with its own date, GPU and versions. Runs accumulate: a notebook's entry is
replaced only when that notebook ran again.

    python tools/record_nbval.py build/nbval-gpu.xml
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarise(junit: Path) -> dict:
    cells: dict = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
    for case in ET.parse(junit).getroot().iter("testcase"):
        notebook = case.get("classname", "?").split(".ipynb")[0].split(".")[-1] + ".ipynb"
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        cells[notebook][outcome] += 1
    return {name: {**counts, "result": "pass" if counts["failed"] == 0 else "fail"} for name, counts in sorted(cells.items())}


def main(argv) -> int:
    from helpers.measure import environment

    model = os.environ.get("GEMMA_MODEL", "e4b-shape")
    target = ROOT / "data" / "gpu-tier" / f"notebooks-{model}.json"
    record = json.loads(target.read_text()) if target.is_file() else {"model": model, "notebooks": {}}
    context = {**environment(), "command": f"GPU_RECORD=1 GEMMA_MODEL={model} make test-gpu-notebooks"}
    for name, counts in summarise(Path(argv[0])).items():
        record["notebooks"][name] = {**counts, **context}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps({name: entry["result"] for name, entry in record["notebooks"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
