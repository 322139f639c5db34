"""GPU tier, issue 31: the driver-sampled busy share the benchmark records reads near all of a stream of large
matmuls and little of the same GPU left waiting on the host between small kernels, on the clock of the windows."""

import time

import pytest
import torch

from lab import gpu_busy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sampled_while(work, seconds: float = 3.0) -> dict:
    sampler = gpu_busy.Sampler.open("cuda:0")
    assert sampler is not None, "no NVML: the benchmark's GPU-busy column would be empty (pip install nvidia-ml-py)"
    torch.cuda.synchronize()
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        work()
    torch.cuda.synchronize()
    sampler.decoded(time.perf_counter() - began)
    return sampler.result()


def test_a_stream_of_matmuls_reads_busy_and_a_gpu_waiting_on_the_host_reads_idle():
    pytest.importorskip("pynvml", reason="nvidia-ml-py: tools/gpu-wheels.txt carries it")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(64, device="cuda")

    def matmuls():
        for _ in range(8):
            a @ a

    def waiting():  # the control: a tiny kernel, then the host sleeps
        small.add_(1)
        time.sleep(0.005)

    busy, idle = sampled_while(matmuls), sampled_while(waiting)
    print("matmuls:", busy, "\nwaiting:", idle)
    assert busy["share"] is not None and busy["share"] >= 0.9, busy
    assert idle["share"] is not None and idle["share"] <= 0.3, idle
    assert busy["newest_sample_age_s"] < 2, "NVML's timestamps are not this clock's: no sample would fall in a window"
