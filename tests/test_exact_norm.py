"""helpers.exact_norm on the CPU: ATen's CUDA mean order (torch 2.11), emulated and checked three ways: against a
thread-by-thread simulation written from Reduce.cuh, against float64 (within fp32 rounding), and against the Triton
kernel run by Triton's interpreter (its mean, bit for bit). Each check has a control that must fail: other summation
orders give other bits, and a one-ulp change of one input changes the result. The GPU half is
tools/exact_norm_probe.py (ATen on CUDA, the whole norm, timings)."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ptx_for, run_interpreted

from helpers import decoding, exact_norm, loading

# (rows, n) of one decode step of E4B, and ATen's launch for each: blockDim.x, blockDim.y, 4-float vectors per thread
DECODE = {(1, 2560): (512, 1, 2), (8, 256): (64, 8, 1), (8, 512): (64, 8, 2), (2, 256): (64, 2, 1),
          (2, 512): (128, 2, 1), (42, 256): (32, 16, 2)}


def varied_rows(samples: int, rows: int, n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Inputs [samples, rows, n] whose rows span eight orders of magnitude. The squares of bf16 values have at most
    16 significant bits, so short fp32 sums of them are often exact whatever the order; fp32 inputs (full 24-bit
    squares) tell orders apart far more often."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(samples, rows, 1, generator=gen) * 8 - 4)
    return (torch.randn(samples, rows, n, generator=gen) * scale).to(dtype)


def simulate_threads(row: np.ndarray, block_x: int, factor: float, warp_offsets_decrease: bool = True) -> np.float32:
    """One row's mean, written from Reduce.cuh thread by thread in numpy float32 scalars: each thread's four
    accumulators over its vectors t, t + block_x, ...; ((a0 + a1) + a2) + a3; shared-memory halving down to 32 lanes;
    then __shfl_down_sync at offsets 16..1 (torch >= 2.10 on CUDA) or 1..16 (before, and ROCm)."""
    f32 = np.float32
    n = row.shape[0]
    sums = []
    for t in range(block_x):
        acc = [f32(0)] * 4
        idx = t
        while idx * 4 + 3 < n:
            for i in range(4):
                acc[i] = f32(acc[i] + row[idx * 4 + i])
            idx += block_x
        sums.append(f32(f32(f32(acc[0] + acc[1]) + acc[2]) + acc[3]))
    offset = block_x // 2
    while offset >= 32:
        for i in range(offset):
            sums[i] = f32(sums[i] + sums[i + offset])
        offset //= 2
    lanes = sums[:32]
    offsets = [16, 8, 4, 2, 1] if warp_offsets_decrease else [1, 2, 4, 8, 16]
    for off in offsets:
        lanes = [f32(lanes[i] + (lanes[i + off] if i + off < 32 else lanes[i])) for i in range(32)]
    return f32(lanes[0] * f32(factor))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape", sorted(DECODE), ids=str)
def test_atens_launch_for_each_decode_shape(shape):
    order = exact_norm.mean_order(*shape)
    assert (order.block_x, order.block_y, order.chunks) == DECODE[shape]
    assert order.factor == float(np.float32(shape[0]) / np.float32(shape[0] * shape[1]))


def test_the_factor_of_a_2560_row_is_not_exact_and_is_multiplied():
    # 1/2560 is no fp32 value: ATen multiplies by its rounding, which is not always the division
    factor = exact_norm.mean_order(1, 2560).factor
    assert factor != 1 / 2560
    sums = torch.rand(100_000, dtype=torch.float32) * 1000
    assert not torch.equal(sums * torch.tensor(factor), sums / 2560)


@pytest.mark.parametrize("rows,n,reason", [(1, 64, "n >= 128"), (2, 2562, "n % 4"), (1, 65536, "across warps"),
                                           (0, 256, "rows=0"), (1, 256.0, "n=256.0")])
def test_a_configuration_not_derived_is_refused_in_one_course_sentence(rows, n, reason):
    from helpers.errors import InvalidChoiceError

    with pytest.raises(InvalidChoiceError, match=reason):
        exact_norm.mean_order(rows, n)


def test_the_emulation_refuses_what_is_not_fp32_squares():
    with pytest.raises(exact_norm.UnderivedShapeError, match="float32"):
        exact_norm.aten_mean_order(torch.ones(1, 256, dtype=torch.bfloat16))
    with pytest.raises(exact_norm.UnderivedShapeError, match="does not divide"):
        exact_norm.aten_mean_order(torch.ones(3, 256), rows=2)


def test_the_decode_step_runs_302_norms_all_in_derived_shapes():
    from helpers import synthetic

    shapes = exact_norm.decode_norm_shapes(synthetic.gemma4_config("e4b-shape"))
    assert shapes == {((1, 1, 2560), True): 211, ((1, 1, 8, 256), True): 35, ((1, 1, 8, 512), True): 7,
                      ((1, 1, 2, 256), True): 20, ((1, 1, 2, 256), False): 20, ((1, 1, 2, 512), True): 4,
                      ((1, 1, 2, 512), False): 4, ((1, 1, 42, 256), True): 1}
    assert {(math.prod(s[:-1]), s[-1]) for s, _ in shapes} == set(DECODE)


@pytest.mark.parametrize("shape", sorted(DECODE), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_emulation_is_the_thread_by_thread_simulation(shape, dtype):
    rows, n = shape
    order = exact_norm.mean_order(rows, n)
    squares = varied_rows(12 if rows < 40 else 2, rows, n, seed=n + rows, dtype=dtype).float().pow(2)
    emulated = exact_norm.aten_mean_order(squares, rows=rows).reshape(-1)
    flat = squares.reshape(-1, n).numpy()
    simulated = torch.tensor([simulate_threads(r, order.block_x, order.factor) for r in flat])
    assert torch.equal(bits(emulated), bits(simulated))


def test_the_older_warp_order_gives_other_bits():
    # the control: torch <= 2.9's warp order (offsets 1..16, still ROCm's) differs from the emulation on this data,
    # so the simulation above tells the two orders apart
    differs = {}
    for rows, n in DECODE:
        order = exact_norm.mean_order(rows, n)
        squares = varied_rows(1, rows, n, seed=5, dtype=torch.float32).pow(2).reshape(rows, n)
        emulated = exact_norm.aten_mean_order(squares).reshape(-1)[:16]  # all rows of the call, then 16 of them
        older = torch.tensor([simulate_threads(r, order.block_x, order.factor, warp_offsets_decrease=False)
                              for r in squares[:16].numpy()])
        differs[(rows, n)] = int((bits(older) != bits(emulated)).sum())
    assert sum(differs.values()) > 0, differs


@pytest.mark.parametrize("shape", sorted(DECODE), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_emulation_is_the_mean_within_fp32_rounding(shape, dtype):
    rows, n = shape
    order = exact_norm.mean_order(rows, n)
    squares = varied_rows(200, rows, n, seed=1, dtype=dtype).float().pow(2)
    emulated = exact_norm.aten_mean_order(squares, rows=rows).double()
    exact = squares.double().mean(-1, keepdim=True)
    depth = order.chunks + 3 + order.levels + 1  # additions along the deepest path, and the multiply
    assert ((emulated - exact).abs() / exact).max().item() <= depth * 2.0**-24


def test_other_summation_orders_give_other_bits():
    # the control: were the order not the point, these would agree with the emulation
    squares = varied_rows(200, 1, 2560, seed=2, dtype=torch.float32).pow(2)
    emulated = bits(exact_norm.aten_mean_order(squares, rows=1))
    factor = torch.tensor(exact_norm.mean_order(1, 2560).factor)
    sequential = torch.from_numpy(np.add.accumulate(squares.numpy(), axis=-1, dtype=np.float32)[..., -1:]) * factor
    cpu_sum = squares.sum(-1, keepdim=True) * factor
    divided = exact_norm._ordered_sum(squares, exact_norm.mean_order(1, 2560)) / 2560
    for other in (sequential, cpu_sum, divided):
        assert (bits(other) != emulated).any()


def test_one_ulp_of_one_square_changes_the_emulated_mean():
    # the control for bit equality: one input one ulp up, where the sum cannot absorb it
    squares = torch.full((1, 2560), 1e-8)
    squares[0, 1000] = 1.0
    nudged = squares.clone()
    nudged[0, 1000] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not torch.equal(bits(exact_norm.aten_mean_order(squares)), bits(exact_norm.aten_mean_order(nudged)))


# ------------------------------------------------------------------ the Triton kernel, interpreted


INTERPRETED = """
import json, sys
import torch
from helpers import decoding, exact_norm, loading
sys.path.insert(0, sys.argv[1])
from test_exact_norm import DECODE, bits, varied_rows

