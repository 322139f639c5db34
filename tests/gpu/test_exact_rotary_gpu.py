"""GPU tier, issue 31: the rotary embedding of each query and key shape of a decode step in one Triton kernel gives
the bits of transformers' apply_rotary_pos_emb on CUDA (helpers.exact_rotary), beside a one-ulp control."""

import pytest
import torch
from test_exact_rotary import ROTARY_SHAPES, rotary_inputs

from helpers import exact_rotary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
POSITIONS = (0, 1, 2, 37, 511, 4095, 32767, 131071)


@pytest.mark.parametrize("shape", sorted(ROTARY_SHAPES), ids=str)
def test_the_fused_rotation_gives_the_eager_bits_on_cuda_and_a_one_ulp_input_is_told_apart(shape):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    differ = told_apart = 0
    for sample, position in enumerate(POSITIONS):
        x, cos, sin = (t.cuda() for t in rotary_inputs(shape, position, seed=100 + sample))
        eager = apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
        assert exact_rotary.is_decode_input(x, cos, sin)
        differ += int((exact_rotary.fused_rotary(x, cos, sin).view(torch.int16) != eager.view(torch.int16)).sum())
        nudged = x.clone().view(torch.int16).add_(1).view(torch.bfloat16)
        told_apart += int((exact_rotary.fused_rotary(nudged, cos, sin).view(torch.int16) != eager.view(torch.int16)).sum())
    assert differ == 0, (shape, differ)
    assert told_apart > 0, shape
