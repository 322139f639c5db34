"""Run every notebook of the course top to bottom, headless, into build/, and print a summary.

    python tools/run_course.py notebooks/*.ipynb
    python tools/run_course.py --save-outputs notebooks/*.ipynb   # maintainers: store outputs in notebooks/
    python tools/run_course.py --record notebooks/*.ipynb   # also write the seconds per notebook to data/course-runs/
    python tools/run_course.py --jobs 4 ...                 # four notebooks at a time, each in its own kernel
    python tools/run_course.py --clear-stale notebooks/*.ipynb  # drop the outputs of cells edited since their run

The model comes from $GEMMA_MODEL (default: tiny), so the same command runs the course on a
CPU, on an E4B-shaped checkpoint on a GPU, or on the real google/gemma-4-E4B-it; $CARD_GB caps
every kernel as a learner's card. A saved notebook carries its run in ``metadata["course_run"]``:
the run's id, model, card and device, and the hash of every code cell it ran, so a cell edited
later is known to show another source's outputs.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.paths import BUILD_DIR as BUILD  # noqa: E402
from helpers.paths import COURSE_RUNS_DIR  # noqa: E402


def cell_hash(cell) -> str:
    """What identifies a code cell's source: its outputs belong to the run that stamped this hash."""
    return hashlib.sha256(cell.source.encode()).hexdigest()[:16]


def stamp(nb, run: dict) -> None:
    """Mark a notebook as the output of ``run``, with the hash of every code cell that ran in it."""
    nb.metadata["course_run"] = {**run, "cells": sorted({cell_hash(c) for c in nb.cells if c.cell_type == "code"})}


def stale_cells(nb) -> list:
    """Indices of code cells that show outputs but were edited after the run that made them (or never run)."""
    ran = set(nb.metadata.get("course_run", {}).get("cells", []))
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs") and cell_hash(c) not in ran]


def cell_text(cell) -> str:
    """What a code cell's outputs show as text: its printed streams and the plain text of what it displayed."""
    return "".join("".join(out.get("text") or out.get("data", {}).get("text/plain") or "") for out in cell.get("outputs", []))


def superseded_record_outputs(nb) -> list:
    """(cell index, table) for each recorded table a cell shows otherwise than the records show it now: a benchmark
    ran after the notebook did, so its outputs are older than docs/results.md (run the notebook again). The tables
    are those a cell names by ``records.table("<name>")`` or a literal it loops over, and the planner's cards."""
    import ast

    from helpers import planner, records

    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        views = {}
        if "records.table(" in cell.source:
            names = [node.value for node in ast.walk(ast.parse(cell.source))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in records.TABLES]
            views |= {name: (lambda name=name: records.table(name)) for name in names}
        if "planner.recorded_decode_on_cards()" in cell.source:
            views["planner.recorded_decode_on_cards()"] = planner.recorded_decode_on_cards
        shown = cell_text(cell)
        found += [(i, what) for what, view in views.items() if str(view() or "") not in shown]
    return found


def clear_stale(path: Path) -> int:
    """Drop the outputs of the cells edited since the notebook's run; returns how many were cleared."""
    import nbformat

    from helpers.course import write_notebook

    nb = nbformat.read(path, as_version=4)
    stale = stale_cells(nb)
    for i in stale:
        nb.cells[i].outputs, nb.cells[i].execution_count = [], None
    if stale:
        prune_widget_state(nb)  # the progress bars those outputs showed
        write_notebook(nb, path)
    return len(stale)


def this_run(model: str) -> dict:
    """The id and setting of one course run: the model, the simulated card, the device."""
    import torch

    card = os.environ.get("CARD_GB") or None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    card_name = f"{card}gb" if card else ("uncapped" if torch.cuda.is_available() else "cpu")
    return {"id": f"{started}-{model}-{card_name}", "model": model, "card_gb": float(card) if card else None, "device": device}


def run(notebook: Path, save_outputs: bool = False, course_run: dict | None = None) -> tuple[str, float, str]:
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
    settle_bar_text(nb)
    BUILD.mkdir(exist_ok=True)
    nbformat.write(nb, BUILD / notebook.name)
    if save_outputs and status == "ok":
        from helpers.course import write_notebook

        stamp(nb, course_run or this_run(os.environ.get("GEMMA_MODEL", "tiny")))
        write_notebook(nb, notebook)  # without this machine's language_info: a fixed point of the notebooks' git filter
    return status, time.perf_counter() - started, detail


def widget_state(nb) -> dict:
    """The notebook's saved widget models by id (empty where it saved none); edits to it are edits to the notebook."""
    return nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})


def shown_widgets(nb) -> set:
    """Widget models an output displays, with every model those refer to (children, layouts, styles)."""
    state = widget_state(nb)
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
    state = widget_state(nb)
    stale = set(state) - shown_widgets(nb)
    for model in stale:
        del state[model]
    return len(stale)


PROGRESS_BARS = ("FloatProgressModel", "IntProgressModel")