found = {}
for rows, n in sorted(DECODE):
    samples = 32 if rows < 8 else 8 if rows < 40 else 2
    for dtype in (torch.bfloat16, torch.float32):
        x = varied_rows(samples, rows, n, seed=n + rows, dtype=dtype)
        mean = torch.empty(samples * rows, dtype=torch.float32)
        out = exact_norm.fused_rms_norm(x, torch.ones(n), 1e-6, mean_out=mean, rows=rows)
        assert out.shape == x.shape and out.dtype == x.dtype
        emulated = exact_norm.aten_mean_order(x.float().pow(2), rows=rows).reshape(-1)
        found[f"{rows}x{n} {dtype}"] = [int((bits(mean) == bits(emulated)).sum()), samples * rows]
x = torch.full((1, 1, 2, 256), 1e-4).to(torch.bfloat16)
x[0, 0, 1, 7] = 1.0
reference = bits(exact_norm.aten_mean_order(x.float().pow(2)).reshape(-1))
x[0, 0, 1, 7] = 1.0078125  # the next bf16 after 1.0
mean = torch.empty(2, dtype=torch.float32)
exact_norm.fused_rms_norm(x, None, 1e-6, mean_out=mean)
found["nudged_rows_equal"] = (bits(mean) == reference).tolist()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The Triton kernel's means under TRITON_INTERPRET=1."""
    return run_interpreted(INTERPRETED, str(Path(__file__).parent),
                           missing="triton is not installed: the fused kernel's tree is checked where it is")


