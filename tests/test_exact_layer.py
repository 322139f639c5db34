"""helpers.exact_layer and exact_norm.fused_residual_norm on the CPU: the joined kernel against the eager sequence
in Triton's interpreter (ATen's CUDA mean order emulated), and the rewired layer against the model's own on tiny.
tests/gpu/test_exact_layer_gpu.py checks the kernel against the eager modules on CUDA."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import decoding, exact_layer, exact_norm, loading

HIDDEN = (2560, 1536)  # E4B's and E2B's hidden size: the rows the joined kernel sees

INTERPRETED = """
import json, sys
import numpy as np
import torch
from helpers import exact_norm

def bits(t):
    return t.view(torch.int16)

# the interpreter's rsqrt is numpy's 1 / sqrt in fp32, its mean the kernel's tree: the eager sequence with both
emulated = dict(mean=exact_norm.aten_mean_order, rsqrt=lambda v: torch.from_numpy(1 / np.sqrt(v.numpy())))
found = {}
for n in json.loads(sys.argv[1]):
    same = checked = told_apart = 0
    generator = torch.Generator().manual_seed(n)
    for sample in range(8):
        spread = 10.0 ** (sample % 4 - 2)  # small and large activations against the residual
        x = (torch.randn(1, 1, n, generator=generator) * spread).to(torch.bfloat16)
        residual = (torch.randn(1, 1, n, generator=generator) * 3).to(torch.bfloat16)
        w, w2 = (torch.rand(n, generator=generator) + 0.5 for _ in range(2))
        scale = torch.tensor([0.5 + sample / 10]).to(torch.bfloat16)
        outputs = [*exact_norm.fused_residual_norm(x, w, 1e-6, residual, scale=scale, next_weight32=w2),
                   exact_norm.fused_residual_norm(x, w, 1e-6, residual)]
        expected = [*exact_norm.residual_norm_eager(x, w, 1e-6, residual, scale=scale, next_weight32=w2, **emulated),
                    exact_norm.residual_norm_eager(x, w, 1e-6, residual, **emulated)]
        for out, eager in zip(outputs, expected):
            same += int((bits(out) == bits(eager)).sum()); checked += n
        nudged = bits(residual.clone()).add_(1).view(torch.bfloat16)  # every residual one ulp away
        told_apart += int((bits(exact_norm.fused_residual_norm(x, w, 1e-6, nudged)) != bits(expected[-1])).sum())
    found[str(n)] = [same, checked, told_apart]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's outputs under TRITON_INTERPRET=1, in a process of its own: the interpreter must be chosen
    before triton is first imported."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the joined kernel is checked where it is (and on the GPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED, json.dumps(HIDDEN)], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", HIDDEN)
def test_the_joined_norm_add_and_scale_round_as_the_eager_sequence_and_a_one_ulp_residual_is_told_apart(interpreted, n):
    same, checked, told_apart = interpreted[str(n)]
    assert same == checked == 8 * 3 * n
    assert told_apart > 8 * n // 4  # the control: a residual one ulp off shows in many sums


def test_the_joined_kernel_compiles_for_an_h100_without_fma_even_where_fusion_is_allowed():
    """Compiled for sm_90 here (no GPU needed): every bf16 rounding is integer operations on the bits, so no product
    can join the residual add as an fma; the norms keep their lone adds and one rsqrt.approx each."""
    pytest.importorskip("triton", reason="triton is not installed")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = exact_norm._residual_kernel(False)
    order = exact_norm.mean_order(1, 2560)
    constants = {"N": 2560, "BLOCK_X": order.block_x, "LEVELS": order.levels, "CHUNKS": order.chunks,
                 "HAS_SCALE": True, "HAS_NEXT": True, "INTERPRET": False}
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp32", "res_ptr": "*bf16", "scale_ptr": "*bf16", "out_ptr": "*bf16",
                 "w2_ptr": "*fp32", "out2_ptr": "*bf16", "factor": "fp32", "eps": "fp32", "eps2": "fp32",
                 **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    assert not re.findall(r"\bfma\.", ptx) and len(re.findall(r"rsqrt\.approx", ptx)) == 2
    assert re.findall(r"\band\.b32\s+%r\d+,\s*%r\d+,\s*-65536;", ptx) and re.findall(r"\bbar\.sync", ptx)


