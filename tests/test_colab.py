"""Colab, statically: every notebook opens from its badge on a T4 runtime, its install cell is the one rendered from
helpers.links (so filling in the repository's address is one line and one command), and that cell asks pip for
the learner's stack only, holding Colab's torch. `make test-colab` runs the cell in a venv of Colab's versions."""

import copy
import json
import os
import re
from pathlib import Path

import pytest

from helpers import course, links

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_notebook_opens_from_its_own_colab_badge_on_a_t4_with_the_rendered_install_cell(path):
    assert course.colab_drift(path) == []


def notebook_with(path, change) -> dict:
    nb = copy.deepcopy(json.loads(path.read_text()))
    change(nb)
    return nb


@pytest.mark.parametrize("change,reported", [
    (lambda nb: nb["cells"][0].update(source="".join(nb["cells"][0]["source"]).replace("<owner>", "someone-else")), "badge"),
    (lambda nb: [c.update(source="".join(c["source"]).replace("<owner>", "stale"))
                 for c in nb["cells"] if "install" in c["metadata"].get("tags", [])], "install cell"),
    (lambda nb: nb["metadata"].pop("accelerator"), "T4"),
    (lambda nb: nb["cells"].pop(0), "badge"),
])
def test_a_stale_address_a_missing_badge_or_a_cpu_runtime_is_reported(change, reported):
    """The control: each check above fails on a notebook that drifted from helpers.links."""
    path = NOTEBOOKS[0]
    assert any(reported in line for line in course.colab_drift(path, notebook_with(path, change)))


def test_the_repository_address_is_written_in_one_place_and_everything_else_renders_it():
    holders = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
               if not {".venv", ".cache", "build", ".git"} & set(p.parts) and links.COURSE_REPOSITORY.split("//")[1] in p.read_text()]
    assert holders == ["helpers/links.py"]
    assert links.COURSE_REPOSITORY in course.install_cell()
    assert links.github_path() in links.colab_url("notebooks/00_setup.ipynb")


def test_the_readme_opens_the_first_notebook_in_colab():
    assert links.colab_badge("notebooks/00_setup.ipynb") in (ROOT / "README.md").read_text()


def test_the_learners_requirements_hold_no_local_or_test_tools():
    learner = (ROOT / "requirements.txt").read_text()
    names = {re.split(r"[<>=\s#]", line.strip())[0].lower() for line in learner.splitlines() if line.strip() and not line.startswith("#")}
    assert {"torch", "transformers", "accelerate", "bitsandbytes", "huggingface_hub", "ipywidgets"} <= names
    assert not names & {"jupyterlab", "nbclient", "nbval", "pytest", "ruff", "notebook"}
    assert "-r requirements.txt" in (ROOT / "requirements-local.txt").read_text()
    assert "-r requirements-local.txt" in (ROOT / "requirements-dev.txt").read_text()


def test_the_install_cell_holds_colabs_torch_and_installs_the_learners_requirements():
    cell = course.install_cell()
    assert '"requirements.txt"' in cell and "requirements-local" not in cell and "requirements-dev" not in cell
    assert "torch==" in cell and '"-e"' in cell
    assert "git\", \"clone\"" in cell and "use_drive_cache" in cell


def test_the_drive_cache_moves_both_caches_into_drive_before_huggingface_hub_reads_them(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "MyDrive").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", "")  # recorded first, so the test's setting is undone even where it was unset
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("GEMMA_COURSE_CACHE", os.environ.get("GEMMA_COURSE_CACHE", ""))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "MyDrive" / "gemma-course" / "huggingface"))
    root = course.use_drive_cache(mount_point=str(tmp_path))
    assert root == tmp_path / "MyDrive" / "gemma-course"
    assert os.environ["HF_HUB_CACHE"] == str(root / "huggingface") and os.environ["GEMMA_COURSE_CACHE"] == str(root / "course")


def test_a_drive_cache_set_after_huggingface_hub_read_its_cache_is_refused_with_the_fix(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "MyDrive").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("GEMMA_COURSE_CACHE", os.environ.get("GEMMA_COURSE_CACHE", ""))
    with pytest.raises(course.SetupError, match="restart the runtime"):
        course.use_drive_cache(mount_point=str(tmp_path))


def test_a_drive_that_is_not_mounted_is_a_clear_error(tmp_path):
    with pytest.raises(course.SetupError, match="does not exist"):
        course.use_drive_cache(mount_point=str(tmp_path / "no-drive"))

