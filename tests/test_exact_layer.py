"""helpers.exact_layer and exact_norm.fused_residual_norm on the CPU: the joined kernel against the eager sequence
in Triton's interpreter (ATen's CUDA mean order emulated), and the rewired layer against the model's own on tiny.
tests/gpu/test_exact_layer_gpu.py checks the kernel against the eager modules on CUDA."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ptx_for, run_interpreted

from helpers import decoding, exact_layer, exact_norm, loading, models

HIDDEN = (2560, 1536)  # E4B's and E2B's hidden size: the rows the joined kernel sees

INTERPRETED = """
import json, sys
import numpy as np
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
    """The kernel's outputs under TRITON_INTERPRET=1."""
    return run_interpreted(INTERPRETED, json.dumps(HIDDEN),
                           missing="triton is not installed: the joined kernel is checked where it is (and on the GPU)")


@pytest.mark.parametrize("n", HIDDEN)
def test_the_joined_norm_add_and_scale_round_as_the_eager_sequence_and_a_one_ulp_residual_is_told_apart(interpreted, n):
    same, checked, told_apart = interpreted[str(n)]
    assert same == checked == 8 * 3 * n
    assert told_apart > 8 * n // 4  # the control: a residual one ulp off shows in many sums


def test_the_joined_kernel_compiles_for_an_h100_without_fma_even_where_fusion_is_allowed():
    """Compiled for sm_90 here (no GPU needed): every bf16 rounding is integer operations on the bits, so no product
    can join the residual add as an fma; the norms keep their lone adds and one rsqrt.approx each."""
    import re

    kernel = exact_norm._residual_kernel(False) if importlib.util.find_spec("triton") else None
    order = exact_norm.mean_order(1, 2560)
    constants = {"N": 2560, "BLOCK_X": order.block_x, "LEVELS": order.levels, "CHUNKS": order.chunks,
                 "HAS_SCALE": True, "HAS_NEXT": True, "INTERPRET": False}
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp32", "res_ptr": "*bf16", "scale_ptr": "*bf16", "out_ptr": "*bf16",
                 "w2_ptr": "*fp32", "out2_ptr": "*bf16", "factor": "fp32", "eps": "fp32", "eps2": "fp32"}
    ptx = ptx_for(kernel, signature, constants)
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
    calls, input_norms = [], []
    joined_on_the_cpu(monkeypatch, calls)
    tuned = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside, fused_layers=True))
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda module, args: input_norms.append(module))
             for layer in exact_layer.layer_modules(scaled_tiny)]
    try:
        run = tuned.greedy(ids, 6, keep_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(exact_layer.layer_modules(scaled_tiny))
    # the prefill runs every layer's input norm; each decode step only the first's (each later one came with the
    # layer before's last kernel)
    assert len(input_norms) == layers + 5 and not tuned.fused_layers.handoff
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


# ------------------------------------------------------------------ the gelu and the product after it

GELU_INTERPRETED = """
import json, sys
import numpy as np
import numpy as np
import torch
from helpers import exact_layer
sys.path.insert(0, sys.argv[1])
from test_exact_layer import gelu_mul_emulated

found = {}
generator = torch.Generator().manual_seed(4)
for name, shape in (("mlp", (1, 1, 10240)), ("per-layer input", (1, 1, 256))):
    same = checked = told_apart = 0
    for sample in range(4):
        spread = (0.05, 1.0, 4.0, 30.0)[sample]  # near zero, the bend, the tails (tanh at +-1)
        gate = (torch.randn(shape, generator=generator) * spread).to(torch.bfloat16)
        other = torch.randn(shape, generator=generator).to(torch.bfloat16)
        out, emulated = exact_layer.fused_gelu_mul(gate, other), gelu_mul_emulated(gate, other)
        same += int((out.view(torch.int16) == emulated.view(torch.int16)).sum()); checked += gate.numel()
        nudged = other.clone().view(torch.int16).add_(1).view(torch.bfloat16)
        told_apart += int((exact_layer.fused_gelu_mul(gate, nudged).view(torch.int16) != emulated.view(torch.int16)).sum())
    found[name] = [same, checked, told_apart]
print(json.dumps(found))
"""


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma, rounded once: the product is exact in fp64, the sum's fp64 rounding error is recovered (TwoSum),
    and only a sum that lands on an fp32 midpoint needs it to round the right way."""
    p = a.astype(np.float64) * b.astype(np.float64)
    s = p + c.astype(np.float64)
    virtual = s - p
    err = (p - (s - virtual)) + (c.astype(np.float64) - virtual)
    out = s.astype(np.float32)
    low = np.nextafter(out, np.float32(-np.inf))
    high = np.nextafter(out, np.float32(np.inf))
    for neighbour in (low, high):  # s exactly between out and a neighbour: the error says which side the fma is on
        midpoint = (out.astype(np.float64) + neighbour.astype(np.float64)) / 2
        tie = (s == midpoint) & (err != 0)
        toward = np.sign(neighbour.astype(np.float64) - out.astype(np.float64)) == np.sign(err)
        out = np.where(tie & toward, neighbour, out)
    return out


def gelu_mul_emulated(gate: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """fused_gelu_mul's sequence in numpy fp32 with the interpreter's tanh (1 - 2 / (exp(2 v) + 1))."""
    from helpers import exact_layer

    f32 = np.float32
    x = gate.float().numpy()
    inner = f32(exact_layer.GELU_BETA) * _fma_f32(np.full_like(x, exact_layer.GELU_KAPPA), (x * x) * x, x)
    t = f32(1.0) - f32(2.0) / (np.exp(f32(2.0) * inner) + f32(1.0))
    activated = torch.from_numpy((f32(0.5) * x) * (f32(1.0) + t)).to(torch.bfloat16)
    return (activated.float() * other.float()).to(torch.bfloat16)


def test_the_emulated_fma_rounds_once_where_multiply_then_add_rounds_twice():
    """The emulation's own control: a product whose low bits an add keeps (x * x - 1 for x = 1 + 2^-12)."""
    x = np.array([1 + 2.0**-12], dtype=np.float32)
    exact = np.float32(2.0**-11 + 2.0**-24)  # (1 + 2^-12)^2 - 1, an fp32 value
    assert _fma_f32(x, x, np.array([-1.0], dtype=np.float32))[0] == exact
    assert (x * x - np.float32(1.0))[0] != exact


@pytest.fixture(scope="module")
def gelu_interpreted() -> dict:
    return run_interpreted(GELU_INTERPRETED, str(Path(__file__).parent),
                           missing="triton is not installed: the gelu kernel is checked where it is (and on the GPU)")


@pytest.mark.parametrize("name", ["mlp", "per-layer input"])
def test_the_gelu_and_product_kernel_rounds_as_the_eager_sequence_and_a_one_ulp_input_is_told_apart(gelu_interpreted, name):
    """In the interpreter (no libdevice: its own tanh), the sequence around tanh: the one fma, each fp32 step and
    the two bf16 roundings. tests/gpu/test_exact_layer_gpu.py holds it against F.gelu and the product on CUDA."""
    same, checked, told_apart = gelu_interpreted[name]
    assert same == checked
    assert told_apart > checked // 4


def test_bad_inputs_to_the_gelu_kernel_get_one_sentence():
    gate = torch.ones(1, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(exact_layer.InvalidChoiceError, match="one shape"):
        exact_layer.fused_gelu_mul(gate, torch.ones(1, 1, 128, dtype=torch.bfloat16))
    with pytest.raises(exact_layer.InvalidChoiceError, match="bf16"):
        exact_layer.fused_gelu_mul(gate, gate.float())


def test_layers_with_their_gelus_joined_decode_the_logits_of_their_own_forward(scaled_tiny, monkeypatch):
    import torch.nn.functional as F

    ids = torch.tensor([[2, 10, 20, 30]])
    outside = decoding.supports_ple_outside(scaled_tiny)
    plain = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside)).greedy(ids, 6, keep_logits=True)
    joined_on_the_cpu(monkeypatch, [])
    products = []
    monkeypatch.setattr(exact_layer, "fused_gelu_mul",
                        lambda gate, other: products.append(gate.shape[-1]) or F.gelu(gate, approximate="tanh") * other)
    settings = decoding.Decoder(compile=None, ple_outside=outside, fused_layers=True, fused_activations=True)
    run = decoding.TunedGreedy(scaled_tiny, settings).greedy(ids, 6, keep_logits=True)
    text = scaled_tiny.config.get_text_config()
    assert len(products) == 5 * 2 * text.num_hidden_layers  # the MLP's and the per-layer input's, every decode step
    assert text.hidden_size_per_layer_input in products and max(products) >= text.intermediate_size
    assert run.tokens == plain.tokens and torch.equal(run.logits, plain.logits)


