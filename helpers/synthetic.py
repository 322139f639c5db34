"""Synthetic Gemma 4 checkpoints: real configs, real tensor names and shapes, random weights.

Memory behaviour depends on shapes, not values, so an E4B-shaped checkpoint gives the real
memory figures on a GPU, and ``tiny`` runs every code path on a CPU in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checksums
from .errors import (
    CourseError,
    DiskFullError,
    InvalidChoiceError,
    SyntheticInitError,
    is_no_room,
    require_bool,
    require_model,
    require_number,
    require_whole_number,
)
from .host_memory import peak_rss_bytes
from .paths import BUILDS_DIR, CONFIG_DIR, cache_dir, cache_subfolder, writable_folder, write_text_atomically

SHAPES = {
    "tiny": "tiny.config.json",
    "e2b-shape": "gemma-4-E2B-it.config.json",
    "e4b-shape": "gemma-4-E4B-it.config.json",
}
COMPLETE_MARKER = "synthetic-checkpoint.json"
DEFAULT_SEED = 0

# The tokenizer is built the way Gemma's own is, so that llama.cpp's converter and tokenizer accept it:
# SentencePiece-style BPE (spaces become "▁" before merging, no word splitting) with byte fallback to
# "<0xNN>" tokens, so every text encodes and decodes exactly; a few letters and merges make the BPE real.
# The vocabulary fills every id up to the config's vocab_size (unused ids as "<unusedN>"), because the
# converter reads ids 0..N-1 in order and llama.cpp wants one token per embedding row.
BYTE_TOKEN_BLOCK_STARTS = (1000, 16)  # first block of 256 free ids that fits the vocabulary
SPACE_PIECE = "\u2581"
BASE_PIECES = (SPACE_PIECE, "\n", *"abcdefghijklmnopqrstuvwxyz")
MERGES = (("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("e", "r"), ("o", "n"), ("a", "n"), ("▁", "a"),
          ("r", "e"), ("▁", "w"), ("e", "s"), ("a", "t"), ("o", "r"), ("e", "n"), ("t", "o"), ("▁", "o"),
          ("▁", "i"), ("i", "s"), ("n", "d"), ("▁", "p"))
# Gemma 4's protocol markers with the ids Google's tokenizer gives them (public copies of its vocabulary agree:
# see data/chat/published-protocol.json). Every shape keeps them there; tiny's 320 ids then hold its specials,
# the 256 byte tokens at the ids left free, and only as many merges as still fit.
PROTOCOL_TOKENS = {"<eos>": 1, "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49,
                   "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52, "<|think|>": 98, "<|channel>": 100,
                   "<channel|>": 101, "<|turn>": 105, "<turn|>": 106}
CHAT_CONTROL_TOKENS = {"think_token": "<|think|>", "soc_token": "<|channel>", "eoc_token": "<channel|>"}
# The published generation_config.json stops at <eos>, <turn|> and <|tool_response>: a model that calls a tool
# writes "<|tool_call>...<tool_call|><|tool_response>" and waits for the caller to run it.
STOP_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")
# Bumped when the tokenizer, chat template or generation config changes: an older build gets new text files
# at its next use.
TEXT_FORMAT = 3

# The course's own template in Gemma 4's turn format, written for the synthetic checkpoints (it is not
# Google's file; tests/test_chat.py checks it against the published versions' recorded renderings):
# a system turn with "<|think|>" when enable_thinking=True, the first system or developer message and the
# tools' declarations ("<|tool>declaration:NAME{...}<tool|>", strings quoted as <|"|>); "<|turn>role ...
# <turn|>" per message with "assistant" spoken as "model", later system messages in place; a model turn's
# tool calls as "<|tool_call>call:NAME{...}<tool_call|>" followed in the same turn by the tool responses
# ("<|tool_response>response:NAME{value:...}<tool_response|>"), or by an open "<|tool_response>" while the
# call waits; a model turn's reasoning replayed only after the last user message; earlier thoughts in a
# reply's text dropped; the generation prompt "<|turn>model\n", none after a tool response (the model goes
# on in its turn) except "<|channel>thought\n" when thinking.
CHAT_TEMPLATE = (
    "{%- macro value(v, quote_keys) -%}"
    "{%- if v is none -%}null{%- elif v is string -%}<|\"|>{{ v }}<|\"|>"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, item in v | dictsort -%}{{ ',' if not loop.first }}"
    "{{ '<|\"|>' + k + '<|\"|>' if quote_keys else k }}:{{ value(item, quote_keys) }}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sequence -%}[{%- for item in v -%}{{ ',' if not loop.first }}{{ value(item, quote_keys) }}{%- endfor -%}]"
    "{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro declaration(f) -%}"
    "declaration:{{ f['name'] }}{description:<|\"|>{{ f['description'] }}<|\"|>"
    "{%- set p = f.get('parameters') -%}{%- if p -%},parameters:{{ '{' }}"
    "{%- if p.get('properties') -%}properties:{{ '{' }}"
    "{%- for name, prop in p['properties'] | dictsort -%}{{ ',' if not loop.first }}{{ name }}:{{ '{' }}"
    "{%- if prop.get('description') -%}description:<|\"|>{{ prop['description'] }}<|\"|>,{%- endif -%}"
    "type:<|\"|>{{ prop['type'] | upper }}<|\"|>}"
    "{%- endfor -%}},{%- endif -%}"
    "{%- if p.get('required') -%}required:[{%- for r in p['required'] -%}{{ ',' if not loop.first }}<|\"|>{{ r }}<|\"|>"
    "{%- endfor -%}],{%- endif -%}"
    "{%- if p.get('type') -%}type:<|\"|>{{ p['type'] | upper }}<|\"|>}{%- endif -%}"
    "{%- endif -%}}"
    "{%- endmacro -%}"
    "{%- macro without_thought(text) -%}"
    "{%- set kept = namespace(text='') -%}"
    "{%- for piece in text.split('<channel|>') -%}{%- set kept.text = kept.text + piece.split('<|channel>')[0] -%}{%- endfor -%}"
    "{{ kept.text | trim }}"
    "{%- endmacro -%}"
    "{%- macro body(content, role) -%}"
    "{%- if content is string -%}{{ without_thought(content) if role == 'model' else content | trim }}"
    "{%- elif content is sequence -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ without_thought(part['text']) if role == 'model' else part['text'] | trim }}"
    "{%- elif part['type'] == 'image' -%}<|image|>{%- elif part['type'] == 'audio' -%}<|audio|>"
    "{%- elif part['type'] == 'video' -%}<|video|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set first_is_system = messages | length > 0 and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set rest = messages[1:] if first_is_system else messages -%}"
    "{%- if thinking or tools or first_is_system -%}"
    "<|turn>system{{ '\\n' }}{{ '<|think|>\\n' if thinking }}"
    "{%- if first_is_system -%}{{ body(messages[0]['content'], 'system') }}{%- endif -%}"
    "{%- for tool in tools or [] -%}<|tool>{{ declaration(tool['function'] if 'function' in tool else tool) }}<tool|>{%- endfor -%}"
    "<turn|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- set last_user = namespace(i=-1) -%}"
    "{%- for m in rest -%}{%- if m['role'] == 'user' -%}{%- set last_user.i = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- set state = namespace(last=None, previous_role=None) -%}"
    "{%- for m in rest -%}{%- if m['role'] != 'tool' -%}"
    "{%- set here = loop.index0 -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{%- set state.last = None -%}"
    "{%- if not (role == 'model' and state.previous_role == 'assistant') -%}<|turn>{{ role }}{{ '\\n' }}{%- endif -%}"
    "{%- set reasoning = m.get('reasoning') or m.get('reasoning_content') -%}"
    "{%- if reasoning and here > last_user.i -%}<|channel>thought{{ '\\n' }}{{ reasoning }}{{ '\\n' }}<channel|>{%- endif -%}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "<|tool_call>call:{{ call['function']['name'] }}{{ '{' }}"
    "{%- for k, v in (call['function']['arguments'] or {}) | dictsort -%}{{ ',' if not loop.first }}"
    "{{ k }}:{{ value(v, false) }}{%- endfor -%}"
    "{{ '}' }}<tool_call|>{%- set state.last = 'tool_call' -%}"
    "{%- endfor -%}"
    "{%- set answered = namespace(any=false, open=true, next_role=None) -%}"
    "{%- for later in rest[here + 1:] -%}"
    "{%- if later['role'] == 'tool' and answered.open and m.get('tool_calls') -%}"
    "{%- set name = namespace(n=later.get('name') or 'unknown') -%}"
    "{%- for call in m['tool_calls'] -%}{%- if call.get('id') and call.get('id') == later.get('tool_call_id') -%}"
    "{%- set name.n = call['function']['name'] -%}{%- endif -%}{%- endfor -%}"
    "{%- set result = later['content'] if later['content'] is string else body(later['content'], 'tool') -%}"
    "<|tool_response>response:{{ name.n }}{value:{{ value(result, false) }}}<tool_response|>"
    "{%- set answered.any = true -%}{%- set state.last = 'tool_response' -%}"
    "{%- elif later['role'] != 'tool' -%}{%- if answered.next_role is none -%}{%- set answered.next_role = later['role'] -%}{%- endif -%}"
    "{%- set answered.open = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set said = body(m.get('content') or '', role) -%}{{ said }}"
    "{%- if state.last == 'tool_call' and not answered.any -%}<|tool_response>"
    "{%- elif role == 'model' and answered.next_role == 'assistant' and (not m.get('tool_calls') or answered.any) -%}"
    "{%- elif not (answered.any and not said | trim and answered.next_role is none) -%}<turn|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- set state.previous_role = m['role'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if state.last not in ['tool_response', 'tool_call'] -%}<|turn>model{{ '\\n' }}"
    "{%- elif state.last == 'tool_response' and thinking -%}<|channel>thought{{ '\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

# The template these checkpoints carried before: turn markers only. It ignores enable_thinking and system
# handling; notebook 07 passes it as "another template" to show what a template that does not read a
# keyword does with it (nothing, silently).
TURNS_ONLY_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'audio' %}<|audio|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def config_dict(shape: str) -> dict:
    """The raw config for a named synthetic shape, as stored in ``data/configs``."""
    if not isinstance(shape, str) or shape not in SHAPES:
        raise InvalidChoiceError(
            f"Unknown synthetic shape {shape!r}; choose one of {', '.join(SHAPES)} or pass a config."
        )
    return json.loads((CONFIG_DIR / SHAPES[shape]).read_text())


def gemma4_config(shape_or_config):
    """A ``Gemma4Config`` from a shape name, a dict, or a config object (returned as is)."""
    from transformers import Gemma4Config, PreTrainedConfig

    if isinstance(shape_or_config, PreTrainedConfig):
        return shape_or_config
    raw = dict(shape_or_config) if isinstance(shape_or_config, dict) else config_dict(shape_or_config)
    return Gemma4Config(**raw)


def config_fingerprint(config) -> str:
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_destination(shape_or_config) -> Path:
    config = gemma4_config(shape_or_config)
    name = shape_or_config if isinstance(shape_or_config, str) else "custom"
    return cache_dir() / "synthetic" / f"{name}-{config_fingerprint(config)}"


def is_complete(path: Path) -> bool:
    """The marker is written last, and atomically: where it exists, every file it lists was whole."""
    return (Path(path) / COMPLETE_MARKER).is_file()


class NotASyntheticCheckpointError(CourseError):
    """A folder without the build's marker, so without recorded checksums."""

    entry = "truncated-or-corrupt-checkpoint"


