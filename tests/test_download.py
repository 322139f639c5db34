"""Downloads against a real Hub-compatible mirror (olah, offline) on loopback, through a proxy
that injects faults: the download completes, keeps finished files, and never leaves a partial
or corrupt file where a loader would read it."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tool

from helpers import download, faults, mirror

REPO = "google/gemma-4-E4B-it"
SMALL_LFS = 100 * 1024  # store the tiny checkpoint's larger files as LFS objects, as the Hub does
PLAN = ["drop", "error", "stall", "reset"] * 6  # 24 faults


@pytest.fixture(scope="module")
def source(tiny_path):
    return tiny_path


@pytest.fixture(scope="module")
def hub_mirror(source, tmp_path_factory):
    with mirror.Mirror(source, REPO, workdir=tmp_path_factory.mktemp("mirror"), lfs_threshold=SMALL_LFS) as served:
        yield served


@pytest.fixture(autouse=True)
def online_to_loopback_only(monkeypatch):
    """The session runs with HF_HUB_OFFLINE=1; these tests talk to servers on 127.0.0.1 only."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def short_timeouts(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)  # a stall is noticed in a second


def test_offline_mode_stops_at_once_with_the_fix(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(download.OfflineModeError, match="unset it"):
        download.download(REPO, tmp_path)


def fault_run():
    return tool("fault_run")


def served_files(source: Path) -> dict:
    return {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}


def test_the_mirror_lays_large_files_out_as_lfs_pointers_on_branch_main(hub_mirror):
    repo = hub_mirror.repository
    pointer = (repo / "model.safetensors").read_text()
    assert pointer.startswith("version https://git-lfs.github.com/spec/v1")
    oid = pointer.split("sha256:")[1].split()[0]
    assert (repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).is_file()
    assert subprocess.run(["git", "branch", "--show-current"], cwd=repo, capture_output=True, text=True).stdout.strip() == "main"


def test_every_fault_kind_twice_ends_with_every_file_verified_and_none_spoiled(tmp_path):
    """The small version of `python tools/fault_run.py --faults 200` (data/faults/)."""
    record = fault_run().run(2 * len(faults.KINDS), seed=1, stall_s=1.5, workdir=tmp_path)
    assert record["faults_injected"] == 2 * len(faults.KINDS)
    assert record["injected_by_kind"] == {kind: 2 for kind in sorted(faults.KINDS)}
    assert record["spoiled_files_download_returned"] == 0
    assert record["files_delivered"] == record["rounds"] * 7  # every file of every round verified
    assert record["files_refetched_after_verification"] >= 1  # the silent faults were caught by verification...
    assert record["control_plain_snapshot_download"]["spoiled_files_accepted"] >= 1  # ...which alone catches them


def test_no_partial_or_corrupt_file_is_ever_where_a_loader_reads(hub_mirror, source, tmp_path, short_timeouts):
    expected = served_files(source)
    with faults.FaultyProxy(hub_mirror.endpoint, PLAN, drop_after_bytes=20_000, stall_s=2) as proxy:
        for _ in range(60):
            try:
                download.download(REPO, tmp_path, endpoint=proxy.endpoint, max_attempts=1)
                done = True
            except download.DownloadFailedError:
                done = False
            for path in tmp_path.iterdir():  # after every attempt, finished or not
                if path.is_file():
                    assert path.read_bytes() == expected[path.name], f"{path.name} is partial or corrupt"
            if done:
                break
        assert done and sum(proxy.injected.values()) >= 20


def test_finished_files_are_never_downloaded_again_after_a_fault(hub_mirror, tmp_path, short_timeouts):
    with faults.FaultyProxy(hub_mirror.endpoint, PLAN, drop_after_bytes=20_000, stall_s=2) as proxy:
        download.download(REPO, tmp_path, endpoint=proxy.endpoint, max_attempts=40, sleep=lambda s: None)
        files = {path: n for path, n in proxy.complete_transfers.items() if "/resolve/" in path}
    assert files and set(files.values()) == {1}, files


def spoil_through(proxy_plan, hub_mirror, folder):
    """A plain snapshot_download through silent faults: it finishes, with spoiled files it believes current."""
    from huggingface_hub import snapshot_download

    with faults.FaultyProxy(hub_mirror.endpoint, proxy_plan) as proxy:
        snapshot_download(REPO, local_dir=str(folder), endpoint=proxy.endpoint, token=False, allow_patterns=download.COURSE_PATTERNS,
                          max_workers=1)  # one file at a time: which file each fault spoils never depends on timing
    return proxy


def test_a_rerun_of_download_repairs_files_that_huggingface_hub_believes_current(hub_mirror, source, tmp_path):
    from huggingface_hub import snapshot_download

    proxy = spoil_through(["zero_length", "flip"], hub_mirror, tmp_path)  # a HEAD comes first, then GETs
    expected = served_files(source)
    spoiled = {name for name in expected if (tmp_path / name).read_bytes() != expected[name]}
    assert sum(proxy.injected.values()) == 2 and len(spoiled) == 2
    snapshot_download(REPO, local_dir=str(tmp_path), endpoint=hub_mirror.endpoint, token=False)
    # the pitfall: huggingface_hub's own metadata says the spoiled files are current, so nothing is fetched
    assert {name for name in expected if (tmp_path / name).read_bytes() != expected[name]} == spoiled
    result = download.download(REPO, tmp_path, endpoint=hub_mirror.endpoint, max_attempts=3, sleep=lambda s: None)
    assert set(result.refetched) == spoiled and set(result.checks.values()) == {"ok"}
    assert {name: (tmp_path / name).read_bytes() for name in expected} == expected


@pytest.mark.parametrize("spoil,status", [
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "mismatch"),
    (lambda p: p.write_bytes(b""), "mismatch"),
    (lambda p: p.unlink(), "missing"),
], ids=["a flipped byte", "truncated", "emptied", "deleted"])
@pytest.mark.parametrize("name", ["model.safetensors", "config.json"], ids=["an LFS file (sha256)", "a small file (git blob id)"])
def test_verify_flags_a_spoiled_download_and_passes_a_whole_one(hub_mirror, tmp_path, spoil, status, name):
    download.download(REPO, tmp_path, endpoint=hub_mirror.endpoint, max_attempts=2, sleep=lambda s: None)
    assert set(download.verify(REPO, tmp_path, endpoint=hub_mirror.endpoint).values()) == {"ok"}  # the control
    spoil(tmp_path / name)
    checks = download.verify(REPO, tmp_path, endpoint=hub_mirror.endpoint)
    assert {file: state for file, state in checks.items() if state != "ok"} == {name: status}