def test_bad_inputs_to_the_joined_kernel_get_one_sentence():
    x = torch.ones(1, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(exact_norm.InvalidChoiceError, match="one contiguous bf16 row"):
        exact_norm.fused_residual_norm(x.float(), torch.ones(256), 1e-6, x)
    with pytest.raises(exact_norm.InvalidChoiceError, match="one contiguous bf16 row"):
        exact_norm.fused_residual_norm(torch.ones(1, 2, 256, dtype=torch.bfloat16), torch.ones(256), 1e-6, x)
    with pytest.raises(exact_norm.InvalidChoiceError, match="float32 tensor of 256"):
        exact_norm.fused_residual_norm(x, torch.ones(256, dtype=torch.bfloat16), 1e-6, x)
    with pytest.raises(exact_norm.InvalidChoiceError, match="one value"):
        exact_norm.fused_residual_norm(x, torch.ones(256), 1e-6, x, scale=torch.ones(2))
    with pytest.raises(exact_norm.InvalidChoiceError, match="scale is on another device"):
        exact_norm.fused_residual_norm(x, torch.ones(256), 1e-6, x, scale=torch.ones(1, device="meta"))


# ------------------------------------------------------------------ the rewired layer


@pytest.fixture()
def scaled_tiny():
    """tiny with a different layer scalar in every layer (the published ones are not all 1: a rewiring that drops
    the scale must show)."""
    model = loading.load_model("tiny", "bf16", "cpu", device="cpu")
    for index, layer in enumerate(exact_layer.layer_modules(model)):
        layer.layer_scalar.fill_(0.5 + index / 8)
    return model


def joined_on_the_cpu(monkeypatch, calls: list, joined=exact_norm.residual_norm_eager):
    """The rewired layers on the CPU: one-token inputs take the joined path, with ``joined`` (the eager sequence by
    default) in place of the CUDA kernel."""
    monkeypatch.setattr(exact_layer, "is_decode_input", lambda h: h.dtype == torch.bfloat16 and h.numel() == h.shape[-1])

    def counted(*args, **kwargs):
        calls.append(kwargs.get("scale") is not None)
        return joined(*args, **kwargs)

    monkeypatch.setattr(exact_norm, "fused_residual_norm", counted)


def test_a_layer_with_its_block_ends_joined_decodes_the_logits_of_its_own_forward(scaled_tiny, monkeypatch):
    ids = torch.tensor([[2, 10, 20, 30]])
    outside = decoding.supports_ple_outside(scaled_tiny)  # transformers 5.5.2 (the matrix) has no per_layer_inputs
    plain = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside)).greedy(ids, 6, keep_logits=True)
    calls = []
    joined_on_the_cpu(monkeypatch, calls)
    tuned = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside, fused_layers=True))
    run = tuned.greedy(ids, 6, keep_logits=True)
    layers = len(exact_layer.layer_modules(scaled_tiny))
    assert layers == scaled_tiny.config.get_text_config().num_hidden_layers and len(tuned.fused_layers.modules) == layers
    assert len(calls) == 5 * 3 * layers and sum(calls) == 5 * layers  # every decode step, every block end; not the prefill
    assert len(set(run.tokens)) > 1 and run.tokens == plain.tokens and torch.equal(run.logits, plain.logits)
    assert all("forward" not in vars(layer) for layer in tuned.fused_layers.modules)  # restored after the loop


def test_a_joined_layer_that_forgets_the_layer_scalar_is_told_apart(scaled_tiny, monkeypatch):
    """The control: the same rewiring with the scale dropped changes the logits."""
    ids = torch.tensor([[2, 10, 20, 30]])
    outside = decoding.supports_ple_outside(scaled_tiny)
    plain = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside)).greedy(ids, 3, keep_logits=True)

    def unscaled(*args, scale=None, **kwargs):
        return exact_norm.residual_norm_eager(*args, **kwargs)

    joined_on_the_cpu(monkeypatch, [], unscaled)
    run = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside, fused_layers=True)).greedy(
        ids, 3, keep_logits=True)
    assert not torch.equal(run.logits, plain.logits)


def test_layers_keep_their_own_forward_off_cuda_and_a_wrapped_layer_is_left_alone():
    model = loading.load_model("tiny", "bf16", "cpu", device="cpu")
    layers = exact_layer.layer_modules(model)
    wrapped = layers[0]
    wrapped.forward = lambda *args, **kwargs: type(wrapped).forward(wrapped, *args, **kwargs)  # someone else's wrapper
    with exact_layer.fuse_layers(model) as fused:
        assert wrapped not in fused.modules and len(fused.modules) == len(layers) - 1
        assert not exact_layer.is_decode_input(torch.ones(1, 1, 2560, dtype=torch.bfloat16))  # a CPU tensor
    assert all("forward" not in vars(layer) for layer in layers[1:]) and "forward" in vars(wrapped)


def test_a_decoder_refuses_fused_layers_under_a_compiler():
    with pytest.raises(decoding.InvalidChoiceError, match="fused_layers"):
        decoding.Decoder(compile="reduce-overhead", fused_layers=True)
    assert "fused layers" in decoding.Decoder(fused_layers=True).label()
