"""The memory planner: resident and peak GPU memory for a config, a quantization, a PLE placement
and a context length, before anything is loaded; and whether that fits a learner's card.

  weights      counted from the meta model (``helpers.weights``): exact, no measurement needed
  KV cache     counted from the config: only the layers that own a cache (the last
               num_kv_shared_layers reuse earlier ones), sliding layers capped at the window
  activations  what a prefill holds beside weights and cache. Not derivable from the config to
               10% (kernels, masks and temporaries decide it), so it is measured: the benchmark's
               memory grid fits  c0 + a*n + b*n^2  per architecture and quantization
               (python -m helpers.planner calibrate  ->  data/planner/activations.json)
  logits       generate() keeps the last position only (inside c0); a plain forward over the whole
               prompt keeps n x vocab of them, which predict(all_logits=True) adds
  training     predict_training(config, sequence=N): one LoRA step with gradient checkpointing. From the
               shapes: weights, adapters, their gradients and optimizer state, the layer inputs checkpointing
               keeps, the logits and the loss. Measured: recomputing a layer and its backward pass (masks, the
               PLE inputs' graph), fitted like the activations from the GPU tier's fine-tuning records
               (python -m helpers.planner calibrate  ->  data/planner/training.json). The peak is the larger
               of two moments: the loss, or the backward pass through the layers
  chunked      predict(prefill_chunk=N, path=...): a prefill in chunks of N tokens holds the activations of
               one chunk (the measured profile at N) plus what grows with the whole context while a chunk
               runs, derived from the shapes transformers uses (``chunked_prefill_terms``): on the plain
               path a copy of one full-attention layer's keys and values per query head (``repeat_kv``),
               the concatenated history of that layer (``DynamicLayer``'s ``torch.cat``) and the boolean
               mask; on the tuned path (``helpers.long_context``) the mask alone. Not yet checked on a GPU.

    python -m helpers.planner predict google/gemma-4-E4B-it
"""

from __future__ import annotations

import functools
import gc
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .cards import CARDS, LEARNER_CARDS, SYSTEM_RAM_ALLOWANCE_BYTES, budget_bytes
from .errors import (
    CourseError,
    InvalidChoiceError,
    NoRecordError,
    RecordFileError,
    brief,
    require_bool,
    require_choice,
    require_module_names,
    require_number,
    require_positive_number,
    require_whole_number,
)
from .fine_tuning import ADAM_STATE_BYTES, LOSS_CHUNK, RANK, adapter_shapes
from .long_context import CACHE_KINDS, DEFAULT_CHUNK
from .models import load_config as _load_config
from .models import requested, smaller_siblings
from .paths import PLANNER_DIR, write_text_atomically
from .placement import PLACEMENTS, human_bytes
from .quantization import QUANTS
from .records import Table, fine_tuning_records, gpu_tier_host, latest_records, preset_records, read_json
from .weights import GPU_HEADROOM_BYTES, WeightEstimate, meta_model, weight_bytes

CALIBRATION = PLANNER_DIR / "activations.json"
TRAINING_CALIBRATION = PLANNER_DIR / "training.json"
HOST_CALIBRATION = PLANNER_DIR / "host.json"
# GPU-tier routes with host memory records, and whether each copies the PLE table into process memory
HOST_ROUTES = {"ple-gpu": False, "ple-cpu": False, "post-load": True}

# (not head_dim: transformers 5.2x saves per-layer head widths differently from 5.5-5.1x)
ARCHITECTURE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "hidden_size_per_layer_input", "vocab_size")
# bitsandbytes 4-bit layers dequantize to the compute dtype, so fp4 computes like nf4
ACTIVATION_PROFILE_OF_QUANT = {"bf16": "bf16", "nf4": "nf4", "fp4": "nf4", "int8": "int8"}
# The seed issue (transformers, "Gemma-4-E4B: the PLE table holds ~5.6 GB of VRAM..."), quoted:
# RTX A5000 16 GB laptop, NF4 with the PLE-path modules and the towers kept in bf16.
SEED_ISSUE = {"gpu": {"resident_gb": 10.11, "peak_8500": "OOM at 15.5 GB"}, "cpu": {"resident_gb": 4.48, "peak_8500": "11.84 GB"}}
# the towers by full prefix: a bare "vision_tower" matches nothing (transformers' should_convert_module)
SEED_KEEP_BF16 = ("per_layer_model_projection", "per_layer_input_gate", "per_layer_projection",
                  "model.vision_tower", "model.audio_tower")


@functools.lru_cache(maxsize=32)
def _named_config(name: str):
    return _load_config(name)


def load_config(config):
    """The config of a name, folder, hub id or config object; a name is read once per process (the planner asks
    for the same few thousands of times)."""
    return _named_config(config) if isinstance(config, str) else _load_config(config)


def text_config_of(config):
    """The text config of a config object, or of a name, folder or hub id (read through ``load_config``)."""
    if not hasattr(config, "to_dict"):
        config = load_config(config)
    return getattr(config, "text_config", None) or config


def config_values(config) -> dict:
    """The text config as saved (recent transformers refuse per-layer attributes such as head_dim
    read globally; the saved values are the same in every version)."""
    return text_config_of(config).to_dict()


def architecture_key(config) -> str:
    """What decides the activation profile: the text model's widths and depths."""
    values = config_values(config)
    return " ".join(f"{key}={values.get(key)}" for key in ARCHITECTURE_KEYS)


PATHS = ("plain", "tuned")  # a chunked prefill as generate runs it / with helpers.long_context.LongContext()


@dataclass(frozen=True)
class KVRates:
    """Keys and values per token of the layers that own a cache: full-attention layers grow with the context,
    sliding ones stop at the window."""
    full_per_token: int
    sliding_per_token: int
    window: int

    def bytes(self, context: int) -> int:
        context = require_whole_number(context, "context", minimum=0, unit="tokens")
        return self.full_per_token * context + self.sliding_per_token * min(context, self.window)


def kv_rates(config, bytes_per_value: int = 2) -> KVRates:
    """``KVRates`` of a config (read once: a planner bisection asks for thousands of contexts)."""
    bytes_per_value = require_whole_number(bytes_per_value, "bytes_per_value", unit="bytes")
    values = config_values(config)
    layer_types = list(values["layer_types"])
    owners = len(layer_types) - (values.get("num_kv_shared_layers") or 0)
    full = sliding = 0
    for kind, (heads, width) in zip(layer_types[:owners], _kv_heads_and_widths(config)):
        if kind == "full_attention":
            full += 2 * heads * width * bytes_per_value
        else:
            sliding += 2 * heads * width * bytes_per_value
    return KVRates(full, sliding, values["sliding_window"])


@functools.lru_cache(maxsize=32)
def _named_kv_rates(name: str) -> KVRates:
    return kv_rates(load_config(name))


def kv_cache_bytes(config, context: int, bytes_per_value: int = 2, cache: str = "dynamic") -> int:
    """Bytes of keys and values after a prefill of ``context`` tokens (bf16 cache). Only the layers that own
    a cache count. ``cache="dynamic"`` (what ``generate`` builds): sliding layers counted at the window, one
    token more than ``DynamicSlidingWindowLayer`` keeps (an upper bound); ``cache="static"``
    (``StaticCache(max_cache_len=context)``): sliding layers hold exactly the window, full layers ``context``. Both
    come to the same count: the window for each sliding layer."""
    require_choice(cache, CACHE_KINDS, "cache")
    return kv_rates(config, bytes_per_value).bytes(context)


