"""A synthetic build killed at every step, by SIGKILL (an OOM kill), SIGTERM (a kernel restart) and
SIGINT (Ctrl+C): before the next build nothing incomplete is marked complete, and after it the folder
holds either the old or the new checkpoint, whole (its files match the hashes its marker records),
and no staging folder is left beside it.

A child process imports the libraries once and forks one builder per case; each builder replaces
an existing checkpoint (seed 1) with a new one (seed 0) and sends itself the signal at its step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import checksums, synthetic

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the builders are forked (Linux and macOS)")

# step -> the code, run in the builder, that delivers the signal there (`die()` sends it)
STEPS = {
    "lock taken, nothing written": """
        real = synthetic._build_unlocked
        synthetic._build_unlocked = lambda *a: (die(), real(*a))[1]""",
    "tensors half written": """
        real, calls = synthetic._raw_bytes, []
        synthetic._raw_bytes = lambda t: (calls.append(1), len(calls) == 3 and die(), real(t))[2]""",
    "weights written, tokenizer next": """
        real = synthetic.save_text_and_media_processors
        synthetic.save_text_and_media_processors = lambda *a: (die(), real(*a))[1]""",
    "marker written aside, not yet renamed": """
        real = os.replace
        os.replace = lambda s, t: (Path(t).name == synthetic.COMPLETE_MARKER and die(), real(s, t))[1]""",
    "staging complete, old still in place": """
        real = synthetic._move_into_place
        synthetic._move_into_place = lambda *a: (die(), real(*a))[1]""",
    "old set aside, new not yet in": """
        real = os.replace
        os.replace = lambda s, t: (real(s, t), Path(t).name.startswith(f".{dest.name}.old-") and die())[0]""",
    "new in place, old not yet deleted": """
        real = os.replace
        os.replace = lambda s, t: (real(s, t), Path(t) == dest and die())[0]""",
    "old half deleted": """
        real = shutil.rmtree
        def half_then_die(path, *a, **k):
            if Path(path).name.startswith(f".{dest.name}.old-"):
                (Path(path) / "model.safetensors").unlink()
                die()
            return real(path, *a, **k)
        synthetic.shutil.rmtree = half_then_die""",
}
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
CASES = [(step, name) for step in STEPS for name in SIGNALS]

BUILDER = """
import json, os, shutil, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell that ran the tests in the background ignores Ctrl+C
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import torch
torch.set_num_threads(1)  # no thread pool in the parent: forks stay safe
from helpers import synthetic
from transformers import Gemma4ForConditionalGeneration, PreTrainedTokenizerFast  # noqa: F401 - once, before the forks
synthetic.gemma4_config("tiny"); synthetic.torchvision_available(); synthetic.build("tiny", sys.argv[2], progress=False)
results = {}
for case in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        dest, number = Path(case["dest"]), getattr(signal, case["signal"])
        def die():
            os.kill(os.getpid(), number)
            time.sleep(5)  # SIGINT is raised here as KeyboardInterrupt; the others never return
%s
        try:
            synthetic.build("tiny", dest, seed=0, force=True, progress=False)
        except KeyboardInterrupt:
            os._exit(130)
        os._exit(0)  # never reached where the signal was delivered
    _, status = os.waitpid(pid, 0)
    results[case["id"]] = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                           "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
print(json.dumps(results))
"""


def case_id(step: str, signal_name: str) -> str:
    return f"{signal_name} at: {step}"


def builder_script() -> str:
    branches = []
    for number, step in enumerate(STEPS):
        body = textwrap.indent(textwrap.dedent(STEPS[step]).strip(), " " * 12)
        branches.append(f"        {'if' if number == 0 else 'elif'} case['step'] == {step!r}:\n{body}")
    return BUILDER % "\n".join(branches)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Every (step, signal) case, run once: {case id: (dest, how the builder ended, old marker hashes)}."""
    root = tmp_path_factory.mktemp("kills")
    old = synthetic.build("tiny", root / "old-template", seed=1, progress=False)
    cases = []
    for step, signal_name in CASES:
        dest = root / f"case-{len(cases)}" / "ckpt"
        dest.parent.mkdir()
        shutil.copytree(old, dest)
        cases.append({"id": case_id(step, signal_name), "step": step, "signal": signal_name, "dest": str(dest)})
    done = subprocess.run([sys.executable, "-c", builder_script(), json.dumps(cases), str(root / "warm-up")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ended = json.loads(done.stdout.strip().splitlines()[-1])
    old_hashes = json.loads((old / synthetic.COMPLETE_MARKER).read_text())["sha256"]
    return {case["id"]: (Path(case["dest"]), ended[case["id"]], old_hashes) for case in cases}


def recorded_hashes(folder: Path) -> dict:
    return json.loads((folder / synthetic.COMPLETE_MARKER).read_text())["sha256"]


@pytest.mark.parametrize("step,signal_name", CASES, ids=[case_id(*case) for case in CASES])
def test_a_build_killed_at_any_step_leaves_the_old_or_the_new_checkpoint_whole_and_no_staging(
        killed, tiny_path, step, signal_name):
    dest, ended, old_hashes = killed[case_id(step, signal_name)]
    if signal_name == "SIGINT":
        assert ended["exit"] == 130, ended  # KeyboardInterrupt reached the builder's caller
    else:
        assert ended["signal"] == SIGNALS[signal_name], ended  # the builder died of the signal
    # before any recovery: nothing is marked complete unless every file it lists is whole
    if synthetic.is_complete(dest):
        assert set(synthetic.verify(dest).values()) == {checksums.OK}
    synthetic.build("tiny", dest, progress=False)  # the next build: finishes or undoes the killed one
    assert set(synthetic.verify(dest).values()) == {checksums.OK}
    assert recorded_hashes(dest) in (old_hashes, recorded_hashes(tiny_path))  # the old (seed 1) or the new (seed 0)
    assert [p.name for p in dest.parent.iterdir()] == ["ckpt"], "a staging or set-aside folder survived"


def test_the_kills_fell_on_both_sides_of_the_replacement(killed, tiny_path):
    # the control: were every case to keep the old checkpoint, the swap itself would be untested
    outcomes = set()
    for dest, _, old_hashes in killed.values():
        outcomes.add("old" if recorded_hashes(dest) == old_hashes else "new")
    assert outcomes == {"old", "new"}


@pytest.fixture
def checkpoint(tiny_path, tmp_path):
    return Path(shutil.copytree(tiny_path, tmp_path / "ckpt"))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("spoil,status", [
    (lambda p: flip_a_byte(p / "model.safetensors"), "mismatch"),
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-4096]), "mismatch"),
    (lambda p: (p / "model.safetensors").write_bytes(b""), "mismatch"),
    (lambda p: (p / "model.safetensors").unlink(), "missing"),
    (lambda p: flip_a_byte(p / "tokenizer.json"), "mismatch"),
], ids=["a flipped byte in the tensor data", "a truncated shard", "an emptied shard", "a deleted shard", "a flipped byte in the tokenizer"])
def test_verify_reports_a_spoiled_file_of_a_synthetic_checkpoint_from_its_marker_hashes(checkpoint, spoil, status):
    assert set(synthetic.verify(checkpoint).values()) == {checksums.OK}  # the control: whole, it passes
    spoil(checkpoint)
    spoiled = checksums.failures(synthetic.verify(checkpoint))
    assert len(spoiled) == 1 and list(spoiled.values()) == [status], spoiled


def test_verify_refuses_a_folder_without_recorded_hashes(tmp_path):
    with pytest.raises(synthetic.NotASyntheticCheckpointError, match="download.verify"):
        synthetic.verify(tmp_path)