def test_a_repository_the_mirror_does_not_have_is_a_clear_error(hub_mirror, tmp_path):
    with pytest.raises(download.ModelNotFoundError, match="HF_ENDPOINT"):
        download.download("google/gemma-4-E9B-it", tmp_path, endpoint=hub_mirror.endpoint, max_attempts=2, sleep=lambda s: None)


def test_a_full_disk_stops_at_once_and_says_what_to_free(monkeypatch, tmp_path):
    import huggingface_hub

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    with pytest.raises(download.DiskFullError, match="16 GB"):
        download.download(REPO, tmp_path, max_attempts=5, sleep=lambda s: None)


def test_a_failed_attempt_keeps_its_errors_whole_first_line_not_cut_inside_a_url(monkeypatch, tmp_path):
    import huggingface_hub

    url = "http://127.0.0.1:8090/google/gemma-4-E4B-it/resolve/" + "a" * 40 + "/chat_template.jinja"
    raised = iter([ConnectionError(f"Server error '503 Service Unavailable' for url '{url}'\nmore detail"),
                   ConnectionError("word " * 200)])

    def failing(*args, **kwargs):
        raise next(raised)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(download.DownloadFailedError) as failed:
        download.download(REPO, tmp_path, max_attempts=2, sleep=lambda s: None)
    first, second = failed.value.attempt_errors
    assert first.endswith(f"for url '{url}'")  # the old 160-character cut ended it at ".../chat_template.jinj"
    assert "more detail" not in first
    assert second.endswith("word …") and len(second) < 450  # a runaway line ends at a word


def test_use_mirror_before_the_hub_is_imported_takes_effect_and_after_it_refuses():
    before = subprocess.run(
        [sys.executable, "-c", "from helpers import download; download.use_mirror('http://127.0.0.1:9'); "
                               "print(download.hub_settings())"], capture_output=True, text=True)
    assert "'endpoint': 'http://127.0.0.1:9'" in before.stdout and "'xet_disabled': True" in before.stdout
    after = subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import snapshot_download; from helpers import download; "
                               "download.use_mirror('http://127.0.0.1:9')"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert after.returncode != 0 and "restart the kernel" in after.stderr


def test_a_model_folder_under_a_dot_cache_directory_is_mirrored_whole(source, tmp_path):
    """The course's default cache is ~/.cache/...; only a .cache folder *inside* the model is skipped."""
    import shutil

    model = tmp_path / ".cache" / "models" / "tiny"
    shutil.copytree(source, model)
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "x.metadata").write_text("hub bookkeeping")
    repo = mirror.prepare_repository(model, tmp_path / "mirrors", REPO)
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    assert sorted(tracked) == sorted(p.name for p in source.iterdir() if p.is_file())


def test_a_gated_model_says_to_accept_the_licence_and_log_in(monkeypatch, tmp_path):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(*args, **kwargs):
        url = f"https://huggingface.co/api/models/{REPO}/revision/main"
        response = httpx.Response(401, request=httpx.Request("GET", url))
        raise GatedRepoError(f"401 Client Error: access to model {REPO} is restricted", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(download.ModelNotFoundError, match="accept its licence.*hf auth login"):
        download.download(REPO, tmp_path, max_attempts=3, sleep=lambda s: None)


def test_an_olah_importable_here_is_started_with_this_python_not_a_venv(monkeypatch):
    import importlib.util
    import sys as system

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "olah" else real(name, *a))
    command = mirror.olah_command()
    assert command == [system.executable, "-c", mirror.OLAH_ENTRY]  # this interpreter, not a venv's
    assert command[-1].rstrip().endswith("from olah.server import cli; cli()")  # olah's own entry point, behind the watch


