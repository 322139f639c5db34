"""Contracts over the repository itself: figures are rendered, not typed; the project never reads ../shared."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tool as _tool

ROOT = Path(__file__).resolve().parents[1]


def test_readme_results_table_is_rendered_from_the_recorded_measurements():
    done = subprocess.run([sys.executable, "tools/render_results.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_no_code_reads_the_shared_folder_outside_the_repository():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("helpers", "tests", "tools", "notebooks")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".ipynb", ".sh"} and path.name != Path(__file__).name
        and "../shared" in path.read_text(errors="ignore")
    ]
    assert offenders == []


def test_the_gpu_workflow_runs_make_test_gpu_on_a_self_hosted_gpu_runner():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    job = workflow["jobs"]["gpu"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    assert any("make test-gpu" in step.get("run", "") for step in job["steps"])




def test_a_notebook_run_again_on_another_gpu_does_not_relabel_the_machine_of_the_notebooks_it_left(tmp_path, monkeypatch):
    tool = _tool("run_course")
    monkeypatch.setattr(tool, "COURSE_RUNS_DIR", tmp_path)
    run = {"model": "e4b-shape", "card_gb": 8.0}
    tool.record([("00_setup.ipynb", "ok", 3.0, ""), ("09_x.ipynb", "ok", 9.0, "")], {**run, "id": "a", "device": "GPU one"}, "c1")
    path = tool.record([("09_x.ipynb", "ok", 8.0, "")], {**run, "id": "b", "device": "GPU two"}, "c2")
    notebooks = json.loads(path.read_text())["notebooks"]
    assert {name: (e["run"], e["device"]) for name, e in notebooks.items()} == {
        "00_setup.ipynb": ("a", "GPU one"), "09_x.ipynb": ("b", "GPU two")}


def test_a_course_run_record_in_the_old_one_machine_format_is_refused_not_silently_mixed(tmp_path, monkeypatch):
    tool = _tool("run_course")
    monkeypatch.setattr(tool, "COURSE_RUNS_DIR", tmp_path)
    (tmp_path / "tiny-cpu.json").write_text(json.dumps({"device": "CPU", "model": "tiny", "notebooks": {}}))
    with pytest.raises(SystemExit, match="older format"):
        tool.record([("00_setup.ipynb", "ok", 1.0, "")], {"model": "tiny", "card_gb": None, "id": "c", "device": "CPU"}, "c")


def test_every_committed_course_run_record_names_the_machine_of_each_notebook():
    for path in (ROOT / "data" / "course-runs").glob("*.json"):
        record = json.loads(path.read_text())
        assert record["schema"] == _tool("run_course").COURSE_RUN_SCHEMA, path.name
        assert all(entry["device"] and entry["platform"] for entry in record["notebooks"].values()), path.name


def test_a_notebook_with_one_failing_cell_is_recorded_as_failed_with_the_run_date(tmp_path):
    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite timestamp="2026-11-29T19:25:03+00:00">'
        '<testcase classname="notebooks.01_download.ipynb" name="Cell 0" />'
        '<testcase classname="notebooks.06_memory_profiling.ipynb" name="Cell 0" time="2.5" />'
        '<testcase classname="notebooks.06_memory_profiling.ipynb" name="Cell 1" time="1.0"><failure message="boom" /></testcase>'
        '</testsuite></testsuites>')
    tool = _tool("record_nbval")
    summary = tool.summarise(junit)
    assert summary["01_download.ipynb"]["result"] == "pass"
    assert summary["06_memory_profiling.ipynb"] == {"passed": 1, "failed": 1, "skipped": 0, "seconds": 3.5, "result": "fail"}
    assert tool.run_date(junit) == "2026-11-29"


def test_a_junit_file_brought_back_takes_its_environment_from_a_benchmark_record_of_that_session(tmp_path):
    records = tmp_path / "e4b-shape.jsonl"
    records.write_text('{"gpu": "NVIDIA H200", "gpu_total_bytes": 1, "versions": {"torch": "2.11"}, "other": 0}\n')
    assert _tool("record_nbval").environment_from(records) == {"gpu": "NVIDIA H200", "gpu_total_bytes": 1, "versions": {"torch": "2.11"}}


def test_a_gpu_run_over_ten_minutes_is_recorded_as_over_the_budget():
    tool = _tool("record_gpu_run")
    environment = {"gpu": "NVIDIA H200", "versions": {}, "date": "2026-11-29"}
    assert tool.summary(512, 0, 0, environment)["within_limit"] is True
    slow = tool.summary(640, 0, 1, environment)
    assert slow["within_limit"] is False and slow["notebooks"] == "fail" and slow["gpu_tier"] == "pass"


def test_each_card_run_keeps_its_own_column_and_a_rerun_replaces_only_its_own(tmp_path, monkeypatch):
    tool = _tool("record_nbval")
    junit = tmp_path / "run.xml"
    monkeypatch.setattr(tool, "GPU_TIER_DIR", tmp_path)
    monkeypatch.setattr(tool, "environment_from", lambda path: {"gpu": "G", "gpu_total_bytes": 1, "versions": {}})
    for card, seconds in (("8", 3), ("15", 4), ("", 5), ("8", 6)):
        junit.write_text('<testsuites><testsuite timestamp="2026-11-30T10:00:00+00:00"><testcase '
                         f'classname="notebooks.05_ple_offload.ipynb" name="Cell 0" time="{seconds}" /></testsuite></testsuites>')
        monkeypatch.setenv("CARD_GB", card)
        assert tool.main([str(junit), "--environment-from", str(junit)]) == 0
    recorded = json.loads((tmp_path / "notebooks-e4b-shape.json").read_text())
    assert {label: card["05_ple_offload.ipynb"]["seconds"] for label, card in recorded["cards"].items()} == {
        "8 GB": 6.0, "15 GB": 4.0, "uncapped": 5.0}
    assert not list(tmp_path.glob("*.lock"))


def test_a_comparison_with_no_hashes_is_shown_as_not_compared_never_as_identical():
    tool = _tool("render_results")
    assert tool.placement_verdict({}, {}) == "not compared"
    assert tool.placement_verdict({"logits_sha256": "a", "greedy_token_count": 32, "greedy_distinct_tokens": 20},
                                  {"logits_sha256": "b"}).startswith("logits DIFFER")
    assert tool.identity_verdict({}) == "not compared"


def test_the_instructor_guide_is_rendered_from_the_records_and_its_figures_exist():
    done = subprocess.run([sys.executable, "tools/render_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    guide = (ROOT / "docs" / "instructor-guide.md").read_text()
    assert "python -m helpers.environment" in guide and "--classroom" in guide and "When GPUs are short" in guide
    for figure in ("peak-vs-context.png", "what-fits-on-which-card.png"):
        assert (ROOT / "docs" / "figures" / figure).stat().st_size > 10_000
        assert f"figures/{figure}" in (ROOT / "README.md").read_text() + (ROOT / "docs" / "results.md").read_text()


def test_a_number_typed_into_the_instructor_guide_is_caught(tmp_path, monkeypatch):
    """The control: the check above fails on a guide edited by hand."""
    tool = _tool("render_docs")
    edited = tmp_path / "guide.md"
    edited.write_text(tool.render().replace(" min", " minutes", 1))
    monkeypatch.setattr(tool, "GUIDE", edited)
    assert tool.main(["--check"]) == 1


def test_a_failed_notebook_cell_on_a_card_is_named_under_the_table_with_its_exception(tmp_path, monkeypatch):
    tool = _tool("render_results")
    monkeypatch.setattr(tool, "GPU_TIER_DIR", tmp_path)
    failure = ("Cell 11: Cell execution caused an exception\n#x1B[31mInsufficientGPUMemoryError#x1B[39m: 2.5 GB is free\n")
    assertion = "----> 7     assert same['identical']\n\nAssertionError: \n"
    (tmp_path / "notebooks-m-8-1.nbval.xml").write_text(
        '<testsuites><testsuite><testcase classname="notebooks.02_quantization.ipynb" name="Cell 11">'
        f'<failure>{failure}</failure></testcase><testcase classname="notebooks.02_quantization.ipynb" name="Cell 12"/>'
        f'<testcase classname="notebooks.05_ple_offload.ipynb" name="Cell 6"><failure>{assertion}</failure></testcase>'
        '</testsuite></testsuites>')
    assert tool.failed_cells("m", "8 GB") == [("02_quantization.ipynb", "cell 11", "InsufficientGPUMemoryError: 2.5 GB is free"),
                                              ("05_ple_offload.ipynb", "cell 6", "assert same['identical']")]
    assert tool.failed_cells("m", "15 GB") == []


def test_a_failure_from_an_old_junit_file_is_not_named_under_a_notebook_that_now_passes(tmp_path, monkeypatch):
    tool = _tool("render_results")
    monkeypatch.setattr(tool, "GPU_TIER_DIR", tmp_path)
    (tmp_path / "notebooks-m-4-diag.nbval.xml").write_text(
        '<testsuites><testsuite><testcase classname="notebooks.08_llama_cpp.ipynb" name="Cell 4">'
        '<failure>NameError: name converted is not defined</failure></testcase></testsuite></testsuites>')
    entry = {"passed": 19, "failed": 0, "seconds": 1.0, "gpu": "G", "date": "d", "command": "c",
             "versions": {"transformers": "t", "bitsandbytes": "b"}, "code_sha": None}
    passing = {"model": "m", "cards": {"4 GB": {"08_llama_cpp.ipynb": {**entry, "result": "pass"}}}}
    failing = {"model": "m", "cards": {"4 GB": {"08_llama_cpp.ipynb": {**entry, "failed": 1, "result": "fail"}}}}
    assert "Cells that failed" not in tool.render_notebooks(passing)
    assert "cell 4: `NameError: name converted is not defined`" in tool.render_notebooks(failing)  # the control


def test_a_record_that_cannot_be_written_whole_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch):
    from helpers import paths
    from lab import records

    target = tmp_path / "gpu-tier" / "e4b-shape-nf4.json"
    records.write_record(target, {"ple-cpu": {"resident_bytes": 1}})
    assert json.loads(target.read_text()) == {"ple-cpu": {"resident_bytes": 1}}

    def killed(*args):
        raise KeyboardInterrupt  # stopped after the new text was written, before it took the record's place

    monkeypatch.setattr(paths.os, "replace", killed)  # the rename write_record makes
    with pytest.raises(KeyboardInterrupt):
        records.write_record(target, {"ple-cpu": {"resident_bytes": 2}})
    assert json.loads(target.read_text()) == {"ple-cpu": {"resident_bytes": 1}}
    assert [p.name for p in target.parent.iterdir()] == ["e4b-shape-nf4.json"]


def test_split_host_refuses_what_is_not_a_route_record_in_one_sentence():
    from helpers.errors import InvalidChoiceError
    from lab.records import split_host

    with pytest.raises(InvalidChoiceError, match="is not a route record"):
        split_host(None)


def test_the_determinism_verdict_claims_whole_runs_agree_only_when_every_recorded_run_did():
    tool = _tool("render_results")
    agreeing = {"command": "probe", "gpu": "G", "date": "d", "model": "m", "new_tokens": 256, "settings": "s",
                "gpu_run_to_run": [{"first_differing_step": None}] * 2, "cpu_vs_gpu_placement": {"first_differing_step": None},
                "cudnn_attention_run_to_run": {"first_differing_step": 241, "max_abs_diff_there": 0.0742},
                "cpu_after_a_long_prefill_vs_before": {"first_differing_step": None},
                "cpu_after_a_long_prefill_run_to_run": {"first_differing_step": None}}  # every key the probe writes
    text = tool.render_determinism(agreeing)
    assert "over all 256 steps" in text and "step 241 (max |diff| 0.0742 there)" in text
    drifting = {**agreeing, "gpu_run_to_run": [{"first_differing_step": None}, {"first_differing_step": 225}]}
    text = tool.render_determinism(drifting)
    assert "over all 256 steps" not in text and "where each agrees with itself" in text


@pytest.mark.parametrize("within", [True, False])
def test_inductors_speed_is_shown_without_a_correctness_claim_only_when_it_left_the_rounding_bound(within, monkeypatch):
    from helpers import records

    tool = _tool("render_results")
    rounding = {"within_rounding": within, "tokens_part_at": 17, "max_abs_diff": 0.16, "reference_std": 1.0,
                "compared_steps": 18, "statistic": "max", "bound": 0.1}
    run = {"generate-static": {"decode_tokens_per_s": 10.0, "command": "bench"},
           "reduce-overhead": {"decode_tokens_per_s": 90.0, "identity": {
               "compared": True, "first_difference": 1, "identical": False, "steps": 256, "rounding": rounding,
               "rounding_control_caught": True}}}
    monkeypatch.setattr(records, "preset_records", lambda preset, *a, **k: run if preset == "decode-speed-inductor" else {})
    text = "\n".join(tool.render_inductor())
    assert "| reduce-overhead | 90.0 | 9.00 | differ from step 1; " + ("within" if within else "further than") in text
    assert ("without a correctness claim" in text) is not within
    assert ("still parted at step 17" in text) is within
    assert text.count("|") % 5 == 0  # no stray pipe inside a cell


def test_a_decode_speed_that_moved_between_runs_shows_its_range_beside_the_newest_and_the_cap_alone_is_a_same_run_ratio(
        tmp_path, monkeypatch):
    from helpers import records

    def line(name, rate, at, card_gb=None, preset="decode-speed-more"):
        return json.dumps({"preset": preset, "recorded_at": at, "decode_tokens_per_s": rate, "command": "bench",
                           "configuration": {"name": name, "model": "e4b-shape", "quant": "nf4", "ple": "cpu",
                                             "card_gb": card_gb, "decode": "generate"}})

    (tmp_path / "e4b-shape.jsonl").write_text("\n".join([
        line("e4b-cpu-generate-8gb", 13.93, "2026-12-02", 8), line("e4b-cpu-generate-8gb", 8.44, "2026-12-01", 8),
        line("e4b-cpu-generate", 13.06, "2026-12-02"), line("e4b-cpu-generate", 99.0, "2026-12-03", preset="speed")]) + "\n")
    assert records.decode_rates_over_runs("decode-speed-more", directory=tmp_path) == {
        "e4b-cpu-generate-8gb": [8.44, 13.93], "e4b-cpu-generate": [13.06]}
    real = (records.preset_records, records.decode_rates_over_runs)
    monkeypatch.setattr(records, "preset_records", lambda preset, model="e4b-shape", directory=None: real[0](
        preset, model, directory=tmp_path))
    monkeypatch.setattr(records, "decode_rates_over_runs", lambda preset, model="e4b-shape", directory=None: real[1](
        preset, model, directory=tmp_path))
    text = "\n".join(_tool("render_results").render_decode_elsewhere())
    assert "| e4b-cpu-generate-8gb | e4b-shape | CPU | 8 GB | 13.93 | - | 8.44-13.93 (2 runs) |" in text
    assert "| e4b-cpu-generate | e4b-shape | CPU | uncapped | 13.06 | - | one run |" in text
    assert "ran 13.93 tokens/s under the 8 GB cap and 13.06 uncapped in the same run (capped / uncapped 1.07)" in text


def test_the_static_cache_trim_probe_equals_plain_chunked_prefill_and_tells_a_cache_one_position_short_apart(tiny_path):
    results = _tool("static_cache_trim_probe").main("tiny", 4096, 8)  # two chunks of 2,048: the cut is taken
    assert results["tuned-trimmed vs plain"]["identical"] and results["tuned-trimmed vs tuned-trimmed-again"]["identical"]
    assert not results["control-one-short vs tuned-trimmed"]["identical"]
    assert results["tuned-trimmed"]["distinct_tokens"] > 1  # what is compared varies


@pytest.mark.parametrize("control_told_apart", [True, False])
def test_the_trim_probes_paragraph_says_what_each_comparison_found_and_never_calls_an_uncaught_control_caught(
        control_told_apart):
    def check(identical, diff=0.0):
        return {"identical": identical, "max_abs_diff": diff}

    run = {"seconds": 10.0, "peak_gb": 7.5, "reserved_gb": 20.0, "distinct_tokens": 8}
    record = {"prompt_tokens": 131065, "new_tokens": 8, "device": "GPU", "plain": run, "tuned": {**run, "seconds": 15.0,
              "peak_gb": 7.0, "reserved_gb": 8.0}, "tuned-trimmed": run, "tuned-trimmed-again": run, "control-one-short": run,
              "tuned-trimmed vs plain": check(True), "tuned vs plain": check(False, 0.1),
              "tuned-trimmed vs tuned-trimmed-again": check(True), "tuned-trimmed vs tuned": check(False, 0.1),
              "control-one-short vs tuned-trimmed": check(not control_told_apart, 0.2 if control_told_apart else 0.0)}
    text = _tool("render_results").render_trim_probe("e4b-shape", record)
    assert "`python tools/static_cache_trim_probe.py e4b-shape 131072 8`" in text
    assert "cut against plain `generate`, identical; the tuned path as it is against plain, differ (max |diff| 0.1)" in text
    assert ("cut one position short, differ (max |diff| 0.2)" in text) is control_told_apart
    assert "1.50x as fast" in text and "0.50 GB more peak allocated" in text


def test_a_rendered_page_cut_short_fails_the_check_and_a_render_cut_short_leaves_the_old_page(tmp_path, monkeypatch):
    """--check compares each whole file, so half a README (a full disk, a kill) cannot pass; the renderer writes aside
    and renames, so a write that fails leaves the page as it was."""
    import errno

    tool = _tool("render_results")
    readme, results = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text((ROOT / "README.md").read_text())
    results.write_text((ROOT / "docs" / "results.md").read_text())
    monkeypatch.setattr(tool, "README", readme)
    monkeypatch.setattr(tool, "RESULTS", results)
    assert tool.main(["--check"]) == 0
    whole = readme.read_text()
    readme.write_text(whole[: len(whole) // 2])  # the control: half a README
    with pytest.raises(SystemExit, match="headline"):
        tool.main(["--check"])
    readme.write_text(whole.replace("## More", "## Mor", 1))  # prose outside the blocks is compared too
    assert tool.main(["--check"]) == 0  # hand-written prose is the author's: only the blocks are rendered
    readme.write_text(whole.replace("| yes |", "| no |", 1))  # a typed figure inside a block is caught
    assert tool.main(["--check"]) == 1

    def full_disk(self, text, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space"):
        tool.main([])
    monkeypatch.undo()
    assert readme.read_text() == whole.replace("| yes |", "| no |", 1) and not list(tmp_path.glob(".*partial"))


@pytest.mark.parametrize("name", ["decode-speed", "decode-speed-inductor", "decode-speed-elsewhere", "host-memory"])
def test_a_notebook_reads_the_very_table_docs_results_shows(name):
    from helpers import records
    from helpers.paths import REPO_ROOT

    table = records.table(name)
    assert table.rows and table.markdown() in (REPO_ROOT / "docs" / "results.md").read_text()


def test_every_decode_run_the_results_page_renders_has_a_table_so_recording_it_cannot_break_the_page():
    import re

    from helpers import records

    rendered = re.findall(r'render_step_run\(\s*"([\w-]+)"', (ROOT / "tools" / "render_results.py").read_text())
    assert {"decode-goal", "decode-goal-cards", "decode-host-free-inductor"} <= set(rendered)
    assert [name for name in rendered if name not in records.TABLES] == []


def test_the_kernel_share_of_the_untraced_step_sets_the_profiles_kernel_time_against_the_untimed_rate():
    from helpers import records

    profiled = {"decode_tokens_per_s": 200.0, "profile": {"device_busy_s": 0.06, "by_step": {"forwards": 15, "wall_ms": 6.0}}}
    share = records.kernel_time_share(profiled)
    assert share["kernel_ms"] == pytest.approx(4.0) and share["untraced_ms"] == pytest.approx(5.0)
    assert share["share"] == pytest.approx(0.8) and share["traced_ms"] == 6.0
    host_bound = {**profiled, "decode_tokens_per_s": 50.0}  # the same kernels in a slower step: a smaller share
    assert records.kernel_time_share(host_bound)["share"] == pytest.approx(0.2)
    assert records.kernel_time_share({"decode_tokens_per_s": 200.0, "profile": {"device_busy_s": 0.06, "by_step": {}}}) is None


def test_a_recorded_table_follows_the_records_it_is_built_from(tmp_path):
    # the control for the check above: one changed rate changes the table
    from helpers import records
    from helpers.paths import MEASUREMENTS_DIR

    lines = (MEASUREMENTS_DIR / "e4b-shape.jsonl").read_text().splitlines()
    changed = [json.loads(line) for line in lines]
    latest = max(i for i, r in enumerate(changed) if r.get("preset") == "decode-speed")
    changed[latest]["decode_tokens_per_s"] = 0.5
    (tmp_path / "e4b-shape.jsonl").write_text("\n".join(json.dumps(r) for r in changed) + "\n")
    assert str(records.table("decode-speed", tmp_path)) != str(records.table("decode-speed"))


def test_an_unknown_table_name_is_refused_in_one_sentence_that_lists_the_tables():
    from helpers import records
    from helpers.errors import InvalidChoiceError

    with pytest.raises(InvalidChoiceError, match="decode-speed-inductor"):
        records.table("decode speed")


def test_every_committed_benchmark_record_is_in_the_current_schema_so_readers_need_no_old_format_branch():
    done = subprocess.run([sys.executable, "tools/upgrade_records.py", "--check"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stdout


def test_a_record_older_than_the_schema_is_upgraded_with_the_rule_it_was_judged_by():
    # the control for the check above: an old record is seen and brought to the schema
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import upgrade_records

    from helpers import records

    old = {"identity": {"rounding": {"max_abs_diff": 0.2, "within_rounding": False}}}
    new = upgrade_records.upgraded(old)
    assert new != old and new["schema"] == records.SCHEMA
    assert new["identity"]["rounding"]["statistic"] == "max" and new["identity"]["rounding"]["bound"] == 0.1
    assert upgrade_records.upgraded(new) == new


def test_the_recorded_placements_agree_at_least_as_far_as_the_gpu_agrees_with_itself():
    # notebook 05 shows the determinism probe's table; the claim it rests on is held here
    from helpers import records

    probe = records.gpu_tier_file("determinism-e4b-shape.json")
    itself = [r["first_differing_step"] for r in probe["gpu_run_to_run"]]
    placements = probe["cpu_vs_gpu_placement"]["first_differing_step"]
    agrees_until = min((step for step in itself if step is not None), default=None)  # None: at every step
    assert placements is None or (agrees_until is not None and placements >= agrees_until - 1)


def test_the_recorded_ple_lookup_decodes_over_five_times_faster_than_a_cpu_entry_with_its_hook():
    # notebook 05 shows the speed table; the claim its text makes is held here
    from helpers import records

    speed = records.decode_speeds("e4b-shape")
    assert speed["cpu-entry"] < speed["ple-cpu"] / 5, speed


def test_notebook_05s_tables_show_the_recorded_control_differing_and_the_offload_identical():
    from helpers import records

    rows = {row[0]: row for row in records.table("ple-offload").rows}
    assert rows["ple-cpu"][3].startswith("identical") and rows["ple-cpu-nudged"][3].startswith("differ")
    assert {"ple-gpu", "ple-cpu", "cpu-entry"} <= {row[0] for row in records.table("decode-by-route").rows}


def _ple_table_bytes():
    from helpers import synthetic, weights

    e4b = weights.meta_model(synthetic.gemma4_config("e4b-shape"))
    return e4b.get_submodule("model.language_model.embed_tokens_per_layer").weight.numel() * 2


def test_the_recorded_cpu_entry_route_copies_the_ple_table_to_the_gpu_during_a_prefill():
    # notebook 03 prints these figures; the claim its text makes is held here
    from helpers import records

    naive, course = records.gpu_route("cpu-entry"), records.gpu_route("ple-cpu")
    ple_bytes = _ple_table_bytes()
    assert naive.prefill_peak_bytes > naive.resident_bytes + 0.9 * ple_bytes
    assert course.prefill_peak_bytes < course.resident_bytes + 0.5 * ple_bytes  # the control: the course's route does not


def test_the_recorded_post_load_offload_keeps_the_table_reserved_and_peaks_above_the_courses_load():
    from helpers import records

    post, course = records.gpu_route("post-load"), records.gpu_route("ple-cpu")
    ple_bytes = _ple_table_bytes()
    assert post.peak_load_bytes > course.peak_load_bytes + 0.9 * ple_bytes
    assert post.reserved_bytes > post.resident_bytes + 0.9 * ple_bytes
    assert course.reserved_bytes < course.resident_bytes + 0.5 * ple_bytes  # the control: loaded in place, nothing left


def test_a_route_reader_gives_the_records_figures_and_refuses_an_unrecorded_route_in_one_sentence():
    from helpers import records
    from helpers.errors import InvalidChoiceError

    whole = records.gpu_tier("e4b-shape", "nf4")
    refused = records.gpu_route("no-flag")
    assert refused.load_error == whole["no-flag"]["load_error"] and refused.resident_bytes is None
    fp16 = records.gpu_route("ple-cpu-fp16")
    assert (fp16.greedy_tokens, fp16.logits_finite) == (whole["ple-cpu-fp16"]["greedy_token_count"], True)
    with pytest.raises(InvalidChoiceError, match="route='ple-tpu' was not recorded.*choose one of"):
        records.gpu_route("ple-tpu")
    with pytest.raises(InvalidChoiceError, match="no recorded decode speed"):
        records.decode_speed("ple-tpu")
    assert records.decode_speed("ple-cpu") == records.decode_speeds("e4b-shape")["ple-cpu"]


def test_the_plain_string_reader_names_each_probed_release_and_none_for_an_unprobed_one():
    from helpers import records

    entries = records.plain_string_outcomes()
    first = entries[0]
    assert records.plain_string_outcome(first["transformers"], first["processor"]) == first["tokenize=True"]
    assert records.plain_string_outcome("0.0.1", first["processor"]) is None
    outcomes = {records.plain_string_outcome(e["transformers"], e["processor"]) for e in entries}
    assert len(outcomes) > 1  # the releases differ, so a reader that ignored the version would be caught
    assert len(records.table("plain-string-outcomes").rows) == len(entries)


def test_a_card_sweep_entry_from_a_notebook_edited_since_the_run_is_shown_as_stale(tmp_path, monkeypatch):
    """The sweep's table mixes runs of several days: an entry that ran other code must say so, never pass as current."""
    tool = _tool("render_results")
    notebook = {"cells": [{"cell_type": "code", "source": ["x = 1\n", "x"]}, {"cell_type": "markdown", "source": "#"}]}
    (tmp_path / "00_a.ipynb").write_text(json.dumps(notebook))
    monkeypatch.setattr(tool.record_nbval.code_hash, "__defaults__", (tmp_path,))
    ran = tool.record_nbval.code_hash("00_a.ipynb")
    entry = {"result": "pass", "passed": 2, "failed": 0, "gpu": "G", "date": "d", "command": "c",
             "versions": {"transformers": "t", "bitsandbytes": "b"}}
    record = {"model": "m", "cards": {"8 GB": {"00_a.ipynb": {**entry, "code_sha": ran}}}}
    assert "| pass 2/2 |" in tool.render_notebooks(record) and "stale" not in tool.render_notebooks(record)
    notebook["cells"][0]["source"] = ["x = 2\n", "x"]  # the control: one character of code changed since the run
    (tmp_path / "00_a.ipynb").write_text(json.dumps(notebook))
    assert "| pass 2/2, stale |" in tool.render_notebooks(record)
    del record["cards"]["8 GB"]["00_a.ipynb"]["code_sha"]  # a run older than the stamp
    assert "*stale* (1 of 1)" in tool.render_notebooks(record)


