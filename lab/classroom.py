"""A room of learners downloading one checkpoint from the classroom mirror at once, on loopback.

    python -m lab.classroom load e2b-shape --clients 20 --record

starts the mirror as an instructor would (``python -m helpers.mirror serve``, its own process), lets one
learner download every file, then ``--clients`` learners at once, each in a process of its own. Every
file is checked against the hashes the mirror lists (sha256 for LFS files, the git blob id otherwise);
every ``--resume-every``-th learner drops its connection halfway through the largest file and asks for
the rest with ``Range``, as huggingface_hub does after a dropped connection. The server's resident
memory (the mirror's process and olah's, sampled) is the figure: the page cache that serves the bytes
is the kernel's, shared and reclaimable, and is not in it. ``--control`` also sends two learners
straight to olah for one shard, which is what the mirror's front replaced. Learners hash what they
receive and keep none of it, so twenty copies of a 10 GB checkpoint need no disk.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from helpers import checksums, synthetic
from helpers.download import expected_files
from helpers.errors import InvalidChoiceError, require_whole_number
from helpers.mirror import LOOPBACK, free_port
from helpers.paths import CLASSROOM_DIR, REPO_ROOT

REPO = "google/gemma-4-E4B-it"  # the name learners ask for
CHUNK_BYTES = 1024 * 1024
SAMPLE_EVERY_S = 0.1


@dataclass
class Fetched:
    name: str
    ok: bool
    size: int
    seconds: float
    resumed: bool = False  # the connection was dropped halfway and the rest came as a 206
    detail: str = ""


def fetch(endpoint: str, repo: str, name: str, expected: checksums.Expected, *, resume_halfway: bool = False) -> Fetched:
    """GET one file and check it against ``expected``; with ``resume_halfway``, hang up after half of it and
    ask for the rest with ``Range: bytes=<half>-``, as a client does after a dropped connection."""
    parts = urlsplit(endpoint)
    path = f"/{repo}/resolve/main/{quote(name)}"
    digest = hashlib.sha256() if expected.kind == "sha256" else hashlib.sha1(f"blob {expected.size}\0".encode())
    started, received, resumed = time.perf_counter(), 0, False
    stop_at = (expected.size or 0) // 2 if resume_halfway else None
    for attempt in ("whole", "rest"):
        headers = {"Range": f"bytes={received}-"} if attempt == "rest" else {}
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        try:
            connection.request("GET", path, headers=headers)
            reply = connection.getresponse()
            wanted = 206 if attempt == "rest" else 200
            if reply.status != wanted:
                return Fetched(name, False, received, time.perf_counter() - started, resumed, f"HTTP {reply.status}, wanted {wanted}")
            while chunk := reply.read(CHUNK_BYTES if stop_at is None else min(CHUNK_BYTES, max(1, stop_at - received))):
                digest.update(chunk)
                received += len(chunk)
                if stop_at is not None and received >= stop_at:
                    break
        finally:
            connection.close()  # halfway: the learner's connection drops here
        if stop_at is None or received == expected.size:
            break
        stop_at, resumed = None, True
    ok = received == expected.size and digest.hexdigest() == expected.digest
    return Fetched(name, ok, received, time.perf_counter() - started, resumed,
                   "" if ok else f"{received} bytes of {expected.size}, {'hash differs' if received == expected.size else 'short'}")


def learner(endpoint: str, repo: str, expected: dict, resume_largest: bool = False, only=None) -> list:
    """One learner: every file (or those in ``only``), one after another, each checked; returns ``Fetched`` as dicts."""
    largest = max(expected, key=lambda name: expected[name].size or 0)
    names = sorted(only or expected)
    return [asdict(fetch(endpoint, repo, name, expected[name], resume_halfway=resume_largest and name == largest))
            for name in names]


def _learner_process(args) -> list:
    endpoint, repo, expected, resume_largest, only = args
    return learner(endpoint, repo, {k: checksums.Expected(*v) for k, v in expected.items()}, resume_largest, only)


class PeakMemory:
    """The largest resident memory of a process and its children, sampled on a thread of its own."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.peak = {"total": 0, "front": 0, "olah": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        import psutil

        try:
            front = self.root.memory_info().rss
            olah = sum(child.memory_info().rss for child in self.root.children(recursive=True))
        except psutil.Error:
            return {"total": 0, "front": 0, "olah": 0}
        return {"total": front + olah, "front": front, "olah": olah}

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.sample()
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            self._stop.wait(SAMPLE_EVERY_S)

    def __enter__(self):
        self.peak = {"total": 0, "front": 0, "olah": 0}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def start_server(model_dir: Path, port: int, workdir: Path) -> subprocess.Popen:
    """``python -m helpers.mirror serve`` in a process of its own, as the instructor runs it; returns once it serves."""
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(workdir), "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "helpers.mirror", "serve", str(model_dir), "--repo", REPO,
                                "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "Ctrl+C stops it" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe from filling
            return process
    raise RuntimeError(f"the mirror did not start: {''.join(seen)[-2000:]}")


