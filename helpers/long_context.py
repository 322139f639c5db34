"""Long prompts on a small card with transformers' own machinery: chunked prefill, a cache whose sliding
layers keep only the window, and attention that does not copy the keys and values for every query head.

What grows with the prompt while ``generate(..., prefill_chunk_size=N)`` runs (transformers 5.5.2,
5.17.0 and 5.24.0 read the same way here):

  the cache        ``generate`` builds ``DynamicCache(config=text_config)``: sliding layers become
                   ``DynamicSlidingWindowLayer`` and keep ``sliding_window - 1`` tokens, full-attention
                   layers ``DynamicLayer`` and keep every token. Only a ``DynamicCache()`` *without* the
                   config keeps every token in every layer (``CACHE_KINDS``, ``footprint``).
  per chunk        each full-attention layer's ``DynamicLayer.update`` concatenates (``torch.cat``) its
                   whole history with the chunk, a second copy of that layer while it runs; SDPA gets a
                   boolean mask of chunk x context entries; and ``sdpa_attention_forward`` copies keys
                   and values for every query head (``repeat_kv``) whenever a mask is passed, which is
                   every chunk after the first (``attention_calls`` shows what attention is handed).

The tuned path (``LongContext``) keeps the cache and drops the copies: a ``StaticCache`` (sliding layers
``StaticSlidingWindowLayer`` of the window, full layers preallocated and written in place, no cat), and
``grouped_sdpa`` (registered through transformers' ``AttentionInterface``), which calls SDPA once per query
head with a view of its key/value head instead of a copy. Same logits: ``tests/test_long_context.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass

import torch

from .errors import (
    InvalidChoiceError,
    brief,
    require_bool,
    require_choice,
    require_model,
    require_positive_number,
    require_whole_number,
)

# generate's own cache; the same without the config (every layer keeps every token); preallocated, written in place
CACHE_KINDS = ("dynamic", "dynamic-without-config", "static")
GROUPED_SDPA = "course_grouped_sdpa"
DEFAULT_CHUNK = 2048  # the prefill chunk of the recorded H200 long-context runs


def text_config_of(model):
    require_model(model)
    return model.config.get_text_config()


def cache_argument(model) -> str:
    """The name ``forward`` and ``generate`` take the cache under: ``cache`` from transformers 5.2x,
    ``past_key_values`` before (older releases swallow the other name silently)."""
    require_model(model)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model, kind: str = "static", max_cache_len: int | None = None):
    """A fresh cache of one of ``CACHE_KINDS`` for ``model`` (a static cache needs its length: prompt + new tokens)."""
    from transformers import DynamicCache, StaticCache

    require_choice(kind, CACHE_KINDS, "cache")
    if kind == "dynamic":
        return DynamicCache(config=text_config_of(model))
    if kind == "dynamic-without-config":
        return DynamicCache()
    if max_cache_len is None:
        raise InvalidChoiceError("A static cache is preallocated: pass max_cache_len, the prompt length plus the new tokens.")
    limit = text_config_of(model).max_position_embeddings
    max_cache_len = require_whole_number(max_cache_len, "max_cache_len", maximum=limit, unit="tokens",
                                         maximum_is="the model's max_position_embeddings")
    return StaticCache(config=text_config_of(model), max_cache_len=max_cache_len)


def require_prompt(model, ids, new_tokens: int = 0) -> torch.Tensor:
    """``ids`` if they are one prompt the model can read: a (1, n) integer tensor, n at least 1, each id in its
    vocabulary, the prompt and ``new_tokens`` within its positions; one sentence otherwise."""
    text = text_config_of(model)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InvalidChoiceError(f"ids={shape} is not one prompt of token ids; pass a (1, n) integer tensor, as "
                                 f"tokenizer(text, return_tensors='pt')['input_ids'] gives.")
    if ids.shape[0] != 1:
        raise InvalidChoiceError(f"The decode runs batch 1; got a batch of {ids.shape[0]}: pass one prompt.")
    if ids.shape[1] == 0:
        raise InvalidChoiceError("ids is an empty prompt; pass at least one token (the tokenizer's bos_token_id).")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= text.vocab_size:
        raise InvalidChoiceError(f"ids holds {low if low < 0 else high}, outside the vocabulary of {text.vocab_size:,}: "
                                 f"tokenize with this model's own tokenizer.")
    written, limit = positions_written(ids.shape[1], new_tokens), text.max_position_embeddings
    if written > limit:
        raise InvalidChoiceError(
            f"A prompt of {ids.shape[1]:,} tokens and {new_tokens:,} new ones needs {written:,} positions, more than the "
            f"model's max_position_embeddings of {limit:,}: shorten the prompt to at most "
            f"{longest_prompt(limit, min(new_tokens, limit)):,} tokens (long_context.longest_prompt).")
    return ids


def require_chunk(chunk) -> int | None:
    """A prefill chunk: ``None`` (the whole prompt at once) or a whole number of tokens, at least 1."""
    return None if chunk is None else require_whole_number(chunk, "chunk", unit="tokens")


def require_cache(cache, what: str = "cache"):
    """``cache`` if it is a transformers cache (what ``new_cache`` returns)."""
    from transformers import Cache

    if not isinstance(cache, Cache):
        raise InvalidChoiceError(f"{what}={brief(cache)} is not a transformers cache; pass one that long_context.new_cache returned.")
    return cache


def require_footprint_rows(rows) -> list:
    """``rows`` if they are a list of ``LayerFootprint`` (what ``footprint`` returns)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, (list, tuple)) or not all(
            isinstance(row, LayerFootprint) for row in rows):
        raise InvalidChoiceError(f"rows={rows!r:.40} is not a list of LayerFootprint; pass what long_context.footprint returned.")
    return list(rows)


