"""Long prompts with transformers' own machinery (helpers.long_context), on tiny in fp32 on the CPU: what the
cache keeps against context, what attention is handed while a chunk runs, and the tuned path's logits against
one uncached forward, each beside a deliberately broken control that must be told apart."""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Gemma4ForConditionalGeneration

from helpers import long_context, planner
from helpers.errors import CourseError, InvalidChoiceError

SEQUENCE = 48  # six times tiny's sliding window (8): sliding layers really slide, chunks really chain
CHUNK = 12
ATOL = 1e-4  # fp32: chunked and one-shot sum in different orders


@pytest.fixture(scope="module")
def model(tiny_path):
    return Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def window(model):
    return model.config.get_text_config().sliding_window


def token_ids(length=SEQUENCE, seed=2):
    return torch.randint(16, 272, (1, length), generator=torch.Generator().manual_seed(seed))


def uncached_along(model, sequence, start):
    """The logits of each generated step from one full forward per step, no cache at all."""
    with torch.no_grad():
        return torch.stack([model(input_ids=sequence[:, :end]).logits[0, -1] for end in range(start, sequence.shape[1])])


# --------------------------------------------------------------------------- what the cache keeps

def test_generate_keeps_sliding_layers_at_the_window_and_full_layers_at_the_whole_context(model, window):
    rows = long_context.cache_growth(model, [token_ids(n) for n in (16, 48, 96)], "dynamic", chunk=8)
    assert [row["tokens"]["sliding_attention"] for row in rows] == [window - 1] * 3
    assert [row["tokens"]["full_attention"] for row in rows] == [16, 48, 96]
    assert len({row["bytes"]["sliding_attention"] for row in rows}) == 1  # flat: the window, whatever the context


def test_a_dynamic_cache_built_without_the_config_keeps_every_token_in_sliding_layers_too(model):
    rows = long_context.cache_growth(model, [token_ids(n) for n in (16, 48)], "dynamic-without-config", chunk=8)
    assert [row["tokens"]["sliding_attention"] for row in rows] == [16, 48]
    assert rows[1]["bytes"]["sliding_attention"] == 3 * rows[0]["bytes"]["sliding_attention"]


def test_the_static_cache_allocates_exactly_the_window_for_sliding_layers_and_the_planner_counts_every_byte(model, window):
    config = model.config.get_text_config()
    for n in (16, 48):
        held = long_context.footprint(long_context.generated_cache(model, token_ids(n), "static", chunk=8), config)
        assert long_context.tokens_by_layer_type(held) == {"sliding_attention": window, "full_attention": n + 1}
        assert sum(row.bytes for row in held) == planner.kv_cache_bytes(config, n + 1, bytes_per_value=4, cache="static")


def test_the_planners_dynamic_cache_term_is_the_cache_generate_builds_plus_one_token_per_sliding_layer(model):
    config = model.config.get_text_config()
    held = long_context.footprint(long_context.generated_cache(model, token_ids(48), "dynamic", chunk=8), config)
    sliding = [row for row in held if row.layer_type == "sliding_attention"]
    one_token = sum(row.bytes // row.tokens for row in sliding)
    assert planner.kv_cache_bytes(config, 48, bytes_per_value=4) == sum(row.bytes for row in held) + one_token


# --------------------------------------------------------------------------- what attention is handed

def test_plain_chunked_prefill_copies_keys_for_every_query_head_and_the_tuned_path_copies_none(model):
    config = model.config.get_text_config()
    assert config.num_attention_heads > config.num_key_value_heads  # grouped-query attention, as in E4B
    plain = long_context.attention_calls(model, token_ids(64), 16)
    tuned = long_context.attention_calls(model, token_ids(64), 16, long_context.LongContext(chunk=16))
    many_queries = [call for call in plain if call.queries > 1]
    assert any(call.key_heads == config.num_attention_heads for call in many_queries)  # repeat_kv's copies
    assert all(call.key_heads == 1 for call in tuned if call.queries > 1)  # views of one key/value head


def test_the_planners_chunked_prefill_terms_are_what_plain_attention_is_handed_at_the_largest_context(model):
    config = model.config.get_text_config()
    plain = long_context.attention_calls(model, token_ids(64), 16)
    terms = planner.chunked_prefill_terms(config, 64, 16, "plain", bytes_per_value=4)
    assert max(call.key_value_bytes for call in plain) == terms["keys and values copied per query head (repeat_kv)"]
    assert max(call.mask_bytes for call in plain) == terms["attention mask (chunk x context, bool)"]
    assert set(planner.chunked_prefill_terms(config, 64, 16, "tuned")) == {"attention mask (chunk x context, bool)"}


def test_grouped_attention_pairs_each_query_head_with_the_key_value_head_repeat_kv_would_give_it():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, 16, generator=generator) for heads, length in ((4, 6), (2, 10), (2, 10)))
    mask = torch.ones(1, 1, 6, 10, dtype=torch.bool).tril(diagonal=4)
    module = type("Attention", (), {"num_key_value_groups": 2, "is_causal": True, "training": False})()
    stock, _ = sdpa_attention_forward(module, query, key, value, mask)
    grouped, _ = long_context.grouped_sdpa_attention_forward(module, query, key, value, mask)
    assert torch.allclose(grouped, stock, atol=1e-6, rtol=0)
    # the control: query heads paired round-robin (h % 2) instead of in blocks (h // 2) must be told apart
    wrong = torch.cat([sdpa_attention_forward(module, query[:, h:h + 1], key[:, h % 2:h % 2 + 1].expand(1, 2, 10, 16),
                                              value[:, h % 2:h % 2 + 1].expand(1, 2, 10, 16), mask)[0][:, :, :1]
                       for h in range(4)], dim=2)
    assert not torch.allclose(wrong, stock, atol=1e-3, rtol=0)


