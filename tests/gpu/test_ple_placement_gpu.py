"""GPU tier: E4B-shaped NF4 in both PLE placements, and the naive routes that fail.

Each route runs in its own process (``python -m lab.measure``) so peak-memory figures
are clean. With ``GPU_RECORD=1`` the records are written to ``data/gpu-tier/``.
"""

import json
import os
import subprocess

import pytest
import torch

from helpers.measure import compare_logits
from helpers.paths import GPU_TIER_DIR
from lab.bench import Configuration
from lab.records import split_host, write_record

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
    # the control: one PLE row one bf16 ulp off; the identity check must call it different
    "ple-cpu-nudged": Configuration(MODEL, QUANT, "cpu", new_tokens=NEW_TOKENS, route="ple-cpu-nudged"),
    # what a T4 runs: 4-bit layers computing in fp16
    "ple-cpu-fp16": Configuration(MODEL, QUANT, "cpu", new_tokens=NEW_TOKENS, route="ple-cpu-fp16"),
}
LOGIT_ROUTES = ("ple-gpu", "ple-cpu", "post-load", "ple-cpu-nudged", "ple-cpu-fp16")


@pytest.fixture(scope="session")
def routes(tmp_path_factory):
    """Run every route once per session, each in a fresh process, all at once: allocator
    counters are per process, so the memory figures are exact; the speeds are not (the processes
    share the GPU), so they are nulled. The benchmark's speed preset measures speed."""
    from helpers import models, synthetic
    from lab.bench import without_timings

    if models.is_synthetic(MODEL):
        synthetic.build(MODEL)  # here, with its progress bar; the five processes would wait on its lock in silence
    out = tmp_path_factory.mktemp("routes")
    running = {}
    for route, configuration in ROUTES.items():
        target = out / f"{route}.json"
        logits = out / f"{route}.logits.pt" if route in LOGIT_ROUTES else None
        running[route] = (subprocess.Popen(configuration.command(target, logits)), target)
    cache: dict = {}
    for route, (process, target) in running.items():
        try:
            returncode = process.wait(timeout=540)
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = None
        cache[route] = without_timings(json.loads(target.read_text()), len(running)) if returncode == 0 else None
    reference = torch.load(out / "ple-gpu.logits.pt") if cache.get("ple-gpu") else None
    for route in LOGIT_ROUTES[1:]:
        if reference is not None and cache.get(route):
            # identity can be claimed only over the steps where both runs agree with themselves
            steps = min(cache["ple-gpu"]["self_consistent_steps"], cache[route]["self_consistent_steps"])
            cache[route]["logits_vs_ple_gpu"] = compare_logits(reference, torch.load(out / f"{route}.logits.pt"), steps)

    def run(route):
        if cache[route] is None:
            pytest.fail(f"route {route} crashed; run its lab.measure command (printed above) to see why")
        return cache[route]

    yield run
    if os.environ.get("GPU_RECORD") == "1":
        for record in filter(None, cache.values()):
            if "greedy_tokens" in record:
                record["greedy_tokens_first_16"] = record.pop("greedy_tokens")[:16]
        host = {route: split_host(record) for route, record in cache.items() if record}
        write_record(GPU_TIER_DIR / f"{MODEL}-{QUANT}.json", cache)
        write_record(GPU_TIER_DIR / f"host-{MODEL}-{QUANT}.json", {route: figures for route, figures in host.items() if figures})


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


def test_ple_on_cpu_logits_are_bit_identical_to_ple_on_gpu_wherever_the_gpu_agrees_with_itself(routes):
    gpu, cpu = routes("ple-gpu"), routes("ple-cpu")
    comparison = cpu["logits_vs_ple_gpu"]
    assert comparison["identical"] and comparison["max_abs_diff"] == 0.0
    assert comparison["steps"] >= 128  # most of the run: a GPU that agrees with itself nowhere proves nothing
    assert cpu["greedy_tokens"][:comparison["steps"]] == gpu["greedy_tokens"][:comparison["steps"]]


def test_what_is_compared_varies_so_a_broken_lookup_could_not_hide(routes):
    # a random-weight model that repeats one token would agree with any broken placement
    assert routes("ple-gpu")["greedy_distinct_tokens"] >= 50


def test_one_ple_row_one_ulp_off_is_reported_as_different(routes):
    control = routes("ple-cpu-nudged")["logits_vs_ple_gpu"]
    assert control["identical"] is False and control["max_abs_diff"] > 0
    assert control["first_difference"] == 0  # the nudged row is read by the prompt: the first step differs


def test_fp16_compute_as_on_a_t4_keeps_every_logit_finite_over_256_tokens(routes):
    record = routes("ple-cpu-fp16")
    assert record["logits_finite"] is True and record["greedy_token_count"] == NEW_TOKENS
    assert record["greedy_distinct_tokens"] >= 50


def test_the_cpu_lookup_returns_exactly_the_rows_the_gpu_embedding_computes():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    from helpers import placement

    torch.manual_seed(0)
    table = Gemma4TextScaledWordEmbedding(4096, 256, padding_idx=0, embed_scale=16.0).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 4096, (3, 97), device="cuda")
    expected = table(ids)
    placement.install_cpu_lookup(table, "cuda")
    got = table(ids)
    assert table.weight.device.type == "cpu" and got.device.type == "cuda"
    assert torch.equal(got, expected) and torch.count_nonzero(got) > 0.9 * got.numel()


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
    assert post["logits_vs_ple_gpu"]["identical"] is True
