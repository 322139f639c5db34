"""The classroom mirror on loopback: it listens on loopback unless classroom mode is asked for, refuses
traversal and everything but the Hub's requests for its repository before olah sees them, never
receives a learner's hub token from the course, serves what its source folder holds now, and says
so, with a non-zero exit, when it cannot start. Each refusal stands beside a request it must serve,
and each guard beside what olah does without it."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import download, faults, mirror, synthetic

REPO = "google/gemma-4-E4B-it"
SMALL_LFS = 100 * 1024
FAKE_TOKEN = "hf_courseTestTokenThatMustNeverTravel"


@pytest.fixture(autouse=True)
def online_to_loopback_only(monkeypatch):
    """The session runs with HF_HUB_OFFLINE=1; these tests talk to servers on 127.0.0.1 only."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def served(tiny_path, tmp_path_factory):
    with mirror.Mirror(tiny_path, REPO, workdir=tmp_path_factory.mktemp("mirror"), lfs_threshold=SMALL_LFS) as running:
        yield running


def raw_request(port: int, request_line: str, *headers: str) -> tuple:
    """(status code, body) for a request sent byte for byte: no client library normalises the path first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall("\r\n".join([request_line, "Host: 127.0.0.1", *headers, "Connection: close", "", ""]).encode())
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunked(body)
    return int(head.split(b" ")[1]), body


def dechunked(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2:]


def listening_addresses(pid: int) -> set:
    """The addresses the process and its children listen on."""
    process = psutil.Process(pid)
    found = set()
    for each in [process, *process.children(recursive=True)]:
        found |= {c.laddr.ip for c in each.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return found


# ---------------------------------------------------------------- loopback unless told otherwise

def start_cli(model: Path, *args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "helpers.mirror", "serve", str(model), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float = 60) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never came: {''.join(seen)} {process.stderr.read() if process.poll() is not None else ''}")


@pytest.mark.parametrize("classroom", [False, True], ids=["by default", "with --classroom"])
def test_the_cli_listens_on_loopback_by_default_and_on_the_network_only_in_classroom_mode(tiny_path, tmp_path, classroom):
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(tmp_path)}
    process = start_cli(tiny_path, "--port", str(mirror.free_port()), *(["--classroom"] if classroom else []), env=env)
    try:
        said = wait_for_line(process, "Ctrl+C stops it")
        addresses = listening_addresses(process.pid)
        assert addresses and "127.0.0.1" in addresses
        if classroom:  # the control: the check sees an exposed server when there is one
            assert "0.0.0.0" in addresses and "Classroom mode" in said and "without a password" in said
        else:
            assert addresses == {"127.0.0.1"} and "this machine only" in said
        assert "HF_HUB_DISABLE_IMPLICIT_TOKEN=1" in said
    finally:
        process.terminate()
        process.communicate(timeout=20)


def test_the_api_serves_loopback_and_olah_stays_on_loopback_even_in_classroom_mode(tiny_path, tmp_path):
    with mirror.Mirror(tiny_path, REPO, workdir=tmp_path, lfs_threshold=SMALL_LFS) as local:
        assert local.front._socket.getsockname()[0] == "127.0.0.1"
        assert listening_addresses(local.process.pid) == {"127.0.0.1"}
    with mirror.Mirror(tiny_path, REPO, workdir=tmp_path, lfs_threshold=SMALL_LFS, classroom=True) as room:
        assert room.front._socket.getsockname()[0] == "0.0.0.0"
        assert listening_addresses(room.process.pid) == {"127.0.0.1"}  # olah itself: never on the network
        assert "Classroom mode" in room.exposure() and "plain HTTP" in room.exposure()


def test_serving_the_network_without_saying_classroom_is_refused(tiny_path, tmp_path):
    with pytest.raises(mirror.MirrorError, match="classroom=True"):
        mirror.Mirror(tiny_path, REPO, host="0.0.0.0", workdir=tmp_path)


# ---------------------------------------------------------------- the front refuses before olah sees it

REFUSED = [
    ("GET /repos/%2e%2e/%2e%2e/%2e%2e/{name} HTTP/1.1", 400, "the issue's write outside olah's cache"),
    ("GET /%2e%2e/decoy/resolve/main/config.json HTTP/1.1", 400, "an organisation named .."),
    ("GET /%2E%2E/decoy/resolve/main/config.json HTTP/1.1", 400, "encoded dots in capitals"),
    ("GET /%252e%252e/decoy/resolve/main/config.json HTTP/1.1", 400, "double-encoded dots"),
    ("GET /../decoy/resolve/main/config.json HTTP/1.1", 400, "plain dots"),
    ("GET /google/gemma-4-E4B-it/resolve/main/..%2f..%2fconfig.json HTTP/1.1", 400, "an encoded slash"),
    ("GET /google/gemma-4-E4B-it/resolve/main/sub/../../../x HTTP/1.1", 400, "dots inside the file path"),
    ("GET /evil/gemma-4-E4B-it/resolve/main/config.json HTTP/1.1", 404, "an unknown organisation"),
    ("GET /google/other-model/resolve/main/config.json HTTP/1.1", 404, "an unknown repository"),
    ("GET /api/models/evil/x/revision/main HTTP/1.1", 404, "an unknown repository's metadata"),
    ("GET /docs HTTP/1.1", 404, "olah's API documentation"),
    ("GET /openapi.json HTTP/1.1", 404, "olah's API schema"),
    ("GET /repos HTTP/1.1", 404, "olah's repository list"),
    ("POST /api/models/google/gemma-4-E4B-it/paths-info/main HTTP/1.1", 405, "another method"),
]


@pytest.mark.parametrize("request_line,status,what", REFUSED, ids=[row[2] for row in REFUSED])
def test_the_front_refuses_traversal_and_unknown_paths_before_olah_sees_them(served, request_line, status, what):
    name = f"escaped-{abs(hash(what))}"
    relayed = served.front.relayed
    code, _ = raw_request(served.port, request_line.format(name=name))
    assert code == status
    assert served.front.relayed == relayed  # never passed on
    assert not (served.workdir / name).exists()


def test_the_front_serves_the_hubs_own_requests_for_its_repository(served, tiny_path):
    # the control beside the refusals: what learners need still comes through, byte for byte
    code, body = raw_request(served.port, f"GET /{REPO}/resolve/main/config.json HTTP/1.1")
    assert code == 200 and body == (tiny_path / "config.json").read_bytes()
    code, body = raw_request(served.port, f"GET /api/models/{REPO}/revision/main HTTP/1.1")
    assert code == 200 and json.loads(body)["sha"] == served.commit


def test_without_the_front_olah_writes_outside_its_cache_and_serves_a_repository_outside_its_root(served, tiny_path, tmp_path):
    # why the front exists: the same requests sent to olah directly do what the issue reported
    code, _ = raw_request(served.olah_port, "GET /repos/%2e%2e/%2e%2e/%2e%2e/olah-escaped HTTP/1.1")
    escaped = served.workdir / "olah-escaped"
    assert escaped.exists(), "olah no longer writes there: the guard may be simplified"
    shutil.rmtree(escaped)
    decoy = mirror.prepare_repository(tiny_path, tmp_path / "elsewhere", "x/decoy", SMALL_LFS)
    shutil.move(str(decoy), served.mirrors_root / "decoy")  # beside models/, outside it
    try:
        direct, _ = raw_request(served.olah_port, "GET /%2e%2e/decoy/resolve/main/config.json HTTP/1.1")
        guarded, _ = raw_request(served.port, "GET /%2e%2e/decoy/resolve/main/config.json HTTP/1.1")
    finally:
        shutil.rmtree(served.mirrors_root / "decoy")
    assert (direct, guarded) == (200, 400)


# ---------------------------------------------------------------- no hub token reaches the mirror

def test_the_course_sends_no_hub_token_to_a_mirror_and_the_control_would(served, tiny_path, tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)  # as if the learner had logged in
    with faults.FaultyProxy(served.endpoint) as recorder:  # no faults: it records what each request carried
        download.download(REPO, tmp_path / "course", endpoint=recorder.endpoint, max_attempts=2, sleep=lambda s: None)
        course = list(recorder.requests)
        with pytest.raises(HfHubHTTPError, match="HF_HUB_DISABLE_IMPLICIT_TOKEN"):
            HfApi(endpoint=recorder.endpoint).list_repo_files(REPO)  # huggingface_hub's default: the saved token
        control = recorder.requests[len(course):]
    assert len(course) >= 7 and all("authorization" not in names for _, _, names in course)
    assert control and all("authorization" in names for _, _, names in control)
    assert served.front.refused["token"] >= 1  # and the front refused what carried it


def test_resolving_a_hub_id_with_hf_endpoint_on_a_mirror_sends_no_token(served, tmp_path):
    # a learner's kernel: HF_ENDPOINT points at the room's mirror, and a token is saved
    # a course cache of its own: where another test (or pytest run) downloaded the repo, resolve asks nothing
    env = {**os.environ, "HF_ENDPOINT": "", "HF_TOKEN": FAKE_TOKEN, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1", "GEMMA_COURSE_CACHE": str(tmp_path / "course-cache")}
    with faults.FaultyProxy(served.endpoint) as recorder:
        env["HF_ENDPOINT"] = recorder.endpoint
        done = subprocess.run([sys.executable, "-c", f"from helpers import models; print(models.resolve({REPO!r}))"],
                              capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert recorder.requests and all("authorization" not in names for _, _, names in recorder.requests)


@pytest.mark.parametrize("endpoint,token", [
    ("https://huggingface.co", None), (None, None), ("http://192.168.1.10:8090", False),
    ("https://huggingface.co.example.com", False), ("http://huggingface.co", False),
], ids=["the hub", "the default endpoint", "a classroom mirror", "a look-alike host", "the hub over plain HTTP"])
def test_only_the_hub_itself_gets_the_saved_token(endpoint, token):
    assert download.hub_token(endpoint) is token


# ---------------------------------------------------------------- what is served is what the folder holds

def test_a_changed_source_folder_is_served_as_it_is_now_not_as_it_was(tiny_path, tmp_path):
    workdir = tmp_path / "mirror"
    other = synthetic.build("tiny", tmp_path / "other", seed=1, progress=False)  # same names, other weights
    assert (other / "model.safetensors").read_bytes() != (tiny_path / "model.safetensors").read_bytes()
    fetched = {}
    for label, source in (("first", tiny_path), ("same again", tiny_path), ("other", other)):
        with mirror.Mirror(source, REPO, workdir=workdir, lfs_threshold=SMALL_LFS) as running:
            folder = tmp_path / label
            download.download(REPO, folder, endpoint=running.endpoint, max_attempts=2, sleep=lambda s: None)
            fetched[label] = ((folder / "model.safetensors").read_bytes(), running.commit)
    assert fetched["first"][0] == (tiny_path / "model.safetensors").read_bytes()
    assert fetched["same again"][1] == fetched["first"][1]  # an unchanged folder: the repository is reused
    assert fetched["other"][0] == (other / "model.safetensors").read_bytes() and fetched["other"][1] != fetched["first"][1]


def test_a_byte_changed_in_place_in_the_source_rebuilds_the_repository(tiny_path, tmp_path):
    source = Path(shutil.copytree(tiny_path, tmp_path / "source"))
    first = mirror.prepare_repository(source, tmp_path / "mirrors", REPO, SMALL_LFS)
    commit = mirror._git(first, "rev-parse", "HEAD")
    data = bytearray((source / "tokenizer.json").read_bytes())
    data[100] ^= 0x01  # same size, same name: only the content hashes tell
    (source / "tokenizer.json").write_bytes(bytes(data))
    again = mirror.prepare_repository(source, tmp_path / "mirrors", REPO, SMALL_LFS)
    assert mirror._git(again, "rev-parse", "HEAD") != commit
    assert (again / "tokenizer.json").read_bytes() == bytes(data)


def test_a_repo_id_that_climbs_out_of_the_mirror_is_refused_and_nothing_is_written(tiny_path, tmp_path):
    root = tmp_path / "deep" / "er" / "mirrors"
    for repo_id in ("../../../escape/x", "google/..", "a/b/c", "google/gemma\n"):
        with pytest.raises(mirror.MirrorError, match="not a valid repo id"):
            mirror.prepare_repository(tiny_path, root, repo_id)
    assert not any(tmp_path.rglob("escape")) and not root.exists()


# ---------------------------------------------------------------- a start that fails says so

@pytest.fixture
def another_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_port_taken_by_another_server_stops_the_mirror_with_a_non_zero_exit(tiny_path, tmp_path, another_server):
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "helpers.mirror", "serve", str(tiny_path), "--port", str(another_server)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and "another program" in done.stderr and "Serving" not in done.stdout
    with pytest.raises(mirror.MirrorError, match="another program"):
        mirror.Mirror(tiny_path, REPO, port=another_server, workdir=tmp_path).start()
    with socket.create_connection(("127.0.0.1", another_server)):
        pass  # the other server is untouched


def fake_olah_venv(home: Path, server_source: str) -> Path:
    """A virtual environment whose olah.server runs ``server_source`` when the mirror starts it, laid out as
    the mirror installs olah (bin/ or Scripts\\, its marker written last)."""
    import sysconfig
    import venv

    venv.create(home, with_pip=False)
    package = Path(sysconfig.get_path("purelib", vars={"base": str(home), "platbase": str(home)})) / "olah"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "server.py").write_text(server_source)
    (home / mirror.OLAH_INSTALLED).write_text("fake")
    return home


def test_an_olah_that_dies_at_start_stops_the_cli_with_a_non_zero_exit_and_its_last_words(tiny_path, tmp_path):
    fake = fake_olah_venv(tmp_path / "olah", "print('olah: config broken')\nraise SystemExit(3)\n")
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(tmp_path), "OLAH_HOME": str(fake)}
    done = subprocess.run([sys.executable, "-m", "helpers.mirror", "serve", str(tiny_path), "--port", str(mirror.free_port())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and "olah exited at start" in done.stderr and "config broken" in done.stderr


FAKE_OLAH_THAT_DIES_WHILE_SERVING = """
import http.server, json, os, re, subprocess, sys, threading, time
text = open(sys.argv[-1]).read()  # the toml the mirror wrote, after -c (no tomllib before Python 3.11)
config = {"host": re.search(r'host = "(.+?)"', text)[1], "port": int(re.search(r"port = (\\d+)", text)[1])}
repo = os.path.join(re.search(r'mirrors-path = \\["(.+?)"\\]', text)[1], "models", "google", "gemma-4-E4B-it")
sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
class Revision(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"sha": sha}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
server = http.server.HTTPServer((config["host"], config["port"]), Revision)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(3)
print("olah: out of memory")
os._exit(5)
"""


def test_an_olah_that_dies_while_serving_ends_the_cli_with_a_non_zero_exit_and_says_so(tiny_path, tmp_path):
    fake = fake_olah_venv(tmp_path / "olah", FAKE_OLAH_THAT_DIES_WHILE_SERVING)
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(tmp_path), "OLAH_HOME": str(fake)}
    process = start_cli(tiny_path, "--port", str(mirror.free_port()), env=env)
    wait_for_line(process, "Ctrl+C stops it")  # it started: the fake answered as olah does
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1 and "olah stopped by itself (exit 5)" in stderr and "out of memory" in stderr


# ---------------------------------------------------------------- olah ends with the mirror's process

HOLD_A_MIRROR = """
import sys, time
from helpers import mirror
if sys.argv[2] == "unwatched":  # the control: olah's plain entry point, without the watch on its stdin
    mirror.OLAH_ENTRY = "from olah.server import cli; cli()"