def chunked_prefill_terms(config, context: int, chunk: int, path: str = "plain", bytes_per_value: int = 2) -> dict:
    """What grows with the whole context while one chunk of a chunked prefill runs, beside the cache itself
    (term -> bytes), from the shapes transformers hands to attention (``long_context.attention_calls``):
    the largest full-attention layer's keys and values copied per query head by ``repeat_kv`` and its history
    concatenated anew by ``DynamicLayer.update`` (plain path only), and the boolean chunk x context mask."""
    require_choice(path, PATHS, "path")
    context = require_whole_number(context, "context", unit="tokens")
    chunk = require_whole_number(chunk, "chunk", unit="tokens")
    bytes_per_value = require_whole_number(bytes_per_value, "bytes_per_value", unit="bytes")
    values = config_values(config)
    full = [(heads, width) for kind, (heads, width) in zip(values["layer_types"], _kv_heads_and_widths(config))
            if kind == "full_attention"]
    heads, width = max(full, key=lambda hw: hw[0] * hw[1]) if full else (0, 0)
    terms = {"attention mask (chunk x context, bool)": min(chunk, context) * context}
    if path == "plain":
        query_heads = values["num_attention_heads"]
        terms["keys and values copied per query head (repeat_kv)"] = (
            2 * query_heads * width * context * bytes_per_value if query_heads > heads else 0)
        terms["history concatenated anew (DynamicLayer torch.cat)"] = 2 * heads * width * context * bytes_per_value
    return terms


def _kv_heads_and_widths(config) -> list:
    """(key/value heads, head width) per layer: from the per-layer configs where transformers has
    them (5.2x), else from the global values (full-attention layers use global_head_dim)."""
    per_layer = getattr(text_config_of(config), "per_layer_config", None)
    if per_layer:
        return [(layer.num_key_value_heads, layer.head_dim) for layer in per_layer]
    values = config_values(config)
    full_width = values.get("global_head_dim") or values["head_dim"]
    return [(values["num_key_value_heads"], full_width if kind == "full_attention" else values["head_dim"])
            for kind in values["layer_types"]]


def logits_bytes(config, positions: int, bytes_per_value: int = 2) -> int:
    """Logits over the whole vocabulary for ``positions`` positions (bf16, before any upcast)."""
    positions = require_whole_number(positions, "positions", minimum=0)
    bytes_per_value = require_whole_number(bytes_per_value, "bytes_per_value", unit="bytes")
    return positions * text_config_of(config).vocab_size * bytes_per_value


def _read_calibration(path, what: str, measured_by: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise NoRecordError(f"No {what} at {path}: run `python -m helpers.planner calibrate` after `{measured_by}` on a GPU.")
    return read_json(path)


def load_calibration(path=CALIBRATION) -> dict:
    return _read_calibration(path, "planner calibration", "make bench PRESET=memory")


@dataclass
class ActivationProfile:
    c0: float
    per_token: float
    per_token_squared: float
    measured_on: str
    exact: bool  # False: borrowed from another architecture and scaled

    def bytes(self, context: int) -> float:
        require_number(context, "context")
        return self.c0 + self.per_token * context + self.per_token_squared * context**2


def activation_profile(config, quant: str, calibration: dict | None = None) -> ActivationProfile:
    calibration = calibration or load_calibration()
    profile_name = ACTIVATION_PROFILE_OF_QUANT[quant]
    measured = {key: entry for key, entry in calibration["architectures"].items() if profile_name in entry["profiles"]}
    return profile_of(config, measured, lambda entry: entry["profiles"][profile_name])


def profile_of(config, architectures: dict, fit_of) -> ActivationProfile:
    """The fit ``fit_of(entry)`` of the config's own architecture in ``architectures`` (keyed by
    ``architecture_key``); else the nearest measured one's, scaled by hidden width x depth (a rough guide)."""
    config = load_config(config)  # a name, folder or hub id too; anything else gets load_config's sentence
    key = architecture_key(config)
    if key in architectures:
        fit = fit_of(architectures[key])
        return ActivationProfile(fit["c0"], fit["per_token"], fit["per_token_squared"], architectures[key]["model"], True)
    text = text_config_of(config)
    size = text.hidden_size * text.num_hidden_layers
    nearest = min(architectures.values(), key=lambda a: abs(math.log(a["hidden_size"] * a["num_hidden_layers"] / size)))
    fit = fit_of(nearest)
    scale = size / (nearest["hidden_size"] * nearest["num_hidden_layers"])
    return ActivationProfile(fit["c0"] * scale, fit["per_token"] * scale, fit["per_token_squared"],
                             f"{nearest['model']} (scaled x{scale:.2f})", False)


@dataclass
class MemoryEstimate:
    """What ``predict`` returns: GPU bytes after load and at the peak of a prefill, term by term."""
    model: str
    quant: str
    ple: str
    context: int
    resident_bytes: int
    peak_bytes: int
    cpu_bytes: int
    terms: dict  # term -> bytes on the GPU at the peak
    weights_by_part: dict
    activations_from: str
    prefill_chunk: int | None = None  # None: the prefill is one forward
    path: str = "plain"

    def __str__(self) -> str:
        how = "" if self.prefill_chunk is None else f" in chunks of {self.prefill_chunk:,} ({self.path} path)"
        lines = [f"{self.model}, {self.quant}, PLE on {self.ple}, {self.context:,}-token prefill{how}:",
                 f"  resident {self.resident_bytes / 1e9:6.2f} GB   peak {self.peak_bytes / 1e9:6.2f} GB   "
                 f"(PLE table on CPU: {self.cpu_bytes / 1e9:.2f} GB)"]
        lines += [f"    {term:<34} {size / 1e9:6.2f} GB" for term, size in self.terms.items()]
        lines.append(f"  activations measured on {self.activations_from}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def predict(config, quant: str = "nf4", ple: str = "cpu", context: int = 8500, keep_bf16=(), *,
            double_quant: bool = False, all_logits: bool = False, calibration: dict | None = None,
            prefill_chunk: int | None = None, path: str = "plain", towers: str = "gpu",
            head: str = "tied") -> MemoryEstimate:
    """Predict resident and peak GPU memory without loading weights.

    ``config``: a config object, a synthetic name ("e4b-shape"), a folder or a hub id.
    ``keep_bf16``: module names bitsandbytes should leave unquantized (as ``llm_int8_skip_modules``).
    ``all_logits``: the prefill is a plain forward that keeps logits for every position
    (``generate`` keeps only the last one).
    ``prefill_chunk``: the prefill runs in chunks of this many tokens (``generate(prefill_chunk_size=...)``);
    ``path``: ``"plain"`` (generate's own cache and attention) or ``"tuned"`` (``long_context.LongContext``).
    ``towers``, ``head``: as in ``loading.load_model`` (the towers and the token table off the GPU)."""
    require_choice(quant, QUANTS, "quant")
    require_choice(path, PATHS, "path")
    if path == "tuned" and prefill_chunk is None:
        prefill_chunk = DEFAULT_CHUNK
    if prefill_chunk is not None:
        prefill_chunk = require_whole_number(prefill_chunk, "prefill_chunk", unit="tokens")
    require_choice(ple, PLACEMENTS, "ple")
    keep_bf16 = require_module_names(keep_bf16)
    require_bool(double_quant, "double_quant")
    require_bool(all_logits, "all_logits")
    label = config if isinstance(config, str) else None
    config = load_config(config)
    context = require_context(config, context)
    if label is not None:  # names are stable: build each meta model once per process
        weights = _named_weight_bytes(label, quant, ple, tuple(keep_bf16), double_quant, towers, head)
    else:
        weights = weight_bytes(meta_model(config), quant=quant, ple=ple, keep_bf16=keep_bf16, double_quant=double_quant,
                               towers=towers, head=head)
    profile = activation_profile(config, quant, calibration)
    by_part = weights.by_course_part()
    terms = {f"weights: {part}": size for part, size in sorted(by_part.items(), key=lambda kv: -kv[1])}
    terms["KV cache"] = kv_cache_bytes(config, context, cache="static" if path == "tuned" else "dynamic")
    if prefill_chunk is None:
        terms["activations (measured profile)"] = int(profile.bytes(context))
    else:
        terms["activations of one chunk (measured profile)"] = int(profile.bytes(min(prefill_chunk, context)))
        terms.update(chunked_prefill_terms(config, context, prefill_chunk, path))
    if all_logits:
        terms["logits for every position"] = logits_bytes(config, context)
    name = label or getattr(config, "_name_or_path", "") or getattr(text_config_of(config), "model_type", "model")
    return MemoryEstimate(model=str(name), quant=quant, ple=ple, context=context, resident_bytes=weights.gpu_bytes,
                          peak_bytes=int(sum(terms.values())), cpu_bytes=weights.cpu_bytes, terms=terms,
                          weights_by_part=by_part, activations_from=profile.measured_on, prefill_chunk=prefill_chunk,
                          path=path)


def require_context(config, context) -> int:
    """A prompt length the model can take: a whole number of tokens up to its ``max_position_embeddings``."""
    window = text_config_of(config).max_position_embeddings
    return require_whole_number(context, "context", minimum=1, maximum=window, unit="tokens",
                                maximum_is="the model's max_position_embeddings")


@functools.lru_cache(maxsize=64)
def _named_weight_bytes(name: str, quant: str, ple: str, keep_bf16: tuple, double_quant: bool, towers: str = "gpu",
                        head: str = "tied") -> WeightEstimate:
    return weight_bytes(meta_model(load_config(name)), quant=quant, ple=ple, keep_bf16=keep_bf16, double_quant=double_quant,
                        towers=towers, head=head)


def largest_true(low: int, high: int, predicate, resolution: int = 512):
    """The largest value in [low, high] (to ``resolution``) where a monotone ``predicate`` holds;
    None if it fails already at ``low``. The benchmark bisects real prefills with it; the planner
    its own prediction."""
    low = require_whole_number(low, "low", minimum=0)
    high = require_whole_number(high, "high", minimum=low)
    resolution = require_whole_number(resolution, "resolution")
    if not callable(predicate):
        raise InvalidChoiceError(f"predicate={brief(predicate)} is not a function; pass one that takes a value and "
                                 "answers True or False.")
    if not predicate(low):
        return None
    if predicate(high):
        return high
    while high - low > resolution:
        middle = (low + high) // 2
        low, high = (middle, high) if predicate(middle) else (low, middle)
    return low


@dataclass
class CardVerdict:
    card_gb: float
    loads: bool
    fits: bool  # the requested context prefills and decodes, with the safe margin
    max_context: int | None  # the largest context that does, with the typical margin (None: does not even load)
    estimate: MemoryEstimate
    safe_context: int | None = None  # the same with the largest margin any measured card needed
    # the same with no margin: what the card holds if the caching allocator wastes nothing between blocks
    # (PYTORCH_ALLOC_CONF=expandable_segments:True comes close: freed pages join one growing segment)
    unfragmented_context: int | None = None

    def __str__(self) -> str:
        if not self.loads:
            return f"{self.card_gb:g} GB: does not load (weights {self.estimate.resident_bytes / 1e9:.2f} GB)"
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{self.card_gb:g} GB: loads; a {self.estimate.context:,}-token prefill {verdict}; "
                f"largest context about {self.max_context:,} tokens, {self.safe_context:,} to be safe")


