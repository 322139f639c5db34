"""Serve a downloaded model to a classroom (or to yourself, offline) with an existing
Hub-compatible mirror server: olah, in offline mode, from a local git repository.

    python -m helpers.mirror serve ~/models/gemma-4-E4B-it                 # this machine only
    python -m helpers.mirror serve ~/models/gemma-4-E4B-it --classroom     # everyone on the network

Learners then set ``HF_ENDPOINT=http://<instructor-ip>:8090``, ``HF_HUB_DISABLE_XET=1`` and
``HF_HUB_DISABLE_IMPLICIT_TOKEN=1``, and ``hf download google/gemma-4-E4B-it`` pulls from the room
instead of the internet.

olah listens on loopback only. In front of it sits a small server of our own (``Front``), the only
thing the network can reach. It answers the file requests (``/<repo>/resolve/<rev>/<file>``) itself,
straight from the served snapshot on disk: ``sendfile`` from the page cache, never a whole file in
memory, with ``Range`` requests answered by the missing bytes (206), so twenty learners pulling the
same 2 GB shard cost the server no more RAM than one, and an interrupted file resumes. olah 0.5.4's
offline mode would read each whole file into memory per request and answer a ``Range`` with the
whole file. The revision and file-list requests (small JSON) are relayed to olah. Everything else is
refused before olah sees it: other paths (``/docs``, olah's ``/repos/...``), ``..`` and
percent-encoded dots, unknown organisations and repositories, other methods, and requests that
carry a hub token (a token has no business on a mirror that sends plain HTTP across a shared network).

olah runs in a virtual environment of its own: its dependencies (fastapi-utils pins
psutil<6) conflict with Jupyter's.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from .checksums import git_blob_sha1, sha256
from .download import is_hub_id
from .errors import CourseError, require_positive_number, require_whole_number
from .paths import cache_subfolder, venv_python, writable_folder

OLAH_VERSION = "0.5.4"
# olah's entry point, with a watch on its stdin: a pipe whose other end only the mirror's process holds, so it reads
# end-of-file when that process ends, however it ends (Ctrl+C, SIGKILL, a closed notebook kernel, Windows' Task
# Manager), and olah ends with it instead of serving on without the front's refusals. (os.read, not sys.stdin: a
# daemon thread inside the buffered reader would hold its lock when olah itself exits.)
OLAH_ENTRY = ("import os, sys, threading\n"
              "def parent_gone():\n"
              "    while os.read(sys.stdin.fileno(), 65536):\n"
              "        pass\n"
              "    os._exit(0)\n"
              "threading.Thread(target=parent_gone, daemon=True).start()\n"
              "from olah.server import cli; cli()\n")
OLAH_INSTALLED = "course-olah-installed"  # written last: a venv without it was interrupted mid-install
LFS_THRESHOLD_BYTES = 1024 * 1024  # files above this are stored as git-lfs objects, as on the Hub
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"
DEFAULT_PORT = 8090
SOURCE_RECORD = "course-source.json"  # in the served repository's .git: the content hashes it was built from
LEARNER_SETTINGS = "HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_IMPLICIT_TOKEN=1"


class MirrorError(CourseError):
    """The mirror could not be prepared or started."""

    entry = "the-classroom-mirror-does-not-start"


def olah_home() -> Path:
    override = os.environ.get("OLAH_HOME")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "gemma-course-tools" / f"olah-{OLAH_VERSION}"


def olah_command() -> list:
    """How to start olah: from this environment if olah is importable here (as on a GPU box with
    carried wheels), else from a virtual environment of its own, installed on first use."""
    import importlib.util

    if importlib.util.find_spec("olah") is not None:
        return [sys.executable, "-c", OLAH_ENTRY]
    home = olah_home()
    if not olah_installed(home):
        _install_olah_venv(home)
    # olah's entry point through the venv's python, not its script: the script is `olah-cli` under bin/ but
    # `olah-cli.exe` under Scripts\ on Windows, and a venv built aside and renamed has a stale shebang
    return [str(venv_python(home)), "-c", OLAH_ENTRY]


def olah_installed(home: Path) -> bool:
    """The marker this module writes last, or (venvs installed before the marker existed) olah's own script,
    which pip writes after the package."""
    return any((home / name).is_file() for name in (OLAH_INSTALLED, "bin/olah-cli", "Scripts/olah-cli.exe"))


def _install_olah_venv(home: Path) -> None:
    staging = home.with_name(f".{home.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True)
        subprocess.run([str(venv_python(staging)), "-m", "pip", "install", "-q", f"olah=={OLAH_VERSION}"], check=True)
        (staging / OLAH_INSTALLED).write_text(OLAH_VERSION)
    except subprocess.CalledProcessError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise MirrorError(f"Could not install olah {OLAH_VERSION} into {home} ({err}); check your connection to PyPI.") from None
    home.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, home)


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "course", "GIT_AUTHOR_EMAIL": "course@localhost",
           "GIT_COMMITTER_NAME": "course", "GIT_COMMITTER_EMAIL": "course@localhost"}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise MirrorError(f"git {' '.join(args)} failed in {repo}: {(done.stderr or done.stdout).strip()}")
    return done.stdout.strip()


# ---------------------------------------------------------------- the served repository

def require_repo_id(repo_id) -> str:
    """``owner/name`` as the Hub spells it; anything else could name a folder outside the mirror."""
    if not is_hub_id(repo_id):
        raise MirrorError(f"{repo_id!r} is not a valid repo id; use owner/name as on the Hub, e.g. google/gemma-4-E4B-it.")
    return repo_id


def repository_path(mirrors_root, repo_id: str) -> Path:
    """Where olah finds ``repo_id``: ``<mirrors_root>/models/<owner>/<name>``, never outside it."""
    models = Path(mirrors_root) / "models"
    target = models / require_repo_id(repo_id)
    if not target.resolve().is_relative_to(models.resolve()):  # defence in depth: the id check already refused it
        raise MirrorError(f"{repo_id!r} is not a valid repo id; it points outside {models}.")
    return target


def source_hashes(model_dir: Path) -> dict:
    """``{relative path: sha256}`` of every file the mirror would serve from ``model_dir``."""
    from tqdm.auto import tqdm

    # a download folder keeps huggingface_hub's metadata in .cache/ inside it: not part of the model
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and ".cache" not in p.relative_to(model_dir).parts)
    total = sum(p.stat().st_size for p in files)
    hashes = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing the model folder", disable=total < 10**9) as bar:
        for path in files:
            hashes[path.relative_to(model_dir).as_posix()] = sha256(path)
            bar.update(path.stat().st_size)
    return hashes


def prepare_repository(model_dir, mirrors_root, repo_id: str, lfs_threshold: int = LFS_THRESHOLD_BYTES) -> Path:
    """Lay ``model_dir`` out as the git repository olah serves: branch ``main`` (with ``master``
    every request answers 401), large files as git-lfs pointers with their objects under
    ``.git/lfs/objects``. Reused only while the folder's content hashes are those it was built
    from; otherwise rebuilt in a staging folder and swapped in (old aside, new in, old deleted)."""
    from filelock import FileLock

    lfs_threshold = require_whole_number(lfs_threshold, "lfs_threshold", minimum=0, unit="bytes")
    if shutil.which("git") is None:
        raise MirrorError("git is not installed: install it (apt install git / https://git-scm.com) and retry.")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise MirrorError(f"{model_dir} has no config.json; pass the folder of a downloaded or saved model.")
    target = repository_path(mirrors_root, repo_id)
    writable_folder(target.parent)
    record = {"files": source_hashes(model_dir), "lfs_threshold": lfs_threshold}
    with FileLock(str(target.parent / f".{target.name}.lock")):
        for leftover in target.parent.glob(f".{target.name}.partial-*"):  # a killed builder's, under the lock
            shutil.rmtree(leftover, ignore_errors=True)
        recorded = target / ".git" / SOURCE_RECORD
        if recorded.is_file() and json.loads(recorded.read_text()) == record:
            return target
        staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
        staging.mkdir()
        try:
            _lay_out(model_dir, staging, record)
            aside = target.with_name(f".{target.name}.partial-old-{uuid.uuid4().hex[:8]}")
            if target.exists():
                os.replace(target, aside)
            os.replace(staging, target)
            shutil.rmtree(aside, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _lay_out(model_dir: Path, repo: Path, record: dict) -> None:
    _git(repo, "init", "-q", "-b", "main")
    for relative, oid in record["files"].items():
        source, destination = model_dir / relative, repo / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        size = source.stat().st_size
        if size > record["lfs_threshold"]:
            obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
            obj.parent.mkdir(parents=True, exist_ok=True)
            try:
                # no second copy of 16 GB where the filesystem allows; an edit of the source in place then
                # edits this object too, which the content hashes catch at the next start
                os.link(source, obj)
            except OSError:
                shutil.copyfile(source, obj)
            destination.write_text(LFS_POINTER.format(oid=oid, size=size))
        else:
            shutil.copyfile(source, destination)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"snapshot of {model_dir.name}")
    (repo / ".git" / SOURCE_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))


@dataclass(frozen=True)
class ServedFile:
    """One file of the served snapshot: where its bytes lie on disk and what the Hub would say about it."""

    path: Path  # the work tree's copy, or the git-lfs object (a hard link to the source where possible)
    size: int
    etag: str  # the Hub's ETag: sha256 for an LFS file, the git blob id otherwise
    lfs: bool


def served_files(repository: Path) -> dict:
    """``{relative path: ServedFile}`` for a repository laid out by ``prepare_repository``."""
    record = json.loads((repository / ".git" / SOURCE_RECORD).read_text())
    files = {}
    for relative, oid in record["files"].items():
        obj = repository / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        if obj.is_file() and (repository / relative).stat().st_size < obj.stat().st_size:
            files[relative] = ServedFile(obj, obj.stat().st_size, oid, True)
        else:
            path = repository / relative
            files[relative] = ServedFile(path, path.stat().st_size, git_blob_sha1(path), False)
    return files


def byte_range(value: str | None, size: int) -> tuple | None:
    """``(first, last)`` for a single ``Range: bytes=...`` header; None to send the whole file (no header,
    several ranges, or one that does not parse, as RFC 9110 allows); ValueError when it starts past the end."""
    size = require_whole_number(size, "size", minimum=0, unit="bytes")
    if not value or not value.startswith("bytes=") or "," in value:
        return None
    first, dash, last = value[len("bytes="):].strip().partition("-")
    if not dash or not (first or last) or not (first.isdigit() or not first) or not (last.isdigit() or not last):
        return None
    if not first:  # bytes=-N: the last N bytes
        if int(last) == 0:
            raise ValueError(value)
        return max(0, size - int(last)), size - 1
    start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise ValueError(value)
    return start, end


def require_port(port, what: str = "port") -> int:
    """``port`` if it is a TCP port number (``True`` and ``"80"`` are not)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise MirrorError(f"{what}={port!r} is not a TCP port; pass a number from 1024 to 65535, e.g. {DEFAULT_PORT}.")
    return port


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- the front

