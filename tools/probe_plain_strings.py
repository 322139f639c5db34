"""Record what each transformers release does with a chat message whose content is a plain string,
into data/chat/plain-string-content.json (one entry per release and processor class; reruns replace).

    python tools/probe_plain_strings.py 5.5.2 5.6.2 5.7.0 5.17.0 5.24.0
    python tools/probe_plain_strings.py --here      # only the transformers this python has

Each release gets the venv `make test-matrix` builds for it (.cache/matrix-transformers-<version>) and is
probed in a fresh process: `python -m helpers.chat probe` on the tiny checkpoint, through the full Gemma 4
processor where torchvision is importable, else through helpers.chat.TextProcessor (the same inherited
ProcessorMixin.apply_chat_template). Run it on a GPU box with torchvision to record Gemma4Processor itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: helpers without an install
from helpers.paths import CHAT_DIR  # noqa: E402

RECORD = CHAT_DIR / "plain-string-content.json"


def python_for(version: str) -> str:
    """The python of the release's own venv, built by the Makefile's rule (once)."""
    marker = f".cache/matrix-transformers-{version}/.installed"
    subprocess.run(["make", "--no-print-directory", marker], cwd=ROOT, check=True)
    return str(ROOT / Path(marker).parent / "bin" / "python")


def probe(python: str) -> dict:
    env = dict(os.environ, GEMMA_COURSE_CACHE=tempfile.mkdtemp(prefix="probe-"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([python, "-m", "helpers.chat", "probe", "--model", "tiny"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="transformers releases to install and probe")
    parser.add_argument("--here", action="store_true", help="probe the transformers this python already has")
    args = parser.parse_args(argv)
    results = ([probe(sys.executable)] if args.here else []) + [probe(python_for(v)) for v in args.versions]
    entries = json.loads(RECORD.read_text()) if RECORD.is_file() else []
    fresh = {(r["transformers"], r["processor"]) for r in results}
    entries = [e for e in entries if (e["transformers"], e["processor"]) not in fresh] + results
    entries.sort(key=lambda e: ([int(n) for n in e["transformers"].split(".")[:3]], e["processor"]))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(entries, indent=1) + "\n")
    for entry in results:
        print(f"{entry['transformers']:>8} {entry['processor']:<16} tokenize=True: {entry['tokenize=True']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