def fits(config, card_gb: float, quant: str = "nf4", ple: str = "cpu", context: int = 8500, keep_bf16=(), *,
         calibration: dict | None = None, prefill_chunk: int | None = None, path: str = "plain", towers: str = "gpu",
         head: str = "tied") -> CardVerdict:
    """Does the model load on a card of ``card_gb`` GB (what the allocator may use), does a
    ``context``-token prefill fit, and what is the largest context that does?

    Beside the predicted peak, the caching allocator needs room for fragmentation: a fraction of
    the transient memory, measured on the simulated cards. ``max_context`` uses the median of those
    fractions (``allocator_reserve``), ``safe_context`` and ``fits`` the largest
    (``allocator_reserve_worst``): under a cap the reachable context is step-like, and a promise
    a card cannot keep costs an out-of-memory error, not a few tokens. ``prefill_chunk`` and ``path``: as
    in ``predict`` (a chunked prefill, plain or tuned)."""
    require_positive_number(card_gb, "card_gb")
    calibration = calibration or load_calibration()
    estimate = predict(config, quant, ple, context, keep_bf16, calibration=calibration,  # a name keeps its cache
                       prefill_chunk=prefill_chunk, path=path, towers=towers, head=head)
    prefill_chunk = estimate_chunk(estimate)
    kv = _named_kv_rates(config) if isinstance(config, str) else None
    config = load_config(config)
    card = card_gb * 1e9
    loads = estimate.resident_bytes + GPU_HEADROOM_BYTES <= card
    if not loads:
        return CardVerdict(card_gb, False, False, None, estimate)
    profile = activation_profile(config, quant, calibration)
    kv = kv or kv_rates(config)  # the same bytes for a dynamic and a static cache (kv_cache_bytes)

    def transient(n: int) -> float:
        if prefill_chunk is None:
            return profile.bytes(n) + kv.bytes(n)
        return profile.bytes(min(prefill_chunk, n)) + kv.bytes(n) + sum(chunked_prefill_terms(config, n, prefill_chunk, path).values())

    def fits_in_card(n: int, reserve: float) -> bool:
        return estimate.resident_bytes + (1 + reserve) * transient(n) <= card

    def largest(reserve: float):
        return largest_true(1, text_config_of(config).max_position_embeddings,
                            lambda n: fits_in_card(n, reserve), resolution=1)

    worst = calibration.get("allocator_reserve_worst", calibration["allocator_reserve"])
    return CardVerdict(card_gb, True, fits_in_card(context, worst), largest(calibration["allocator_reserve"]), estimate,
                       safe_context=largest(worst), unfragmented_context=largest(0.0))


def estimate_chunk(estimate: MemoryEstimate) -> int | None:
    """The prefill chunk an estimate was made for (None: one forward)."""
    return estimate.prefill_chunk


def decode_bytes_per_token(config, quant: str = "nf4", ple: str = "cpu", context: int = 32) -> int:
    """What one decode step must read from GPU memory at least: every GPU weight the text model uses (the
    towers idle; a PLE table on the GPU gives one row) and the keys and values of ``context`` positions.
    A card's memory bandwidth divided by this is the fastest decode it can reach at batch 1."""
    context = require_whole_number(context, "context", minimum=0, unit="tokens")
    estimate = predict(config, quant, ple, 1)
    idle = ("vision tower", "audio tower", "PLE table")
    weights = sum(size for part, size in estimate.weights_by_part.items() if part not in idle)
    return int(weights + kv_cache_bytes(load_config(config), context))


@dataclass(frozen=True)
class DecodeRange:
    """What one recorded decode step would give on a learner's card, batch 1."""
    card: str
    slowest_tokens_per_s: float  # the card reads the bytes, then the step's other time is added in full
    fastest_tokens_per_s: float  # the other time hidden behind the reading: the card's bandwidth alone
    bound: str  # "bandwidth" or "latency": the larger share of a token's time on this card

    def speeds(self) -> str:
        """The range and what bounds it, as the card tables show it."""
        return f"{self.slowest_tokens_per_s:.0f}-{self.fastest_tokens_per_s:.0f} tokens/s, {self.bound}-bound"

    def __str__(self) -> str:
        return f"{self.card}: {self.speeds()}"


DECODE_RECORD_KEYS = ("decode_tokens_per_s", "bytes_read_per_token", "copy_bandwidth_bytes_per_s")


def decode_range(record: dict, card) -> DecodeRange:
    """A card's decode speed from one recorded run (``make bench`` writes the three ``DECODE_RECORD_KEYS``). Each
    token the card reads the record's bytes at its bandwidth (``cards.Card``); the step's other time is the
    recorded time per token less the recording GPU's reading time at its measured copy bandwidth (host work,
    launches, kernels that wait). It may hide behind the reading or add to it: the two ends of the range. The other
    time was the recording machine's, whose host may be faster than a laptop's."""
    missing = [key for key in DECODE_RECORD_KEYS if not record.get(key)]
    if missing:
        raise RecordFileError(f"This decode record has no {missing[0]}: take one from `make bench PRESET=decode-speed` "
                          f"(records.preset_records('decode-speed')), which measures all of {', '.join(DECODE_RECORD_KEYS)}.")
    reading_there = record["bytes_read_per_token"] / record["copy_bandwidth_bytes_per_s"]
    other = max(1 / record["decode_tokens_per_s"] - reading_there, 0.0)
    reading_here = record["bytes_read_per_token"] / (card.bandwidth_gb_s * 1e9)
    return DecodeRange(card.name, 1 / (reading_here + other), 1 / max(reading_here, other),
                       "bandwidth" if reading_here >= other else "latency")


