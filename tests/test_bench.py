"""The benchmark's orchestration on CPU (the measurements themselves need a GPU: make bench)."""

import json
import subprocess
import sys

import pytest

from helpers import bench, cards, records
from helpers.planner import largest_true


def test_bisection_finds_the_largest_context_that_fits_to_the_resolution():
    assert 9000 - 512 <= largest_true(512, 32768, lambda c: c <= 9000) <= 9000
    assert largest_true(512, 32768, lambda c: True) == 32768
    assert largest_true(512, 32768, lambda c: False) is None  # does not even load a short prompt


def test_every_preset_runs_each_configuration_with_both_placements():
    for name, configurations in bench.presets().items():
        configurations = [c for c in configurations if not c.route]  # extra routes are measured alone
        keys = {(c.model, c.quant, c.card_gb, c.contexts) for c in configurations}
        for key in keys:
            assert {c.ple for c in configurations if (c.model, c.quant, c.card_gb, c.contexts) == key} == {"gpu", "cpu"}, name
    assert {c.card_gb for c in bench.presets()["cards"]} == {8, 15, 16}
    assert 8500 in bench.MEMORY_CONTEXTS


def test_dry_run_lists_measure_commands_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "helpers.bench", "cards", "--dry-run"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == len(bench.presets()["cards"])
    assert all(line.startswith("-m helpers.measure") and "--search-max-context" in line for line in lines)


def fake_runner(mismatch=False, crash_on=None, logits_mismatch=False):
    def run(config):
        if crash_on == config.ple:
            return {"crashed": "exit 1: boom"}
        resident = 3.9e9 if config.ple == "cpu" else 9.5e9
        return {"resident_bytes": resident, "decode_tokens_per_s": 9.0,
                "prefill": [{"context": c, "peak_bytes": resident + 1.7e9, "tokens_per_s": 4000.0} for c in config.contexts],
                "greedy_sha256": "b" if (mismatch and config.ple == "cpu") else "a", "greedy_tokens": [1, 2],
                "logits_sha256": "y" if (logits_mismatch and config.ple == "cpu") else "x", "greedy_distinct_tokens": 2}
    return run


def test_records_accumulate_and_ratios_compare_placements_from_the_same_run(tmp_path):
    records, comparisons = bench.run_preset("quick", runner=fake_runner(), directory=tmp_path)
    bench.run_preset("quick", runner=fake_runner(), directory=tmp_path)
    lines = (tmp_path / "e4b-shape.jsonl").read_text().splitlines()
    assert len(lines) == 2 * len(records)  # a second run appends, never overwrites
    assert all("greedy_tokens" not in json.loads(line) for line in lines)
    (comparison,) = comparisons
    assert comparison.ratios["resident"] == pytest.approx(3.9 / 9.5, abs=1e-3)
    assert comparison.ratios["peak@2048"] == pytest.approx(5.6 / 11.2, abs=1e-3)
    assert comparison.greedy_match is True


def test_a_greedy_mismatch_between_placements_is_reported(tmp_path):
    _, comparisons = bench.run_preset("quick", runner=fake_runner(mismatch=True), directory=tmp_path)
    assert [c.greedy_match for c in comparisons] == [False]


def test_logits_that_differ_are_reported_even_when_the_greedy_tokens_agree(tmp_path):
    _, comparisons = bench.run_preset("quick", runner=fake_runner(logits_mismatch=True), directory=tmp_path)
    assert [(c.greedy_match, c.logits_match) for c in comparisons] == [(True, False)]
    _, same = bench.run_preset("quick", runner=fake_runner(), directory=tmp_path / "same")
    assert [(c.greedy_match, c.logits_match) for c in same] == [(True, True)]


def test_a_crashed_configuration_is_recorded_as_a_result_not_raised(tmp_path):
    records, comparisons = bench.run_preset("quick", runner=fake_runner(crash_on="gpu"), directory=tmp_path)
    assert any("crashed" in r for r in records)
    assert comparisons[0].ratios["resident"] is None


def test_side_by_side_jobs_keep_memory_figures_but_null_every_speed(tmp_path):
    records, comparisons = bench.run_preset("quick", runner=fake_runner(), directory=tmp_path, jobs=2)
    for record in records:
        assert record["concurrent_jobs"] == 2 and record["resident_bytes"] > 0
        assert record["decode_tokens_per_s"] is None
        assert all(p["tokens_per_s"] is None and p["peak_bytes"] > 0 for p in record["prefill"])
    lines = (tmp_path / "e4b-shape.jsonl").read_text().splitlines()
    assert len(lines) == len(records) and all(json.loads(line) for line in lines)  # whole lines, none interleaved
    assert comparisons[0].ratios["decode_speed"] is None and comparisons[0].ratios["resident"] is not None


def test_the_naive_cpu_entry_is_timed_but_never_compared_as_a_placement(tmp_path):
    (naive,) = [c for c in bench.presets()["speed"] if c.route]
    assert naive.measured_route == "cpu-entry" and "--route cpu-entry" in " ".join(naive.command("x.json"))
    records, comparisons = bench.run_preset("speed", runner=fake_runner(), directory=tmp_path)
    assert len(records) == len(bench.presets()["speed"])
    assert {(c.model, c.quant) for c in comparisons} == {("e4b-shape", "nf4"), ("e2b-shape", "nf4")}


def test_decode_speeds_come_only_from_runs_timed_one_process_at_a_time(tmp_path):
    bench.run_preset("speed", runner=fake_runner(), directory=tmp_path)
    speeds = records.decode_speeds("e4b-shape", directory=tmp_path)
    assert speeds == {"ple-gpu": 9.0, "ple-cpu": 9.0, "cpu-entry": 9.0}
    side_by_side = tmp_path / "concurrent"
    bench.run_preset("speed", runner=fake_runner(), directory=side_by_side, jobs=2)
    with pytest.raises(FileNotFoundError, match="helpers.bench speed"):
        records.decode_speeds("e4b-shape", directory=side_by_side)  # nulled timings are not speeds


def test_the_recorded_speeds_show_the_naive_cpu_entry_far_slower_than_the_course_offload():
    speeds = records.decode_speeds("e4b-shape")
    assert speeds["cpu-entry"] < speeds["ple-cpu"] / 5


def test_every_record_has_the_issue_keys_even_when_loading_runs_out_of_memory(tmp_path):
    def runner(config):
        if config.ple == "gpu":
            return {"load_error": "InsufficientGPUMemoryError: ...", "load_oom": True, "model": config.model}
        return fake_runner()(config)

    records, comparisons = bench.run_preset("cards", runner=runner, directory=tmp_path)
    for line in (tmp_path / "e4b-shape.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert set(bench.RECORD_KEYS) <= set(record), set(bench.RECORD_KEYS) - set(record)
        assert record["card_gb"] in cards.SIMULATED_CARDS_GB and record["date"]
        if record["ple"] == "gpu":
            assert record["resident_bytes"] is None and record["prefill"] == [] and record["max_context"] is None
    assert all(c.ratios["resident"] is None for c in comparisons)
