"""Writing the recorded results: a record file whole or not at all, the host-memory figures a route record
carries, and the stamp (GPU, versions, date) on every record. ``helpers.records`` reads them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from helpers.errors import InvalidChoiceError
from helpers.paths import write_text_atomically

# anonymous and file-backed peaks of load and generate: every benchmark record carries them (bench.RECORD_KEYS)
HOST_PEAK_KEYS = ("host_load_anon_peak_bytes", "host_load_file_peak_bytes", "host_generate_anon_peak_bytes",
                  "host_generate_file_peak_bytes")
HOST_KEYS = (*HOST_PEAK_KEYS, "host_process_peak_bytes")


def write_record(path, data) -> None:
    """Write a record as JSON, whole or not at all: a crash mid-write leaves the previous file as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def split_host(record: dict) -> dict:
    """Take a route record's host-memory figures out of it, returned with what says where they come from."""
    if not isinstance(record, dict):
        raise InvalidChoiceError(f"record={record!r} is not a route record; pass the dict lab.measure wrote.")
    host = {key: record.pop(key) for key in HOST_KEYS if key in record}
    return {**host, **{key: record[key] for key in ("model", "quant", "ple", "route", "gpu", "versions", "date", "command")
                       if key in record}} if host else {}


def environment() -> dict:
    """The GPU, its memory and the library versions of this machine: the stamp on every record."""
    import accelerate
    import torch
    import transformers

    try:
        import bitsandbytes

        bnb = bitsandbytes.__version__
    except ImportError:
        bnb = None
    gpu = torch.cuda.get_device_properties(0)
    return {
        "gpu": gpu.name,
        "gpu_total_bytes": gpu.total_memory,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "bitsandbytes": bnb,
        },
        "date": datetime.date.today().isoformat(),
    }
