"""The setup check a workshop attendee runs first: each failure names its fix."""

import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

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
    assert ("ready for the course" if ready else "NOT ready: fix the FAIL lines") in done.stdout


def test_the_command_line_check_exits_1_when_a_line_fails():
    failing = ("import sys, helpers.environment as e; "
               "e.package_checks = lambda: [e.Check('transformers', '4.57.6 (need >= 5.5.2)', e.FAIL, 'pip install -U')]; "
               "sys.exit(e.main())")
    done = subprocess.run([sys.executable, "-c", failing], capture_output=True, text=True)
    assert done.returncode == 1 and "NOT ready" in done.stdout


UNWRITABLE = "/proc/gemma-course-check"  # no process, root included, can create anything here
needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc for a folder nobody can write")


def line_named(report, start: str):
    return next(c for c in report.checks if c.name.startswith(start))


@pytest.mark.parametrize("variable,line", [("GEMMA_COURSE_CACHE", "course cache"), ("HF_HUB_CACHE", "download cache"),
                                           ("HF_HOME", "huggingface home")])
def test_a_cache_variable_naming_a_file_fails_its_line(variable, line, tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    monkeypatch.setenv(variable, str(a_file))
    report = environment.check()
    assert line_named(report, line).status == environment.FAIL and variable in line_named(report, line).fix
    assert not report.ready and "NOT ready" in str(report)


@pytest.mark.parametrize("variable,line", [("GEMMA_COURSE_CACHE", "course cache"), ("HF_HUB_CACHE", "download cache"),
                                           ("HF_HOME", "huggingface home")])
def test_the_same_variables_naming_writable_folders_pass(variable, line, tmp_path, monkeypatch):
    # the control: a folder, existing or to be created, that can be written
    monkeypatch.setenv(variable, str(tmp_path / "new" / "folder"))
    assert line_named(environment.check(), line).status == environment.OK
    assert not (tmp_path / "new").exists()  # the check created nothing


@needs_proc
def test_an_unwritable_hf_home_fails_its_line_and_the_download_cache_under_it(monkeypatch):
    monkeypatch.setenv("HF_HOME", UNWRITABLE)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    report = environment.check()
    assert line_named(report, "huggingface home").status == environment.FAIL
    assert "cannot be written" in line_named(report, "huggingface home").value
    assert line_named(report, "download cache").status == environment.FAIL and not report.ready


def test_too_little_free_disk_for_the_chosen_model_fails_and_enough_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path))  # nothing built there yet
    need = environment.checkpoint_bytes("e2b-shape")
    assert need > 1e9  # what is compared varies with the model: tiny needs far less
    assert environment.checkpoint_bytes("tiny") < need / 1000
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    short = environment.model_disk_check("e2b-shape")
    assert short.status == environment.FAIL and "GEMMA_COURSE_CACHE" in short.fix
    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: usage._replace(free=need))
    assert environment.model_disk_check("e2b-shape").status == environment.OK  # the control: exactly enough
    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: usage._replace(free=int(16e9) - 1))
    hub = environment.model_disk_check("google/gemma-4-E4B-it")  # not downloaded into this empty cache
    assert hub.status == environment.FAIL and "GEMMA_COURSE_CACHE" in hub.fix and "16.0 GB" in hub.fix


def test_the_command_line_check_refuses_an_argument_it_does_not_know():
    done = subprocess.run([sys.executable, "-m", "helpers.environment", "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr
    assert "ready for the course" not in done.stdout and "Traceback" not in done.stderr


def test_the_command_line_check_takes_the_model_it_is_told(tmp_path):
    # the control beside the refusal: a known option is read, and names the model in its disk line
    done = subprocess.run([sys.executable, "-m", "helpers.environment", "--model", "tiny"], capture_output=True, text=True)
    assert done.returncode in (0, 1) and "disk for tiny" in done.stdout
