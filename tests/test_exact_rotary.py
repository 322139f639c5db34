"""Issue 31: the rotary embedding of one decode token in one Triton kernel (helpers.exact_rotary) gives the bits of
transformers' apply_rotary_pos_emb. Here: the shapes a decode step really rotates, the kernel under Triton's
interpreter against the eager function (bf16 on the CPU rounds each op as CUDA does), the controls, and the swap.
On a GPU: tests/gpu/test_exact_rotary_gpu.py."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import ptx_for, run_interpreted

from helpers import decoding, exact_rotary, models

# [1, 1, heads, head_dim] of every query and key one decode step rotates, E4B's and E2B's (sliding and full layers)
ROTARY_SHAPES = {(1, 1, 8, 256), (1, 1, 2, 256), (1, 1, 8, 512), (1, 1, 2, 512), (1, 1, 1, 256), (1, 1, 1, 512)}


def rotary_inputs(shape, position: int, seed: int) -> tuple:
    """x with values over four orders of magnitude, and the cos and sin of ``position`` as Gemma's rotary
    embedding computes them (fp32, then bf16)."""
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = (torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(shape[:-1] + (1,), generator=gen) * 4 - 2))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.tensor([[float(position)]])[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return x.to(torch.bfloat16), emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def test_the_shapes_checked_are_the_ones_a_decode_step_rotates():
    from transformers.models.gemma4 import modeling_gemma4

    seen = set()
    original = modeling_gemma4.apply_rotary_pos_emb

    def record(x, cos, sin, unsqueeze_dim=1):
        seen.add(tuple(x.shape))
        return original(x, cos, sin, unsqueeze_dim=unsqueeze_dim)

    for name in ("e4b-shape", "e2b-shape"):
        text = copy.deepcopy(models.load_config(name).get_text_config())
        text._attn_implementation = "eager"  # sdpa's mask check asks .item() of meta tensors
        with torch.device("meta"):
            model = modeling_gemma4.Gemma4ForCausalLM(text).to(torch.bfloat16)
        ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
        modeling_gemma4.apply_rotary_pos_emb = record
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        finally:
            modeling_gemma4.apply_rotary_pos_emb = original
    assert seen == ROTARY_SHAPES


def test_rounding_each_op_is_what_makes_the_bits():
    # the control for the kernel's design: the same sum without the bf16 roundings between the ops gives other bits
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb, rotate_half

    x, cos, sin = rotary_inputs((1, 1, 8, 256), 4321, seed=3)
    eager = apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
    each_rounded = ((x.float() * cos.float()).bfloat16().float()
                    + (rotate_half(x).float() * sin.float()).bfloat16().float()).bfloat16()
    once_rounded = (x.float() * cos.float() + rotate_half(x).float() * sin.float()).bfloat16()
    assert torch.equal(each_rounded.view(torch.int16), eager.view(torch.int16))
    assert not torch.equal(once_rounded.view(torch.int16), eager.view(torch.int16))


INTERPRETED = """
import json, sys
import torch
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb
from helpers import exact_rotary
sys.path.insert(0, sys.argv[1])
from test_exact_rotary import ROTARY_SHAPES, rotary_inputs

def bits(t):
    return t.view(torch.int16)

found = {}
for shape in sorted(ROTARY_SHAPES):
    same = checked = told_apart = 0
    for sample, position in enumerate((0, 1, 37, 1000, 31999, 131071)):
        x, cos, sin = rotary_inputs(shape, position, seed=sample)
        eager = apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
        fused = exact_rotary.fused_rotary(x, cos, sin)
        same += int((bits(fused) == bits(eager)).sum()); checked += eager.numel()
        nudged = bits(x.clone()).add_(1).view(torch.bfloat16)  # every input one ulp away
        told_apart += int((bits(exact_rotary.fused_rotary(nudged, cos, sin)) != bits(eager)).sum())
    found[str(shape)] = [same, checked, told_apart]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's outputs under TRITON_INTERPRET=1."""
    return run_interpreted(INTERPRETED, str(Path(__file__).parent),
                           missing="triton is not installed: the fused kernel is checked where it is (and on the GPU)")


