"""Synthetic Gemma 4 checkpoints: real configs, real tensor names and shapes, random weights.

Memory behaviour depends on shapes, not values, so an E4B-shaped checkpoint gives the real
memory figures on a GPU, and ``tiny`` runs every code path on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from .errors import InvalidChoiceError
from .paths import CONFIG_DIR, cache_dir

SHAPES = {
    "tiny": "tiny.config.json",
    "e2b-shape": "gemma-4-E2B-it.config.json",
    "e4b-shape": "gemma-4-E4B-it.config.json",
}
COMPLETE_MARKER = "synthetic-checkpoint.json"
DEFAULT_SEED = 0

# A byte-level vocabulary: every text encodes, decoding is exact, no merges file to ship.
BYTE_TOKEN_BLOCK_STARTS = (1000, 16)  # first block of 256 free ids that fits the vocabulary

CHAT_TEMPLATE = (
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
    if shape not in SHAPES:
        raise InvalidChoiceError(
            f"Unknown synthetic shape {shape!r}; choose one of {', '.join(SHAPES)} or pass a config."
        )
    return json.loads((CONFIG_DIR / SHAPES[shape]).read_text())


def gemma4_config(shape_or_config):
    """A ``Gemma4Config`` from a shape name, a dict, or a config object (returned as is)."""
    from transformers import Gemma4Config, PreTrainedConfig

    if isinstance(shape_or_config, PreTrainedConfig):
        return shape_or_config
    raw = config_dict(shape_or_config) if isinstance(shape_or_config, str) else dict(shape_or_config)
    return Gemma4Config(**raw)


def config_fingerprint(config) -> str:
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_destination(shape_or_config) -> Path:
    config = gemma4_config(shape_or_config)
    name = shape_or_config if isinstance(shape_or_config, str) else "custom"
    return cache_dir() / "synthetic" / f"{name}-{config_fingerprint(config)}"


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def soften_attention(model) -> None:
    """Scale q/k norms so attention scores have unit spread, as in a trained model.

    Gemma 4 uses attention scaling 1.0 and relies on trained q/k norms. With the default
    init (norm weights 1) scores spread by ~sqrt(head_dim), attention becomes an argmax,
    and bf16 rounding differences between kernels flip greedy tokens.
    """
    for module in model.modules():
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        head_dim = getattr(module, "head_dim", None)
        if q_norm is None or head_dim is None:
            continue
        scale = float(head_dim) ** -0.25
        with torch.no_grad():
            q_norm.weight.fill_(scale)
            if k_norm is not None and getattr(k_norm, "weight", None) is not None:
                k_norm.weight.fill_(scale)


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


def _byte_block_start(special_ids, vocab_size: int) -> int:
    for start in BYTE_TOKEN_BLOCK_STARTS:
        block = range(start, start + 256)
        if block.stop <= vocab_size and not any(i in block for i in special_ids):
            return start
    raise InvalidChoiceError(
        f"vocab_size={vocab_size} leaves no room for 256 byte tokens beside the special tokens; use at least 300."
    )


def build_tokenizer(config):
    """A byte-level tokenizer whose special tokens sit at the ids the config names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _special_token_ids(config)
    start = _byte_block_start(specials.values(), config.get_text_config().vocab_size)
    vocab = dict(specials)
    for offset, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[symbol] = start + offset
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
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
            "sot_token": "<|turn>",
            "eot_token": "<turn|>",
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


def _init_device() -> torch.device:
    # Random init of 8 B parameters takes minutes on a CPU and seconds on a GPU.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build(shape="tiny", dest=None, *, seed: int = DEFAULT_SEED, force: bool = False, progress: bool = True) -> Path:
    """Build (or reuse) a synthetic checkpoint and return its folder.

    ``shape`` is ``tiny``, ``e2b-shape``, ``e4b-shape``, or a config object/dict for any other
    Gemma 4 shape. The build is atomic: it is written to a hidden sibling folder and renamed
    into place only once complete, so an interrupted build leaves nothing that looks like a
    checkpoint. Concurrent calls for the same folder build it once.
    """
    from filelock import FileLock

    config = gemma4_config(shape)
    dest = Path(dest) if dest is not None else default_destination(shape)
    if is_complete(dest) and not force:
        return dest
    # several processes may ask at once (bench --jobs, the GPU tier): one builds, the others wait
    # and reuse, so none replaces a checkpoint another is reading. The lock lives in the course
    # cache, not beside a folder the user chose.
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / (hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:16] + ".lock"))):
        if is_complete(dest) and not force:
            return dest
        return _build_unlocked(shape, config, dest, seed, progress)


def _build_unlocked(shape, config, dest: Path, seed: int, progress: bool) -> Path:
    from tqdm.auto import tqdm
    from transformers import Gemma4ForConditionalGeneration, GenerationConfig

    if dest.exists() and not is_complete(dest) and any(dest.iterdir()):
        raise InvalidChoiceError(
            f"{dest} exists and is not a synthetic checkpoint; choose an empty or new folder."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    shape_name = shape if isinstance(shape, str) else "custom"
    steps = tqdm(total=4, desc=f"build {shape_name}", disable=not progress)
    try:
        started = time.time()
        torch.manual_seed(seed)
        with torch.device(_init_device()):
            model = Gemma4ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
        steps.update()
        soften_attention(model)
        text = config.get_text_config()
        model.generation_config = GenerationConfig(
            bos_token_id=text.bos_token_id,
            pad_token_id=text.pad_token_id,
            eos_token_id=config.eos_token_id,
        )
        steps.update()
        model.save_pretrained(staging, max_shard_size="2GB")
        del model
        steps.update()
        full_processor = save_text_and_media_processors(config, build_tokenizer(config), staging)
        steps.update()
        (staging / COMPLETE_MARKER).write_text(
            json.dumps(
                {
                    "shape": shape_name,
                    "seed": seed,
                    "config_sha256_12": config_fingerprint(config),
                    "full_processor": full_processor,
                    "built_in_s": round(time.time() - started, 1),
                    "note": "random weights: memory figures are real, generated text is not",
                },
                indent=2,
            )
        )
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    finally:
        steps.close()
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest
