"""helpers.exact_nf4 on the CPU: the kernel against bitsandbytes' SIMT order (``gemv_eager``) in Triton's
interpreter, that order against a plain sum, the layers it takes and the launches it joins.
tests/gpu/test_exact_nf4_gpu.py checks the kernel against bitsandbytes' own on CUDA."""

import importlib.util
import re
import sys

import pytest
import torch
from conftest import ptx_for, run_interpreted, tool

from helpers import decoding, exact_nf4
from helpers.paths import DATA_DIR

bnb = pytest.importorskip("bitsandbytes")

# K of E4B's hidden size, its per-layer input, and one 1024-group and a half; the three layers of n, n + 1 and n + 2
# rows leave every remainder of the kernel's 4-row blocks (the interpreter's time grows with the rows)
SHAPES = [(5, 2560), (10, 256), (9, 3072)]
# inputs over three orders of magnitude, and bf16 inputs so small that many products fall below 2**-126 (fp16
# cannot hold them: zeros there)
SCALES = (0.1, 1.0, 10.0, 1e-36)


def nf4_linear(n: int, k: int, *, nested: bool = False, dtype=torch.bfloat16, seed: int = 0, bias: bool = False,
               quant_type: str = "nf4"):
    """A quantized ``Linear4bit`` on the CPU, never called (bitsandbytes repacks CPU weights on a first call)."""
    return tool("nf4_gemv_probe").linear(n, k, dtype, nested, torch.Generator().manual_seed(seed), device="cpu",
                                         bias=bias, quant_type=quant_type)


INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, "tests")
from test_exact_nf4 import SCALES, SHAPES, nf4_linear
from helpers import exact_nf4

def bits(t):
    return t.view(torch.int16)

