"""The notebooks' install cell in a fresh virtual environment with Colab's versions (tools/colab-versions.txt):
it must add bitsandbytes and the course, change nothing Colab ships (torch above all), and leave a stack on
which part of the CPU tier passes. Minutes, with network to PyPI: `make test-colab` runs it (COURSE_COLAB_VENV=1)."""

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from helpers import course, links
from helpers.paths import venv_python

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ROOT / "tools" / "colab-versions.txt"
# a slice of the CPU tier that loads, quantizes, places and explores tiny on Colab's libraries
CPU_SLICE = ["tests/test_loading.py", "tests/test_placement.py", "tests/test_anatomy.py", "tests/test_quantization.py"]

pytestmark = pytest.mark.skipif(os.environ.get("COURSE_COLAB_VENV") != "1",
                                reason="builds a venv from PyPI for minutes: make test-colab runs it")


def colab_pins() -> dict:
    pins = {}
    for line in VERSIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def frozen(python: Path) -> dict:
    done = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True)
    return {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1] for line in done.stdout.splitlines() if "==" in line}


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A Colab-like runtime: Colab's versions installed, the course already cloned into /content's stand-in."""
    home = tmp_path_factory.mktemp("colab")
    venv.create(home / "venv", with_pip=True)
    python = venv_python(home / "venv")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(VERSIONS)], check=True)
    content = home / "content"
    shutil.copytree(ROOT, content / links.repository_name(),
                    ignore=shutil.ignore_patterns(".venv", ".git", ".cache", "build", "__pycache__", "*.egg-info"))
    return python, content


def test_the_install_cell_on_colabs_versions_adds_bitsandbytes_and_the_course_and_changes_nothing_else(colab):
    python, content = colab
    before = frozen(python)
    public = {name: (before.get(name) or "").split("+")[0] for name in colab_pins()}  # 2.13.0+cpu is torch==2.13.0
    assert public == colab_pins(), "the venv does not hold Colab's versions"
    script = f"{course.install_cell()}\nimport helpers, bitsandbytes\nprint(helpers.__file__)"
    done = subprocess.run([str(python), "-c", script], cwd=content, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLAB_RELEASE_TAG": "course-test", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(content / links.repository_name() / "helpers"))
    after = frozen(python)
    changed = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
    added = set(after) - set(before)
    assert changed == {}, f"the install cell replaced what Colab ships: {changed}"
    assert "bitsandbytes" in added and "gemma4-small-gpu-course" in added, added


def test_part_of_the_cpu_tier_passes_on_colabs_versions(colab):
    python, content = colab
    clone = content / links.repository_name()
    installed = subprocess.run([str(python), "-c", "import helpers"], cwd=clone, capture_output=True)
    if installed.returncode != 0:
        pytest.skip("the install cell did not run: see the test above")
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *CPU_SLICE], cwd=clone,
                          capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(clone)})
    assert done.returncode == 0, done.stdout[-4000:]