HEAD_TIMEOUT_S = 30  # a client that has not sent its request head by then is cut off
RELAY_CHUNK_BYTES = 64 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
CREDENTIALS = {"authorization", "proxy-authorization", "cookie"}


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # the counter's key: method, token, body, path, encoded, traversal, route, repository
    message: str
    error_code: str = ""  # huggingface_hub turns X-Error-Code: RepoNotFound into RepositoryNotFoundError

    def response(self) -> bytes:
        body = json.dumps({"error": self.message}).encode()
        phrase = {400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}[self.status]
        lines = [f"HTTP/1.1 {self.status} {phrase}", "Content-Type: application/json", f"Content-Length: {len(body)}",
                 f"X-Error-Message: {self.message}", "Connection: close"]
        if self.error_code:
            lines.append(f"X-Error-Code: {self.error_code}")
        if self.status == 405:
            lines.append("Allow: GET, HEAD")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_request_head(head: bytes) -> tuple:
    """``(method, target, [(name, value), ...])`` of an HTTP/1.x request head; ValueError if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(version)
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return method, target, headers


def refusal(method: str, target: str, headers: list, repos: set) -> Refusal | None:
    """Why the front refuses a request, or None when it is one the Hub's client makes for a served repository:
    ``/api/models/<repo>[/revision|/tree/<rev>[/path]]`` or ``/<repo>/resolve/<rev>/<file>``, GET or HEAD."""
    names = {name.lower() for name, _ in headers}
    if method not in ("GET", "HEAD"):
        return Refusal(405, "method", f"{method} is not served here; this mirror answers GET and HEAD only.")
    if names & CREDENTIALS:
        return Refusal(400, "token", "This mirror refuses requests that carry a hub token or cookie: set "
                                     "HF_HUB_DISABLE_IMPLICIT_TOKEN=1 (helpers.download sends none) so it stays on your machine.")
    if "transfer-encoding" in names or any(name.lower() == "content-length" and value != "0" for name, value in headers):
        return Refusal(400, "body", "A GET or HEAD with a body is not served here.")
    path = target.split("?", 1)[0]
    if not path.startswith("/"):
        return Refusal(400, "path", "Only absolute paths are served here.")
    segments = []
    for raw in path[1:].removesuffix("/").split("/"):  # huggingface_hub lists a tree as .../tree/<rev>/
        lowered = raw.lower()
        if any(code in lowered for code in ("%2e", "%2f", "%5c", "%00", "%25")) or "\\" in raw:
            return Refusal(400, "encoded", "Percent-encoded dots, slashes and escapes are refused here.")
        decoded = unquote(raw)
        if decoded in ("", ".", "..") or any(ord(c) < 32 for c in decoded):
            return Refusal(400, "traversal", "Empty, '.' and '..' path segments are refused here.")
        segments.append(decoded)
    repo = None
    if segments[:2] == ["api", "models"] and len(segments) >= 4:
        repo, rest = f"{segments[2]}/{segments[3]}", segments[4:]
        if rest and not (rest[0] in ("revision", "tree") and len(rest) >= 2):
            repo = None
    elif len(segments) >= 5 and segments[2] == "resolve":
        repo = f"{segments[0]}/{segments[1]}"
    if repo is None:
        return Refusal(404, "route", "Not served here: this mirror answers the Hub's revision, file-list and file requests only.")
    if repo not in repos:
        return Refusal(404, "repository", f"Repository {repo} is not served by this mirror.", "RepoNotFound")
    return None


class Front:
    """What the network reaches: ``refusal`` decides; the served files are sent from disk, the rest is relayed to olah.

    ``files`` is ``{repo_id: {relative path: ServedFile}}`` and ``revisions`` the names the snapshot answers to
    (``main`` and its commit); a file request for anything else goes on to olah, which answers it as the Hub would."""

    def __init__(self, host: str, port: int, repos: set, files: dict | None = None, revisions=(), commit: str = ""):
        self.host, self.port, self.repos = host, require_port(port), set(repos)
        self.files, self.revisions, self.commit = files or {}, set(revisions), commit
        self.upstream_port = None
        self.refused: Counter = Counter()  # reason -> requests refused
        self.relayed = 0
        self.sent_from_disk: Counter = Counter()  # status (200, 206, 416) -> file requests answered here
        self._socket = self._server = None

    def bind(self) -> None:
        """Take the port now, before olah starts, so that a port in use is reported, not served by someone else."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self._socket = socket.create_server((self.host, self.port), family=family)
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE)):
                raise MirrorError(f"Cannot listen on {self.host}:{self.port} ({err.strerror or err}); another program "
                                  f"is using the port: pass another port (--port) or stop that program.") from None
            raise MirrorError(f"Cannot listen on {self.host}:{self.port} ({err.strerror or err}): this machine has no "
                              f"such address{' (IPv6 may be off)' if family == socket.AF_INET6 else ''}; pass "
                              f"--host {LOOPBACK}, or an address this machine has.") from None

    def serve(self, upstream_port: int) -> None:
        """Answer on the bound port, relaying what it does not refuse or send from disk to olah on ``upstream_port``."""
        if self._socket is None:
            raise MirrorError("The front holds no port yet; call bind() before serve(), so that a port in use is "
                              "reported before olah starts.")
        self.upstream_port = require_port(upstream_port, "upstream_port")
        self._server = ServerThread(self._handle, self._socket, f"mirror-front-{self.port}").start()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        elif self._socket is not None:
            self._socket.close()

    async def _handle(self, reader, writer):
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            method, target, headers = parse_request_head(head)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            writer.close()
            return
        refused = refusal(method, target, headers, self.repos)
        if refused is not None:
            self.refused[refused.reason] += 1
            writer.write(refused.response())
            await _drain_and_close(writer)
            return
        served = self.served_file(target)
        if served is not None:
            await self._send_file(writer, method, headers, served)
            return
        self.relayed += 1
        kept = [f"{name}: {value}" for name, value in headers if name.lower() not in HOP_BY_HOP | CREDENTIALS]
        forwarded = "\r\n".join([f"{method} {target} HTTP/1.1", *kept, "Connection: close", "", ""]).encode("latin-1")
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await _drain_and_close(writer)
            return
        try:
            up_writer.write(forwarded)
            await up_writer.drain()
            while chunk := await up_reader.read(RELAY_CHUNK_BYTES):
                writer.write(chunk)
                await writer.drain()  # at the client's pace: a 5 GB shard is never held here
        except ConnectionError:
            pass
        finally:
            up_writer.close()  # no await in here: a connection cancelled at stop must finish at once
        await _drain_and_close(writer)

    def served_file(self, target: str) -> ServedFile | None:
        """The file a ``/<owner>/<name>/resolve/<rev>/<path>`` request asks for, when this front serves it."""
        segments = [unquote(raw) for raw in target.split("?", 1)[0][1:].split("/")]
        if len(segments) < 5 or segments[2] != "resolve" or segments[3] not in self.revisions:
            return None
        return self.files.get(f"{segments[0]}/{segments[1]}", {}).get("/".join(segments[4:]))

    async def _send_file(self, writer, method: str, headers: list, served: ServedFile) -> None:
        asked = next((value for name, value in headers if name.lower() == "range"), None)
        common = ["Accept-Ranges: bytes", f'ETag: "{served.etag}"', f"X-Repo-Commit: {self.commit}", "Connection: close"]
        if served.lfs:  # what the Hub adds for LFS files; huggingface_hub reads the size and hash from these
            common += [f'X-Linked-Etag: "{served.etag}"', f"X-Linked-Size: {served.size}"]
        try:
            span = byte_range(asked, served.size)
        except ValueError:
            self.sent_from_disk[416] += 1
            writer.write("\r\n".join(["HTTP/1.1 416 Range Not Satisfiable", f"Content-Range: bytes */{served.size}",
                                       "Content-Length: 0", *common, "", ""]).encode("latin-1"))
            await _drain_and_close(writer)
            return
        first, last = span if span is not None else (0, served.size - 1)
        count = last - first + 1 if served.size else 0
        status = "206 Partial Content" if span is not None else "200 OK"
        lines = [f"HTTP/1.1 {status}", "Content-Type: application/octet-stream", f"Content-Length: {count}", *common]
        if span is not None:
            lines.append(f"Content-Range: bytes {first}-{last}/{served.size}")
        self.sent_from_disk[206 if span is not None else 200] += 1
        try:
            writer.write(("\r\n".join([*lines, "", ""])).encode("latin-1"))
            await writer.drain()
            if method == "GET" and count:
                with open(served.path, "rb") as handle:
                    # the kernel copies from the page cache to the socket, at the client's pace: nothing is held here
                    await asyncio.get_running_loop().sendfile(writer.transport, handle, first, count)
        except (ConnectionError, OSError):
            pass
        await _drain_and_close(writer)


