"""GPU tier: a picture and a sound arrive while E4B's towers wait in host memory (``towers="cpu"``), under a 4 and an
8 GB cap. Three ways to meet each, timed side by side in one process: the tower visits the GPU for the call (the default
where the card has room: copied over, run with a resident tower's kernels, dropped after), it runs where it waits on the
CPU (``placement.towers_stay_in_host_memory``), or it lives on the GPU (what ``towers="gpu"`` pays for all the time).
A visit gives a resident tower's features bit for bit, beside a one-ulp control that must show; the CPU's are within
rounding, and another input falls far outside. A card with room for the weights but not the activations makes the
visit run out of memory: it then runs on the CPU and gives back what it took.
``GPU_RECORD=1`` writes data/gpu-tier/towers-e4b-shape.json."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CARDS_GB = (4, 8)

ON_A_CARD = r"""
import json, statistics, sys, time
import numpy as np
import torch
from PIL import Image
from helpers import cards, loading, placement

card_gb = float(sys.argv[1])
cards.simulate(card_gb)
model = loading.load_model("e4b-shape", "nf4", "cpu", device=0, towers="cpu", head="nf4")
processor = loading.load_processor("e4b-shape")

def picture(seed):
    generator = torch.Generator().manual_seed(seed)
    found = processor.image_processor(Image.fromarray((torch.rand(448, 448, 3, generator=generator) * 255)
                                                      .to(torch.uint8).numpy()), return_tensors="pt")
    return found["pixel_values"].to(0, model.dtype), found["image_position_ids"].to(0)

def sound(seed):  # ten seconds of noise at 16 kHz: 250 audio soft tokens
    wave = (torch.rand(160_000, generator=torch.Generator().manual_seed(seed)) * 0.6 - 0.3).numpy().astype(np.float32)
    found = processor.feature_extractor([wave], sampling_rate=16_000, return_tensors="pt")
    return found["input_features"].to(0, model.dtype), found["input_features_mask"].to(0)

# each input: its towers, how it is made, how it is encoded, and the weight the control nudges (read by every input)
INPUTS = {"picture": ("vision", picture, model.model.get_image_features, "patch_embedder.input_proj.weight"),
          "sound": ("audio", sound, model.model.get_audio_features, "subsample_conv_projection.layer0.conv.weight")}

def timed(call, given, runs=3):
    seconds = []
    for _ in range(runs):
        torch.cuda.synchronize(0)
        began = time.perf_counter()
        result = call(given)
        torch.cuda.synchronize(0)
        seconds.append(time.perf_counter() - began)
    return result, round(statistics.median(seconds), 4)

def relative_rms(a, b):
    return round(float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()), 5)

torch.ones(64, 64, device=0, dtype=torch.bfloat16) @ torch.ones(64, 64, device=0, dtype=torch.bfloat16)
resident = torch.cuda.memory_allocated(0)  # after cuBLAS's one-time workspace, which an NF4 text model never needed
record = {"card_gb": card_gb, "resident_bytes": resident}
for kind, (tower_word, make, encode, nudged) in INPUTS.items():
    names = [name for name in placement.tower_module_names(model) if tower_word in name]
    towers = [model.get_submodule(name) for name in names]

    def features(given):
        with torch.no_grad():
            return torch.cat(list(encode(*given).pooler_output)).float().cpu()

    def on_the_cpu(given):
        with placement.towers_stay_in_host_memory(model, names):
            return features(given)

    given = make(1)
    module_bytes = {name: sum(p.numel() * p.element_size() for p in t.parameters()) for name, t in zip(names, towers)}
    found = {"module_bytes": module_bytes, "tower_bytes": sum(module_bytes.values()),
             "room_bytes": cards.budget_bytes(0), "input_shape": list(given[0].shape)}
    host, found["host_s"] = timed(on_the_cpu, given)
    torch.cuda.reset_peak_memory_stats(0)
    visited, found["visit_s"] = timed(features, given)
    found["visit_peak_bytes"] = torch.cuda.max_memory_allocated(0) - resident
    found["ran"] = {name: t._tower_last_run for name, t in zip(names, towers)}
    found["back_in_host_memory"] = all(p.device.type == "cpu" for t in towers for p in t.parameters())
    found["resident_after_bytes"] = torch.cuda.memory_allocated(0)
    found["visit_vs_host_relative_rms"] = relative_rms(visited, host)
    found["other_input_relative_rms"] = relative_rms(features(make(2)), host)  # what is compared varies
    found["resident_after_more_bytes"] = torch.cuda.memory_allocated(0)  # after a fourth visit

    for tower in towers:  # the towers living on the GPU, as towers="gpu" keeps them
        tower.to(0)
        tower.forward = tower._tower_run
    in_place, found["resident_s"] = timed(features, given)
    found["visit_identical_to_resident"] = torch.equal(visited, in_place)
    for tower in towers:
        placement.install_cpu_tower(tower, 0)
    torch.cuda.empty_cache()
    weight = towers[0].get_parameter(nudged)
    kept = weight[0].detach().clone()
    with torch.no_grad():  # the control: one bf16 ulp up in one weight, on the host copy a visit reads
        weight[0].copy_(torch.nextafter(kept, torch.full_like(kept, float("inf"))))
        found["nudged_visit_identical"] = torch.equal(features(given), in_place)
        weight[0].copy_(kept)

    # room for the weights but not the activations: the visit runs out of memory, then the tower runs on the CPU
    torch.cuda.empty_cache()  # else the cache's free blocks, which the budget counts, hold the visit too
    before, spare = torch.cuda.memory_allocated(0), cards.budget_bytes(0) - found["tower_bytes"] - 16 * 2**20
    if spare > 0:  # else the card has no room for the weights either: the visit above already ran on the CPU
        filler = torch.empty(spare, dtype=torch.uint8, device=0)
        squeezed = features(given)
        found["squeezed_ran"] = {name: t._tower_last_run for name, t in zip(names, towers)}
        found["squeezed_vs_host_relative_rms"] = relative_rms(squeezed, host)
        del filler
        found["squeezed_gave_back"] = torch.cuda.memory_allocated(0) <= before
    found["faster"] = "visit" if found["visit_s"] < found["host_s"] else "host"
    record[kind] = found
    torch.cuda.empty_cache()
