"""Downloading a 16 GB model that fails halfway: mirrors, XetHub, retries, resume, verification.

Everything goes through ``huggingface_hub``: ``snapshot_download`` writes each file to an
``.incomplete`` file under ``<local_dir>/.cache`` and renames it into place only when it is
whole, so a loader never sees half a file; a retry continues from what is already there.
Whole is not the same as right: a proxy that flips a byte, or a ``Content-Length: 0`` that
huggingface_hub believes, leaves a wrong file that looks finished. So ``download`` checks every
file against the hashes the server lists (sha256 for LFS files, the git blob id otherwise) and
fetches again what does not match.

A hub token goes to the Hub only: to any other endpoint (a classroom mirror) the course sends none.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from . import checksums
from .checksums import git_blob_sha1, sha256  # noqa: F401 - the names notebooks and the mirror use
from .errors import (
    CourseError,
    DiskFullError,
    InvalidChoiceError,
    ModelNotFoundError,
    require_bool,
    require_number,
    require_whole_number,
)
from .paths import cache_dir, writable_folder

REAL_MODEL = "google/gemma-4-E4B-it"
# written into <local_dir>/.cache (beside huggingface_hub's own records) once every file matched the server's hashes:
# what lets models.resolve use a download without asking the network again
VERIFIED_RECORD = "course-verified.json"
HUB_HOST = "huggingface.co"
# What the course needs from google/gemma-4-E4B-it: weights, configs, tokenizer and chat template.
COURSE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
# owner/name, as the course spells hub ids (huggingface_hub's own validator checks the rest)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubImportedTooEarlyError(CourseError):
    """HF_ENDPOINT / HF_HUB_DISABLE_XET set after huggingface_hub had already read them."""

    entry = "huggingface_hub-was-imported-before-hf_endpoint-was-set"


class DownloadFailedError(CourseError):
    """Every attempt failed."""

    def __init__(self, message: str, attempt_errors=()):
        super().__init__(message)
        self.attempt_errors = list(attempt_errors)  # one line per failed attempt

    @property
    def never_reached(self) -> bool:
        """No attempt reached the server at all (offline, or a wrong HF_ENDPOINT)."""
        return bool(self.attempt_errors) and all("LocalEntryNotFoundError" in line for line in self.attempt_errors)

    entry = "a-download-that-keeps-failing-or-stalls"


class OfflineModeError(CourseError):
    """HF_HUB_OFFLINE forbids the download."""

    entry = "hf_hub_offline-is-set"


def is_hub_id(name) -> bool:
    """``owner/name`` as the Hub accepts it: no spaces, newlines, ``..`` or extra slashes."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or not _HUB_ID.fullmatch(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def require_hub_id(repo_id) -> str:
    if not is_hub_id(repo_id):
        raise ModelNotFoundError(
            f"{repo_id!r} is not a valid hub id; write it as owner/name, e.g. {REAL_MODEL}, without spaces, newlines or '..'.")
    return repo_id


def require_endpoint(url, what: str = "endpoint") -> str:
    """An http(s) URL with a host, without its trailing slash."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidChoiceError(f"{what}={url!r} is not a URL; pass one such as http://192.168.1.10:8090 or https://{HUB_HOST}.")
    return url.rstrip("/")


def is_the_hub(endpoint: str | None) -> bool:
    """Whether requests to ``endpoint`` (None: huggingface_hub's own) go to the Hugging Face Hub."""
    from huggingface_hub import constants

    parts = urlsplit(endpoint or constants.ENDPOINT)
    return parts.scheme == "https" and parts.hostname == HUB_HOST


def hub_token(endpoint: str | None):
    """What to pass as huggingface_hub's ``token``: ``None`` (its default: the saved token, which gated
    Gemma needs) for the Hub, ``False`` (send none) for any other endpoint. huggingface_hub sends the
    saved token to whatever endpoint it is given, and a classroom mirror is plain HTTP on a shared network."""
    return None if is_the_hub(endpoint) else False


def hub_settings() -> dict:
    """What huggingface_hub is actually using (read once, when it was first imported)."""
    from huggingface_hub import constants

    return {"endpoint": constants.ENDPOINT, "xet_disabled": bool(constants.HF_HUB_DISABLE_XET),
            "implicit_token_disabled": bool(constants.HF_HUB_DISABLE_IMPLICIT_TOKEN)}


def use_mirror(endpoint: str, disable_xet: bool = True) -> None:
    """Point huggingface_hub at a mirror. Must run before huggingface_hub reads its settings,
    which happens once, the first time anything of it is used (importing transformers is enough).

    ``HF_ENDPOINT`` only redirects API and ``resolve`` requests. Files stored on XetHub are
    fetched from ``cas-bridge.xethub.hf.co`` directly, past any mirror, unless
    ``HF_HUB_DISABLE_XET=1`` makes the client fall back to plain HTTP through the endpoint.
    ``HF_HUB_DISABLE_IMPLICIT_TOKEN=1`` keeps the saved hub token from travelling to the mirror
    with every request that any library makes.
    """
    require_bool(disable_xet, "disable_xet")
    endpoint = require_endpoint(endpoint)
    os.environ["HF_ENDPOINT"] = endpoint
    if disable_xet:
        os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
    if "huggingface_hub" in sys.modules:
        settings = hub_settings()
        if (settings["endpoint"].rstrip("/") != endpoint or (disable_xet and not settings["xet_disabled"])
                or not settings["implicit_token_disabled"]):
            raise HubImportedTooEarlyError(
                f"huggingface_hub was imported before HF_ENDPOINT/HF_HUB_DISABLE_XET/HF_HUB_DISABLE_IMPLICIT_TOKEN were set and still uses "
                f"{settings['endpoint']}: restart the kernel and run this cell before any other import."
            )


@dataclass
class DownloadResult:
    path: Path
    attempts: int
    errors: list = field(default_factory=list)  # one line per failed attempt
    checks: dict = field(default_factory=dict)  # {file: "ok"}: every file, verified against the server's hashes
    refetched: list = field(default_factory=list)  # files that failed verification, deleted and fetched again


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


def _first_line(err: Exception, limit: int = 400) -> str:
    """An error's first line for the list of failed attempts: whole, so a URL keeps its file name; a line past
    ``limit`` ends at a word with an ellipsis, never inside a word."""
    line = next(iter(str(err).splitlines()), "")
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > 0 else limit].rstrip() + " …"


