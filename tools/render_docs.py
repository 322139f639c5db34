"""Render docs/instructor-guide.md and the README's figures from the records in data/: every number in them comes
from a recorded run, none is typed.

    python tools/render_docs.py          # rewrite docs/instructor-guide.md and docs/figures/*.png
    python tools/render_docs.py --check  # exit 1 if the guide is out of date with data/

Records read: data/course-runs/ (tools/run_course.py --record: seconds per notebook on tiny / CPU),
data/gpu-tier/notebooks-<model>.json (nbval on e4b-shape under 8 GB, 15 GB and the whole GPU),
data/classroom/ (python -m lab.classroom load), data/measurements/ (the benchmark, for the figures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone: helpers without an install
from helpers import links  # noqa: E402
from helpers.paths import CLASSROOM_DIR, COURSE_RUNS_DIR, GPU_TIER_DIR, write_text_atomically  # noqa: E402

GUIDE = ROOT / links.INSTRUCTOR_GUIDE
FIGURES = ROOT / "docs" / "figures"
WHAT = {  # what each notebook teaches, for the agenda
    "00_setup.ipynb": "pre-flight: GPU, CUDA, versions, RAM, the Windows page file",
    "01_download.ipynb": "downloading 16 GB that fails halfway; the classroom mirror",
    "02_quantization.ipynb": "bf16, int8, NF4, FP4 part by part",
    "03_device_map_pitfalls.ipynb": "seven device_map pitfalls, reproduced and fixed",
    "04_named_modules.ipynb": "reading the model: named_modules, sizes, the explorer",
    "05_ple_offload.ipynb": "the PLE table on the CPU, bit for bit",
    "06_memory_profiling.ipynb": "memory profiling and the planner: what fits on my card",
    "07_chat.ipynb": "the chat template, streaming, stop button",
    "08_llama_cpp.ipynb": "the llama.cpp (GGUF) route",
}


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def agenda() -> list:
    runs = [json.loads(p.read_text()) for p in sorted(COURSE_RUNS_DIR.glob("*.json"))]
    gpu = json.loads((GPU_TIER_DIR / "notebooks-e4b-shape.json").read_text())
    cards = ["8 GB", "15 GB", "uncapped"]
    columns = [f"`{run['model']}` on {' / '.join(sorted({e['device'] for e in run['notebooks'].values()}))}"
               + (f" capped to {run['card_gb']:g} GB" if run.get("card_gb") else "") for run in runs] + [
        f"`e4b-shape`, {card if card != 'uncapped' else 'whole'} {'card' if card != 'uncapped' else 'H200'}" for card in cards]
    lines = ["| notebook | what it teaches | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    totals = [0.0] * len(columns)
    for name, what in WHAT.items():
        cells = []
        for i, run in enumerate(runs):
            entry = run["notebooks"].get(name)
            cells.append("not run" if entry is None else f"{minutes(entry['seconds'])}" + ("" if entry["result"] == "ok" else " (failed)"))
            totals[i] += entry["seconds"] if entry else 0
        for j, card in enumerate(cards):
            entry = gpu["cards"].get(card, {}).get(name)
            cells.append("not recorded" if entry is None else f"{minutes(entry['seconds'])}"
                         + ("" if entry["result"] == "pass" else f" ({entry['failed']} cell(s) failed)"))
            totals[len(runs) + j] += entry["seconds"] if entry else 0
        lines.append(f"| `{name}` | {what} | " + " | ".join(cells) + " |")
    lines.append("| all | | " + " | ".join(minutes(t) for t in totals) + " |")
    sources = []
    for run in runs:
        by_command: dict = {}
        for name, entry in sorted(run["notebooks"].items()):
            key = (entry["command"].split(" notebooks/")[0], entry["date"], entry["platform"], entry["device"],
                   entry["load_average_at_start"], entry["versions"]["transformers"])
            by_command.setdefault(key, []).append(name[:2])
        sources += [f"`{run['model']}` {', '.join(numbers)}: `{command} notebooks/<notebook>` on {date} ({platform}, "
                    f"{device} shared with other work, load average {load} at the start; transformers {tf})"
                    for (command, date, platform, device, load, tf), numbers in by_command.items()]
    entries = [e for card in gpu["cards"].values() for e in card.values()]
    first = entries[0]
    sources.append(f"`e4b-shape`: `{first['command'].replace('CARD_GB=15 ', 'CARD_GB=<card> ')}` on {first['gpu']}, "
                   f"{first['date']} (nbval; transformers {first['versions']['transformers']})")
    return lines + ["", "Recorded by " + "; ".join(sources) + "."]


def classroom() -> list:
    records = [json.loads(p.read_text()) for p in sorted(CLASSROOM_DIR.glob("load-*.json"))]
    lines = []
    for r in records:
        gb_each = r["bytes_per_learner"] / 1e9
        lines += [
            f"Measured on loopback with `{r['command']}` ({r['date']}, {r['platform']}, {r['cpus']} cores, "
            f"{r['ram_bytes'] / 1e9:.0f} GB RAM): {r['clients']} learners at once each downloaded all {r['files']} files of "
            f"`{r['model']}` ({gb_each:.2f} GB), {r['clients'] * gb_each:.0f} GB in all.", "",
            "| | figure |", "|---|---|",
            f"| every file verified against the mirror's hashes | {'yes' if r['every_file_verified'] else 'NO'} |",
            f"| files interrupted halfway and resumed with `Range` | {r['resumed_files']} |",
            f"| one learner alone | {minutes(r['seconds_one_learner'])} |",
            f"| all {r['clients']} at once | {minutes(r['seconds_all_learners'])} "
            f"({r['seconds_all_learners'] / r['seconds_one_learner']:.1f}x one learner) |",
            f"| server memory (front + olah), idle | {r['server_rss_idle_bytes'] / 1e6:.0f} MB |",
            f"| server memory, peak with {r['clients']} learners | {r['server_rss_peak_bytes'] / 1e6:.0f} MB |",
        ]
        if "control" in r:
            c = r["control"]
            lines.append(f"| control: 2 learners straight to olah for `{c['file']}` ({c['file_bytes'] / 1e6:.0f} MB) | "
                         f"olah's memory {c['olah_rss_before_bytes'] / 1e6:.0f} MB -> {c['olah_rss_peak_bytes'] / 1e6:.0f} MB |")
        lines += ["", "The learners ran on the same two cores as the server and hashed every byte, so the room's time is "
                  "bounded by that hashing, not by the server; on a real network the link is the limit. The page cache "
                  "holding the checkpoint is the kernel's, shared by every request, and not in these figures."]
    return lines


def render() -> str:
    parts = [
        "# Instructor guide",
        "",
        "<!-- Rendered by tools/render_docs.py from data/: edit the tool, not this file. -->",
        "",
        "A one-day workshop of about twenty people, on their own machines (an 8 GB RTX 4060 on Windows, a 16 GB laptop "
        "card, Colab's free T4) or on CPUs only. Every figure below comes from a recorded run; rerun the command beside "
        "it to measure your own machines.",
        "",
        "## Before the day: pre-flight every machine",
        "",
        "Ask each learner to set up and run the setup check a few days ahead (it exits with status 1 when a line fails, "
        "and each failing line names its fix):",
        "",
        "```bash",
        "python -m helpers.course setup      # Windows (PowerShell), Linux, macOS: no make needed; `make install` does the same",
        "python -m helpers.environment       # the pre-flight check (notebook 00 shows the same as a table)",
        "```",
        "",
        "On Windows the check fails a CPU-only torch beside an NVIDIA GPU and a page file too small for the checkpoint, "
        "printing the exact command for each. Colab learners only need the *Open in Colab* badge of each notebook and "
        "*Runtime > Change runtime type > T4 GPU*. Errors and their fixes: "
        f"[troubleshooting]({Path(links.TROUBLESHOOTING_PAGE).name}).",
        "",
        "## Agenda",
        "",
        "Run time of each notebook executed top to bottom without a person (`tools/run_course.py`, nbval): the machine's "
        "part of the day. Reading, explaining and the exercises at the end of each notebook come on top. On `tiny` "
        "everything runs on a CPU; on `e4b-shape` (the real E4B's shapes) the notebooks ran under a simulated card "
        "(`CARD_GB`). A failure there is a notebook that needs more than that card, which is what notebook 06's planner "
        "predicts.",
        "",
        *agenda(),
        "",
        "## Serving the model to the room",
        "",
        "Twenty learners downloading 16 GB each over a venue's internet is the day's most likely failure. Download once, "
        "verify, and serve it from the instructor's machine:",
        "",
        "```bash",
        "python -m helpers.mirror serve ~/.cache/gemma-course/downloads/google--gemma-4-E4B-it --classroom",
        "```",
        "",
        "Learners set, before starting Jupyter (PowerShell: `$env:NAME = \"value\"` for each):",
        "",
        "```bash",
        "export HF_ENDPOINT=http://<instructor-ip>:8090 HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_IMPLICIT_TOKEN=1",
        "```",
        "",
        "The mirror sends files straight from disk and resumes interrupted ones; olah (behind it, on loopback) answers "
        "only the file lists. Without `--classroom` it serves this machine only. It serves plain HTTP without a password: "
        "stop it (Ctrl+C) when the class is over. `python -m lab.classroom load e2b-shape --clients 20 --record` "
        "measures it on your own machine before the day.",
        "",
        *classroom(),
        "",
        "## When GPUs are short",
        "",
        "- **CPU only.** Every notebook runs on `tiny` on a CPU (the agenda's first column): the lessons' logic runs for "
        "real, and where a figure needs a GPU the notebook shows the one recorded on an H200 (`data/gpu-tier/`).",
        "- **Colab.** The free T4 (15 GB) runs E4B in NF4; notebook 06's planner says what fits there.",
        "- **One big GPU for several learners.** `CARD_GB=8` caps a kernel at an RTX 4060's memory "
        "(`torch.cuda.set_per_process_memory_fraction`), so one large card can host several learners' kernels side by "
        "side, each seeing its own 8 GB card. `make test-gpu-cards` runs the notebooks that way on three cards at once.",
        "- **Pairs.** One machine with a GPU per pair; the other runs the same notebook on `tiny` and compares.",
        "",
        "## After each notebook",
        "",
        "Each notebook ends by handing the GPU back; JupyterLab keeps kernels alive, so ask learners to shut down the "
        "previous notebook's kernel before the next (*Kernel > Shut Down All Kernels*). Exercises end every notebook; "
        "`helpers.exercises.check` tells a learner whether an answer is right, and `solutions/` has worked answers.",
        "",
    ]
    return "\n".join(parts)


def figures() -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers import charts, planner, records

    FIGURES.mkdir(parents=True, exist_ok=True)
    memory = records.latest_records(preset="memory")
    cards = records.latest_records(preset="cards")
    written = []
    for name, draw in (("peak-vs-context.png", lambda ax: charts.peak_vs_context(memory, ax=ax, planner=planner.predicted_peak)),
                       ("what-fits-on-which-card.png", lambda ax: charts.card_fits(cards, ax=ax,
                                                                                   planner=planner.expected_largest_context)),
                       ("long-prompts.png", lambda ax: charts.peak_against_context_paths(
                           planner.chunked_peaks(records.LONG_CONTEXTS), records.long_context_peaks(), ax=ax))):
        figure, ax = plt.subplots(figsize=(9, 5.5))
        draw(ax)
        figure.tight_layout()
        figure.savefig(FIGURES / name, dpi=110, metadata={"Software": None})
        plt.close(figure)
        written.append(FIGURES / name)
    return written


def main(argv) -> int:
    fresh = render()
    if "--check" in argv:
        if not GUIDE.is_file() or GUIDE.read_text() != fresh:
            print(f"{GUIDE} is out of date with data/: run python tools/render_docs.py")
            return 1
        return 0
    GUIDE.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(GUIDE, fresh)  # whole or not at all: a full disk leaves the old guide
    for path in figures():
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"wrote {GUIDE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
