"""The driver-sampled GPU-busy share: only samples whose whole period lies in a decode window count, so a
prefill or the host's pause between runs cannot raise or lower it; and the sampler collects NVML's samples
once each, however often it asks."""

from __future__ import annotations

import time

import pytest
from conftest import FakeNvml

from lab import gpu_busy

PERIOD_US = 100_000


def samples_at(start_s: float, values: list) -> list:
    return [(int(start_s * 1e6) + (i + 1) * PERIOD_US, value) for i, value in enumerate(values)]


def test_a_prefill_before_the_decode_window_does_not_count_in_its_busy_share():
    # 0.0-0.3 s prefill at 20%, 0.3-1.0 s decode at 90%, then 0.3 s of host work at 0%
    samples = samples_at(0.0, [20, 20, 20] + [90] * 7 + [0, 0, 0])
    found = gpu_busy.busy_in_windows(samples, [(0.3, 1.0)])
    assert found == {"share": 0.9, "samples": 7, "period_ms": 100.0, "decode_windows": 1}
    everything = gpu_busy.busy_in_windows(samples, [(0.0, 1.3)])  # control: the whole run, prefill and pause in
    assert everything["share"] < 0.7


def test_a_sample_whose_period_began_before_the_window_is_left_out():
    samples = samples_at(0.0, [10, 95, 95, 95, 95])  # the first covers 0.0-0.1 s, before the decode began at 0.05
    found = gpu_busy.busy_in_windows(samples, [(0.05, 0.5)])
    assert (found["share"], found["samples"]) == (0.95, 4)


@pytest.mark.parametrize("samples, windows", [([], [(0, 1)]), (samples_at(0.0, [90] * 3), []),
                                              (samples_at(0.0, [90] * 10), [(0.0, 0.25)])],
                         ids=["no-samples", "no-window", "window-shorter-than-three-periods"])
def test_too_few_samples_inside_a_window_measure_nothing(samples, windows):
    assert gpu_busy.busy_in_windows(samples, windows) is None


def test_no_nvml_on_a_cpu_means_no_sampler():
    assert gpu_busy.Sampler.open("cpu") is None


def test_the_sampler_keeps_each_sample_once_and_measures_the_windows_it_was_told(monkeypatch):
    monkeypatch.setattr(gpu_busy, "POLL_S", 0.05)
    sampler = gpu_busy.Sampler(FakeNvml(87), handle=None)
    time.sleep(0.6)
    sampler.decoded(0.5)
    result = sampler.result()
    stamps = [t for t, _ in sampler._samples]
    assert len(stamps) == len(set(stamps)) and result["samples_seen"] == len(stamps)
    assert result["share"] == 0.87 and 30 <= result["samples"] <= 50, result
    assert 0 <= result["newest_sample_age_s"] < 1


def test_the_sampler_counts_the_decoding_it_was_told_of(monkeypatch):
    sampler = gpu_busy.Sampler(FakeNvml(50), handle=None)
    sampler.decoded(0.5)
    sampler.decoded(1.25)
    assert sampler.decoded_s == pytest.approx(1.75)
    sampler.result()


def test_the_sampler_asks_for_more_decoding_until_enough_whole_periods_fell_inside(monkeypatch):
    monkeypatch.setattr(gpu_busy, "MIN_DECODE_S", 0.0)
    sampler = gpu_busy.Sampler(FakeNvml(50), handle=None)
    time.sleep(0.05)
    sampler.decoded(0.02)  # two of the fake's 10 ms periods at most
    assert sampler.wants_more()
    time.sleep(0.2)
    sampler.decoded(0.15)
    assert not sampler.wants_more()
    monkeypatch.setattr(gpu_busy, "MAX_DECODE_S", 0.1)  # the cap: a GPU whose samples never come stops asking
    stalled = gpu_busy.Sampler(FakeNvml(50), handle=None)
    stalled.decoded(0.2)
    stalled._samples.clear()
    assert not stalled.wants_more()
    sampler.result(), stalled.result()


@pytest.mark.parametrize("call, message", [(lambda s: gpu_busy.busy_in_windows("90%", []), "samples="),
                                           (lambda s: s.decoded("1.4"), "seconds="),
                                           (lambda s: s.decoded(float("nan")), "seconds=")],
                         ids=["samples-as-text", "seconds-as-text", "seconds-nan"])
def test_bad_samples_or_decode_times_are_refused_in_one_sentence(call, message):
    from helpers.errors import CourseError

    sampler = gpu_busy.Sampler(FakeNvml(50), handle=None)
    try:
        with pytest.raises(CourseError, match=message):
            call(sampler)
    finally:
        sampler.result()