def positions_written(context: int, new_tokens: int) -> int:
    """How many positions ``generate`` writes to the cache: the prompt and every new token but the last, which
    is only predicted, never fed back (transformers sizes its own static cache ``max_length - 1``). So a
    prompt of the model's whole ``max_position_embeddings`` still gets one new token."""
    context = require_whole_number(context, "context", unit="tokens")
    new_tokens = require_whole_number(new_tokens, "new_tokens", minimum=0, unit="tokens")
    return context + max(new_tokens - 1, 0)


def longest_prompt(max_positions: int, new_tokens: int) -> int:
    """The longest prompt whose ``new_tokens`` still fit in ``max_positions`` (``positions_written`` inverted)."""
    max_positions = require_whole_number(max_positions, "max_positions", unit="positions")
    new_tokens = require_whole_number(new_tokens, "new_tokens", minimum=0, maximum=max_positions, unit="tokens",
                                      maximum_is="a prompt needs one position of its own")
    return max_positions - max(new_tokens - 1, 0)


# --------------------------------------------------------------------------- what a cache holds

@dataclass(frozen=True)
class LayerFootprint:
    layer: int
    layer_type: str  # sliding_attention / full_attention, from the config
    cache_class: str  # what transformers built for it
    tokens: int  # positions its keys hold (a static layer: all it has allocated)
    bytes: int  # keys and values


def footprint(cache, config) -> list:
    """What each cache layer holds right now. KV-shared layers own no cache (transformers 5.24 keeps
    a ``DummyLayer`` for them, earlier releases nothing) and are left out."""
    require_cache(cache)
    if not isinstance(getattr(config, "layer_types", None), (list, tuple)):
        raise InvalidChoiceError(f"config={type(config).__name__} has no layer_types; pass the model's "
                                 f"config.get_text_config().")
    layer_types = list(config.layer_types)
    rows = []
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            continue
        rows.append(LayerFootprint(index, layer_types[index], type(layer).__name__, keys.shape[-2],
                                   keys.nbytes + values.nbytes))
    return rows


