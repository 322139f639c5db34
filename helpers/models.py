"""Where a checkpoint comes from: one resolver for hub ids, local folders and synthetic names."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from .errors import CorruptCheckpointError, InvalidChoiceError, ModelNotFoundError, NotAGemma4CheckpointError

DEFAULT_MODEL = "tiny"
MODEL_ENV = "GEMMA_MODEL"
GEMMA4_MODEL_TYPES = {"gemma4", "gemma4_text"}
# the same architecture, smaller: what a notebook step runs live when the model does not fit the card (the real
# E2B is a 10 GB download a notebook should not start on its own, so it is not listed); tiny has none
SMALLER_SIBLING = {"e4b-shape": "e2b-shape", "e2b-shape": "tiny"}
# a hub id ("google/gemma-4-E4B-it"), a folder, a synthetic name ("tiny"), or None for $GEMMA_MODEL
Source = str | os.PathLike | None


def _builder():
    """The synthetic builder, imported when a name first needs it rather than with this module, so that
    importing ``loading`` imports neither the builder nor the downloader (``tests/test_package.py``)."""
    return importlib.import_module(".synthetic", __package__)


def _downloader():
    """The course's downloader, imported on first use for the same reason as ``_builder``."""
    return importlib.import_module(".download", __package__)


def requested(source: Source = None) -> str:
    """What the user asked for: the argument, else ``$GEMMA_MODEL``, else ``tiny``."""
    synthetic = _builder()
    course_download = _downloader()
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InvalidChoiceError(
            f"source={source!r} is not a model; pass a hub id, a folder or one of {', '.join(synthetic.SHAPES)}.")
    name = os.fspath(source) if source is not None else os.environ.get(MODEL_ENV) or DEFAULT_MODEL
    if not name.strip():
        raise InvalidChoiceError(
            f"source={name!r} is empty; pass a hub id (e.g. {course_download.REAL_MODEL}), a folder "
            f"or one of {', '.join(synthetic.SHAPES)}.")
    return name


def is_synthetic(source: Source = None) -> bool:
    synthetic = _builder()
    return requested(source) in synthetic.SHAPES


def smaller_sibling(source: Source = None) -> str | None:
    """A smaller checkpoint of the same architecture to run a live step on, or None."""
    return SMALLER_SIBLING.get(requested(source))


def smaller_siblings(source: Source = None) -> list:
    """Every smaller checkpoint of the same architecture, the largest first."""
    found, name = [], requested(source)
    while (name := SMALLER_SIBLING.get(name)) is not None:
        found.append(name)
    return found


def check_checkpoint_folder(path: Path) -> Path:
    synthetic = _builder()
    course_download = _downloader()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NotAGemma4CheckpointError(
            f"{path} has no config.json; point to the folder that `save_pretrained` or `hf download` wrote."
        )
    fix = "download or save the checkpoint again"
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise NotAGemma4CheckpointError(f"{config_file} is not valid JSON ({getattr(err, 'msg', err)}); {fix}.") from None
    if not isinstance(config, dict):
        raise NotAGemma4CheckpointError(f"{config_file} holds a {type(config).__name__}, not a JSON object; {fix}.")
    model_type = config.get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES:
        raise NotAGemma4CheckpointError(
            f"{path} holds a {model_type!r} model, not Gemma 4; this course needs a Gemma 4 checkpoint "
            f"such as {course_download.REAL_MODEL} or a synthetic one ({', '.join(synthetic.SHAPES)})."
        )
    return path