def verify(folder) -> dict:
    """Check every file of a synthetic checkpoint against the sha256 its build recorded:
    ``{file: "ok" | "missing" | "mismatch"}`` (a flipped byte, a truncated or a deleted file)."""
    folder = Path(folder)
    if not is_complete(folder):
        raise NotASyntheticCheckpointError(
            f"{folder} has no {COMPLETE_MARKER}, so no checksums were recorded for it; verify a synthetic build, "
            f"or a download with download.verify(repo_id, folder).")
    recorded = json.loads((folder / COMPLETE_MARKER).read_text())["sha256"]
    return checksums.compare(folder, {name: checksums.Expected(digest) for name, digest in recorded.items()})


def _special_token_ids(config) -> dict[str, int]:
    text = config.get_text_config()
    eos = text.eos_token_id if isinstance(text.eos_token_id, int) else text.eos_token_id[0]
    top_eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [eos, eos + 1]
    end_of_turn = top_eos[-1]
    return {
        "<pad>": text.pad_token_id,
        "<eos>": eos,
        "<bos>": text.bos_token_id,
        "<unk>": 3,
        "<|turn>": end_of_turn - 1,
        "<turn|>": end_of_turn,
        "<|image>": config.boi_token_id,
        "<image|>": config.eoi_token_id,
        "<|image|>": config.image_token_id,
        "<|audio>": config.boa_token_id,
        "<audio|>": config.eoa_token_id,
        "<|audio|>": config.audio_token_id,
        "<|video|>": config.video_token_id,
    }


