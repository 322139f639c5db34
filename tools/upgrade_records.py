"""Bring every benchmark record in data/measurements/ to the current schema (``records.SCHEMA``), once, so that the
readers hold no branch for an older format:

    python tools/upgrade_records.py           # rewrite the files (atomically) where a record is older
    python tools/upgrade_records.py --check   # exit 1 if any record is older

Schema 1 (no ``schema`` key): a rounding verdict without ``statistic`` and ``bound`` was judged on the largest
difference against ``measure.ROUNDING_BOUND`` (0.1 then as now); schema 2 says so in the record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import records  # noqa: E402
from helpers.measure import ROUNDING_BOUND  # noqa: E402
from helpers.paths import MEASUREMENTS_DIR, write_text_atomically  # noqa: E402


def upgraded(record: dict) -> dict:
    """The record in the current schema; a current one comes back as it is."""
    if record.get("schema") == records.SCHEMA:
        return record
    record = dict(record)
    rounding = (record.get("identity") or {}).get("rounding")
    if rounding is not None and "statistic" not in rounding:
        record["identity"] = {**record["identity"], "rounding": {**rounding, "statistic": "max", "bound": ROUNDING_BOUND}}
    record["schema"] = records.SCHEMA
    return record


def main(argv) -> int:
    check = "--check" in argv
    stale = []
    for path in sorted(MEASUREMENTS_DIR.glob("*.jsonl")):
        found = records.record_lines(path)
        current = [upgraded(record) for record in found]
        if current != found:
            stale.append(path)
            if not check:
                write_text_atomically(path, "".join(json.dumps(record, sort_keys=True) + "\n" for record in current))
    for path in stale:
        print(f"{path.name}: {'older records; run python tools/upgrade_records.py' if check else 'upgraded'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
