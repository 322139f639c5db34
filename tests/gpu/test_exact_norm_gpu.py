"""GPU tier, issue 31: each RMSNorm shape of E4B's decode step in one Triton kernel gives the eager module's bits on
CUDA (helpers.exact_norm), beside a one-ulp control that must differ. tools/exact_norm_probe.py checks more samples
and times the step's norms; this is its pass or fail."""

import pytest
import torch
from conftest import tool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
probe = tool("exact_norm_probe")


@pytest.mark.parametrize("shape,with_scale", sorted(probe.KNOWN_SHAPES), ids=lambda value: str(value))
def test_the_fused_norm_gives_the_eager_norms_bits_and_a_one_ulp_input_is_told_apart(shape, with_scale):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    found = probe.check_norm(shape, with_scale, samples=200, seed=31)
    for dtype, checks in ((k, v) for k, v in found.items() if isinstance(v, dict)):
        for name in ("eager_vs_fused", "eager_vs_fused_one_call_each", "eager_vs_fuse_norms"):
            assert checks[name]["differ"] == 0, (shape, dtype, name, checks[name])
        assert checks["control_one_ulp"]["differ"] > 0, (shape, dtype)
    assert found["decode_input_takes_the_kernel"]


def test_aten_sums_the_mean_in_the_order_the_emulation_follows():
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    for shape, _ in sorted(probe.KNOWN_SHAPES):
        found = probe.check_mean(shape, samples=200, seed=7)
        for dtype in ("torch.bfloat16", "torch.float32"):
            assert found[dtype]["aten_vs_emulation"]["differ"] == 0, (shape, dtype)
            assert found[dtype]["aten_vs_fused_mean"]["differ"] == 0, (shape, dtype)
        if shape[-1] & (shape[-1] - 1):  # 1/n is no fp32 value: the multiply ATen does is not the division
            assert any(found[d]["aten_vs_divide_by_n"]["differ"] for d in ("torch.bfloat16", "torch.float32")), shape
