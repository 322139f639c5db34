"""Setting the course up wherever its learners are, without make: Windows (PowerShell), Linux, macOS and Colab.

    python -m helpers.course setup          # .venv: a CUDA torch when an NVIDIA GPU is present, the course, JupyterLab
    python -m helpers.course setup --dev    # the same plus the test tools (what `make test` uses)
    python -m helpers.course test           # ruff, the CPU tests, every notebook under nbval
    python -m helpers.course lab            # JupyterLab on notebooks/
    python -m helpers.course colab --write  # the notebooks' Colab badge and install cell, rendered from helpers.links

This module uses the standard library only: it runs under the Python that will create the venv.

On Colab the notebooks' install cell (``install_cell()``, the same in every notebook) clones the
course, installs ``requirements.txt`` with Colab's torch held where it is (pip then adds only what
Colab lacks: bitsandbytes) and the helpers; ``use_drive_cache`` keeps the downloaded model in
Google Drive, so it is downloaded once per learner and not once per notebook.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import errors, links
from .errors import CourseError, require_bool, require_whole_number
from .paths import CACHE_ENV, NOTEBOOKS_DIR, REPO_ROOT, venv_python, write_text_atomically

VENV = REPO_ROOT / ".venv"
INSTALLED_MARKER = ".course-installed"
# What a machine without CUDA installs first (the Makefile and CI too): the CPU build, pinned so that CI is repeatable.
CPU_TORCH = "torch==2.13.0"
# PyTorch's wheel indexes for NVIDIA GPUs, newest first, with the lowest driver each one runs on. A CUDA 13.0
# build needs an R580 driver; CUDA 12.x builds run on any R525 driver or newer (CUDA's minor-version
# compatibility), and 12.6 is the 12.x build with the widest driver range. An RTX 4060 (sm_89) runs either.
# A plain `pip install torch` on Windows is the CPU build: that is why the index is spelled out.
CUDA_TORCH_INDEXES = (("cu130", 580, "https://download.pytorch.org/whl/cu130"),
                      ("cu126", 525, "https://download.pytorch.org/whl/cu126"))
REQUIREMENTS = {"learner": "requirements.txt", "local": "requirements-local.txt", "dev": "requirements-dev.txt"}
DRIVE_MOUNT = "/content/drive"
DRIVE_FOLDER = "MyDrive/gemma-course"  # inside the learner's Drive: the Hugging Face cache and the course cache


class SetupError(CourseError):
    """A step of ``python -m helpers.course setup`` that failed."""

    entry = "setup-fails"


# ---------------------------------------------------------------- which torch

def nvidia_driver() -> str | None:
    """The NVIDIA driver version nvidia-smi reports (e.g. "581.57"), or None when there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else None


def cuda_torch_index(driver: str | None) -> str | None:
    """The PyTorch wheel index for this driver (None: no NVIDIA driver, or one older than any CUDA build here)."""
    if not driver:
        return None
    match = re.match(r"(\d+)", driver)
    major = int(match.group(1)) if match else 0
    return next((url for _, lowest, url in CUDA_TORCH_INDEXES if major >= lowest), None)


def torch_install_args(driver: str | None) -> list:
    """pip's arguments for the right torch: a CUDA build from PyTorch's index with an NVIDIA GPU, else the CPU build."""
    index = cuda_torch_index(driver)
    return ["torch", "--index-url", index] if index else [CPU_TORCH]


def fix_cpu_only_torch_command(driver: str | None, python: str = "python") -> str:
    """The exact command that replaces a CPU-only torch with a CUDA build for this driver."""
    index = cuda_torch_index(driver)
    if index is None:
        return "update the NVIDIA driver (R525 or newer, https://www.nvidia.com/drivers), then run python -m helpers.course setup"
    return f"{python} -m pip install --force-reinstall torch --index-url {index}"


# ---------------------------------------------------------------- setup, test, lab

def _run(command: list, what: str) -> None:
    print("+", " ".join(map(str, command)), flush=True)
    if subprocess.run(command).returncode != 0:
        raise SetupError(f"{what} failed (the output above says why); fix that and run python -m helpers.course setup again.")


