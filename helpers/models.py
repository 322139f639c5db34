"""Where a checkpoint comes from: one resolver for hub ids, local folders and synthetic names."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from . import synthetic
from .download import REAL_MODEL, explain_hub_error
from .errors import ModelNotFoundError, NotAGemma4CheckpointError

DEFAULT_MODEL = "tiny"
MODEL_ENV = "GEMMA_MODEL"
GEMMA4_MODEL_TYPES = {"gemma4", "gemma4_text"}
# the same architecture, smaller: what a notebook compares live when a route does not fit the card
# (the real E2B is a 10 GB download a notebook should not start on its own, so it is not listed)
SMALLER_SIBLING = {"e4b-shape": "e2b-shape", "tiny": "tiny"}
# a hub id ("google/gemma-4-E4B-it"), a folder, a synthetic name ("tiny"), or None for $GEMMA_MODEL
Source = str | os.PathLike | None
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def requested(source: Source = None) -> str:
    """What the user asked for: the argument, else ``$GEMMA_MODEL``, else ``tiny``."""
    if source is not None:
        return os.fspath(source)
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def is_synthetic(source: Source = None) -> bool:
    return requested(source) in synthetic.SHAPES


def smaller_sibling(source: Source = None) -> str | None:
    """A smaller checkpoint of the same architecture to run a live comparison on, or None."""
    return SMALLER_SIBLING.get(requested(source))


def check_checkpoint_folder(path: Path) -> Path:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NotAGemma4CheckpointError(
            f"{path} has no config.json; point to the folder that `save_pretrained` or `hf download` wrote."
        )
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES:
        raise NotAGemma4CheckpointError(
            f"{path} holds a {model_type!r} model, not Gemma 4; this course needs a Gemma 4 checkpoint "
            f"such as {REAL_MODEL} or a synthetic one ({', '.join(synthetic.SHAPES)})."
        )
    return path


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id))
    except Exception as err:  # noqa: BLE001 - the hub's own errors become one sentence; others propagate
        explained = explain_hub_error(err, repo_id)
        if explained is None:
            raise
        raise explained from None


def resolve(source: Source = None) -> Path:
    """Local path of a ready checkpoint for a hub id, a folder, or a synthetic name.

    Synthetic names are built on first use (seconds for ``tiny``); hub ids are downloaded
    with ``huggingface_hub`` (reusing its cache).
    """
    name = requested(source)
    if name in synthetic.SHAPES:
        return synthetic.build(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return check_checkpoint_folder(path)
    if path.exists():
        raise NotAGemma4CheckpointError(f"{path} is a file; pass the folder that holds config.json.")
    if _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        return check_checkpoint_folder(_download(name))
    raise ModelNotFoundError(
        f"No folder {str(path)!r} and not a hub id; pass an existing folder, a hub id like {REAL_MODEL}, "
        f"or one of {', '.join(synthetic.SHAPES)}."
    )


def load_config(source=None):
    """The config of a checkpoint without loading weights: a config object as is, a synthetic
    name from ``data/configs`` (nothing built), a folder or a hub id through ``resolve``."""
    from transformers import AutoConfig, PreTrainedConfig

    if isinstance(source, PreTrainedConfig):
        return source
    if is_synthetic(source):
        return synthetic.gemma4_config(requested(source))
    return AutoConfig.from_pretrained(resolve(source))


def auto_class_for(config):
    """The Auto class that loads this checkpoint: image-text-to-text where it has a vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