def stop_token_ids(config) -> list[int]:
    """The ids the checkpoint's generation config stops at: ``STOP_TOKENS`` in this vocabulary."""
    specials = vocabulary(config)[1]
    return [specials[token] for token in STOP_TOKENS if token in specials]


def _byte_ids(special_ids, vocab_size: int) -> list[int]:
    """256 ids for the byte tokens: the first block of ``BYTE_TOKEN_BLOCK_STARTS`` clear of the specials,
    else the first 256 free ids (tiny, whose specials are spread over its small vocabulary)."""
    taken = set(special_ids)
    for start in BYTE_TOKEN_BLOCK_STARTS:
        block = range(start, start + 256)
        if block.stop <= vocab_size and taken.isdisjoint(block):
            return list(block)
    free = [i for i in range(vocab_size) if i not in taken]
    if len(free) < 256 + len(BASE_PIECES):
        raise InvalidChoiceError(
            f"vocab_size={vocab_size} leaves no room for 256 byte tokens and the letters beside the special tokens; "
            f"use at least 320.")
    return free[:256]


def vocabulary(config) -> tuple[dict[str, int], dict[str, int]]:
    """(every token -> id, the special tokens -> id): the config's special ids, the protocol markers at their
    published ids (a marker whose id the config gives another token goes to the first free id), 256 byte
    tokens, the letters, as many merges as fit, and "<unusedN>" up to ``vocab_size``."""
    vocab_size = config.get_text_config().vocab_size
    specials = _special_token_ids(config)
    for token, i in PROTOCOL_TOKENS.items():
        if token not in specials and i < vocab_size and i not in specials.values():
            specials[token] = i
    for token in (t for t in PROTOCOL_TOKENS if t not in specials):
        specials[token] = next(i for i in range(vocab_size) if i not in specials.values())
    vocab = dict(specials)
    vocab.update({f"<0x{byte:02X}>": i for byte, i in enumerate(_byte_ids(specials.values(), vocab_size))})
    taken = set(vocab.values())
    free_ids = [i for i in range(vocab_size) if i not in taken]
    pieces = [*BASE_PIECES, *("".join(pair) for pair in MERGES)][:len(free_ids)]
    vocab.update(zip(pieces, free_ids))
    vocab.update({f"<unused{n}>": i for n, i in enumerate(free_ids[len(pieces):])})
    return vocab, specials


def kept_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges whose result the vocabulary holds (``MERGES`` in order, so each one's parts exist)."""
    return [pair for pair in MERGES if "".join(pair) in vocab]


def build_tokenizer(config):
    """A Gemma-style tokenizer (SentencePiece-style BPE with byte fallback) whose special tokens sit at
    the ids the config names; llama.cpp's converter and tokenizer read it as they read Gemma 4's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab, specials = vocabulary(config)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=kept_merges(vocab), unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(Regex(" "), SPACE_PIECE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "image_token": "<|image|>",
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "audio_token": "<|audio|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "video_token": "<|video|>",
            "sot_token": "<|turn>",
            "eot_token": "<turn|>",
            **CHAT_CONTROL_TOKENS,
        },
    )


def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        return False
    return True


def save_text_and_media_processors(config, tokenizer, dest: Path) -> bool:
    """Write the tokenizer and, where torchvision exists, the full ``Gemma4Processor``.

    Returns whether the full processor was written. Gemma 4's video processor needs
    torchvision; without it ``AutoProcessor`` cannot be built, but the tokenizer and its
    chat template still serve text-only chat.
    """
    tokenizer.save_pretrained(dest)
    if not torchvision_available() or not getattr(config, "vision_config", None):
        return False
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    soft_tokens = config.vision_config.default_output_length
    processor = Gemma4Processor(
        image_processor=Gemma4ImageProcessor(
            image_seq_length=soft_tokens, max_soft_tokens=soft_tokens, pooling_kernel_size=3, do_normalize=False
        ),
        feature_extractor=Gemma4AudioFeatureExtractor(),
        video_processor=Gemma4VideoProcessor(),
        tokenizer=tokenizer,
        image_seq_length=soft_tokens,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(dest)
    return True


# Tensors are initialised and written one module at a time, never the whole model: an E4B-shaped
# build then needs no GPU and about a gigabyte of host memory per worker. Embedding tables above this
# size (the PLE table is 5.6 GB) are initialised and written in row blocks of it.
EMBEDDING_BLOCK_BYTES = 256 * 1024**2
MAX_SHARD_BYTES = 2 * 10**9  # as save_pretrained(max_shard_size="2GB")
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}
# Every random tensor is drawn exactly (``exact_normal``): numpy's PCG64 bit stream, an integer stream that NumPy
# keeps stable across releases, keyed by the build's seed and the tensor's name, turned into values by integer and
# correctly rounded float arithmetic only. So the bytes are the same on every CPU, instruction set, thread count and
# torch release, and do not depend on the order the pieces are made in: worker processes make them side by side, and
# a row block of a large table reads its own stretch of its tensor's stream. Bumped when that scheme changes: the
# marker records it and an older build is rebuilt, not reused (scheme 2 drew from torch's normal_, whose bits
# differed between machines).
INIT_SCHEME = 3
# Below this size one process builds (tiny: a second); above it, up to MAX_WORKERS processes, each
# holding one module or row block at a time: about 1.3 GB with its libraries (8 workers peaked at
# 11.3 GB together on the H200 box). They take at most half the memory available when the build starts,
# so a 16 GB laptop builds with three or four and stays under about 6 GB.
PARALLEL_FROM_BYTES = 512 * 1024**2
MAX_WORKERS = 8
WORKER_BYTES = 1.4e9


def build(shape="tiny", dest=None, *, seed: int = DEFAULT_SEED, force: bool = False, progress: bool = True,
          workers: int | None = None) -> Path:
    """Build (or reuse) a synthetic checkpoint and return its folder.

    ``shape`` is ``tiny``, ``e2b-shape``, ``e4b-shape``, or a config object/dict for any other
    Gemma 4 shape. The build needs no GPU and bounded host memory (module by module, in ``workers``
    processes side by side; ``None`` picks by size, CPUs and free memory). It is atomic:
    written to a hidden sibling folder and renamed into place only once complete, so an interrupted
    build leaves nothing that looks like a checkpoint. Concurrent calls for the same folder build it once.
    """
    from filelock import FileLock

    config = gemma4_config(shape)
    require_whole_number(seed, "seed", minimum=0)
    require_bool(force, "force")
    require_bool(progress, "progress")
    if workers is not None:
        require_whole_number(workers, "workers", minimum=1)
    if dest is not None and not isinstance(dest, (str, os.PathLike)):
        raise InvalidChoiceError(f"dest={dest!r} is not a folder path; pass a str or pathlib.Path, or leave it out.")
    dest = Path(dest) if dest is not None else default_destination(shape)
    if dest.exists() and not dest.is_dir():
        raise InvalidChoiceError(f"dest={str(dest)!r} is a file; choose an empty or new folder for the checkpoint.")
    if (is_complete(dest) and not force and _formats(dest) == (TEXT_FORMAT, INIT_SCHEME)
            and not _siblings(dest, "partial") + _siblings(dest, "old")):
        return dest  # the common case, without waiting for the lock
    # several processes may ask at once (bench --jobs, the GPU tier): one builds, the others wait
    # and reuse, so none replaces a checkpoint another is reading. The lock lives in the course
    # cache, not beside a folder the user chose.
    locks = cache_subfolder("locks")
    writable_folder(dest.parent)
    with FileLock(str(locks / (hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:16] + ".lock"))):
        _recover(dest)
        text_format, init_scheme = _formats(dest) if is_complete(dest) else (None, None)
        if is_complete(dest) and not force and init_scheme == INIT_SCHEME:
            if text_format != TEXT_FORMAT:
                _refresh_text_files(config, dest)
            return dest
        return _build_unlocked(shape, config, dest, seed, progress, workers)


def _formats(path: Path) -> tuple:
    """(text format, init scheme) of a complete build, read from its marker in one go; builds from before
    either was recorded are 1 (the init scheme 1: one random stream in file order)."""
    marker = json.loads((Path(path) / COMPLETE_MARKER).read_text())
    return marker.get("text_format", 1), marker.get("init_scheme", 1)


def _refresh_text_files(config, dest: Path) -> None:
    """Give a complete build from an older course the current tokenizer and chat template, weights
    untouched: the files are written beside it, moved in one by one, and the marker (with their
    hashes) is replaced last, so a kill midway leaves a build that is refreshed again next time."""
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        full_processor = save_text_and_media_processors(config, build_tokenizer(config), staging)
        generation_config(config).save_pretrained(staging)
        marker = json.loads((dest / COMPLETE_MARKER).read_text())
        for path in sorted(staging.iterdir()):
            marker["sha256"][path.name] = checksums.sha256(path)
            os.replace(path, dest / path.name)
        marker.update(full_processor=full_processor, text_format=TEXT_FORMAT)
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
        os.replace(staging / COMPLETE_MARKER, dest / COMPLETE_MARKER)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def weights_sha256(folder) -> dict:
    """{shard file: sha256} of a complete build's weights, from its marker."""
    if not is_complete(Path(folder)):
        raise NotASyntheticCheckpointError(f"{folder} has no {COMPLETE_MARKER}: build it with synthetic.build first.")
    recorded = json.loads((Path(folder) / COMPLETE_MARKER).read_text())["sha256"]
    return {name: digest for name, digest in sorted(recorded.items()) if name.endswith(".safetensors")}


def recorded_weights_sha256(shape: str) -> dict:
    """The weights' sha256 that ``python -m helpers.synthetic SHAPE --force --record`` wrote into data/builds/
    ({} where none was recorded, or it came from another init scheme): what every machine's build must give."""
    config_dict(shape)  # refuses an unknown shape
    path = BUILDS_DIR / f"{shape}.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    return record.get("weights_sha256", {}) if record.get("init_scheme") == INIT_SCHEME else {}


def _siblings(dest: Path, kind: str) -> list:
    return sorted(dest.parent.glob(f".{dest.name}.{kind}-*")) if dest.parent.is_dir() else []


def _recover(dest: Path) -> None:
    """Under the build lock no other builder of ``dest`` is alive: finish what a killed one left.
    A complete new build waiting beside a missing ``dest`` is moved in (the kill fell between the
    two renames), else a set-aside old one is put back; every other leftover is deleted."""
    if not is_complete(dest):
        ready = [p for p in _siblings(dest, "partial") if is_complete(p)] or [p for p in _siblings(dest, "old") if is_complete(p)]
        if ready and not dest.exists():
            os.replace(ready[0], dest)
    for leftover in _siblings(dest, "partial") + _siblings(dest, "old"):
        shutil.rmtree(leftover, ignore_errors=True)


def _build_unlocked(shape, config, dest: Path, seed: int, progress: bool, workers: int | None = None) -> Path:
    if dest.exists() and not is_complete(dest) and any(dest.iterdir()):
        raise InvalidChoiceError(
            f"{dest} exists and is not a synthetic checkpoint; choose an empty or new folder."
        )
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    shape_name = shape if isinstance(shape, str) else "custom"
    started = time.time()
    try:
        staging.mkdir()
        hashes, workers, workers_peak = write_weights(config, staging, seed=seed, progress=progress, desc=f"build {shape_name}",
                                             workers=workers)
        full_processor = save_text_and_media_processors(config, build_tokenizer(config), staging)
        hashes.update({path.name: checksums.sha256(path) for path in sorted(staging.iterdir()) if path.name not in hashes})
        write_text_atomically(
            staging / COMPLETE_MARKER,
            json.dumps(
                {
                    "shape": shape_name,
                    "seed": seed,
                    "config_sha256_12": config_fingerprint(config),
                    "full_processor": full_processor,
                    "text_format": TEXT_FORMAT,
                    "init_scheme": INIT_SCHEME,
                    "workers": workers,
                    "built_in_s": round(time.time() - started, 1),
                    # the builder's peak plus that of each worker that made a piece (all of them, in a large build):
                    # an upper bound on the host memory held at once
                    "peak_rss_bytes": peak_rss_bytes() + workers_peak,
                    "sha256": hashes,
                    "note": "random weights: memory figures are real, generated text is not",
                },
                indent=2,
            ),
        )
        _move_into_place(staging, dest)
    except OSError as err:
        if not is_no_room(err):
            raise
        raise DiskFullError(f"There is no room on the disk holding {dest.parent} for the {shape_name} build "
                            f"({os.strerror(err.errno)}): free space there, or set GEMMA_COURSE_CACHE (or dest) to a "
                            f"larger disk; nothing half-written was left.") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _move_into_place(staging: Path, dest: Path) -> None:
    """Old aside, new in, old deleted: a kill at any point leaves a complete checkpoint that
    ``_recover`` puts (back) in place at the next build."""
    aside = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    if dest.exists():
        os.replace(dest, aside)
    os.replace(staging, dest)
    shutil.rmtree(aside, ignore_errors=True)


def skeleton(config):
    """The model on the meta device, tied, with the course's init overrides by module name."""
    from transformers import Gemma4ForConditionalGeneration

    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.tie_weights()
    model.generation_config = generation_config(config)
    return model


def generation_config(config):
    """The checkpoint's generation config: it stops at every one of ``STOP_TOKENS``, as Google's does."""
    from transformers import GenerationConfig

    text = config.get_text_config()
    return GenerationConfig(bos_token_id=text.bos_token_id, pad_token_id=text.pad_token_id,
                            eos_token_id=stop_token_ids(config))


# Each decoder layer adds three unit-RMS vectors (attention, MLP, per-layer input, each through
# its post-norm) to a residual stream that starts as the token's own embedding. With E4B's widths
# and the default init that embedding stays large enough for the tied lm_head to pick the input
# token again, and greedy decoding repeats one token forever: token-level comparisons then cannot
# tell a broken computation from a correct one. Post-norm weights of 8 let the layers dominate the
# stream, as trained weights do, and greedy output varies (tests/test_synthetic.py, the benchmark's
# distinct-token counts).
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
POST_NORM_SCALE = 8.0


def course_init_fills(model) -> dict:
    """Module name -> the value its norm weight is filled with, on top of the library's init.

    q/k norms are scaled so attention scores have unit spread, as in a trained model: Gemma 4 uses
    attention scaling 1.0 and relies on trained q/k norms. With the default init (norm weights 1)
    scores spread by ~sqrt(head_dim), attention becomes an argmax, and bf16 rounding differences
    between kernels flip greedy tokens. The decoder's post-norms get ``POST_NORM_SCALE`` (above).
    """
    require_model(model)
    fills = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in POST_NORMS and ".language_model." in f".{name}":
            fills[name] = POST_NORM_SCALE
        head_dim = getattr(module, "head_dim", None)
        if head_dim is None or getattr(module, "q_norm", None) is None:
            continue
        for norm in ("q_norm", "k_norm"):
            if getattr(getattr(module, norm, None), "weight", None) is not None:
                fills[f"{name}.{norm}" if name else norm] = float(head_dim) ** -0.25
    return fills


def _tensors_to_write(model) -> list:
    """(name, module name, attribute, tensor) for each saved tensor, tied ones once (the first name, as
    save_pretrained keeps), sorted by name: the files then do not depend on the order a transformers release
    registers its modules in (5.5.2 and 5.17 differ)."""
    owners = {}
    for module_name, module in model.named_modules():
        for attribute, tensor in list(module._parameters.items()) + [
                (b, t) for b, t in module._buffers.items() if b not in module._non_persistent_buffers_set]:
            if tensor is not None:
                owners.setdefault(id(tensor), (module_name, attribute))
    seen, plan = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # a tied weight: save_pretrained keeps the first name
        seen.add(id(tensor))
        plan.append((name, *owners[id(tensor)], tensor))
    return sorted(plan, key=lambda entry: entry[0])


def _shards(plan) -> list:
    shards, current, size = [], [], 0
    for entry in plan:
        nbytes = entry[3].numel() * entry[3].element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return shards + ([current] if current else [])


def _header(shard) -> bytes:
    """The safetensors header for a shard (the format's JSON, padded to 8 bytes, length first)."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _, _, tensor in shard:
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


# The random part of an init: four 16-bit lanes of one 64-bit draw, summed and centred (Irwin-Hall), an integer in
# [-131070, 131070] with the spread below; scaled by std / spread in float32 (exact up to one correctly rounded
# multiply), then rounded to the tensor's dtype by round-to-nearest-even.
NORMAL_LANES = 4
LANE_CENTRE = NORMAL_LANES * 0xFFFF // 2
LANE_SPREAD = math.sqrt(NORMAL_LANES * (0x10000 ** 2 - 1) / 12)
DRAW_CHUNK = 1 << 18  # values per numpy pass: its temporaries stay in the CPU's cache
# the random inits of transformers.initialization; normal_ is drawn exactly, the others are refused
RANDOM_INITS = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                "trunc_normal_", "orthogonal_", "sparse_")


def tensor_key(seed: int, tensor_name: str) -> str:
    """The name of a tensor's random stream in a build of ``seed``."""
    seed = require_whole_number(seed, "seed", minimum=0)
    return f"{seed}/{tensor_name}"


def exact_normal(key: str, count: int, *, start: int = 0, mean: float = 0.0, std: float = 1.0,
                 dtype=torch.bfloat16) -> torch.Tensor:
    """Values ``start`` to ``start + count`` of the normal-like stream named ``key``: the same bits on every machine."""
    import numpy as np

    require_whole_number(count, "count", minimum=0)
    require_whole_number(start, "start", minimum=0)
    require_number(mean, "mean", minimum=-math.inf)
    require_number(std, "std")
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise InvalidChoiceError(f"dtype={dtype} is not drawn exactly; use torch.bfloat16, torch.float32 or torch.float16.")
    stream = np.random.PCG64(int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "little"))
    stream.advance(start)
    scale, shift = np.float32(std / LANE_SPREAD), np.float32(mean)
    out = np.empty(count, np.uint16 if dtype is torch.bfloat16 else np.float32)
    for begin in range(0, count, DRAW_CHUNK):
        size = min(DRAW_CHUNK, count - begin)
        lanes = stream.random_raw(size).astype("<u8").view("<u2").reshape(size, NORMAL_LANES)
        total = lanes[:, 0].astype(np.int32)
        for lane in range(1, NORMAL_LANES):
            total += lanes[:, lane]
        total -= LANE_CENTRE
        values = total.astype(np.float32)  # exact: |total| < 2**24
        values *= scale
        if shift:
            values += shift
        if dtype is torch.bfloat16:  # float32 -> bfloat16, round to nearest even, in integers
            bits = values.view(np.uint32)
            bits += ((bits >> 16) & 1) + np.uint32(0x7FFF)
            np.right_shift(bits, 16, out=out[begin:begin + size], casting="unsafe")
        else:
            out[begin:begin + size] = values
    if dtype is torch.bfloat16:
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(out).to(dtype)  # float32 -> float16: round to nearest even