found = {}
nested = sys.argv[1] == "nested"  # one half per process: plain or nested scales
for dtype in (torch.bfloat16, torch.float16):
    for n, k in SHAPES:
        layers = [nf4_linear(n + i, k, nested=nested, dtype=dtype, seed=i) for i in range(3)]
        same = checked = apart = 0
        for sample, scale in enumerate(SCALES):
            x = (torch.randn(1, 1, k, generator=torch.Generator().manual_seed(sample)) * scale).to(dtype)
            joined = exact_nf4.nf4_gemv(x, layers)
            alone = exact_nf4.nf4_gemv(x, layers[1:2])[0]
            expected = [exact_nf4.gemv_eager(x, layer) for layer in layers]
            for out, eager in [*zip(joined, expected), (alone, expected[1])]:
                same += int((bits(out) == bits(eager)).sum()); checked += out.numel()
            if scale == 1.0:  # the control, once: the largest input one ulp up
                nudged = x.clone()
                bits(nudged).view(-1)[int(x.abs().argmax())] += 1
                apart += int((bits(exact_nf4.nf4_gemv(nudged, layers[:1])[0]) != bits(expected[0])).sum())
        found[f"{nested} {dtype} {n}x{k}"] = [same, checked, apart]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's outputs under TRITON_INTERPRET=1, plain and nested scales in two processes at once (the
    interpreter runs on one core)."""
    from concurrent.futures import ThreadPoolExecutor

    missing = "triton is not installed: the NF4 kernel is checked where it is (and on the GPU)"
    with ThreadPoolExecutor(2) as pool:
        halves = pool.map(lambda half: run_interpreted(INTERPRETED, half, missing=missing), ["plain", "nested"])
        return {key: value for half in halves for key, value in half.items()}


@pytest.mark.parametrize("nested", [False, True], ids=["plain-scales", "nested-scales"])
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_sums_in_bitsandbytes_order_alone_and_joined_and_a_one_ulp_input_is_told_apart(interpreted, nested,
                                                                                                 dtype, n, k):
    same, checked, apart = interpreted[f"{nested} {dtype} {n}x{k}"]
    assert same == checked == len(SCALES) * (4 * n + 4)  # three layers joined (n, n + 1, n + 2 rows) and one alone
    assert apart > 0


@pytest.mark.parametrize("nested", [False, True], ids=["plain-scales", "nested-scales"])
def test_the_simt_order_is_the_dequantized_product_summed_in_another_order(nested):
    """``gemv_eager`` computes W x (close to bitsandbytes' dequantized weight times x), and its order is not a plain
    fp32 sum: some outputs differ in the last bits, which is what the kernel has to repeat."""
    layer = nf4_linear(256, 3072, nested=nested)
    x = torch.randn(1, 1, 3072, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ours = exact_nf4.gemv_eager(x, layer).float().flatten()
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    plain = (dense @ x.float().flatten()).to(torch.bfloat16).float()
    assert float((ours - plain).norm() / plain.norm()) < 0.02  # each product rounded to bf16: close, not equal
    assert 0 < int((ours != plain).sum()) < 256 and ours.unique().numel() > 200


# bitsandbytes on a GPU: python tools/nf4_gemv_probe.py --quick --out DIR writes it
FIXTURE = DATA_DIR / "bitsandbytes" / "nf4-gemv-fixture.json"


@pytest.mark.parametrize("key", ["bfloat16", "bfloat16-nested", "float16", "float16-nested"])
def test_the_simt_order_gives_the_bits_bitsandbytes_computed_on_a_gpu_and_a_plain_sum_does_not(key):
    """``gemv_eager`` on this CPU against bitsandbytes' CUDA outputs recorded for the same quantized bytes and input:
    every output's bits, where a plain fp32 sum of the dequantized products (the control) misses some. Its 64 rows
    tell each product's rounding apart, not the order of the lanes' final tree (that moves the fp32 sum by less than
    a bf16 or fp16 step in every row here): the interpreter and GPU tiers check that."""
    import json

    recorded = json.loads(FIXTURE.read_text())
    probe = tool("nf4_gemv_probe")
    assert {name: recorded[name] for name in probe.FIXTURE} == probe.FIXTURE  # the layer the GPU ran
    dtype = getattr(torch, key.split("-")[0])
    layer, x = probe.fixture_layer(dtype, key.endswith("-nested"), "cpu")
    expected = torch.tensor(recorded[key], dtype=torch.int16)
    assert expected.unique().numel() > expected.numel() // 2  # the recorded outputs vary
    ours = exact_nf4.gemv_eager(x, layer).view(torch.int16).flatten()
    assert torch.equal(ours, expected)
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    plain = (dense @ x.float().flatten()).to(dtype).view(torch.int16)
    assert int((plain != expected).sum()) > 0


def test_products_below_2_to_the_minus_126_are_flushed_as_bitsandbytes_fast_math_adds_flush_them():
    """Scaling the input by a power of two scales every product and sum exactly, so the output scales back to the
    same bits (the control) unless a value below 2**-126 was flushed to zero along the way."""
    layer = nf4_linear(64, 2560)
    x = torch.randn(1, 1, 2560, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    shift = 2.0 ** 64
    assert torch.equal(exact_nf4.gemv_eager(x / shift, layer).float() * shift, exact_nf4.gemv_eager(x, layer).float())
    tiny = (x.float() * 1e-35).to(torch.bfloat16)  # a tenth of the products under 2**-126, every output above it
    flushed = exact_nf4.gemv_eager(tiny, layer).float()
    kept = exact_nf4.gemv_eager((tiny.float() * shift).to(torch.bfloat16), layer).float() / shift
    assert flushed.abs().min() > torch.finfo(torch.float32).tiny  # normal outputs: the difference is the flush
    assert 0 < int((flushed != kept).sum()) < flushed.numel()


def test_layers_the_kernel_cannot_take_keep_their_own_forward():
    assert exact_nf4.takes_kernel(nf4_linear(8, 256))
    assert not exact_nf4.takes_kernel(nf4_linear(8, 256, bias=True))
    assert not exact_nf4.takes_kernel(nf4_linear(8, 256, quant_type="fp4"))  # another centroid table
    assert not exact_nf4.takes_kernel(torch.nn.Linear(256, 8))
    training = nf4_linear(8, 256).train()
    assert not exact_nf4.takes_kernel(training)
    assert exact_nf4.can_join([nf4_linear(8, 256), nf4_linear(4, 256)])
    assert not exact_nf4.can_join([nf4_linear(8, 256), nf4_linear(8, 512)])  # another K
    assert not exact_nf4.can_join([nf4_linear(8, 256), nf4_linear(8, 256, nested=True)])
    with pytest.raises(exact_nf4.InvalidChoiceError, match="one to three NF4"):
        exact_nf4.nf4_gemv(torch.ones(1, 1, 256, dtype=torch.bfloat16), [nf4_linear(8, 256, bias=True)])
    with pytest.raises(exact_nf4.InvalidChoiceError, match="one token of 256"):
        exact_nf4.nf4_gemv(torch.ones(1, 2, 256, dtype=torch.bfloat16), [nf4_linear(8, 256)])


def test_a_cpu_input_never_takes_the_kernel():
    layer = nf4_linear(8, 256)
    layer.compute_type_is_set = True
    x = torch.ones(1, 1, 256, dtype=torch.bfloat16)
    assert not exact_nf4.is_decode_input(x, [layer])
    assert not exact_nf4.is_decode_input(x.float(), [layer])


class Block(torch.nn.Module):
    """An attention block's projections and an MLP's, as Gemma 4 calls them; a KV-shared block has no k or v."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.q_proj = nf4_linear(16, 256, seed=1)
        self.k_proj = None if shared else nf4_linear(8, 256, seed=2)
        self.v_proj = None if shared else nf4_linear(8, 256, seed=3)
        self.o_proj = nf4_linear(256, 128, seed=4)


def test_siblings_reading_one_input_are_one_launch_and_a_shared_blocks_q_runs_alone():
    model = torch.nn.ModuleDict({"a": Block(), "b": Block(shared=True)})
    groups = exact_nf4.gemv_groups(model)
    assert [model.a.q_proj, model.a.k_proj, model.a.v_proj] in groups
    assert [model.b.q_proj] in groups and [model.a.o_proj] in groups and len(groups) == 4


def test_a_sibling_takes_the_joined_output_only_for_the_very_input_it_was_made_from(monkeypatch):
    """The first of a group runs the group and hands each sibling its part; a sibling called with another tensor
    (equal values or not) computes its own."""
    model = torch.nn.ModuleDict({"a": Block()})
    launches = []

    def gemv(x, modules):
        launches.append(len(modules))
        return [exact_nf4.gemv_eager(x, m) for m in modules]

    monkeypatch.setattr(exact_nf4, "is_decode_input", lambda x, modules: x.numel() == x.shape[-1])
    monkeypatch.setattr(exact_nf4, "_launch", gemv)
    x = torch.randn(1, 1, 256).to(torch.bfloat16)
    with exact_nf4.fuse_gemv(model) as joined:
        block = model.a
        q, k, v = block.q_proj(x), block.k_proj(x), block.v_proj(x.clone())
        assert launches == [3, 1]
        for out, layer in ((q, block.q_proj), (k, block.k_proj), (v, block.v_proj)):
            assert torch.equal(out, exact_nf4.gemv_eager(x, layer))
        assert not joined.handoff  # v's part was not taken, and is gone: nothing stale for the next step
    assert "forward" not in vars(block.q_proj)


def kernel_signature(dtype: str = "bf16") -> dict:
    """The kernel's runtime arguments by type, for compiling it without a GPU."""
    signature = {"x_ptr": "*i32", "out_ptr": f"*{dtype}", "lut_ptr": "*fp32", "lut_pairs_ptr": "*i32", "code_ptr": "*fp32"}
    for i in range(3):
        signature.update({f"words{i}": "*i32", f"scales{i}": "*fp32", f"nested{i}": "*u8", f"offset{i}": "*fp32"})
    return {**signature, "END0": "i32", "END1": "i32", "N_ALL": "i32"}


def kernel_constants(**chosen) -> dict:
    return {"K": 2560, "BLOCK_LOG2": 6, "NESTED": False, "IS_BF16": True, "ROWS": exact_nf4.ROWS,
            "LANES_FIRST": exact_nf4.LANES_FIRST, "PACKED": False, "INTERPRET": False, **chosen}


def compiled_kernel() -> object:
    return exact_nf4._kernel(False) if importlib.util.find_spec("triton") else None


def test_the_kernel_compiles_for_an_h100_with_no_fma_but_the_nested_scales_one():
    """Compiled for sm_90 here, fusion allowed: every product is rounded to bf16 before the add that follows it, so
    nothing contracts; nested scales keep bitsandbytes' one multiply-add."""
    kernel = compiled_kernel()
    for nested, packed in ((False, False), (True, False), (False, True)):
        ptx = ptx_for(kernel, kernel_signature(), kernel_constants(NESTED=nested, PACKED=packed), fusion=True)
        assert bool(re.findall(r"\bfma\.rn\.f32", ptx)) == nested, (nested, packed)
        # every fp32 add flushes denormals, as bitsandbytes' FADD.FTZ
        assert re.findall(r"\badd\.ftz\.f32", ptx) and not re.findall(r"\badd(\.rn)?\.f32", ptx)
        # packed: two bf16x2 products per byte, each one rounding (an fma with -0); otherwise cvt.rn to bf16
        assert bool(re.findall(r"\bfma\.rn\.bf16x2", ptx)) == packed and re.findall(r"cvt\.rn\.bf16", ptx)


def test_the_kernel_is_one_loop_over_k_not_an_unrolled_body_that_grows_with_the_layer():
    """K's groups unrolled made the down projection's kernel (K 10,240) ten copies of the body: slow to build on
    the first decode, and more code than the GPU's instruction cache holds. A loop keeps one body for any K."""
    kernel = compiled_kernel()
    sizes = {k: len(ptx_for(kernel, kernel_signature(), kernel_constants(K=k, PACKED=True))) for k in (2560, 10240)}
    assert sizes[10240] < 1.1 * sizes[2560], sizes
    body = ptx_for(kernel, kernel_signature(), kernel_constants(K=2560, PACKED=True))
    assert len(re.findall(r"\bfma\.rn\.bf16x2", body)) == 2 * 16  # one group's 16 bytes, two products each


def test_a_lanes_sixteen_weight_bytes_are_one_16_byte_load_as_bitsandbytes_reads_them():
    """Four 4-byte loads a lane, 16 bytes apart across the warp, use a quarter of each memory transaction; one
    vector load does not (Triton emits it where it can prove the pointers 16-byte aligned, as its launcher does on a
    GPU: unaligned, the control, it cannot)."""
    aligned = ptx_for(compiled_kernel(), kernel_signature(), kernel_constants(PACKED=True), aligned=True)
    assert re.findall(r"\bld\.global(\.\w+)*\.v4\.b32", aligned)  # the weights' (triton 3.6 also loads x so)
    unknown = ptx_for(compiled_kernel(), kernel_signature(), kernel_constants(PACKED=True))  # the control
    assert not re.findall(r"\bld\.global(\.\w+)*\.v4", unknown)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_bytes_packed_centroid_pair_puts_the_high_nibble_in_the_low_half_as_x_is_packed(dtype):
    """The packed path loads a byte's two centroids at once: the high nibble is the lower K index, so its centroid
    goes where x's lower element is (the low 16 bits). Swapped halves would multiply each weight by the wrong x."""
    state = nf4_linear(8, 256, dtype=dtype).weight.quant_state
    pairs = exact_nf4._lut_pairs(state, dtype)
    centroids = exact_nf4._lut(state, dtype).to(dtype).view(torch.int16).long() & 0xFFFF
    byte = torch.arange(256)
    assert torch.equal(pairs.long() & 0xFFFF, centroids[byte >> 4])
    assert torch.equal((pairs.long() >> 16) & 0xFFFF, centroids[byte & 0xF])
    assert not torch.equal(centroids[byte >> 4], centroids[byte & 0xF])  # the control: the halves differ


@pytest.mark.parametrize("arch,dtype", [(75, "fp16"), (75, "bf16"), (86, "bf16"), (89, "bf16"), (89, "fp16")],
                         ids=["T4-fp16", "sm75-bf16", "3060-bf16", "4060-bf16", "4060-fp16"])
def test_the_kernel_assembles_for_each_learner_card_packed_only_where_the_card_has_the_instruction(arch, dtype):
    """A T4 (sm_75) has f16x2 arithmetic but no bf16x2, which PTX gives from sm_80: each card gets the products it
    can run, and ptxas takes the kernel for that architecture."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    packed = exact_nf4.packs_on(torch_dtype, (arch // 10, arch % 10))
    assert packed == (dtype == "fp16" or arch >= 80)
    ptx = ptx_for(compiled_kernel(), kernel_signature(dtype), kernel_constants(IS_BF16=dtype == "bf16", PACKED=packed),
                  arch=arch)
    assert bool(re.findall(r"\bfma\.rn\.bf16x2", ptx)) == (packed and dtype == "bf16")
    assert bool(re.findall(r"\bmul\.rn\.f16x2", ptx)) == (packed and dtype == "fp16")
    assert re.findall(r"\badd\.ftz\.f32", ptx) and not re.findall(r"\badd(\.rn)?\.f32", ptx)


@pytest.fixture(scope="module")
def bnb_sass():
    """tools/bnb_sass.py and its survey of the installed wheel (requirements-dev.txt brings cuobjdump on Linux x86-64,
    where CI runs; elsewhere the wheel has no disassembler to pip install)."""
    import platform

    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        pytest.skip("NVIDIA's cuobjdump wheel is for Linux x86-64 only")
    module = tool("bnb_sass")
    return module, module.survey()


def test_every_gpu_architecture_in_the_bitsandbytes_wheel_rounds_and_sums_as_the_kernel_does(bnb_sass):
    """The GPU test compares bits on one card; a T4 (sm_75), 3060 (sm_86) or 4060 (sm_89) runs other machine code
    of the same source. In every one the wheel ships, bf16 and fp16: rounded products, one fma only for the
    nested scale, fp32 adds that flush denormals, the shfl_down tree. Its fp32 kernel, an fma per product, is
    the control that must be reported different."""
    _, rows = bnb_sass
    read = [(library, arch, dtype, found) for library, arch, dtype, found in rows if arch]
    assert {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"} <= {arch for _, arch, _, _ in read}
    assert [row for row in read if row[2] != "float32" and row[3]] == []
    controls = [found for _, _, dtype, found in read if dtype == "float32"]
    assert controls and all(any("fma" in problem for problem in found) for found in controls)
    unread = [row for row in rows if not row[1]]
    assert len(unread) <= len({row[0] for row in rows}) // 2, unread  # most builds are read, not skipped


def test_a_kernel_whose_nested_scale_is_two_roundings_or_whose_adds_keep_denormals_is_reported(bnb_sass):
    module, _ = bnb_sass
    library = next(library for library in module.libraries() if "cuda13" in library.name)
    sass = module.kernel_sass(library, module.cuobjdump())["sm_90"]["bfloat16"]
    assert module.differences(sass, "bfloat16") == []
    split = re.sub(r"FFMA\.FTZ (R\d+), (R\d+), (R\d+), (R\d+) ;", r"FMUL.FTZ \1, \2, \3 ;", sass)
    assert split != sass and "nested scale is not one fp32 fma" in " ".join(module.differences(split, "bfloat16"))
    kept = sass.replace("FADD.FTZ", "FADD", 1)
    assert "keeps denormals" in " ".join(module.differences(kept, "bfloat16"))
    fused = re.sub(r"HMUL2\.BF16_V2 (R\d+), (R\d+), (R\d+) ;", r"HFMA2.BF16_V2 \1, \2, \3, R4 ;", sass, count=1)
    assert fused != sass and "fused with an add" in " ".join(module.differences(fused, "bfloat16"))
    reordered = re.sub(r"(SHFL\.DOWN PT, R\d+, R\d+, )0x8,", r"\g<1>0x4,", sass, count=1)
    assert reordered != sass and "shfl_down at 16, 8, 4, 2, 1" in " ".join(module.differences(reordered, "bfloat16"))


def test_the_decoder_takes_the_joined_gemv_as_a_fusion():
    settings = decoding.Decoder(host_free=True, fused_gemv=True)
    assert "fused gemv" in settings.label()
    with pytest.raises(decoding.InvalidChoiceError, match="fused_gemv"):
        decoding.Decoder(compile="reduce-overhead", fused_gemv=True)


def test_another_bitsandbytes_release_is_refused_rather_than_summed_in_a_guessed_order(monkeypatch):
    model = torch.nn.ModuleDict({"a": Block()})
    monkeypatch.setattr(bnb, "__version__", "0.51.0")
    with pytest.raises(exact_nf4.TunedDecodeError, match="bitsandbytes==0.50"):
        exact_nf4.fuse_gemv(model)
    assert "forward" not in vars(model.a.q_proj)
    monkeypatch.setattr(bnb, "__version__", "0.50.2")
    exact_nf4.fuse_gemv(model).restore()


def test_the_recorded_tile_is_the_geometry_the_kernel_launches_with(monkeypatch):
    monkeypatch.setattr(exact_nf4, "STAGES", 5)
    monkeypatch.setattr(exact_nf4, "ROWS", 8)
    assert exact_nf4.tile() == {"rows": 8, "warps": exact_nf4.WARPS, "lanes_first": exact_nf4.LANES_FIRST,
                                "packed": exact_nf4.PACKED, "stages": 5}