def _torch_cuda(python: Path) -> str | None:
    """``torch.version.cuda`` as ``python`` sees it: None for a CPU build or no torch."""
    done = subprocess.run([str(python), "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() not in ("", "None") else None


def _has_torch(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0


def setup(dev: bool = False, venv: Path = VENV) -> Path:
    """Create ``venv`` (once), with a CUDA torch when an NVIDIA GPU is present, the course's requirements and the helpers."""
    require_bool(dev, "dev")
    driver = nvidia_driver()
    python = venv_python(venv)
    if not python.exists():
        # a machine whose Python already has a CUDA torch (a GPU box's image) lends it to the venv instead of a second copy
        borrow = driver is not None and _torch_cuda(Path(sys.executable)) is not None
        _run([sys.executable, "-m", "venv", *(["--system-site-packages"] if borrow else []), str(venv)], "creating the venv")
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], "upgrading pip")
    if driver is not None and _torch_cuda(python) is None:
        print(f"NVIDIA driver {driver}: installing a CUDA build of torch from {cuda_torch_index(driver) or 'PyPI'}", flush=True)
        _run([str(python), "-m", "pip", "install", "-q", *(["--force-reinstall"] if _has_torch(python) else []),
              *torch_install_args(driver)], "installing torch")
    elif driver is None and not _has_torch(python):
        print(f"No NVIDIA GPU: installing the CPU build {CPU_TORCH} first", flush=True)
        _run([str(python), "-m", "pip", "install", "-q", CPU_TORCH], "installing torch")
    requirements = REPO_ROOT / REQUIREMENTS["dev" if dev else "local"]
    _run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], f"installing {requirements.name}")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO_ROOT)], "installing the helpers")
    (venv / INSTALLED_MARKER).write_text(requirements.name)
    if configure_notebook_filter(python):
        print("git compares notebooks without what opening them adds (.gitattributes, filter course-notebook)")
    print(f"Ready: {python}. Next: python -m helpers.course lab (JupyterLab) or python -m helpers.course test.")
    return python


def require_setup(venv: Path = VENV) -> Path:
    python = venv_python(venv)
    if not (venv / INSTALLED_MARKER).is_file():
        raise SetupError(f"{venv} is not set up yet: run python -m helpers.course setup first.")
    return python


def test(venv: Path = VENV) -> int:
    """What `make test-cpu test-notebooks` and `make lint` run, without make."""
    python = require_setup(venv)
    if (venv / INSTALLED_MARKER).read_text().strip() != REQUIREMENTS["dev"]:
        raise SetupError(f"{venv} has the course but not the test tools: run python -m helpers.course setup --dev first.")
    notebooks = [str(p) for p in sorted(NOTEBOOKS_DIR.glob("*.ipynb"))]
    for command in ([str(python), "-m", "ruff", "check", "."], [str(python), "-m", "pytest", "tests", "-ra"],
                    [str(python), "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", *notebooks]):
        print("+", " ".join(command), flush=True)
        code = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}).returncode
        if code != 0:
            return code
    return 0


def lab_command(python, *, port: int | None = None, browser: bool = True, as_root: bool = False, extra=()) -> list:
    """The JupyterLab command ``lab`` runs: on notebooks/, on loopback (JupyterLab's default) unless ``extra`` says
    otherwise, ``--allow-root`` where the process is root (containers, cloud machines), then ``extra`` as given."""
    require_bool(browser, "browser")
    require_bool(as_root, "as_root")
    if port is not None:
        require_whole_number(port, "port", minimum=1, maximum=65535)
    command = [str(python), "-m", "jupyter", "lab", str(NOTEBOOKS_DIR)]
    command += [f"--port={port}"] if port is not None else []
    command += [] if browser else ["--no-browser"]
    command += ["--allow-root"] if as_root else []
    return command + list(extra)


def running_as_root() -> bool:
    """Root on Linux and macOS (Windows has no root user, and JupyterLab checks for none there)."""
    effective_user = getattr(os, "geteuid", None)  # POSIX only
    return effective_user is not None and effective_user() == 0


def lab(venv: Path = VENV, *, port: int | None = None, browser: bool = True, extra=()) -> int:
    python = require_setup(venv)
    as_root = running_as_root()
    if as_root:
        print("Running as root (a container or a cloud machine): JupyterLab is started with --allow-root.", flush=True)
    return subprocess.run(lab_command(python, port=port, browser=browser, as_root=as_root, extra=extra),
                          cwd=REPO_ROOT).returncode


# What JupyterLab writes into a notebook as it opens it, which differs from machine to machine: the kernel's
# language_info (its Python version) and the kernelspec of this machine's kernel. A notebook whose metadata already
# says what the kernel reports is not marked changed, so it is not autosaved (jupyter/notebook#2123). The repository
# keeps the venv's kernelspec and no language_info; the git filter `setup` configures writes this machine's
# language_info into each notebook it checks out (smudge) and takes it out again (clean), so a notebook a learner only
# opened is not "modified" and a later git pull does not conflict.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
NOTEBOOK_FILTER = "course-notebook"


def _notebook_text(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False) + "\n"  # as nbformat


def clean_notebook(text: str) -> str:
    """A notebook's text without what opening it on a machine adds (as the repository keeps it)."""
    nb = json.loads(text)
    nb.setdefault("metadata", {}).pop("language_info", None)
    nb["metadata"]["kernelspec"] = dict(KERNELSPEC)
    return _notebook_text(nb)