@contextlib.contextmanager
def exact_random_init(streams: dict):
    """While a model's ``_init_weights`` runs inside, its ``normal_`` draws from ``exact_normal``: ``streams`` maps
    ``id(tensor)`` to ``(key, start)``. Any other random init, or a draw from torch's own generator, is refused: its
    bits would depend on the machine."""
    from transformers import initialization

    functions = initialization.TORCH_INIT_FUNCTIONS
    saved = dict(functions)

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        if id(tensor) not in streams:
            raise SyntheticInitError(f"The synthetic build was asked to draw a tensor of shape {tuple(tensor.shape)} it has no "
                              f"stream for; draw whole parameters only.")
        key, start = streams[id(tensor)]
        with torch.no_grad():
            tensor.copy_(exact_normal(key, tensor.numel(), start=start, mean=mean, std=std, dtype=tensor.dtype)
                         .view(tensor.shape))
        return tensor

    def refused(function):
        def draw(tensor, *args, **kwargs):
            raise SyntheticInitError(f"This model's init asks for {function}, which the synthetic build cannot draw the same "
                              f"on every machine; only normal_ is drawn exactly.")
        return draw

    functions.update({name: refused(name) for name in RANDOM_INITS if name in functions})
    functions["normal_"] = normal_
    before = torch.random.get_rng_state()
    try:
        yield
    finally:
        functions.clear()
        functions.update(saved)
    if not torch.equal(before, torch.random.get_rng_state()):
        raise SyntheticInitError("This model's init drew from torch's random generator, whose bits depend on the machine; "
                          "the synthetic build draws only through transformers.initialization.normal_.")


