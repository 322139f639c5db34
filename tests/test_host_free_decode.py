"""The host-free decode step (``Decoder(host_free=True)``) on tiny on the CPU: the token the step chooses feeds the
next step in place, positions and masks are made before the loop, and nothing in the loop reads a tensor on the
host. The same logits as generate with a static cache, bit for bit, beside a control whose masks are one step
late. The GPU's part (the tables read in place, the graph replays queued without waiting) is measured by make bench."""


import pytest
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
    for run in runs:
        assert measure.compare_logits(expected.logits, run.logits, steps)["identical"]
        assert run.tokens == expected.tokens


def test_masks_made_one_step_late_are_told_apart(model, ids, reference, monkeypatch):
    expected, steps = reference
    ahead = decoding.TunedGreedy._masks_ahead

    def late(self, cache, mask_2d, positions, start):
        masks = ahead(self, cache, mask_2d, positions, start)
        return masks[:1] + masks[:-1]  # every step after the first gets the previous step's masks

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


@pytest.mark.parametrize("settings", [dict(compile="eager"), dict(compile="reduce-overhead"), dict(ple_outside=False)])
def test_host_free_with_a_compiler_or_the_rows_inside_is_refused_in_one_sentence(settings):
    with pytest.raises(InvalidChoiceError, match="host_free=True"):
        decoding.Decoder(host_free=True, **settings)
