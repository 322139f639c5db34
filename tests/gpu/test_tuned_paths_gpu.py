"""GPU tier, issue 15: the tuned long-context and decode paths on ``tiny`` on CUDA, before the benchmark spends
minutes on E4B. Fast (tiny): a crash or a silent fallback (CUDA graphs skipped, graph breaks) shows here first."""

import functools

import pytest
import torch

from helpers import decoding, loading, long_context, measure

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW = 48
measure.reproducible_kernels()  # at import, before any test's first matmul: runs repeat bit for bit


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return loading.load_tokenizer("tiny")


@pytest.fixture(scope="module")
def ids(tokenizer):
    return measure.prompt_ids(tokenizer, 32, 0)


def counters():
    from torch._dynamo.utils import counters as dynamo_counters

    return {"graph_breaks": sum(dynamo_counters["graph_break"].values()),
            "cudagraph_skips": dynamo_counters["inductor"].get("cudagraph_skips", 0)}


def test_the_loader_attaches_hooks_on_a_gpu_they_break_the_graph_up_to_accelerate_1_15_and_removing_them_keeps_the_logits(ids):
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    assert decoding.hooked_modules(model)  # the per-module map with a "cpu" entry goes through dispatch_model
    before = decoding.plain_greedy(model, ids, 16, static_cache=True, keep_logits=True)
    assert (decoding.graph_breaks(model, ids)["graph_breaks"] > 0) == decoding.hooks_break_graphs()
    decoding.remove_hooks(model)
    assert decoding.graph_breaks(model, ids)["graph_breaks"] == 0
    after = decoding.plain_greedy(model, ids, 16, static_cache=True, keep_logits=True)
    assert len(set(before.tokens)) > 8  # what is compared varies
    assert measure.compare_logits(before.logits, after.logits)["identical"]


def static_generate_reference(model, ids):
    """Plain generate with a static cache, twice: the reference run and how many steps it agrees with itself."""
    reference = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
    again = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
    return reference, measure.self_consistent_steps(reference.logits, again.logits)


@pytest.mark.parametrize("prompt", [32, 4], ids=["window-full", "window-filling"])
def test_the_tuned_decode_replays_cuda_graphs_of_the_eager_step_with_the_logits_of_generate_bit_for_bit(tokenizer, prompt):
    ids = measure.prompt_ids(tokenizer, prompt, 0)
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    reference, steps = static_generate_reference(model, ids)
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile="cudagraphs"))
    first = tuned.greedy(ids, NEW, keep_logits=True)
    second = tuned.greedy(ids, NEW, keep_logits=True)
    phases = 1 if prompt >= 8 else 2  # tiny's window is 8: a short prompt fills it while decoding
    assert (tuned.graphs.captured, len(tuned.graphs.phases)) == (phases, phases)
    assert tuned.graphs.replayed == 2 * (NEW - 1) - phases
    assert steps >= NEW // 2 and len(set(reference.tokens)) > NEW // 4, (steps, reference.tokens)
    for run in (first, second):
        comparison = measure.compare_logits(reference.logits, run.logits, steps)
        assert comparison["identical"], comparison
    with measure.ple_row_nudged(model, int(ids[0, -1])):  # the control: one PLE row one bf16 ulp off
        nudged = tuned.greedy(ids, NEW, keep_logits=True)
    assert not measure.compare_logits(reference.logits, nudged.logits, steps)["identical"]


def test_inductors_cuda_graphs_run_without_a_skip_or_a_break_and_round_differently_within_bounds(ids):
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    reference = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
    start = counters()
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile="reduce-overhead"))
    first = tuned.greedy(ids, NEW, keep_logits=True)
    second = tuned.greedy(ids, NEW, keep_logits=True)
    end = counters()
    assert end == start, (start, end)  # no graph break, no CUDA graph skipped
    assert measure.compare_logits(first.logits, second.logits)["identical"]  # a replayed graph agrees with itself
    fused = measure.compare_rounding(reference.logits, first.logits)
    one_step_late = measure.compare_rounding(reference.logits[1:], reference.logits[:-1])  # a cache one position off
    assert fused["within_rounding"] and not one_step_late["within_rounding"], (fused, one_step_late)


def test_a_cuda_graph_launches_far_fewer_times_per_token_than_plain_generate(ids, tmp_path):
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    plain = decoding.profile(functools.partial(decoding.plain_greedy, model, ids, 8), tmp_path / "plain.json", 8, 0)
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile="cudagraphs"))
    tuned.greedy(ids, 8)  # capture first
    graphed = decoding.profile(functools.partial(tuned.greedy, ids, 8), tmp_path / "tuned.json", 8, 0)
    assert plain.kernels > 0 and 0 < plain.device_busy_fraction <= 1
    assert tuned.graphs.captured == 1 and tuned.graphs.replayed > 8  # the profiled steps were replays
    assert graphed.by_step["launches"] < plain.by_step["launches"] / 5, (plain.by_step, graphed.by_step)


