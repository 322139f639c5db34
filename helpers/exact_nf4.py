"""bitsandbytes' one-token NF4 matmul as a Triton kernel with bitsandbytes' bits on CUDA, and several of them that
read one input in one launch.

A batch-1 decode step spends most of its GPU time in bitsandbytes' SIMT kernel (``gemm_4bit_simt`` in its
``csrc/gemm_4bit_simt.cu``, 0.50), one launch per projection. That kernel gives each output row one warp; lane
``l`` walks K in groups of 1024, taking the 32 weights at ``g * 1024 + l * 32``; it rounds each weight
(centroid times block scale) and each product to the compute dtype, adds the two products of a byte in fp32, adds
that to its fp32 sum in order, and the warp sums its 32 lanes with ``__shfl_down`` at 16, 8, 4, 2 and 1. The sums
here run in exactly that order, so the result is the same to the bit:

* ``gemv_eager(x, module)``: that order in plain torch ops, on any device (the CPU tests' reference);
* ``nf4_gemv(x, modules)``: one kernel for one or more NF4 ``Linear4bit`` that read the same one-token input;
* ``fuse_gemv(model)``: each NF4 ``Linear4bit`` of a model takes the kernel for one-token CUDA inputs and keeps its
  own forward for anything else; the q, k and v projections of an attention block, and the gate and up
  projections of an MLP, run as one launch. ``.installed()`` / ``.restore()`` as ``exact_norm.SwappedForwards``.

The order is bitsandbytes 0.50's (``SUMMED_AS``): ``fuse_gemv`` refuses another release rather than guess.
``tools/bnb_sass.py`` reads it in the machine code of every GPU architecture the wheel ships (the nested scale is
one fma there too). Each of its fp32 adds flushes what is below 2**-126 to zero (``--use_fast_math``), and so do the
adds here. Only on sm_75 in bf16 does it also flush a product before rounding it (an fp32 multiply there); a product
so small is far under any decode step's. tests/gpu/test_exact_nf4_gpu.py checks the bits on a GPU beside a one-ulp
control.
"""

from __future__ import annotations

import functools
import os

import torch

from . import exact_norm
from .errors import InvalidChoiceError, TunedDecodeError, require_model

SUMMED_AS = "0.50."  # the bitsandbytes releases whose SIMT kernel sums in this order
GROUP = 1024  # K elements a warp takes per step: 32 lanes x 32 weights (NUM_VAL, K_STRIDE in gemm_4bit_simt.cu)
LANES = 32
NESTED_BLOCK = 256  # bitsandbytes' gemm_4bit takes nested scales only with state2.blocksize 256
# rows per program, warps, and the tile's layout: tools/nf4_gemv_probe.py times the choices (the bits are the same).
# bitsandbytes' own geometry, a warp per row and four rows a block: enough warps in flight for a 2,560-row layer (32
# rows a program left 80 programs for an H200's 132 SMs, and the kernel at 330 GB/s: decode-gemv's profile).
# STAGES: the loop over K's groups software-pipelined that deep (Triton's num_stages; 3 is its CUDA default): loads
# of later groups in flight, the sums in the same order
ROWS, WARPS, LANES_FIRST, PACKED, STAGES = 4, 4, False, True, 3
TILE_KNOBS = ("ROWS", "WARPS", "LANES_FIRST", "PACKED", "STAGES")  # the settings above, which the probe varies


def tile() -> dict:
    """The kernel's geometry now, as a record keeps it: its speed depends on it, its bits do not."""
    return {knob.lower(): globals()[knob] for knob in TILE_KNOBS}

tl = None  # triton.language, bound by _kernel() on first use (the kernel's source names it)
_to_bf16 = None