# --------------------------------------------------------------------------- the tuned path's logits

@pytest.mark.parametrize("settings", [long_context.LongContext(chunk=CHUNK), long_context.LongContext.plain(CHUNK),
                                      long_context.LongContext(chunk=CHUNK, cache="dynamic")], ids=["tuned", "plain", "tuned-dynamic"])
def test_chunked_prefill_gives_the_logits_of_one_uncached_forward_in_fp32(model, settings):
    ids = token_ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    agreement = long_context.logits_agree(reference, settings.prefill_logits(model, ids), ATOL)
    assert agreement["close"], agreement
    assert agreement["spread"] > 1000 * ATOL  # what is compared varies: a wrong result would show


def test_a_sliding_window_one_token_too_small_is_reported_as_different(model):
    ids = token_ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    settings = long_context.LongContext(chunk=CHUNK)
    broken = long_context.narrow_window(long_context.new_cache(model, "static", SEQUENCE))
    agreement = long_context.logits_agree(reference, settings.prefill_logits(model, ids, cache=broken), ATOL)
    assert not agreement["close"] and agreement["max_abs_diff"] > 100 * ATOL, agreement


def test_cached_decoding_after_the_tuned_chunked_prefill_matches_uncached_forwards_and_a_narrow_window_does_not(model):
    ids, new = token_ids(), 8
    settings = long_context.LongContext(chunk=CHUNK)
    out = settings.generate(model, ids, new, keep_logits=True)
    decoded = torch.stack([step[0] for step in out.logits])
    reference = uncached_along(model, out.sequences, SEQUENCE)
    assert long_context.logits_agree(reference, decoded, ATOL)["close"]
    assert len(set(decoded.argmax(-1).tolist())) > 1  # the decoded tokens vary
    narrow = long_context.narrow_window(long_context.new_cache(model, "static", SEQUENCE + new))
    broken = settings.generate(model, ids, new, keep_logits=True, cache=narrow)
    broken_reference = uncached_along(model, broken.sequences, SEQUENCE)
    assert not long_context.logits_agree(broken_reference, torch.stack([step[0] for step in broken.logits]), ATOL)["close"]


def test_the_tuned_path_gives_bit_identical_logits_to_the_plain_chunked_prefill_on_the_cpu(model):
    """Per-head SDPA calls do the same arithmetic as one call over copied heads (CPU kernels; a GPU run records it)."""
    ids = token_ids()
    grouped = long_context.LongContext(chunk=CHUNK, cache="dynamic").prefill_logits(model, ids)
    plain = long_context.LongContext.plain(CHUNK).prefill_logits(model, ids)
    assert torch.equal(grouped, plain)


def test_the_model_gets_its_own_attention_back_after_the_tuned_path_even_when_it_fails(model):
    before = model.config.get_text_config()._attn_implementation
    with pytest.raises(RuntimeError):
        with long_context.use_attention(model, long_context.GROUPED_SDPA):
            assert model.config.get_text_config()._attn_implementation == long_context.GROUPED_SDPA
            raise RuntimeError("boom")
    assert model.config.get_text_config()._attn_implementation == before


