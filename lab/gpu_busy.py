"""How busy the GPU was while decoding, by the driver's own sampler instead of a tracer.

NVML's utilization samples give, for each sample period, the share of time in which any kernel ran. A
thread collects them while the timed runs decode; only the samples whose whole period falls inside a
decode window count (the prefill and the host's work between runs left out). A traced profile reads low
for steps of many short kernels, since CUPTI adds a gap after each; the sampler adds nothing to the step.
"""

from __future__ import annotations

import statistics
import threading
import time

from helpers.errors import InvalidChoiceError, require_number

POLL_S = 0.25  # how often the thread empties the driver's sample buffer (it holds a few seconds at most)
MIN_SAMPLES = 3  # fewer whole periods inside the windows measure nothing
MIN_DECODE_S = 3.0  # decode at least this long while sampling, and on until MIN_SAMPLES whole periods fell inside
MAX_DECODE_S = 30.0  # ... or this long: NVML's period is 1/6 s to 1 s depending on the GPU


def busy_in_windows(samples: list, windows: list) -> dict | None:
    """The mean utilization of the ``samples`` ((timestamp µs, percent), in time order) whose period lies wholly
    inside one of the ``windows`` ((start s, end s) on the same clock), with their count and the period; None
    where fewer than ``MIN_SAMPLES`` do. A sample at time t covers the period before it."""
    if not isinstance(samples, list) or not isinstance(windows, list):
        raise InvalidChoiceError(f"samples={type(samples).__name__} and windows={type(windows).__name__} must be lists: "
                                 f"of (timestamp µs, percent) and of (start s, end s).")
    times = sorted({t for t, _ in samples})
    if len(times) < 2 or not windows:
        return None
    period_us = statistics.median(b - a for a, b in zip(times, times[1:]))
    inside = [value for t, value in samples
              if any(start * 1e6 + period_us <= t <= end * 1e6 for start, end in windows)]
    if len(inside) < MIN_SAMPLES:
        return None
    return {"share": round(statistics.fmean(inside) / 100, 4), "samples": len(inside),
            "period_ms": round(period_us / 1e3, 1), "decode_windows": len(windows)}


class Sampler:
    """Collects NVML's utilization samples of one GPU on a thread. ``decoded(seconds)`` marks the decode that
    just ended; ``result()`` stops and returns ``busy_in_windows`` (its share None where too few samples fell
    inside). ``Sampler.open`` is None where there is no NVML (a CPU machine, or no ``nvidia-ml-py``)."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle
        self._samples, self._windows, self._last = [], [], 0
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._collect, daemon=True, name="nvml-busy")
        self._thread.start()

    @classmethod
    def open(cls, device) -> Sampler | None:
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            try:  # torch's index counts only the visible GPUs; the UUID names the same one for NVML
                handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
            except pynvml.NVMLError:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # noqa: BLE001 - no NVML here: the record says so by leaving the figure out
            return None
        return cls(pynvml, handle)

    def _drain(self) -> None:
        with self._lock:
            self._drain_unlocked()

    def _drain_unlocked(self) -> None:
        try:
            _, samples = self._nvml.nvmlDeviceGetSamples(self._handle, self._nvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                         self._last)
        except self._nvml.NVMLError:  # NVML_ERROR_NOT_FOUND: no new sample since the last one
            return
        for sample in samples:
            if sample.timeStamp > self._last:
                self._samples.append((sample.timeStamp, sample.sampleValue.uiVal))
                self._last = sample.timeStamp

    def _collect(self) -> None:
        while not self._stop.wait(POLL_S):
            self._drain()

    def decoded(self, seconds: float) -> None:
        """A decode of ``seconds`` ended just now (the caller synchronized)."""
        require_number(seconds, "seconds")
        end = time.time()
        self._windows.append((end - seconds, end))

    @property
    def decoded_s(self) -> float:
        """The seconds of decoding marked so far."""
        return sum(end - start for start, end in self._windows)

    def wants_more(self) -> bool:
        """Whether another decode should be sampled: under ``MIN_DECODE_S`` so far, or under ``MAX_DECODE_S`` with
        fewer than ``MIN_SAMPLES`` whole periods inside the windows yet."""
        if self.decoded_s < MIN_DECODE_S:
            return True
        self._drain()
        with self._lock:
            samples = sorted(self._samples)
        return self.decoded_s < MAX_DECODE_S and busy_in_windows(samples, self._windows) is None

    def result(self) -> dict | None:
        time.sleep(2 * POLL_S)  # the last window's samples reach the buffer
        self._stop.set()
        self._thread.join()
        self._drain()
        samples = sorted(self._samples)
        found = busy_in_windows(samples, self._windows) or {"share": None}
        # how far the newest sample lies behind this clock: a mismatch of clocks would show here
        latest_gap = round(time.time() - samples[-1][0] / 1e6, 3) if samples else None
        return {**found, "samples_seen": len(samples), "newest_sample_age_s": latest_gap}