def test_a_record_with_no_place_on_the_results_page_is_refused_and_the_prose_between_blocks_is_kept(tmp_path, monkeypatch):
    """docs/results.md is hand-written prose around rendered blocks: a new record must be given a place (one sentence
    says where), a block no record fills must go, and editing the prose outside the blocks is the author's right."""
    tool = _tool("render_results")
    results = tmp_path / "results.md"
    page = (ROOT / "docs" / "results.md").read_text()
    blocks = tool.render_blocks()
    assert tool.rendered_results(page, blocks) == page
    edited = page.replace("## The records", "## The records we keep", 1)
    assert tool.rendered_results(edited, blocks) == edited  # the prose is kept as written
    start, end = tool.block_markers("release-probe-8gb")
    without = page[:page.index(start)] + page[page.index(end) + len(end):]
    with pytest.raises(SystemExit, match="no place for release-probe-8gb: add <!-- results:release-probe-8gb"):
        tool.rendered_results(without, blocks)
    with pytest.raises(SystemExit, match="no record renders \\(release-probe-8gb\\)"):
        tool.rendered_results(page, {name: body for name, body in blocks.items() if name != "release-probe-8gb"})
    typed = page.replace("| pass 8/8, 26 s |", "| pass 8/8, 2 s |", 1)  # the control: a figure typed inside a block
    assert typed != page and tool.rendered_results(typed, blocks) == page
    results.write_text(typed)
    monkeypatch.setattr(tool, "RESULTS", results)
    assert tool.main(["--check"]) == 1


