"""Host memory: what a process holds in RAM, split the way the operating system counts it.

Anonymous memory (``RssAnon``: Python objects, tensors on the CPU, pinned buffers) is what runs a
12.7 GB Colab VM out of memory. File-backed memory (``RssFile``: the safetensors shards mapped
while loading; ``RssShmem`` too, where the checkpoint sits on a RAM disk such as ``/dev/shm``) sits in
the page cache. Peaks are sampled
from ``/proc/self/status`` on Linux; elsewhere only the total resident size is known.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from .errors import require_positive_number

STATUS = "/proc/self/status"
FIELDS = {"RssAnon": "anon_bytes", "RssFile": "file_bytes", "RssShmem": "shmem_bytes"}


def current() -> dict:
    """This process's resident memory now: anonymous, file-backed and shared bytes (Linux), or the
    total (``rss_bytes``) where ``/proc`` does not exist."""
    if os.path.exists(STATUS):
        values = {}
        with open(STATUS) as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    values[FIELDS[key]] = int(rest.split()[0]) * 1024
        return values
    import psutil

    return {"rss_bytes": psutil.Process().memory_info().rss}


def peak_rss_bytes() -> int:
    """The largest resident size this process has had: ``getrusage`` where it exists, the peak working set on
    Windows (which has no ``resource`` module)."""
    if os.name != "nt":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux kilobytes
    import psutil

    return psutil.Process().memory_info().peak_wset


def total_ram_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


@dataclass
class Peaks:
    anon_bytes: int | None = None
    file_bytes: int | None = None
    rss_bytes: int | None = None


class PeakSampler:
    """Sample ``current()`` every ``interval_s`` in a thread and keep each field's peak::

        with PeakSampler() as load:
            model = load_model(...)
        load.peaks.anon_bytes
    """

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = require_positive_number(interval_s, "interval_s")
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = current()
        if "file_bytes" in now:  # a checkpoint on tmpfs is mapped as shared memory: page cache all the same
            now["file_bytes"] += now.pop("shmem_bytes", 0)
        for key, value in now.items():
            key = key if key in ("anon_bytes", "file_bytes", "rss_bytes") else None
            if key and (getattr(self.peaks, key) is None or value > getattr(self.peaks, key)):
                setattr(self.peaks, key, value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
