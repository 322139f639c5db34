"""Gemma 4's decoder layer in a decode step with each residual add joined to the norms around it, with the eager
layer's bits on CUDA.

Each of a decoder layer's three blocks ends the same way: a norm, then ``residual + normed``; the last also scales
by the layer scalar. A norm reads each sum next: the feed-forward block's, and the next layer's input norm. Eagerly
those ends are nine kernels beside the norms (three adds, the scale, two norms of the sums, each norm's own);
here each block's end is one kernel (``exact_norm.fused_residual_norm``), rounding every step to bf16 as ATen's
kernels do:

* ``fuse_layers(model, activations=False)``: each decoder layer takes a forward that runs the joined kernels for
  one-token CUDA inputs and its own forward for anything else (prefill); its last kernel also makes the next layer's
  input norm; with ``activations`` each gelu and its product are one kernel too. ``.installed()`` puts the forwards
  in for a while, ``.restore()`` takes them out;
* ``layer_modules(model)``: the layers it can join (dense MLP, per-layer inputs, a scalar, weighted norms);
* ``fused_gelu_mul(gate, other)``: ``gelu_tanh(gate) * other`` in one kernel (the MLP's and the per-layer
  input's gate), computed as ATen's CUDA gelu computes it (its one contracted multiply-add, then tanhf).

The attention and the projections still run as the model's own modules (fused norms and rotary included where
those are installed). tests/gpu/test_exact_layer_gpu.py checks each kernel's bits against the eager modules on a
GPU, with a one-ulp control.
"""

from __future__ import annotations

import functools
import inspect
import os

import numpy as np
import torch

from . import exact_norm
from .errors import InvalidChoiceError, require_bool, require_model

LAYER_CLASS = "Gemma4TextDecoderLayer"
MLP_CLASS = "Gemma4TextMLP"
JOINED_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
                "post_per_layer_input_norm")
ACTIVATION = "gelu_pytorch_tanh"  # Gemma 4's hidden_activation: F.gelu(x, approximate="tanh")
# ATen's constants (ActivationGeluKernel.cu): kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 and kKappa, as fp32
GELU_BETA = float(np.float32(1.41421356237309504880 * 1.12837916709551257390 * 0.5))
GELU_KAPPA = float(np.float32(0.044715))

tl = None  # triton.language and libdevice, bound by _gelu_kernel() on first use (the kernel's source names them)
libdevice = None
_to_bf16 = None  # exact_norm._to_bf16, jitted, likewise