def _is_offline_miss(err: Exception) -> bool:
    # during a download a "not in the local cache" error means the connection dropped: retry it
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(err, LocalEntryNotFoundError)


def download(repo_id: str, local_dir, *, endpoint: str | None = None, allow_patterns=COURSE_PATTERNS,
             max_attempts: int = 20, first_wait_s: float = 2.0, max_wait_s: float = 60.0,
             sleep=time.sleep) -> DownloadResult:
    """Download ``repo_id`` into ``local_dir``, retrying with exponential backoff, and return only
    once every file matches the server's hashes.

    Like the article's retry loop, but each retry keeps every finished file and
    huggingface_hub continues partial ones. Gated, missing and disk-full errors stop at once
    with the fix; anything else (dropped connections, 5xx, stalls) is retried. A file that fails
    verification is deleted with huggingface_hub's record of it (which would call it current) and
    fetched again, so running ``download`` again repairs a folder.
    """
    from huggingface_hub import constants, snapshot_download

    require_hub_id(repo_id)
    local_dir = download_folder(local_dir)
    require_whole_number(max_attempts, "max_attempts", minimum=1)
    require_number(first_wait_s, "first_wait_s")  # finite seconds, 0 or more: time.sleep takes no NaN
    require_number(max_wait_s, "max_wait_s")
    if endpoint is not None:
        endpoint = require_endpoint(endpoint)
    if constants.HF_HUB_OFFLINE:
        raise OfflineModeError("HF_HUB_OFFLINE=1 is set, so nothing can be downloaded: unset it and restart the kernel.")
    record = local_dir / ".cache" / VERIFIED_RECORD
    record.unlink(missing_ok=True)  # until this download is verified, the folder is not one resolve may trust
    errors, refetched = [], []
    for attempt in range(1, max_attempts + 1):
        try:
            path = snapshot_download(repo_id, local_dir=str(local_dir), endpoint=endpoint, allow_patterns=allow_patterns,
                                     token=hub_token(endpoint), tqdm_class=download_bars())
            checks = verify(repo_id, local_dir, endpoint=endpoint, allow_patterns=allow_patterns)
            if not checksums.failures(checks):
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps({"repo_id": repo_id, "endpoint": endpoint or constants.ENDPOINT,
                                              "allow_patterns": list(allow_patterns), "files": sorted(checks)}, indent=1))
                return DownloadResult(Path(path), attempt, errors, checks, refetched)
            spoiled = sorted(name for name, status in checks.items() if status == checksums.MISMATCH)
            # missing: huggingface_hub returned the folder as it was (it does when the file list fails)
            missing = sorted(name for name, status in checks.items() if status == checksums.MISSING)
            for name in spoiled:
                forget(local_dir, name)
            refetched += spoiled
            found = ([f"{len(spoiled)} file(s) did not match the server's hashes and were deleted to be fetched again: "
                      f"{', '.join(spoiled)}"] if spoiled else []) + ([f"still missing: {', '.join(missing)}"] if missing else [])
            errors.append(f"attempt {attempt}: {'; '.join(found)}")
        except Exception as err:  # noqa: BLE001 - sorted below into permanent, disk-full and transient
            permanent = explain_hub_error(err, repo_id)
            if permanent is not None and not _is_offline_miss(err):
                raise permanent from None
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise DiskFullError(
                    f"The disk holding {local_dir} is full: free about 16 GB or pass a local_dir on a larger disk; "
                    f"finished files are kept and the next run continues."
                ) from None
            errors.append(f"attempt {attempt}: {type(err).__name__}: {_first_line(err)}")
        if attempt < max_attempts:
            sleep(min(max_wait_s, first_wait_s * 2 ** (attempt - 1)))
    raise DownloadFailedError(
        f"{repo_id} did not download in {max_attempts} attempts (last: {errors[-1]}); finished files are kept and any "
        f"that failed verification deleted: run it again, or check HF_ENDPOINT.", errors
    )