@pytest.mark.parametrize("shape", sorted(DECODE), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_triton_kernels_mean_is_the_emulation_bit_for_bit(interpreted, shape, dtype):
    same, checked = interpreted[f"{shape[0]}x{shape[1]} {dtype}"]
    assert same == checked >= 32


def test_one_ulp_of_one_input_changes_the_triton_kernels_mean(interpreted):
    # the control: the row with the nudged input differs from the emulation of the input before, the other does not
    assert interpreted["nudged_rows_equal"] == [True, False]


def test_the_kernel_compiles_for_an_h100_without_fma_and_with_the_rsqrt_cuda_uses():
    """Compiled for sm_90 here (no GPU needed): every add and multiply is a lone .rn instruction (no fma: the
    squares, the factor and eps stay separate roundings, as in ATen's separate kernels), one rsqrt.approx (what
    rsqrtf is), bf16 stores rounded to nearest even."""
    import re

    kernel = exact_norm._triton_kernel(False) if importlib.util.find_spec("triton") else None
    order = exact_norm.mean_order(1, 2560)
    constants = {"N": 2560, "BLOCK_X": order.block_x, "LEVELS": order.levels, "CHUNKS": order.chunks,
                 "HAS_WEIGHT": True, "WRITE_MEAN": False, "INTERPRET": False}
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "mean_ptr": "*fp32", "factor": "fp32",
                 "eps": "fp32"}
    ptx = ptx_for(kernel, signature, constants)
    assert not re.findall(r"\bfma\.", ptx) and re.findall(r"\badd\.rn\.f32", ptx) and re.findall(r"\bmul\.rn\.f32", ptx)
    assert len(re.findall(r"rsqrt\.approx", ptx)) == 1 and re.findall(r"cvt\.rn\.bf16\.f32", ptx)
    fused = ptx_for(kernel, signature, constants, fusion=True)
    assert re.findall(r"\bfma\.", fused)  # the control: with fusion allowed, x*x + acc becomes an fma


