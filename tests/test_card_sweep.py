"""The GPU card sweep (tools/card_sweep.py, make test-gpu-sweep): its parts cover every card size a learner brings,
the whole GPU and the sizes at which the planner's choices turn, for both shapes, each exactly once, in parts small
enough for one device call."""

import json

from conftest import tool

from helpers import cards, planner

card_sweep = tool("card_sweep")


def test_the_sweep_runs_every_card_size_from_4_gb_the_whole_gpu_and_the_edges_for_both_shapes_once():
    runs = [(shape, card) for shape, part in card_sweep.parts() for card in part]
    wanted = [(shape, card) for shape in ("e4b-shape", "e2b-shape")
              for card in [*(f"{gb:g}" for gb in cards.CARD_SIZES_GB), "uncapped", *card_sweep.edge_cards(shape)]]
    assert sorted(runs) == sorted(wanted) and len(runs) == len(set(runs))
    assert min(cards.CARD_SIZES_GB) == 4 and all(len(part) <= card_sweep.CARDS_PER_PART for _, part in card_sweep.parts())


def choice_on(step: str, shape: str, gb: float):
    found = planner.choose(step, shape, card_gb=round(gb, 2), ram_bytes=card_sweep.PLENTY_OF_RAM)
    return (found.model, found.setup) if found else None


def test_the_edges_are_the_sizes_where_some_step_first_runs_a_new_choice_the_named_cards_miss():
    """A card named in the sweep can sit well inside a choice's range; the tightest card for each choice is where a
    planner that promises a little too much fails (notebook 03 on 4.5 GB, with 4 and 6 GB passing)."""
    step = card_sweep.EDGE_STEP_GB
    for shape in card_sweep.SHAPES:
        edges = [float(gb) for gb in card_sweep.edge_cards(shape)]
        assert edges and not set(edges) & set(cards.CARD_SIZES_GB)
        for gb in edges:
            assert any(choice_on(name, shape, gb) not in (choice_on(name, shape, gb - step), None)
                       for name in planner.STEPS), (shape, gb)
        # the control: the size just above an edge is not one, unless a choice turns there too
        above = edges[0] + step
        assert (above in edges) == any(choice_on(name, shape, above) not in (choice_on(name, shape, edges[0]), None)
                                       for name in planner.STEPS)
    # the smallest card that runs e4b-shape itself in notebook 03's load is one of them
    smallest = next(gb / 20 for gb in range(80, 481) if choice_on("03.course", "e4b-shape", gb / 20)[0] == "e4b-shape")
    assert f"{smallest:g}" in card_sweep.edge_cards("e4b-shape") or smallest in cards.CARD_SIZES_GB


def test_each_part_is_one_make_test_gpu_cards_call_with_its_shape_and_cards():
    shape, part = card_sweep.parts()[0]
    assert card_sweep.command(shape, part)[2:] == ["test-gpu-cards", f"GEMMA_MODEL={shape}", f"GPU_CARDS={' '.join(part)}"]


def test_the_sweep_names_as_still_to_run_a_card_whose_record_is_missing_stale_or_failing(tmp_path):
    """A part recorded before a notebook changed is not done: --todo must find it, and must pass a current one."""
    import json

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "00_a.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": "x = 1"}]}))
    current = card_sweep.code_hash("00_a.ipynb", notebooks)
    cards_recorded = {"4 GB": {"00_a.ipynb": {"result": "pass", "code_sha": current}},  # the control: done
                      "6 GB": {"00_a.ipynb": {"result": "pass", "code_sha": "an older notebook"}},
                      "8 GB": {"00_a.ipynb": {"result": "fail", "code_sha": current}}}
    (tmp_path / "notebooks-e4b-shape.json").write_text(json.dumps({"cards": cards_recorded}))
    left = card_sweep.unfinished("e4b-shape", ("4", "6", "8", "uncapped"), tmp_path, notebooks)
    assert left == ["6 GB: 00_a.ipynb stale", "8 GB: 00_a.ipynb failed", "uncapped: 00_a.ipynb not run"]
    assert card_sweep.unfinished("e4b-shape", ("4",), tmp_path, notebooks) == []