DECODE_CARDS = ("RTX 4060", "RTX 4050 Laptop", "RTX 3060", "Colab T4", "RTX 3090")  # from small laptop to large desktop


def decode_on_cards(steps: dict) -> Table:
    """Each recorded decode step (name -> record) carried to learners' cards by ``decode_range``: one row per card of
    ``DECODE_CARDS``, one column per step; steps missing a ``DECODE_RECORD_KEYS`` figure are left out."""
    if not isinstance(steps, dict) or not all(isinstance(record, dict) for record in steps.values()):
        raise InvalidChoiceError(f"steps={type(steps).__name__} is not a dict of step name -> decode record; pass e.g. "
                                 f"{{'cudagraphs': records.preset_records('decode-goal')['cudagraphs']}}.")
    steps = {name: record for name, record in steps.items() if all(record.get(key) for key in DECODE_RECORD_KEYS)}
    by_name = {card.name: card for card in LEARNER_CARDS}
    rows = tuple((f"{name} ({by_name[name].bandwidth_gb_s:g} GB/s)",
                  *(decode_range(record, by_name[name]).speeds() for record in steps.values()))
                 for name in DECODE_CARDS) if steps else ()
    return Table(("card", *steps), rows, "derived by planner.decode_range from the recorded bytes per token and speed")


def recorded_decode_on_cards(preset: str = "decode-goal", modes: tuple = ("cudagraphs", "host-free-fused-cache")) -> Table:
    """``decode_on_cards`` for ``modes`` of one recorded decode preset (empty where it has not run)."""
    if not isinstance(modes, tuple) or not all(isinstance(mode, str) for mode in modes):
        raise InvalidChoiceError(f"modes={modes!r} is not a tuple of mode names; pass e.g. "
                                 f"('cudagraphs', 'host-free-fused-cache').")
    run = preset_records(preset)
    unknown = [mode for mode in modes if run and mode not in run]
    if unknown:
        raise InvalidChoiceError(f"{unknown[0]!r} is not a mode of the recorded {preset} run; choose among "
                                 f"{', '.join(run)}.")
    return decode_on_cards({mode: run[mode] for mode in modes if mode in run})


def chunked_peaks(contexts, model: str = "e4b-shape", quant: str = "nf4", ple: str = "cpu",
                  prefill_chunk: int = DEFAULT_CHUNK) -> dict:
    """The planner's peak bytes of a chunked prefill on each path: path -> {context: bytes} (notebook 09 and the
    README draw them beside the long-context preset's records)."""
    return {path: {n: predict(model, quant, ple, n, prefill_chunk=prefill_chunk, path=path).peak_bytes for n in contexts}
            for path in PATHS}


def predicted_peak(model: str, quant: str, ple: str, context: int) -> int:
    """The planner's peak bytes for one prefill (what notebook 06 draws beside a measured curve)."""
    return predict(model, quant, ple, context).peak_bytes


def expected_largest_context(model: str, quant: str, ple: str, card_gb: float) -> int | None:
    """The planner's expected largest context on a card (what notebook 06 draws beside a measured bar)."""
    return fits(model, card_gb, quant, ple).max_context


def card_table(config, quant: str = "nf4", context: int = 8500, keep_bf16=(), cards: dict = CARDS) -> list:
    """Rows of (card, placement, verdict) for the course's cards and both PLE placements."""
    calibration = load_calibration()
    return [(name, ple, fits(config, gb, quant, ple, context, keep_bf16, calibration=calibration))
            for name, gb in cards.items() for ple in ("gpu", "cpu")]


@dataclass
class CardTable:
    """``card_table``'s rows as one compact table: a card per row, both placements side by side."""
    rows: list
    context: int

    def cells(self) -> list:
        by_card: dict = {}
        for name, ple, verdict in self.rows:
            if not verdict.loads:
                text = "does not load"
            else:
                text = (f"{'fits' if verdict.fits else 'too long'}; up to {verdict.max_context:,} "
                        f"(safe {verdict.safe_context:,})")
            by_card.setdefault(name, {})[ple] = text
        return [(name, cells.get("gpu", ""), cells.get("cpu", "")) for name, cells in by_card.items()]

    def __str__(self) -> str:
        header = ("card", "PLE on GPU", "PLE on CPU")
        table = [header, *self.cells()]
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
        return "\n".join([f"Prompts of {self.context:,} tokens, and the largest context in tokens:", *lines])

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td style='white-space:nowrap'>{name}</td><td style='white-space:nowrap'>{gpu}</td>"
                       f"<td style='white-space:nowrap'>{cpu}</td></tr>" for name, gpu, cpu in self.cells())
        return (f"<p>Prompts of {self.context:,} tokens, and the largest context in tokens:</p><table><tr><th>card</th>"
                f"<th>PLE on GPU</th><th>PLE on CPU</th></tr>{body}</table>")


def card_summary(config, quant: str = "nf4", context: int = 8500, keep_bf16=(), cards: dict = CARDS) -> CardTable:
    """``card_table`` as one compact table (what notebook 06 shows)."""
    return CardTable(card_table(config, quant, context, keep_bf16, cards), context)


def accelerate_estimate(config, quant: str = "nf4") -> int:
    """What ``accelerate estimate-memory`` would say for the weights: the fp32 total of every
    parameter divided by 2 (float16), 4 (int8) or 8 (int4). It assumes every weight is quantized;
    bitsandbytes quantizes linear layers only, so embeddings and the PLE table stay in bf16."""
    from accelerate.utils import calculate_maximum_sizes

    require_choice(quant, QUANTS, "quant")
    total_bf16, _ = calculate_maximum_sizes(meta_model(load_config(config)))
    divisor = {"bf16": 2, "int8": 4, "nf4": 8, "fp4": 8}[quant]
    return int(total_bf16 * 2 / divisor)


def agreement(records: list, calibration: dict | None = None) -> list:
    """Planner against measurement for every recorded load, prefill and simulated card:
    rows of (what, measured, predicted, relative error)."""
    calibration = calibration or load_calibration()
    rows = []
    for record in records:
        c = record["configuration"]
        if c.get("route") or c.get("path") or c.get("decode") or record.get("resident_bytes") is None:
            continue  # other routes, chunked prefills and decoding modes are not what predict() describes
        name = f"{c['model']} {c['quant']} PLE on {c['ple']}"
        for point in [p for p in record.get("prefill", []) if "peak_bytes" in p]:
            estimate = predict(c["model"], c["quant"], c["ple"], point["context"], calibration=calibration)
            rows.append((f"{name}: peak, {point['context']:,} tokens", point["peak_bytes"], estimate.peak_bytes,
                         estimate.peak_bytes / point["peak_bytes"] - 1))
        estimate = predict(c["model"], c["quant"], c["ple"], 512, calibration=calibration)
        rows.append((f"{name}: resident", record["resident_bytes"], estimate.resident_bytes,
                     estimate.resident_bytes / record["resident_bytes"] - 1))
        if record.get("max_context"):
            verdict = fits(c["model"], c["card_gb"], c["quant"], c["ple"], calibration=calibration)
            rows.append((f"{name}: largest context on {c['card_gb']:g} GB", record["max_context"], verdict.max_context,
                         verdict.max_context / record["max_context"] - 1))
            rows.append((f"{name}: safe context on {c['card_gb']:g} GB", record["max_context"], verdict.safe_context,
                         verdict.safe_context / record["max_context"] - 1))
    return rows


# --- calibration: the measured activation profiles, from the benchmark's records -------------------

def _transient(record, point, config) -> float:
    return point["peak_bytes"] - record["resident_bytes"] - kv_cache_bytes(config, point["context"])


