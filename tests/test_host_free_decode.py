"""The host-free decode step (``Decoder(host_free=True)``) on tiny on the CPU: the token the step chooses feeds the
next step in place, the step advances its own position and makes its masks from it on the device, and nothing in
the loop reads a tensor on the host. The same logits as generate with a static cache, bit for bit, beside a control
whose masks are one step late. The GPU's part (the tables read in place, the graph replays queued without waiting)
is measured by make bench."""


import pytest
import torch
import transformers
from packaging.version import Version

from helpers import decoding, loading, measure
from helpers.errors import InvalidChoiceError

NEW = 24
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.17.0"),
                                reason="this transformers takes no per_layer_inputs")


@pytest.fixture(scope="module")
def model(tiny_path):
    return loading.load_model("tiny", quant="nf4", ple="cpu", device="cpu")


@pytest.fixture(scope="module")
def ids():
    return measure.prompt_ids(loading.load_tokenizer("tiny"), 32, "cpu")  # past tiny's window: sliding layers fill


@pytest.fixture(scope="module")
def reference(model, ids):
    with measure.math_attention():
        first = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
        again = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
    return first, measure.self_consistent_steps(first.logits, again.logits)


@pytest.mark.parametrize("compile_mode", [None, "cudagraphs"], ids=["loop", "graph-buffers"])
def test_the_host_free_step_gives_the_logits_of_generate_with_a_static_cache_bit_for_bit(model, ids, reference, compile_mode):
    expected, steps = reference
    assert steps == NEW and len(set(expected.tokens)) > NEW // 2  # self-consistent, and the tokens vary
    with measure.math_attention():
        tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=compile_mode, host_free=True))
        runs = [tuned.greedy(ids, NEW, keep_logits=True) for _ in range(2)]  # the second from a cache reset in place
    assert any(arange is not None for arange in tuned._mask_aranges.values())  # the masks came from the position
    for run in runs:
        assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]
        assert run.tokens == expected.tokens


@pytest.mark.parametrize("prompt", [4, 32], ids=["window-fills-while-decoding", "window-full-from-the-prompt"])
def test_transformers_masks_are_the_positions_rule_at_every_step_and_the_logits_stay_identical(model, ids, prompt):
    """The rule the step makes its masks by, held against transformers' own masks at each of the run's steps: tiny's
    sliding window (8) fills during the decode of a 4-token prompt and before that of a 32-token one, and the full
    mask grows in both."""
    ids = ids[:, :prompt]
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=None, host_free=True))
    cache = tuned.cache(prompt + NEW)
    mask_2d = torch.ones((1, prompt + NEW), dtype=torch.long)
    with torch.no_grad():
        tuned._prefill(ids, cache)
    sizes = tuned._mask_sizes(cache, mask_2d, prompt, NEW)
    assert sizes and len({size for size in sizes.values() if size}) == 2  # a sliding and a full mask
    for late in (0, 1):  # 1: the control, every mask one position late
        agree = []
        for step, masks in enumerate(tuned._masks_at(cache, mask_2d, range(NEW - 1), prompt)):
            for name, mask in masks.items():
                agree.append(torch.equal(mask.flatten(), torch.arange(sizes[name]) <= prompt + step - late))
        assert all(agree) if not late else not all(agree)
    with measure.math_attention():
        expected = decoding.plain_greedy(model, ids, NEW, static_cache=True, keep_logits=True)
        run = tuned.greedy(ids, NEW, keep_logits=True)
    assert run.tokens == expected.tokens and measure.compare_logits(expected.logits, run.logits, NEW)["identical"]


def test_masks_of_another_rule_are_made_ahead_and_still_give_the_same_logits(model, ids, reference, monkeypatch):
    """Where transformers' masks are not ``arange(size) <= position`` (other attention, padding), the step takes
    masks made before the loop: here float masks posing as another rule must make ``_mask_sizes`` give up."""
    expected, steps = reference
    real = decoding.TunedGreedy._masks_at
    monkeypatch.setattr(decoding.TunedGreedy, "_masks_at", lambda self, *a: [
        {k: None if m is None else m.float() for k, m in masks.items()} for masks in real(self, *a)])
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=None, host_free=True))
    cache = tuned.cache(ids.shape[1] + NEW)
    assert tuned._mask_sizes(cache, torch.ones((1, ids.shape[1] + NEW), dtype=torch.long), ids.shape[1], NEW) is None
    monkeypatch.setattr(decoding.TunedGreedy, "_masks_at", real)
    monkeypatch.setattr(decoding.TunedGreedy, "_mask_sizes", lambda self, *a: None)
    with measure.math_attention():
        run = tuned.greedy(ids, NEW, keep_logits=True)
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]


@pytest.mark.parametrize("path", ["position", "ahead"])
def test_masks_one_step_late_are_told_apart(model, ids, reference, monkeypatch, path):
    expected, steps = reference
    if path == "position":
        monkeypatch.setattr(decoding.TunedGreedy, "_graph_masks", lambda self: {
            name: None if arange is None else arange <= self.position.view(1, 1, 1, 1) - 1
            for name, arange in self._mask_aranges.items()})
    else:
        ahead = decoding.TunedGreedy._masks_ahead

        def late(self, cache, mask_2d, positions, start):
            masks = ahead(self, cache, mask_2d, positions, start)
            return masks[:1] + masks[:-1]  # every step after the first gets the previous step's masks

        monkeypatch.setattr(decoding.TunedGreedy, "_mask_sizes", lambda self, *a: None)
        monkeypatch.setattr(decoding.TunedGreedy, "_masks_ahead", late)
    with measure.math_attention():
        run = decoding.TunedGreedy(model, decoding.Decoder(compile=None, host_free=True)).greedy(ids, NEW, keep_logits=True)
    assert not measure.compare_logits(expected.logits, run.logits, steps)["identical"]