def smudge_notebook(text: str) -> str:
    """A notebook's text with the language_info this Python's ipykernel reports, as JupyterLab would write it."""
    from ipykernel.ipkernel import IPythonKernel

    nb = json.loads(clean_notebook(text))
    nb["metadata"]["language_info"] = json.loads(json.dumps(IPythonKernel.language_info))
    return _notebook_text(nb)


def write_notebook(nb, path) -> None:
    """Write a notebook (an nbformat node) as the repository keeps it: ``clean_notebook``'s form, whole or not at all."""
    import nbformat

    write_text_atomically(Path(path), clean_notebook(nbformat.writes(nb)))


def configure_notebook_filter(python: Path, repo: Path = REPO_ROOT) -> bool:
    """Tell this clone's git to keep notebooks through ``clean_notebook`` and check them out through
    ``smudge_notebook`` (.gitattributes names the filter), and check out again the notebooks nobody has changed;
    False where this is not a git checkout or git is missing."""
    if not isinstance(python, (str, os.PathLike)) or not Path(python).is_file():
        raise errors.InvalidChoiceError(f"configure_notebook_filter needs the path of a Python interpreter, not {errors.brief(python)}: "
                          "pass e.g. venv_python('.venv').")
    if not (repo / ".git").exists() or shutil.which("git") is None:
        return False

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    command = f'"{python}" -m helpers.course notebook'
    for key, value in (("clean", f"{command}-clean"), ("smudge", f"{command}-smudge"), ("required", "false")):
        git("config", f"filter.{NOTEBOOK_FILTER}.{key}", value)
    changed = set(git("ls-files", "-m", "--", "notebooks").splitlines())
    untouched = [name for name in git("ls-files", "--", "notebooks/*.ipynb").splitlines() if name not in changed]
    for name in untouched:
        (repo / name).unlink()
    if untouched:
        git("checkout", "--", *untouched)  # written again through the smudge filter, the index's stat refreshed
    return True


# ---------------------------------------------------------------- Colab

INSTALL_CELL = '''# Setup. Locally, `python -m helpers.course setup` has done this. On Colab this cell clones the course and
# adds only what Colab lacks (bitsandbytes and the course's helpers), keeping Colab's torch. Set
# KEEP_MODEL_IN_DRIVE = True on Colab to keep the downloaded model in Google Drive: downloaded once, not per notebook.
import importlib.metadata
import importlib.util
import os
import pathlib
import site
import subprocess
import sys

KEEP_MODEL_IN_DRIVE = False
COURSE_REPOSITORY = "{repository}"  # from helpers/links.py

if importlib.util.find_spec("helpers") is None:
    on_colab = "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ
    repo = pathlib.Path.cwd() / "{name}" if on_colab else pathlib.Path.cwd().parent
    if on_colab and not repo.is_dir():
        subprocess.run(["git", "clone", "--depth", "1", COURSE_REPOSITORY, str(repo)], check=True)
    if not (repo / "requirements.txt").is_file():
        raise RuntimeError("Open this notebook from the notebooks/ folder of a clone of the course, or on Colab.")
    # torch stays as it is (Colab's CUDA build): pip may add packages, never replace torch
    keep = [f"torch=={{importlib.metadata.version('torch')}}"] if importlib.util.find_spec("torch") else []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", str(repo / "requirements.txt"), *keep,
                    "-e", str(repo)], check=True)
    site.addsitedir(site.getsitepackages()[0])  # let this running kernel see the editable install
if KEEP_MODEL_IN_DRIVE:
    from helpers import course
    course.use_drive_cache()'''

BADGE_TAG = "colab-badge"
COLAB_METADATA = {"accelerator": "GPU", "colab": {"provenance": [], "gpuType": "T4"}}


def install_cell() -> str:
    """The install cell every notebook carries, rendered from the repository's address."""
    return INSTALL_CELL.format(repository=links.COURSE_REPOSITORY, name=links.repository_name())


def badge_cell_source(notebook: Path) -> str:
    return links.colab_badge(notebook.relative_to(REPO_ROOT).as_posix())


def colab_drift(notebook: Path, content: dict | None = None) -> list:
    """What in a notebook does not match ``helpers.links`` and ``install_cell()``: one line per difference."""
    nb = content if content is not None else json.loads(Path(notebook).read_text())
    cells, found = nb["cells"], []
    first = cells[0] if cells else {}
    if first.get("cell_type") != "markdown" or BADGE_TAG not in first.get("metadata", {}).get("tags", []):
        found.append("the first cell is not the Open in Colab badge")
    elif "".join(first["source"]) != badge_cell_source(notebook):
        found.append("the Colab badge does not point at this notebook in links.COURSE_REPOSITORY")
    installs = [c for c in cells if c["cell_type"] == "code" and "install" in c.get("metadata", {}).get("tags", [])]
    if len(installs) != 1 or "".join(installs[0]["source"]) != install_cell():
        found.append("the install cell is not course.install_cell()")
    for key, value in COLAB_METADATA.items():
        if nb["metadata"].get(key) != value:
            found.append(f"metadata[{key!r}] is not {value!r} (Colab would not offer a T4)")
    return found