def calibrate(records: list) -> dict:
    """Least-squares fits of the activation term per architecture and quantization (memory preset,
    PLE on CPU: the placement does not change activations), and the allocator reserve that the
    simulated cards' largest contexts imply (median over the cards records)."""
    import numpy as np

    architectures: dict = {}
    configs: dict = {}
    for record in records:
        config_of = record["configuration"]
        if record.get("preset") != "memory" or config_of["ple"] != "cpu" or record.get("resident_bytes") is None:
            continue
        config = configs.setdefault(config_of["model"], load_config(config_of["model"]))
        points = [p for p in record["prefill"] if "peak_bytes" in p]
        n = np.array([p["context"] for p in points], dtype=float)
        y = np.array([_transient(record, p, config) for p in points])
        c0, a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n, n**2], 1), y, rcond=None)[0]
        text = text_config_of(config)
        entry = architectures.setdefault(architecture_key(config), {
            "model": config_of["model"], "hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers,
            "profiles": {}})
        entry["profiles"][config_of["quant"]] = {"c0": round(float(c0)), "per_token": round(float(a), 2),
                                                "per_token_squared": round(float(b), 4),
                                                "contexts": [int(c) for c in n], "recorded_at": record["recorded_at"]}
    calibration = {"architectures": architectures, "allocator_reserve": None}
    reserves = []
    for record in records:
        if record.get("preset") != "cards" or not record.get("max_context"):
            continue
        config = configs.setdefault(record["configuration"]["model"], load_config(record["configuration"]["model"]))
        profile = activation_profile(config, record["configuration"]["quant"], calibration)
        n = record["max_context"]
        transient = profile.bytes(n) + kv_cache_bytes(config, n)
        reserves.append((record["configuration"]["card_gb"] * 1e9 - record["resident_bytes"] - transient) / transient)
    calibration["allocator_reserve"] = round(float(np.median(reserves)), 3) if reserves else 0.0
    calibration["allocator_reserve_worst"] = math.ceil(max(reserves) * 1000) / 1000 if reserves else 0.0  # up: safe
    calibration["source"] = "python -m helpers.planner calibrate (from data/measurements/*.jsonl)"
    return calibration


def holdout(records: list) -> dict:
    """Out-of-sample error: each prefill point predicted by a calibration fitted without it, and each
    card's largest context by an allocator reserve fitted without that card. Returns, per kind,
    (in-sample, out-of-sample) worst relative errors; the in-sample ones are ``agreement``'s."""
    import copy

    inside = agreement(records)
    worst_in = {kind: max(abs(e) for what, _, _, e in inside if kind in what) for kind in ("peak", "largest context")}
    errors = {"peak": [], "largest context": []}
    for index, record in enumerate(records):
        c = record["configuration"]
        if record.get("preset") == "memory" and c["ple"] == "cpu" and record.get("resident_bytes") is not None:
            for point in [p for p in record["prefill"] if "peak_bytes" in p]:
                without = copy.deepcopy(records)
                without[index]["prefill"] = [p for p in record["prefill"] if p is not point and p != point]
                fitted = calibrate(without)
                for other in records:  # the same point on both placements: the profile is shared
                    oc = other["configuration"]
                    if (other.get("preset"), oc["model"], oc["quant"]) != ("memory", c["model"], c["quant"]):
                        continue
                    measured = next((p for p in other["prefill"] if p["context"] == point["context"] and "peak_bytes" in p), None)
                    if measured:
                        predicted = predict(c["model"], c["quant"], oc["ple"], point["context"], calibration=fitted).peak_bytes
                        errors["peak"].append(predicted / measured["peak_bytes"] - 1)
        if record.get("preset") == "cards" and record.get("max_context"):
            fitted = calibrate(records[:index] + records[index + 1:])
            verdict = fits(c["model"], c["card_gb"], c["quant"], c["ple"], calibration=fitted)
            errors["largest context"].append(verdict.max_context / record["max_context"] - 1)
    return {kind: (worst_in[kind], max(abs(e) for e in errors[kind])) for kind in errors}


# --- training: the peak of one LoRA step with gradient checkpointing ------------------------------
#
# The step peaks at one of two moments. At the loss: the layer inputs checkpointing keeps, the final hidden states
# with their gradient, and per logit over the whole vocabulary the bf16 logits (2 bytes), the tanh output the final
# soft-capping keeps for backward (2), the loss's fp32 upcast (4), its log-softmax (4) and the gradient (4); the
# chunked loss (fine_tuning.causal_lm_loss) holds those for one chunk of positions at a time. Or in the backward
# pass through the layers: the kept inputs again, beside one layer recomputed with its gradients, the attention
# masks (n^2) and the PLE inputs' graph. That second part is measured, not derived: least squares of c0 + a*n + b*n^2
# over the steps of tests/gpu/test_fine_tuning_gpu.py whose peak the loss does not explain.
LOGIT_BYTES_PER_VALUE = 16
HIDDEN_AND_GRADIENT_BYTES = 6
ACTIVATION_BYTES = 2  # bf16 activations
ADAPTER_BYTES = 4  # peft keeps the adapters in fp32 (autocast_adapter_dtype)
BACKWARD_TERM = "one layer recomputed, its backward, the masks"  # then (measured), or whose fit it borrows
LOSS_EXPLAINS = 1.05  # a measured step within 5% of the loss's terms peaked at the loss: it says nothing of the backward
AT_THE_LOSS, IN_THE_BACKWARD = "at the loss", "in the backward pass through the layers"


@dataclass
class TrainingEstimate:
    """What ``predict_training`` returns: GPU bytes of the weights and at the peak of one training step, by term
    (the terms every moment holds, then those of the moment that peaks: ``peak_at``)."""
    model: str
    quant: str
    ple: str
    sequence: int
    batch: int
    rank: int
    optimizer: str
    adapter_parameters: int
    resident_bytes: int
    peak_bytes: int
    cpu_bytes: int
    terms: dict
    peak_at: str = AT_THE_LOSS
    other_moment_bytes: int = 0  # the step's GPU bytes at the other moment

    @property
    def context(self) -> int:
        return self.sequence

    def __str__(self) -> str:
        other = IN_THE_BACKWARD if self.peak_at == AT_THE_LOSS else AT_THE_LOSS
        lines = [f"{self.model}, {self.quant}, PLE on {self.ple}, LoRA rank {self.rank} "
                 f"({self.adapter_parameters:,} parameters), {self.optimizer}, batch {self.batch} x {self.sequence:,} tokens:",
                 f"  weights {self.resident_bytes / 1e9:6.2f} GB   training step peak {self.peak_bytes / 1e9:6.2f} GB, "
                 f"{self.peak_at}   (PLE table on CPU: {self.cpu_bytes / 1e9:.2f} GB)",
                 f"  {other}: {self.other_moment_bytes / 1e9:.2f} GB"]
        lines += [f"    {term:<70} {human_bytes(size):>10}" for term, size in self.terms.items()]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


@functools.lru_cache(maxsize=32)
def _named_adapter_shapes(name: str) -> tuple:
    return tuple(adapter_shapes(meta_model(load_config(name))).items())


def load_training_calibration(path=TRAINING_CALIBRATION) -> dict:
    return _read_calibration(path, "training calibration", "GPU_RECORD=1 python -m pytest tests/gpu/test_fine_tuning_gpu.py")


def _kept_inputs_bytes(values: dict, tokens: int) -> int:
    width = values["hidden_size"] + (values.get("hidden_size_per_layer_input") or 0)
    return tokens * values["num_hidden_layers"] * width * ACTIVATION_BYTES


def _loss_terms(values: dict, batch: int, sequence: int, loss_chunk: int | None) -> dict:
    """What the loss holds beside the kept layer inputs, from the shapes."""
    if loss_chunk is None:
        return {"logits, the loss and its gradient": batch * sequence * values["vocab_size"] * LOGIT_BYTES_PER_VALUE}
    return {"final hidden states and their gradient": batch * sequence * values["hidden_size"] * HIDDEN_AND_GRADIENT_BYTES,
            f"logits, loss, gradient: {loss_chunk:,} positions at once":
                batch * min(sequence, loss_chunk) * values["vocab_size"] * LOGIT_BYTES_PER_VALUE}


def backward_profile(config, calibration: dict | None = None) -> ActivationProfile:
    """The measured backward part of a training step (``c0 + a*n + b*n^2`` bytes for n tokens): the architecture's
    own fit, else the nearest measured one scaled by hidden width x depth (a rough guide, ``exact`` False)."""
    calibration = calibration or load_training_calibration()
    architectures = calibration["architectures"]
    if not architectures:
        raise FileNotFoundError("The training calibration holds no architecture: run the fine-tuning GPU test, then "
                                "`python -m helpers.planner calibrate`.")
    return profile_of(config, architectures, lambda entry: entry)


