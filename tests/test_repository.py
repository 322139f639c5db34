"""Contracts over the repository itself: figures are rendered, not typed; the project never reads ../shared."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_results_table_is_rendered_from_the_recorded_measurements():
    done = subprocess.run([sys.executable, "tools/render_results.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_no_code_reads_the_shared_folder_outside_the_repository():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("helpers", "tests", "tools", "notebooks")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".ipynb", ".sh"} and path.name != Path(__file__).name
        and "../shared" in path.read_text(errors="ignore")
    ]
    assert offenders == []


def test_readme_names_the_two_setup_commands_near_the_top():
    head = (ROOT / "README.md").read_text().split("## Which model")[0]
    assert "make course" in head and "make test" in head


def test_the_gpu_workflow_runs_make_test_gpu_on_a_self_hosted_gpu_runner():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    job = workflow["jobs"]["gpu"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    assert any("make test-gpu" in step.get("run", "") for step in job["steps"])
