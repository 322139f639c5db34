"""Downloading a 16 GB model that fails halfway: mirrors, XetHub, retries, resume, verification.

Everything goes through ``huggingface_hub``: ``snapshot_download`` writes each file to an
``.incomplete`` file under ``<local_dir>/.cache`` and renames it into place only when it is
whole, so a loader never sees half a file; a retry continues from what is already there.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CourseError, ModelNotFoundError

REAL_MODEL = "google/gemma-4-E4B-it"
# What the course needs from google/gemma-4-E4B-it: weights, configs, tokenizer and chat template.
COURSE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]


class HubImportedTooEarlyError(CourseError):
    """HF_ENDPOINT / HF_HUB_DISABLE_XET set after huggingface_hub had already read them."""


class DownloadFailedError(CourseError):
    """Every attempt failed."""


class DiskFullError(CourseError):
    """No space left for the download."""


class OfflineModeError(CourseError):
    """HF_HUB_OFFLINE forbids the download."""


def hub_settings() -> dict:
    """What huggingface_hub is actually using (read once, when it was first imported)."""
    from huggingface_hub import constants

    return {"endpoint": constants.ENDPOINT, "xet_disabled": bool(constants.HF_HUB_DISABLE_XET)}


def use_mirror(endpoint: str, disable_xet: bool = True) -> None:
    """Point huggingface_hub at a mirror. Must run before huggingface_hub reads its settings,
    which happens once, the first time anything of it is used (importing transformers is enough).

    ``HF_ENDPOINT`` only redirects API and ``resolve`` requests. Files stored on XetHub are
    fetched from ``cas-bridge.xethub.hf.co`` directly, past any mirror, unless
    ``HF_HUB_DISABLE_XET=1`` makes the client fall back to plain HTTP through the endpoint.
    """
    os.environ["HF_ENDPOINT"] = endpoint.rstrip("/")
    if disable_xet:
        os.environ["HF_HUB_DISABLE_XET"] = "1"
    if "huggingface_hub" in sys.modules:
        settings = hub_settings()
        if settings["endpoint"].rstrip("/") != endpoint.rstrip("/") or (disable_xet and not settings["xet_disabled"]):
            raise HubImportedTooEarlyError(
                f"huggingface_hub was imported before HF_ENDPOINT/HF_HUB_DISABLE_XET were set and still uses "
                f"{settings['endpoint']}: restart the kernel and run this cell before any other import."
            )


@dataclass
class DownloadResult:
    path: Path
    attempts: int
    errors: list = field(default_factory=list)  # one line per failed attempt


def explain_hub_error(err: Exception, repo_id: str) -> CourseError | None:
    """The course's sentence for a hub error that no retry can fix (gated, missing, no such
    revision, not cached while offline); ``None`` for the rest, which a retry may fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return ModelNotFoundError(
            f"{repo_id} is gated: accept its licence on the model page, then log in with `hf auth login`.")
    if isinstance(err, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id} has no such revision; drop the revision or pick one that exists.")
    if isinstance(err, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"No model {repo_id!r} on the hub at this endpoint (or no access): check the spelling (e.g. {REAL_MODEL}) "
            f"and HF_ENDPOINT.")
    if isinstance(err, LocalEntryNotFoundError):
        return ModelNotFoundError(
            f"Cannot reach the hub to fetch {repo_id} and it is not in the local cache: connect, set HF_ENDPOINT "
            f"to a mirror (with HF_HUB_DISABLE_XET=1), or use a synthetic model such as GEMMA_MODEL=tiny.")
    return None


def _is_offline_miss(err: Exception) -> bool:
    # during a download a "not in the local cache" error means the connection dropped: retry it
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(err, LocalEntryNotFoundError)


def download(repo_id: str, local_dir, *, endpoint: str | None = None, allow_patterns=COURSE_PATTERNS,
             max_attempts: int = 20, first_wait_s: float = 2.0, max_wait_s: float = 60.0,
             sleep=time.sleep) -> DownloadResult:
    """Download ``repo_id`` into ``local_dir``, retrying with exponential backoff.

    Like the article's retry loop, but each retry keeps every finished file and
    huggingface_hub continues partial ones. Gated, missing and disk-full errors stop at once
    with the fix; anything else (dropped connections, 5xx, stalls) is retried.
    """
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise OfflineModeError("HF_HUB_OFFLINE=1 is set, so nothing can be downloaded: unset it and restart the kernel.")
    errors = []
    for attempt in range(1, max_attempts + 1):
        try:
            path = snapshot_download(repo_id, local_dir=str(local_dir), endpoint=endpoint, allow_patterns=allow_patterns)
            return DownloadResult(Path(path), attempt, errors)
        except Exception as err:  # noqa: BLE001 - sorted below into permanent, disk-full and transient
            permanent = explain_hub_error(err, repo_id)
            if permanent is not None and not _is_offline_miss(err):
                raise permanent from None
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise DiskFullError(
                    f"The disk holding {local_dir} is full: free about 16 GB or pass a local_dir on a larger disk; "
                    f"finished files are kept and the next run continues."
                ) from None
            errors.append(f"attempt {attempt}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
            if attempt < max_attempts:
                sleep(min(max_wait_s, first_wait_s * 2 ** (attempt - 1)))
    raise DownloadFailedError(
        f"{repo_id} did not download in {max_attempts} attempts (last: {errors[-1]}); finished files are kept: "
        f"run it again, or check HF_ENDPOINT."
    )


def _file_digest(path: Path, digest, header: bytes = b"") -> str:
    digest.update(header)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):  # 16 GB files: never read whole
            digest.update(block)
    return digest.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """The id git (and the Hub's ETag) gives a small file."""
    return _file_digest(Path(path), hashlib.sha1(), f"blob {Path(path).stat().st_size}\0".encode())


def sha256(path: Path) -> str:
    """The id of an LFS file (and the Hub's ETag for it)."""
    return _file_digest(Path(path), hashlib.sha256())


def verify(repo_id: str, local_dir, *, endpoint: str | None = None, allow_patterns=COURSE_PATTERNS) -> dict:
    """Check every downloaded file against the server's checksum: sha256 for LFS files, the
    git blob id for the rest (the ETag the Hub sends). Returns ``{file: "ok" | "missing" | "mismatch"}``."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    api = HfApi(endpoint=endpoint)
    files = [f for f in api.list_repo_files(repo_id) if any(fnmatch(f, p) for p in allow_patterns)]
    result = {}
    for name in files:
        local = Path(local_dir) / name
        if not local.is_file():
            result[name] = "missing"
            continue
        etag = get_hf_file_metadata(hf_hub_url(repo_id, name, endpoint=endpoint)).etag.strip('"')
        actual = sha256(local) if len(etag) == 64 else git_blob_sha1(local)
        result[name] = "ok" if actual == etag else "mismatch"
    return result
