"""GPU tier: a picture arrives while E4B's towers wait in host memory (``towers="cpu"``). Two ways to meet it, timed
side by side in one process under a 4 and an 8 GB cap: run the vision tower where it waits, on the CPU, or let it
visit the GPU for the call (``placement.towers_visiting``: copied over, run there, sent back). Both give the image
features within rounding of each other (different kernels), and another picture falls outside.
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

def pixels(seed):
    generator = torch.Generator().manual_seed(seed)
    picture = Image.fromarray((torch.rand(448, 448, 3, generator=generator) * 255).to(torch.uint8).numpy())
    found = image_processor(picture, return_tensors="pt")
    return found["pixel_values"].to(0, model.dtype), found["image_position_ids"].to(0)

def features(image):
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(*image).pooler_output).float().cpu()

def visiting(image):
    with placement.towers_visiting(model, vision):
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

image, other = pixels(1), pixels(2)
resident = torch.cuda.memory_allocated(0)
record = {"card_gb": card_gb, "patches": image[0].shape[1], "resident_bytes": resident,
          "tower_bytes": sum(p.numel() * p.element_size() for name in vision for p in model.get_submodule(name).parameters())}
host, record["host_s"] = timed(features, image)
torch.cuda.reset_peak_memory_stats(0)
try:
    visited, record["visit_s"] = timed(visiting, image)
    record["visit_peak_bytes"] = torch.cuda.max_memory_allocated(0) - resident
except torch.OutOfMemoryError:
    visited, record["visit_s"] = None, None
    torch.cuda.empty_cache()
record["back_in_host_memory"] = all(p.device.type == "cpu" for name in vision for p in model.get_submodule(name).parameters())
record["resident_after_bytes"] = torch.cuda.memory_allocated(0)

def relative_rms(a, b):
    return round(float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()), 5)

if visited is not None:
    record["visit_vs_host_relative_rms"] = relative_rms(visited, host)
record["other_picture_relative_rms"] = relative_rms(features(other), host)  # the control
record["faster"] = "visit" if record["visit_s"] is not None and record["visit_s"] < record["host_s"] else "host"
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
def test_a_picture_meets_the_waiting_tower_on_the_cpu_within_the_cap(record, card):
    measured = record[f"{card} GB"]
    assert measured["resident_bytes"] < card * 1e9 and measured["host_s"] > 0


@pytest.mark.parametrize("card", CARDS_GB)
def test_a_visit_to_the_gpu_gives_the_features_within_rounding_and_another_picture_falls_outside(record, card):
    measured = record[f"{card} GB"]
    assert measured["other_picture_relative_rms"] > 0.01  # what is compared varies with the picture
    if measured["visit_s"] is not None:  # the devices round apart far less than two pictures differ
        assert measured["visit_vs_host_relative_rms"] * 5 < measured["other_picture_relative_rms"]


@pytest.mark.parametrize("card", CARDS_GB)
def test_after_the_visit_the_tower_waits_in_host_memory_and_the_gpu_holds_what_it_held(record, card):
    measured = record[f"{card} GB"]
    assert measured["back_in_host_memory"]
    assert measured["resident_after_bytes"] <= measured["resident_bytes"] + 1e6

