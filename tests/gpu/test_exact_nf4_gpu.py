"""GPU tier, issue 31: each NF4 projection of a decode step through helpers.exact_nf4's kernel gives
bitsandbytes' own bits on CUDA, alone and joined with its siblings, beside a one-ulp control."""

import pytest
import torch
from conftest import tool

from helpers import exact_nf4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("bitsandbytes")

# (N, K) of E4B's projections: q, k/v (sliding and full), o, gate/up, down, the per-layer gate and projection
SHAPES = [(2048, 2560), (512, 2560), (4096, 2560), (1024, 2560), (2560, 2048), (2560, 4096), (10240, 2560),
          (2560, 10240), (256, 2560), (2560, 256)]


linear = tool("nf4_gemv_probe").linear  # a random Linear4bit quantized on the GPU


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("nested", [False, True], ids=["plain-scales", "nested-scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_gives_bitsandbytes_bits_on_cuda_and_a_one_ulp_input_is_told_apart(n, k, dtype, nested):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    generator = torch.Generator().manual_seed(n + k)
    differ = apart = 0
    seen = set()
    for sample in range(4):
        module = linear(n, k, dtype, nested, generator)
        x = (torch.randn(1, 1, k, generator=generator) * 10.0 ** (sample - 2)).to("cuda", dtype)
        with torch.no_grad():
            theirs = module(x)
        differ += int((bits(exact_nf4.nf4_gemv(x, [module])[0]) != bits(theirs)).sum())
        seen.update(theirs.flatten().tolist())
        nudged = x.clone()
        bits(nudged).view(-1)[int(x.abs().argmax())] += 1
        apart += int((bits(exact_nf4.nf4_gemv(nudged, [module])[0]) != bits(theirs)).sum())
    assert differ == 0
    # the outputs vary (bf16 holds about 4,000 values in their range, so not one per row of a tall layer), and one
    # input one ulp up shows
    assert apart > 0 and len(seen) > min(n, 512)


@pytest.mark.parametrize("sizes", [[2048, 512, 512], [10240, 10240]], ids=["q-k-v", "gate-up"])
def test_siblings_joined_in_one_launch_give_each_layers_own_bits(sizes):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    generator = torch.Generator().manual_seed(len(sizes))
    modules = [linear(n, 2560, torch.bfloat16, False, generator) for n in sizes]
    x = torch.randn(1, 1, 2560, generator=generator).to("cuda", torch.bfloat16)
    with torch.no_grad():
        theirs = [m(x) for m in modules]
    for ours, eager in zip(exact_nf4.nf4_gemv(x, modules), theirs):
        assert torch.equal(bits(ours), bits(eager))


@pytest.mark.parametrize("n,k", [(2048, 2560), (2560, 10240)])
def test_products_below_2_to_the_minus_126_are_flushed_as_bitsandbytes_flushes_them(n, k):
    """bitsandbytes' fast-math adds flush them to zero (tools/bnb_sass.py reads FADD.FTZ); the kernel's adds must too.
    The same input 2**64 larger, scaled back, keeps them: it must differ somewhere, or nothing here was flushed."""
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    generator = torch.Generator().manual_seed(k)
    module = linear(n, k, torch.bfloat16, False, generator)
    x = (torch.randn(1, 1, k, generator=generator) * 1e-36).to("cuda", torch.bfloat16)
    with torch.no_grad():
        theirs = module(x)
        kept = module(x * 2.0 ** 64).float() / 2.0 ** 64
    assert torch.equal(bits(exact_nf4.nf4_gemv(x, [module])[0]), bits(theirs))
    assert bool((theirs.float() != kept).any())
