"""The setup check a workshop attendee runs first: each failure names its fix."""

import subprocess
import sys
from collections import namedtuple

import pytest

from helpers import environment


def test_minimum_versions_are_read_from_requirements_txt():
    wanted = environment.required_versions()
    assert wanted["transformers"] == "5.5.2"
    assert "bitsandbytes" in wanted and "accelerate" in wanted


def test_a_too_old_transformers_is_a_failing_line_with_the_upgrade_command(monkeypatch):
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version", lambda p: "5.5.0" if p == "transformers" else real(p))
    report = environment.check()
    line = next(c for c in report.checks if c.name == "transformers")
    assert line.status == environment.FAIL and "pip install -U 'transformers>=5.5.2'" in line.fix
    assert not report.ready


def test_a_missing_bitsandbytes_is_a_failing_line(monkeypatch):
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version", lambda p: None if p == "bitsandbytes" else real(p))
    line = next(c for c in environment.check().checks if c.name == "bitsandbytes")
    assert line.status == environment.FAIL and "pip install" in line.fix


def test_a_small_windows_page_file_fails_and_explains_os_error_1455(monkeypatch):
    psutil = pytest.importorskip("psutil")
    Swap = namedtuple("Swap", "total")
    monkeypatch.setattr(environment.platform, "system", lambda: "Windows")
    monkeypatch.setattr(psutil, "swap_memory", lambda: Swap(4 * 1024**3))
    line = next(c for c in environment.check().checks if c.name == "Windows page file")
    assert line.status == environment.FAIL and "1455" in line.fix


def test_no_gpu_is_a_warning_not_a_failure_because_tiny_runs_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = next(c for c in environment.check().checks if c.name == "GPU")
    assert line.status == environment.WARN


def test_html_report_colours_failing_lines_red(monkeypatch):
    failing = environment.Check("bitsandbytes", "not installed", environment.FAIL, "pip install bitsandbytes")
    report = environment.EnvironmentReport([failing])
    assert environment.COLOURS[environment.FAIL] in report._repr_html_()
    assert "Not ready" in report._repr_html_()


def test_the_command_line_check_exits_nonzero_when_not_ready(tmp_path):
    ready = environment.check().ready
    done = subprocess.run([sys.executable, "-m", "helpers.environment"], capture_output=True, text=True)
    assert done.returncode == (0 if ready else 1)
    assert "ready for the course" in done.stdout


def test_the_command_line_check_exits_1_when_a_line_fails():
    failing = ("import sys, helpers.environment as e; "
               "e.package_checks = lambda: [e.Check('transformers', '4.57.6 (need >= 5.5.2)', e.FAIL, 'pip install -U')]; "
               "sys.exit(e.main())")
    done = subprocess.run([sys.executable, "-c", failing], capture_output=True, text=True)
    assert done.returncode == 1 and "NOT ready" in done.stdout
