"""Weight-size estimates from the meta device, checked against real loads and the GPU record."""

import json

import pytest

from helpers import loading, placement, records, synthetic, weights
from helpers.paths import GPU_TIER_DIR

GPU_RECORD = GPU_TIER_DIR / "e4b-shape-nf4.json"


def test_bf16_estimate_equals_the_bytes_of_a_real_tiny_load(tiny_path):
    model = loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu")
    actual = sum(placement.report(model).bytes_by_device().values())
    estimate = weights.weight_bytes(weights.meta_model(model.config), "bf16", "gpu")
    assert estimate.gpu_bytes == actual


def test_ple_cpu_moves_exactly_the_table_out_of_the_gpu_estimate():
    meta = weights.meta_model(synthetic.gemma4_config("e4b-shape"))
    on_gpu, on_cpu = weights.weight_bytes(meta, "nf4", "gpu"), weights.weight_bytes(meta, "nf4", "cpu")
    table = 262144 * 42 * 256 * 2
    assert table <= on_cpu.cpu_bytes < table + 16  # the table and its scalar scale
    assert on_gpu.gpu_bytes - on_cpu.gpu_bytes == on_cpu.cpu_bytes


@pytest.mark.skipif(not GPU_RECORD.is_file(), reason="no recorded GPU measurement")
@pytest.mark.parametrize("route, ple", [("ple-gpu", "gpu"), ("ple-cpu", "cpu")])
def test_nf4_estimate_agrees_with_the_recorded_h200_measurement_within_2_percent(route, ple):
    record = json.loads(GPU_RECORD.read_text())[route]
    meta = weights.meta_model(synthetic.gemma4_config(record["model"]))
    estimate = weights.weight_bytes(meta, record["quant"], ple)
    assert abs(estimate.gpu_bytes - record["resident_bytes"]) / record["resident_bytes"] < 0.02


def test_the_recorded_ple_offload_frees_what_the_weight_count_says_within_3_percent():
    # notebook 05 prints both figures; the recorded H200 run must agree with the meta model's count


    recorded = records.gpu_tier("e4b-shape", "nf4")
    freed = recorded["ple-gpu"]["resident_bytes"] - recorded["ple-cpu"]["resident_bytes"]
    e4b = weights.meta_model(synthetic.gemma4_config("e4b-shape"))
    counted = weights.weight_bytes(e4b, "nf4", "gpu").gpu_bytes - weights.weight_bytes(e4b, "nf4", "cpu").gpu_bytes
    assert counted > 0 and abs(freed - counted) / counted < 0.03, (freed, counted)
