"""Is helpers.exact_nf4 bit-identical to bitsandbytes' one-token NF4 matmul on this GPU, and how fast? Run where
CUDA torch, triton and bitsandbytes are:

    python tools/nf4_gemv_probe.py --out "$OUT"

For each (N, K) an E4B decode step multiplies by (its projections, from the e4b-shape config), bf16 and fp16,
plain and nested scales: ``--samples`` random weights and inputs spanning four orders of magnitude, each through
the ``Linear4bit`` module (bitsandbytes' kernel) and through ``exact_nf4.nf4_gemv``, compared bit for bit; the
control, the input with one element one ulp up, must be told apart. Then each shape, and each group one launch
joins (q, k, v; gate, up), is captured 50 times in a CUDA graph and timed both ways, for each rows/warps choice.
Writes ``nf4-gemv-probe.json`` into ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install

import torch  # noqa: E402

from helpers import exact_nf4  # noqa: E402
from helpers.paths import write_text_atomically  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "data" / "configs" / "gemma-4-E4B-it.config.json"
# exact_nf4.TILE_KNOBS: (rows per program, warps, lanes first, packed, pipeline stages); on an H100 the 8-row tiles
# were slower everywhere
CHOICES = [(4, 4, False, True, 3), (4, 4, False, True, 2), (4, 4, False, True, 4), (2, 2, False, True, 3),
           (32, 4, True, True, 3)]
KNOBS = exact_nf4.TILE_KNOBS


def decode_shapes() -> dict:
    """name -> (N, K) of every NF4 projection an E4B decode step runs, and the groups one launch joins."""
    c = json.loads(CONFIG.read_text())["text_config"]
    h, i, per = c["hidden_size"], c["intermediate_size"], c["hidden_size_per_layer_input"]
    heads, kv, d, d_full = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["global_head_dim"]
    return {"q": (heads * d, h), "kv": (kv * d, h), "q-full": (heads * d_full, h), "kv-full": (kv * d_full, h),
            "o": (h, heads * d), "o-full": (h, heads * d_full), "gate-up": (i, h), "down": (h, i),
            "per-layer-gate": (per, h), "per-layer-projection": (h, per)}


def linear(n: int, k: int, dtype, nested: bool, generator, *, device: str = "cuda", bias: bool = False,
           quant_type: str = "nf4"):
    """A ``Linear4bit`` of random weights (each row its own spread), quantized on ``device``; on the CPU never call
    it (bitsandbytes repacks CPU weights on a first call). The tests build their layers here too."""
    import bitsandbytes as bnb

    module = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, quant_type=quant_type, compress_statistics=nested)
    weight = torch.randn(n, k, generator=generator) * (0.02 + torch.rand(n, 1, generator=generator) * 0.1)
    module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type, blocksize=64,
                                      compress_statistics=nested)
    return module.to(device).eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check(shapes: dict, samples: int) -> dict:
    found = {}
    for name, (n, k) in shapes.items():
        for dtype in (torch.bfloat16, torch.float16):
            for nested in (False, True):
                key = f"{name} {n}x{k} {str(dtype)[6:]}{' nested' if nested else ''}"
                try:
                    generator = torch.Generator().manual_seed(n * 7 + k)
                    differ = apart = distinct = 0
                    for sample in range(samples):
                        module = linear(n, k, dtype, nested, generator)
                        x = (torch.randn(1, 1, k, generator=generator) * 10.0 ** (sample % 4 - 2)).to("cuda", dtype)
                        with torch.no_grad():
                            theirs = module(x)
                        ours = exact_nf4.nf4_gemv(x, [module])[0]
                        differ += int((bits(ours) != bits(theirs)).sum())
                        distinct += int(torch.unique(theirs).numel())
                        nudged = x.clone()
                        top = int(x.abs().argmax())
                        bits(nudged).view(-1)[top] += 1
                        apart += int((bits(exact_nf4.nf4_gemv(nudged, [module])[0]) != bits(theirs)).sum())
                    found[key] = {"outputs": samples * n, "differ": differ, "told_apart": apart, "distinct": distinct}
                except Exception:
                    found[key] = {"error": traceback.format_exc(limit=6)}
    return found


def graph_time(run, repeats: int = 50) -> float:
    """Microseconds per call of ``run`` replayed from a CUDA graph of ``repeats`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    microseconds = start.elapsed_time(end) * 1000 / (20 * repeats)
    if microseconds < 0.5:  # no kernel runs that fast: the capture recorded nothing (PyTorch warns "empty")
        raise RuntimeError(f"the CUDA graph of {repeats} calls replayed in {microseconds:.3f} us a call: it is empty")
    return microseconds


def timings(shapes: dict, only: tuple | None = None, keep=lambda found: None) -> dict:
    defaults = tuple(getattr(exact_nf4, knob) for knob in KNOBS)
    generator = torch.Generator().manual_seed(0)
    groups = {"q k v": ["q", "kv", "kv"], "q k v full": ["q-full", "kv-full", "kv-full"], "gate up": ["gate-up", "gate-up"],
              **{name: [name] for name in shapes}}
    found = {}
    for label, names in groups.items():
        if only and label not in only:
            continue
        try:
            modules = [linear(*shapes[name], torch.bfloat16, False, generator) for name in names]
            x = torch.randn(1, 1, shapes[names[0]][1], generator=generator).to("cuda", torch.bfloat16)

            def theirs(modules=modules, x=x):
                with torch.no_grad():
                    for module in modules:
                        module(x)

            with torch.no_grad():
                expected = torch.cat([module(x).flatten() for module in modules])
            row = {"bitsandbytes_us": graph_time(theirs), "differ": {}}
            for chosen in CHOICES:
                for knob, value in zip(KNOBS, chosen):
                    setattr(exact_nf4, knob, value)
                rows, warps, lanes_first, packed, stages = chosen
                choice = (f"rows{rows}-warps{warps}{'-lanes' if lanes_first else ''}{'-packed' if packed else ''}"
                          f"-stages{stages}")
                try:
                    ours = torch.cat([out.flatten() for out in exact_nf4.nf4_gemv(x, modules)])
                    row["differ"][choice] = int((bits(ours) != bits(expected)).sum())
                    # the graph holds the decode step's hot path: nf4_gemv's checks read the centroids on the host,
                    # which a capture refuses
                    row[f"{choice}_us"] = graph_time(lambda modules=modules, x=x: exact_nf4._launch(x, modules))
                except Exception as error:  # a choice Triton cannot build or time: the others are still timed
                    row.setdefault("errors", {})[choice] = f"{type(error).__name__}: {str(error)[:200]}"
            row["bytes"] = sum(m.weight.numel() + m.weight.quant_state.absmax.numel() * 4 for m in modules)
            found[label] = row
            keep(found)  # each group's timings on disk as soon as they exist
        except Exception:
            found[label] = {"error": traceback.format_exc(limit=6)}
        finally:  # the next group, and the caller, start from the module's own choice
            for knob, value in zip(KNOBS, defaults):
                setattr(exact_nf4, knob, value)
    return found


FIXTURE = {"n": 64, "k": 3072, "seed": 31}  # one and a half 1024-groups: the idle lanes of the last group too


def fixture_layer(dtype, nested: bool, device: str):
    """The fixture's layer, quantized on the CPU (the same bytes on any machine), then moved to ``device``."""
    generator = torch.Generator().manual_seed(FIXTURE["seed"])
    module = linear(FIXTURE["n"], FIXTURE["k"], dtype, nested, generator, device="cpu")
    x = (torch.randn(1, 1, FIXTURE["k"], generator=generator) * 3).to(dtype)
    return module.to(device).eval(), x.to(device)


def fixture() -> dict:
    """bitsandbytes' CUDA outputs for the fixture's layer and input, as int16 bits, per dtype and nesting: test
    data for the CPU tests' check of ``exact_nf4.gemv_eager``."""
    found = {**FIXTURE, "gpu": torch.cuda.get_device_name()}
    for dtype in (torch.bfloat16, torch.float16):
        for nested in (False, True):
            module, x = fixture_layer(dtype, nested, "cuda")
            with torch.no_grad():
                found[f"{str(dtype)[6:]}{'-nested' if nested else ''}"] = bits(module(x)).flatten().tolist()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="time the joined groups and the down projection only, "
                        "no bit check (tests/gpu/test_exact_nf4_gpu.py has one)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = decode_shapes()
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import bitsandbytes
    import triton

    record.update(bitsandbytes=bitsandbytes.__version__, triton=triton.__version__)
    write_text_atomically(args.out / "nf4-gemv-fixture.json", json.dumps({**fixture(), "bitsandbytes": bitsandbytes.__version__}))
    record["bits"] = {} if args.quick else check(shapes, args.samples)
    write_text_atomically(args.out / "nf4-gemv-probe.json", json.dumps(record, indent=1))

    def keep(found):
        write_text_atomically(args.out / "nf4-gemv-probe.json", json.dumps({**record, "timings": found}, indent=1))

    quick = ("q k v", "gate up", "down", "o", "per-layer-gate", "per-layer-projection")
    record["timings"] = timings(shapes, quick if args.quick else None, keep)
    keep(record["timings"])
    for key, value in record["bits"].items():
        print(key, value)
    for key, value in record["timings"].items():
        print(key, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in value.items()})


if __name__ == "__main__":
    main()
