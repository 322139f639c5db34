"""The tuned decode (helpers.decoding) on tiny on the CPU: the same logits as generate with a static cache, bit for
bit over the steps where each agrees with itself, beside a control that must differ; accelerate's hooks as graph
breaks; a compiled step without int inputs; a profile a learner can open. Speeds are measured by make bench."""

import contextlib
import json
import os

import accelerate
import pytest
import torch
import transformers
from packaging.version import Version

from helpers import decoding, loading, measure, placement
from helpers.errors import CourseError, InvalidChoiceError
from lab import bench
from lab import measure as lab_measure

NEW = 24
OLD_RELEASE = Version(transformers.__version__) < Version("5.17.0")  # no per_layer_inputs, no hooks on 5.5.2 (below)


math_attention = measure.math_attention  # the comparisons' kernel: see its docstring


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return loading.load_tokenizer("tiny")


@pytest.fixture(scope="module")
def ids(tokenizer):
    return measure.prompt_ids(tokenizer, 32, "cpu")  # four times tiny's window: sliding layers are full


def fresh(quant="nf4"):
    return loading.load_model("tiny", quant=quant, ple="cpu", device="cpu")


@pytest.fixture(scope="module")
def nf4():
    return fresh()


@pytest.fixture(scope="module")
def reference(nf4, ids):
    """Plain generate with a static cache, twice: its logits and how far it agrees with itself."""
    with math_attention():
        first = decoding.plain_greedy(nf4, ids, NEW, static_cache=True, keep_logits=True)
        again = decoding.plain_greedy(nf4, ids, NEW, static_cache=True, keep_logits=True)
    return first, measure.self_consistent_steps(first.logits, again.logits)


needs_ple_outside = pytest.mark.skipif(OLD_RELEASE, reason="this transformers takes no per_layer_inputs (tested below)")


@needs_ple_outside
@pytest.mark.parametrize("compile_mode", [None, "eager", "cudagraphs"], ids=["loop", "dynamo", "graph-buffers"])
def test_the_tuned_decode_gives_the_logits_of_generate_with_a_static_cache_bit_for_bit(nf4, ids, reference, compile_mode):
    expected, steps = reference
    assert steps == NEW and len(set(expected.tokens)) > NEW // 2  # self-consistent, and the tokens vary
    with math_attention():
        run = decoding.TunedGreedy(nf4, decoding.Decoder(compile=compile_mode)).greedy(ids, NEW, keep_logits=True)
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]
    assert run.tokens == expected.tokens


@pytest.fixture(scope="module")
def emitting_placeholders(ids):
    """A model of its own whose greedy decode emits the image, audio and video placeholders (measure.placeholders_emitted),
    and plain generate's static-cache run of it, twice: the reference, and how far it agrees with itself."""
    model = fresh()

    def generated():
        with math_attention():
            return decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)

    with measure.placeholders_emitted(model, lambda: generated().tokens) as forced:
        first, again = generated(), generated()
        yield model, forced, first, measure.self_consistent_steps(first.logits, again.logits)


@needs_ple_outside
@pytest.mark.parametrize("compile_mode", [None, "eager", "cudagraphs"], ids=["loop", "dynamo", "graph-buffers"])
def test_the_tuned_decode_looks_up_a_generated_placeholder_as_the_models_forward_does_so_it_still_equals_generate(
        emitting_placeholders, ids, compile_mode, monkeypatch):
    model, forced, expected, steps = emitting_placeholders
    placeholders = measure.placeholder_ids(model)
    assert sorted(forced) == sorted(placeholders) and steps == NEW  # the case is covered: each one is fed back
    assert all(expected.tokens[step] == token and step < NEW - 1 for token, step in forced.items())
    assert len(set(expected.tokens)) > NEW // 2
    with math_attention():
        run = decoding.TunedGreedy(model, decoding.Decoder(compile=compile_mode)).greedy(ids, NEW, keep_logits=True)
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]
    assert run.tokens == expected.tokens
    monkeypatch.setattr(decoding, "text_ids", lambda model, ids: ids)  # the control: the raw ids looked up
    with math_attention():
        raw = decoding.TunedGreedy(model, decoding.Decoder(compile=compile_mode)).greedy(ids, NEW, keep_logits=True)
    comparison = measure.compare_logits(expected.logits, raw.logits, steps)
    assert not comparison["identical"] and comparison["first_difference"] == min(forced.values()) + 1


