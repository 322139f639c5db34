"""Is this machine ready for the course? One verdict per line, each with the action that fixes it.

Run it before a workshop:  python -m helpers.environment [--model NAME]   (exit status 1 if any line fails)
"""

from __future__ import annotations

import argparse
import html
import os
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import synthetic
from .course import fix_cpu_only_torch_command, nvidia_driver
from .download import course_folder, is_hub_id, verified_download
from .errors import CourseError, require_number, require_whole_number
from .host_memory import total_ram_bytes
from .models import requested
from .paths import CACHE_ENV, REPO_ROOT, cache_dir
from .placement import unique_tensors
from .planner import host_fits, predict_host
from .weights import meta_model

OK, WARN, FAIL = "ok", "warn", "fail"
FULL_CHECKPOINT_BYTES = 16e9  # google/gemma-4-E4B-it in bf16 safetensors
PLE_TABLE_BYTES = 5.64e9
MIN_GPU_FREE_BYTES = 5e9  # NF4 with the PLE on the CPU: 3.9 GB of weights plus a prefill
MIN_RAM_BYTES = 16e9
COLOURS = {OK: "#1a7f37", WARN: "#9a6700", FAIL: "#cf222e"}
# The page file at 16-32 GB (MB below): automatic management off first, else Windows keeps its own size.
PAGE_FILE_FIX = ("Set-CimInstance -Query 'SELECT * FROM Win32_ComputerSystem' -Property @{AutomaticManagedPagefile=$false}; "
                 "Get-CimInstance Win32_PageFileSetting | Set-CimInstance -Property @{InitialSize=16384; MaximumSize=32768}")


@dataclass
class Check:
    name: str
    value: str
    status: str
    fix: str = ""


@dataclass
class EnvironmentReport:
    checks: list = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def __str__(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"{c.status.upper():<4}  {c.name:<{width}}  {c.value}" + (f"\n      -> {c.fix}" if c.fix else "")
                 for c in self.checks]
        verdict = "ready for the course" if self.ready else "NOT ready: fix the FAIL lines above"
        return "\n".join(lines + [verdict])

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='color:{COLOURS[c.status]};font-weight:bold'>{c.status.upper()}</td>"
            f"<td>{html.escape(c.name)}</td><td>{html.escape(c.value)}</td><td>{html.escape(c.fix)}</td></tr>"
            for c in self.checks
        )
        return (f"<table><tr><th></th><th>check</th><th>found</th><th>what to do</th></tr>{rows}</table>"
                f"<p><b>{'Ready for the course.' if self.ready else 'Not ready: fix the red lines.'}</b></p>")

    def as_dict(self) -> dict:
        return {"ready": self.ready, "checks": [c.__dict__ for c in self.checks]}


def required_versions(requirements: Path = REPO_ROOT / "requirements.txt") -> dict:
    """Minimum versions from requirements.txt, the single place they are written."""
    wanted = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", line.split("#")[0].strip())
        if match:
            wanted[match.group(1).lower().replace("_", "-")] = match.group(2)
    return wanted


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def bf16_is_native(major: int, minor: int = 0) -> bool:
    """bf16 arithmetic in hardware from compute capability 8.0 (Ampere) on; a T4 (7.5) emulates it."""
    major = require_whole_number(major, "major", minimum=0)
    minor = require_whole_number(minor, "minor", minimum=0)
    return (major, minor) >= (8, 0)


def on_windows() -> bool:
    return platform.system() == "Windows"


def gb(value: float) -> str:
    require_number(value, "value")
    return f"{value / 1e9:.1f} GB"


def package_checks() -> list:
    from packaging.version import Version

    checks = []
    for package, minimum in required_versions().items():
        found = installed_version(package)
        if found is None:
            checks.append(Check(package, "not installed", FAIL, f"pip install '{package}>={minimum}'"))
        elif Version(found.split("+")[0]) < Version(minimum):
            checks.append(Check(package, f"{found} (need >= {minimum})", FAIL,
                                f"pip install -U '{package}>={minimum}', then restart the kernel"))
        else:
            checks.append(Check(package, found, OK))
    return checks