def _materialise(model, module_name: str, fills: dict, seed: int):
    """Give one module real CPU tensors, initialised by the model's own ``_init_weights``, its random draws exact."""
    module = model.get_submodule(module_name)
    for attribute, tensor in list(module._parameters.items()):
        if tensor is not None:
            module._parameters[attribute] = torch.nn.Parameter(torch.empty_like(tensor, device="cpu"),
                                                               requires_grad=tensor.requires_grad)
    for attribute, tensor in list(module._buffers.items()):
        if tensor is not None:
            module._buffers[attribute] = torch.empty_like(tensor, device="cpu")
    prefix = f"{module_name}." if module_name else ""
    streams = {id(tensor): (tensor_key(seed, prefix + attribute), 0)
               for attribute, tensor in [*module._parameters.items(), *module._buffers.items()] if tensor is not None}
    with torch.no_grad(), exact_random_init(streams):
        model._init_weights(module)
        if module_name in fills:
            module.weight.fill_(fills[module_name])
    return module


def _release(module) -> None:
    for attribute, tensor in list(module._parameters.items()):
        if tensor is not None:
            module._parameters[attribute] = torch.nn.Parameter(tensor.to("meta"), requires_grad=tensor.requires_grad)
    for attribute, tensor in list(module._buffers.items()):
        if tensor is not None:
            module._buffers[attribute] = tensor.to("meta")


