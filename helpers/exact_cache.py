"""The static cache's write of one decode token in one kernel, with the library's bits on CUDA.

transformers' ``StaticLayer.update`` (and ``StaticSlidingWindowLayer``'s before its window is full) writes a token's
key and value as five kernels: ``arange(1) + cumulative_length``, two ``index_copy_`` and ``cumulative_length.add_``.
Every layer that computes its own key and value does it at every step (24 of E4B's 42). Here one program copies both
rows to the position the counter holds, then advances the counter: copies and an integer add, so the same bits.

* ``write_token(keys, values, key_states, value_states, cumulative_length)``: that write in one launch;
* ``writable(layer, key_states, value_states)``: whether the kernel can take this update of this cache layer.

``decoding.Decoder(fused_cache=True)`` gives a decode step's cache layers the one-launch update.
tests/gpu/test_exact_cache_gpu.py checks it against the library's update on a GPU, with a control.
"""

from __future__ import annotations

import functools
import os

import torch

from .errors import InvalidChoiceError

tl = None  # triton.language, bound by _triton_kernel() on first use (the kernel's source names it)


def _write_token_kernel(keys_ptr, values_ptr, k_ptr, v_ptr, length_ptr, k_head_stride, v_head_stride, max_len,
                        D: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: every head's row of k and v to ``[head, position]`` of the cache, position the counter's value
    (no write at or past ``max_len``, where the library's index_copy_ would fail), then the counter + 1, after every
    thread has read it."""
    position = tl.load(length_ptr)
    offs = tl.arange(0, BLOCK)
    head, d = offs // D, offs % D
    inside = (offs < HEADS * D) & (position < max_len)
    at = (head * max_len + position) * D + d
    tl.store(keys_ptr + at, tl.load(k_ptr + head * k_head_stride + d, mask=inside), mask=inside)
    tl.store(values_ptr + at, tl.load(v_ptr + head * v_head_stride + d, mask=inside), mask=inside)
    tl.debug_barrier()
    tl.store(length_ptr, position + 1)


@functools.lru_cache(maxsize=2)
def _triton_kernel(interpret: bool):
    """The kernel, jitted on first use (``interpret``: TRITON_INTERPRET was set, CPU tensors)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_write_token_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _refusal(keys, values, key_states, value_states, cumulative_length) -> str | None:
    """Why the kernel cannot take this write, in one sentence; None where it can."""
    if keys.dim() != 4 or keys.shape[0] != 1 or not (keys.is_contiguous() and values.is_contiguous()):
        return f"the cache's keys {tuple(keys.shape)} must be one sequence's [1, heads, length, head_dim], contiguous."
    if values.shape != keys.shape or key_states.shape != value_states.shape or tuple(key_states.shape) != (
            1, keys.shape[1], 1, keys.shape[3]):
        return (f"key and value states {tuple(key_states.shape)}, {tuple(value_states.shape)} must be one token's "
                f"[1, {keys.shape[1]}, 1, {keys.shape[3]}] for a cache of {tuple(keys.shape)}.")
    if key_states.stride(3) != 1 or value_states.stride(3) != 1:
        return "each head's key and value must be consecutive values: the kernel copies rows."
    if not keys.dtype == values.dtype == key_states.dtype == value_states.dtype:
        return (f"the cache ({keys.dtype}) and the states ({key_states.dtype}, {value_states.dtype}) must share a dtype: "
                f"index_copy_ would refuse them too.")
    if cumulative_length.dtype != torch.long or cumulative_length.numel() != 1:
        return (f"cumulative_length must be the layer's one-value int64 counter, not {cumulative_length.dtype} x "
                f"{cumulative_length.numel()}.")
    if len({keys.device, values.device, key_states.device, value_states.device, cumulative_length.device}) != 1:
        return "the cache, the states and the counter must be on one device."
    return None


def write_token(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                cumulative_length: torch.Tensor) -> None:
    """``keys[:, :, n] = key_states``, ``values[:, :, n] = value_states`` and ``cumulative_length += 1``, n the
    counter's value, in one launch (no write where n is past the cache, as ``index_copy_`` would refuse it)."""
    refusal = _refusal(keys, values, key_states, value_states, cumulative_length)
    if refusal:
        raise InvalidChoiceError(f"write_token: {refusal}")
    heads, d = keys.shape[1], keys.shape[3]
    _triton_kernel(_interpreting())[(1,)](keys, values, key_states, value_states, cumulative_length, key_states.stride(1),
                                    value_states.stride(1), keys.shape[2], D=d, HEADS=heads,
                                    BLOCK=1 << (heads * d - 1).bit_length(), num_warps=4)


def writable(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """An initialised static cache layer's update of one CUDA token (a CPU one under Triton's interpreter) that the
    kernel can write, and in a sliding layer one its window still has room for: a full window rolls instead."""
    on_kernel_device = key_states.is_cuda or _interpreting()  # the interpreter runs the kernel on CPU tensors
    if not (getattr(layer, "is_initialized", False) and on_kernel_device and key_states.dim() == 4
            and key_states.shape[-2] == 1):
        return False
    if hasattr(layer, "cumulative_length_int") and layer.cumulative_length_int + 1 > layer.max_cache_len:
        return False
    return _refusal(layer.keys, layer.values, key_states, value_states, layer.cumulative_length) is None
