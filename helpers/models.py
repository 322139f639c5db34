"""Where a checkpoint comes from: one resolver for hub ids, local folders and synthetic names."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from . import synthetic
from .errors import ModelNotFoundError, NotAGemma4CheckpointError

DEFAULT_MODEL = "tiny"
MODEL_ENV = "GEMMA_MODEL"
REAL_MODEL = "google/gemma-4-E4B-it"
GEMMA4_MODEL_TYPES = {"gemma4", "gemma4_text"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def requested(source=None) -> str:
    """What the user asked for: the argument, else ``$GEMMA_MODEL``, else ``tiny``."""
    if source is not None:
        return os.fspath(source)
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def is_synthetic(source=None) -> bool:
    return requested(source) in synthetic.SHAPES


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
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id))
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id} is gated: accept its licence on the model page, then log in with `hf auth login`."
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"No model {repo_id!r} on the hub (or no access): check the spelling, e.g. {REAL_MODEL}."
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo_id} has no such revision; drop the revision or pick one that exists.") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"Cannot reach the hub to fetch {repo_id} and it is not in the local cache: connect, set HF_ENDPOINT "
            f"to a mirror (with HF_HUB_DISABLE_XET=1), or use a synthetic model such as GEMMA_MODEL=tiny."
        ) from None


def resolve(source=None) -> Path:
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
