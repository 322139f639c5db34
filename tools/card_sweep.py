"""The notebooks on every card size a learner brings, in parts that each fit one 10-minute call on an H200.

Every size of ``helpers.cards.CARD_SIZES_GB`` (4 GB up) and the whole GPU, for e4b-shape and e2b-shape, then each
shape's edge cards: the sizes between those at which the planner first runs a new model or setup for some step, the
tightest card each choice is made on. A part is a few cards of one shape, run side by side by ``make test-gpu-cards``
(each card's notebooks in four groups, every kernel capped with CARD_GB) and recorded into
data/gpu-tier/notebooks-<shape>.json, which the README renders as a card x notebook table.

    python tools/card_sweep.py --list      # the parts, one line each
    python tools/card_sweep.py --todo      # the parts whose record is missing a notebook, stale or failing
    python tools/card_sweep.py 2           # run what part 2 has left here (a GPU machine), recorded
    python tools/card_sweep.py 12 13 --pack "$OUT" --deadline 470   # on a lent box: side by side, stop in time, one file back
    python tools/card_sweep.py --unpack part-12-13.tgz               # here: the records, and any JUnit they did not record
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers import planner  # noqa: E402
from helpers.cards import CARD_SIZES_GB  # noqa: E402
from helpers.paths import BUILD_DIR, GPU_TIER_DIR, NOTEBOOKS_DIR, write_text_atomically  # noqa: E402
from tools.record_nbval import card_label, code_hash  # noqa: E402

LOG = "card-sweep.log"

SHAPES = ("e4b-shape", "e2b-shape")
# two cards a call (eight kernels on the H200 box's 16 cores). Five cards, 20 kernels, ran group 00-03 in 455 s
# against about 200 s alone, and the part passed its 555 s limit with two groups unfinished.
CARDS_PER_PART = 2


# how finely the planner's verdicts are scanned for the sizes at which they turn (first every COARSE_STEPS of them, then
# by bisection where the choice changed), and the host memory assumed: the GPU box's never limits a step there
EDGE_STEP_GB = 0.05
COARSE_STEPS = 5
PLENTY_OF_RAM = 64e9


@functools.cache
def edge_cards(shape: str) -> tuple:
    """The card sizes, from the smallest learner's card to the largest, at which the planner first runs a model or setup
    it did not run on the size just below for some step, other than the learners' sizes: where a planner that promised
    a little too much would fail first. Notebook 03 failed so on 4.5 GB while 4 and 6 GB passed."""
    low, high = (round(gb / EDGE_STEP_GB) for gb in (min(CARD_SIZES_GB), max(CARD_SIZES_GB)))
    edges = set()
    for step in planner.STEPS:
        @functools.cache
        def made(index: int, step=step):
            choice = planner.choose(step, shape, card_gb=round(index * EDGE_STEP_GB, 2), ram_bytes=PLENTY_OF_RAM)
            return (choice.model, choice.setup) if choice else None

        coarse = [*range(low, high, COARSE_STEPS), high]
        for below, above in zip(coarse, coarse[1:]):
            while made(below) != made(above):  # the first size in (below, above] whose choice differs, by bisection
                first, last = below + 1, above
                while first < last:
                    middle = (first + last) // 2
                    first, last = (first, middle) if made(middle) != made(below) else (middle + 1, last)
                if made(first) is not None:
                    edges.add(round(first * EDGE_STEP_GB, 2))
                below = first
    return tuple(f"{gb:g}" for gb in sorted(edges - set(CARD_SIZES_GB)))


def parts() -> list:
    """(shape, cards) per part, in the order they run: every card size and "uncapped" for each shape, then each
    shape's edge cards."""
    def split(shape: str, sizes) -> list:
        return [(shape, tuple(sizes[i:i + CARDS_PER_PART])) for i in range(0, len(sizes), CARDS_PER_PART)]

    named = [f"{gb:g}" for gb in CARD_SIZES_GB] + ["uncapped"]
    return ([part for shape in SHAPES for part in split(shape, named)]
            + [part for shape in SHAPES for part in split(shape, edge_cards(shape))])


def unfinished(shape: str, cards: tuple, folder: Path = GPU_TIER_DIR, notebooks: Path = NOTEBOOKS_DIR) -> list:
    """One "card: notebook why" for each notebook of the part not recorded as passing on the code it has now, or
    recorded by more runs than one for its card: a card counts as one run of the sweep's command, whole."""
    path = folder / f"notebooks-{shape}.json"
    recorded = json.loads(path.read_text())["cards"] if path.is_file() else {}
    current = {p.name: code_hash(p.name, notebooks) for p in sorted(notebooks.glob("*.ipynb"))}  # each read once
    left = []
    for card in cards:
        entries = recorded.get(card_label(card), {})
        runs = {(e.get("gpu"), e.get("date"), e.get("command")) for name, e in entries.items() if name in current}
        for notebook, code in current.items():
            entry = entries.get(notebook)
            why = ("not run" if entry is None else "stale" if entry.get("code_sha") != code
                   else "failed" if entry["result"] != "pass" else f"one of {len(runs)} runs" if len(runs) > 1 else None)
            if why:
                left.append(f"{card_label(card)}: {notebook} {why}")
    return left