# huggingface_hub names its snapshot bars; these are the two that count bytes
BYTES_WRITTEN_BAR = "huggingface_hub.snapshot_download"
BYTES_RECEIVED_BAR = "huggingface_hub.snapshot_download.transfer"


def download_bars():
    """huggingface_hub's own progress bars (its ``tqdm``: widgets in Jupyter, its off switches kept),
    labelled for what a download without Xet does: there is nothing to reconstruct, and the bytes
    received are the bytes written, so one bar counts them instead of two."""
    from huggingface_hub import constants
    from huggingface_hub.utils import tqdm as hub_tqdm

    if not constants.HF_HUB_DISABLE_XET:
        return hub_tqdm  # with Xet, reconstruction and transfer are two different things

    class PlainHttpBar(hub_tqdm):
        def __init__(self, *args, name: str | None = None, **kwargs):
            self._plain_bytes = name == BYTES_WRITTEN_BAR
            if name == BYTES_RECEIVED_BAR:
                kwargs["disable"] = True
            elif self._plain_bytes:
                kwargs["desc"] = "Downloading"
            super().__init__(*args, name=name, **kwargs)

        def set_description(self, desc=None, refresh=True):
            if self._plain_bytes and str(desc).startswith("Reconstruct"):
                desc = "Download complete"
            super().set_description(desc, refresh)

    return PlainHttpBar


def course_folder(repo_id: str) -> Path:
    """Where the course downloads ``repo_id`` (notebook 01) and where every later notebook finds it:
    ``<course cache>/downloads/<owner>--<name>``."""
    return cache_dir() / "downloads" / require_hub_id(repo_id).replace("/", "--")


def verified_download(repo_id: str) -> Path | None:
    """The course's download of ``repo_id`` if ``download`` finished it with every file verified, else None.
    Reads local files only: no request leaves the machine."""
    folder = course_folder(repo_id)
    record = folder / ".cache" / VERIFIED_RECORD
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if recorded.get("repo_id") != repo_id or not all((folder / name).is_file() for name in recorded.get("files", ())):
        return None
    return folder


def download_folder(local_dir) -> Path:
    """``local_dir`` as a writable folder, or one sentence saying why it cannot be."""
    if not isinstance(local_dir, (str, os.PathLike)):
        raise InvalidChoiceError(f"local_dir={local_dir!r} is not a folder path; pass a str or pathlib.Path.")
    local_dir = Path(local_dir).expanduser()
    if local_dir.exists() and not local_dir.is_dir():
        raise InvalidChoiceError(f"local_dir={str(local_dir)!r} is a file; pass a folder (it is created if missing).")
    return writable_folder(local_dir)


def forget(local_dir, name: str) -> None:
    """Delete a downloaded file and huggingface_hub's record of it: with the record in place it takes
    the file for current (same commit, same ETag) and never fetches it again."""
    from huggingface_hub._local_folder import get_local_download_paths

    paths = get_local_download_paths(Path(local_dir), name)
    paths.file_path.unlink(missing_ok=True)
    paths.metadata_path.unlink(missing_ok=True)


def expected_files(repo_id: str, *, endpoint: str | None = None, allow_patterns=COURSE_PATTERNS, revision: str = "main") -> dict:
    """``{file: checksums.Expected}`` as the server lists them (one tree request): the sha256 and size
    of each LFS file, the git blob id and size of the others."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint, token=hub_token(endpoint))
    expected = {}
    for entry in api.list_repo_tree(repo_id, recursive=True, revision=revision):
        if not isinstance(entry, RepoFile) or not any(fnmatch(entry.path, pattern) for pattern in allow_patterns):
            continue
        expected[entry.path] = (checksums.Expected(entry.lfs.sha256, "sha256", entry.lfs.size) if entry.lfs is not None
                                else checksums.Expected(entry.blob_id, "git-sha1", entry.size))
    return expected


def verify(repo_id: str, local_dir, *, endpoint: str | None = None, allow_patterns=COURSE_PATTERNS, revision: str = "main") -> dict:
    """Check every downloaded file against the server's checksum: sha256 for LFS files, the
    git blob id for the rest (what the Hub's ETag carries). Returns ``{file: "ok" | "missing" | "mismatch"}``."""
    require_hub_id(repo_id)
    if not isinstance(local_dir, (str, os.PathLike)) or not Path(local_dir).is_dir():
        raise ModelNotFoundError(f"No folder {str(local_dir)!r} to verify: download {repo_id} into it first with download.download.")
    return checksums.compare(local_dir, expected_files(repo_id, endpoint=endpoint, allow_patterns=allow_patterns, revision=revision))
