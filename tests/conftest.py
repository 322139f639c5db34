"""Test tiers: CPU tests always run; ``gpu`` tests skip without CUDA (see tests/gpu)."""

import os
import time
import types

import pytest


def pytest_configure(config):
    """Under ATEN_CPU_CAPABILITY forced below the hardware's (make test-kernels), torch 2.13's CPU flash attention
    for bf16 packs its inputs for the AMX/AVX-512 hardware it detects and then refuses to, in the lower-capability
    build it runs ("pack_vnni2 is only supported when avx512 is supported"): a machine that really is AVX2 never takes
    that path. Where the probe meets it, attention runs on the other CPU kernels (math) for this session."""
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        return
    import torch

    query = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)  # large enough for the packed path
    try:
        torch.nn.functional.scaled_dot_product_attention(query, query, query)
    except RuntimeError as error:
        if "pack_vnni2" not in str(error):
            raise
        torch.backends.cuda.enable_flash_sdp(False)  # the flag the CPU's dispatch reads too
        config.issue_config_time_warning(pytest.PytestWarning(
            f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} on this AMX machine: torch's bf16 flash attention "
            f"refuses to run ({error}); attention runs on the math kernel for this session."), stacklevel=2)


@pytest.fixture(scope="session", autouse=True)
def isolated_course_cache(tmp_path_factory):
    """Synthetic checkpoints go to a per-session folder, not the learner's ~/.cache."""
    if "GEMMA_COURSE_CACHE" not in os.environ:
        os.environ["GEMMA_COURSE_CACHE"] = str(tmp_path_factory.mktemp("course-cache"))
    os.environ.pop("GEMMA_MODEL", None)
    os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach the hub
    yield


# the variables the course reads: a test that sets one must undo it, or every later test (and each notebook kernel it
# starts) runs on another model, card or cache; a card-sweep helper once left GEMMA_MODEL=e4b-shape behind, and a
# later notebook test built the 16 GB checkpoint on a CI disk with no room for it
COURSE_VARIABLES = ("GEMMA_", "CARD_GB", "HF_", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")


@pytest.fixture(autouse=True)
def course_variables_left_as_found():
    before = {key: value for key, value in os.environ.items() if key.startswith(COURSE_VARIABLES)}
    yield
    after = {key: value for key, value in os.environ.items() if key.startswith(COURSE_VARIABLES)}
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
        pytest.fail(f"the test left {', '.join(changed)} changed in os.environ (use monkeypatch.setenv)")


@pytest.fixture(scope="session")
def tiny_path():
    from helpers import synthetic

    return synthetic.build("tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def tiny_prompt(tokenizer, text="Where does the PLE table live?"):
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def write_small_gguf(path, rows: int = 16):
    """A valid GGUF holding only a zero PLE tensor (rows x rows, float32), written by gguf's own writer: the
    starting point the bad-input tests cut short or corrupt."""
    import numpy as np
    from gguf import GGUFWriter

    from helpers import gguf_route

    writer = GGUFWriter(str(path), "gemma4")
    writer.add_tensor(gguf_route.PLE_TENSOR, np.zeros((rows, rows), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tool(name: str):
    """A script of tools/ imported as a module, as the tests read it (tools/ is not installed with helpers)."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def require_triton(why: str) -> None:
    """Skip a Triton kernel test where triton is missing (a CPU venv); fail it in ``make test-triton``
    (``COURSE_TRITON_TIER=1``), which installs triton so that those tests run rather than skip."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        if os.environ.get("COURSE_TRITON_TIER"):
            pytest.fail(f"make test-triton runs the kernel tests with triton, but it is not importable: {why}")
        pytest.skip(why)


def run_interpreted(script: str, *args: str, missing: str) -> dict:
    """``script``'s last printed line (JSON), run under TRITON_INTERPRET=1 in a process of its own (the interpreter
    must be chosen before triton is first imported), with the repository as its folder and ``args`` as argv[1:];
    skipped with ``missing`` where triton is not installed."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    require_triton(missing)
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ptx_for(kernel, signature: dict, constants: dict, fusion: bool = False, arch: int = 90, aligned: bool = False) -> str:
    """The PTX Triton makes of a jitted ``kernel`` for a GPU of compute capability ``arch`` (90: an H100), compiled
    here without a GPU and assembled by Triton's ptxas: ``signature`` names each runtime argument's type,
    ``constants`` the constexpr values; ``fusion``: enable_fp_fusion; ``aligned``: every pointer 16-byte aligned, as
    Triton's launcher tells the compiler when it is so on the GPU."""
    require_triton("triton is not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = [name for name, kind in signature.items() if kind.startswith("*")] if aligned else []
    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
                       attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": fusion})
    assert compiled.asm["cubin"]  # ptxas took it for this architecture
    return compiled.asm["ptx"]


class FakeNvml:
    """NVML's sample buffer stood in for (tests/test_gpu_busy.py, tests/test_decoding.py): every call returns each
    sample newer than the timestamp asked, one every STEP_US, all at ``percent``."""
    NVML_GPU_UTILIZATION_SAMPLES = 1
    STEP_US = 10_000  # a sample every 10 ms

    class NVMLError(Exception):
        pass

    def __init__(self, percent: int):
        self.percent, self.began = percent, time.time()

    def nvmlDeviceGetSamples(self, handle, kind, last_seen):
        now = time.time()
        stamps = range(int(self.began * 1e6) + FakeNvml.STEP_US, int(now * 1e6), FakeNvml.STEP_US)
        fresh = [types.SimpleNamespace(timeStamp=t, sampleValue=types.SimpleNamespace(uiVal=self.percent))
                 for t in stamps if t > last_seen]
        if not fresh:
            raise self.NVMLError("not found")
        return kind, fresh