def test_text_inputs_are_what_the_models_own_forward_hands_its_decoder_for_placeholder_ids():
    """Drift: decoding.text_inputs copies Gemma4Model.forward's rule (placeholders looked up as the pad token); it must
    give the decoder the embeddings and PLE rows that forward gives it, with pad rows that are not zero."""
    model = fresh("bf16")
    pad = model.config.get_text_config().pad_token_id
    image, audio, video = measure.placeholder_ids(model)
    with torch.no_grad():
        for table in (model.get_input_embeddings(), model.get_submodule(placement.ple_module_names(model)[0])):
            table.weight.data[pad] = table.weight.data[pad + 7]
    ids = torch.tensor([[2, image, 300, audio, video, 301]])
    seen = {}
    hook = decoding.language_model(model).register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs),
                                                                    with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids)
            ours = decoding.text_inputs(model, ids)
            raw = {"inputs_embeds": model.get_input_embeddings()(ids)}  # the control: placeholders looked up as they are
    finally:
        hook.remove()
    for name, tensor in ours.items():
        assert torch.equal(seen[name], tensor), name
    assert not torch.equal(seen["inputs_embeds"], raw["inputs_embeds"])


@needs_ple_outside
def test_the_tuned_decode_with_one_ple_row_nudged_by_one_ulp_is_told_apart(nf4, ids, reference):
    expected, steps = reference
    with measure.ple_row_nudged(nf4, int(ids[0, -1])), math_attention():
        run = decoding.TunedGreedy(nf4, decoding.Decoder(compile=None)).greedy(ids, NEW, keep_logits=True)
    comparison = measure.compare_logits(expected.logits, run.logits, steps)
    assert not comparison["identical"] and comparison["first_difference"] == 0


@needs_ple_outside
@pytest.mark.parametrize("prompt, phases", [(32, 1), (4, 2)], ids=["window-full", "window-filling"])
def test_the_graph_step_reads_every_input_from_its_static_buffers_so_its_replays_give_the_logits_of_generate(
        nf4, tokenizer, prompt, phases):
    """On the CPU a StepGraphs 'replay' runs the forward on the static buffers a CUDA graph would read: an input
    that did not go through them would be stale here as it would be on the GPU."""
    ids = measure.prompt_ids(tokenizer, prompt, "cpu")
    with math_attention():
        expected = decoding.plain_greedy(nf4, ids, NEW, static_cache=True, keep_logits=True)
        tuned = decoding.TunedGreedy(nf4, decoding.Decoder(compile="cudagraphs"))
        first, second = (tuned.greedy(ids, NEW, keep_logits=True) for _ in range(2))
    assert len(tuned.graphs.phases) == phases and tuned.graphs.replayed == 2 * (NEW - 1) - phases
    assert len(set(expected.tokens)) > NEW // 2
    for run in (first, second):  # the second run replays every step, from a cache reset in place
        assert measure.compare_logits(expected.logits, run.logits)["identical"]


@needs_ple_outside
def test_a_graph_step_whose_masks_skip_their_buffers_is_told_apart(nf4, ids, reference, monkeypatch):
    expected, steps = reference
    tensors = decoding._tensors
    monkeypatch.setattr(decoding, "_tensors", lambda inputs, prefix=(): (
        (path, t) for path, t in tensors(inputs, prefix) if path[0] != "attention_mask"))
    with math_attention():
        run = decoding.TunedGreedy(nf4, decoding.Decoder(compile="cudagraphs")).greedy(ids, NEW, keep_logits=True)
    comparison = measure.compare_logits(expected.logits, run.logits, steps)
    assert not comparison["identical"] and comparison["first_difference"] > 0  # the first step runs eagerly


