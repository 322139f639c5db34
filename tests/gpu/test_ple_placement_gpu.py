"""GPU tier: E4B-shaped NF4 in both PLE placements, and the naive routes that fail.

Each route runs in its own process (``python -m helpers.measure``) so peak-memory figures
are clean. With ``GPU_RECORD=1`` the records are written to ``data/gpu-tier/``.
"""

import json
import os
import subprocess

import pytest
import torch

from helpers.bench import Configuration
from helpers.paths import GPU_TIER_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = os.environ.get("GEMMA_GPU_MODEL", "e4b-shape")
QUANT = "nf4"
NEW_TOKENS = 256
PREFILL = int(os.environ.get("GEMMA_GPU_PREFILL", "8500"))
ROUTES = {  # the benchmark's own command builder, so the tier measures exactly what bench does
    "ple-gpu": Configuration(MODEL, QUANT, "gpu", contexts=(PREFILL,), new_tokens=NEW_TOKENS),
    "ple-cpu": Configuration(MODEL, QUANT, "cpu", contexts=(PREFILL,), new_tokens=NEW_TOKENS),
    "post-load": Configuration(MODEL, QUANT, "cpu", contexts=(PREFILL,), new_tokens=NEW_TOKENS, route="post-load"),
    "cpu-entry": Configuration(MODEL, QUANT, "cpu", contexts=(512,), new_tokens=4, route="cpu-entry"),
    "no-flag": Configuration(MODEL, QUANT, "cpu", new_tokens=0, route="no-flag"),
}


@pytest.fixture(scope="session")
def routes(tmp_path_factory):
    """Run every route once per session, each in a fresh process, all at once: allocator
    counters are per process, so the memory figures are exact; the speeds are not (the processes
    share the GPU), so they are nulled. The benchmark's speed preset measures speed."""
    from helpers import models, synthetic
    from helpers.bench import without_timings

    if models.is_synthetic(MODEL):
        synthetic.build(MODEL)  # here, with its progress bar; the five processes would wait on its lock in silence
    out = tmp_path_factory.mktemp("routes")
    running = {}
    for route, configuration in ROUTES.items():
        target = out / f"{route}.json"
        running[route] = (subprocess.Popen(configuration.command(target)), target)
    cache: dict = {}
    for route, (process, target) in running.items():
        try:
            returncode = process.wait(timeout=540)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = None
        cache[route] = without_timings(json.loads(target.read_text()), len(running)) if returncode == 0 else None

    def run(route):
        if cache[route] is None:
            pytest.fail(f"route {route} crashed; run its helpers.measure command (printed above) to see why")
        return cache[route]

    yield run
    if os.environ.get("GPU_RECORD") == "1":
        GPU_TIER_DIR.mkdir(parents=True, exist_ok=True)
        for record in filter(None, cache.values()):
            if "greedy_tokens" in record:
                record["greedy_tokens_first_16"] = record.pop("greedy_tokens")[:16]
        (GPU_TIER_DIR / f"{MODEL}-{QUANT}.json").write_text(json.dumps(cache, indent=1, sort_keys=True))


def ple_table_bytes(record):
    return record["placement"].get("cpu", 0)


def test_ple_on_cpu_frees_the_whole_table_from_gpu_memory(routes):
    gpu, cpu = routes("ple-gpu"), routes("ple-cpu")
    table = ple_table_bytes(cpu)
    assert table > 1e9 if MODEL == "e4b-shape" else table > 0
    saved = gpu["resident_bytes"] - cpu["resident_bytes"]
    assert abs(saved - table) / table < 0.03, (saved, table)


def test_ple_on_cpu_never_reaches_the_gpu_while_loading(routes):
    gpu, cpu = routes("ple-gpu"), routes("ple-cpu")
    # a `""` key would load the table onto the GPU first; the per-module map never does
    assert cpu["peak_load_bytes"] <= cpu["resident_bytes"] + 0.25e9
    assert cpu["peak_load_bytes"] < gpu["resident_bytes"] - 0.9 * ple_table_bytes(cpu)


def test_ple_on_cpu_greedy_output_is_bit_identical_over_256_tokens(routes):
    gpu, cpu = routes("ple-gpu"), routes("ple-cpu")
    assert len(cpu["greedy_tokens"]) >= 256
    assert cpu["greedy_tokens"] == gpu["greedy_tokens"]


def test_ple_on_cpu_lowers_the_long_prefill_peak(routes):
    gpu, cpu = routes("ple-gpu"), routes("ple-cpu")
    gpu_peak, cpu_peak = gpu["prefill"][0], cpu["prefill"][0]
    assert not cpu_peak.get("oom")
    if not gpu_peak.get("oom"):
        assert gpu_peak["peak_bytes"] - cpu_peak["peak_bytes"] > 0.9 * ple_table_bytes(cpu)


def test_cpu_entry_in_device_map_alone_copies_the_whole_table_to_gpu_at_every_forward(routes):
    naive, cpu = routes("cpu-entry"), routes("ple-cpu")
    table = ple_table_bytes(cpu)
    assert naive["resident_bytes"] < cpu["resident_bytes"] + 0.1 * table  # looks like it worked...
    peak = naive["prefill"][0]["peak_bytes"]
    assert peak > naive["resident_bytes"] + 0.9 * table  # ...until the forward pulls the table over


def test_bitsandbytes_refuses_a_cpu_entry_without_the_offload_flag(routes):
    record = routes("no-flag")
    assert "load_error" in record
    assert "llm_int8_enable_fp32_cpu_offload" in record["load_error"] or "dispatched on the CPU" in record["load_error"]


def test_post_load_offload_frees_allocated_but_not_reserved_memory(routes):
    post, gpu, cpu = routes("post-load"), routes("ple-gpu"), routes("ple-cpu")
    table = ple_table_bytes(cpu)
    assert abs(post["resident_bytes"] - cpu["resident_bytes"]) < 0.05 * table
    assert post["reserved_bytes"] > post["resident_bytes"] + 0.9 * table
    assert post["peak_load_bytes"] >= gpu["resident_bytes"] - 0.02 * table
    assert post["greedy_tokens"] == gpu["greedy_tokens"]