def test_a_card_whose_notebooks_passed_in_different_runs_is_run_again_whole(tmp_path):
    """4.5 GB had notebook 03 rerun after a fix and 4.55 GB notebook 10 after a kernel timed out: each card's column
    then mixed two runs (two machines for 4.55 GB), where the sweep promises one run of its command per card."""
    import json

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for name in ("00_a.ipynb", "01_b.ipynb"):
        (notebooks / name).write_text(json.dumps({"cells": [{"cell_type": "code", "source": name}]}))
    run = {"result": "pass", "gpu": "NVIDIA H200", "date": "2026-12-04", "command": "make test-gpu-cards"}
    entry = {name: {**run, "code_sha": card_sweep.code_hash(name, notebooks)} for name in ("00_a.ipynb", "01_b.ipynb")}
    cards_recorded = {"4 GB": entry,  # the control: one run
                      "6 GB": {**entry, "01_b.ipynb": {**entry["01_b.ipynb"], "gpu": "NVIDIA H100 80GB HBM3"}}}
    (tmp_path / "notebooks-e4b-shape.json").write_text(json.dumps({"cards": cards_recorded}))
    assert card_sweep.unfinished("e4b-shape", ("4", "6"), tmp_path, notebooks) == [
        "6 GB: 00_a.ipynb one of 2 runs", "6 GB: 01_b.ipynb one of 2 runs"]


def test_a_notebook_checked_out_with_windows_line_ends_hashes_as_the_same_code(tmp_path):
    import json

    for name, source in (("lf.ipynb", "x = 1\ny = 2"), ("crlf.ipynb", "x = 1\r\ny = 2"), ("other.ipynb", "x = 1\ny = 3")):
        (tmp_path / name).write_text(json.dumps({"cells": [{"cell_type": "code", "source": source}]}))
    lf, crlf, other = (card_sweep.code_hash(name, tmp_path) for name in ("lf.ipynb", "crlf.ipynb", "other.ipynb"))
    assert lf == crlf and lf != other  # the control: one character of code is another notebook