def test_every_mutation_still_finds_its_text_and_its_tests_so_an_edit_cannot_break_the_mutation_step_late():
    mutations = _tool("mutations")
    for mutation in mutations.MUTATIONS:
        mutations.check_applies(mutation)  # raises SystemExit naming the mutation whose text or test moved
    gone = mutations.Mutation(name="control", path="helpers/synthetic.py", old="text that is in no file", new="", tests=())
    with pytest.raises(SystemExit, match="occurs 0 times"):
        mutations.check_applies(gone)
    # a renamed test would select nothing, and pytest's exit code for that is not 0: it must not pass for a kill
    present = mutations.MUTATIONS[0]
    renamed = dataclasses.replace(present, tests=(present.tests[0] + "_renamed",))
    with pytest.raises(SystemExit, match="is not there"):
        mutations.check_applies(renamed)
    mutations.check_applies(dataclasses.replace(present, tests=(present.tests[0] + "[one-parameter]",)))  # still there


def test_the_fused_step_is_shown_beside_the_cuda_graph_step_of_its_own_run(tmp_path, monkeypatch):
    """A decode-fused run renders its ratio to that run's CUDA-graph step and both steps' kernels per step; an
    unrecorded run says how to record it instead of printing an empty table."""
    import functools

    from helpers import records

    tool = _tool("render_results")

    def record(name, rate, kernels):
        return {"configuration": {"model": "e4b-shape", "name": name, "ple": "cpu", "quant": "nf4", "card_gb": None},
                "preset": "decode-fused",
                "command": "python -m lab.bench decode-fused", "recorded_at": "2026-12-06T00:00:00",
                "decode_tokens_per_s": rate, "profile": {"by_step": {"kernels": kernels}, "device_busy_fraction": 0.9}}

    (tmp_path / "e4b-shape.jsonl").write_text("\n".join(json.dumps(r) for r in (
        record("cudagraphs", 80.0, 4096), record("host-free-fused-all", 200.0, 1494))) + "\n")
    monkeypatch.setattr(records, "preset_records", functools.partial(records.preset_records, directory=tmp_path))
    monkeypatch.setattr(records, "table", functools.partial(records.table, directory=tmp_path))
    text = "\n".join(tool.render_fused_step())
    assert "It ran 2.50x the CUDA-graph step of the same run." in text
    assert "| host-free-fused-all | 200.0 | 2.50 |" in text and "1,494" in text and "4,096" in text

    (tmp_path / "e4b-shape.jsonl").write_text(json.dumps(record("cudagraphs", 80.0, 4096)).replace("decode-fused", "speed") + "\n")
    assert "not yet measured (`make bench PRESET=decode-fused`)" in "\n".join(tool.render_fused_step())