def _round_to(v, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> the nearest bf16 or fp16 (ties to even), kept in fp32 (the interpreter's bf16 cast truncates, so
    there the bits are rounded by hand)."""
    if IS_BF16:
        if INTERPRET:
            return _to_bf16(v)
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    return v.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)


def _halves(pair, IS_BF16: tl.constexpr):
    """Two 16-bit floats packed in an int32 (the lower K index in the low half) -> (lower, higher) in fp32."""
    if IS_BF16:
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
    low = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


def _bits16(v, IS_BF16: tl.constexpr):
    """fp32 -> the 16 bits of the nearest bf16 or fp16 (ties to even), in the low half of an int32."""
    if IS_BF16:
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return v.to(tl.float16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


def _mul2(a, b, IS_BF16: tl.constexpr):
    """Two packed 16-bit products, each rounded to nearest even, as bitsandbytes' __hmul2: bf16 as an fma with -0
    (sm_80 and later have no bf16x2 mul before sm_90), fp16 as mul.rn.f16x2."""
    if IS_BF16:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.full(a.shape, -2147450880, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


def _add(a, b, INTERPRET: tl.constexpr):
    """a + b in fp32 as bitsandbytes' fast-math build adds: inputs and result below 2**-126 flushed to a zero of
    their sign (PTX add.ftz; the interpreter has no inline PTX, so there by hand)."""
    if INTERPRET:
        return _flushed(_flushed(a) + _flushed(b))
    return tl.inline_asm_elementwise("add.ftz.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


def _flushed(v):
    return tl.where(tl.abs(v) < 1.1754943508222875e-38, v * 0.0, v)


def _quarter(v, INDEX: tl.constexpr):
    """Element ``INDEX`` of ``v``'s last axis of 4, that axis dropped (``tl.split`` halves a last axis of 2)."""
    low, high = tl.split(tl.reshape(v, v.shape[:-1] + [2, 2]))  # index 2 * i + j: low holds j = 0, high j = 1
    even, odd = tl.split(low if INDEX % 2 == 0 else high)
    return even if INDEX // 2 == 0 else odd


def _halves_summed(acc, WIDTH: tl.constexpr, ROWS: tl.constexpr, LANES_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    """Lane i plus lane i + WIDTH for i < WIDTH: one step of __shfl_down's tree over the lane axis."""
    if LANES_FIRST:  # [2 * WIDTH, ROWS] -> [WIDTH, ROWS]
        first, second = tl.split(tl.permute(tl.reshape(acc, [2, WIDTH, ROWS]), (1, 2, 0)))
    else:  # [ROWS, 2 * WIDTH] -> [ROWS, WIDTH]
        first, second = tl.split(tl.permute(tl.reshape(acc, [ROWS, 2, WIDTH]), (0, 2, 1)))
    return _add(first, second, INTERPRET)


def _gemv_kernel(x_ptr, out_ptr, lut_ptr, lut_pairs_ptr, code_ptr, words0, scales0, nested0, offset0, words1, scales1, nested1,
                 offset1, words2, scales2, nested2, offset2, END0, END1, N_ALL, K: tl.constexpr,
                 BLOCK_LOG2: tl.constexpr, NESTED: tl.constexpr, IS_BF16: tl.constexpr, ROWS: tl.constexpr,
                 LANES_FIRST: tl.constexpr, PACKED: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows [0, N_ALL) of up to three weights stacked (weight i holds rows [END(i-1), END(i))): out[row] = the row
    times x (``x_ptr``: its values in int32 pairs), summed as bitsandbytes' SIMT kernel sums (module docstring).
    Masked lanes add nothing, as its idle lanes do. ``LANES_FIRST`` lays the tile out [lane, row], so a warp's
    threads hold rows and read each x pair once for all of them; otherwise [row, lane], as bitsandbytes does.
    ``PACKED``: each byte's two weights and products as one packed bf16x2 / f16x2 operation, as bitsandbytes
    computes them (the same roundings; not in the interpreter, which has no inline PTX); a byte's two centroids are
    then one load from ``lut_pairs_ptr`` (256 packed pairs). K's groups are a loop, not unrolled: one body of code
    for any K."""
    base = tl.program_id(0) * ROWS
    if LANES_FIRST:
        row = base + tl.arange(0, ROWS)[None, :]
        lane = tl.arange(0, 32)[:, None]
        acc = tl.zeros([32, ROWS], dtype=tl.float32)
    else:
        row = base + tl.arange(0, ROWS)[:, None]
        lane = tl.arange(0, 32)[None, :]
        acc = tl.zeros([ROWS, 32], dtype=tl.float32)
    first, second = row < END0, row < END1
    words = tl.where(first, words0, tl.where(second, words1, words2))  # int32 pointer per row
    scales = tl.where(first, scales0, tl.where(second, scales1, scales2))
    local = tl.where(first, row, tl.where(second, row - END0, row - END1))  # the row inside its own weight
    live_row = row < N_ALL
    for group in tl.range(0, (K + 1023) // 1024):
        inner = group * 1024 + lane * 32  # this lane's first K index
        on = live_row & (inner < K)
        block = local * (K >> BLOCK_LOG2) + (inner >> BLOCK_LOG2)
        if NESTED:
            nested = tl.where(first, nested0, tl.where(second, nested1, nested2))
            offset = tl.load(tl.where(first, offset0, tl.where(second, offset1, offset2)), mask=on, other=0.0)
            index = tl.load(nested + block, mask=on, other=0).to(tl.int32)
            scale = tl.fma(tl.load(code_ptr + index, mask=on, other=0.0), tl.load(scales + (block >> 8), mask=on,
                                                                                   other=0.0), offset)
        else:
            scale = tl.load(scales + block, mask=on, other=0.0)
        scale = _round_to(scale, IS_BF16, INTERPRET)
        if PACKED:
            scale_bits = _bits16(scale, IS_BF16)
            scale2 = scale_bits | (scale_bits << 16)
        a_on = inner < K
        # the lane's 16 bytes as four little-endian words, and its 32 inputs as 16 pairs: one 16-byte load for the
        # weights (as bitsandbytes reads them) and four for x, split apart in registers
        quad = tl.arange(0, 4)[None, None, :]
        word_quad = tl.load((words + local * (K // 8) + inner // 8)[:, :, None] + quad, mask=on[:, :, None], other=0)
        x_quads = tl.load((x_ptr + inner // 2)[:, :, None] + tl.arange(0, 16)[None, None, :], mask=a_on[:, :, None],
                          other=0)
        x_by_s = tl.permute(tl.reshape(x_quads, [x_quads.shape[0], x_quads.shape[1], 4, 4]), (0, 1, 3, 2))
        for w in tl.static_range(4):
            word = _quarter(word_quad, w)
            x_of_word = _quarter(x_by_s, w)  # the pairs 4w .. 4w + 3
            for s in tl.static_range(4):
                byte = (word >> (8 * s)) & 0xFF
                x_pair = _quarter(x_of_word, s)
                if PACKED:  # the high nibble is the lower K index: the pair's low half, as x's
                    weights = tl.load(lut_pairs_ptr + byte)
                    low, high = _halves(_mul2(_mul2(weights, scale2, IS_BF16), x_pair, IS_BF16), IS_BF16)
                else:
                    a_low, a_high = _halves(x_pair, IS_BF16)
                    low = _round_to(_round_to(tl.load(lut_ptr + (byte >> 4)) * scale, IS_BF16, INTERPRET) * a_low,
                                    IS_BF16, INTERPRET)
                    high = _round_to(_round_to(tl.load(lut_ptr + (byte & 0xF)) * scale, IS_BF16, INTERPRET) * a_high,
                                     IS_BF16, INTERPRET)
                acc = _add(acc, tl.where(on, _add(low, high, INTERPRET), 0.0), INTERPRET)
    # lane i + lane i+16, then 8, 4, 2, 1: __shfl_down's tree
    total = _halves_summed(acc, 16, ROWS, LANES_FIRST, INTERPRET)
    total = _halves_summed(total, 8, ROWS, LANES_FIRST, INTERPRET)
    total = _halves_summed(total, 4, ROWS, LANES_FIRST, INTERPRET)
    total = _halves_summed(total, 2, ROWS, LANES_FIRST, INTERPRET)
    total = tl.reshape(_halves_summed(total, 1, ROWS, LANES_FIRST, INTERPRET), [ROWS])
    rows = base + tl.arange(0, ROWS)
    total = _add(total, tl.zeros([ROWS], dtype=tl.float32), INTERPRET)  # bitsandbytes adds its bias, 0 without one
    tl.store(out_ptr + rows, _round_to(total, IS_BF16, INTERPRET).to(out_ptr.dtype.element_ty), mask=rows < N_ALL)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel, jitted on first use (``interpret``: TRITON_INTERPRET was set, CPU tensors)."""
    global tl
    import triton

    globals()["_to_bf16"] = exact_norm.jit_helpers()["_to_bf16"]
    tl = exact_norm.tl
    globals()["_round_to"] = triton.jit(_round_to)
    globals()["_halves"] = triton.jit(_halves)
    globals()["_bits16"] = triton.jit(_bits16)
    globals()["_mul2"] = triton.jit(_mul2)
    globals()["_flushed"] = triton.jit(_flushed)
    globals()["_add"] = triton.jit(_add)
    globals()["_halves_summed"] = triton.jit(_halves_summed)
    globals()["_quarter"] = triton.jit(_quarter)
    return triton.jit(_gemv_kernel)


# --------------------------------------------------------------------------- which layers, which inputs

def _state(module):
    weight = getattr(module, "weight", None)
    return getattr(weight, "quant_state", None)


def takes_kernel(module) -> bool:
    """An NF4 ``Linear4bit`` without a bias, in inference, whose K the kernel's groups cover: what ``nf4_gemv``
    takes. Nested (double-quantized) scales only as bitsandbytes' fused kernel takes them (state2 blocks of 256)."""
    state = _state(module)
    if type(module).__name__ not in ("Linear4bit", "LinearNF4") or state is None or module.training:
        return False
    if getattr(module, "bias", None) is not None or state.quant_type != "nf4" or len(state.shape) != 2:
        return False
    if getattr(state, "packing_format_for_cpu", False):  # repacked for bitsandbytes' CPU kernel: another layout
        return False
    n, k = (int(d) for d in state.shape)
    blocksize = int(state.blocksize)
    if k % 32 or k % blocksize or blocksize & (blocksize - 1) or blocksize < 32:
        return False
    if state.nested and int(state.state2.blocksize) != NESTED_BLOCK:
        return False
    return module.weight.is_contiguous() and module.weight.data_ptr() % 16 == 0 and module.weight.numel() * 2 == n * k


def compute_dtype(module) -> torch.dtype | None:
    """The dtype the layer computes in once it has run (None before: bitsandbytes sets it on the first call)."""
    if not getattr(module, "compute_type_is_set", False):
        return None
    return module.compute_dtype


def is_decode_input(x: torch.Tensor, modules: list) -> bool:
    """One CUDA token ([..., K], one row, contiguous) in the dtype the layers compute in, on their device."""
    if x.device.type != "cuda" or x.numel() != x.shape[-1] or not x.is_contiguous():
        return False
    if torch.is_grad_enabled() and x.requires_grad:  # bitsandbytes takes its autograd path then, not the SIMT kernel
        return False
    return all(compute_dtype(m) == x.dtype in (torch.bfloat16, torch.float16) and m.weight.device == x.device
               and int(_state(m).shape[1]) == x.shape[-1] for m in modules)


# --------------------------------------------------------------------------- the reference and the launch

def _scales(state) -> torch.Tensor:
    """The fp32 block scales as bitsandbytes' kernel makes them (nested: code[q] * absmax2[b >> 8] + offset, one
    contracted multiply-add)."""
    if not state.nested:
        return state.absmax.float()
    quantized = state.absmax.long()
    coarse = state.state2.absmax.float()[torch.arange(quantized.numel(), device=quantized.device) // NESTED_BLOCK]
    fine = state.state2.code.float()[quantized]
    # the product of two fp32 is exact in float64; the sum then rounds twice, which the GPU test would catch
    return (fine.double() * coarse.double() + state.offset.double()).float()


def _lut(state, dtype: torch.dtype) -> torch.Tensor:
    """The 16 NF4 centroids rounded to the compute dtype, kept in fp32 (``static_cast<T>(lut[lane])``)."""
    return state.code.float().to(dtype).float().contiguous()


def _lut_pairs(state, dtype: torch.dtype) -> torch.Tensor:
    """For each byte, its two centroids' 16 bits packed in an int32: the high nibble's (the lower K index) in the
    low half, as x's pairs are packed."""
    bits = state.code.float().to(dtype).view(torch.int16).long() & 0xFFFF
    byte = torch.arange(256, device=bits.device)
    pairs = bits[byte >> 4] | (bits[byte & 0xF] << 16)
    return torch.where(pairs >= 2 ** 31, pairs - 2 ** 32, pairs).to(torch.int32).contiguous()  # the same 32 bits


def gemv_eager(x: torch.Tensor, module) -> torch.Tensor:
    """``module(x)`` for one token, summed in the order of bitsandbytes' SIMT kernel with torch ops: the reference
    the kernel is held to. ``x``: [..., K] with one row, in the layer's compute dtype."""
    state, dtype = _state(module), x.dtype
    n, k = (int(d) for d in state.shape)
    groups = -(-k // GROUP)

    def rounded(v):
        return v.to(dtype).float()

    def flushed(v):  # bitsandbytes' fp32 adds flush what is below 2**-126 to a zero of its sign
        return torch.where(v.abs() < torch.finfo(torch.float32).tiny, v * 0.0, v)

    def add(a, b):
        return flushed(flushed(a) + flushed(b))

    packed = module.weight.detach().reshape(n, k // 2)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(n, k).long()  # high nibble first
    scale = rounded(_scales(state).reshape(n, -1)).repeat_interleave(int(state.blocksize), dim=1)
    weights = rounded(_lut(state, dtype)[nibbles] * scale)
    products = rounded(weights * x.reshape(1, k).float())
    pairs = add(products[:, 0::2], products[:, 1::2])  # [n, k/2]
    padded = torch.zeros(n, groups * GROUP // 2, dtype=torch.float32, device=pairs.device)
    padded[:, :k // 2] = pairs
    lanes = padded.reshape(n, groups, LANES, 16)
    acc = torch.zeros(n, LANES, dtype=torch.float32, device=pairs.device)
    for group in range(groups):
        for pair in range(16):
            acc = add(acc, lanes[:, group, :, pair])
    while acc.shape[1] > 1:
        half = acc.shape[1] // 2
        acc = add(acc[:, :half], acc[:, half:])
    return add(acc[:, 0], torch.zeros_like(acc[:, 0])).to(dtype).reshape(*x.shape[:-1], n)


class _Weights:
    """What the kernel reads of one layer, made once: its packed bytes as int32 words, its scales and centroids."""

    def __init__(self, module):
        state = self.state = _state(module)
        self.n, self.k = (int(d) for d in state.shape)
        self.words = module.weight.detach().reshape(-1).view(torch.uint8).view(torch.int32)
        self.nested = bool(state.nested)
        if self.nested:
            self.scales = state.state2.absmax.float().contiguous()
            self.quantized = state.absmax.contiguous()
            self.code = state.state2.code.float().contiguous()
            self.offset = state.offset.float().reshape(1).contiguous()
        else:
            self.scales = state.absmax.float().contiguous()
            self.quantized = self.code = self.offset = None
        self.blocksize = int(state.blocksize)
        self.luts = {}

    def lut(self, dtype):
        if dtype not in self.luts:
            self.luts[dtype] = _lut(self.state, dtype), _lut_pairs(self.state, dtype)
        return self.luts[dtype]


def _weights(module) -> _Weights:
    cached = vars(module).get("_exact_nf4")
    if cached is None or cached.words.data_ptr() != module.weight.data_ptr():
        cached = _Weights(module)
        module._exact_nf4 = cached
    return cached


def can_join(modules: list) -> bool:
    """Layers one launch can run: one to three that ``takes_kernel``, with one K, one block size, one nesting and one
    centroid table."""
    if not 1 <= len(modules) <= 3 or not all(takes_kernel(m) for m in modules):
        return False
    states = [_state(m) for m in modules]
    first = states[0]
    return all(int(s.shape[1]) == int(first.shape[1]) and int(s.blocksize) == int(first.blocksize)
               and bool(s.nested) == bool(first.nested) and torch.equal(s.code.cpu(), first.code.cpu())
               for s in states)


def packs(x: torch.Tensor) -> bool:
    """Whether the kernel multiplies packed pairs for ``x`` (on a CUDA device; see ``packs_on``)."""
    return x.device.type == "cuda" and packs_on(x.dtype, torch.cuda.get_device_capability(x.device))


def packs_on(dtype: torch.dtype, capability: tuple) -> bool:
    """``PACKED`` set, and fp16, or bf16 on sm_80 or later (PTX has no bf16x2 arithmetic before)."""
    return PACKED and (dtype == torch.float16 or tuple(capability) >= (8, 0))


def nf4_gemv(x: torch.Tensor, modules: list) -> list:
    """Each layer of ``modules`` (``can_join``) applied to the one-token ``x`` in one launch, with bitsandbytes' bits:
    a list of outputs, [..., N_i] each, in x's dtype."""
    if not can_join(list(modules)):
        raise InvalidChoiceError("nf4_gemv takes one to three NF4 Linear4bit layers without a bias that share K, "
                                 "block size and nesting; run the others as they are.")
    k = int(_state(modules[0]).shape[1])
    if x.numel() != x.shape[-1] or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[-1] != k:
        raise InvalidChoiceError(f"nf4_gemv takes one token of {k} bf16 or fp16 values; got {tuple(x.shape)} {x.dtype}.")
    return _launch(x.contiguous(), modules)


def _launch(x: torch.Tensor, modules: list) -> list:
    """``nf4_gemv`` without its checks, for layers and an input already checked (the decode step's hot path: no
    host sync, nothing a CUDA graph capture refuses)."""
    held = [_weights(m) for m in modules]
    sizes = [w.n for w in held]
    total = sum(sizes)
    out = torch.empty(total, dtype=x.dtype, device=x.device)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [total] * (3 - len(sizes))
    nested = held[0].nested
    arguments = []
    for w in held + [held[-1]] * (3 - len(held)):  # unused weight slots repeat the last: no row reaches them
        arguments += [w.words, w.scales, w.quantized if nested else w.words, w.offset if nested else w.scales]
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    lut, lut_pairs = held[0].lut(x.dtype)
    _kernel(interpret)[(-(-total // ROWS),)](
        x.view(torch.int32), out, lut, lut_pairs, held[0].code if nested else held[0].scales, *arguments,
        ends[0], ends[1], total, K=held[0].k, BLOCK_LOG2=held[0].blocksize.bit_length() - 1, NESTED=nested,
        IS_BF16=x.dtype == torch.bfloat16, ROWS=ROWS, LANES_FIRST=LANES_FIRST, PACKED=packs(x) and not interpret,
        INTERPRET=interpret, num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False)
    return [part.reshape(*x.shape[:-1], n) for part, n in zip(out.split(sizes), sizes)]


# --------------------------------------------------------------------------- the model's layers

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read one input


def _joined_forward(module, group: list, handoff: dict):
    """``module``'s forward: for a one-token CUDA input, the first of ``group`` runs the whole group in one launch
    and leaves each sibling its output in ``handoff``, which the sibling takes only for the very same input tensor;
    anything else (prefill, another dtype) runs the layer's own forward. ``gemv_groups`` checked the layers once."""
    original = module.forward  # the class's forward, bound

    def forward(x: torch.Tensor) -> torch.Tensor:
        if module is not group[0]:
            pending = handoff.pop(module, None)
            if pending is not None and pending[0] is x:
                return pending[1]
        if not is_decode_input(x, group if module is group[0] else [module]):
            return original(x)
        if module is not group[0]:
            return _launch(x, [module])[0]
        outputs = _launch(x, group)
        for sibling, output in zip(group[1:], outputs[1:]):
            handoff[sibling] = (x, output)
        return outputs[0]

    return forward


class JoinedGemv(exact_norm.SwappedForwards):
    """The layers ``fuse_gemv`` swapped, their forwards, and what a group's first layer leaves its siblings."""

    def __init__(self, forwards: dict, handoff: dict, groups: list):
        super().__init__(forwards)
        self.handoff, self.groups = handoff, groups

    def restore(self) -> int:
        self.handoff.clear()
        return super().restore()


def gemv_groups(model) -> list:
    """The NF4 layers of ``model`` the kernel takes, as launches: a block's q, k, v (those it has) and an MLP's gate
    and up each as one group, every other such layer alone."""
    require_model(model)
    groups, grouped = [], set()
    for parent in model.modules():
        for names in GROUPS:
            members = [m for m in (getattr(parent, name, None) for name in names) if m is not None]
            if len(members) > 1 and all(exact_norm._runs_its_class_forward(m) for m in members) and can_join(members):
                groups.append(members)
                grouped.update(members)
    for module in model.modules():
        if module not in grouped and takes_kernel(module) and exact_norm._runs_its_class_forward(module):
            groups.append([module])
    return groups


def fuse_gemv(model) -> JoinedGemv:
    """Give each NF4 layer of ``model`` that ``takes_kernel`` the forward that runs ``nf4_gemv`` for one-token CUDA
    inputs, siblings that read one input in one launch (``gemv_groups``), and its own forward for anything else.
    Call it after the model is placed and accelerate's hooks are removed; capture CUDA graphs after it."""
    require_model(model)
    import bitsandbytes

    if not bitsandbytes.__version__.startswith(SUMMED_AS):
        raise TunedDecodeError(f"Decoder(fused_gemv=True) sums as bitsandbytes {SUMMED_AS}x does, and bitsandbytes "
                               f"{bitsandbytes.__version__} is installed: install bitsandbytes=={SUMMED_AS}*, or leave "
                               f"fused_gemv out.")
    groups = gemv_groups(model)
    handoff: dict = {}
    forwards = {module: _joined_forward(module, group, handoff) for group in groups for module in group}
    for module, forward in forwards.items():
        module.forward = forward
    return JoinedGemv(forwards, handoff, groups)