def calibrate_training(records: list) -> dict:
    """Fit the backward part per architecture from fine-tuning records (``tools/fine_tuning_bench.py``): the
    chunked-loss steps whose measured peak, less the resident weights and adapters, their gradients, the optimizer
    state and the kept layer inputs, exceeds what the loss holds by more than ``LOSS_EXPLAINS``."""
    import numpy as np

    points: dict = {}
    for record in records:
        if record.get("loss_chunk") is None:
            continue  # every logit at once: those steps peak at the loss
        config = load_config(record["model"])
        values = config_values(config)
        estimate = predict_training(record["model"], loss_chunk=record["loss_chunk"], calibration=EMPTY_TRAINING)
        beside = estimate.terms["their gradients (fp32)"] + estimate.terms[f"optimizer state ({estimate.optimizer})"]
        entry = points.setdefault(architecture_key(config), {"model": record["model"], "text": text_config_of(config),
                                                             "rows": [], "recorded_at": []})
        entry["recorded_at"].append(record["recorded_at"])
        for row in record["runs"]:
            if row["outcome"] != "trained":
                continue
            n = row["sequence"]
            kept = _kept_inputs_bytes(values, n)
            transient = row["peak_bytes"] - record["resident_bytes"] - beside  # what the step added beside the weights
            if transient > LOSS_EXPLAINS * (kept + sum(_loss_terms(values, 1, n, record["loss_chunk"]).values())):
                entry["rows"].append((n, transient - kept))
    architectures = {}
    for key, entry in points.items():
        n = np.array([r[0] for r in entry["rows"]], dtype=float)
        if len(set(n)) < 3:
            continue  # a quadratic needs three lengths where the backward pass peaks
        y = np.array([r[1] for r in entry["rows"]], dtype=float)
        c0, a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n, n**2], 1), y, rcond=None)[0]
        architectures[key] = {"model": entry["model"], "hidden_size": entry["text"].hidden_size,
                              "num_hidden_layers": entry["text"].num_hidden_layers, "c0": round(float(c0)),
                              "per_token": round(float(a), 2), "per_token_squared": round(float(b), 4),
                              "sequences": sorted({int(v) for v in n}), "recorded_at": max(entry["recorded_at"])}
    return {"architectures": architectures,
            "source": "python -m helpers.planner calibrate (from data/gpu-tier/fine-tuning-*.json)"}


EMPTY_TRAINING = {"architectures": {}}  # the shapes' terms alone: what calibrate_training subtracts


def predict_training(config, quant: str = "nf4", ple: str = "cpu", sequence: int = 512, *, batch: int = 1,
                     rank: int = RANK, optimizer: str = "paged_adamw_8bit",
                     loss_chunk: int | None = LOSS_CHUNK, calibration: dict | None = None) -> TrainingEstimate:
    """Predict the GPU peak of one LoRA training step on ``batch`` sequences of ``sequence`` tokens, gradient
    checkpointing on, without loading weights. ``optimizer``: ``"paged_adamw_8bit"`` (the GPU's) or ``"adamw"``;
    ``loss_chunk``: positions whose logits the loss makes at a time (``fine_tuning.causal_lm_loss``), None for all;
    ``calibration``: the measured backward part (default: data/planner/training.json)."""
    loss_chunk = None if loss_chunk is None else require_whole_number(loss_chunk, "loss_chunk", unit="tokens")
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    require_choice(optimizer, list(ADAM_STATE_BYTES), "optimizer")
    batch = require_whole_number(batch, "batch")
    rank = require_whole_number(rank, "rank")
    label = config if isinstance(config, str) else None
    config = load_config(config)
    sequence = require_context(config, sequence)
    if label is not None:
        weights = _named_weight_bytes(label, quant, ple, (), False)
        shapes = _named_adapter_shapes(label)
    else:
        skeleton = meta_model(config)
        weights = weight_bytes(skeleton, quant=quant, ple=ple)
        shapes = tuple(adapter_shapes(skeleton).items())
    values = config_values(config)
    parameters = sum(rank * (fan_in + fan_out) for _, (fan_in, fan_out) in shapes)
    terms = {f"weights: {part}": size for part, size in sorted(weights.by_course_part().items(), key=lambda kv: -kv[1])}
    terms["LoRA adapters (fp32)"] = parameters * ADAPTER_BYTES
    terms["their gradients (fp32)"] = parameters * ADAPTER_BYTES
    terms[f"optimizer state ({optimizer})"] = parameters * ADAM_STATE_BYTES[optimizer]
    terms["layer inputs kept by checkpointing"] = _kept_inputs_bytes(values, batch * sequence)
    at_the_loss = _loss_terms(values, batch, sequence, loss_chunk)
    calibration = load_training_calibration() if calibration is None else calibration
    if calibration["architectures"]:
        profile = backward_profile(config, calibration)
        term = f"{BACKWARD_TERM} ({'measured' if profile.exact else 'scaled from ' + profile.measured_on.split(' (')[0]})"
        in_the_backward = {term: max(0, int(batch * profile.bytes(sequence)))}
    else:
        in_the_backward = {}
    loss_bytes, backward_bytes = sum(at_the_loss.values()), sum(in_the_backward.values())
    peak_at = AT_THE_LOSS if loss_bytes >= backward_bytes else IN_THE_BACKWARD
    terms |= at_the_loss if peak_at == AT_THE_LOSS else in_the_backward
    name = label or getattr(config, "_name_or_path", "") or "model"
    total = int(sum(terms.values()))
    return TrainingEstimate(str(name), quant, ple, sequence, batch, rank, optimizer, parameters, weights.gpu_bytes,
                            total, weights.cpu_bytes, terms, peak_at, total - abs(loss_bytes - backward_bytes))


def training_fits(config, card_gb: float, quant: str = "nf4", ple: str = "cpu", sequence: int = 512, *,
                  batch: int = 1, rank: int = RANK, calibration: dict | None = None,
                  loss_chunk: int | None = LOSS_CHUNK, training_calibration: dict | None = None) -> CardVerdict:
    """Does a LoRA step on ``sequence`` tokens fit a card of ``card_gb`` GB, and what is the longest sequence that
    does? The same margins as ``fits``: the allocator's reserve on what the step adds beside the weights."""
    require_positive_number(card_gb, "card_gb")
    sequence = require_whole_number(sequence, "sequence", unit="tokens")
    calibration = calibration or load_calibration()
    training_calibration = training_calibration or load_training_calibration()

    def step(n: int) -> TrainingEstimate:
        return predict_training(config, quant, ple, n, batch=batch, rank=rank, loss_chunk=loss_chunk,
                                calibration=training_calibration)

    estimate = step(sequence)
    card = card_gb * 1e9
    if estimate.resident_bytes + GPU_HEADROOM_BYTES > card:
        return CardVerdict(card_gb, False, False, None, estimate)
    longest = text_config_of(load_config(config)).max_position_embeddings

    def fits_in_card(n: int, reserve: float) -> bool:
        at = step(n)
        return at.resident_bytes + (1 + reserve) * (at.peak_bytes - at.resident_bytes) <= card

    def largest(reserve: float):
        return largest_true(1, longest, lambda n: fits_in_card(n, reserve), resolution=64)

    worst = calibration.get("allocator_reserve_worst", calibration["allocator_reserve"])
    return CardVerdict(card_gb, True, fits_in_card(sequence, worst), largest(calibration["allocator_reserve"]), estimate,
                       safe_context=largest(worst), unfragmented_context=largest(0.0))


# --- host memory: what loading and generating take in RAM ------------------------------------------
#
#   anonymous     what a process really owns (Python, torch, the CUDA context's host side, tensors
#                 copied into CPU memory). Measured: a baseline, and what generate adds to it.
#                 offload_ple after loading copies the whole PLE table into it; ple="cpu" from the
#                 first byte does not: on Linux the table stays a view of the memory-mapped
#                 checkpoint (the GPU tier's records show it), read into the page cache row by row.
#   file-backed   the memory-mapped checkpoint while loading: page cache the kernel can drop.

