"""File identities: the sha256 of an LFS file and the git blob id of a small one, as the Hub
records them, and a folder checked against recorded ones. Files are read in blocks: a 5 GB shard
is never held in memory."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

BLOCK_BYTES = 1 << 20
OK, MISSING, MISMATCH = "ok", "missing", "mismatch"


def _file_digest(path: Path, digest, header: bytes = b"") -> str:
    digest.update(header)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256(path) -> str:
    """The id of an LFS file (and the Hub's ETag for it)."""
    return _file_digest(Path(path), hashlib.sha256())


def git_blob_sha1(path) -> str:
    """The id git (and the Hub's ETag) gives a small file."""
    return _file_digest(Path(path), hashlib.sha1(), f"blob {Path(path).stat().st_size}\0".encode())


@dataclass(frozen=True)
class Expected:
    """What a file should be: its digest, which kind of digest, and its size where known."""

    digest: str
    kind: str = "sha256"  # or "git-sha1"
    size: int | None = None

    def matches(self, path: Path) -> bool:
        if self.size is not None and path.stat().st_size != self.size:
            return False  # a truncated or padded file: no need to read 5 GB to know
        return (sha256(path) if self.kind == "sha256" else git_blob_sha1(path)) == self.digest


def compare(folder, expected: dict) -> dict:
    """``{file: "ok" | "missing" | "mismatch"}`` for each ``{file: Expected}`` under ``folder``."""
    folder = Path(folder)
    result = {}
    for name, wanted in sorted(expected.items()):
        path = folder / name
        result[name] = MISSING if not path.is_file() else OK if wanted.matches(path) else MISMATCH
    return result


def failures(result: dict) -> dict:
    """The entries of a ``compare`` result that are not ``ok``."""
    return {name: status for name, status in result.items() if status != OK}
