"""GPU tier: a load that fails gives back every byte it took, under a card's cap: the planner's refusal before
anything is loaded, running out of memory partway through, and an error in the quantizer after the weights
arrived. Allocated GPU memory and pinned host memory return to what they were before the call, and reserved GPU
memory to at most that."""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROBE = r"""
import json, sys
import torch
from helpers import cards, loading
from helpers.errors import CourseError

kind = sys.argv[1]
cards.simulate(6)
torch.ones(1, device=0)  # the CUDA context first: what a failed load must give back is measured after it

def memory():
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0),
            "pinned": host.get("allocated_bytes.current", host.get("allocations.current", 0))}

def fail(self, model, **kwargs):
    raise RuntimeError("the quantizer failed after the weights were loaded")

before = memory()
arguments = {"refused": dict(quant="bf16", ple="gpu"),
             "out-of-memory": dict(quant="bf16", ple="gpu", check_memory=False),
             "quantizer": dict(quant="nf4", ple="cpu")}[kind]
if kind == "quantizer":
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    Bnb4BitHfQuantizer._process_model_after_weight_loading = fail
try:
    loading.load_model("e4b-shape", device=0, **arguments)
    outcome = "loaded"
except (CourseError, RuntimeError) as error:
    outcome = type(error).__name__
    kept = error  # as a notebook keeps its last error
peak = torch.cuda.max_memory_reserved(0)
print(json.dumps({"kind": kind, "outcome": outcome, "before": before, "after": memory(), "peak_reserved": peak}))
"""


@pytest.mark.parametrize("kind, outcome", [("refused", "InsufficientGPUMemoryError"),
                                           ("out-of-memory", "InsufficientGPUMemoryError"),
                                           ("quantizer", "RuntimeError")])
def test_a_failed_load_on_a_6_gb_card_gives_back_all_it_took(kind, outcome):
    import json

    from helpers import synthetic
    from helpers.paths import REPO_ROOT

    synthetic.build("e4b-shape")  # here: a build under the cap would only wait
    done = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == outcome, result
    if kind != "refused":
        assert result["peak_reserved"] > result["before"]["reserved"] + 1e9, result  # it did take memory first
    # allocated and pinned memory are back to what they were; the reserved cache is at most what it was (emptying it
    # may also hand back the block the CUDA context's first tensor left behind)
    assert result["after"]["allocated"] == result["before"]["allocated"], result
    assert result["after"]["pinned"] == result["before"]["pinned"], result
    assert result["after"]["reserved"] <= result["before"]["reserved"], result