def test_the_headline_shows_the_exact_step_fastest_against_its_own_runs_cuda_graph_step_not_the_newest(tmp_path,
                                                                                                      monkeypatch):
    """A newer preset whose step is slower (or not identical) must not replace a faster exact step in the README."""
    import functools

    from helpers import records

    tool = _tool("render_results")

    def record(preset, name, rate, identical=True):
        return {"configuration": {"model": "e4b-shape", "name": name, "ple": "cpu", "quant": "nf4", "card_gb": None},
                "preset": preset, "command": f"python -m lab.bench {preset}", "recorded_at": "2026-12-06T00:00:00",
                "decode_tokens_per_s": rate, "bandwidth_limit_tokens_per_s": 1000.0, "gpu": "G",
                "identity": {"identical": identical, "steps": 256}}

    def headline(gemv_rate, identical=True):
        rows = (record("decode-fused", "cudagraphs", 80.0), record("decode-fused", "host-free-fused-all", 160.0),
                record("decode-gemv", "cudagraphs", 70.0), record("decode-gemv", "host-free-fused-gemv", gemv_rate, identical))
        (tmp_path / "e4b-shape.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return "\n".join(tool.fused_step_headline())

    monkeypatch.setattr(records, "preset_records", functools.partial(records.preset_records, directory=tmp_path))
    assert "160.0 tokens/s" in headline(70.0) and "2.00x" in headline(70.0)  # the newer, slower step is not shown
    assert "175.0 tokens/s" in headline(175.0) and "2.50x" in headline(175.0)  # the control: faster, so it is
    assert "160.0 tokens/s" in headline(175.0, identical=False)  # faster but not identical: not the exact headline


def test_the_headline_lets_a_run_that_measured_both_steps_side_by_side_decide_over_ratios_from_two_runs(
        tmp_path, monkeypatch):
    """An older run's slightly higher ratio to its own CUDA-graph step must not beat a step that ran faster than it
    in one run that measured both (ratios of two runs differ by noise; one run's side-by-side does not)."""
    import functools

    from helpers import records

    tool = _tool("render_results")

    def record(preset, name, rate):
        return {"configuration": {"model": "e4b-shape", "name": name, "ple": "cpu", "quant": "nf4", "card_gb": None},
                "preset": preset, "command": f"python -m lab.bench {preset}", "recorded_at": "2026-12-06T00:00:00",
                "decode_tokens_per_s": rate, "bandwidth_limit_tokens_per_s": 1000.0, "gpu": "G",
                "identity": {"identical": True, "steps": 256}}

    def headline(gemv_in_goal_run):
        rows = (record("decode-gemv", "cudagraphs", 70.0), record("decode-gemv", "host-free-fused-gemv", 183.0),
                record("decode-goal", "cudagraphs", 71.0), record("decode-goal", "host-free-fused-gemv", gemv_in_goal_run),
                record("decode-goal", "host-free-fused-cache", 184.0))
        (tmp_path / "e4b-shape.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return "\n".join(tool.fused_step_headline())

    monkeypatch.setattr(records, "preset_records", functools.partial(records.preset_records, directory=tmp_path))
    # 183/70 = 2.61x beats 184/71 = 2.59x as ratios, but the goal run measured its cache step faster than the gemv step
    assert "184.0 tokens/s" in headline(178.0) and "decode-goal" in headline(178.0)
    # the control: the same run measured the gemv step faster, so the gemv step is the headline
    assert "183.0 tokens/s" in headline(186.0) and "decode-gemv" in headline(186.0)


def test_the_driver_sampled_busy_share_shows_as_a_column_only_in_a_run_that_sampled_it(tmp_path):
    from helpers import records
    from helpers.paths import MEASUREMENTS_DIR

    column = "GPU busy (driver-sampled, no tracer)"
    changed = [json.loads(line) for line in (MEASUREMENTS_DIR / "e4b-shape.jsonl").read_text().splitlines()]
    latest = max(i for i, r in enumerate(changed) if r.get("preset") == "decode-goal")
    sampled = {key: value for key, value in changed[latest].items() if key != "gpu_busy_sampled"}
    unsampled = [r for i, r in enumerate(changed) if i != latest and not (r.get("preset") == "decode-goal"
                                                                        and "gpu_busy_sampled" in r)]
    for folder, with_share in (("with", True), ("without", False)):
        record = {**sampled, "gpu_busy_sampled": {"share": 0.9137, "samples": 8}} if with_share else sampled
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "e4b-shape.jsonl").write_text("\n".join(json.dumps(r) for r in [*unsampled, record]) + "\n")
    shown = records.table("decode-goal", tmp_path / "with")
    row = dict(zip(shown.columns, next(r for r in shown.rows if r[0] == sampled["configuration"]["name"])))
    assert row[column] == "91%"
    assert column not in records.table("decode-goal", tmp_path / "without").columns


def test_the_committed_outputs_name_the_notebooks_a_run_covered_not_a_glob_over_all_of_them():
    """A course run over three notebooks must not be cited as having run `notebooks/*.ipynb`."""
    from helpers.paths import NOTEBOOKS_DIR

    tool = _tool("render_results")
    every = [f"notebooks/{path.name}" for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb"), reverse=True)]
    head = "CARD_GB=8 python tools/run_course.py --record --save-outputs --jobs 3"
    assert tool.course_command(f"{head} {' '.join(every)}") == f"{head} notebooks/*.ipynb"
    some = tool.course_command(f"{head} {every[0]} {every[-1]}")
    assert some == f"{head} {every[-1]} {every[0]}" and "*" not in some