def test_the_host_free_loop_reads_nothing_on_the_host_and_the_current_step_reads_every_token(model, ids):
    # the control: today's step reads each token (and transformers reads each step's masks) on the host
    forward = model.forward
    today = decoding.loop_host_reads(model, ids, decoding.Decoder(compile="cudagraphs"), NEW)
    host_free = decoding.loop_host_reads(model, ids, decoding.Decoder(compile="cudagraphs", host_free=True), NEW)
    assert today >= NEW - 1
    assert host_free <= 3  # before the loop, the prompt's smallest and largest id; after it, the tokens
    assert model.forward == forward and "forward" not in model.__dict__  # the count leaves the model as it was


def test_the_host_free_step_hands_sdpa_additive_masks_so_no_layer_converts_its_own(model, ids, reference):
    """sdpa turns a boolean mask into 0/-inf in every layer (three kernels each on a GPU); the step makes each mask
    that way once. Counted against the same step with boolean masks, and the logits stay identical."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Conversions(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Conversions.count += func is torch.ops.aten.where.self
            return func(*args, **(kwargs or {}))

    expected, steps = reference
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=None, host_free=True))
    assert tuned._mask_values is not None  # tiny's attention is sdpa
    counts, runs = {}, {}
    for additive in (True, False):
        if not additive:
            tuned._mask_values = None  # the control: the boolean masks, converted by sdpa in each layer
        Conversions.count = 0
        with Conversions(), measure.math_attention():
            runs[additive] = tuned.greedy(ids, NEW, keep_logits=True)
        counts[additive] = Conversions.count
    masks = sum(arange is not None for arange in tuned._mask_aranges.values())
    layers = model.config.get_text_config().num_hidden_layers
    assert masks >= 1 and counts[False] - counts[True] == (NEW - 1) * (layers - masks)
    for run in runs.values():
        assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]


@pytest.mark.parametrize("settings", [dict(compile="eager"), dict(compile="reduce-overhead"), dict(ple_outside=False)])
def test_host_free_with_a_compiler_or_the_rows_inside_is_refused_in_one_sentence(settings):
    """reduce-overhead would capture Inductor's own graphs around a step whose token never leaves the GPU; the
    course's graph takes Inductor's kernels instead (compile="inductor")."""
    with pytest.raises(InvalidChoiceError, match="host_free=True.*compile='inductor'"):
        decoding.Decoder(host_free=True, **settings)


def test_inductor_compiles_the_whole_host_free_step_and_the_courses_graph_runs_what_it_returns(model, ids, reference,
                                                                                              monkeypatch):
    """``Decoder(host_free=True, compile="inductor")``: torch.compile gets the host-free step itself (its token, rows
    and masks traced with the model, in one graph) and StepGraphs runs the compiled step. Here Dynamo's trace runs
    on its eager backend, so the logits must stay identical; Inductor's own kernels, which round differently, are
    held to the rounding rule on the GPU (tests/gpu/test_tuned_paths_gpu.py)."""
    compiled, compile = [], torch.compile

    def traced_eagerly(fn, **options):
        compiled.append((fn, options))
        return compile(fn, **{**options, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", traced_eagerly)
    expected, steps = reference
    with measure.math_attention():
        tuned = decoding.TunedGreedy(model, decoding.Decoder(compile="inductor", host_free=True))
        run = tuned.greedy(ids, NEW, keep_logits=True)
    assert [(fn.__func__, options["backend"], options["fullgraph"]) for fn, options in compiled] == [
        (decoding.TunedGreedy._host_free_forward, "inductor", True)]
    assert tuned.graphs.forward is not tuned._host_free_forward  # the graph runs the compiled step, not the plain one
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"] and run.tokens == expected.tokens


def test_fused_norms_take_every_norm_of_each_decode_step_and_none_of_the_prefill_or_of_generate(model, ids, reference,
                                                                                               monkeypatch):
    """``Decoder(fused_norms=True)`` puts the one-kernel norms in only around the decode loop: the prefill and a later
    ``generate`` keep the model's own. On the CPU the kernel cannot run, so its call is counted and answered with the
    eager norm; the GPU tier and the probe check its bits."""
    from helpers import exact_norm

    calls = []

    def counted(x, weight32, eps, **kwargs):
        calls.append(tuple(x.shape))
        squares = x.float().pow(2)
        normed = x.float() * torch.pow(squares.mean(-1, keepdim=True) + eps, -0.5)
        return (normed * weight32 if weight32 is not None else normed).type_as(x)

    monkeypatch.setattr(exact_norm, "is_decode_input", lambda x: x.dim() >= 3 and x.shape[:2] == (1, 1))
    monkeypatch.setattr(exact_norm, "fused_rms_norm", counted)
    expected, steps = reference
    norms = sum(type(m).__name__ == exact_norm.NORM_CLASS for m in model.modules())
    with measure.math_attention():
        tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=None, host_free=True, fused_norms=True))
        assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ == exact_norm.NORM_CLASS)
        run = tuned.greedy(ids, NEW, keep_logits=True)
        after = len(calls)
        decoding.plain_greedy(model, ids, 2, static_cache=True)  # the control: generate after it fuses nothing
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ == exact_norm.NORM_CLASS)
    assert after == len(calls) and after % (NEW - 1) == 0 and 0 < after // (NEW - 1) <= norms
    assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]


def test_fused_norms_with_a_compiler_are_refused_in_one_sentence():
    with pytest.raises(InvalidChoiceError, match="fused_norms=True"):
        decoding.Decoder(compile="reduce-overhead", fused_norms=True)