def _download(repo_id: str) -> Path:
    """One location for a hub model, found without a request where it can be: the course's verified download
    (notebook 01), else the Hugging Face cache (``hf download``, an earlier run), else downloaded into the
    course's folder, verified (``download.download``); offline, only the first two."""
    course_download = _downloader()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    downloaded = course_download.verified_download(repo_id)
    if downloaded is not None:
        return downloaded
    try:
        return Path(snapshot_download(repo_id, token=course_download.hub_token(None), local_files_only=True))  # the HF cache, no request
    except LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise course_download.explain_hub_error(err, repo_id) from None
    except Exception as err:  # noqa: BLE001 - the hub's own errors become one sentence; others propagate
        explained = course_download.explain_hub_error(err, repo_id)
        if explained is None:
            raise
        raise explained from None
    folder = course_download.course_folder(repo_id)
    try:
        return course_download.download(repo_id, folder, max_attempts=1).path
    except course_download.DownloadFailedError as first:
        if first.never_reached:  # offline or a wrong endpoint: say so now rather than after minutes of retries
            raise ModelNotFoundError(
                f"Cannot reach the hub to fetch {repo_id} and it is not downloaded yet: connect, set HF_ENDPOINT to a "
                f"mirror (with HF_HUB_DISABLE_XET=1), run notebook 01, or use a synthetic model such as GEMMA_MODEL=tiny."
            ) from None
    # it started: a few more attempts continue it (notebook 01's download.download tries 20 times)
    return course_download.download(repo_id, folder, max_attempts=5).path


def resolve(source: Source = None) -> Path:
    """Local path of a ready checkpoint for a hub id, a folder, or a synthetic name.

    Synthetic names are built on first use (seconds for ``tiny``); a hub id is found where notebook 01
    downloaded it (or in the Hugging Face cache) without a request, and downloaded once otherwise.
    """
    synthetic = _builder()
    course_download = _downloader()
    name = requested(source)
    if name in synthetic.SHAPES:
        return synthetic.build(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return check_checkpoint_folder(path)
    if path.exists():
        raise NotAGemma4CheckpointError(f"{path} is a file; pass the folder that holds config.json.")
    if course_download.is_hub_id(name):
        return check_checkpoint_folder(_download(name))
    raise ModelNotFoundError(
        f"No folder {str(path)!r}, and {name!r} is not a valid hub id; pass an existing folder, a hub id like {course_download.REAL_MODEL} "
        f"(no spaces, newlines or '..'), or one of {', '.join(synthetic.SHAPES)}."
    )


def check_weight_files(path: Path) -> Path:
    """Open the header of every safetensors file (and the shards an index names) before loading, so a
    truncated, emptied or garbled file gets a sentence with the fix instead of safetensors' error."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    names = sorted(p.name for p in path.glob("*.safetensors"))
    if index.is_file():
        try:
            names = sorted(set(names) | set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise CorruptCheckpointError(f"{index} is truncated or corrupt ({type(err).__name__}); {_repair_hint(path)}.") from None
    if not names:
        raise CorruptCheckpointError(f"{path} holds no .safetensors weights; {_repair_hint(path)}.")
    for name in names:
        shard = path / name
        if not shard.is_file():
            raise CorruptCheckpointError(f"{shard} is missing, though the index names it (truncated or corrupt "
                                         f"checkpoint); {_repair_hint(path)}.")
        try:
            with safe_open(shard, "pt"):
                pass
        except SafetensorError as err:
            raise CorruptCheckpointError(f"{shard} is truncated or corrupt ({str(err).strip()}); {_repair_hint(path)}.") from None
    return path


def _repair_hint(path: Path) -> str:
    synthetic = _builder()
    if synthetic.is_complete(path):
        shape = json.loads((path / synthetic.COMPLETE_MARKER).read_text()).get("shape")
        if shape in synthetic.SHAPES:
            return f"rebuild it with `python -m helpers.synthetic {shape} --force`"
        return "rebuild it with synthetic.build(config, folder, force=True)"
    if (path / ".cache" / "huggingface").is_dir():
        return "run download.download again, which fetches again every file that fails verification"
    return "download or save the checkpoint again"


def load_config(source=None):
    """The config of a checkpoint without loading weights: a config object as is, a synthetic
    name from ``data/configs`` (nothing built), a folder or a hub id through ``resolve``."""
    synthetic = _builder()
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