running = mirror.Mirror(sys.argv[1], "google/gemma-4-E4B-it").start()
print(running.process.pid, flush=True)
time.sleep(600)
"""


def olah_after_its_parent_is_killed(tiny_path, tmp_path, watched: str) -> bool:
    """Start a mirror in a process of its own, kill that process outright (SIGKILL; TerminateProcess on Windows),
    and say whether olah is still running 15 s later."""
    env = {**os.environ, "GEMMA_COURSE_CACHE": str(tmp_path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_MIRROR, str(tiny_path), watched], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        olah = psutil.Process(int(holder.stdout.readline()))
    except ValueError:
        raise AssertionError(holder.stderr.read()) from None
    holder.kill()
    holder.wait(timeout=30)
    gone, alive = psutil.wait_procs([olah], timeout=15)
    for process in alive:
        process.kill()
    return bool(alive)


def test_olah_ends_when_the_mirrors_process_is_killed_outright_and_without_the_watch_it_would_not(tiny_path, tmp_path):
    assert not olah_after_its_parent_is_killed(tiny_path, tmp_path / "watched", "watched")
    assert olah_after_its_parent_is_killed(tiny_path, tmp_path / "control", "unwatched")  # the control: it serves on


def test_an_address_this_machine_cannot_bind_is_refused_for_what_it_is_not_as_a_busy_port(tiny_path, tmp_path):
    front = mirror.Front("127.0.0.1", mirror.free_port(), {REPO})
    front.bind()  # the control: an address the machine has
    front.close()
    for host in ("192.0.2.1", "2001:db8::1"):  # documentation addresses (RFC 5737, RFC 3849): no machine has them
        with pytest.raises(mirror.MirrorError, match="no such address") as refused:
            mirror.Front(host, mirror.free_port(), {REPO}).bind()
        assert "another program" not in str(refused.value)


def test_ipv6_loopback_is_served_where_the_machine_has_it_and_its_endpoint_is_bracketed(tiny_path, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("this machine has no ::1")
    with mirror.Mirror(tiny_path, REPO, host="::1", workdir=tmp_path) as running:
        assert running.endpoint == f"http://[::1]:{running.port}"
        with socket.create_connection(("::1", running.port), timeout=10):
            pass


def _a_handler_that_starts_another_when_ended(started: list):
    async def handler():
        try:
            await asyncio.sleep(3600)
        finally:  # as a connection accepted while the others were being ended starts its handler
            if len(started) < 3:
                started.append(asyncio.get_running_loop().create_task(handler()))
    return handler


def _single_pass_cancel():
    async def cancel():
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
    return cancel


@pytest.mark.parametrize("cancel, leaves_one_pending", [(lambda: mirror._cancel_connections, False),
                                                         (_single_pass_cancel, True)], ids=["ours", "single-pass"])
def test_a_handler_started_while_the_server_stops_is_ended_too_not_left_pending(cancel, leaves_one_pending):
    loop = asyncio.new_event_loop()
    try:
        started = []
        started.append(loop.create_task(_a_handler_that_starts_another_when_ended(started)()))
        loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(cancel()())
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        assert bool(pending) == leaves_one_pending, pending
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
