"""GPU tier: a picture arrives while E4B's towers wait in host memory (``towers="cpu"``), under a 4 and an 8 GB cap.
Three ways to meet it, timed side by side in one process: the tower visits the GPU for the call (the default where
the card has room: copied over, run with a resident tower's kernels, dropped after), it runs where it waits on the CPU
(``placement.towers_stay_in_host_memory``), or it lives on the GPU (what ``towers="gpu"`` pays for all the time).
A visit gives a resident tower's features bit for bit, beside a one-ulp control that must show; the CPU's are within
rounding, and another picture falls far outside. A card with room for the weights but not the activations makes the
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
import torch
from PIL import Image
from helpers import cards, loading, placement

card_gb = float(sys.argv[1])
cards.simulate(card_gb)
model = loading.load_model("e4b-shape", "nf4", "cpu", device=0, towers="cpu", head="nf4")
image_processor = loading.load_processor("e4b-shape").image_processor
vision = [name for name in placement.tower_module_names(model) if "vision" in name]
towers = [model.get_submodule(name) for name in vision]

def pixels(seed):
    generator = torch.Generator().manual_seed(seed)
    picture = Image.fromarray((torch.rand(448, 448, 3, generator=generator) * 255).to(torch.uint8).numpy())
    found = image_processor(picture, return_tensors="pt")
    return found["pixel_values"].to(0, model.dtype), found["image_position_ids"].to(0)

def features(image):
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(*image).pooler_output).float().cpu()

def on_the_cpu(image):
    with placement.towers_stay_in_host_memory(model, vision):
        return features(image)

def timed(call, image, runs=3):
    seconds = []
    for _ in range(runs):
        torch.cuda.synchronize(0)
        began = time.perf_counter()
        result = call(image)
        torch.cuda.synchronize(0)
        seconds.append(time.perf_counter() - began)
    return result, round(statistics.median(seconds), 4)

def relative_rms(a, b):
    return round(float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()), 5)

image, other = pixels(1), pixels(2)
torch.ones(64, 64, device=0, dtype=torch.bfloat16) @ torch.ones(64, 64, device=0, dtype=torch.bfloat16)
resident = torch.cuda.memory_allocated(0)  # after cuBLAS's one-time workspace, which an NF4 text model never needed
record = {"card_gb": card_gb, "patches": image[0].shape[1], "resident_bytes": resident,
          "tower_bytes": sum(p.numel() * p.element_size() for t in towers for p in t.parameters())}
host, record["host_s"] = timed(on_the_cpu, image)
torch.cuda.reset_peak_memory_stats(0)
visited, record["visit_s"] = timed(features, image)
record["visit_peak_bytes"] = torch.cuda.max_memory_allocated(0) - resident
record["ran"] = {name: t._tower_last_run for name, t in zip(vision, towers)}
record["back_in_host_memory"] = all(p.device.type == "cpu" for t in towers for p in t.parameters())
record["resident_after_bytes"] = torch.cuda.memory_allocated(0)
record["visit_vs_host_relative_rms"] = relative_rms(visited, host)
record["other_picture_relative_rms"] = relative_rms(features(other), host)  # what is compared varies

for tower in towers:  # the towers living on the GPU, as towers="gpu" keeps them
    tower.to(0)
    tower.forward = tower._tower_run
in_place, record["resident_s"] = timed(features, image)
record["visit_identical_to_resident"] = torch.equal(visited, in_place)
weight = towers[0].patch_embedder.input_proj.weight
for tower in towers:
    placement.install_cpu_tower(tower, 0)
kept = weight[0].detach().clone()
with torch.no_grad():  # the control: one bf16 ulp up in one weight, on the host copy a visit reads
    weight[0].copy_(torch.nextafter(kept, torch.full_like(kept, float("inf"))))
    record["nudged_visit_identical"] = torch.equal(features(image), in_place)
    weight[0].copy_(kept)
torch.cuda.empty_cache()

# room for the weights but not the activations: the visit runs out of memory, then the tower runs on the CPU
before = torch.cuda.memory_allocated(0)
filler = torch.empty(cards.budget_bytes(0) - record["tower_bytes"] - 16 * 2**20, dtype=torch.uint8, device=0)
squeezed = features(image)
record["squeezed_ran"] = {name: t._tower_last_run for name, t in zip(vision, towers)}
record["squeezed_vs_host_relative_rms"] = relative_rms(squeezed, host)
del filler
record["squeezed_gave_back"] = torch.cuda.memory_allocated(0) <= before
record["faster"] = "visit" if record["visit_s"] < record["host_s"] else "host"
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


@pytest.mark.parametrize("card", CARDS_GB)
def test_a_picture_visits_the_gpu_where_the_card_has_room_and_the_tower_waits_in_host_memory_after(record, card):
    measured = record[f"{card} GB"]
    assert set(measured["ran"].values()) == {"visit"} and measured["back_in_host_memory"]
    assert measured["resident_bytes"] + measured["visit_peak_bytes"] < card * 1e9
    assert measured["resident_after_bytes"] <= measured["resident_bytes"] + 1e6


@pytest.mark.parametrize("card", CARDS_GB)
def test_a_visit_gives_the_features_of_a_resident_tower_bit_for_bit_and_a_nudged_weight_shows(record, card):
    measured = record[f"{card} GB"]
    assert measured["visit_identical_to_resident"] and not measured["nudged_visit_identical"]


@pytest.mark.parametrize("card", CARDS_GB)
def test_the_cpu_run_is_within_rounding_and_another_picture_falls_far_outside(record, card):
    measured = record[f"{card} GB"]
    assert measured["other_picture_relative_rms"] > 0.01  # what is compared varies with the picture
    assert measured["visit_vs_host_relative_rms"] * 5 < measured["other_picture_relative_rms"]


@pytest.mark.parametrize("card", CARDS_GB)
def test_a_visit_that_runs_out_of_memory_runs_on_the_cpu_and_gives_back_what_it_took(record, card):
    measured = record[f"{card} GB"]
    assert measured["squeezed_ran"]["model.vision_tower"] == "cpu" and measured["squeezed_gave_back"]
    assert measured["squeezed_vs_host_relative_rms"] * 5 < measured["other_picture_relative_rms"]
