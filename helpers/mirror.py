"""Serve a downloaded model to a classroom (or to yourself, offline) with an existing
Hub-compatible mirror server: olah, in offline mode, from a local git repository.

    python -m helpers.mirror serve ~/models/gemma-4-E4B-it --repo google/gemma-4-E4B-it --host 0.0.0.0

Learners then set ``HF_ENDPOINT=http://<instructor-ip>:8090`` and ``HF_HUB_DISABLE_XET=1``, and
``hf download google/gemma-4-E4B-it`` pulls from the room instead of the internet.

olah runs in a virtual environment of its own: its dependencies (fastapi-utils pins
psutil<6) conflict with Jupyter's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .download import sha256
from .errors import CourseError
from .paths import cache_dir

OLAH_VERSION = "0.5.4"
LFS_THRESHOLD_BYTES = 1024 * 1024  # files above this are stored as git-lfs objects, as on the Hub
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


class MirrorError(CourseError):
    """The mirror could not be prepared or started."""


def olah_home() -> Path:
    override = os.environ.get("OLAH_HOME")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "gemma-course-tools" / f"olah-{OLAH_VERSION}"


def olah_command() -> list:
    """How to start olah: from this environment if olah is importable here (as on a GPU box with
    carried wheels), else from a virtual environment of its own, installed on first use."""
    import importlib.util

    if importlib.util.find_spec("olah") is not None:
        return [sys.executable, "-c", "from olah.server import cli; cli()"]
    home = olah_home()
    python = home / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    cli = python.parent / "olah-cli"
    if not cli.exists():
        _install_olah_venv(home)
    # the venv was built elsewhere and renamed, so run its script through its python, not its shebang
    return [str(python), str(cli)]


def _install_olah_venv(home: Path) -> None:
    staging = home.with_name(f".{home.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True)
        python = staging / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"olah=={OLAH_VERSION}"], check=True)
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


def repository_path(mirrors_root: Path, repo_id: str) -> Path:
    return Path(mirrors_root) / "models" / repo_id


def prepare_repository(model_dir, mirrors_root, repo_id: str, lfs_threshold: int = LFS_THRESHOLD_BYTES) -> Path:
    """Lay ``model_dir`` out as the git repository olah serves: branch ``main`` (with ``master``
    every request answers 401), large files as git-lfs pointers with their objects under
    ``.git/lfs/objects``. Built in a staging folder and renamed, so it is never half there."""
    if shutil.which("git") is None:
        raise MirrorError("git is not installed: install it (apt install git / https://git-scm.com) and retry.")
    model_dir = Path(model_dir)
    # a download folder keeps huggingface_hub's metadata in .cache/ inside it: not part of the model
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and ".cache" not in p.relative_to(model_dir).parts)
    if not (model_dir / "config.json").is_file():
        raise MirrorError(f"{model_dir} has no config.json; pass the folder of a downloaded or saved model.")
    target = repository_path(mirrors_root, repo_id)
    if (target / ".git").is_dir():
        return target
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        _git(staging, "init", "-q", "-b", "main")
        for source in files:
            relative = source.relative_to(model_dir)
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            size = source.stat().st_size
            if size > lfs_threshold:
                oid = sha256(source)
                obj = staging / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
                obj.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, obj)  # no copy of 16 GB where the filesystem allows
                except OSError:
                    shutil.copyfile(source, obj)
                destination.write_text(LFS_POINTER.format(oid=oid, size=size))
            else:
                shutil.copyfile(source, destination)
        _git(staging, "add", "-A")
        _git(staging, "commit", "-q", "-m", f"snapshot of {model_dir.name}")
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Mirror:
    """A running olah server; use as a context manager. ``endpoint`` is what HF_ENDPOINT takes.

    In offline mode olah answers ``/api/models/<repo>/revision/<rev>`` (what ``snapshot_download``
    asks) but 401 for the bare ``/api/models/<repo>``."""

    def __init__(self, model_dir, repo_id: str, *, port: int | None = None, host: str = "127.0.0.1", workdir=None,
                 lfs_threshold: int = LFS_THRESHOLD_BYTES):
        self.repo_id = repo_id
        self.host, self.port = host, port or free_port()
        self.workdir = Path(workdir) if workdir else cache_dir() / "mirror"
        self.mirrors_root = self.workdir / "mirrors"
        self.repository = prepare_repository(model_dir, self.mirrors_root, repo_id, lfs_threshold)
        self.process = None

    @property
    def endpoint(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60) -> Mirror:
        import urllib.request

        command = olah_command()
        config = self.workdir / f"olah-{self.port}.toml"
        self.workdir.mkdir(parents=True, exist_ok=True)
        config.write_text(
            "[basic]\n"
            f'host = "{self.host}"\nport = {self.port}\n'
            f'mirrors-path = ["{self.mirrors_root.as_posix()}"]\n'
            f'repos-path = "{(self.workdir / "olah-cache").as_posix()}"\n'
            "[accessibility]\noffline = true\n"
        )
        self.log = open(self.workdir / f"olah-{self.port}.log", "w")
        self.process = subprocess.Popen([*command, "-c", str(config)], stdout=self.log,
                                        stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.flush()
                tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-3:]
                raise MirrorError(f"olah exited at start ({' | '.join(tail) or 'no output'}); full log: {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/api/models/{self.repo_id}/revision/main", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise MirrorError(f"olah did not answer on {self.endpoint} within {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Serve a local model folder as a Hub mirror (olah, offline).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve until Ctrl+C")
    serve.add_argument("model_dir")
    serve.add_argument("--repo", default="google/gemma-4-E4B-it", help="the repo id learners will ask for")
    serve.add_argument("--host", default="0.0.0.0", help="0.0.0.0 to serve the room, 127.0.0.1 for yourself")
    serve.add_argument("--port", type=int, default=8090)
    args = parser.parse_args(argv)
    try:
        mirror = Mirror(args.model_dir, args.repo, port=args.port, host=args.host).start()
    except CourseError as err:
        print(err)
        return 2
    print(f"Serving {args.repo} from {args.model_dir}. Learners run:\n"
          f"  export HF_ENDPOINT=http://<this machine's address>:{args.port} HF_HUB_DISABLE_XET=1\n"
          f"  hf download {args.repo}\nCtrl+C stops it.")
    try:
        mirror.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        mirror.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
