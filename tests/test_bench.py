"""The benchmark's orchestration on CPU (the measurements themselves need a GPU: make bench)."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import cards, long_context, measure, models, records
from helpers.errors import CourseError, InvalidChoiceError
from helpers.planner import largest_true
from lab import bench


def test_bisection_finds_the_largest_context_that_fits_to_the_resolution():
    assert 9000 - 512 <= largest_true(512, 32768, lambda c: c <= 9000) <= 9000
    assert largest_true(512, 32768, lambda c: True) == 32768
    assert largest_true(512, 32768, lambda c: False) is None  # does not even load a short prompt


def test_every_preset_runs_each_configuration_with_both_placements():
    for name, configurations in bench.presets().items():
        configurations = [c for c in configurations if not c.route and not c.name]  # extra routes and named ones alone
        keys = {(c.model, c.quant, c.card_gb, c.contexts) for c in configurations}
        for key in keys:
            assert {c.ple for c in configurations if (c.model, c.quant, c.card_gb, c.contexts) == key} == {"gpu", "cpu"}, name
    assert {c.card_gb for c in bench.presets()["cards"]} == {8, 15, 16}
    assert 8500 in bench.MEMORY_CONTEXTS


def test_dry_run_lists_measure_commands_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "lab.bench", "cards", "--dry-run"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == len(bench.presets()["cards"])
    assert all(line.startswith("-m lab.measure") and "--search-max-context" in line for line in lines)


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
    with pytest.raises(FileNotFoundError, match="lab.bench speed"):
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


# --------------------------------------------------------------------------- the long-context and speed presets

# every long-context and decode preset: each is one device call, which may run ten minutes at most
ONE_CALL_PRESETS = tuple(name for name in bench.presets() if name.startswith(("long-context", "decode-")))


def test_every_long_context_and_speed_preset_is_estimated_to_finish_within_ten_minutes_on_the_gpu_the_speeds_were_recorded_on():
    for name in ONE_CALL_PRESETS:
        total = sum(bench.estimate_seconds(config) for config in bench.presets()[name])
        assert 60 < total < 600, (name, total)


def test_a_profiled_configuration_is_estimated_longer_since_the_profiler_and_its_trace_take_time():
    plain = bench.Configuration("e4b-shape", "nf4", "cpu", name="a", decode="generate", new_tokens=256)
    profiled = bench.Configuration("e4b-shape", "nf4", "cpu", name="a", decode="generate", new_tokens=256, profile=True)
    assert bench.estimate_seconds(profiled) - bench.estimate_seconds(plain) == pytest.approx(bench.PROFILE_S)


def test_the_estimate_grows_faster_than_the_context_since_attention_reads_every_earlier_token():
    def prefill_seconds(contexts):
        config = bench.Configuration("e4b-shape", "nf4", "cpu", name="a", path="tuned", contexts=contexts, new_tokens=0)
        return bench.estimate_seconds(config) - bench.estimate_seconds(bench.Configuration("e4b-shape", "nf4", "cpu", new_tokens=0))

    assert prefill_seconds((131072,)) > 16 * prefill_seconds((8192,)) > 0


def test_named_configurations_are_unique_and_compare_with_an_earlier_configuration_of_their_preset():
    for name in ONE_CALL_PRESETS:
        configurations = bench.presets()[name]
        names = [c.name for c in configurations]
        assert all(names) and len(set(names)) == len(names), name
        for index, config in enumerate(configurations):
            if config.reference:
                assert config.reference in names[:index] and config.keep_logits, (name, config.name)
                assert bench.presets()[name][names.index(config.reference)].keep_logits
            assert not config.control or config.reference  # a control is a control of something


def test_the_decode_presets_time_plain_generate_and_the_tuned_decode_over_256_tokens_with_a_control():
    speed = {c.name: c for c in bench.presets()["decode-speed"]}
    assert {"generate", "generate-static", "cudagraphs"} <= set(speed)
    assert all(c.new_tokens >= 256 and c.decode for c in speed.values())
    controls = [c for c in speed.values() if c.control]
    assert controls and all(c.route == "ple-cpu-nudged" for c in controls)
    assert speed["cudagraphs"].reference == "generate-static"


def test_the_long_context_preset_fills_all_131072_positions_with_32_decoded_on_an_8_gb_card_against_the_same_code_uncapped():
    positions = models.load_config("e4b-shape").get_text_config().max_position_embeddings
    configurations = {c.name: c for c in bench.presets()["long-context"]}
    capped = configurations["tuned-128k-8gb"]
    assert (capped.card_gb, capped.new_tokens, capped.path) == (8, 32, "tuned")
    assert long_context.positions_written(capped.greedy_context, capped.new_tokens) == positions == 131072
    uncapped = configurations[capped.reference]
    assert uncapped.card_gb is None and (uncapped.greedy_context, uncapped.path) == (capped.greedy_context, "tuned")
    control = configurations["tuned-128k-8gb-nudged"]  # an identity with nothing beside it that must differ proves nothing
    assert control.control and control.route == "ple-cpu-nudged" and control.reference == capped.reference
    assert (control.card_gb, control.greedy_context, control.new_tokens) == (8, capped.greedy_context, capped.new_tokens)
    assert configurations["plain"].contexts == configurations["tuned"].contexts == records.LONG_CONTEXTS


@pytest.mark.parametrize("preset", ONE_CALL_PRESETS)
def test_dry_run_lists_the_long_context_and_decoding_options(preset):
    done = subprocess.run([sys.executable, "-m", "lab.bench", preset, "--dry-run"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == len(bench.presets()[preset])
    for line, config in zip(lines, bench.presets()[preset]):
        assert line.startswith(f"PYTORCH_ALLOC_CONF={config.allocator} " if config.allocator else "-m lab.measure")
        assert ("--path " + config.path in line) == bool(config.path)
        assert ("--decode " + config.decode in line) == bool(config.decode)
        assert ("--logits-out" in line) == config.keep_logits and ("--profile-trace" in line) == config.profile


def logits_runner(directory, differ=(), crash=()):
    """A fake measure: logits files as measure writes them; ``differ`` changes one entry at step 3."""
    def run(config):
        if config.name in crash:
            return {"crashed": "exit 1: boom"}
        logits = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5)
        if config.name in differ:
            logits[3, 2] += 1e-3
        path = directory / f"{config.name}.pt"
        torch.save(logits, path)
        return {"logits_file": str(path), "self_consistent_steps": 6, "greedy_distinct_tokens": 7,
                "decode_tokens_per_s": 10.0 if config.decode.startswith("generate") else 40.0,
                "bandwidth_limit_tokens_per_s": 900.0, "prefill": []}
    return run


def test_the_tuned_decode_is_compared_with_its_reference_over_the_self_consistent_steps_only(tmp_path):
    records, _ = bench.run_preset("decode-speed", runner=logits_runner(tmp_path, differ={"loop-nudged"}),
                                  directory=tmp_path / "records")
    named = {r["configuration"]["name"]: r for r in records}
    assert named["cudagraphs"]["identity"] == {"reference": "generate-static", "control": False, "compared": True,
                                              "steps": 6, "identical": True, "first_difference": None,
                                              "max_abs_diff": 0.0, "distinct_tokens": 7}
    assert named["loop-nudged"]["identity"]["told_apart"] is True
    assert bench.identity_failures(records) == []
    assert any("4.00x plain generate" in line for line in bench.summary_lines(records))
    lines = (tmp_path / "records" / "e4b-shape.jsonl").read_text().splitlines()
    assert all("logits_file" not in json.loads(line) for line in lines)  # scratch paths are not recorded


def test_a_tuned_decode_that_differs_and_a_control_that_does_not_are_both_reported_as_failures(tmp_path):
    records, _ = bench.run_preset("decode-speed", runner=logits_runner(tmp_path, differ={"cudagraphs"}),
                                  directory=tmp_path / "records")
    failures = bench.identity_failures(records)
    assert any(f.startswith("cudagraphs differs from generate-static at step 3") for f in failures)
    assert any(f.startswith("control loop-nudged gave the same logits") for f in failures)


def test_a_difference_after_the_self_consistent_steps_is_not_a_failure(tmp_path):
    def runner(config):
        record = logits_runner(tmp_path)(config)
        record["self_consistent_steps"] = 3  # the difference at step 3 lies past what either agrees on
        return record

    records, _ = bench.run_preset("decode-speed", runner=logits_runner(tmp_path, differ={"cudagraphs", "loop-nudged"}),
                                  directory=tmp_path / "a")
    assert bench.identity_failures(records) == [next(f for f in bench.identity_failures(records) if "cudagraphs" in f)]
    records, _ = bench.run_preset("decode-speed", runner=runner, directory=tmp_path / "b")
    named = {r["configuration"]["name"]: r for r in records}
    assert named["cudagraphs"]["identity"]["steps"] == 3 and named["cudagraphs"]["identity"]["identical"]


def test_nothing_is_called_identical_when_the_reference_crashed(tmp_path):
    records, _ = bench.run_preset("decode-speed", runner=logits_runner(tmp_path, crash={"generate-static"}),
                                  directory=tmp_path / "records")
    named = {r["configuration"]["name"]: r for r in records}
    assert named["cudagraphs"]["identity"]["compared"] is False and "no logits" in named["cudagraphs"]["identity"]["why_not"]
    assert bench.identity_failures(records) == []


def test_presets_that_time_or_compare_refuse_to_run_side_by_side(tmp_path):
    with pytest.raises(CourseError, match="--jobs 1"):
        bench.run_preset("decode-speed", runner=logits_runner(tmp_path), directory=tmp_path, jobs=2)
    records, _ = bench.run_preset("long-context-cards", runner=logits_runner(tmp_path), directory=tmp_path, jobs=2)
    assert len(records) == len(bench.presets()["long-context-cards"])


def test_named_records_of_one_placement_are_kept_apart_and_an_unrun_preset_reads_as_empty(tmp_path):
    bench.run_preset("long-context", runner=logits_runner(tmp_path), directory=tmp_path)
    kept = records.preset_records("long-context", directory=tmp_path)
    assert set(kept) == {c.name for c in bench.presets()["long-context"]}
    assert records.preset_records("decode-speed", directory=tmp_path) == {}


def test_the_allocator_setting_reaches_the_measuring_process_and_only_that_one(monkeypatch):
    seen = []

    def fake_run(command, **kwargs):
        seen.append((kwargs.get("env") or {}).get("PYTORCH_ALLOC_CONF"))
        raise subprocess.TimeoutExpired(command, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    for config in bench.presets()["long-context-8gb"]:
        bench.run_in_fresh_process(config)
    assert seen == [c.allocator or None for c in bench.presets()["long-context-8gb"]]
    assert "expandable_segments:True" in seen


def test_a_capped_run_that_reserved_more_than_its_card_is_called_out():
    record = {"configuration": {"name": "tuned-8gb", "card_gb": 8},
              "prefill": [{"context": 131072, "peak_bytes": 7e9, "peak_reserved_bytes": 9e9}]}
    assert "NOT enforced" in bench.summary_lines([record])[0]
    record["prefill"][0]["peak_reserved_bytes"] = 7.5e9
    assert "NOT enforced" not in bench.summary_lines([record])[0]


@pytest.mark.parametrize("differ,expected", [
    ({"tuned-128k-8gb-nudged"}, ["logits identical to the same code uncapped over 6", "told apart."]),
    ({"tuned-128k-8gb", "tuned-128k-8gb-nudged"}, ["different from step 3 of the same code uncapped", "told apart."]),
    (set(), ["identical to", "NOT told apart: the comparison proves nothing."]),
], ids=["identical-beside-its-control", "differs", "control-not-told-apart"])
def test_the_long_context_goal_is_described_from_its_records_with_the_verdict_of_its_control(tmp_path, differ, expected):
    assert records.long_context_goal(directory=tmp_path) == []  # not run yet: nothing claimed
    bench.run_preset("long-context", runner=logits_runner(tmp_path, differ=differ), directory=tmp_path)
    text = "\n".join(records.long_context_goal(directory=tmp_path))
    assert f"a {bench.GOAL_PROMPT:,}-token prompt" in text and "131,072 positions written" in text
    assert all(part in text for part in expected), text


def test_the_largest_contexts_mark_a_search_that_stopped_at_the_models_positions_not_at_the_card(tmp_path):
    def run(config):
        reached = 131065 if config.path == "tuned" else 68847 if config.path == "plain" else 16832
        return {"max_context": reached, "max_context_limit": 131065, "prefill": []}

    for preset in ("long-context-8gb", "long-context-cards", "cards"):
        bench.run_preset(preset, runner=run, directory=tmp_path)
    reached = records.largest_contexts(directory=tmp_path)
    assert set(reached) == set(cards.SIMULATED_CARDS_GB)
    assert reached[8]["tuned, chunks of 2,048"] == (131065, True)
    assert reached[8]["plain, chunks of 2,048"] == (68847, False)
    assert reached[8]["generate, one prefill"] == (16832, False)
    assert reached[8]["tuned, chunks of 2,048, expandable_segments:True"] == (131065, True)
    plain = records.reached_lines(card_gb=8, path="plain", directory=tmp_path)
    assert len(plain) == 1 and plain[0].startswith(" 8 GB card reached: plain, chunks of 2,048: 68,847")
    assert "tuned" not in plain[0] and "one prefill" not in plain[0]  # only the path asked for
    every = records.reached_lines(directory=tmp_path)
    assert len(every) == len(cards.SIMULATED_CARDS_GB) and all("(the model's limit)" in line for line in every)


def test_a_prefill_that_ran_out_of_memory_is_recorded_as_such_and_one_that_ran_keeps_no_oom_field():
    from helpers.measure import PrefillPeak

    ran, failed = PrefillPeak(512, 4_060_000_000, 4_100_000_000, 3000.0), PrefillPeak(131072, oom=True, device_free_bytes=1)
    assert ran.record() == {"context": 512, "peak_bytes": 4_060_000_000, "peak_reserved_bytes": 4_100_000_000,
                            "tokens_per_s": 3000.0}
    assert failed.record() == {"context": 131072, "oom": True, "device_free_bytes": 1}
    assert str(ran) == "   512 tokens: peak 4.06 GB (reserved 4.10), 3,000 tokens/s of prefill"
    assert str(failed) == "131,072 tokens: out of memory"


def test_what_notebook_09_and_the_readme_say_about_128k_on_an_8_gb_card_is_what_the_newest_records_say():
    # a drift test: these sentences are taught from the records; a new run that contradicts them must fail here
    recorded = records.preset_records("long-context")
    assert recorded, "no long-context records: make bench PRESET=long-context on a GPU"
    capped = recorded["tuned-128k-8gb"]
    c = capped["configuration"]
    assert long_context.positions_written(c["greedy_context"], c["new_tokens"]) == 131072 and not capped.get("greedy_oom")
    assert capped["identity"]["identical"] and capped["identity"]["steps"] == c["new_tokens"]
    assert capped["greedy_distinct_tokens"] > 1  # what was compared varies
    assert capped["peak_generate_reserved_bytes"] <= c["card_gb"] * 1e9  # the cap held
    assert recorded["plain-128k-8gb"]["prefill"][-1].get("oom")
    plain, tuned = ({p["context"]: p for p in recorded[name]["prefill"]}[131072] for name in ("plain", "tuned"))
    assert plain["peak_reserved_bytes"] > 2 * plain["peak_bytes"]  # "far more than its tensors needed"
    assert tuned["tokens_per_s"] < plain["tokens_per_s"]  # "memory for time"
    assert recorded["tuned-128k-8gb-nudged"]["identity"]["told_apart"]  # the control beside the identity


def test_what_notebook_09_says_about_expandable_segments_on_an_8_gb_card_is_what_the_newest_records_say():
    # "it reached further on the 8 GB card"; "the tuned path ... has nothing to fragment" (it reached the limit)
    reached = records.largest_contexts()[8]
    chunks = f"chunks of {long_context.DEFAULT_CHUNK:,}"
    plain, expandable = reached[f"plain, {chunks}"][0], reached[f"plain, {chunks}, expandable_segments:True"][0]
    assert expandable > plain
    assert reached[f"tuned, {chunks}"][1] and reached[f"tuned, {chunks}, expandable_segments:True"][1]


def rounding_runner(directory, noise: float):
    """A fake measure for decode-speed-inductor: reduce-overhead's logits are the reference's plus ``noise``."""
    def run(config):
        record = logits_runner(directory)(config)
        if config.rounds_differently:
            logits = torch.load(record["logits_file"])
            logits += noise * torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
            torch.save(logits, record["logits_file"])
        return record
    return run


def test_inductors_fused_kernels_are_held_to_rounding_not_identity_and_a_larger_difference_is_a_failure(tmp_path):
    records, _ = bench.run_preset("decode-speed-inductor", runner=rounding_runner(tmp_path, 1e-3), directory=tmp_path / "a")
    fused = next(r for r in records if r["configuration"]["name"] == "reduce-overhead")["identity"]
    assert not fused["identical"] and fused["rounding"]["within_rounding"] and fused["rounding_control_caught"]
    assert fused["rounding"]["tokens_part_at"] is None and fused["rounding"]["compared_steps"] == fused["steps"] == 6
    assert bench.identity_failures(records) == []
    assert any("within rounding: root mean square" in line and "never part" in line for line in bench.summary_lines(records))
    records, _ = bench.run_preset("decode-speed-inductor", runner=rounding_runner(tmp_path, 3.0), directory=tmp_path / "b")
    assert [f for f in bench.identity_failures(records) if f.startswith("reduce-overhead is further from generate-static")]


def test_the_rounding_check_stops_where_the_greedy_tokens_part_and_still_checks_that_step():
    reference = 10 * torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)  # greedy token 3 at every step ...
    reference[2, 2] = 109.5  # ... with a near tie at step 2 (110 beside it)
    parted = reference.clone()
    parted[2, 2] += 1.0  # the tie tipped by a rounding-sized push: the tokens part at step 2 ...
    parted[3:] = torch.flip(reference[3:], dims=[1])  # ... then two different conversations
    result = measure.compare_rounding(reference, parted)
    assert (result["tokens_part_at"], result["compared_steps"], result["max_abs_diff"]) == (2, 3, 1.0)
    assert result["within_rounding"]  # 1.0 < 0.1 x the spread (about 36); the flipped steps are not held against it
    assert result["rms_diff"] == pytest.approx(1.0 / 12 ** 0.5) and result["bound"] == measure.ROUNDING_BOUND
    parted[2] += 20.0  # the step where they part is still one input both shared: a large shift there is a fault
    assert not measure.compare_rounding(reference, parted)["within_rounding"]


def test_a_rounding_verdict_names_the_statistic_it_was_judged_on():
    rounding = {"rms_diff": 0.03, "max_abs_diff": 0.162, "reference_std": 1.0, "compared_steps": 18, "tokens_part_at": 17,
                "within_rounding": True, "bound": 0.1, "statistic": "max"}
    check = {"rounding": rounding, "rounding_control_caught": True}
    assert "largest difference 0.162 against" in records.rounding_sentence(check)  # judged on the largest
    rounding["statistic"] = "rms"
    assert "root mean square difference 0.03 (largest 0.162) against" in records.rounding_sentence(check)


def test_a_speed_up_under_a_card_cap_is_a_ratio_of_plain_generate_under_the_same_cap_and_placement():
    def record(name, decode, rate, ple="cpu", card_gb=None):
        return {"configuration": {"name": name, "model": "e4b-shape", "ple": ple, "card_gb": card_gb, "decode": decode},
                "decode_tokens_per_s": rate}

    run = [record("gpu-generate", "generate", 16.0, ple="gpu"), record("generate", "generate", 13.0),
           record("generate-8gb", "generate", 12.0, card_gb=8), record("cudagraphs-8gb", "cudagraphs", 78.0, card_gb=8),
           record("gpu-cudagraphs", "cudagraphs", 76.0, ple="gpu"), record("lone-cudagraphs-15gb", "cudagraphs", 1.0, card_gb=15)]
    rates = {r["configuration"]["name"]: records.plain_generate_rate(r, run) for r in run}
    assert rates == {"gpu-generate": None, "generate": None, "generate-8gb": None, "cudagraphs-8gb": 12.0,
                     "gpu-cudagraphs": 16.0, "lone-cudagraphs-15gb": None}
    assert any("cudagraphs-8gb; 78.0 tokens/s, 6.50x plain generate" in line for line in bench.summary_lines(run))


@pytest.mark.parametrize("record", [None, {"decode_tokens_per_s": 1.0}, {"configuration": "e4b"}])
def test_a_speed_up_asked_of_something_that_is_not_a_benchmark_record_is_refused_in_one_sentence(record):
    with pytest.raises(InvalidChoiceError, match="is not a benchmark record; pass a dict lab.bench recorded"):
        records.plain_generate_rate(record, [])


def test_a_record_line_a_kill_cut_short_is_skipped_with_a_notice_and_the_next_append_removes_it(tmp_path):
    import warnings

    from helpers import records

    whole = {"preset": "quick", "configuration": {"model": "tiny", "quant": "nf4", "ple": "cpu", "card_gb": None},
             "recorded_at": "2026-12-01T00:00:00"}
    bench.append_record(whole, tmp_path)
    target = tmp_path / "tiny.jsonl"
    target.write_text(target.read_text() + '{"preset": "quick", "configur')  # the kill, mid-append
    with pytest.warns(records.CutRecordNotice, match="cut short"):
        assert list(records.every_record(tmp_path)) == [{**whole, "schema": records.SCHEMA}]  # append_record stamps the schema
    bench.append_record({**whole, "recorded_at": "2026-12-02T00:00:00"}, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repaired: no notice any more
        assert [r["recorded_at"] for r in records.every_record(tmp_path)] == ["2026-12-01T00:00:00", "2026-12-02T00:00:00"]
    target.write_text('{"broken\n' + target.read_text())  # the control: a bad line that is not the last is refused
    with pytest.raises(CourseError, match="line 1 is not a JSON record"):
        list(records.every_record(tmp_path))


def test_a_record_file_cut_short_is_refused_in_one_sentence_that_names_the_fix(tmp_path):
    from helpers import records

    cut = tmp_path / "e4b-shape-nf4.json"
    cut.write_text('{"ple-gpu": {"resident_bytes": 95')
    with pytest.raises(CourseError, match="not whole JSON.*git checkout -- e4b-shape-nf4.json"):
        records.gpu_tier("e4b-shape", "nf4", directory=tmp_path)


def test_the_small_cards_search_runs_what_the_planner_would_load_there_and_text_only_loads_the_planners_text_only(
        monkeypatch):
    """Below 8 GB the planner runs E4B text only on 4 GB: the measured route must load exactly that choice (the PLE,
    towers and token table on the CPU, its head), not the course's plain ple="cpu", or the figure is of another model."""
    from helpers import planner
    from lab import measure as lab_measure

    small = {config.name: config for config in bench.presets()["long-context-small-cards"]}
    assert all(config.card_gb < 8 and config.search_max_context and config.path == "tuned" for config in small.values())
    assert small["tuned-4gb-text-only"].route == "text-only" and small["tuned-4gb"].model == "e2b-shape"
    asked = {}
    monkeypatch.setattr(lab_measure.loading, "load_model", lambda source, **kwargs: asked.update(kwargs))
    lab_measure._load("text-only", "tiny", "nf4", 0)
    quant, ple, towers, head = planner.TEXT_ONLY
    assert (asked["ple"], asked["towers"], asked["head"]) == (ple, towers, head) and asked["quant"] == "nf4"
    asked.clear()
    lab_measure._load("ple-cpu", "tiny", "nf4", 0)  # the control: the course's route keeps towers and head
    assert "towers" not in asked and asked["ple"] == "cpu"


def test_a_profile_that_included_the_prefill_is_not_reported_as_the_decode_loop_alone():
    loop_only = {"profile": {"steps": 64, "by_step": {"forwards": 63, "launches": 58}}}
    whole_run = {"profile": {"steps": 16, "by_step": {"launches": 306}}}  # recorded before decode ranges existed
    assert "decode loop alone (63 forwards)" in records.profile_covers(loop_only)
    assert records.profile_covers(whole_run) == "16 steps and the prefill before them"
