"""GPU tier, issue 31: a decoder layer's block end (norm, residual add, layer scalar, the next norm) in one Triton
kernel gives the eager modules' bits on CUDA (exact_norm.fused_residual_norm), beside a one-ulp control."""

import pytest
import torch
from test_exact_layer import HIDDEN

from helpers import exact_layer, exact_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def eager_norm(n: int, generator: torch.Generator):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    norm = Gemma4RMSNorm(n, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=generator) + 0.5)
    return norm


@pytest.mark.parametrize("n", HIDDEN)
def test_the_joined_block_end_gives_the_eager_modules_bits_on_cuda_and_a_one_ulp_residual_is_told_apart(n):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    generator = torch.Generator().manual_seed(n)
    differ = told_apart = 0
    for sample in range(64):
        post, following = eager_norm(n, generator), eager_norm(n, generator)
        spread = 10.0 ** (sample % 4 - 2)
        x = (torch.randn(1, 1, n, generator=generator) * spread).to("cuda", torch.bfloat16)
        residual = (torch.randn(1, 1, n, generator=generator) * 3).to("cuda", torch.bfloat16)
        scalar = torch.tensor([0.5 + sample / 64], dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            h = residual + post(x)  # the layer's own sequence
            h *= scalar
            normed = following(h)
            plain = residual + post(x)
        assert exact_layer.is_decode_input(x)
        weights = dict(weight32=post.weight.float().contiguous(), eps=exact_norm._norm_eps(post))
        joined, joined_normed = exact_norm.fused_residual_norm(
            x, **weights, residual=residual, scale=scalar, next_weight32=following.weight.float().contiguous(),
            next_eps=exact_norm._norm_eps(following))
        alone = exact_norm.fused_residual_norm(x, **weights, residual=residual)
        for out, eager in ((joined, h), (joined_normed, normed), (alone, plain)):
            differ += int((out.view(torch.int16) != eager.view(torch.int16)).sum())
        nudged = residual.clone().view(torch.int16).add_(1).view(torch.bfloat16)
        told_apart += int((exact_norm.fused_residual_norm(x, **weights, residual=nudged).view(torch.int16)
                           != plain.view(torch.int16)).sum())
    assert differ == 0, (n, differ)
    assert told_apart > 0, n


@pytest.mark.parametrize("width", [10240, 20480, 256], ids=["mlp", "double-wide-mlp", "per-layer-input"])
def test_the_joined_gelu_and_product_give_the_eager_bits_on_cuda_and_a_one_ulp_input_is_told_apart(width):
    """F.gelu(approximate="tanh") then the product, as Gemma 4's MLP and per-layer-input gate run them, against one
    kernel: the same fma nvcc contracts and libdevice's tanhf as CUDA's."""
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(width)
    differ = told_apart = 0
    for sample in range(32):
        spread = (0.05, 1.0, 4.0, 30.0)[sample % 4]
        gate = (torch.randn(1, 1, width, generator=generator) * spread).to("cuda", torch.bfloat16)
        other = torch.randn(1, 1, width, generator=generator).to("cuda", torch.bfloat16)
        eager = F.gelu(gate, approximate="tanh") * other
        differ += int((exact_layer.fused_gelu_mul(gate, other).view(torch.int16) != eager.view(torch.int16)).sum())
        nudged = other.clone().view(torch.int16).add_(1).view(torch.bfloat16)
        told_apart += int((exact_layer.fused_gelu_mul(gate, nudged).view(torch.int16) != eager.view(torch.int16)).sum())
    assert differ == 0, (width, differ)
    assert told_apart > 0, width