class Service:
    """Something started and stopped, usable as ``with Service(...) as running:``."""

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class ServerThread:
    """An asyncio server on a thread of its own, on a socket already listening; ``stop`` ends its
    connections too (a stalled one included) and closes the socket."""

    def __init__(self, handler, listening: socket.socket, name: str):
        self.handler, self.listening, self.name = handler, listening, name
        self._loop = self._thread = None

    def start(self) -> ServerThread:
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            server = self._loop.run_until_complete(asyncio.start_server(self._closing_handler, sock=self.listening))
            ready.set()
            self._loop.run_forever()
            server.close()
            self._loop.run_until_complete(_cancel_connections())
            self._loop.run_until_complete(server.wait_closed())
            self._loop.run_until_complete(_cancel_connections())  # one accepted as the server closed
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=self.name)
        self._thread.start()
        ready.wait(10)
        return self

    async def _closing_handler(self, reader, writer):
        try:
            await self.handler(reader, writer)
        finally:
            if not writer.is_closing():  # cancelled at stop, or failed: the connection is closed either way
                writer.transport.abort()

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


async def _cancel_connections() -> None:
    """Connections still open when the server stops (a stalled client, a slow one) are ended, not orphaned,
    and so is any handler started while the others were ending: the loop closes with no task pending."""
    while True:
        await asyncio.sleep(0.05)  # the closes and accepts already scheduled run first
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if not others:
            return
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