def render_colab_cells(write: bool = False) -> dict:
    """``{notebook: differences}`` for every notebook; with ``write`` each is rewritten to match first."""
    require_bool(write, "write")
    import nbformat  # only here: rendering is a maintainer's step, run from the course's venv

    drift = {}
    for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        found = colab_drift(path)
        if found and write:
            nb = nbformat.read(path, as_version=4)
            if nb.cells and BADGE_TAG in nb.cells[0].metadata.get("tags", []):
                nb.cells[0].source = badge_cell_source(path)
            else:
                nb.cells.insert(0, nbformat.v4.new_markdown_cell(badge_cell_source(path), metadata={"tags": [BADGE_TAG]}))
            for cell in nb.cells:
                if cell.cell_type == "code" and "install" in cell.metadata.get("tags", []):
                    cell.source = install_cell()
            nb.metadata.update(json.loads(json.dumps(COLAB_METADATA)))
            write_notebook(nb, path)
            found = colab_drift(path)
        if found:
            drift[path.name] = found
    return drift


def use_drive_cache(folder: str = DRIVE_FOLDER, mount_point: str = DRIVE_MOUNT) -> Path:
    """Keep the Hugging Face cache and the course's cache in Google Drive (mounted on Colab first), so that every
    notebook, and every new runtime, finds the model downloaded once. Must run before huggingface_hub is used."""
    if "google.colab" in sys.modules and not Path(mount_point, "MyDrive").is_dir():
        from google.colab import drive  # exists on Colab only

        drive.mount(mount_point)
    root = Path(mount_point) / folder
    if not root.parent.is_dir():
        raise SetupError(
            f"{root.parent} does not exist: run this on Colab (it mounts Google Drive) or pass the folder to keep the cache in.")
    hub_cache = root / "huggingface"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants

        if Path(constants.HF_HUB_CACHE) != hub_cache:
            raise SetupError(f"huggingface_hub was imported before the Drive cache was set and still uses {constants.HF_HUB_CACHE}: "
                             "restart the runtime and run the install cell first.")
    os.environ["HF_HUB_CACHE"] = str(hub_cache)
    os.environ[CACHE_ENV] = str(root / "course")
    hub_cache.mkdir(parents=True, exist_ok=True)
    (root / "course").mkdir(parents=True, exist_ok=True)
    return root


# ---------------------------------------------------------------- command line

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.course", description="Set the course up without make.")
    sub = parser.add_subparsers(dest="command", required=True)
    setup_parser = sub.add_parser("setup", help="create .venv and install the course (a CUDA torch with an NVIDIA GPU)")
    setup_parser.add_argument("--dev", action="store_true", help="also the test tools (requirements-dev.txt)")
    sub.add_parser("test", help="ruff, the CPU tests and the notebooks under nbval")
    lab_parser = sub.add_parser("lab", help="JupyterLab on notebooks/ (other options are passed on to JupyterLab)")
    lab_parser.add_argument("--port", type=int, help="the port JupyterLab listens on (default: its own, 8888 or the next free)")
    lab_parser.add_argument("--no-browser", action="store_true", help="do not open a browser (print the link instead)")
    sub.add_parser("notebook-clean", help="(git's filter) a notebook from stdin without what opening it added, to stdout")
    sub.add_parser("notebook-smudge", help="(git's filter) a notebook from stdin with this kernel's language_info, to stdout")
    colab = sub.add_parser("colab", help="check (or --write) every notebook's Colab badge, metadata and install cell")
    colab.add_argument("--write", action="store_true")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "setup":
            setup(dev=args.dev)
            return 0
        if args.command == "test":
            return test()
        if args.command == "lab":
            return lab(port=args.port, browser=not args.no_browser, extra=extra)
        if args.command in ("notebook-clean", "notebook-smudge"):
            transform = clean_notebook if args.command == "notebook-clean" else smudge_notebook
            sys.stdout.buffer.write(transform(sys.stdin.buffer.read().decode("utf-8")).encode("utf-8"))  # no CRLF
            return 0
        drift = render_colab_cells(write=args.write)
        for name, found in drift.items():
            print(f"{name}: {'; '.join(found)}")
        print("every notebook matches helpers.links and the install cell" if not drift else
              "run python -m helpers.course colab --write")
        return 1 if drift else 0
    except CourseError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