def narrow_window(cache, by: int = 1):
    """A deliberately broken cache, for controls: every sliding layer keeps ``by`` token(s) fewer than the window
    its attention reads. Call it on a fresh cache, before it holds anything."""
    require_cache(cache)
    by = require_whole_number(by, "by", unit="tokens")
    for layer in cache.layers:
        if hasattr(layer, "sliding_window"):  # DynamicSlidingWindowLayer
            layer.sliding_window -= by
            layer._sliding_window_tensor = torch.tensor(layer.sliding_window, dtype=torch.long)
        elif hasattr(layer, "cumulative_length_int"):  # StaticSlidingWindowLayer, before its lazy allocation
            layer.max_cache_len -= by
    return cache


def bytes_by_layer_type(rows) -> dict:
    rows = require_footprint_rows(rows)
    totals: dict = {}
    for row in rows:
        totals[row.layer_type] = totals.get(row.layer_type, 0) + row.bytes
    return totals


def tokens_by_layer_type(rows) -> dict:
    """The largest number of positions any layer of each type holds."""
    rows = require_footprint_rows(rows)
    held: dict = {}
    for row in rows:
        held[row.layer_type] = max(held.get(row.layer_type, 0), row.tokens)
    return held


def generated_cache(model, ids: torch.Tensor, kind: str, chunk: int | None, new_tokens: int = 1):
    """Run ``generate`` on ``ids`` with a cache of ``kind`` and ``prefill_chunk_size=chunk``; the cache it leaves."""
    require_model(model)
    require_choice(kind, CACHE_KINDS, "cache")
    chunk = require_chunk(chunk)
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    require_prompt(model, ids, new_tokens)
    cache = new_cache(model, kind, ids.shape[1] + new_tokens if kind == "static" else None)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk,
                       **{cache_argument(model): cache})
    return cache


def cache_growth(model, prompts, kind: str = "dynamic", chunk: int | None = None) -> list:
    """Cache bytes and positions per layer type after a ``generate`` prefill of each prompt in ``prompts``
    (token-id tensors of growing length): the rows a learner plots against context. Every argument is
    checked before the first prompt runs."""
    require_model(model)
    require_choice(kind, CACHE_KINDS, "cache")
    chunk = require_chunk(chunk)
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidChoiceError(f"prompts={type(prompts).__name__} is not a list of prompts; pass a non-empty list of "
                                 f"(1, n) token-id tensors, one per context length.")
    for ids in prompts:
        require_prompt(model, ids, 1)
    config = text_config_of(model)
    rows = []
    for ids in prompts:
        held = footprint(generated_cache(model, ids, kind, chunk), config)
        rows.append({"context": ids.shape[1], "cache": kind, "bytes": bytes_by_layer_type(held),
                     "tokens": tokens_by_layer_type(held)})
    return rows


# --------------------------------------------------------------------------- what attention is handed

@dataclass(frozen=True)
class AttentionCall:
    query_heads: int
    key_heads: int  # as many as query_heads in a grouped-query model: repeat_kv copied them
    queries: int
    keys: int
    key_value_bytes: int  # keys + values handed to this call
    mask_bytes: int  # 0 without a mask


class AttentionRecorder(torch.overrides.TorchFunctionMode):
    """Records the shapes and bytes of every ``scaled_dot_product_attention`` call made while it is active."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query, key, value = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append(AttentionCall(query.shape[1], key.shape[1], query.shape[2], key.shape[2],
                                            key.nbytes + value.nbytes, 0 if mask is None else mask.nbytes))
        return func(*args, **kwargs)


def attention_calls(model, ids: torch.Tensor, chunk: int, settings: LongContext | None = None) -> list:
    """Every SDPA call of one chunked-prefill ``generate`` (one new token): plain (``settings=None``:
    generate's own cache and attention) or with the tuned ``settings``."""
    require_model(model)
    chunk = require_whole_number(chunk, "chunk", unit="tokens")
    if settings is not None and not isinstance(settings, LongContext):
        raise InvalidChoiceError(f"settings={settings!r:.40} is not a LongContext; pass LongContext(...) or None.")
    require_prompt(model, ids, 1)
    settings = settings or LongContext(chunk=chunk, cache="dynamic", grouped_attention=False)
    with use_attention(model, settings.attention):
        recorder = AttentionRecorder()
        with recorder, torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                           do_sample=False, **settings.generate_kwargs(model, ids.shape[1], 1))
    return recorder.calls