def olah_port(workdir: Path, front_port: int) -> int:
    """olah's own loopback port, from the configuration the mirror wrote for it."""
    text = (workdir / "mirror" / f"olah-{front_port}.toml").read_text()
    return int(re.search(r"^port = (\d+)", text, re.M)[1])


def run_learners(endpoint: str, expected: dict, clients: int, resume_every: int, only=None) -> tuple:
    """``clients`` learners at once, each in its own process; returns (seconds, [their results])."""
    import multiprocessing

    plain = {name: (e.digest, e.kind, e.size) for name, e in expected.items()}
    jobs = [(endpoint, REPO, plain, resume_every > 0 and (i + 1) % resume_every == 0, only) for i in range(clients)]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        results = pool.map(_learner_process, jobs)
    return time.perf_counter() - started, results


def load_test(model_dir, clients: int = 20, resume_every: int = 5, control: bool = False) -> dict:
    model_dir = Path(model_dir)
    clients = require_whole_number(clients, "clients", maximum=200)
    resume_every = require_whole_number(resume_every, "resume_every", minimum=0)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="classroom-") as work:
        workdir = Path(work)
        server = start_server(model_dir, port, workdir)
        try:
            endpoint = f"http://{LOOPBACK}:{port}"
            expected = expected_files(REPO, endpoint=endpoint, allow_patterns=["*"])
            memory = PeakMemory(server.pid)
            idle = memory.sample()
            with memory:
                one_seconds, one = run_learners(endpoint, expected, 1, 0)
            one_peak = dict(memory.peak)
            with memory:
                room_seconds, room = run_learners(endpoint, expected, clients, resume_every)
            room_peak = dict(memory.peak)
            record = {
                "clients": clients, "files": len(expected), "bytes_per_learner": sum(e.size for e in expected.values()),
                "every_file_verified": all(f["ok"] for learner_files in room + one for f in learner_files),
                "failures": [f for learner_files in room + one for f in learner_files if not f["ok"]][:10],
                "resumed_files": sum(f["resumed"] for learner_files in room for f in learner_files),
                "seconds_one_learner": round(one_seconds, 1), "seconds_all_learners": round(room_seconds, 1),
                "server_rss_idle_bytes": idle["total"], "server_rss_peak_one_learner_bytes": one_peak["total"],
                "server_rss_peak_bytes": room_peak["total"], "front_rss_peak_bytes": room_peak["front"],
                "olah_rss_peak_bytes": room_peak["olah"],
            }
            if control:
                record["control"] = olah_direct(workdir, port, expected, memory)
        finally:
            server.terminate()
            server.wait(30)
    return record


def olah_direct(workdir: Path, front_port: int, expected: dict, memory: PeakMemory) -> dict:
    """The control: two learners fetch the smallest shard of at least 100 MB straight from olah (what the front replaced)."""
    by_size = sorted((e.size, name) for name, e in expected.items())
    size, name = next((pair for pair in by_size if pair[0] >= 100 * 10**6), by_size[-1])  # the smallest shard, if any
    direct = f"http://{LOOPBACK}:{olah_port(workdir, front_port)}"
    before = memory.sample()
    with memory:
        seconds, results = run_learners(direct, expected, 2, 0, only=[name])
    return {"what": "2 learners fetch one shard straight from olah 0.5.4, past the front", "file": name, "file_bytes": size,
            "olah_rss_before_bytes": before["olah"], "olah_rss_peak_bytes": memory.peak["olah"],
            "verified": all(f["ok"] for r in results for f in r), "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Load-test the classroom mirror on loopback.")
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="N learners download one checkpoint at once")
    load.add_argument("model", help="a synthetic shape (tiny, e2b-shape, e4b-shape) or a checkpoint folder")
    load.add_argument("--clients", type=int, default=20)
    load.add_argument("--resume-every", type=int, default=5, help="every Nth learner drops its largest file halfway and resumes")
    load.add_argument("--control", action="store_true", help="also fetch one shard straight from olah, past the front")
    load.add_argument("--record", action="store_true", help=f"write the figures to {CLASSROOM_DIR}/load-<model>.json")
    args = parser.parse_args(argv)
    if args.model in synthetic.SHAPES:
        model_dir = synthetic.build(args.model)
    elif Path(args.model).is_dir():
        model_dir = Path(args.model)
    else:
        raise InvalidChoiceError(f"model={args.model!r} is neither a synthetic shape ({', '.join(synthetic.SHAPES)}) nor a folder.")
    record = load_test(model_dir, args.clients, args.resume_every, args.control)
    import psutil

    record.update(model=args.model, date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(), ram_bytes=psutil.virtual_memory().total,
                  platform=f"{platform.system()} {platform.machine()}", python=platform.python_version(),
                  command="python -m lab.classroom " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(record, indent=1))
    if args.record:
        CLASSROOM_DIR.mkdir(parents=True, exist_ok=True)
        name = args.model if args.model in synthetic.SHAPES else Path(args.model).name
        (CLASSROOM_DIR / f"load-{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0 if record["every_file_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