def test_a_full_window_indexed_once_updates_the_cache_exactly_as_the_library_does():
    from transformers.cache_utils import StaticSlidingWindowLayer

    torch.manual_seed(0)
    library, ours, broken = (StaticSlidingWindowLayer(max_cache_len=32, sliding_window=4) for _ in range(3))
    prompt = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    for layer in (library, ours, broken):
        layer.update(*prompt)  # the window is full from here on
    assert decoding.index_full_windows_once(type("Cache", (), {"layers": [ours, broken]})()) == 2
    assert type(ours) is decoding.FullWindowIndexedLayer
    broken.last_index = torch.tensor([-2])  # the control: the new token written one row too early
    for _ in range(3):
        token = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
        wrong = broken.update(*token)
        for got, want in zip(ours.update(*token), library.update(*token)):
            assert torch.equal(got, want)
        assert not torch.equal(wrong[0], library.keys)
    assert ours.cumulative_length_int == library.cumulative_length_int == 9
    assert not torch.equal(ours.keys, prompt[0][:, :, -4:])  # the window moved


def test_the_library_still_makes_its_full_window_index_at_every_token_so_the_override_is_still_needed():
    """Drift: when transformers stops calling torch.tensor inside StaticSlidingWindowLayer.update, a CUDA graph can
    capture the library's layer and FullWindowIndexedLayer should go."""
    import inspect

    from transformers.cache_utils import StaticSlidingWindowLayer

    assert "torch.tensor([-1]" in inspect.getsource(StaticSlidingWindowLayer.update)


def test_a_static_cache_changes_the_bits_of_plain_generate_under_a_fused_attention_kernel_so_identity_is_claimed_against_its_static_twin(
        nf4, ids):
    static = decoding.plain_greedy(nf4, ids, NEW, static_cache=True, keep_logits=True)
    dynamic = decoding.plain_greedy(nf4, ids, NEW, keep_logits=True)
    comparison = measure.compare_logits(static.logits, dynamic.logits)
    # where this CPU's fused kernel rounds by the keys' length (AVX-512 and AVX2 builds do; a forced lower capability
    # on an AMX machine runs math, conftest.py), the two differ, and only by rounding
    assert comparison["max_abs_diff"] < 0.1 * static.logits.std().item()  # rounding, not a different computation
    with math_attention():  # the padded keys of the static cache change only how a fused kernel rounds
        static, dynamic = (decoding.plain_greedy(nf4, ids, NEW, static_cache=static_cache, keep_logits=True)
                           for static_cache in (True, False))
    assert len(set(static.tokens)) > NEW // 2  # what is compared varies
    assert measure.compare_logits(static.logits, dynamic.logits)["identical"]


@pytest.mark.skipif(OLD_RELEASE, reason="5.5.2 with hooks on every layer: see the KeyError test below")
def test_accelerate_hooks_break_the_decode_graph_up_to_1_15_and_removing_them_leaves_one_graph_and_the_same_tokens(ids):
    """accelerate 1.16 took torch.compiler.disable off AlignDevicesHook's pre/post_forward (only its offloading
    steps keep it), so the same hooks that were graph breaks are traced into one graph; the course says which."""
    assert decoding.hooks_break_graphs() == (Version(accelerate.__version__) < Version("1.16"))
    model = decoding.attach_placement_hooks(fresh("bf16"))
    assert decoding.hooked_modules(model)
    before = decoding.plain_greedy(model, ids, 8, static_cache=True, keep_logits=True)
    hooked = decoding.graph_breaks(model, ids)
    if decoding.hooks_break_graphs():
        assert hooked["graph_breaks"] > 0 and any("AlignDevicesHook" in reason for reason in hooked["reasons"])
    else:
        assert hooked == {"graphs": 1, "graph_breaks": 0, "reasons": []}
    assert decoding.remove_hooks(model) > 0 and not decoding.hooked_modules(model)
    assert placement.has_cpu_lookup(model.get_submodule(placement.ple_module_names(model)[0]))  # the lookup stays
    assert decoding.graph_breaks(model, ids) == {"graphs": 1, "graph_breaks": 0, "reasons": []}
    after = decoding.plain_greedy(model, ids, 8, static_cache=True, keep_logits=True)
    assert len(set(before.tokens)) > 4  # what is compared varies
    assert torch.equal(before.logits, after.logits)


