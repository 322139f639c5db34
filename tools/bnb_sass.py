"""Does the installed bitsandbytes compute its one-token NF4 matmul as helpers.exact_nf4 assumes, on every GPU
architecture its wheel ships? Reads the machine code (SASS) of ``gemm_4bit_simt<T, 1>`` from each
``libbitsandbytes_cuda*.so`` with NVIDIA's cuobjdump; no GPU needed:

    python tools/bnb_sass.py            # one line per library, architecture and dtype; exit 1 on a difference

What it checks in each bf16 and fp16 kernel (the source is csrc/gemm_4bit_simt.cu):

* each weight and each product is rounded to the 16-bit dtype on its own: packed ``HMUL2`` or ``HFMA2`` with a -0
  addend (a multiply), or on sm_75 bf16 an fp32 ``FMUL`` the library rounds by hand; no product is fused into an add;
* the nested scale ``code[q] * absmax2[b >> 8] + offset`` is one fp32 ``FFMA`` (nvcc contracts it), in the nested
  branch only, and no other fp32 fma exists;
* the sums are fp32 ``FADD``s, every one flushing denormals (``.FTZ``: the build's ``--use_fast_math``);
* the warp sums its lanes with ``SHFL.DOWN`` at 16, 8, 4, 2, 1.

The fp32 kernel of the same source multiplies and adds in one ``FFMA`` per product: the control, reported different.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# the kernel bitsandbytes launches for one token (M_BLOCK = 1), by compute dtype (Itanium-mangled names)
KERNELS = {"bfloat16": "_Z14gemm_4bit_simtI13__nv_bfloat16Li1EEvPKT_PKhPKfS5_S7_S7_PS1_S3_iiiii",
           "float16": "_Z14gemm_4bit_simtI6__halfLi1EEvPKT_PKhPKfS5_S7_S7_PS1_S3_iiiii",
           "float32": "_Z14gemm_4bit_simtIfLi1EEvPKT_PKhPKfS4_S6_S6_PS0_S2_iiiii"}
OLDEST_ARCH = 75  # Triton's oldest target, and the T4's
WARP_TREE = ["0x10", "0x8", "0x4", "0x2", "0x1"]
PRODUCTS_PER_GROUP = 32  # a lane's 16 bytes: 16 weight pairs and 16 product pairs
# one instruction: offset, optional predicate, opcode, operands
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?P<predicate>@!?U?P[T0-9]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)\s*(?P<args>[^;]*);")
INSTALL = "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (requirements-dev.txt has them)"


def cuobjdump() -> str:
    """The cuobjdump of the nvidia-cuda-cuobjdump wheel (its nvdisasm beside it), else one on PATH."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(found)
    found = shutil.which("cuobjdump")
    if found is None:
        raise SystemExit(f"cuobjdump is not installed: {INSTALL}.")
    return found


def libraries() -> list:
    """The CUDA builds the installed bitsandbytes ships, one per CUDA release."""
    import importlib.util

    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None:
        raise SystemExit("bitsandbytes is not installed: pip install -r requirements.txt.")
    return sorted(Path(spec.origin).parent.glob("libbitsandbytes_cuda*.so"))


def _disassemble(library: Path, tool: str, arch: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool, "-sass", *(["-arch", arch] if arch else []), "-fun", ",".join(KERNELS.values()),
                           str(library)], capture_output=True, text=True)


def kernel_sass(library: Path, tool: str) -> dict:
    """arch -> dtype -> the SASS text of that dtype's one-token kernel, for each architecture from sm_75 on that
    ``library`` holds code for; SystemExit if cuobjdump cannot read the library. All at once where the
    disassembler knows every architecture in it, else one architecture at a time (it has dropped sm_60 and sm_70)."""
    done = _disassemble(library, tool)
    if done.returncode:
        listed = subprocess.run([tool, "-lelf", str(library)], capture_output=True, text=True)
        archs = sorted(set(re.findall(r"\.(sm_\d+)\.cubin", listed.stdout)), key=lambda a: int(a[3:]))
        parts = [_disassemble(library, tool, arch) for arch in archs if int(arch[3:]) >= OLDEST_ARCH]
        failed = next((part for part in [listed, *parts] if part.returncode), None)
        if failed is not None or not parts:
            reason = failed.stderr.strip() if failed is not None else "no code for sm_75 or later"
            raise SystemExit(f"cuobjdump cannot read {library.name}: {reason}")
        done = subprocess.CompletedProcess(done.args, 0, "".join(part.stdout for part in parts), "")
    by_arch = {}
    for arch, code in zip(*[iter(re.split(r"\bcode for (sm_\d+)", done.stdout)[1:])] * 2):
        if int(arch[3:]) >= OLDEST_ARCH:
            pieces = re.split(r"Function : (\S+)", code)
            by_name = dict(zip(pieces[1::2], pieces[2::2]))
            by_arch[arch] = {dtype: by_name[name] for dtype, name in KERNELS.items() if name in by_name}
    return by_arch


