"""Windows without make: the set-up picks a CUDA torch from PyTorch's index when there is an NVIDIA driver, the
setup check names the exact command for a CPU-only torch and for the page file, and no helpers module calls
what exists on POSIX only (each rule beside a snippet it must flag). Windows itself is not run here."""

import ast
import types
from pathlib import Path

import pytest

from helpers import course, environment
from helpers.paths import venv_python

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
POSIX_ONLY_CALLS = {"os.fork", "os.forkpty", "os.killpg", "os.setsid", "os.setpgrp", "os.getuid", "os.geteuid", "os.getpgid",
                    "os.getppid", "os.sync", "signal.SIGKILL", "signal.SIGSTOP", "signal.SIGHUP", "signal.SIGUSR1",
                    "signal.SIGALRM", "signal.alarm", "signal.pause"}
POSIX_ONLY_MODULES = {"resource", "fcntl", "pwd", "grp", "termios", "pty", "posix"}
POSIX_ONLY_STRINGS = ("/tmp", "/dev/null", "/usr/bin", "bin/python", "bin/activate", "bin/pip")
POSIX_ONLY_KEYWORDS = {"preexec_fn", "start_new_session", "pass_fds"}


def guarded_by_platform(node, parents) -> bool:
    """Inside an ``if`` that tests ``os.name`` or ``sys.platform``: the other branch serves Windows."""
    return any(isinstance(p, ast.If) and any(isinstance(n, ast.Attribute) and n.attr in ("name", "platform")
                                               for n in ast.walk(p.test)) for p in parents)


def posix_only_uses(source: str) -> list:
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []

    def visit(node, parents):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and f"{node.value.id}.{node.attr}" in POSIX_ONLY_CALLS:
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not guarded_by_platform(node, parents):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.extend(f"line {node.lineno}: import {n}" for n in names if n.split(".")[0] in POSIX_ONLY_MODULES)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.extend(f"line {node.lineno}: {node.value!r}" for s in POSIX_ONLY_STRINGS if s in node.value.replace("\\\\", "/"))
        elif isinstance(node, ast.keyword) and node.arg in POSIX_ONLY_KEYWORDS:
            found.append(f"line {node.value.lineno}: {node.arg}=")
        elif isinstance(node, ast.keyword) and node.arg == "shell" and getattr(node.value, "value", False) is True:
            found.append(f"line {node.value.lineno}: shell=True")
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node])

    visit(tree, [])
    return found


@pytest.mark.parametrize("path", sorted(HELPERS.glob("*.py")), ids=lambda p: p.name)
def test_no_helpers_module_calls_what_exists_on_posix_only(path):
    assert posix_only_uses(path.read_text()) == []


@pytest.mark.parametrize("snippet", [
    "import os\nos.fork()", "import signal, os\nos.kill(1, signal.SIGKILL)", "import resource", "from fcntl import flock",
    "open('/tmp/x')", "venv = 'env/bin/python'", "import subprocess\nsubprocess.run('ls', shell=True)",
    "import subprocess\nsubprocess.Popen(['x'], start_new_session=True)",
])
def test_each_posix_only_call_is_flagged(snippet):
    """The control: the guard above sees each kind of POSIX-only use."""
    assert posix_only_uses(snippet)


def test_a_posix_module_behind_a_platform_check_is_allowed():
    assert posix_only_uses("import os\nif os.name != 'nt':\n    import resource\n") == []


def test_a_venvs_python_is_under_scripts_on_windows_and_bin_elsewhere(tmp_path):
    assert venv_python(tmp_path, "nt") == tmp_path / "Scripts" / "python.exe"
    assert venv_python(tmp_path, "posix") == tmp_path / "bin" / "python"


@pytest.mark.parametrize("driver,index", [("581.57", "cu130"), ("580.65.06", "cu130"), ("566.36", "cu126"),
                                          ("528.49", "cu126"), ("470.256", None), (None, None), ("", None)])
def test_the_torch_wheel_index_follows_the_nvidia_driver(driver, index):
    chosen = course.cuda_torch_index(driver)
    assert (chosen.rsplit("/", 1)[-1] if chosen else None) == index
    args = course.torch_install_args(driver)
    assert args == ["torch", "--index-url", chosen] if index else args == [course.CPU_TORCH]


def fake_torch_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


def test_a_cpu_only_torch_beside_an_nvidia_gpu_fails_with_the_exact_reinstall_command(monkeypatch):
    fake_torch_without_cuda(monkeypatch)
    monkeypatch.setattr(environment, "nvidia_driver", lambda: "581.57")
    [gpu] = environment.gpu_checks()
    assert gpu.status == environment.FAIL
    assert "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu130" in gpu.fix


def test_without_an_nvidia_gpu_a_cpu_torch_is_only_a_warning(monkeypatch):
    """The control: the same torch on a machine without a GPU is what the course expects there."""
    fake_torch_without_cuda(monkeypatch)
    monkeypatch.setattr(environment, "nvidia_driver", lambda: None)
    [gpu] = environment.gpu_checks()
    assert gpu.status == environment.WARN


@pytest.mark.parametrize("page_file_gb,status", [(4, "fail"), (32, "ok")])
def test_a_small_windows_page_file_fails_with_the_powershell_command_that_raises_it(monkeypatch, page_file_gb, status):
    import psutil

    monkeypatch.setattr(environment, "on_windows", lambda: True)
    monkeypatch.setattr(psutil, "swap_memory", lambda: types.SimpleNamespace(total=page_file_gb * 10**9))
    [page] = [c for c in environment.memory_checks() if c.name == "Windows page file"]
    assert page.status == status
    assert (environment.PAGE_FILE_FIX in page.fix) == (status == "fail")


def test_test_and_lab_before_setup_say_to_run_setup(tmp_path, capsys):
    with pytest.raises(course.SetupError, match="python -m helpers.course setup"):
        course.require_setup(tmp_path / "no-venv")


def test_test_without_the_test_tools_says_to_set_up_with_dev(tmp_path):
    (tmp_path / course.INSTALLED_MARKER).write_text(course.REQUIREMENTS["local"])
    with pytest.raises(course.SetupError, match="setup --dev"):
        course.test(tmp_path)
