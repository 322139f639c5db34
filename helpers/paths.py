"""Where the course keeps its files: the one place each data path is spelled."""

import os
import tempfile
from pathlib import Path

from .errors import UnwritableFolderError

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
CONFIG_DIR = DATA_DIR / "configs"
MEASUREMENTS_DIR = DATA_DIR / "measurements"  # the benchmark's records, one JSONL file per model
GPU_TIER_DIR = DATA_DIR / "gpu-tier"  # the GPU tier's records and notebook runs
PLANNER_DIR = DATA_DIR / "planner"  # the planner's calibration
BUILDS_DIR = DATA_DIR / "builds"  # how long a synthetic build took and how much host memory it needed
FAULTS_DIR = DATA_DIR / "faults"  # recorded fault-injection runs (tools/fault_run.py)
GGUF_DIR = DATA_DIR / "gguf"  # the llama.cpp route measured on a checkpoint (python -m helpers.gguf_route measure)
CLASSROOM_DIR = DATA_DIR / "classroom"  # the classroom mirror under a room's load (python -m lab.classroom load)
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
COURSE_RUNS_DIR = DATA_DIR / "course-runs"  # seconds per notebook, recorded by tools/run_course.py --record
CITED_DIR = DATA_DIR / "cited"  # published figures the course cites beside its own, never measured here
CHAT_DIR = DATA_DIR / "chat"  # what each transformers release does with a plain-string message (tools/)
BUILD_DIR = REPO_ROOT / "build"  # executed notebooks and JUnit files, never committed
CACHE_ENV = "GEMMA_COURSE_CACHE"


def cache_dir() -> Path:
    """Synthetic checkpoints live here; ``GEMMA_COURSE_CACHE`` moves them (e.g. to a bigger disk)."""
    override = os.environ.get(CACHE_ENV)
    path = Path(override).expanduser() if override else Path.home() / ".cache" / "gemma-course"
    if path.exists() and not path.is_dir():
        raise UnwritableFolderError(
            f"{CACHE_ENV}={override!r} is a file, not a folder; point it at a folder (it is created if missing)."
            if override else f"{path} is a file, so the course cannot keep its cache there; move it away or set {CACHE_ENV}.")
    return path


def writable_folder(path, *, setting: str | None = None) -> Path:
    """``path``, created if missing and proven writable, else one sentence saying what to change:
    ``setting`` names the environment variable that chose it (else the folder is the caller's choice)."""
    path = Path(path)
    fix = f"set {setting} to a folder you can write" if setting else "choose a folder you can write"
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=path, prefix=".write-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise UnwritableFolderError(f"The course cannot write to {path} ({err.strerror or err}): {fix}.") from None
    return path


def write_text_atomically(path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: written aside, then renamed over it, so a kill
    mid-write leaves the previous file (or none) and no half-written one that looks complete."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.partial")
    try:
        aside.write_text(text)
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def cache_subfolder(*parts: str) -> Path:
    """A folder inside the course cache, created and writable, or the sentence naming GEMMA_COURSE_CACHE."""
    return writable_folder(cache_dir().joinpath(*parts), setting=CACHE_ENV)


def kernel_folder(*parts: str) -> Path:
    """An empty folder of this kernel's own inside the course cache (``cache/<parts>/kernel-<pid>``), so two kernels
    on one cache (a classroom server, an instructor simulating two cards side by side, the card sweep) never read
    each other's half-made files. Folders of kernels that have ended, a kill included, are removed first, and this
    one goes when this kernel ends."""
    import atexit
    import shutil

    import psutil

    root = cache_subfolder(*parts)
    for folder in root.glob("kernel-*"):
        pid = folder.name.removeprefix("kernel-")
        if not (pid.isdigit() and psutil.pid_exists(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)
    mine = root / f"kernel-{os.getpid()}"
    shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir()
    atexit.register(shutil.rmtree, mine, True)
    return mine


def practice_folder() -> Path:
    """Notebook 01's practice run (its download and its mirror): a ``kernel_folder`` of its own."""
    return kernel_folder("practice")


def venv_python(venv, os_name: str | None = None) -> Path:
    """The interpreter of a virtual environment: ``Scripts\\python.exe`` on Windows, ``bin/python`` elsewhere."""
    windows = (os_name or os.name) == "nt"
    return Path(venv) / ("Scripts" if windows else "bin") / ("python.exe" if windows else "python")