def test_an_olah_that_dies_at_start_is_reported_with_its_last_words(source, tmp_path, monkeypatch):
    import sys as system

    monkeypatch.setattr(mirror, "olah_command", lambda: [system.executable, "-c", "print('olah: config broken'); raise SystemExit(3)"])
    with pytest.raises(mirror.MirrorError, match="config broken"):
        mirror.Mirror(source, REPO, workdir=tmp_path).start(timeout=20)


def test_the_recorded_fault_run_injected_200_faults_of_every_kind_and_download_returned_no_spoiled_file():
    from helpers.paths import FAULTS_DIR

    recorded = sorted(FAULTS_DIR.glob("*.json"))
    assert recorded, "run `python tools/fault_run.py --faults 200`"
    record = json.loads(recorded[-1].read_text())
    assert record["faults_injected"] == record["faults_planned"] >= 200
    assert set(record["injected_by_kind"]) == set(faults.KINDS)
    assert record["spoiled_files_download_returned"] == 0 == sum(len(r["spoiled_though_download_returned"]) for r in record["per_round"])
    assert record["control_plain_snapshot_download"]["spoiled_files_accepted"] > 0  # the faults did spoil files


@pytest.mark.parametrize("fault,status", [("error", 503), ("server_error", 500), ("rate_limit", 429), ("html", 200)])
def test_a_fault_on_any_request_is_answered_as_planned_not_by_a_crashed_handler(fault, status):
    """The proxy's 503, 500, 429 and captive-portal page reach the client (a handler that crashed instead closed the
    connection without an answer, which tested only resets)."""
    import http.client

    with faults.FaultyProxy(f"http://127.0.0.1:{mirror.free_port()}", [fault]) as proxy:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        connection.request("GET", "/api/models/google/gemma-4-E4B-it/revision/main")
        reply = connection.getresponse()
        body = reply.read()
        connection.close()
    assert reply.status == status and proxy.injected[fault] == 1
    assert (b"hotel Wi-Fi" in body) == (fault == "html")


def test_two_kernels_practising_at_once_never_share_a_folder_and_an_ended_kernels_folder_is_removed(tmp_path, monkeypatch):
    from helpers import paths

    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = tmp_path / "practice"
    for pid in (int(ended.stdout), os.getppid()):  # a kernel that has ended, and one still running
        (root / f"kernel-{pid}").mkdir(parents=True)
        (root / f"kernel-{pid}" / "model.safetensors").write_bytes(b"x")
    mine = paths.practice_folder()
    assert mine == root / f"kernel-{os.getpid()}" and list(mine.iterdir()) == []
    assert not (root / f"kernel-{int(ended.stdout)}").exists() and (root / f"kernel-{os.getppid()}").exists()
    (mine / "left-over").write_text("from the last run")
    assert list(paths.practice_folder().iterdir()) == []  # a re-run starts empty


def test_a_kernels_scratch_folder_goes_when_the_kernel_ends_so_no_gguf_or_adapter_is_left_on_disk(tmp_path, monkeypatch):
    """Notebooks 03, 06, 08, 09 and 10 write into ``kernel_folder``: another kernel on the same cache (the card sweep
    runs five) never unlinks or overwrites them, and nothing stays once the kernel has ended."""
    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path))
    code = ("from helpers import paths; f = paths.kernel_folder('gguf', 'tiny'); (f / 'model.gguf').write_bytes(b'x'); "
            "print(f)")
    made = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    assert made.parent == tmp_path / "gguf" / "tiny" and made.name.startswith("kernel-")
    assert not made.exists()  # removed when that process ended
    from helpers import paths

    mine = paths.kernel_folder("gguf", "tiny")
    (mine / "model.gguf").write_bytes(b"x")
    assert mine.exists() and mine != made  # the control: a live kernel's folder stays


@pytest.mark.parametrize("xet_disabled", [True, False], ids=["plain-http", "control-hubs-own-labels"])
def test_a_download_without_xet_shows_no_reconstruction_bar_and_counts_its_bytes_once(hub_mirror, tmp_path,
                                                                                       monkeypatch, xet_disabled):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", xet_disabled)
    shown = []
    labelled = download.download_bars

    def shown_as_in_a_notebook():
        class Shown(labelled()):
            def __init__(self, *args, **kwargs):
                if kwargs.get("disable") is None:  # a pipe hides bars; a notebook shows them
                    kwargs["disable"] = False
                super().__init__(*args, **kwargs)
                if not self.disable:
                    shown.append((self.desc, self.unit))
        return Shown

    monkeypatch.setattr(download, "download_bars", shown_as_in_a_notebook)
    download.download(REPO, tmp_path, endpoint=hub_mirror.endpoint)
    byte_bars = [desc for desc, unit in shown if unit == "B"]
    if xet_disabled:
        assert byte_bars == ["Downloading"], shown
    else:  # huggingface_hub's own labels (from 1.x's later releases: "Reconstructing", and the bytes counted twice)
        assert byte_bars and byte_bars != ["Downloading"], shown
