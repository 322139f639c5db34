"""What a learner meets first: the README that starts the course, `python -m helpers.course lab` where learners are
(root in a container, another port, no browser), and notebooks that are not "modified" once opened."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import course
from helpers.errors import CourseError

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_readme_is_a_landing_page_with_the_setup_commands_on_its_first_screen():
    lines = README.splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:40])
    assert "python -m helpers.course setup" in first_screen and "python -m helpers.course lab" in first_screen
    for page in ("docs/results.md", "docs/troubleshooting.md", "docs/instructor-guide.md", "tests/README.md"):
        assert f"]({page})" in README and (ROOT / page).is_file(), page
    assert all(f"`{path.stem}`" in README for path in NOTEBOOKS)  # the notebooks, one line each


def test_lab_as_root_says_so_and_passes_allow_root_and_the_learners_own_options_on():
    command = course.lab_command("python", port=8890, browser=False, as_root=True, extra=["--ServerApp.token=abc"])
    assert command[:4] == ["python", "-m", "jupyter", "lab"]
    assert command[5:] == ["--port=8890", "--no-browser", "--allow-root", "--ServerApp.token=abc"]
    assert "--allow-root" not in course.lab_command("python") and "--ip" not in " ".join(course.lab_command("python"))


@pytest.mark.parametrize("port", [0, 70000, 8.5, "8890"])
def test_lab_refuses_a_port_that_is_not_one_in_one_sentence(port):
    with pytest.raises(CourseError, match="port"):
        course.lab_command("python", port=port)


def test_the_command_line_passes_unknown_options_to_jupyterlab_and_refuses_them_elsewhere(monkeypatch):
    seen = {}
    monkeypatch.setattr(course, "lab", lambda **kwargs: seen.update(kwargs) or 0)
    assert course.main(["lab", "--port", "8890", "--no-browser", "--ServerApp.ip=127.0.0.1"]) == 0
    assert seen == {"port": 8890, "browser": False, "extra": ["--ServerApp.ip=127.0.0.1"]}
    with pytest.raises(SystemExit):
        course.main(["test", "--bogus"])


def committed(path: Path) -> str:
    """The notebook as git keeps it (the working file may carry this machine's language_info, from the filter)."""
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{path.relative_to(ROOT).as_posix()}"], capture_output=True)
    return done.stdout.decode("utf-8") if done.returncode == 0 else path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_committed_notebook_is_already_in_the_form_the_git_filter_keeps(path):
    text = committed(path)
    assert course.clean_notebook(text) == text
    assert course.clean_notebook(course.smudge_notebook(text)) == text  # checked out and cleaned again: unchanged


def kernel_language_info() -> dict:
    """What a real kernel of this Python reports, which JupyterLab writes into a notebook it opens."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        return client.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checked_out_notebook_already_says_what_the_kernel_reports_so_opening_it_changes_nothing(tmp_path, monkeypatch):
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", repo)
    notebook = repo / "notebooks" / NOTEBOOKS[0].name
    notebook.write_text(committed(NOTEBOOKS[0]), encoding="utf-8")  # as git keeps it (this clone's may be smudged)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path)}

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "course")
    reported = kernel_language_info()
    assert "language_info" not in json.loads(notebook.read_text())["metadata"]  # the control: as committed, opening adds it
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # git runs the filter with the course importable, as setup's venv has it
    assert course.configure_notebook_filter(Path(sys.executable), repo)
    metadata = json.loads(notebook.read_text())["metadata"]
    assert metadata["language_info"] == reported and metadata["kernelspec"] == course.KERNELSPEC
    assert git("status", "--porcelain") == ""
    lab_saved = json.loads(notebook.read_text())
    lab_saved["metadata"]["language_info"]["version"] = "3.99.0"  # even a save from another Python is no change
    notebook.write_text(json.dumps(lab_saved, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    assert git("diff", "--stat") == ""
    lab_saved["cells"][1]["source"] = "changed"
    notebook.write_text(json.dumps(lab_saved, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    assert git("diff", "--stat").strip()  # a real change still shows
