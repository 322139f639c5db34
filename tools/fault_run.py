"""Download through the course's mirror while a proxy injects faults, and count what got through.

    python tools/fault_run.py --faults 200            # writes data/faults/<date>.json
    python tools/fault_run.py --faults 22 --no-record # a quick look

The tiny checkpoint is served by olah behind the course's front (helpers.mirror) on loopback; the
faulty proxy (helpers.faults) sits between it and ``download.download``. The plan holds every fault
kind equally often, shuffled. Rounds of ``download`` into fresh folders run until every planned fault
has been injected; after each round every file is compared byte for byte with the served model, which
is independent of the hashes ``download`` checked itself. A control round downloads with a plain
``snapshot_download`` through the silent faults (a flipped byte, a zero Content-Length) to show that
they do spoil files when nothing verifies them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers import download, faults, mirror, synthetic  # noqa: E402
from helpers.paths import FAULTS_DIR  # noqa: E402

REPO = "google/gemma-4-E4B-it"
LFS_THRESHOLD = 100_000  # the tiny checkpoint's weights become an LFS object, as on the Hub
DROP_AFTER_BYTES = 20_000


def plan_of(count: int, seed: int) -> list:
    """``count`` faults, every kind as often as the others (to within one), in a shuffled order."""
    kinds = list(faults.KINDS) * (count // len(faults.KINDS) + 1)
    plan = kinds[:count]
    random.Random(seed).shuffle(plan)
    return plan


def spoiled_files(folder: Path, source: dict) -> list:
    """Files of ``folder`` that differ from the served model's bytes (or are missing)."""
    return sorted(name for name, data in source.items() if not (folder / name).is_file() or (folder / name).read_bytes() != data)


def run(count: int = 200, seed: int = 0, stall_s: float = 2.0, read_timeout_s: float = 1.0, workdir=None) -> dict:
    from huggingface_hub import constants, snapshot_download

    workdir = Path(workdir or tempfile.mkdtemp(prefix="fault-run-"))
    saved = constants.HF_HUB_OFFLINE, constants.HF_HUB_DOWNLOAD_TIMEOUT
    constants.HF_HUB_OFFLINE, constants.HF_HUB_DOWNLOAD_TIMEOUT = False, read_timeout_s  # loopback only; a stall noticed fast
    started = time.monotonic()
    try:
        model = synthetic.build("tiny", progress=False)
        source = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
        plan = plan_of(count, seed)
        rounds = []
        with mirror.Mirror(model, REPO, workdir=workdir / "mirror", lfs_threshold=LFS_THRESHOLD) as served, \
                faults.FaultyProxy(served.endpoint, plan, drop_after_bytes=DROP_AFTER_BYTES, stall_s=stall_s) as proxy:
            while proxy.faults_left and len(rounds) < count:
                folder = workdir / f"round-{len(rounds) + 1}"
                before = sum(proxy.injected.values())
                result = download.download(REPO, folder, endpoint=proxy.endpoint, max_attempts=max(100, count), sleep=lambda s: None)
                rounds.append({"faults": sum(proxy.injected.values()) - before, "attempts": result.attempts,
                               "refetched_after_verification": len(result.refetched),
                               "verified": sum(status == "ok" for status in result.checks.values()),
                               "spoiled_though_download_returned": spoiled_files(folder, source)})
            injected = dict(proxy.injected)
        control = control_round(model, source, workdir, snapshot_download, stall_s)
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DOWNLOAD_TIMEOUT = saved
    return {
        "faults_planned": count, "faults_injected": sum(injected.values()), "injected_by_kind": dict(sorted(injected.items())),
        "rounds": len(rounds), "attempts": sum(r["attempts"] for r in rounds),
        "files_delivered": sum(r["verified"] for r in rounds),
        "files_refetched_after_verification": sum(r["refetched_after_verification"] for r in rounds),
        "spoiled_files_download_returned": sum(len(r["spoiled_though_download_returned"]) for r in rounds),
        "control_plain_snapshot_download": control,
        "seed": seed, "seconds": round(time.monotonic() - started, 1), "per_round": rounds,
    }


def control_round(model: Path, source: dict, workdir: Path, snapshot_download, stall_s: float) -> dict:
    """The silent faults against huggingface_hub alone: what it accepts when nothing verifies."""
    plan = list(faults.SILENT_FAULTS) * 2
    spoiled, rounds = [], 0
    with mirror.Mirror(model, REPO, workdir=workdir / "mirror", lfs_threshold=LFS_THRESHOLD) as served, \
            faults.FaultyProxy(served.endpoint, plan, drop_after_bytes=DROP_AFTER_BYTES, stall_s=stall_s) as proxy:
        while proxy.faults_left and rounds < 10:
            rounds += 1
            folder = workdir / f"control-{rounds}"
            snapshot_download(REPO, local_dir=str(folder), endpoint=proxy.endpoint, token=False,
                              allow_patterns=download.COURSE_PATTERNS)
            spoiled += spoiled_files(folder, source)
        injected = dict(proxy.injected)
    return {"faults_injected": dict(sorted(injected.items())), "spoiled_files_accepted": len(spoiled)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help=f"print only; do not write {FAULTS_DIR}/<date>.json")
    args = parser.parse_args(argv)
    record = run(args.faults, args.seed)
    import huggingface_hub

    record.update(date=time.strftime("%Y-%m-%d"), huggingface_hub=huggingface_hub.__version__, olah=mirror.OLAH_VERSION,
                  command=f"python tools/fault_run.py --faults {args.faults} --seed {args.seed}")
    summary = {key: value for key, value in record.items() if key != "per_round"}
    print(json.dumps(summary, indent=1))
    if not args.no_record:
        FAULTS_DIR.mkdir(parents=True, exist_ok=True)
        target = FAULTS_DIR / f"{record['date']}.json"
        target.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {target}")
    ok = (record["faults_injected"] == args.faults and record["spoiled_files_download_returned"] == 0
          and record["control_plain_snapshot_download"]["spoiled_files_accepted"] > 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
