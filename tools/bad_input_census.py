"""Count how the course answers the bad-input battery (tests/test_bad_inputs.py), its functions and its
command lines: a clear CourseError sentence, a bare library exception, a silent result, or a CourseError
without the fix.

    python tools/bad_input_census.py                      # this tree's helpers
    PYTHONPATH=/tmp/older-tree python tools/bad_input_census.py --json census.json   # another tree's helpers

The table is this repository's; the helpers are the first ``helpers`` on the path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree's helpers win where one is given


def battery():
    sys.path.insert(0, str(ROOT / "tests"))  # its helpers in tests/conftest.py, as pytest would find them
    spec = importlib.util.spec_from_file_location("test_bad_inputs", ROOT / "tests" / "test_bad_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def census(workdir: Path) -> list:
    os.environ.setdefault("GEMMA_COURSE_CACHE", str(workdir / "cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"  # as in the tests: nothing reaches the hub
    table = battery()
    from helpers import synthetic

    inputs = table.Inputs(workdir / "inputs", synthetic.build("tiny", progress=False))
    inputs.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in table.CASES:
        if case[0] in table.CUDA_ONLY_ROWS and not table.NO_CUDA:
            continue
        if case[0] in table.LLAMA_CPP_ROWS and not table.gguf_route.installed():
            continue
        outcome, detail = table.answer(case, inputs)
        rows.append({"input": case[0], "outcome": outcome, "detail": detail})
    for row in table.CLI_ROWS:  # every command line of helpers
        outcome, detail = table.cli_answer(row, inputs)
        rows.append({"input": f"python -m helpers.{row[0]}", "outcome": outcome, "detail": detail})
    return rows


MAIN_OUTCOMES = ("bare exception", "silent", "clear")  # the three columns, always shown


def summary(counts: Counter, total: int, helpers_dir: Path) -> str:
    """One line: bare / silent / clear, then any CourseError that names no fix or the wrong class."""
    others = [f"{outcome} {n}" for outcome, n in counts.most_common() if outcome not in MAIN_OUTCOMES]
    return (f"helpers from {helpers_dir}: {total} bad inputs: bare {counts['bare exception']} / silent {counts['silent']} / "
            f"clear {counts['clear']}" + (f" ({', '.join(others)})" if others else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every row's outcome here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        rows = census(Path(workdir))
    import helpers

    counts = Counter(row["outcome"] for row in rows)
    for row in rows:
        if row["outcome"] != "clear":
            print(f"{row['outcome']:<15} {row['input']}: {row['detail']}")
    print(summary(counts, len(rows), Path(helpers.__file__).parent))
    if args.json:
        record = {"helpers": str(Path(helpers.__file__).parent), "counts": dict(counts), "rows": rows}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if counts["clear"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