def test_a_static_cache_chosen_by_name_with_prefill_chunks_works_on_the_releases_that_read_per_layer_head_widths(model):
    """transformers 5.17's _get_static_cache_init_shape reads text_config.head_dim, which Gemma 4's per-layer
    config refuses (AmbiguousGlobalPerLayerAttributeError); 5.5.2 and 5.24 pass. The course passes a
    StaticCache object, which never takes that path."""
    ids = token_ids(16)

    def by_name():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                  cache_implementation="static", prefill_chunk_size=8)

    version = Version(transformers.__version__)
    if Version("5.17.0") <= version < Version("5.18.0"):
        with pytest.raises(Exception, match="head_dim|per.layer|Ambiguous"):
            by_name()
    else:
        assert by_name().shape[1] == 18
    out = long_context.LongContext(chunk=8).generate(model, ids, 2)
    assert out.sequences.shape[1] == 18


@pytest.mark.parametrize("make, message", [
    (lambda: long_context.LongContext(chunk=0), "whole number"),
    (lambda: long_context.LongContext(chunk=2048.5), "whole number"),
    (lambda: long_context.LongContext(cache="hybrid"), "choose one of"),
    (lambda: long_context.LongContext(grouped_attention="yes"), "True or False"),
    (lambda: long_context.positions_written(0, 3), "context=0"),
    (lambda: long_context.positions_written(4096, -1), "new_tokens=-1"),
    (lambda: long_context.longest_prompt(131072.0, 32), "whole number"),
    (lambda: long_context.longest_prompt(32, 33), "too large"),
])
def test_bad_long_context_settings_are_refused_in_one_sentence(make, message):
    with pytest.raises(CourseError, match=message):
        make()


def test_a_prompt_that_fills_every_position_the_model_has_still_gets_its_new_tokens(model):
    """generate never feeds the last new token back, so a static cache of prompt + new - 1 positions is enough:
    sized prompt + new, the goal's conversation (E4B's whole 131,072 positions) would be refused."""
    positions = model.config.get_text_config().max_position_embeddings
    prompt = long_context.longest_prompt(positions, 3)
    ids = token_ids(prompt, seed=5)
    tuned = long_context.LongContext(chunk=1024).generate(model, ids, 3, keep_logits=True)
    plain = long_context.LongContext.plain(chunk=1024).generate(model, ids, 3, keep_logits=True)
    assert tuned.sequences.shape[1] == positions + 1  # every position written, and one token predicted after them
    for step_tuned, step_plain in zip(tuned.logits, plain.logits, strict=True):
        assert long_context.logits_agree(step_plain, step_tuned)["close"]
    assert not torch.equal(tuned.logits[0], tuned.logits[-1])  # the compared logits vary from step to step
    # the control: the same full-length cache with its sliding window one position too small must be told apart
    narrow = long_context.narrow_window(long_context.new_cache(model, "static", long_context.positions_written(prompt, 3)))
    broken = long_context.LongContext(chunk=1024).generate(model, ids, 3, keep_logits=True, cache=narrow)
    assert not all(long_context.logits_agree(step_plain, step_broken)["close"]
                   for step_broken, step_plain in zip(broken.logits, plain.logits, strict=True))
    with pytest.raises(InvalidChoiceError, match="max_position_embeddings"):  # one prompt token more does not fit
        long_context.LongContext(chunk=1024).generate(model, token_ids(prompt + 1, seed=5), 3)


def test_generate_sizes_its_own_static_cache_as_the_positions_it_writes(model):
    # the rule positions_written follows is transformers' own: its static cache is max_length - 1 long
    ids = token_ids(20, seed=6)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, cache_implementation="static", return_dict_in_generate=True)
    cache = out.past_key_values
    full = next(layer for layer, kind in zip(cache.layers, model.config.get_text_config().layer_types, strict=False)
                if kind == "full_attention")
    assert full.max_cache_len == long_context.positions_written(20, 5) == 24


def test_a_static_cache_needs_its_length_and_a_length_the_model_can_take(model):
    with pytest.raises(CourseError, match="max_cache_len"):
        long_context.new_cache(model, "static")
    with pytest.raises(InvalidChoiceError, match="at most"):
        long_context.new_cache(model, "static", 10**9)
