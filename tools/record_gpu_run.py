"""Record one whole `make test-gpu` run: its wall time and the outcome of each half, with the GPU
and versions, into data/gpu-tier/make-test-gpu.json (the Makefile calls this when GPU_RECORD=1).

    python tools/record_gpu_run.py --seconds 512 --tier-status 0 --notebooks-status 0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers.paths import GPU_TIER_DIR  # noqa: E402

TARGET = GPU_TIER_DIR / "make-test-gpu.json"
LIMIT_S = 600  # the budget: the whole GPU check within 10 minutes on one H200


def summary(seconds: float, tier_status: int, notebooks_status: int, environment: dict) -> dict:
    return {"seconds": round(seconds), "within_limit": seconds <= LIMIT_S, "limit_s": LIMIT_S,
            "gpu_tier": "pass" if tier_status == 0 else "fail", "notebooks": "pass" if notebooks_status == 0 else "fail",
            "command": "GPU_RECORD=1 make test-gpu", **environment}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--tier-status", type=int, required=True)
    parser.add_argument("--notebooks-status", type=int, required=True)
    args = parser.parse_args(argv)
    from lab.records import environment

    record = summary(args.seconds, args.tier_status, args.notebooks_status, environment())
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