# make test-gpu-cards' default GPU_NOTEBOOK_GROUPS: each card's notebooks in four kernels side by side
NOTEBOOK_GROUPS = ("0[0-3]", "0[4-6]", "0[7-9]", "1[0-9]")


def command(shape: str, cards: tuple, groups: tuple = NOTEBOOK_GROUPS) -> list:
    return ["make", "--no-print-directory", "test-gpu-cards", f"GEMMA_MODEL={shape}", f"GPU_CARDS={' '.join(cards)}",
            *([] if groups == NOTEBOOK_GROUPS else [f"GPU_NOTEBOOK_GROUPS={' '.join(groups)}"])]


def left_to_run(number: int, folder: Path = GPU_TIER_DIR, notebooks: Path = NOTEBOOKS_DIR) -> tuple:
    """What part ``number`` still has to run: (shape, its cards with a notebook left, the notebook groups holding
    one); a group runs whole, so a notebook already passing beside one that is not runs again."""
    shape, cards = parts()[number - 1]
    left = unfinished(shape, cards, folder, notebooks)
    cards_left = tuple(card for card in cards if any(line.startswith(f"{card_label(card)}: ") for line in left))
    names = {line.split(": ", 1)[1].split(" ", 1)[0] for line in left}  # "4 GB: 00_setup.ipynb not run"
    groups = tuple(group for group in NOTEBOOK_GROUPS
                   if any(fnmatch.fnmatch(name, f"{group}*.ipynb") for name in names))
    return shape, cards_left, groups


def run(numbers, deadline: float | None = None, log: Path | None = None) -> int:
    """Run what parts ``numbers`` have left, recorded, side by side; past ``deadline`` seconds every part's process
    group is stopped, so that a lent machine's call ends with time left to send back what the groups that finished
    recorded. 0 when every part ran and passed (or had nothing left), 124 at the deadline, else the first failure."""
    started = time.monotonic()
    for junit in BUILD_DIR.glob("nbval-gpu-*.xml"):  # an earlier call's, on a box kept warm: not this run's
        junit.unlink()
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        processes = []
        for number in numbers:
            shape, cards, groups = left_to_run(number)
            if not cards:
                print(f"part {number}: nothing left to run", file=sink if log else sys.stderr, flush=True)
                continue
            processes.append((number, subprocess.Popen(
                command(shape, cards, groups), env={**os.environ, "GPU_RECORD": "1"}, start_new_session=True,
                stdout=sink if log else None, stderr=subprocess.STDOUT if log else None)))
        statuses = []
        for _, process in processes:
            left = None if deadline is None else max(0.0, deadline - (time.monotonic() - started))
            try:
                statuses.append(process.wait(timeout=left))
            except subprocess.TimeoutExpired:
                for _, other in processes:
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGTERM)
                        other.wait()
                print(f"parts {', '.join(str(n) for n, _ in processes)} stopped at the deadline of {deadline:g} s",
                      file=sys.stderr)
                return 124
    return next((status for status in statuses if status), 0)


def bundle_name(numbers) -> str:
    return "part-" + "-".join(str(number) for number in numbers) + ".tgz"


ENVIRONMENT = "environment.json"


def pack(numbers, folder: Path, log: Path | None = None, environment: dict | None = None) -> Path:
    """One file for the way back (a lent machine returns a few files only): the record of each shape the parts ran,
    the JUnit files of this run, its log and the machine it ran on (``environment``: GPU, memory, versions)."""
    target = Path(folder) / bundle_name(numbers)
    with tarfile.open(target, "w:gz") as bundle:
        if environment is not None:  # straight into the bundle: nothing beside it on disk
            stamp = json.dumps(environment).encode()
            member = tarfile.TarInfo(ENVIRONMENT)
            member.size = len(stamp)
            bundle.addfile(member, io.BytesIO(stamp))
        for shape in sorted({parts()[number - 1][0] for number in numbers}):
            record = GPU_TIER_DIR / f"notebooks-{shape}.json"
            if record.is_file():
                bundle.add(record, arcname=record.name)
        for junit in sorted(BUILD_DIR.glob("nbval-gpu-*.xml")):
            bundle.add(junit, arcname=f"junit/{junit.name}")
        if log and Path(log).is_file():
            bundle.add(log, arcname=LOG)
    return target