def test_fused_activations_need_the_rewired_layer():
    with pytest.raises(decoding.InvalidChoiceError, match="fused_layers=True"):
        decoding.Decoder(fused_activations=True)


def test_the_gelu_kernel_compiles_for_an_h100_with_its_fma_and_libdevices_tanh():
    """Compiled for sm_90 here (no GPU needed), as the GPU will compile it: the contracted multiply-add is an fma,
    tanh is libdevice's (inlined: no call left), and both bf16 roundings clear the bits' low half."""
    import re

    kernel = exact_layer._gelu_kernel(False) if importlib.util.find_spec("triton") else None
    signature = {"gate_ptr": "*bf16", "other_ptr": "*bf16", "out_ptr": "*bf16", "beta": "fp32", "kappa": "fp32"}
    ptx = ptx_for(kernel, signature, {"N": 10240, "BLOCK": 1024, "INTERPRET": False})
    assert re.findall(r"\bfma\.rn\.f32", ptx) and not re.findall(r"^\s*call", ptx, re.M)
    assert len(re.findall(r"\band\.b32\s+%r\d+,\s*%r\d+,\s*-65536;", ptx)) >= 2


def test_on_e4b_each_joined_layer_saves_its_block_ends_next_input_norm_and_gelus():
    """tools/decode_census.py on E4B's shape (meta device): the rewired layers run six operators fewer each (three
    adds, the scale and two norms of sums become three kernels; the next layer's input norm comes with the last; the
    first layer keeps its own), and the gelus two fewer; the stand-ins are put back after."""
    from conftest import tool

    found = {level: sum(counts.values()) for level, counts in tool("decode_census").census("e4b-shape").items()}
    layers = models.load_config("e4b-shape").get_text_config().num_hidden_layers
    assert found["eager"] > found["norms"] > found["rotary"]
    assert found["rotary"] - found["layers"] == 6 * layers - 1
    assert found["layers"] - found["activations"] == 2 * layers
    restored = (exact_norm.fused_residual_norm, exact_layer.is_decode_input, exact_layer.fused_gelu_mul)
    assert {function.__module__ for function in restored} == {"helpers.exact_norm", "helpers.exact_layer"}


def test_a_layer_called_with_another_tensor_than_the_one_handed_over_norms_its_own_input(scaled_tiny, monkeypatch):
    """A hook that changes the first layer's output between the layers: the second must norm what it is given, not
    take the norm the first layer's kernel made of its own output."""
    ids = torch.tensor([[2, 10, 20, 30]])
    outside = decoding.supports_ple_outside(scaled_tiny)
    first = exact_layer.layer_modules(scaled_tiny)[0]
    hook = first.register_forward_hook(lambda module, args, output: output * 1.5)
    try:
        plain = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside)).greedy(
            ids, 4, keep_logits=True)
        joined_on_the_cpu(monkeypatch, [])
        run = decoding.TunedGreedy(scaled_tiny, decoding.Decoder(compile=None, ple_outside=outside, fused_layers=True)).greedy(
            ids, 4, keep_logits=True)
    finally:
        hook.remove()
    assert torch.equal(run.logits, plain.logits)