def gpu_checks() -> list:
    import torch

    if not torch.cuda.is_available():
        driver = nvidia_driver()
        if driver is not None and torch.version.cuda is None:
            # the Windows trap: `pip install torch` there is the CPU build, so the RTX 4060 sits unused
            return [Check("GPU", f"an NVIDIA GPU (driver {driver}) but torch {torch.__version__} is a CPU-only build", FAIL,
                          f"{fix_cpu_only_torch_command(driver, sys.executable)}, then restart the kernel")]
        fix = ("Runtime > Change runtime type > T4 GPU" if in_colab()
               else "the tiny model runs on CPU; the E4B lessons need an NVIDIA GPU and a CUDA build of torch")
        return [Check("GPU", "no CUDA device visible to torch", WARN, fix)]
    checks = []
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    checks.append(Check("GPU", f"{props.name}, {gb(total)} total", OK))
    checks.append(Check("GPU memory free", gb(free), OK if free >= MIN_GPU_FREE_BYTES else FAIL,
                        "" if free >= MIN_GPU_FREE_BYTES else
                        "close other notebooks or restart the kernel: E4B in NF4 with the PLE on CPU needs about 5 GB"))
    checks.append(Check("CUDA (torch build)", str(torch.version.cuda), OK))
    driver = nvidia_driver()
    checks.append(Check("NVIDIA driver", driver or "unknown (nvidia-smi not found)", OK if driver else WARN))
    native_bf16 = bf16_is_native(props.major, props.minor)
    checks.append(Check(
        "bf16", "native" if native_bf16 else f"emulated (compute capability {props.major}.{props.minor})",
        OK if native_bf16 else WARN,
        "" if native_bf16 else "on a T4 or older, use bnb_4bit_compute_dtype=torch.float16: bf16 is emulated and slow",
    ))
    return checks


def memory_checks(download_dir: Path | None = None) -> list:
    checks = []
    try:
        import psutil

        ram = psutil.virtual_memory().total
        checks.append(Check("RAM", gb(ram), OK if ram >= MIN_RAM_BYTES else WARN,
                            "" if ram >= MIN_RAM_BYTES else
                            f"with the PLE on the CPU the table alone takes {gb(PLE_TABLE_BYTES)} of RAM"))
        if on_windows():
            page_file = psutil.swap_memory().total
            enough = page_file >= FULL_CHECKPOINT_BYTES
            checks.append(Check(
                "Windows page file", gb(page_file), OK if enough else FAIL,
                "" if enough else f"in PowerShell as administrator: {PAGE_FILE_FIX}, then reboot; without it "
                "loading fails with `os error 1455` (the paging file is too small)",
            ))
    except ImportError:
        checks.append(Check("RAM", "unknown (pip install psutil)", WARN))
    checks += host_ram_checks()
    where = download_dir or Path(os.environ.get("HF_HUB_CACHE", Path.home() / ".cache" / "huggingface"))
    probe = where if where.exists() else Path.home()
    free = shutil.disk_usage(probe).free
    checks.append(Check(f"free disk at {where}", gb(free), OK if free >= 1.1 * FULL_CHECKPOINT_BYTES else WARN,
                        "" if free >= 1.1 * FULL_CHECKPOINT_BYTES else
                        "the full checkpoint needs 16 GB: free space or set HF_HUB_CACHE to a larger disk"))
    return checks


def hf_home() -> Path:
    """Where huggingface_hub keeps its files: ``HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ~/.cache/huggingface."""
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface"


def hub_cache() -> Path:
    """Where downloads from the hub go: ``HF_HUB_CACHE``, else ``<HF_HOME>/hub``."""
    return Path(os.environ["HF_HUB_CACHE"]).expanduser() if os.environ.get("HF_HUB_CACHE") else hf_home() / "hub"


def write_problem(path: Path) -> str | None:
    """Why the course could not create and write files in ``path`` (``None``: it can), found without
    creating anything: a file where the folder should be, or a folder (or its nearest existing parent)
    that refuses a new file."""
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        handle, name = tempfile.mkstemp(dir=probe, prefix=".write-probe-")
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        return f"{probe} cannot be written ({err.strerror or err})"
    return None


def folder_checks() -> list:
    """The folders the course writes: its own cache, huggingface_hub's home and its download cache. A file
    where a folder should be, or a folder that cannot be written, fails the first load or download."""
    checks, folders = [], []
    try:
        folders.append((f"course cache ({CACHE_ENV})", cache_dir(), CACHE_ENV))
    except CourseError as err:  # GEMMA_COURSE_CACHE names a file
        checks.append(Check(f"course cache ({CACHE_ENV})", os.environ.get(CACHE_ENV, ""), FAIL, err.sentence))
    folders += [("huggingface home (HF_HOME)", hf_home(), "HF_HOME"), ("download cache (HF_HUB_CACHE)", hub_cache(), "HF_HUB_CACHE")]
    for name, path, setting in folders:
        problem = write_problem(path)
        checks.append(Check(name, problem or str(path), FAIL if problem else OK,
                            f"set {setting} to a folder you can write (or fix its permissions)" if problem else ""))
    return checks