@pytest.mark.skipif(OLD_RELEASE, reason="5.5.2 with hooks on every layer: see the KeyError test below")
def test_counting_host_reads_on_a_hooked_model_leaves_it_runnable_after_its_hooks_are_taken_off(ids):
    """Notebook 09 on a GPU: loop_host_reads wrapped the hooked forward, TunedGreedy took the hooks off, and the
    wrapper's clean-up put the hook's forward back without its hook, so the next call raised AttributeError."""
    model = decoding.attach_placement_hooks(fresh("bf16"))
    assert decoding.hooked_modules(model)
    for new_tokens in (4, 6):  # the second count is what met the half-restored forward
        decoding.loop_host_reads(model, ids, decoding.Decoder(), new_tokens)
    assert not decoding.hooked_modules(model) and "_hf_hook" not in model.__dict__
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[1] == ids.shape[1]


@pytest.mark.skipif(not OLD_RELEASE, reason="only releases before 5.17 pass the shared keys in a plain dict")
def test_on_old_transformers_hooks_on_every_layer_lose_gemma4s_shared_keys(ids):
    """accelerate's send_to_device rebuilds every dict it is handed, so the keys one layer stores for the
    KV-shared layers land in a copy (transformers 5.5.2); later releases pass them in a KVSharingDict or by name."""
    model = decoding.attach_placement_hooks(fresh("bf16"))
    with pytest.raises(KeyError):
        decoding.plain_greedy(model, ids, 2)


def test_attaching_hooks_after_loading_is_refused_for_bitsandbytes_weights(nf4):
    with pytest.raises(CourseError, match="bf16"):
        decoding.attach_placement_hooks(nf4)


def test_hooks_are_kept_where_removing_them_would_leave_weights_behind():
    from accelerate.hooks import attach_align_device_hook

    model = fresh("bf16")
    table = model.get_submodule(placement.ple_module_names(model)[0])
    attach_align_device_hook(table, execution_device="cpu", offload=True, weights_map=table.state_dict())
    with pytest.raises(CourseError, match="offloads"):
        decoding.remove_hooks(model)


@needs_ple_outside
@pytest.mark.parametrize("prompt, graphs", [(32, 1), (4, 2)], ids=["window-full", "window-filling"])
def test_the_compiled_step_takes_no_int_inputs_so_cuda_graphs_are_recorded_once_per_branch(nf4, tokenizer, prompt, graphs):
    ids = measure.prompt_ids(tokenizer, prompt, "cpu")
    seen = []

    def backend(graph_module, example_inputs):
        seen.append([type(value).__name__ for value in example_inputs if not isinstance(value, torch.Tensor)])
        return graph_module.forward

    tuned = decoding.TunedGreedy(nf4, decoding.Decoder(compile=None))
    tuned.step_forward = torch.compile(nf4.forward, backend=backend, fullgraph=True, dynamic=False)
    tuned.greedy(ids, 12)
    assert len(seen) == graphs and all(inputs == [] for inputs in seen)


@needs_ple_outside
def test_without_pinned_counters_the_compiled_step_takes_the_sliding_counters_as_int_inputs(nf4, ids, monkeypatch):
    seen = []

    def backend(graph_module, example_inputs):
        seen.append([type(value).__name__ for value in example_inputs if not isinstance(value, torch.Tensor)])
        return graph_module.forward

    monkeypatch.setattr(decoding, "pinned_sliding_counters", lambda cache: contextlib.nullcontext())
    tuned = decoding.TunedGreedy(nf4, decoding.Decoder(compile=None))
    tuned.step_forward = torch.compile(nf4.forward, backend=backend, fullgraph=True)
    tuned.greedy(ids, 6)
    assert any("SymInt" in inputs for inputs in seen)  # each new value would record a new CUDA graph


