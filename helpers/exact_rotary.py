"""Gemma 4's rotary embedding of one decode token in one kernel, with the eager function's bits on CUDA.

transformers' ``apply_rotary_pos_emb(x, cos, sin)`` is ``(x * cos) + (rotate_half(x) * sin)``: two slices, a
``neg``, a ``cat`` and three arithmetic kernels, each rounding to bf16 (ATen computes each in fp32 and rounds
its result). The query of every layer and the key of each layer that computes one go through it, so a decode
step of E4B runs it 66 times. Repeating each rounding in one Triton kernel gives the same bits:

* ``fused_rotary(x, cos, sin)``: the rotation of ``x`` [..., heads, d] by ``cos``/``sin`` [..., d], one launch;
* ``fuse_rotary()``: Gemma 4's modeling module calls the one-kernel rotation for one-token CUDA inputs and its
  own function for anything else, until ``restore()``.

tests/gpu/test_exact_rotary_gpu.py checks the bits against the eager function on a GPU, with a one-ulp control.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import exact_norm
from .errors import InvalidChoiceError

MODELING_MODULE = "transformers.models.gemma4.modeling_gemma4"
FUNCTION = "apply_rotary_pos_emb"

tl = None  # triton.language, bound by _triton_kernel() on first use (the kernel's source names it)
_to_bf16 = None  # exact_norm._to_bf16, jitted: bound by _triton_kernel() likewise


def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, D: tl.constexpr, HALF: tl.constexpr):
    """One program per head: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), each product and the sum in
    fp32 and rounded once, as ATen's three bf16 kernels do (enable_fp_fusion=False: no FMA joins them)."""
    row = tl.program_id(0) * D
    offs = tl.arange(0, HALF)
    low = tl.load(x_ptr + row + offs).to(tl.float32)  # x1
    high = tl.load(x_ptr + row + HALF + offs).to(tl.float32)  # x2
    cos_low, cos_high = tl.load(cos_ptr + offs).to(tl.float32), tl.load(cos_ptr + HALF + offs).to(tl.float32)
    sin_low, sin_high = tl.load(sin_ptr + offs).to(tl.float32), tl.load(sin_ptr + HALF + offs).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): the first half takes -x2, the second x1 (neg is exact)
    out_low = _to_bf16(_to_bf16(low * cos_low) + _to_bf16(-high * sin_low))
    out_high = _to_bf16(_to_bf16(high * cos_high) + _to_bf16(low * sin_high))
    tl.store(out_ptr + row + offs, out_low.to(tl.bfloat16))  # already bf16 values: the cast is exact
    tl.store(out_ptr + row + HALF + offs, out_high.to(tl.bfloat16))


@functools.lru_cache(maxsize=2)
def _triton_kernel(interpret: bool):
    """The kernel, jitted on first use (``interpret``: TRITON_INTERPRET was set, CPU tensors)."""
    global tl
    import triton

    globals()["_to_bf16"] = exact_norm.jit_helpers()["_to_bf16"]  # the kernel calls it by this name
    tl = exact_norm.tl
    return triton.jit(_rotary_kernel)


def _refusal(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel cannot rotate these inputs, in one sentence; None where it can."""
    d = x.shape[-1]
    if not x.is_contiguous() or d % 2 or d & (d - 1):
        return (f"x {tuple(x.shape)} must be contiguous with a power-of-two last dim: the kernel reads each head's two "
                f"halves as consecutive values.")
    if cos.numel() != d or sin.numel() != d or not (cos.is_contiguous() and sin.is_contiguous()):
        return (f"cos and sin must hold one position's {d} values, contiguous (got {tuple(cos.shape)}, "
                f"{tuple(sin.shape)}): the fused rotation serves one decode token.")
    if not x.dtype == cos.dtype == sin.dtype == torch.bfloat16:
        return (f"x, cos and sin must be bfloat16 (got {x.dtype}, {cos.dtype}, {sin.dtype}): the kernel rounds as bf16 "
                f"kernels do; other dtypes keep transformers' function.")
    return None


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(x * cos) + (rotate_half(x) * sin)`` in one launch, with the eager result's bits: ``x`` contiguous bf16
    [..., heads, d] and ``cos``, ``sin`` contiguous bf16 with d values each (one position)."""
    refusal = _refusal(x, cos, sin)
    if refusal:
        raise InvalidChoiceError(refusal)
    d = x.shape[-1]
    out = torch.empty_like(x)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _triton_kernel(interpret)[(x.numel() // d,)](x, cos, sin, out, D=d, HALF=d // 2, num_warps=max(1, min(4, d // 128)),
                                                enable_fp_fusion=False)
    return out


def is_decode_input(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """One token of one sequence on CUDA ([1, 1, heads, d]) that the kernel can rotate."""
    return x.is_cuda and x.dim() == 4 and x.shape[0] == x.shape[1] == 1 and _refusal(x, cos, sin) is None


class FusedRotary:
    """Gemma 4's modeling module with the one-kernel rotation for decode inputs: ``restore()`` (or leaving a
    ``with`` block) puts its own function back; ``installed()`` swaps it in for a while."""

    def __init__(self):
        import importlib

        self.module = importlib.import_module(MODELING_MODULE)
        self.original = vars(self.module)[FUNCTION]
        original = self.original

        def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim: int = 1):
            if unsqueeze_dim == 2 and is_decode_input(x, cos, sin):
                return fused_rotary(x, cos, sin)
            return original(x, cos, sin, unsqueeze_dim=unsqueeze_dim)

        self.fused = apply_rotary_pos_emb

    def restore(self) -> None:
        setattr(self.module, FUNCTION, self.original)

    @contextlib.contextmanager
    def installed(self):
        with self:
            yield self

    def __enter__(self):
        setattr(self.module, FUNCTION, self.fused)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def fuse_rotary() -> FusedRotary:
    """The swap, not yet installed: ``with fuse_rotary(): ...`` or ``.installed()`` around a decode loop. Capture
    CUDA graphs inside it (the attention reads the module's function at each call)."""
    return FusedRotary()