print(json.dumps(record))
"""


def run(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def record():
    from helpers import synthetic

    synthetic.build("e4b-shape")
    found = {f"{card} GB": run(ON_A_CARD, str(card)) for card in CARDS_GB}
    if os.environ.get("GPU_RECORD") == "1":
        from helpers.paths import REPO_ROOT
        from lab.records import environment, write_record

        write_record(REPO_ROOT / "data/gpu-tier/towers-e4b-shape.json", {**environment(), **found})
    return found


INPUTS = ("picture", "sound")
CASES = [(card, kind) for card in CARDS_GB for kind in INPUTS]


@pytest.mark.parametrize(("card", "kind"), CASES)
def test_an_input_brings_its_tower_to_the_gpu_where_the_card_has_room_and_it_waits_in_host_memory_after(record, card,
                                                                                                      kind):
    measured, resident = record[f"{card} GB"][kind], record[f"{card} GB"]["resident_bytes"]
    assert measured["back_in_host_memory"]
    assert measured["ran"] == {name: "visit" if measured["room_bytes"] > size else "cpu"
                               for name, size in measured["module_bytes"].items()}
    if "visit" in measured["ran"].values():
        assert resident + measured["visit_peak_bytes"] < card * 1e9


@pytest.mark.parametrize(("card", "kind"), CASES)
def test_a_visit_leaves_next_to_nothing_on_the_gpu_and_a_later_visit_adds_nothing(record, card, kind):
    measured, resident = record[f"{card} GB"][kind], record[f"{card} GB"]["resident_bytes"]
    assert measured["resident_after_bytes"] - resident <= measured["tower_bytes"] / 50  # a cache of the first call
    assert measured["resident_after_more_bytes"] == measured["resident_after_bytes"]


@pytest.mark.parametrize(("card", "kind"), CASES)
def test_a_visit_gives_the_features_of_a_resident_tower_bit_for_bit_and_a_nudged_weight_shows(record, card, kind):
    measured = record[f"{card} GB"][kind]
    assert measured["visit_identical_to_resident"] and not measured["nudged_visit_identical"]


@pytest.mark.parametrize(("card", "kind"), CASES)
def test_the_cpu_run_is_within_rounding_and_another_input_falls_far_outside(record, card, kind):
    measured = record[f"{card} GB"][kind]
    assert measured["other_input_relative_rms"] > 0.01  # what is compared varies with the input
    assert measured["visit_vs_host_relative_rms"] * 5 < measured["other_input_relative_rms"]


@pytest.mark.parametrize(("card", "kind"), CASES)
def test_a_visit_that_runs_out_of_memory_runs_on_the_cpu_and_gives_back_what_it_took(record, card, kind):
    measured = record[f"{card} GB"][kind]
    if "squeezed_ran" not in measured:
        pytest.skip(f"no room on {card} GB for the {kind}'s tower: it ran on the CPU from the start")
    assert "cpu" in measured["squeezed_ran"].values() and measured["squeezed_gave_back"]
    assert measured["squeezed_vs_host_relative_rms"] * 5 < measured["other_input_relative_rms"]