@pytest.mark.skipif(not OLD_RELEASE, reason="this transformers takes per_layer_inputs")
def test_old_transformers_are_told_to_upgrade_or_keep_the_ple_lookup_in_the_step(nf4, ids, reference):
    with pytest.raises(CourseError, match="upgrade transformers"):
        decoding.TunedGreedy(nf4, decoding.Decoder(compile=None))
    expected, steps = reference
    with math_attention():
        run = decoding.TunedGreedy(nf4, decoding.Decoder(compile=None, ple_outside=False)).greedy(ids, NEW, keep_logits=True)
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]


def test_a_profile_writes_a_chrome_trace_of_the_decode_a_learner_can_open(nf4, ids, tmp_path):
    summary = decoding.profile(lambda: decoding.plain_greedy(nf4, ids, 4), tmp_path / "decode.json", 4, "cpu")
    events = decoding.trace_events(summary.trace)
    assert any(event.get("name", "").startswith("aten::") for event in events)
    assert summary.cpu_ops > 0 and summary.by_step["cpu_ops"] == summary.cpu_ops / 4
    assert summary.kernels == 0 and summary.device_busy_fraction is None  # no GPU here: nothing claimed about one


def test_a_profile_prints_none_of_the_profilers_start_and_stop_marks_into_the_learners_cell(nf4, ids, tmp_path, capfd):
    """torch 2.12 and later write "USDT: ... profiler_start" and "profiler_stop" to the process's stderr, which a
    notebook shows in red; a bare torch profile in the same process is the control where this torch writes them."""
    from torch.profiler import profile as torch_profile

    with torch_profile():
        torch.ones(3).sum()
    bare = capfd.readouterr().err
    decoding.profile(lambda: decoding.plain_greedy(nf4, ids, 2), tmp_path / "decode.json", 2, "cpu")
    assert "USDT:" not in capfd.readouterr().err
    if Version(torch.__version__).release >= (2, 12):
        assert "profiler_start" in bare  # the control: this torch writes the marks, so the filter above was tested


@needs_ple_outside
def test_the_decode_speed_route_records_what_the_benchmark_compares_on_the_cpu(nf4, tokenizer, tmp_path):
    """lab.measure._measure_decoding is what `make bench PRESET=decode-speed` runs on the GPU; on the CPU its records
    must already carry self-consistency and logits that bench.identity compares, control included."""
    cpu = torch.device("cpu")
    records = {}
    for name, mode, nudged in (("generate-static", "generate-static", False), ("dynamo", "dynamo", False),
                               ("nudged", "loop", True)):
        record = {"model": "tiny", "quant": "nf4", "ple": "cpu"}
        nudge = measure.ple_row_nudged(nf4, int(measure.prompt_ids(tokenizer, 32, "cpu")[0, -1])) if nudged \
            else contextlib.nullcontext()
        with nudge, math_attention():
            lab_measure._measure_decoding(nf4, tokenizer, cpu, record, decode=mode, new_tokens=12, decode_runs=0,
                                      greedy_context=32, logits_out=tmp_path / f"{name}.pt", profile_trace=None,
                                      profile_steps=4)
        record["logits_file"] = str(tmp_path / f"{name}.pt")
        records[name] = record
    assert records["generate-static"]["self_consistent_steps"] == 12
    assert records["dynamo"]["compile"]["graph_breaks"] == 0
    assert records["dynamo"]["bandwidth_limit_tokens_per_s"] > 0
    same = bench.identity(records["generate-static"], records["dynamo"],
                          bench.Configuration("tiny", "nf4", "cpu", reference="generate-static"))
    control = bench.identity(records["generate-static"], records["nudged"],
                             bench.Configuration("tiny", "nf4", "cpu", reference="generate-static", control=True))
    assert same["compared"] and same["identical"] and same["steps"] == 12
    assert control["compared"] and control["told_apart"]
    json.dumps(records)  # what measure writes must serialise