def unpack(bundle_path: Path) -> list:
    """Take a packed run in: the cards of its parts replace this tree's in each shape's record, then each JUnit file
    the box did not record itself is recorded, so a group stopped before its own record counts. It is stamped with
    the machine the bundle names or, from a bundle without one, the one its record holds for the same card that day;
    never another card's, which may have run on another machine."""
    from lab.records import write_record
    from tools import record_nbval

    numbers = [int(n) for n in Path(bundle_path).name.removeprefix("part-").removesuffix(".tgz").split("-")]
    shape_of = {card: shape for number in numbers for shape, cards in [parts()[number - 1]] for card in cards}
    recorded = []
    with tempfile.TemporaryDirectory() as work, tarfile.open(bundle_path) as bundle:
        bundle.extractall(work, filter="data")
        work = Path(work)
        entries = {}
        for shape in sorted(set(shape_of.values())):
            record = work / f"notebooks-{shape}.json"
            if not record.is_file():
                raise SystemExit(f"{bundle_path} holds no notebooks-{shape}.json: the run recorded nothing for {shape}")
            packed = json.loads(record.read_text())
            entries[shape] = packed["cards"]
            # only this bundle's cards: a bundle packed beside another from the same tree must not undo that one's
            mine = {card_label(card) for card, card_shape in shape_of.items() if card_shape == shape}
            here = GPU_TIER_DIR / record.name
            merged = json.loads(here.read_text()) if here.is_file() else {**packed, "cards": {}}
            merged["cards"].update({label: cards for label, cards in packed["cards"].items() if label in mine})
            write_record(here, merged)
        if (work / LOG).is_file():
            cards = [card for number in numbers for card in parts()[number - 1][1]]
            shapes = "-".join(sorted(set(shape_of.values())))
            write_text_atomically(GPU_TIER_DIR / f"notebooks-{shapes}-{'-'.join(cards)}.log", (work / LOG).read_text())
        machine = json.loads((work / ENVIRONMENT).read_text()) if (work / ENVIRONMENT).is_file() else None
        for junit in sorted((work / "junit").glob("nbval-gpu-*.xml")):
            card = junit.name.removeprefix("nbval-gpu-").rsplit("-", 1)[0]
            shape = shape_of.get(card)
            date = record_nbval.run_date(junit)
            card_entries = entries.get(shape, {}).get(card_label(card), {})
            if all(card_entries.get(name, {}).get("date") == date and card_entries[name]["passed"] == counts["passed"]
                   for name, counts in record_nbval.summarise(junit).items()):
                continue  # the box recorded this group itself, with its own command
            same_run = [machine] if machine else [e for e in card_entries.values() if e.get("date") == date and "gpu" in e]
            if not same_run:
                continue
            environment = work / "environment.jsonl"
            environment.write_text(json.dumps({key: same_run[-1][key] for key in ("gpu", "gpu_total_bytes", "versions")}))
            part_cards = next(cards for number in numbers for _, cards in [parts()[number - 1]] if card in cards)
            part_command = "GPU_RECORD=1 " + " ".join(command(shape, part_cards))
            record_nbval.main([str(junit), "--environment-from", str(environment), "--command", part_command,
                              "--model", shape, "--card", card])
            recorded.append(junit.name)
    return recorded


def require_parts(numbers, parser) -> list:
    """The parts asked for, each once; side by side they must not share a card label (the JUnit files name the card,
    not the shape)."""
    for number in numbers:
        if not 1 <= number <= len(parts()):
            parser.error(f"part {number} does not exist: choose 1 to {len(parts())} (--list names them)")
    numbers = list(dict.fromkeys(numbers))
    cards = [card for number in numbers for card in parts()[number - 1][1]]
    if len(cards) != len(set(cards)):
        parser.error(f"parts {', '.join(map(str, numbers))} share a card size; run them one after the other")
    return numbers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="*", type=int, help=f"the parts to run side by side, 1 to {len(parts())}")
    parser.add_argument("--list", action="store_true", help="print the parts and their commands")
    parser.add_argument("--todo", action="store_true", help="print the parts still to run on the notebooks as they are")
    parser.add_argument("--deadline", type=float, help="stop the part after this many seconds (what finished counts)")
    parser.add_argument("--pack", type=Path, metavar="DIR", help="then write DIR/part-N.tgz: record, JUnit files, log")
    parser.add_argument("--unpack", type=Path, metavar="TGZ", help="take in a packed part")
    args = parser.parse_args(argv)
    if args.unpack:
        print(f"recorded {len(unpack(args.unpack))} JUnit files; python tools/card_sweep.py --todo says what is left")
        return 0
    if args.todo:
        todo = [(number, left) for number, part in enumerate(parts(), 1) if (left := unfinished(*part))]
        for number, left in todo:
            print(f"part {number}: {len(left)} to run ({'; '.join(left[:3])}{'; ...' if len(left) > 3 else ''})")
        print(f"{len(todo)} of {len(parts())} parts to run" if todo else "every part is recorded passing on today's notebooks")
        return 0
    if args.list or not args.part:
        for number, (shape, cards) in enumerate(parts(), 1):
            print(f"{number}: {shape} on {', '.join(c if c == 'uncapped' else c + ' GB' for c in cards)}: GPU_RECORD=1 "
                  + " ".join(command(shape, cards)))
        return 0
    numbers = require_parts(args.part, parser)
    log = Path(args.pack) / LOG if args.pack else None
    status = run(numbers, args.deadline, log)
    if args.pack:
        import torch

        from lab.records import environment

        print(f"packed {pack(numbers, args.pack, log, environment() if torch.cuda.is_available() else None)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