# --------------------------------------------------------------------------- attention without repeat_kv

def grouped_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except where it would copy keys and values for every query head
    (``repeat_kv``: a grouped-query layer given more than one query position). There it calls SDPA once
    per query head, with a view of the key/value head that head reads: no copy, the same arithmetic per head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.shape[2] == 1 or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    one_head = types.SimpleNamespace(is_causal=getattr(module, "is_causal", True), training=False)
    outputs = []
    for head in range(query.shape[1]):
        group = head // groups  # query heads h*groups .. h*groups+groups-1 read key/value head h (repeat_kv's order)
        output, _ = sdpa_attention_forward(one_head, query[:, head:head + 1], key[:, group:group + 1],
                                           value[:, group:group + 1], attention_mask, **kwargs)
        outputs.append(output)  # (batch, queries, 1, head_dim)
    return torch.cat(outputs, dim=2), None


def register_grouped_sdpa(name: str = GROUPED_SDPA, function=grouped_sdpa_attention_forward) -> str:
    """Register ``function`` with transformers' ``AttentionInterface`` under ``name``, with SDPA's masks
    (``AttentionMaskInterface``: an unregistered name would get no mask at all)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidChoiceError(f"name={name!r} is not supported; pass a non-empty name such as {GROUPED_SDPA!r}.")
    if not callable(function):
        raise InvalidChoiceError(f"function={function!r:.40} is not callable; pass an attention forward such as "
                                 f"long_context.grouped_sdpa_attention_forward.")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])
    return name


def attention_implementations() -> tuple:
    """The names ``use_attention`` takes: transformers' eager attention, every name registered with its
    ``AttentionInterface`` (sdpa, flash and flex attention, kernels), and the course's grouped SDPA."""
    from transformers import AttentionInterface

    return tuple(dict.fromkeys(("eager", "sdpa", *AttentionInterface._global_mapping, GROUPED_SDPA)))


def use_attention(model, implementation: str | None):
    """Switch the text model's attention implementation for a block (``None``: leave it), then switch back.
    The name is checked when called, before the block runs."""
    require_model(model)
    if implementation is not None:
        require_choice(implementation, attention_implementations(), "implementation")
    return _switched_attention(model, implementation)


@contextlib.contextmanager
def _switched_attention(model, implementation: str | None):
    previous = text_config_of(model)._attn_implementation
    if implementation is not None and implementation != previous:
        if implementation == GROUPED_SDPA:
            register_grouped_sdpa()
        try:
            model.set_attn_implementation({"text_config": implementation})
        except (ImportError, ValueError) as error:  # a flash or flex attention this machine cannot run
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidChoiceError(f"implementation={implementation!r} cannot run here ({first.rstrip('.')}); "
                                     f"use 'sdpa' or {GROUPED_SDPA!r}.") from None
    try:
        yield model
    finally:
        if text_config_of(model)._attn_implementation != previous:
            model.set_attn_implementation({"text_config": previous})


# --------------------------------------------------------------------------- the tuned path