def _gelu_mul_kernel(gate_ptr, other_ptr, out_ptr, beta, kappa, N: tl.constexpr, BLOCK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """out = bf16(bf16(gelu_tanh(gate)) * other), gelu as ATen's CUDA kernel evaluates it in fp32: x*x*x, the
    multiply-add nvcc contracts (kappa * x_cube + x) as one fma, * beta, tanhf, then 0.5 * x * (1 + t). The
    interpreter has no libdevice: its tanh is 1 - 2 / (exp(2 v) + 1), so there only the sequence around it is checked."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    inner = beta * tl.fma(kappa, (x * x) * x, x)
    if INTERPRET:
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    else:
        t = libdevice.tanh(inner)
    activated = _to_bf16((0.5 * x) * (1.0 + t))
    product = _to_bf16(activated * tl.load(other_ptr + offs, mask=inside, other=0.0).to(tl.float32))
    tl.store(out_ptr + offs, product.to(tl.bfloat16), mask=inside)  # already a bf16 value: the cast is exact


@functools.lru_cache(maxsize=2)
def _gelu_kernel(interpret: bool):
    """The kernel, jitted on first use (``interpret``: TRITON_INTERPRET was set, CPU tensors)."""
    global tl, libdevice
    import triton

    globals()["_to_bf16"] = exact_norm.jit_helpers()["_to_bf16"]
    tl, libdevice = exact_norm.tl, exact_norm.libdevice
    return triton.jit(_gelu_mul_kernel)


def multipliable(gate: torch.Tensor, other: torch.Tensor) -> bool:
    """Contiguous bf16 tensors of one shape on one device: what ``fused_gelu_mul`` takes."""
    return (gate.shape == other.shape and gate.dtype == other.dtype == torch.bfloat16 and gate.device == other.device
            and gate.is_contiguous() and other.is_contiguous())


def fused_gelu_mul(gate: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * other`` in one launch for contiguous bf16 tensors of one shape on one
    device, rounded as the two eager kernels round."""
    if not multipliable(gate, other):
        raise InvalidChoiceError(f"gate {tuple(gate.shape)} {gate.dtype} and other {tuple(other.shape)} {other.dtype} "
                                 f"must be contiguous bf16 tensors of one shape on one device: the kernel multiplies "
                                 f"them element by element.")
    out = torch.empty_like(gate)
    n, block = gate.numel(), 1024
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _gelu_kernel(interpret)[(-(-n // block),)](gate, other, out, GELU_BETA, GELU_KAPPA, N=n, BLOCK=block,
                                               INTERPRET=interpret, num_warps=4, enable_fp_fusion=False)
    return out


def is_decode_input(hidden_states: torch.Tensor) -> bool:
    """One bf16 token of one sequence on CUDA ([1, 1, hidden]) whose norm order ``exact_norm`` derives."""
    return (hidden_states.dtype == torch.bfloat16 and hidden_states.numel() == hidden_states.shape[-1]
            and exact_norm.is_decode_input(hidden_states))


def _joinable(layer) -> bool:
    """A dense layer with per-layer inputs, one scalar and weighted ``Gemma4RMSNorm``s at each block's end."""
    norms = [getattr(layer, name, None) for name in JOINED_NORMS]
    return (type(layer).__name__ == LAYER_CLASS and not getattr(layer, "enable_moe_block", False)
            and bool(getattr(layer, "hidden_size_per_layer_input", 0)) and getattr(layer, "layer_scalar", None) is not None
            and layer.layer_scalar.numel() == 1
            and all(_weighted_norm(norm) for norm in norms))


def _weighted_norm(norm) -> bool:
    return type(norm).__name__ == exact_norm.NORM_CLASS and getattr(norm, "with_scale", True)


def layer_modules(model) -> list:
    """Every decoder layer of ``model`` whose block ends ``fuse_layers`` can join, in module order."""
    require_model(model)
    return [m for m in model.modules() if _joinable(m)]


def _weight32(norm) -> torch.Tensor:
    return norm.weight.detach().float().contiguous()


def gelu_tanh(layer) -> bool:
    """Whether the layer's MLP and per-layer-input gate run tanh-approximated gelu (Gemma 4's), which
    ``fused_gelu_mul`` computes."""
    config = getattr(getattr(layer, "mlp", None), "config", None)
    return getattr(config, "hidden_activation", None) == ACTIVATION and type(layer.mlp).__name__ == MLP_CLASS


def _gelu_times(act_fn, gate: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate) * other``, in one kernel where the tensors allow it."""
    return fused_gelu_mul(gate, other) if multipliable(gate, other) else act_fn(gate) * other


def _fused_forward(layer, activations: bool, following, handoff: dict):
    """The joined forward of ``layer``; with ``following`` (the layer called next) its last kernel also runs that
    layer's input norm and leaves ``(output, normed)`` in ``handoff`` for it, which takes it only if the output is
    the very tensor it is called with."""
    original = layer.forward  # the class's forward, bound
    signature = inspect.signature(original)
    keywords = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    post_attention, pre_feedforward, post_feedforward, post_per_layer = (
        (_weight32(getattr(layer, name)), exact_norm._norm_eps(getattr(layer, name))) for name in JOINED_NORMS)
    next_input = (_weight32(following.input_layernorm), exact_norm._norm_eps(following.input_layernorm)) if following else None

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        arguments = signature.bind(hidden_states, *args, **kwargs).arguments
        per_layer_input = arguments.pop("per_layer_input", None)
        if (per_layer_input is None or not is_decode_input(hidden_states)
                or {post_attention[0].device, layer.layer_scalar.device} != {hidden_states.device}):
            return original(hidden_states, *args, **kwargs)  # prefill, or a layer placed apart from its input
        arguments.pop("hidden_states")
        attention = {**arguments, **arguments.pop(keywords, {})} if keywords else arguments  # as the layer passes them
        residual = hidden_states
        pending = handoff.pop(layer, None)
        normed = pending[1] if pending is not None and pending[0] is hidden_states else layer.input_layernorm(hidden_states)
        hidden_states, _ = layer.self_attn(hidden_states=normed, **attention)
        residual, hidden_states = exact_norm.fused_residual_norm(
            hidden_states, *post_attention, residual, next_weight32=pre_feedforward[0], next_eps=pre_feedforward[1])
        if activations:  # the MLP's own forward, its gelu and product in one kernel
            mlp = layer.mlp
            hidden_states = mlp.down_proj(_gelu_times(mlp.act_fn, mlp.gate_proj(hidden_states), mlp.up_proj(hidden_states)))
        else:
            hidden_states = layer.mlp(hidden_states)
        residual = exact_norm.fused_residual_norm(hidden_states, *post_feedforward, residual)
        gate = layer.per_layer_input_gate(residual)
        hidden_states = (_gelu_times(layer.act_fn, gate, per_layer_input) if activations
                         else layer.act_fn(gate) * per_layer_input)
        projected = layer.per_layer_projection(hidden_states)
        if next_input is None:
            return exact_norm.fused_residual_norm(projected, *post_per_layer, residual, scale=layer.layer_scalar)
        output, normed = exact_norm.fused_residual_norm(projected, *post_per_layer, residual, scale=layer.layer_scalar,
                                                        next_weight32=next_input[0], next_eps=next_input[1])
        handoff[following] = (output, normed)
        return output

    return forward


class FusedLayers(exact_norm.SwappedForwards):
    """The layers ``fuse_layers`` swapped and their joined forwards, and what each hands the next while a step runs."""

    def __init__(self, forwards: dict, handoff: dict):
        super().__init__(forwards)
        self.handoff = handoff  # layer -> (its input, that input normed) from the layer before

    def restore(self) -> int:
        self.handoff.clear()
        return super().restore()


def fuse_layers(model, activations: bool = False) -> FusedLayers:
    """Give each joinable decoder layer of ``model`` the forward whose block ends run as one kernel each for one-token
    CUDA inputs, the last one also the next layer's input norm, falling back to its own forward for any other input;
    with ``activations``, each gelu and the product after it too (``fused_gelu_mul``), in the layers whose MLP runs
    its own tanh gelu. Call it after the model is placed (each norm weight is cast to fp32 once, here) and after
    accelerate's hooks are removed."""
    require_model(model)
    activations = require_bool(activations, "activations")
    layers = [layer for layer in layer_modules(model) if exact_norm._runs_its_class_forward(layer)]
    handoff: dict = {}
    followers = [following if following is not None and _weighted_norm(following.input_layernorm) else None
                 for following in [*layers[1:], None]]
    forwards = {layer: _fused_forward(layer, activations and gelu_tanh(layer) and exact_norm._runs_its_class_forward(layer.mlp),
                                      following, handoff) for layer, following in zip(layers, followers)}
    for layer, forward in forwards.items():
        layer.forward = forward
    return FusedLayers(forwards, handoff)
