"""GPU tier: QLoRA steps of E4B-shaped NF4 with the PLE on the CPU under 8 GB and 15 GB caps.

Each card runs ``tools/fine_tuning_bench.py`` in its own process, one after the other (the speeds are valid only
alone): peak memory against sequence length (512 tokens up, to the first out-of-memory error), steps per second,
the largest sequence each card trains, and the copy task's loss falling. Each card runs twice: with the course's
chunked loss, and with every logit at once as transformers' own loss makes them; each card also tries the planner's
safe and largest sequence for it. First, uncapped, a profile of the peak up to 20,480 tokens: what
``python -m helpers.planner calibrate`` fits the planner's backward term on. With ``GPU_RECORD=1`` the records go to
``data/gpu-tier/fine-tuning-<model>-<card>gb.json``, ``...-<card>gb-whole-loss.json`` and ``...-profile.json``;
then run the calibration, and commit both.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.paths import GPU_TIER_DIR
from lab.records import write_record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("GEMMA_GPU_MODEL", "e4b-shape")
CARDS_GB = (8, 15)
WHOLE = "whole-loss"  # every logit at once, as transformers' own loss makes them: the baseline on the same card
PROFILE = "profile"  # no cap: the peak against the sequence, the planner's calibration
PROFILE_SEQUENCES = (512, 2048, 4096, 6144, 8192, 12288, 16384, 20480)


def bench(out: Path, *extra) -> dict | None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "fine_tuning_bench.py"), "--model", MODEL,
                           "--out", str(out), *extra], timeout=540)
    return json.loads(out.read_text()) if done.returncode == 0 else None


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from helpers import models, synthetic

    if models.is_synthetic(MODEL):
        synthetic.build(MODEL)
    out = tmp_path_factory.mktemp("fine-tuning")
    found = {PROFILE: bench(out / f"{PROFILE}.json", "--sequences", *map(str, PROFILE_SEQUENCES))}
    for card in CARDS_GB:
        found[card] = bench(out / f"{card}.json", "--card-gb", str(card))
        found[(card, WHOLE)] = bench(out / f"{card}-{WHOLE}.json", "--card-gb", str(card), "--loss-chunk", "none")
    yield found
    if os.environ.get("GPU_RECORD") == "1":
        for key, record in found.items():
            name = f"{key[0]}gb-{WHOLE}" if isinstance(key, tuple) else key if key == PROFILE else f"{key}gb"
            if record:
                write_record(GPU_TIER_DIR / f"fine-tuning-{MODEL}-{name}.json", record)


def runs(records, card):
    if records[card] is None:
        pytest.fail(f"the {card} run crashed: run tools/fine_tuning_bench.py to see why")
    return records[card]["runs"]


@pytest.mark.parametrize("card", CARDS_GB)
def test_qlora_steps_train_under_the_cap_with_the_ple_on_the_cpu(records, card):
    trained = [row for row in runs(records, card) if row["outcome"] == "trained"]
    assert trained, f"not even {runs(records, card)[0]['sequence']} tokens trained on {card} GB"
    assert all(row["peak_bytes"] <= card * 1e9 for row in trained)


@pytest.mark.parametrize("card", CARDS_GB)
def test_the_copy_task_loss_falls_on_the_gpu_with_no_overflow(records, card):
    first = runs(records, card)[0]
    assert first["outcome"] == "trained"
    assert first["losses"][-1] < first["losses"][0] - 0.5 and not first["skipped"]


@pytest.mark.parametrize("card", CARDS_GB)
def test_the_planners_safe_sequence_really_trains_on_that_card(records, card):
    record = records[card] or pytest.fail(f"the {card} GB run crashed")
    safe = record["planner"]["safe_context"]
    tried = [row for row in record["runs"] if row["sequence"] <= safe]
    assert safe in [row["sequence"] for row in tried], "the bench tries the planner's safe sequence itself"
    assert all(row["outcome"] == "trained" for row in tried), (safe, record["runs"])


def test_the_bigger_card_trains_at_least_as_long_a_sequence(records):
    small, big = (records[card] or pytest.fail(f"the {card} GB run crashed") for card in CARDS_GB)
    assert (big["largest_sequence"] or 0) >= (small["largest_sequence"] or 0)


@pytest.mark.parametrize("card", CARDS_GB)
def test_the_chunked_loss_trains_a_longer_sequence_than_the_whole_loss_on_the_same_card(records, card):
    chunked, whole = records[card], records[(card, WHOLE)]
    if chunked is None or whole is None:
        pytest.fail(f"a {card} GB run crashed: run tools/fine_tuning_bench.py --card-gb {card} to see why")
    assert chunked["loss_chunk"] and whole["loss_chunk"] is None
    assert (chunked["largest_sequence"] or 0) > (whole["largest_sequence"] or 0)
    same = [(c, w) for c in chunked["runs"] for w in whole["runs"]
            if c["sequence"] == w["sequence"] and c["outcome"] == w["outcome"] == "trained"]
    assert same and all(c["peak_bytes"] < w["peak_bytes"] for c, w in same), same


@pytest.mark.parametrize("card", [PROFILE, *CARDS_GB, *((card, WHOLE) for card in CARDS_GB)], ids=str)
def test_the_measured_peak_is_within_15_percent_of_the_planners(records, card):
    # the loss's terms come from the shapes, the backward's from the committed calibration: a fresh run meets both
    for row in runs(records, card):
        if row["outcome"] == "trained":
            assert abs(row["peak_bytes"] / row["predicted_peak_bytes"] - 1) < 0.15, row


def test_the_profile_reaches_past_every_cards_safe_sequence_so_the_fit_is_not_extrapolated(records):
    longest = max(row["sequence"] for row in runs(records, PROFILE) if row["outcome"] == "trained")
    assert all(longest >= records[card]["planner"]["safe_context"] for card in CARDS_GB if records[card])