@dataclass
class HostEstimate:
    anon_load_bytes: int
    anon_generate_bytes: int
    file_load_bytes: int
    terms: dict

    def __str__(self) -> str:
        return (f"host memory: {self.anon_load_bytes / 1e9:.2f} GB anonymous after loading, "
                f"{self.anon_generate_bytes / 1e9:.2f} GB while generating; up to {self.file_load_bytes / 1e9:.2f} GB "
                f"of page cache (file-backed, reclaimable) while loading")


def host_records(directory=None) -> list:
    """(route, record) for every GPU-tier route with host memory figures."""
    tier = gpu_tier_host() if directory is None else gpu_tier_host(directory=directory)
    return [(route, record) for route, record in tier.items()
            if route in HOST_ROUTES and record and record.get("host_load_anon_peak_bytes")]


def host_predictions(directory=None):
    """The planner's anonymous host memory while generating beside the GPU tier's measurement, by route: a table."""
    rows = []
    for route, record in host_records(directory):
        estimate = predict_host(record["model"], record["quant"], "cpu" if route == "ple-cpu" else "gpu",
                                offload_after_load=HOST_ROUTES[route])
        rows.append((route, f"{estimate.anon_generate_bytes / 1e9:.2f}", f"{record['host_generate_anon_peak_bytes'] / 1e9:.2f}"))
    return Table(("route", "predicted anonymous, generating (GB)", "measured (GB)"), tuple(rows), "GPU_RECORD=1 make test-gpu-tier")


def calibrate_host(rows: list) -> dict:
    """The baseline anonymous memory of loading (routes that copy nothing into process memory) and
    what generating adds, as medians over the records."""
    import numpy as np

    baseline = [r["host_load_anon_peak_bytes"] for route, r in rows if not HOST_ROUTES[route]]
    increments = [r["host_generate_anon_peak_bytes"] - r["host_load_anon_peak_bytes"] for _, r in rows]
    return {"load_baseline_bytes": int(np.median(baseline)), "generate_increment_bytes": int(np.median(increments)),
            "measured_on": sorted({f"{r['model']} {r['quant']} {route}" for route, r in rows}),
            "source": "python -m helpers.planner calibrate (from the GPU tier's records, data/gpu-tier/)"}


def load_host_calibration(path=HOST_CALIBRATION) -> dict:
    return _read_calibration(path, "host-memory calibration", "GPU_RECORD=1 make test-gpu-tier")


def predict_host(config, quant: str = "nf4", ple: str = "cpu", *, offload_after_load: bool = False,
                 calibration: dict | None = None) -> HostEstimate:
    """Predict the host memory of ``load_model(config, quant, ple)`` (``offload_after_load``: then
    ``offload_ple``), anonymous and file-backed, before anything is loaded."""
    require_bool(offload_after_load, "offload_after_load")
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    calibration = calibration or load_host_calibration()
    label = config if isinstance(config, str) else None
    table = (_named_weight_bytes(label, quant, "cpu", (), False) if label else
             weight_bytes(meta_model(load_config(config)), quant, "cpu")).cpu_bytes
    checkpoint = (_named_weight_bytes(label, "bf16", "gpu", (), False) if label else
                  weight_bytes(meta_model(load_config(config)), "bf16", "gpu")).gpu_bytes  # as stored: bf16
    copied = table if offload_after_load else 0
    terms = {"baseline (Python, torch, CUDA context)": calibration["load_baseline_bytes"],
             "PLE table copied into process memory": copied}
    anon_load = sum(terms.values())
    mapped = checkpoint - (table if ple == "cpu" and not offload_after_load else 0)
    return HostEstimate(anon_load, anon_load + calibration["generate_increment_bytes"], mapped,
                        {**terms, "generating adds": calibration["generate_increment_bytes"]})


def host_fits(estimate: HostEstimate, ram_bytes: float) -> bool:
    """Does the anonymous peak leave the system its share of this machine's RAM?"""
    require_positive_number(ram_bytes, "ram_bytes")
    return estimate.anon_generate_bytes + SYSTEM_RAM_ALLOWANCE_BYTES <= ram_bytes


# --------------------------------------------------------------------------- what a notebook step runs on this card

@dataclass(frozen=True)
class Step:
    """A notebook step that loads a model: what it shows, the setups it can show it with ((quant, ple), or
    (quant, ple, towers, head) for ``load_model``'s switches; the most wanted first), the longest prompt it prefills,
    and modules it keeps in bf16."""
    title: str
    setups: tuple
    context: int = 64
    keep_bf16: tuple = ()
    training: bool = False  # a LoRA training step (predict_training), not a prefill
    model: str | None = None  # a step that always shows this model, whichever the learner chose


# E4B on a 4 GB card: the towers and the token table in host memory, an NF4 output head on the GPU (not the tied
# head's exact logits); for steps about a text conversation, before a smaller sibling is taken
TEXT_ONLY = ("nf4", "cpu", "cpu", "nf4")


def full_setup(setup: tuple) -> tuple:
    """A step's setup as (quant, ple, towers, head): a (quant, ple) pair keeps the towers on the GPU and the head tied."""
    return tuple(setup) if len(setup) == 4 else (*setup, "gpu", "tied")

# Every live step of the notebooks, by notebook: one place for what each needs.
STEPS = {
    "02.converts": Step("what bitsandbytes converts", (("nf4", "gpu"), ("nf4", "cpu"))),
    "02.skip-lists": Step("the llm_int8_skip_modules trials", (("nf4", "cpu"),), keep_bf16=("model.vision_tower",)),
    "02.reference": Step("the bf16 reference the quantized models are compared with", (("bf16", "cpu"),)),
    "03.auto": Step('device_map="auto" with bitsandbytes', (("nf4", "cpu"),)),
    "03.course": Step('load_model(ple="cpu") and its placement report', (("nf4", "cpu"),)),
    "03.cpu-entry": Step('a "cpu" entry in the device map', (("nf4", "cpu"),)),
    "04.anatomy": Step("the loaded model's bytes by device and dtype", (("nf4", "cpu"), TEXT_ONLY)),
    "05.reference": Step("the PLE on the GPU, the reference of the identity check", (("nf4", "gpu"),), context=32 + 256),
    "05.course": Step('the PLE on the CPU with load_model(ple="cpu")', (("nf4", "cpu"),)),
    "05.text-only": Step("the towers and the token table on the CPU too", (("nf4", "cpu", "cpu", "bf16"), TEXT_ONLY),
                         context=32 + 256),
    "06.profile": Step("prefill peaks against the planner", (("nf4", "cpu"), TEXT_ONLY), context=8500),
    "07.chat": Step("chatting with the model", (("nf4", "cpu"), TEXT_ONLY), context=1024),
    "08.transformers": Step("the transformers side of the llama.cpp comparison", (("nf4", "cpu"), TEXT_ONLY), context=64),
    "09.long": Step("long prompts, plain and tuned", (("nf4", "cpu"), TEXT_ONLY), context=8192),
    "09.decode": Step("decoding speed and its profile", (("nf4", "cpu"), TEXT_ONLY), context=32 + 256),
    "09.host-free": Step("the host-free step's host reads and identity", (("nf4", "cpu"),), context=32 + 48, model="tiny"),
    "10.train": Step("LoRA training steps on the copy task", (("nf4", "cpu"),), context=512, training=True),
}
MIN_CONTEXT = 64  # a shorter prompt than this shows nothing a step is about


@dataclass(frozen=True)
class Choice:
    """What a step runs: ``model`` with ``quant`` and ``ple`` on prompts up to ``context`` tokens, or nothing (the
    step shows recorded figures), and the sentence that says why."""
    step: str
    model: str | None
    quant: str | None
    ple: str | None
    context: int | None
    reason: str
    towers: str = "gpu"
    head: str = "tied"

    def __bool__(self) -> bool:
        return self.model is not None

    @property
    def setup(self) -> tuple:
        """(quant, ple, towers, head), as ``full_setup`` spells a step's setups."""
        return self.quant, self.ple, self.towers, self.head

    def __str__(self) -> str:
        return self.reason

    def _repr_pretty_(self, printer, cycle):
        printer.text(self.reason)