def checkpoint_bytes(shape: str) -> int:
    """The bytes a synthetic build of ``shape`` writes: every tensor once, in bf16 as the checkpoint stores it."""
    return sum(tensor.numel() * tensor.element_size() for *_, tensor in unique_tensors(meta_model(synthetic.gemma4_config(shape))))


def model_disk_check(model: str | None = None, download_dir: Path | None = None) -> Check:
    """Is there room for the chosen model (``--model``, else ``$GEMMA_MODEL``, else tiny) where it will be
    written: a synthetic build or a hub download in the course cache (none where it is there already), a folder nowhere."""
    name = requested(model)
    if name in synthetic.SHAPES:
        where = cache_dir()
        need = 0 if synthetic.is_complete(synthetic.default_destination(name)) else checkpoint_bytes(name)
        fix = f"free space or set {CACHE_ENV} to a larger disk"
    elif is_hub_id(name) and not Path(name).exists():  # notebook 01 downloads into the course cache
        where = download_dir or course_folder(name)
        need = 0 if verified_download(name) is not None else FULL_CHECKPOINT_BYTES
        fix = f"free space or set {CACHE_ENV} to a larger disk"
    elif (Path(name).expanduser() / "config.json").is_file():
        return Check(f"disk for {name}", "a folder already on disk: nothing to write", OK)
    elif Path(name).expanduser().is_dir():
        return Check(f"model {name}", "a folder without config.json", FAIL,
                     "pass --model the folder of a downloaded or saved model (the one holding config.json)")
    else:
        return Check(f"model {name}", "no such folder, hub id or synthetic name", FAIL,
                     f"pass --model an existing folder, a hub id like google/gemma-4-E4B-it, or one of "
                     f"{', '.join(synthetic.SHAPES)}")
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe if probe.is_dir() else probe.parent).free
    enough = free >= need
    return Check(f"disk for {name} at {where}", f"{gb(free)} free, needs {gb(need)}" if need else f"{gb(free)} free, on disk already",
                 OK if enough else FAIL, "" if enough else f"{name} needs {gb(need)} at {where}: {fix}")


def host_ram_checks(model: str = "e4b-shape") -> list:
    """Will this machine's RAM hold E4B NF4 in each placement? The planner's anonymous peak (what runs
    a VM out of memory) against the RAM, minus an allowance for the system."""
    ram = total_ram_bytes()
    checks = []
    for label, ple, copied in (("PLE on the CPU from the first byte", "cpu", False), ("PLE moved after loading", "gpu", True)):
        estimate = predict_host(model, "nf4", ple, offload_after_load=copied)
        enough = host_fits(estimate, ram)
        checks.append(Check(f"RAM for E4B NF4, {label}", f"needs about {gb(estimate.anon_generate_bytes)} of {gb(ram)}",
                            OK if enough else WARN, "" if enough else
                            "load with ple='cpu' (the table then stays in the memory-mapped file) or close other programs"))
    return checks


def check(download_dir: Path | None = None, model: str | None = None) -> EnvironmentReport:
    """Everything the course needs, as one report (printable, HTML in a notebook, ``as_dict``); ``model``:
    the one the course will load (default ``$GEMMA_MODEL``, else tiny), for the disk it needs."""
    python_ok = sys.version_info >= (3, 10)
    checks = [
        Check("Python", platform.python_version(), OK if python_ok else FAIL, "" if python_ok else "use Python 3.10 or newer"),
        Check("platform", f"{platform.system()} {platform.machine()}" + (" (Colab)" if in_colab() else ""), OK),
    ]
    checks += package_checks()
    if installed_version("torch") is not None:
        checks += gpu_checks()
    checks += memory_checks(download_dir)
    checks += folder_checks()
    try:
        checks.append(model_disk_check(model, download_dir))
    except CourseError as err:  # a model name that is no model, or a cache that is a file (its own line above)
        checks.append(Check("disk for the chosen model", str(model or os.environ.get("GEMMA_MODEL", "")), FAIL, err.sentence))
    return EnvironmentReport(checks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.environment", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the model the course will load (default: $GEMMA_MODEL, else tiny)")
    args = parser.parse_args(argv)  # an unknown argument: argparse's one line and exit status 2
    try:
        report = check(model=args.model)
    except CourseError as err:  # an empty --model: its sentence, not a traceback
        print(err, file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ready else 1


if __name__ == "__main__":
    sys.exit(main())