def _block_rows(module) -> int:
    return max(1, EMBEDDING_BLOCK_BYTES // (module.weight.shape[1] * module.weight.element_size()))


def _embedding_block(model, module_name: str, rows: tuple, seed: int) -> torch.Tensor:
    """Rows ``start:stop`` of a large embedding table, initialised by ``_init_weights`` as an ``nn.Embedding``
    of those rows (the padding row zeroed where it falls), drawn from its table's stream at its first row."""
    module = model.get_submodule(module_name)
    start, stop = rows
    width = module.weight.shape[1]
    piece = torch.nn.Embedding(stop - start, width, device="cpu", dtype=module.weight.dtype, _freeze=True)
    pad = module.padding_idx
    piece.padding_idx = pad - start if pad is not None and start <= pad < stop else None
    with torch.no_grad(), exact_random_init({id(piece.weight): (tensor_key(seed, f"{module_name}.weight"), start * width)}):
        model._init_weights(piece)
    return piece.weight.detach()


def _is_blocked(module, attribute: str) -> bool:
    return (isinstance(module, torch.nn.Embedding) and attribute == "weight"
            and module.weight.numel() * module.weight.element_size() > EMBEDDING_BLOCK_BYTES)


@dataclass(frozen=True)
class Piece:
    """One unit of work: a module's tensors (or rows ``start:stop`` of a large embedding), and where
    in which shard file each tensor's bytes go. It carries every size, so a worker needs none of this
    module's settings."""

    module_name: str
    rows: tuple | None
    writes: tuple  # ((attribute, file name, byte offset), ...)
    nbytes: int


def _pieces(model, shards, names, header_sizes) -> list:
    """Every piece of the checkpoint, with the file offsets its bytes are written at (after each
    shard's header, in the order the header lists the tensors)."""
    by_module, pieces = {}, []
    for file_name, shard, offset in zip(names, shards, header_sizes):
        for _, module_name, attribute, tensor in shard:
            nbytes = tensor.numel() * tensor.element_size()
            module = model.get_submodule(module_name)
            if _is_blocked(module, attribute):
                count, row_bytes, step = module.weight.shape[0], nbytes // module.weight.shape[0], _block_rows(module)
                for start in range(0, count, step):
                    stop = min(count, start + step)
                    pieces.append(Piece(module_name, (start, stop), (("weight", file_name, offset + start * row_bytes),),
                                        (stop - start) * row_bytes))
            else:
                by_module.setdefault(module_name, []).append((attribute, file_name, offset, nbytes))
            offset += nbytes
    for module_name, writes in by_module.items():
        pieces.append(Piece(module_name, None, tuple(w[:3] for w in writes), sum(w[3] for w in writes)))
    return sorted(pieces, key=lambda piece: -piece.nbytes)  # largest first: the workers finish together


def _write_piece(model, fills: dict, seed: int, folder: Path, piece: Piece) -> int:
    if piece.rows is not None:
        (_, file_name, offset), = piece.writes
        _write_at(folder / file_name, offset, _raw_bytes(_embedding_block(model, piece.module_name, piece.rows, seed)))
        return piece.nbytes
    module = _materialise(model, piece.module_name, fills, seed)
    try:
        for attribute, file_name, offset in piece.writes:
            _write_at(folder / file_name, offset, _raw_bytes(getattr(module, attribute)))
    finally:
        _release(module)
    return piece.nbytes


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _raw_bytes(tensor: torch.Tensor):
    """A tensor's bytes as safetensors stores them (little-endian, row-major; scalars too), as a buffer
    over the tensor's own memory: a 256 MB row block is written without a second copy."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# A worker process keeps its own meta skeleton between pieces.
_WORKER = {}


def _start_worker(config, seed: int, folder: str) -> None:
    torch.set_num_threads(1)  # the workers are the parallelism; a thread pool each would oversubscribe
    model = skeleton(config)
    _WORKER.update(model=model, fills=course_init_fills(model), seed=seed, folder=Path(folder))


def _worker_piece(piece: Piece) -> tuple:
    written = _write_piece(_WORKER["model"], _WORKER["fills"], _WORKER["seed"], _WORKER["folder"], piece)
    return written, os.getpid(), peak_rss_bytes()


def _default_workers(total_bytes: int) -> int:
    """One process for a small build; else one per CPU, at most ``MAX_WORKERS`` and as many as half the
    available host memory holds at ``WORKER_BYTES`` each."""
    if total_bytes < PARALLEL_FROM_BYTES:
        return 1
    import psutil

    return max(1, min(os.cpu_count() or 1, MAX_WORKERS, int(psutil.virtual_memory().available / 2 // WORKER_BYTES)))


def write_weights(config, folder: Path, *, seed: int = DEFAULT_SEED, progress: bool = True, desc: str = "weights",
                  workers: int | None = None) -> tuple:
    """Write config, generation config and safetensors shards (with their index) into ``folder``,
    as ``save_pretrained`` lays them out, initialising one module at a time on the CPU, in
    ``workers`` processes side by side (``None``: ``_default_workers``).
    Returns ``({file name: sha256} for the shards, the number of worker processes started, and the
    peak resident bytes of those that made a piece, added up)``: 0 workers where the calling process
    built it alone."""
    require_whole_number(seed, "seed", minimum=0)
    require_bool(progress, "progress")
    from tqdm.auto import tqdm

    if workers is not None:
        require_whole_number(workers, "workers", minimum=1)
    model = skeleton(config)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    fills = course_init_fills(model)
    shards = _shards(_tensors_to_write(model))
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    headers = [_header(shard) for shard in shards]
    for file_name, shard, header in zip(names, shards, headers):
        with open(folder / file_name, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + sum(t.numel() * t.element_size() for *_, t in shard))
    pieces = _pieces(model, shards, names, [len(header) for header in headers])
    total = sum(piece.nbytes for piece in pieces)
    workers = _default_workers(total) if workers is None else workers
    peaks = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        if workers <= 1:
            for piece in pieces:
                bar.update(_write_piece(model, fills, seed, folder, piece))
        else:
            peaks = _write_in_workers(config, seed, folder, pieces, workers, bar)
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name, *_ in shard}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:  # hashlib lets go of the GIL
        digests = dict(zip(names, pool.map(lambda name: checksums.sha256(folder / name), names)))
    return digests, (workers if workers > 1 else 0), sum(peaks.values())


def _write_in_workers(config, seed: int, folder: Path, pieces: list, workers: int, bar) -> dict:
    """The pieces in ``workers`` spawned processes (spawn: safe beside torch's threads, and the only
    start method on Windows). Returns each worker's peak resident bytes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    peaks = {}
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(config, seed, str(folder)))
    try:
        for future in as_completed([pool.submit(_worker_piece, piece) for piece in pieces]):
            written, pid, peak = future.result()  # a worker's error is raised here, and the rest cancelled
            peaks[pid] = max(peaks.get(pid, 0), peak)
            bar.update(written)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return peaks