def settle_bar_text(nb) -> int:
    """Give each progress bar's plain text the bar's last state, read from the saved widget state: what JupyterLab
    draws. A viewer that cannot draw the widget shows that text instead (VS Code's fallback, nbconvert to text), which
    tqdm wrote when the bar began, at 0%. A bar of unknown length (tqdm's full "info" bar) keeps only its counts. Returns how many."""
    import html

    state = widget_state(nb)

    def model(ref: str) -> dict:
        return state.get(ref.removeprefix("IPY_MODEL_"), {}).get("state", {})

    settled = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            parts = [model(ref) for ref in model(view["model_id"]).get("children", [])] if view else []
            if [part.get("_model_name") for part in parts] not in (["HTMLModel", bar, "HTMLModel"] for bar in PROGRESS_BARS):
                continue
            left, bar, right = parts
            total, done = bar.get("max") or 0, bar.get("value") or 0
            if bar.get("bar_style") == "info" and total == 1:  # tqdm's bar for a total it was not told
                drawn = ""
            else:
                filled = round(10 * min(done / total, 1)) if total > 0 else 0
                drawn = f"|{'█' * filled}{' ' * (10 - filled)}|"
            output["data"]["text/plain"] = html.unescape(f"{left.get('value', '')}{drawn}{right.get('value', '')}").replace("\u2007", " ")
            settled += 1
    return settled


COURSE_RUN_SCHEMA = 2  # 2: the machine (device, RAM, platform) is in each notebook's entry, not once per file


def record(results: list, course_run: dict, command: str) -> Path:
    """Seconds per notebook, each entry with the run and the machine it was measured on: what the instructor guide
    renders. Notebooks run again replace their own entries; the others keep theirs, machine and all."""
    import platform
    from importlib.metadata import version

    import psutil

    from helpers.paths import write_text_atomically

    model, card = course_run["model"], course_run["card_gb"]
    kind = "cpu" if course_run["device"].startswith("CPU") else "cuda"
    COURSE_RUNS_DIR.mkdir(parents=True, exist_ok=True)
    path = COURSE_RUNS_DIR / f"{model}-{kind}{f'-{card:g}gb' if card else ''}.json"
    entry = json.loads(path.read_text()) if path.is_file() else {"schema": COURSE_RUN_SCHEMA, "notebooks": {}}
    if entry.get("schema") != COURSE_RUN_SCHEMA:
        raise SystemExit(f"{path} is in an older format (schema {entry.get('schema', 1)}, not {COURSE_RUN_SCHEMA}): "
                         "convert it once, each notebook's entry taking the file's device, RAM and platform")
    entry.update({"schema": COURSE_RUN_SCHEMA, "model": model, "card_gb": card})
    run = {"date": datetime.date.today().isoformat(), "command": command, "run": course_run["id"],
           "device": course_run["device"], "ram_bytes": psutil.virtual_memory().total,
           "platform": f"{platform.system()} {platform.machine()}",
           "load_average_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
           "versions": {name: version(name) for name in ("torch", "transformers", "accelerate", "bitsandbytes", "huggingface_hub")}}
    for name, status, seconds, _ in results:
        entry["notebooks"][name] = {"result": status, "seconds": round(seconds, 1), **run}
    write_text_atomically(path, json.dumps(entry, indent=1, sort_keys=True) + "\n")
    return path


def main(args: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--save-outputs", action="store_true", help="store each passing notebook's outputs in notebooks/")
    parser.add_argument("--record", action="store_true", help="write the seconds per notebook to data/course-runs/")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at a time, each in its own kernel")
    parser.add_argument("--clear-stale", action="store_true", help="only drop the outputs of cells edited since their run")
    options = parser.parse_args(args)
    if options.jobs < 1:
        parser.error(f"--jobs {options.jobs}: give 1 or more notebooks at a time")
    notebooks = options.notebooks
    if not notebooks:
        print("No notebooks to run yet (notebooks/*.ipynb is empty).")
        return 0
    if options.clear_stale:
        for notebook in notebooks:
            print(f"{notebook.name}: {clear_stale(notebook)} cell(s) cleared")
        return 0
    model = os.environ.get("GEMMA_MODEL", "tiny")
    course_run = this_run(model)
    print(f"run {course_run['id']}: {len(notebooks)} notebook(s) on {model}, {options.jobs} at a time ...", flush=True)
    with ProcessPoolExecutor(max_workers=options.jobs) as pool:
        futures = [pool.submit(run, notebook, options.save_outputs, course_run) for notebook in notebooks]
        results = [(notebook.name, *future.result()) for notebook, future in zip(notebooks, futures)]
    width = max(len(name) for name, *_ in results)
    print(f"\nCourse run {course_run['id']}; executed notebooks are in {BUILD}/")
    for name, status, seconds, detail in results:
        print(f"  {name:<{width}}  {status:<6} {seconds:7.1f} s  {detail}")
    failed = sum(status != "ok" for _, status, *_ in results)
    if options.record:
        card = f"CARD_GB={course_run['card_gb']:g} " if course_run["card_gb"] else ""
        flags = " --save-outputs" * options.save_outputs + f" --jobs {options.jobs}" * (options.jobs > 1)
        notebooks_run = " ".join(p.as_posix() for p in notebooks)
        command = f"{card}GEMMA_MODEL={model} python tools/run_course.py --record{flags} {notebooks_run}"
        print(f"recorded in {record(results, course_run, command)}")
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