@pytest.mark.parametrize("shape", sorted(ROTARY_SHAPES), ids=str)
def test_the_triton_rotation_has_the_eager_functions_bits_and_a_one_ulp_input_is_told_apart(interpreted, shape):
    same, checked, told_apart = interpreted[str(shape)]
    assert same == checked >= 6 * 256
    assert told_apart > checked // 4  # the control: one ulp on every input shows in most outputs


def test_the_rotary_kernel_compiles_for_an_h100_without_fma_even_where_fusion_is_allowed():
    """Compiled for sm_90 here (no GPU needed): each product is rounded to bf16 by integer operations on its bits
    before the add, so no multiply and add can become an fma (which would skip that rounding), with or without
    Triton's fp fusion."""
    import re

    kernel = exact_rotary._triton_kernel(False) if importlib.util.find_spec("triton") else None
    signature = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"}
    for fusion in (False, True):
        ptx = ptx_for(kernel, signature, {"D": 256, "HALF": 128}, fusion=fusion)
        assert not re.findall(r"\bfma\.", ptx) and re.findall(r"\bmul(\.rn)?\.f32", ptx), fusion
        assert re.findall(r"\band\.b32\s+%r\d+,\s*%r\d+,\s*-65536;", ptx), fusion  # the bits' low half cleared


def test_the_swap_keeps_transformers_function_off_cuda_and_is_restored():
    from transformers.models.gemma4 import modeling_gemma4

    original = modeling_gemma4.apply_rotary_pos_emb
    x, cos, sin = rotary_inputs((1, 1, 8, 256), 99, seed=1)
    before = original(x, cos, sin, unsqueeze_dim=2)
    with exact_rotary.fuse_rotary() as fused:
        assert modeling_gemma4.apply_rotary_pos_emb is fused.fused
        assert not exact_rotary.is_decode_input(x, cos, sin)  # a CPU tensor: transformers' function runs
        assert torch.equal(modeling_gemma4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2), before)
    assert modeling_gemma4.apply_rotary_pos_emb is original


def test_bad_inputs_to_the_fused_rotation_get_one_sentence():
    x, cos, sin = rotary_inputs((1, 1, 8, 256), 5, seed=2)
    with pytest.raises(exact_rotary.InvalidChoiceError, match="bfloat16"):
        exact_rotary.fused_rotary(x.float(), cos.float(), sin.float())
    with pytest.raises(exact_rotary.InvalidChoiceError, match="one position"):
        exact_rotary.fused_rotary(x, torch.cat([cos, cos], dim=1), sin)
    with pytest.raises(exact_rotary.InvalidChoiceError, match="contiguous"):
        exact_rotary.fused_rotary(x.transpose(2, 3), cos, sin)


def test_a_decoder_refuses_fused_rotary_under_a_compiler():
    with pytest.raises(decoding.InvalidChoiceError, match="fused_rotary"):
        decoding.Decoder(compile="reduce-overhead", fused_rotary=True)
    assert "fused rotary" in decoding.Decoder(fused_rotary=True).label()


def test_a_tuned_decoder_swaps_the_rotation_in_for_the_decode_loop_only(monkeypatch):
    from transformers.models.gemma4 import modeling_gemma4

    from helpers import loading

    model = loading.load_model("tiny", "bf16", "cpu", device="cpu")
    ids = torch.tensor([[2, 10, 20, 30]])
    outside = decoding.supports_ple_outside(model)  # transformers 5.5.2 (the matrix) has no per_layer_inputs
    plain = decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=outside)).greedy(ids, 4, keep_logits=True)
    asked = []
    monkeypatch.setattr(exact_rotary, "is_decode_input", lambda x, cos, sin: asked.append(x.shape) or False)
    fused = decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=outside, fused_rotary=True))
    run = fused.greedy(ids, 4, keep_logits=True)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(asked) >= 3 * layers and all(shape[:2] == (1, 1) for shape in asked)  # every decode step's queries
    assert modeling_gemma4.apply_rotary_pos_emb is fused.fused_rotary.original  # the prefill's and after: its own
    assert run.tokens == plain.tokens and torch.equal(run.logits, plain.logits)