@pytest.mark.parametrize("compile_mode", ["cudagraphs", "reduce-overhead", "eager"])
def test_int8_layers_that_pick_outliers_on_the_host_are_refused_before_loading_and_on_a_loaded_model(compile_mode):
    settings = decoding.Decoder(compile=compile_mode)
    with pytest.raises(CourseError, match="quant='nf4', or pass Decoder\\(compile=None\\)"):
        settings.check_quant("int8")
    for quant in ("bf16", "nf4", "fp4"):
        settings.check_quant(quant)  # the others are taken
    decoding.Decoder(compile=None).check_quant("int8")
    with pytest.raises(CourseError, match="choose one of"):
        settings.check_quant("int4")
    with pytest.raises(CourseError, match="int8"):
        decoding.TunedGreedy(fresh("int8"), settings)


@pytest.mark.parametrize("make, message", [
    (lambda: decoding.Decoder(compile="fast"), "choose one of"),
    (lambda: decoding.Decoder(fullgraph="yes"), "True or False"),
    (lambda: decoding.Decoder(chunk=-1), "whole number"),
])
def test_bad_decoder_settings_are_refused_in_one_sentence(make, message):
    with pytest.raises((CourseError, InvalidChoiceError), match=message):
        make()


@needs_ple_outside
def test_the_tuned_decode_refuses_a_batch_and_settings_of_the_wrong_kind(nf4, ids):
    with pytest.raises(CourseError, match="Decoder"):
        decoding.TunedGreedy(nf4, "reduce-overhead")
    with pytest.raises(CourseError, match="batch 1"):
        decoding.TunedGreedy(nf4, decoding.Decoder(compile=None)).greedy(ids.repeat(2, 1), 2)
    with pytest.raises(CourseError, match="at least 34"):
        decoding.TunedGreedy(nf4, decoding.Decoder(compile=None)).greedy(ids, 2, cache_length=33)


