"""A small mutation check: break the code on purpose, one known way at a time, and make sure a test
notices. Each mutation is applied to a copy of the repository, never to this one.

    python tools/mutations.py            # every mutation the CPU suite must kill (exit 1 if one survives)
    python tools/mutations.py --list     # the mutations (tools/mutations.json), including those only the GPU tier can kill

A mutation whose text no longer occurs in its file, or that names a test no longer there, fails the check too: the
list must follow the code. Each mutation names the tests that notice it, so a run is short; the mutations run one per
core (at most four) at once, each in its own copy and its own empty model cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pytest import ExitCode

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("helpers", "tests", "data", "tools", "pyproject.toml", "requirements.txt", "README.md")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple
    gpu_only: bool = False  # killed by the GPU tier (make test-gpu-tier), not by the CPU suite


# the named mutations, as data: {name, path, old, new, tests, gpu_only?}
MUTATIONS = tuple(Mutation(**{**entry, "tests": tuple(entry["tests"])})
                  for entry in json.loads((ROOT / "tools" / "mutations.json").read_text()))


def check_applies(mutation: Mutation) -> None:
    count = (ROOT / mutation.path).read_text().count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: its text occurs {count} times in {mutation.path}; update tools/mutations.json")
    for test in mutation.tests:
        path, _, name = test.partition("::")
        name = name.split("[")[0]  # a parametrized id names the function before its brackets
        source = ROOT / path
        if not source.is_file() or (name and not re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M)):
            raise SystemExit(f"mutation {mutation.name!r}: its test {test} is not there; update tools/mutations.json")


def killed(mutation: Mutation) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "repo"
        copy.mkdir()
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, copy / name)
        target = copy / mutation.path
        target.write_text(target.read_text().replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": str(copy), "GEMMA_COURSE_CACHE": str(Path(scratch) / "cache")}
        done = subprocess.run([sys.executable, "-m", "pytest", *mutation.tests, "-x", "-q", "-p", "no:cacheprovider",
                               "-m", "not gpu"], cwd=copy, env=env, capture_output=True, text=True)
        if done.returncode in (ExitCode.USAGE_ERROR, ExitCode.NO_TESTS_COLLECTED):  # a name that selects nothing kills nothing
            raise SystemExit(f"mutation {mutation.name!r}: pytest ran none of {', '.join(mutation.tests)}:\n{done.stdout[-1000:]}")
        return done.returncode != 0


def main(argv) -> int:
    for mutation in MUTATIONS:
        check_applies(mutation)
    if "--list" in argv:
        for mutation in MUTATIONS:
            print(f"{'GPU tier' if mutation.gpu_only else 'CPU suite'}: {mutation.name} ({mutation.path}; {', '.join(mutation.tests)})")
        return 0
    for mutation in MUTATIONS:
        if mutation.gpu_only:
            print(f"  (GPU tier) {mutation.name}: killed only by {', '.join(mutation.tests)}")
    survivors = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(4, cores)) as pool:  # at most four: each holds torch and a model build
        cpu_suite = [mutation for mutation in MUTATIONS if not mutation.gpu_only]
        for mutation, verdict in zip(cpu_suite, pool.map(killed, cpu_suite)):
            print(f"  {'killed  ' if verdict else 'SURVIVED'} {mutation.name}", flush=True)
            if not verdict:
                survivors.append(mutation.name)
    print(f"{len(survivors)} survivor(s)" + (": " + "; ".join(survivors) if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