async def _drain_and_close(writer) -> None:
    try:
        await writer.drain()
    except ConnectionError:
        pass
    writer.close()


# ---------------------------------------------------------------- the mirror

def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Mirror(Service):
    """A running olah server behind the front; use as a context manager. ``endpoint`` is what HF_ENDPOINT takes.

    Loopback unless ``classroom=True``, which listens on every interface (or on ``host``): the one
    switch that exposes the model to the network, and ``exposure()`` says what that means.

    In offline mode olah answers ``/api/models/<repo>/revision/<rev>`` (what ``snapshot_download``
    asks) but 401 for the bare ``/api/models/<repo>``."""

    def __init__(self, model_dir, repo_id: str, *, port: int | None = None, host: str | None = None,
                 classroom: bool = False, workdir=None, lfs_threshold: int = LFS_THRESHOLD_BYTES):
        self.repo_id = require_repo_id(repo_id)
        if not isinstance(classroom, bool):
            raise MirrorError(f"classroom={classroom!r} is not supported; pass True to serve the network, False for this machine.")
        self.classroom = classroom
        self.host = host or (EVERY_INTERFACE if classroom else LOOPBACK)
        if not isinstance(self.host, str) or (not classroom and not is_loopback(self.host)):
            raise MirrorError(f"host={self.host!r} would expose the mirror beyond this machine; pass classroom=True "
                              f"(python -m helpers.mirror serve --classroom) to serve the room on purpose.")
        self.port = free_port() if port is None else require_port(port)
        self.workdir = writable_folder(workdir) if workdir else cache_subfolder("mirror")
        self.mirrors_root = self.workdir / "mirrors"
        self.model_dir = Path(model_dir)
        self.repository = prepare_repository(model_dir, self.mirrors_root, repo_id, lfs_threshold)
        self.commit = _git(self.repository, "rev-parse", "HEAD")
        self.front = Front(self.host, self.port, {repo_id}, files={repo_id: served_files(self.repository)},
                           revisions={"main", self.commit}, commit=self.commit)
        self.olah_port = None
        self.process = None
        self.log = None

    @property
    def endpoint(self) -> str:
        host = LOOPBACK if self.host in (EVERY_INTERFACE, "::") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def olah_endpoint(self) -> str:
        """olah itself, on loopback: what the front relays to (tests show what it would do unguarded)."""
        return f"http://{LOOPBACK}:{self.olah_port}"

    def exposure(self) -> str:
        """One paragraph: who can reach the mirror, what it serves, what it refuses."""
        files = [p for p in self.model_dir.rglob("*") if p.is_file() and ".cache" not in p.relative_to(self.model_dir).parts]
        size = sum(p.stat().st_size for p in files) / 1e9
        served = f"{self.repo_id} ({len(files)} files, {size:.2f} GB)"
        refused = ("Nothing else is served: other paths, '..', encoded dots, other repositories and requests carrying "
                   "a hub token are refused before they reach olah.")
        if not self.classroom:
            return f"Serving {served} to this machine only, at {self.endpoint}. {refused}"
        where = "every network interface" if self.host in (EVERY_INTERFACE, "::") else self.host
        return (f"Classroom mode: anyone who can reach this machine on port {self.port} ({where}) can download {served} "
                f"over plain HTTP, without a password. {refused} Learners set {LEARNER_SETTINGS} so that their "
                f"hub token never travels; stop the mirror (Ctrl+C) when the class is over.")

    def start(self, timeout: float = 60) -> Mirror:
        """Bind the front, start olah and wait up to ``timeout`` seconds for it to serve this commit."""
        require_positive_number(timeout, "timeout")
        self.front.bind()  # first: a port taken by another server is an error, not a success
        try:
            self._start_olah(timeout)
            self.front.serve(self.olah_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_olah(self, timeout: float) -> None:
        import urllib.request

        command = olah_command()
        self.olah_port = free_port()
        config = self.workdir / f"olah-{self.port}.toml"
        config.write_text(
            "[basic]\n"
            f'host = "{LOOPBACK}"\nport = {self.olah_port}\n'
            f'mirrors-path = ["{self.mirrors_root.as_posix()}"]\n'
            f'repos-path = "{(self.workdir / "olah-cache").as_posix()}"\n'
            "[accessibility]\noffline = true\n"
        )
        self.log = open(self.workdir / f"olah-{self.port}.log", "w")
        self.process = subprocess.Popen([*command, "-c", str(config)], stdin=subprocess.PIPE, stdout=self.log,
                                        stderr=subprocess.STDOUT, cwd=self.workdir)
        probe = f"{self.olah_endpoint}/api/models/{self.repo_id}/revision/main"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MirrorError(f"olah exited at start ({self.log_tail()}); full log: {self.log.name}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as reply:
                    # ours only if it serves this repository at this commit: another server may hold the port
                    if reply.status == 200 and json.loads(reply.read()).get("sha") == self.commit:
                        return
            except (OSError, ValueError):
                time.sleep(0.3)
        raise MirrorError(f"olah did not answer on {self.olah_endpoint} within {timeout:.0f} s; see {self.log.name}")

    def log_tail(self, lines: int = 3) -> str:
        lines = require_whole_number(lines, "lines")
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail) or "no output"

    def stop(self) -> None:
        self.front.close()
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()  # olah's watch reads end-of-file and exits
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.log is not None:
            self.log.close()


def _stop_on_terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Serve a local model folder as a Hub mirror (olah, offline).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve until Ctrl+C")
    serve.add_argument("model_dir")
    serve.add_argument("--repo", default="google/gemma-4-E4B-it", help="the repo id learners will ask for")
    serve.add_argument("--classroom", action="store_true",
                       help="serve every machine that can reach this one (plain HTTP, no password); without it, only this machine")
    serve.add_argument("--host", help="with --classroom: the one address to listen on (default: every interface)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args(argv)
    try:
        mirror = Mirror(args.model_dir, args.repo, port=args.port, host=args.host, classroom=args.classroom).start()
    except CourseError as err:
        print(err, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_terminate)  # `kill` and a process manager stop it as Ctrl+C does: olah too
    endpoint = f"http://<this machine's address>:{mirror.port}" if args.classroom else mirror.endpoint
    try:  # the banner inside: a closed stdout (a broken pipe) still stops olah
        print(f"{mirror.exposure()}\nLearners run:\n"
              f"  export HF_ENDPOINT={endpoint} {LEARNER_SETTINGS}\n"
              f"  hf download {args.repo}\nCtrl+C stops it.", flush=True)
        code = mirror.process.wait()
        print(f"olah stopped by itself (exit {code}): {mirror.log_tail()}; full log: {mirror.log.name}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 1
    finally:
        mirror.stop()


if __name__ == "__main__":
    sys.exit(main())