# ------------------------------------------------------------------ the swap


def test_fused_norms_keep_their_own_forward_off_cuda_and_are_restored():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    model = torch.nn.Sequential(Gemma4RMSNorm(256), Gemma4RMSNorm(256, with_scale=False))
    x = torch.randn(1, 1, 2, 256).to(torch.bfloat16)
    before = model(x)
    with exact_norm.fuse_norms(model) as fused:
        assert len(fused.modules) == 2 and all("forward" in vars(m) for m in model)
        assert not exact_norm.is_decode_input(x)  # a CPU tensor: the module's own forward runs
        assert torch.equal(model(x), before)
        assert exact_norm.fuse_norms(model).modules == []  # swapped once only
    assert all("forward" not in vars(m) for m in model) and torch.equal(model(x), before)


def test_norms_whose_accelerate_hooks_were_removed_are_fused_too():
    """accelerate's remove_hook_from_module leaves each module's own forward as an instance attribute: a swap that
    skipped every module with a ``forward`` of its own fused none of a loaded model's norms (the GPU profile's
    kernel count barely moved)."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    model = torch.nn.Sequential(Gemma4RMSNorm(256), Gemma4RMSNorm(256, with_scale=False), Gemma4RMSNorm(256))
    for norm in model[:2]:
        add_hook_to_module(norm, ModelHook())
        remove_hook_from_module(norm)
    assert all("forward" in vars(m) for m in model[:2]) and "forward" not in vars(model[2])  # what the hooks left
    wrapped = Gemma4RMSNorm(256)
    wrapped.forward = lambda hidden_states: hidden_states  # control: a wrapper of someone else's stays as it is
    with exact_norm.fuse_norms(torch.nn.Sequential(*model, wrapped)) as fused:
        assert fused.modules == [*model]
    assert all("forward" not in vars(m) for m in model) and wrapped.forward(1) == 1  # restored to the class's own


def test_a_tuned_decoder_fuses_every_norm_of_a_model_loaded_with_hooks():
    model = loading.load_model("tiny", "bf16", "cpu", device="cpu")
    decoding.attach_placement_hooks(model)  # what from_pretrained attaches on a GPU with the course's map
    norms = exact_norm.norm_modules(model)
    outside = decoding.supports_ple_outside(model)  # transformers 5.5.2 (the matrix) has no per_layer_inputs
    tuned = decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=outside, fused_norms=True))
    assert tuned.hooks_removed > 0 and len(norms) > 10
    assert tuned.fused_norms.modules == norms


# ------------------------------------------------------------------ the GPU probe's verdict


def probe_record(eager_vs_fused_differ: int, control_differ: int) -> dict:
    checks = {"eager_vs_fused": {"compared": 9, "differ": eager_vs_fused_differ},
              "control_one_ulp": {"compared": 9, "differ": control_differ}}
    mean = {"order": {}, "torch.bfloat16": {"aten_vs_emulation": {"compared": 9, "differ": 0},
                                            "aten_vs_divide_by_n": {"compared": 9, "differ": 3}}}
    return {"shapes": {"[1, 1, 2560] scale=True": {"mean": mean, "norm": {
        "torch.bfloat16": checks, "decode_input_takes_the_kernel": True}}},
        "step": {"graph_outputs_identical": True}}


def test_the_probe_calls_equal_bits_identical_and_sees_a_difference_or_a_blind_control():
    from conftest import tool

    verdict = tool("exact_norm_probe").verdict
    assert verdict(probe_record(0, 9)) == "bit-identical"
    assert verdict(probe_record(1, 9)) == "DIFFERS"  # the controls: one differing sample, a control that saw nothing
    assert verdict(probe_record(0, 0)).startswith("control failed")
    failed = probe_record(0, 9)
    failed["shapes"]["[1, 1, 2560] scale=True"]["norm"] = {"error": "Traceback ...\nRuntimeError: boom"}
    assert verdict(failed).startswith("incomplete")
