"""Property-based bad input (hypothesis): each public argument check is fed generated bad values (wrong
types, NaN and infinities, bools posing as numbers, zero, negative and fractional sizes, "yes"/"no" posing
as booleans, empty strings and files) and must answer with one CourseError sentence: never another
exception from deep inside a library, never a silent result. The hand-written battery is
tests/test_bad_inputs.py; these find the cases nobody wrote down. Small budgets: each property runs a
few dozen examples, on a tiny model loaded once."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import itertools
import math
import pkgutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import write_small_gguf

pytest.importorskip("hypothesis", reason="hypothesis is in requirements-dev.txt; the GPU box's wheels carry none")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import decoding, errors, exercises, fine_tuning, gguf_route, long_context, placement, planner, records, synthetic  # noqa: E402,E501
from helpers.errors import CourseError  # noqa: E402

PROPERTY = settings(max_examples=25, deadline=None, database=None)
TINY = synthetic.gemma4_config("tiny").get_text_config()

# ------------------------------------------------------------------ the bad values

NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
YES_AND_NO = st.sampled_from(["yes", "no", "True", "False", "true", "1", "0", "", " ", "none", "8"])
WRONG_TYPES = st.one_of(st.none(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                          max_size=2),
                        st.binary(max_size=4), st.complex_numbers(allow_nan=False, max_magnitude=10),
                        st.just(object()), st.just(torch.ones(2)))
FRACTIONS = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6).filter(lambda x: not x.is_integer())
# a size must be a whole number of at least 1: bools, floats (even 8.0), text and everything else are refused
BAD_SIZES = st.one_of(st.integers(max_value=0), FRACTIONS, st.floats(allow_nan=False).filter(float.is_integer), NOT_FINITE,
                      st.booleans(), YES_AND_NO, WRONG_TYPES.filter(lambda v: v is not None))
BAD_COUNTS = st.one_of(st.integers(max_value=-1), FRACTIONS, NOT_FINITE, st.booleans(), YES_AND_NO,
                       WRONG_TYPES.filter(lambda v: v is not None))  # a count may be 0
BAD_BOOLS = st.one_of(st.integers(), st.floats(), YES_AND_NO, WRONG_TYPES)
BAD_POSITIVE = st.one_of(st.floats(max_value=0), NOT_FINITE, st.booleans(), YES_AND_NO, WRONG_TYPES)


def bad_choice(allowed) -> st.SearchStrategy:
    """Anything but one of ``allowed``: other text (its case changed, padded), numbers, bools, other types."""
    words = [str(a) for a in allowed if a is not None]
    near = st.sampled_from(words).flatmap(lambda w: st.sampled_from([w.upper(), f" {w}", f"{w} ", w + "x", w[:-1]]))
    return st.one_of(st.text(max_size=12), near, st.integers(), st.booleans(), NOT_FINITE, WRONG_TYPES).filter(
        lambda v: not (isinstance(v, str) and v in allowed))


def bad_prompts() -> st.SearchStrategy:
    """Token ids that are no prompt of the tiny model: other types, floats, bools, 1-D or 3-D, a batch of
    several, empty, negative ids, ids past the vocabulary, a prompt longer than its positions."""
    length = st.integers(1, 6)
    return st.one_of(
        st.lists(st.integers(0, 100), max_size=5), WRONG_TYPES.filter(lambda v: not isinstance(v, torch.Tensor)),
        length.map(lambda n: torch.ones(1, n)),  # float
        length.map(lambda n: torch.ones(1, n, dtype=torch.bool)),
        length.map(lambda n: torch.ones(n, dtype=torch.long)),  # 1-D
        length.map(lambda n: torch.ones(1, 1, n, dtype=torch.long)),
        st.integers(2, 4).map(lambda b: torch.ones(b, 3, dtype=torch.long)),  # a batch
        st.just(torch.ones(1, 0, dtype=torch.long)),
        st.integers(-10**6, -1).map(lambda i: torch.tensor([[5, i]])),
        st.integers(TINY.vocab_size, 10**9).map(lambda i: torch.tensor([[i, 5]])),
        st.just(torch.full((1, TINY.max_position_embeddings + 1), 5)),
    )


def refused(call, *args, **kwargs) -> CourseError:
    """The one CourseError sentence ``call`` must answer with; any other exception, or none, fails."""
    with pytest.raises(CourseError) as raised:
        call(*args, **kwargs)
    assert "\n" not in str(raised.value).strip()
    return raised.value


@pytest.fixture(scope="module")
def model(tiny_path):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as path:
        yield Path(path)


GOOD_PROMPT = torch.tensor([[2, 20, 30, 40]])

# ------------------------------------------------------------------ the checks in helpers.errors


@PROPERTY
@given(BAD_SIZES)
def test_a_size_that_is_no_whole_number_of_at_least_one_is_refused(value):
    refused(errors.require_whole_number, value, "size", unit="tokens")


@PROPERTY
@given(BAD_BOOLS)
def test_a_boolean_must_be_true_or_false_not_a_word_or_a_number(value):
    refused(errors.require_bool, value, "flag")


@PROPERTY
@given(BAD_POSITIVE)
def test_a_positive_number_refuses_zero_negatives_infinities_bools_and_text(value):
    refused(errors.require_positive_number, value, "card_gb")


@PROPERTY
@given(bad_choice(("nf4", "int8", "bf16")))
def test_a_choice_outside_the_allowed_ones_is_refused_whatever_its_type(value):
    refused(errors.require_choice, value, ("nf4", "int8", "bf16"), "quant")


@PROPERTY
@given(st.one_of(st.text(), st.integers(), st.lists(st.one_of(st.integers(), st.just("")), min_size=1, max_size=3), st.none()))
def test_module_names_must_be_a_list_of_names_not_a_string_split_into_characters(value):
    refused(errors.require_module_names, value)


def test_the_checks_still_take_good_values():
    # the control: what the course teaches passes every check above
    assert errors.require_whole_number(8, "size") == 8 and errors.require_bool(False, "flag") is False
    assert errors.require_positive_number(7.5, "card_gb") == 7.5 and errors.require_choice("nf4", ("nf4",), "q") == "nf4"
    assert errors.require_module_names(["lm_head"]) == ("lm_head",)


# ------------------------------------------------------------------ long_context


@PROPERTY
@given(BAD_SIZES, bad_choice(long_context.CACHE_KINDS), BAD_BOOLS)
def test_long_context_settings_refuse_each_bad_field(chunk, cache, grouped):
    refused(long_context.LongContext, chunk=chunk)
    refused(long_context.LongContext, cache=cache)
    refused(long_context.LongContext, grouped_attention=grouped)


@PROPERTY
@given(BAD_SIZES, BAD_COUNTS)
def test_position_arithmetic_refuses_bad_sizes(size, count):
    refused(long_context.positions_written, size, 1)
    refused(long_context.positions_written, 8, count)
    refused(long_context.longest_prompt, size, 1)


@PROPERTY
@given(BAD_SIZES)
def test_cache_growth_refuses_a_bad_chunk_before_any_prompt_runs(model, chunk):
    refused(long_context.cache_growth, model, [GOOD_PROMPT], chunk=chunk)


@PROPERTY
@given(bad_prompts())
def test_the_long_context_paths_refuse_what_is_no_prompt_of_the_model(model, ids):
    refused(long_context.LongContext.plain(8).generate, model, ids, 1)
    refused(long_context.LongContext(chunk=8).prefill_logits, model, ids)
    refused(long_context.cache_growth, model, [GOOD_PROMPT, ids])


@PROPERTY
@given(BAD_SIZES, BAD_BOOLS)
def test_generate_refuses_bad_new_tokens_and_keep_logits(model, new_tokens, keep):
    refused(long_context.LongContext(chunk=8).generate, model, GOOD_PROMPT, new_tokens)
    refused(long_context.LongContext(chunk=8).generate, model, GOOD_PROMPT, 1, keep_logits=keep)


@PROPERTY
@given(bad_choice(("eager", "sdpa", long_context.GROUPED_SDPA, "flash_attention_2", "flex_attention")))
def test_use_attention_refuses_a_name_transformers_has_no_attention_for(model, name):
    if name is None or (isinstance(name, str) and name in long_context.attention_implementations()):
        return  # a real implementation, picked by the text strategy
    refused(long_context.use_attention, model, name)


@PROPERTY
@given(BAD_SIZES, bad_choice(long_context.CACHE_KINDS))
def test_a_new_cache_refuses_a_bad_length_and_kind(model, length, kind):
    refused(long_context.new_cache, model, "static", length)
    refused(long_context.new_cache, model, kind)


def test_the_long_context_paths_still_run_a_good_prompt(model):
    # the control beside the refusals
    assert long_context.LongContext(chunk=2).generate(model, GOOD_PROMPT, 2).sequences.shape == (1, 6)
    with long_context.use_attention(model, "eager"):
        assert model.config.get_text_config()._attn_implementation == "eager"


# ------------------------------------------------------------------ gguf_route's readers

def real_gguf(folder: Path) -> bytes:
    path = folder / "real.gguf"
    if not path.exists():
        write_small_gguf(path)
    return path.read_bytes()


COUNTER = itertools.count()


@PROPERTY
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(lambda b: b"GGUF" + b)))
def test_a_file_that_is_no_gguf_is_refused_by_every_reader(folder, data):
    path = folder / f"junk-{next(COUNTER)}.gguf"
    path.write_bytes(data)
    refused(gguf_route.metadata, path)
    refused(gguf_route.tensor, path)


@pytest.mark.skipif(not gguf_route.installed(), reason="llama-cpp-python and gguf are not installed (make llama-cpp)")
@PROPERTY
@given(st.data())
def test_a_gguf_cut_anywhere_is_refused_by_every_reader(folder, data):
    whole = real_gguf(folder)
    cut = data.draw(st.integers(0, len(whole) - 1))
    path = folder / f"cut-{next(COUNTER)}.gguf"
    path.write_bytes(whole[:cut])
    refused(gguf_route.metadata, path)
    refused(gguf_route.tensor, path)
    refused(gguf_route.load, path)


@pytest.mark.skipif(not gguf_route.installed(), reason="llama-cpp-python and gguf are not installed (make llama-cpp)")
def test_the_whole_gguf_is_still_read(folder):
    # the control: the same file uncut reads, so the refusals above are about the cut
    path = folder / "real.gguf"
    real_gguf(folder)
    assert gguf_route.tensor(path)["shape"] == [16, 16] and gguf_route.metadata(path)["architecture"] == "gemma4"


@PROPERTY
@given(st.one_of(WRONG_TYPES, st.just(""), st.just("   ")), BAD_SIZES)
def test_gguf_paths_and_load_options_are_checked_before_llama_cpp_sees_them(folder, path, n_ctx):
    refused(gguf_route.metadata, path)
    refused(gguf_route.load, folder / "never-written.gguf", n_ctx=n_ctx)


# ------------------------------------------------------------------ decoding


@PROPERTY
@given(bad_choice([m for m in decoding.COMPILE_MODES if m]).filter(lambda v: v is not None), BAD_BOOLS, BAD_SIZES)
def test_decoder_settings_refuse_each_bad_field(compile_mode, flag, chunk):
    refused(decoding.Decoder, compile=compile_mode)
    refused(decoding.Decoder, remove_hooks=flag)
    refused(decoding.Decoder, fullgraph=flag)
    refused(decoding.Decoder, chunk=chunk)


@PROPERTY
@given(bad_prompts(), BAD_SIZES, BAD_BOOLS)
def test_plain_greedy_refuses_bad_prompts_lengths_and_flags(model, ids, new_tokens, flag):
    refused(decoding.plain_greedy, model, ids, 1)
    refused(decoding.plain_greedy, model, GOOD_PROMPT, new_tokens)
    refused(decoding.plain_greedy, model, GOOD_PROMPT, 1, static_cache=flag)


@PROPERTY
@given(BAD_SIZES)
def test_profile_refuses_bad_step_counts_before_profiling(folder, steps):
    refused(decoding.profile, lambda: None, folder / "trace.json", steps, "cpu")


# ------------------------------------------------------------------ placement


BAD_DEVICES = st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(), WRONG_TYPES,
                        st.text(max_size=8).filter(lambda s: s not in ("cpu", "cuda") and not s.startswith("cuda:")),
                        st.sampled_from(["mps", "tpu", "cuda:x", "cuda:-1", "CPU", "gpu", "cuda:0 "]))


@PROPERTY
@given(BAD_DEVICES)
def test_a_device_the_course_cannot_run_on_is_refused(value):
    refused(placement.require_device, value)


@PROPERTY
@given(st.one_of(WRONG_TYPES, st.text(max_size=8)))
def test_what_is_no_model_is_refused_by_the_placement_functions(value):
    refused(placement.require_model, value)
    refused(placement.report, value)
    refused(placement.offload_ple, value)


# ------------------------------------------------------------------ planner


@PROPERTY
@given(BAD_SIZES)
def test_the_planner_refuses_a_context_that_is_no_whole_number_of_tokens(context):
    refused(planner.predict, "tiny", context=context)
    refused(planner.fits, "tiny", 8, context=context)


@PROPERTY
@given(BAD_POSITIVE)
def test_the_planner_refuses_a_card_that_is_no_size(card_gb):
    refused(planner.fits, "tiny", card_gb)


@PROPERTY
@given(bad_choice(("nf4", "int8", "bf16")), bad_choice(placement.PLACEMENTS))
def test_the_planner_refuses_an_unknown_quant_and_placement(quant, ple):
    refused(planner.predict, "tiny", quant)
    refused(planner.predict, "tiny", "nf4", ple)


@PROPERTY
@given(bad_choice(tuple(planner.STEPS)))
def test_the_planner_refuses_a_step_it_does_not_know(step):
    refused(planner.choose, step, "tiny", "cpu")


@PROPERTY
@given(BAD_SIZES)
def test_the_training_planner_refuses_a_loss_chunk_that_is_no_whole_number_of_positions(loss_chunk):
    refused(planner.predict_training, "tiny", loss_chunk=loss_chunk)
    refused(planner.training_fits, "tiny", 8, loss_chunk=loss_chunk)


# ------------------------------------------------------------------ the chunked loss and the record readers


def bad_batches() -> st.SearchStrategy:
    """What is no training batch of the tiny model: other types, floats, bools, 1-D or 3-D, one token a row, no rows,
    ids outside the vocabulary, a row longer than its positions."""
    return st.one_of(
        WRONG_TYPES.filter(lambda v: not isinstance(v, torch.Tensor)), st.lists(st.integers(0, 100), max_size=5),
        st.integers(2, 6).map(lambda n: torch.ones(1, n)), st.integers(2, 6).map(lambda n: torch.ones(1, n, dtype=torch.bool)),
        st.integers(2, 6).map(lambda n: torch.ones(n, dtype=torch.long)), st.just(torch.ones(1, 1, 3, dtype=torch.long)),
        st.integers(1, 3).map(lambda b: torch.ones(b, 1, dtype=torch.long)), st.just(torch.ones(0, 4, dtype=torch.long)),
        st.integers(-10**6, -1).map(lambda i: torch.tensor([[5, i]])),
        st.integers(TINY.vocab_size, 10**9).map(lambda i: torch.tensor([[i, 5]])),
        st.just(torch.full((1, TINY.max_position_embeddings + 1), 5)))


@PROPERTY
@given(bad_batches(), BAD_SIZES)
def test_the_chunked_loss_refuses_what_is_no_batch_and_a_chunk_that_is_no_size(model, ids, chunk):
    refused(fine_tuning.causal_lm_loss, model, ids)
    refused(fine_tuning.causal_lm_loss, model, torch.tensor([[2, 20, 30]]), chunk=chunk)
    refused(fine_tuning.causal_lm_loss, model, torch.tensor([[2, 20, 30]]), torch.tensor([[2, 20]]))


@PROPERTY
@given(st.one_of(st.text(max_size=12), WRONG_TYPES))
def test_a_route_the_gpu_tier_did_not_record_is_refused_by_its_readers(route):
    refused(records.gpu_route, route)
    refused(records.decode_speed, route)


def test_the_chunked_loss_and_the_readers_still_take_good_values(model):
    assert torch.isfinite(fine_tuning.causal_lm_loss(model, torch.tensor([[2, 20, 30, 40]]), chunk=2))
    assert records.gpu_route("ple-cpu").resident_bytes > 0 and records.decode_speed("ple-cpu") > 0


LOADED_FIRST = ("model", "processor", "tokenizer", "llm")  # a loaded model, its tokenizer or processor, a llama.cpp model


def takes_a_loaded_model_first() -> list:
    """Every public function of helpers whose first parameter is a loaded object (``LOADED_FIRST``) rather than a
    name: found anew each run, so a function added tomorrow is covered without anyone listing it."""
    import helpers

    found = []
    for info in pkgutil.iter_modules(helpers.__path__):
        module = importlib.import_module(f"helpers.{info.name}")
        for name, function in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            first = next(iter(inspect.signature(function).parameters.values()), None)
            if first is not None and first.name in LOADED_FIRST and "str" not in str(first.annotation):
                found.append(function)
    return found


def call_through(function, first):
    """Call ``function`` with ``first`` and None for its other required arguments, and run what it returns where
    that is a generator or a context manager: its checks run only then."""
    required = [p for p in list(inspect.signature(function).parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    result = function(first, *[None] * len(required))
    if inspect.isgenerator(result):
        next(result)
    elif hasattr(result, "__enter__"):
        with result:
            pass


LOADED_MODEL_FIRST = takes_a_loaded_model_first()


def answered(function, value) -> str:
    try:
        call_through(function, value)
    except CourseError as error:
        return "several lines" if "\n" in str(error).strip() else "clear"
    except Exception as error:  # noqa: BLE001 - what the property must never see
        return f"bare {type(error).__name__}"
    return "silent"


@PROPERTY
@given(st.one_of(WRONG_TYPES.filter(lambda v: v is not None), st.text(max_size=8)))  # None: "the default model"
def test_every_public_function_taking_a_model_refuses_what_is_no_model_before_any_work(value):
    assert len(LOADED_MODEL_FIRST) > 50
    wrong = {f"{f.__module__}.{f.__qualname__}": answered(f, value) for f in LOADED_MODEL_FIRST}
    assert {name: outcome for name, outcome in wrong.items() if outcome != "clear"} == {}


def test_a_function_taking_a_model_still_takes_one():
    # the control: the refusal above is about the value, not about every call
    skeleton = placement.require_model(torch.nn.Linear(2, 2))
    assert placement.modules_named(skeleton, "weight") == [] and placement.bytes_per_device(skeleton, {"": "cpu"})


# ------------------------------------------------------------------ the exercises and the build command


@PROPERTY
@given(bad_choice(tuple(exercises.EXERCISES)))
def test_an_exercise_that_does_not_exist_is_refused(key):
    refused(exercises.check, key, 1)


@PROPERTY
@given(st.integers(max_value=0))
def test_the_build_command_refuses_no_workers_with_exit_status_2(workers):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert synthetic.main(["tiny", "--workers", str(workers)]) == 2
    assert f"workers={workers}" in err.getvalue() and "Traceback" not in err.getvalue()
