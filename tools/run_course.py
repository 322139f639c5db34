"""Run every notebook of the course top to bottom, headless, into build/, and print a summary.

    python tools/run_course.py notebooks/*.ipynb
    python tools/run_course.py --save-outputs notebooks/*.ipynb   # maintainers: store outputs in notebooks/
    python tools/run_course.py --record notebooks/*.ipynb   # also write the seconds per notebook to data/course-runs/

The model comes from $GEMMA_MODEL (default: tiny), so the same command runs the course on a
CPU, on an E4B-shaped checkpoint on a GPU, or on the real google/gemma-4-E4B-it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.paths import BUILD_DIR as BUILD  # noqa: E402
from helpers.paths import COURSE_RUNS_DIR  # noqa: E402


def run(notebook: Path, save_outputs: bool = False) -> tuple[str, float, str]:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(notebook, as_version=4)
    started = time.perf_counter()
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}})
    try:
        client.execute()
        status, detail = "ok", ""
    except CellExecutionError as err:
        status, detail = "FAILED", str(err).strip().splitlines()[-1][:120]
    prune_widget_state(nb)
    BUILD.mkdir(exist_ok=True)
    nbformat.write(nb, BUILD / notebook.name)
    if save_outputs and status == "ok":
        from helpers.course import write_notebook

        write_notebook(nb, notebook)  # without this machine's language_info: a fixed point of the notebooks' git filter
    return status, time.perf_counter() - started, detail


def shown_widgets(nb) -> set:
    """Widget models an output displays, with every model those refer to (children, layouts, styles)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    todo = set(re.findall(r'"model_id": "([0-9a-f]+)"', json.dumps([c.get("outputs", []) for c in nb.cells])))
    seen = set()
    while todo:
        model = todo.pop()
        seen.add(model)
        todo |= set(re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(state.get(model, {})))) - seen
    return seen


def prune_widget_state(nb) -> int:
    """Drop the stored state of widgets no output shows (progress bars of loads whose output was replaced, widgets
    closed by the cell that made them): JupyterLab would otherwise restore them as stale bars. Returns how many."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    stale = set(state) - shown_widgets(nb)
    for model in stale:
        del state[model]
    return len(stale)


def record(results: list, model: str, command: str) -> Path:
    """Seconds per notebook, with the machine they were measured on: what the instructor guide renders. Notebooks
    run again replace their own entries; the others keep theirs, each with the run it came from."""
    import datetime
    import platform
    from importlib.metadata import version

    import psutil
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    COURSE_RUNS_DIR.mkdir(parents=True, exist_ok=True)
    path = COURSE_RUNS_DIR / f"{model}-{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    entry = json.loads(path.read_text()) if path.is_file() else {"notebooks": {}}
    entry.update({"model": model, "device": device, "ram_bytes": psutil.virtual_memory().total,
                  "platform": f"{platform.system()} {platform.machine()}"})
    run = {"date": datetime.date.today().isoformat(), "command": command,
           "load_average_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
           "versions": {name: version(name) for name in ("torch", "transformers", "accelerate", "bitsandbytes", "huggingface_hub")}}
    for name, status, seconds, _ in results:
        entry["notebooks"][name] = {"result": status, "seconds": round(seconds, 1), **run}
    path.write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
    return path


def main(args: list[str]) -> int:
    save_outputs = "--save-outputs" in args
    keep_record = "--record" in args
    notebooks = [Path(p) for p in args if p not in ("--save-outputs", "--record")]
    model = os.environ.get("GEMMA_MODEL", "tiny")
    if not notebooks:
        print("No notebooks to run yet (notebooks/*.ipynb is empty).")
        return 0
    results = []
    for notebook in notebooks:
        print(f"running {notebook.name} on {model} ...", flush=True)
        results.append((notebook.name, *run(notebook, save_outputs)))
    width = max(len(name) for name, *_ in results)
    print(f"\nCourse run on GEMMA_MODEL={model}; executed notebooks are in {BUILD}/")
    for name, status, seconds, detail in results:
        print(f"  {name:<{width}}  {status:<6} {seconds:7.1f} s  {detail}")
    failed = sum(status != "ok" for _, status, *_ in results)
    if keep_record:
        notebooks_run = " ".join(p.as_posix() for p in notebooks)
        print(f"recorded in {record(results, model, f'GEMMA_MODEL={model} python tools/run_course.py --record {notebooks_run}')}")
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