def _gpu_budget(device, card_gb) -> float | None:
    """Bytes a load may use: a whole card of ``card_gb``, else what ``device`` has free now under any cap (None: the
    CPU, no GPU limit)."""
    import torch

    if card_gb is not None:
        return require_positive_number(card_gb, "card_gb") * 1e9
    if device is None:
        device = 0 if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return None
    gc.collect()  # a model deleted in a cycle holds its memory until the garbage collector frees it
    return float(budget_bytes(device))


def _host_need(model: str, quant: str, ple: str, on_gpu: bool) -> int:
    """Host memory the load holds while it generates: the calibrated GPU route, or every weight on a CPU."""
    if on_gpu:
        return predict_host(model, quant, ple).anon_generate_bytes
    estimate = _named_weight_bytes(model, quant, ple, (), False) if isinstance(model, str) else weight_bytes(
        meta_model(load_config(model)), quant, ple)
    return estimate.gpu_bytes + estimate.cpu_bytes


def choose(step: str, model=None, device=None, *, card_gb=None, context: int | None = None, ram_bytes=None) -> Choice:
    """What ``step`` (a key of ``STEPS``) runs here: on the card in force (what ``device`` has free now, a simulated
    card's cap included) or, with ``card_gb``, on an empty card of that size. In order: the model itself in each of
    the step's setups, then in them with the longest prompt that fits (at least ``MIN_CONTEXT``), then each smaller
    sibling the same way, else nothing, and the step shows recorded figures. ``context``: the prompt the step prefills,
    where it depends on the model; ``ram_bytes``: the host memory free (default: what the machine has available)."""
    import psutil

    require_choice(step, list(STEPS), "step")
    wanted = STEPS[step]
    context = wanted.context if context is None else require_whole_number(context, "context", minimum=1, unit="tokens")
    name = wanted.model or requested(model)
    budget = _gpu_budget(device, card_gb)
    ram = psutil.virtual_memory().available if ram_bytes is None else require_positive_number(ram_bytes, "ram_bytes")
    candidates = [name, *smaller_siblings(name)]
    calibration = load_calibration()
    first_need = None

    def verdict(candidate, quant, ple, tokens, towers="gpu", head="tied"):
        tokens = min(tokens, text_config_of(load_config(candidate)).max_position_embeddings)
        if budget is None:
            return tokens, None
        if wanted.training:
            found = training_fits(candidate, budget / 1e9, quant, ple, tokens, calibration=calibration)
        else:
            found = fits(candidate, budget / 1e9, quant, ple, tokens, wanted.keep_bf16, calibration=calibration,
                         towers=towers, head=head)
        need = found.estimate.resident_bytes + GPU_HEADROOM_BYTES
        if not found.loads:
            return None, need
        if found.fits:
            return tokens, need
        return (found.safe_context if (found.safe_context or 0) >= MIN_CONTEXT else None), need

    where = "the CPU (no GPU memory limit)" if budget is None else f"{budget / 1e9:.1f} GB free"
    plain_setups = [setup for setup in wanted.setups if full_setup(setup)[2:] == ("gpu", "tied")]
    for candidate in candidates:
        for shorter in (False, True):
            for setup in wanted.setups:
                quant, ple, towers, head = full_setup(setup)
                switches = (towers, head) != ("gpu", "tied")
                if budget is None and switches and plain_setups:
                    continue  # no GPU limit: the towers and the head have no reason to move
                tokens, need = verdict(candidate, quant, ple, context, towers, head)
                first_need = first_need or need
                if tokens is None or (tokens < context) != shorter:
                    continue
                host = _host_need(candidate, quant, ple, budget is not None) + SYSTEM_RAM_ALLOWANCE_BYTES
                if host > ram:
                    continue
                setup = f"{candidate}, {quant}, PLE on {ple}"
                if switches:
                    exact = "the tied head's exact logits" if head == "bf16" else "not the tied head's exact logits"
                    setup += f", towers on the {towers.upper()}, an output head of its own in {head} ({exact})"
                how = f"{setup} ({need / 1e9:.1f} GB with headroom, {where})" if need else f"{setup} on {where}"
                if candidate != name:
                    how += (f": {name} needs {first_need / 1e9:.1f} GB" if first_need else f": {name} does not fit the host's memory")
                    how += f", so {candidate}, the same architecture smaller, runs it"
                if shorter:
                    what = "sequences" if wanted.training else "prompts"
                    how += f", with {what} up to {tokens:,} tokens (a {context:,}-token one does not fit)"
                return Choice(step, candidate, quant, ple, tokens, f"{wanted.title}: {how}.", towers, head)
    quant, ple = wanted.setups[0][:2]
    lacking = (f"{name}, {quant}, PLE on {ple} needs {first_need / 1e9:.1f} GB with headroom and {where}"
               if first_need else f"{name} needs more host memory than the {ram / 1e9:.1f} GB available")
    others = f" (nor does {', '.join(candidates[1:])}, the same architecture smaller)" if candidates[1:] else ""
    return Choice(step, None, None, None, None,
                  f"{wanted.title} does not run live here: {lacking}{others}; the recorded figures show it.")


@dataclass
class CoursePlan:
    """``choose`` for every step of the course on one card: what runs live, and what is shown from records."""
    card: str
    choices: list

    def rows(self) -> list:
        return [(choice.step, STEPS[choice.step].title, _runs(choice) if choice else "from records")
                for choice in self.choices]

    def __str__(self) -> str:
        width = max(len(title) for _, title, _ in self.rows())
        return "\n".join([f"On {self.card}:", *(f"  {step:<16} {title:<{width}}  {what}" for step, title, what in self.rows())])

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td>{step}</td><td>{title}</td><td>{what}</td></tr>" for step, title, what in self.rows())
        return f"<p>On {self.card}:</p><table><tr><th>step</th><th>what it shows</th><th>runs</th></tr>{body}</table>"


def _runs(choice: Choice) -> str:
    switches = "" if (choice.towers, choice.head) == ("gpu", "tied") else f", towers on {choice.towers}, {choice.head} head"
    what = "sequences" if STEPS[choice.step].training else "prompts"
    return f"{choice.model}, {choice.quant}, PLE on {choice.ple}{switches}, {what} up to {choice.context:,} tokens"


def course_plan(model=None, device=None, *, card_gb=None, ram_bytes=None) -> CoursePlan:
    """What every live step of the course runs on this card (or an empty card of ``card_gb``): 00_setup shows it."""
    budget = _gpu_budget(device, card_gb)
    card = ("the CPU" if budget is None else f"a {card_gb:g} GB card" if card_gb is not None
            else f"this GPU ({budget / 1e9:.1f} GB free)")
    return CoursePlan(card, [choose(step, model, device, card_gb=card_gb, ram_bytes=ram_bytes) for step in STEPS])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The memory planner's calibration and predictions.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("calibrate", help="fit the activation and training profiles (data/measurements, data/gpu-tier) into data/planner/")
    plan = sub.add_parser("predict", help="predict resident and peak memory, and the cards it fits")
    plan.add_argument("config", help="synthetic name, folder or hub id")
    plan.add_argument("--quant", default="nf4")
    plan.add_argument("--context", type=int, default=8500)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except CourseError as err:  # bad input: its sentence, not a traceback
        print(err, file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "calibrate":
        calibration = calibrate(latest_records())
        CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(CALIBRATION, json.dumps(calibration, indent=1, sort_keys=True) + "\n")
        write_text_atomically(HOST_CALIBRATION, json.dumps(calibrate_host(host_records()), indent=1, sort_keys=True) + "\n")
        training = calibrate_training(fine_tuning_records())
        write_text_atomically(TRAINING_CALIBRATION, json.dumps(training, indent=1, sort_keys=True) + "\n")
        print(f"wrote {CALIBRATION} ({len(calibration['architectures'])} architectures, "
              f"allocator reserve {calibration['allocator_reserve']:.1%}, worst {calibration['allocator_reserve_worst']:.1%})")
        return 0
    for ple in ("gpu", "cpu"):
        print(predict(args.config, args.quant, ple, args.context))
        print("  " + str(predict_host(args.config, args.quant, ple)))
    for name, ple, verdict in card_table(args.config, args.quant, args.context):
        print(f"{name:<18} PLE on {ple}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