@dataclass(frozen=True)
class LongContext:
    """Settings for a long prompt: ``generate``'s ``prefill_chunk_size``, the cache kind, and whether
    attention avoids ``repeat_kv``. ``LongContext()`` is the tuned path; ``LongContext.plain()`` what
    ``generate(prefill_chunk_size=...)`` does on its own."""

    chunk: int | None = DEFAULT_CHUNK
    cache: str = "static"
    grouped_attention: bool = True

    def __post_init__(self):
        if self.chunk is not None:
            require_whole_number(self.chunk, "chunk", unit="tokens")
        require_choice(self.cache, CACHE_KINDS, "cache")
        require_bool(self.grouped_attention, "grouped_attention")

    @classmethod
    def plain(cls, chunk: int | None = DEFAULT_CHUNK) -> LongContext:
        return cls(chunk=chunk, cache="dynamic", grouped_attention=False)

    @property
    def attention(self) -> str | None:
        return GROUPED_SDPA if self.grouped_attention else None

    def generate_kwargs(self, model, context: int, new_tokens: int) -> dict:
        """``generate`` keyword arguments for a prompt of ``context`` tokens and ``new_tokens`` more: the
        chunk size and a fresh cache (passed as an object: ``cache_implementation="static"`` with
        ``prefill_chunk_size`` fails on Gemma 4 in transformers 5.17, see ``tests/test_long_context.py``)."""
        require_model(model)
        written, limit = positions_written(context, new_tokens), text_config_of(model).max_position_embeddings
        if written > limit:
            raise InvalidChoiceError(f"context={context:,} and new_tokens={new_tokens:,} need {written:,} positions, more "
                                     f"than the model's max_position_embeddings of {limit:,}: shorten the prompt.")
        cache = new_cache(model, self.cache, positions_written(context, new_tokens) if self.cache == "static" else None)
        return {"prefill_chunk_size": self.chunk, cache_argument(model): cache}

    def generate(self, model, ids: torch.Tensor, new_tokens: int, *, keep_logits: bool = False, cache=None):
        """Greedy ``generate`` of exactly ``new_tokens`` after ``ids`` with these settings (``cache``: as in
        ``prefill_logits``)."""
        require_model(model)
        new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
        require_prompt(model, ids, new_tokens)
        require_bool(keep_logits, "keep_logits")
        if cache is not None:
            require_cache(cache)
        kwargs = self.generate_kwargs(model, ids.shape[1], new_tokens)
        if cache is not None:
            kwargs[cache_argument(model)] = cache
        with use_attention(model, self.attention), torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, output_logits=keep_logits,
                                  return_dict_in_generate=True, **kwargs)

    def prefill_logits(self, model, ids: torch.Tensor, cache=None) -> torch.Tensor:
        """The logits of every prompt position, computed chunk by chunk through this cache and attention,
        as ``generate``'s chunked prefill runs them (which keeps only the last position's). ``cache``: one
        built beforehand (a test's deliberately broken one), else a fresh one of this kind."""
        require_model(model)
        require_prompt(model, ids)
        if cache is not None:
            require_cache(cache)
        chunk = self.chunk or ids.shape[1]
        if cache is None:
            cache = new_cache(model, self.cache, ids.shape[1] if self.cache == "static" else None)
        with use_attention(model, self.attention), torch.no_grad():
            pieces = [model(input_ids=ids[:, start:start + chunk], use_cache=True, **{cache_argument(model): cache}).logits
                      for start in range(0, ids.shape[1], chunk)]
        return torch.cat(pieces, dim=1)


def logits_agree(reference: torch.Tensor, candidate: torch.Tensor, atol: float = 1e-4) -> dict:
    """fp32 agreement of two computations of the same logits (different summation orders round differently,
    so chunked and one-shot agree to a tolerance, not bit for bit): close, the largest difference, and the
    spread of the reference (what a real error would be compared with)."""
    for what, value in (("reference", reference), ("candidate", candidate)):
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            raise InvalidChoiceError(f"{what}={type(value).__name__} is not a tensor of logits; pass the logits two "
                                     f"computations returned (prefill_logits, a model's .logits).")
    require_positive_number(atol, "atol")
    if reference.shape != candidate.shape:
        return {"close": False, "max_abs_diff": float("inf"), "spread": reference.float().std().item()}
    difference = (reference.float() - candidate.float()).abs().max().item()
    return {"close": difference <= atol, "max_abs_diff": difference, "spread": reference.float().std().item()}