def test_reproducible_kernels_fix_cublas_and_keep_attention_off_cudnn_whose_runs_drift_apart(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        said = measure.reproducible_kernels()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert ("cuDNN" in said) if torch.cuda.is_available() else said.startswith("No CUDA GPU")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("bad, message", [
    ([[2, 5, 6]], "not one prompt"),
    (torch.tensor([2, 5, 6]), "not one prompt"),
    (torch.tensor([[2.0, 5.0]]), "not one prompt"),
    (torch.tensor([[2, -1]]), "outside the vocabulary"),
    (torch.tensor([[2, 10**7]]), "outside the vocabulary"),
    (torch.zeros((1, 0), dtype=torch.long), "empty prompt"),
    (torch.tensor([[2, 5], [2, 6]]), "batch 1"),
], ids=["list", "1-d", "float", "negative", "out-of-vocabulary", "empty", "batch-2"])
def test_a_prompt_the_model_cannot_read_is_refused_in_one_sentence_by_every_decode(nf4, bad, message):
    decoders = [lambda: decoding.plain_greedy(nf4, bad, 2)]
    if not OLD_RELEASE:
        decoders.append(lambda: decoding.TunedGreedy(nf4, decoding.Decoder(compile=None)).greedy(bad, 2))
    for decode in decoders:
        with pytest.raises(CourseError, match=message):
            decode()


def test_decode_lengths_and_profiles_of_nothing_are_refused(nf4, ids):
    with pytest.raises(CourseError, match="new_tokens"):
        decoding.plain_greedy(nf4, ids, 0)
    with pytest.raises(CourseError, match="steps"):
        decoding.profile(lambda: None, "trace.json", 0, "cpu")
    with pytest.raises(CourseError, match="something to call"):
        decoding.profile("not a function", "trace.json", 4, "cpu")
    too_long = nf4.config.get_text_config().max_position_embeddings
    if not OLD_RELEASE:
        with pytest.raises(CourseError, match="max_position_embeddings"):
            decoding.TunedGreedy(nf4, decoding.Decoder(compile=None)).greedy(ids, too_long)


def test_a_decode_profile_leaves_out_the_prefill_and_other_work_around_the_loop(nf4, ids, tmp_path):
    def busy_elsewhere():
        for _ in range(500):  # work outside the decode loop, as a prefill is: it must not weigh as steps do
            torch.ones(4).add_(1)

    def decode_only():
        decoding.plain_greedy(nf4, ids, 4)

    def decode_and_more():
        busy_elsewhere()
        decoding.plain_greedy(nf4, ids, 4)

    alone = decoding.profile(decode_only, tmp_path / "alone.json", 4, "cpu")
    with_more = decoding.profile(decode_and_more, tmp_path / "more.json", 4, "cpu")
    assert with_more.by_step["forwards"] == alone.by_step["forwards"] == 4
    assert abs(with_more.cpu_ops - alone.cpu_ops) < 100  # the 1,000 operators around the loop are not counted
    unmarked = decoding.profile(busy_elsewhere, tmp_path / "unmarked.json", 4, "cpu")  # control: no decode loop
    assert unmarked.cpu_ops >= 1000 and "forwards" not in unmarked.by_step


def test_a_decode_profile_counts_the_gpu_work_its_launches_started_even_after_the_loop_returns():
    """A CUDA-graph step's kernels run after its launch returns: they are joined to the loop by correlation id,
    and the loop's wall reaches the last one's end. Work launched outside the loop is not counted."""
    range_ = {"ph": "X", "cat": "user_annotation", "name": decoding.decode_range(2), "ts": 0, "dur": 100}
    events = [range_,
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5, "dur": 2, "args": {"correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 2, "args": {"correlation": 2}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 200, "dur": 2, "args": {"correlation": 3}},
              {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 10, "dur": 20, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 20, "dur": 20, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "argmax", "ts": 120, "dur": 30, "args": {"correlation": 2}},
              {"ph": "X", "cat": "kernel", "name": "outside", "ts": 205, "dur": 50, "args": {"correlation": 3}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 60, "dur": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 300, "dur": 1}]
    summary = decoding._decode_loop_summary(events, [(0, 100, 2)], 2, "trace.json")
    assert (summary.kernels, summary.launches, summary.cpu_ops) == (3, 2, 1)
    assert summary.wall_s == pytest.approx(150e-6)  # to the end of the kernel that ran after the loop returned
    assert summary.device_busy_s == pytest.approx(60e-6)  # the overlapping gemvs count once: 10..40, 120..150
    assert summary.device_busy_fraction == pytest.approx(0.4)
    assert summary.by_step["kernels"] == 1.5 and summary.by_step["top_kernels"][0] == {"name": "gemv", "share": 0.5714,  # of 70 µs of work
                                                                                  "per_forward": 1.0, "mean_us": 20.0}


def test_the_decode_measurement_samples_busy_beyond_its_timed_runs_without_timing_the_extra_ones(nf4, tokenizer,
                                                                                                  tmp_path, monkeypatch):
    """On a GPU, lab.gpu_busy's sampler runs beside the timed decodes and asks for untimed ones until enough whole
    periods fell inside; here a sampler whose every period is 70% busy stands in for NVML."""
    from conftest import FakeNvml

    from lab import gpu_busy

    opened = []

    def fake_open(device):
        opened.append(gpu_busy.Sampler(FakeNvml(70), handle=None))
        return opened[-1]

    monkeypatch.setattr(gpu_busy.Sampler, "open", staticmethod(fake_open))
    monkeypatch.setattr(gpu_busy, "MIN_DECODE_S", 0.5)
    record = {"model": "tiny", "quant": "nf4", "ple": "cpu"}
    lab_measure._measure_decoding(nf4, tokenizer, torch.device("cpu"), record, decode="generate", new_tokens=6,
                                  decode_runs=1, greedy_context=32, logits_out=None, profile_trace=None, profile_steps=4)
    assert len(record["decode_tokens_per_s_runs"]) == 2  # the second run and one timed: the extra ones not among them
    assert opened[0].decoded_s >= 0.5 and len(opened[0]._windows) > 1
    assert record["gpu_busy_sampled"]["share"] == 0.7 and record["gpu_busy_sampled"]["samples"] >= 3