def test_the_tuned_chunked_prefill_gives_the_logits_of_one_uncached_forward_on_the_gpu_and_a_narrow_window_does_not(ids, tokenizer):
    model = loading.load_model("tiny", quant="bf16", ple="cpu", device=0, dtype=torch.float32)
    long_ids = measure.prompt_ids(tokenizer, 96, 0)
    with torch.no_grad():
        reference = model(input_ids=long_ids).logits
    settings = long_context.LongContext(chunk=16)
    good = long_context.logits_agree(reference, settings.prefill_logits(model, long_ids), atol=1e-3)
    broken = long_context.narrow_window(long_context.new_cache(model, "static", 96))
    bad = long_context.logits_agree(reference, settings.prefill_logits(model, long_ids, cache=broken), atol=1e-3)
    assert good["close"] and not bad["close"], (good, bad)


def capture_case(case: str, model: str = "tiny") -> dict:
    """One case of tools/capture_probe.py in a fresh process: nothing an earlier model set up can help it."""
    import json
    import subprocess
    import sys

    from helpers.paths import REPO_ROOT

    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "capture_probe.py"), model, "--case", case],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("case", ["bf16", "nf4", "fp4"])
def test_the_cuda_graph_step_captures_as_the_first_model_of_a_fresh_process_with_the_logits_of_generate(case):
    result = capture_case(case)
    assert result["captured"] and result["identical"] and result["distinct_tokens"] > 8, result


def test_int8_is_refused_before_loading_and_by_a_loaded_model_in_one_sentence():
    result = capture_case("int8")
    assert "compile=None" in result["refused_before_loading"] and not result["captured"], result
    assert result["error"].startswith("TunedDecodeError") and "compile=None" in result["error"], result


@pytest.mark.parametrize("prompt", [32, 4], ids=["window-full", "window-filling"])
def test_the_host_free_step_reads_its_tables_in_place_and_gives_the_logits_of_generate_bit_for_bit(tokenizer, prompt):
    ids = measure.prompt_ids(tokenizer, prompt, 0)
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    reference, steps = static_generate_reference(model, ids)
    tuned = decoding.TunedGreedy(model, decoding.Decoder(host_free=True))
    assert tuned.mapped_tables  # the PLE table in pinned host memory, read by the GPU in place
    assert not torch.cuda.memory_allocated(0) > 0.5e9  # tiny: no copy of a table on the card
    runs = [tuned.greedy(ids, NEW, keep_logits=True) for _ in range(2)]
    assert steps >= NEW // 2 and len(set(reference.tokens)) > NEW // 4, (steps, reference.tokens)
    for run in runs:
        assert measure.compare_logits(reference.logits, run.logits, steps)["identical"]
        assert run.tokens == reference.tokens
    table = model.get_submodule(tuned.mapped_tables[0])
    table.weight.data.view(torch.int16)[reference.tokens[1]] += 1  # the control: one ulp in a row the run reads
    nudged = tuned.greedy(ids, NEW, keep_logits=True)
    assert not measure.compare_logits(reference.logits, nudged.logits, steps)["identical"]


def test_inductor_in_the_host_free_steps_own_graph_rounds_differently_within_bounds(tokenizer):
    """Inductor's fused kernels round otherwise than the eager ones, so the rule is the bound, beside its control (a
    cache one position off falls outside it); the step still reads its tables in place and replays the same graph."""
    ids = measure.prompt_ids(tokenizer, 32, 0)
    model = loading.load_model("tiny", quant="nf4", ple="cpu", device=0)
    reference = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
    tuned = decoding.TunedGreedy(model, decoding.Decoder(host_free=True, compile="inductor"))
    first, second = (tuned.greedy(ids, NEW, keep_logits=True) for _ in range(2))
    assert tuned.mapped_tables and tuned.graphs.captured > 0 and tuned.graphs.replayed > 0
    assert measure.compare_logits(first.logits, second.logits)["identical"]  # a replayed graph agrees with itself
    fused = measure.compare_rounding(reference.logits, first.logits)
    one_step_late = measure.compare_rounding(reference.logits[1:], reference.logits[:-1])
    assert fused["within_rounding"] and not one_step_late["within_rounding"], (fused, one_step_late)