def test_a_part_stopped_at_its_deadline_ends_in_time_and_leaves_no_process_behind(tmp_path, monkeypatch):
    """A lent machine's call is cut at 10 minutes, and what it ran is lost with it: the part stops itself first."""
    import subprocess
    import time

    sleeper = "sleep 30.0713"  # a child of the part's shell, in its process group
    monkeypatch.setattr(card_sweep, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(card_sweep, "left_to_run", lambda number: (*card_sweep.parts()[number - 1], ("0[0-3]",)))
    monkeypatch.setattr(card_sweep, "command", lambda shape, cards, groups: ["bash", "-c", f"({sleeper}) & wait"])
    card_sweep.parts()  # the planner's scan for the edges, cached, is not the part's time
    started = time.monotonic()
    assert card_sweep.run([1, 2], deadline=0.5, log=tmp_path / "log") == 124
    assert time.monotonic() - started < 10
    time.sleep(0.2)
    assert subprocess.run(["pgrep", "-f", sleeper], capture_output=True).returncode == 1  # none left, of either part
    monkeypatch.setattr(card_sweep, "command", lambda shape, cards, groups: ["bash", "-c", "exit 3"])
    assert card_sweep.run([1], deadline=5) == 3  # the control: a part that ends by itself keeps its status


def test_a_part_runs_only_the_cards_and_notebook_groups_left_and_skips_a_part_already_done(tmp_path, monkeypatch):
    """Part 12 had one notebook left on one card: rerunning its 22 cost a whole call."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for name in ("00_a.ipynb", "05_b.ipynb", "10_c.ipynb"):
        (notebooks / name).write_text(json.dumps({"cells": [{"cell_type": "code", "source": f"# {name}"}]}))
    shape, cards = card_sweep.parts()[0]
    done = {name: {"result": "pass", "code_sha": card_sweep.code_hash(name, notebooks)}
            for name in ("00_a.ipynb", "05_b.ipynb", "10_c.ipynb")}
    recorded = {f"{card_sweep.card_label(card)}": dict(done) for card in cards}
    recorded[card_sweep.card_label(cards[-1])]["10_c.ipynb"] = {"result": "fail", "code_sha": done["10_c.ipynb"]["code_sha"]}
    (tmp_path / f"notebooks-{shape}.json").write_text(json.dumps({"cards": recorded}))
    assert card_sweep.left_to_run(1, tmp_path, notebooks) == (shape, (cards[-1],), ("1[0-9]",))
    del recorded[card_sweep.card_label(cards[0])]["05_b.ipynb"]  # never run there
    (tmp_path / f"notebooks-{shape}.json").write_text(json.dumps({"cards": recorded}))
    assert card_sweep.left_to_run(1, tmp_path, notebooks) == (shape, cards, ("0[4-6]", "1[0-9]"))
    recorded[card_sweep.card_label(cards[0])]["05_b.ipynb"] = done["05_b.ipynb"]
    assert card_sweep.command(shape, (cards[-1],), ("1[0-9]",))[-1] == "GPU_NOTEBOOK_GROUPS=1[0-9]"
    assert not any(a.startswith("GPU_NOTEBOOK_GROUPS") for a in card_sweep.command(shape, cards))  # the default: all
    recorded[card_sweep.card_label(cards[-1])]["10_c.ipynb"]["result"] = "pass"  # the control: nothing left
    (tmp_path / f"notebooks-{shape}.json").write_text(json.dumps({"cards": recorded}))
    assert card_sweep.left_to_run(1, tmp_path, notebooks) == (shape, (), ())
    monkeypatch.setattr(card_sweep, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(card_sweep, "left_to_run", lambda number: (shape, (), ()))
    monkeypatch.setattr(card_sweep, "command", lambda *a: ["bash", "-c", "exit 3"])
    assert card_sweep.run([1], deadline=5) == 0  # nothing started


def test_parts_side_by_side_may_not_share_a_card_size_since_the_junit_files_name_only_the_card(capsys):
    import argparse

    import pytest

    parser = argparse.ArgumentParser()
    shared = next((a, b) for a, (_, ca) in enumerate(card_sweep.parts(), 1) for b, (_, cb) in enumerate(card_sweep.parts(), 1)
                  if a < b and set(ca) & set(cb))
    with pytest.raises(SystemExit):
        card_sweep.require_parts(list(shared), parser)
    assert "share a card size" in capsys.readouterr().err
    apart = next((a, b) for a, (_, ca) in enumerate(card_sweep.parts(), 1) for b, (_, cb) in enumerate(card_sweep.parts(), 1)
                 if a < b and not set(ca) & set(cb))
    assert card_sweep.require_parts([*apart, apart[0]], parser) == list(apart)  # the control, asked twice: once


def test_a_packed_part_brings_back_the_groups_a_deadline_stopped_before_they_recorded(tmp_path, monkeypatch):
    from tools import record_nbval

    box, here, build = tmp_path / "box", tmp_path / "here", tmp_path / "build"
    for folder in (box, here, build):
        folder.mkdir()
    shape, cards = card_sweep.parts()[0]
    entry = {"passed": 8, "failed": 0, "skipped": 0, "seconds": 30.0, "result": "pass", "gpu": "NVIDIA H200",
             "gpu_total_bytes": 150109880320, "versions": {"transformers": "5.24.0"}, "date": "2026-12-05",
             "command": "c", "code_sha": "x"}
    (box / f"notebooks-{shape}.json").write_text(json.dumps({"model": shape, "cards": {f"{cards[0]} GB": {
        "00_setup.ipynb": entry}}}))
    (build / f"nbval-gpu-{cards[0]}-2.xml").write_text(  # a group that finished after the record's last write
        '<testsuites><testsuite timestamp="2026-12-05T08:05:00"><testcase classname="notebooks.04_named_modules.ipynb" '
        'name="Cell 0" time="1.5"/><testcase classname="notebooks.04_named_modules.ipynb" name="Cell 1" time="2"/>'
        '</testsuite></testsuites>')
    (box / "card-sweep.log").write_text("log")
    monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", box)
    monkeypatch.setattr(card_sweep, "BUILD_DIR", build)
    bundle = card_sweep.pack([1], tmp_path, box / "card-sweep.log")
    assert bundle.name == "part-1.tgz"

    monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", here)
    monkeypatch.setattr(record_nbval, "GPU_TIER_DIR", here)
    monkeypatch.setenv("CARD_GB", "")
    assert card_sweep.unpack(bundle) == [f"nbval-gpu-{cards[0]}-2.xml"]
    record = json.loads((here / f"notebooks-{shape}.json").read_text())["cards"][f"{cards[0]} GB"]
    assert record["00_setup.ipynb"] == entry  # what the box recorded, kept
    added = record["04_named_modules.ipynb"]
    assert (added["passed"], added["seconds"], added["gpu"], added["date"]) == (2, 3.5, "NVIDIA H200", "2026-12-05")
    assert "GPU_CARDS=" in added["command"] and (here / f"notebooks-{shape}-{'-'.join(cards)}.log").read_text() == "log"


def test_an_unpacked_group_is_stamped_with_the_machine_it_ran_on_not_another_cards(tmp_path, monkeypatch):
    """Part 16 ran on an H100 on 2026-12-06; unpacking it stamped its cards "NVIDIA H200", taken from another card
    recorded that day on another machine. The box packs its own machine; an older bundle lends only the same card's."""
    from tools import record_nbval

    box, build = tmp_path / "box", tmp_path / "build"
    box.mkdir(), build.mkdir()
    shape, cards = card_sweep.parts()[0]
    other = {"passed": 8, "failed": 0, "skipped": 0, "seconds": 30.0, "result": "pass", "gpu": "NVIDIA H200",
             "gpu_total_bytes": 150109880320, "versions": {"transformers": "5.24.0"}, "date": "2026-12-06",
             "command": "c", "code_sha": "x"}
    (box / f"notebooks-{shape}.json").write_text(json.dumps({"model": shape, "cards": {"99 GB": {"00_setup.ipynb": other}}}))
    (build / f"nbval-gpu-{cards[0]}-2.xml").write_text(
        '<testsuites><testsuite timestamp="2026-12-06T08:05:00"><testcase classname="notebooks.04_named_modules.ipynb" '
        'name="Cell 0" time="1.5"/></testsuite></testsuites>')
    monkeypatch.setattr(card_sweep, "BUILD_DIR", build)
    monkeypatch.setenv("CARD_GB", "")
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_total_bytes": 85017493504, "versions": {"transformers": "5.24.0"}}
    for name, machine, expected in (("stamped", h100, h100["gpu"]), ("unstamped", None, None)):
        here = tmp_path / name
        here.mkdir()
        monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", box)
        bundle = card_sweep.pack([1], here, environment=machine)
        assert not (here / card_sweep.ENVIRONMENT).exists()  # only inside the bundle
        monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", here)
        monkeypatch.setattr(record_nbval, "GPU_TIER_DIR", here)
        card_sweep.unpack(bundle)
        record = json.loads((here / f"notebooks-{shape}.json").read_text())["cards"]
        added = record.get(f"{cards[0]} GB", {}).get("04_named_modules.ipynb")
        assert (added or {}).get("gpu") == expected  # the other card's H200 lent to neither


def test_two_parts_packed_from_one_tree_and_unpacked_in_turn_keep_each_others_cards(tmp_path, monkeypatch):
    """Each bundle carries the whole record it started from; taking one in whole undid the other (parts 12-13 and 14,
    2026-12-05). Only a bundle's own cards replace the tree's."""
    here = tmp_path / "here"
    here.mkdir()
    first, second = [(number, part) for number, part in enumerate(card_sweep.parts(), 1) if part[0] == "e4b-shape"][:2]
    shape = first[1][0]
    base = {"model": shape, "cards": {"old GB": {"00_setup.ipynb": {"result": "pass"}}}}
    bundles = []
    for number, (_, part_cards) in (first, second):
        box = tmp_path / f"box{number}"
        box.mkdir()
        recorded = {**base, "cards": {**base["cards"], f"{part_cards[0]} GB": {"00_setup.ipynb": {"result": "pass"}}}}
        (box / f"notebooks-{shape}.json").write_text(json.dumps(recorded))
        monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", box)
        monkeypatch.setattr(card_sweep, "BUILD_DIR", tmp_path / "no-build")
        bundles.append(card_sweep.pack([number], box))
    monkeypatch.setattr(card_sweep, "GPU_TIER_DIR", here)
    (here / f"notebooks-{shape}.json").write_text(json.dumps(base))
    for bundle in bundles:
        card_sweep.unpack(bundle)
    kept = set(json.loads((here / f"notebooks-{shape}.json").read_text())["cards"])
    assert kept == {"old GB", f"{first[1][1][0]} GB", f"{second[1][1][0]} GB"}