def instructions(sass: str) -> list:
    """(predicated, opcode, operands) of each instruction."""
    return [(bool(m["predicate"]), m["op"], [a.strip() for a in m["args"].split(",")]) for m in INSTRUCTION.finditer(sass)]


def is_multiply(op: str, args: list) -> bool:
    """A packed 16-bit product: HMUL2, or HFMA2 of two registers with a -0 addend (not the HFMA2 -RZ, RZ
    idiom that loads a constant)."""
    if op.startswith("HMUL2"):
        return True
    return op.startswith("HFMA2") and len(args) == 4 and not args[1].startswith(("-RZ", "RZ")) \
        and args[3].split(".")[0] == "-RZ"


def differences(sass: str, dtype: str) -> list:
    """How a kernel's SASS departs from the order helpers.exact_nf4 reproduces; [] when it does not."""
    found = []
    code = instructions(sass)
    ops = Counter(op.split(".")[0] for _, op, _ in code)
    multiplies = sum(is_multiply(op, args) for _, op, args in code)
    fused = [" ".join([op, *args]) for _, op, args in code
             if op.startswith("HFMA2") and not is_multiply(op, args) and not args[1].startswith(("-RZ", "RZ"))]
    rounded_by_hand = dtype == "bfloat16" and multiplies == 0 and ops["FMUL"] >= 2 * PRODUCTS_PER_GROUP
    if multiplies < PRODUCTS_PER_GROUP and not rounded_by_hand:
        found.append(f"products are not rounded one by one to {dtype}: {multiplies} packed multiplies, "
                     f"{ops['FMUL']} fp32 multiplies")
    if fused:
        found.append(f"a 16-bit product is fused with an add: {fused[0]}")
    fmas = [(predicated, op) for predicated, op, _ in code if op.startswith("FFMA")]
    if not fmas:
        found.append("the nested scale is not one fp32 fma")
    elif len(fmas) > 4 or not all(predicated for predicated, _ in fmas):
        found.append(f"{len(fmas)} fp32 fmas: products are summed by fma, not rounded and added")
    adds = [op for _, op, _ in code if op.startswith("FADD")]
    if len(adds) < PRODUCTS_PER_GROUP + len(WARP_TREE):
        found.append(f"only {len(adds)} fp32 adds: the products are not added one by one")
    if any(".FTZ" not in op for op in adds):
        found.append("an fp32 add keeps denormals (the build is no longer --use_fast_math)")
    offsets = [args[-2] for _, op, args in code if op.startswith("SHFL.DOWN")]
    if not offsets or offsets != WARP_TREE * (len(offsets) // len(WARP_TREE)):  # the whole tree, once per copy
        found.append(f"the warp does not sum with shfl_down at 16, 8, 4, 2, 1: {offsets}")
    return found


def survey(tool: str | None = None) -> list:
    """(library, arch, dtype, differences) for every bf16, fp16 and fp32 one-token kernel the wheel ships; a
    library cuobjdump cannot read is one row with dtype None."""
    from concurrent.futures import ThreadPoolExecutor

    tool = tool or cuobjdump()

    def read(library):
        try:
            return kernel_sass(library, tool)
        except SystemExit as unreadable:
            return str(unreadable)

    found = libraries()
    with ThreadPoolExecutor(max_workers=4) as pool:  # each library is one or a few cuobjdump processes
        read_all = list(pool.map(read, found))
    rows = []
    for library, by_arch in zip(found, read_all):
        if isinstance(by_arch, str):
            rows.append((library.name, None, None, [by_arch]))
            continue
        for arch, sass in by_arch.items():
            for dtype in KERNELS:
                rows.append((library.name, arch, dtype, differences(sass[dtype], dtype) if dtype in sass
                             else [f"{KERNELS[dtype]} is not in it"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    from importlib.metadata import version

    rows = survey()
    print(f"bitsandbytes {version('bitsandbytes')}: gemm_4bit_simt<T, 1> against helpers.exact_nf4's order")
    for library, arch, dtype, found in rows:
        print(f"{library} {arch or '-'} {dtype or '-'}: {'; '.join(found) if found else 'the same order'}")
    departing = [row for row in rows if row[1] and row[2] != "float32" and row[3]]
    return 1 if departing else 0


if __name__ == "__main__":
    sys.exit(main())