def main(argv=None) -> int:
    import argparse
    import os as _os
    import platform
    import sys

    parser = argparse.ArgumentParser(description="Build a synthetic Gemma 4 checkpoint (no GPU needed).")
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete checkpoint exists")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that build side by side (default: by size, CPUs and free memory)")
    parser.add_argument("--record", action="store_true", help=f"write the build's time and peak host memory to {BUILDS_DIR}/")
    args = parser.parse_args(argv)
    try:
        path = build(args.shape, force=args.force, workers=args.workers)
    except CourseError as err:  # bad input or a full disk: its sentence, not a traceback
        print(err, file=sys.stderr)
        return 2
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    by = f"{marker['workers']} worker processes" if marker.get("workers") else "the builder alone"
    print(f"{path}: built in {marker['built_in_s']} s by {by}, peak host memory {marker['peak_rss_bytes'] / 1e9:.2f} GB")
    if args.record:
        import psutil

        record = {key: marker[key] for key in ("shape", "seed", "config_sha256_12", "init_scheme", "workers", "built_in_s",
                                               "peak_rss_bytes")}
        record.update(weights_sha256=weights_sha256(path), cpus=_os.cpu_count(), ram_bytes=psutil.virtual_memory().total,
                      gpu_used=False,
                      platform=f"{platform.system()} {platform.machine()}", torch=torch.__version__,
                      date=time.strftime("%Y-%m-%d"), command=f"python -m helpers.synthetic {args.shape} --force --record")
        BUILDS_DIR.mkdir(parents=True, exist_ok=True)
        write_text_atomically(BUILDS_DIR / f"{args.shape}.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
