"""Is helpers.exact_norm bit-identical to ATen on this GPU? Run where CUDA torch (2.11) and triton are:

    python tools/exact_norm_probe.py --out "$OUT"

For every decode-step norm shape of E4B (traced from the e4b-shape config), on ``--samples`` random inputs whose
rows span eight orders of magnitude (bf16, as the model has them, and fp32, whose squares tell orders apart more
often), each input a separate eager call of the real shape:

(a) ATen's ``x.float().pow(2).mean(-1, keepdim=True)`` on CUDA vs ``exact_norm.aten_mean_order`` on the CPU copy,
    and vs the fused kernel's own mean;
(b) the eager ``Gemma4RMSNorm`` (with and without scale, bf16 weight) vs ``exact_norm.fused_rms_norm``, and the same
    through ``fuse_norms`` on a few inputs;
(c) the control: the fused norm of each input with its largest element one ulp up, compared with the eager norm of
    the input before, must be reported as different.

Then the 302 norms of one decode step, each way, are captured in a CUDA graph and timed, and their kernels counted
with torch.profiler (eager, outside a graph). Every part is recorded even when another failed. Writes
``exact-norm-probe.json`` into ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install

import torch  # noqa: E402

from helpers import exact_norm  # noqa: E402

EPS = 1e-6
DEVICE = "cuda"  # a dry run of the code paths may set "cpu" (with TRITON_INTERPRET=1); the checks mean CUDA
# the E4B decode step, for when the trace itself fails (docs/exact-norm.md; a CPU test pins the trace to it)
KNOWN_SHAPES = {((1, 1, 2560), True): 211, ((1, 1, 8, 256), True): 35, ((1, 1, 8, 512), True): 7,
                ((1, 1, 2, 256), True): 20, ((1, 1, 2, 256), False): 20, ((1, 1, 2, 512), True): 4,
                ((1, 1, 2, 512), False): 4, ((1, 1, 42, 256), True): 1}


def failure() -> dict:
    return {"error": traceback.format_exc(limit=6)}


def environment() -> dict:
    found = {"torch": torch.__version__, "torch_git": torch.version.git_version, "cuda": torch.version.cuda,
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in ("triton", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - recorded, not fatal
            found[name] = f"missing: {error}"
    return found


def decode_shapes(record: dict) -> dict:
    try:
        from helpers import synthetic

        shapes = exact_norm.decode_norm_shapes(synthetic.gemma4_config("e4b-shape"))
        record["shapes_traced"] = [{"shape": list(s), "with_scale": w, "calls": c} for (s, w), c in shapes.items()]
        record["shapes_match_known"] = shapes == KNOWN_SHAPES
        return shapes
    except Exception:  # noqa: BLE001
        record["shapes_trace"] = failure()
        return dict(KNOWN_SHAPES)


def varied(samples: int, shape: tuple, dtype, seed: int) -> torch.Tensor:
    """[samples, *shape] on the GPU: rows scaled by 10**U(-4, 4); then sample 0 all zeros, sample 1 all ones and
    sample 2 of size 1e-25 (its squares underflow: the mean is 0 and eps alone is left)."""
    gen = torch.Generator().manual_seed(seed)
    rows_shape = (samples, *shape[:-1], 1)
    scale = 10.0 ** (torch.rand(rows_shape, generator=gen) * 8 - 4)
    x = torch.randn(samples, *shape, generator=gen) * scale
    if samples >= 3:
        x[0], x[1], x[2] = 0.0, 1.0, x[2].sign() * 1e-25
    return x.to(dtype).to(DEVICE).contiguous()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def compare(a: torch.Tensor, b: torch.Tensor, per_sample: bool = True) -> dict:
    """Bit equality of two [samples, ...] tensors: samples that differ, and the first one."""
    a, b = bits(a.cpu()), bits(b.cpu())
    differ = (a != b).reshape(a.shape[0], -1).any(-1) if per_sample else (a != b).reshape(-1)
    found = {"compared": int(differ.numel()), "differ": int(differ.sum())}
    if found["differ"]:
        i = int(differ.nonzero()[0, 0])
        found["first"] = {"index": i, "a": [hex(v) for v in a.reshape(a.shape[0], -1)[i][:4].tolist()],
                          "b": [hex(v) for v in b.reshape(b.shape[0], -1)[i][:4].tolist()]}
    return found


def check_mean(shape: tuple, samples: int, seed: int) -> dict:
    rows, n = shape_rows(shape), shape[-1]
    result = {"order": dataclasses.asdict(exact_norm.mean_order(rows, n))}
    for dtype in (torch.bfloat16, torch.float32):
        xs = varied(samples, shape, dtype, seed)
        aten = torch.stack([xs[i].float().pow(2).mean(-1, keepdim=True) for i in range(samples)])
        emulated = exact_norm.aten_mean_order(xs.float().pow(2).cpu(), rows=rows)
        kernel_mean = torch.empty(samples * rows, dtype=torch.float32, device=DEVICE)
        exact_norm.fused_rms_norm(xs, None, EPS, mean_out=kernel_mean, rows=rows)
        sync()
        result[str(dtype)] = {"aten_vs_emulation": compare(aten, emulated),
                              "aten_vs_fused_mean": compare(aten, kernel_mean.reshape(aten.shape)),
                              "aten_vs_divide_by_n": compare(aten, xs.float().pow(2).sum(-1, keepdim=True).cpu() / n)}
    return result


def shape_rows(shape: tuple) -> int:
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows


def norm_module(n: int, with_scale: bool, seed: int):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    module = Gemma4RMSNorm(n, eps=EPS, with_scale=with_scale)
    if with_scale:
        gen = torch.Generator().manual_seed(seed)
        module.weight.data = 1 + 0.3 * torch.randn(n, generator=gen)
    return module.to(DEVICE, torch.bfloat16)


def one_ulp_up(xs: torch.Tensor) -> torch.Tensor:
    """Each sample with its largest-magnitude element moved one ulp away from zero (zeros to the smallest value)."""
    nudged = xs.clone()
    flat = nudged.reshape(xs.shape[0], -1)
    where = flat.float().abs().argmax(-1)
    raw = bits(flat)
    raw[torch.arange(flat.shape[0], device=flat.device), where] += 1
    return nudged


def check_norm(shape: tuple, with_scale: bool, samples: int, seed: int) -> dict:
    rows, n = shape_rows(shape), shape[-1]
    module = norm_module(n, with_scale, seed)
    weight32 = module.weight.detach().float().contiguous() if with_scale else None
    result = {}
    for dtype in (torch.bfloat16, torch.float32):
        xs = varied(samples, shape, dtype, seed + 1)
        with torch.no_grad():
            eager = torch.stack([module(xs[i]) for i in range(samples)])
            fused = exact_norm.fused_rms_norm(xs, weight32, exact_norm._norm_eps(module), rows=rows)
            nudged = exact_norm.fused_rms_norm(one_ulp_up(xs), weight32, exact_norm._norm_eps(module), rows=rows)
            single = torch.stack([exact_norm.fused_rms_norm(xs[i], weight32, EPS) for i in range(min(samples, 50))])
            with exact_norm.fuse_norms(module):
                swapped = torch.stack([module(xs[i]) for i in range(min(samples, 50))])
        sync()
        result[str(dtype)] = {"eager_vs_fused": compare(eager, fused),
                              "eager_vs_fused_one_call_each": compare(eager[:len(single)], single),
                              "eager_vs_fuse_norms": compare(eager[:len(swapped)], swapped),
                              "control_one_ulp": compare(eager, nudged)}
    result["decode_input_takes_the_kernel"] = exact_norm.is_decode_input(varied(2, shape, torch.bfloat16, 0)[0])
    return result


def step_calls(shapes: dict, seed: int) -> list:
    """(module, weight32, x) for every norm of one decode step, modules shared per (n, with_scale)."""
    modules, calls = {}, []
    for (shape, with_scale), count in shapes.items():
        key = (shape[-1], with_scale)
        if key not in modules:
            module = norm_module(shape[-1], with_scale, seed)
            modules[key] = (module, module.weight.detach().float().contiguous() if with_scale else None)
        module, weight32 = modules[key]
        xs = varied(count, tuple(shape), torch.bfloat16, seed + count)
        calls.extend((module, weight32, xs[i]) for i in range(count))
    return calls


def timed_graph(step, replays: int) -> tuple:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        outputs = step()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, outputs


def kernels_in(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def time_step(shapes: dict, replays: int, seed: int) -> dict:
    calls = step_calls(shapes, seed)
    eps = EPS

    def eager():
        return [module(x) for module, _, x in calls]

    def fused():
        return [exact_norm.fused_rms_norm(x, weight32, eps) for _, weight32, x in calls]

    result = {"norms": len(calls), "replays": replays}
    for name, step in (("eager", eager), ("fused", fused)):
        try:
            result[f"{name}_kernels"] = kernels_in(step)
        except Exception:  # noqa: BLE001
            result[f"{name}_kernels"] = failure()
        try:
            ms, outputs = timed_graph(step, replays)
            result[f"{name}_graph_ms"] = round(ms, 4)
            result[f"{name}_us_per_norm"] = round(1000 * ms / len(calls), 3)
            result[f"_{name}_outputs"] = outputs
        except Exception:  # noqa: BLE001
            result[f"{name}_graph"] = failure()
    if "_eager_outputs" in result and "_fused_outputs" in result:
        pairs = zip(result["_eager_outputs"], result["_fused_outputs"])
        result["graph_outputs_identical"] = all(torch.equal(bits(a), bits(b)) for a, b in pairs)
    return {k: v for k, v in result.items() if not k.startswith("_")}


def summary(record: dict) -> list:
    lines = [f"torch {record['environment']['torch']}, triton {record['environment'].get('triton')}, "
             f"{record['environment']['device']}"]
    for key, part in record["shapes"].items():
        for what in ("mean", "norm"):
            body = part.get(what, {})
            if "error" in body:
                lines.append(f"{key} {what}: ERROR {body['error'].strip().splitlines()[-1]}")
                continue
            for dtype, checks in body.items():
                if not isinstance(checks, dict) or "compared" in checks or dtype == "order":
                    continue
                said = ", ".join(f"{name} {c['differ']}/{c['compared']} differ" for name, c in checks.items())
                lines.append(f"{key} {what} {dtype.replace('torch.', '')}: {said}")
    step = {k: (v["error"].strip().splitlines()[-1] if isinstance(v, dict) and "error" in v else v)
            for k, v in record.get("step", {}).items()}
    if "error" in step:
        lines.append(f"step: ERROR {str(step['error']).strip().splitlines()[-1]}")
    lines.append(f"step: {step.get('norms')} norms; kernels eager {step.get('eager_kernels')} fused "
                 f"{step.get('fused_kernels')}; graph ms eager {step.get('eager_graph_ms')} fused "
                 f"{step.get('fused_graph_ms')}; outputs identical {step.get('graph_outputs_identical')}")
    lines.append(f"verdict: {record['verdict']}")
    return lines


def verdict(record: dict) -> str:
    exact, control, errors = True, True, []
    for key, part in record["shapes"].items():
        for what in ("mean", "norm"):
            body = part.get(what, {})
            if "error" in body:
                errors.append(f"{key} {what}")
                continue
            if body.get("decode_input_takes_the_kernel") is False:
                errors.append(f"{key}: fuse_norms would keep the eager forward")
            for dtype, checks in body.items():
                if dtype == "order" or not isinstance(checks, dict):
                    continue
                for name, c in checks.items():
                    if name.startswith("aten_vs_divide") or not isinstance(c, dict):
                        continue
                    if name.startswith("control"):
                        control &= c["differ"] > 0
                    else:
                        exact &= c["differ"] == 0
    step = record.get("step", {})
    errors += [f"step {k}" for k, v in step.items() if k == "error" or (isinstance(v, dict) and "error" in v)]
    if errors:
        return f"incomplete: {'; '.join(errors)}"
    if not control:
        return "control failed: a one-ulp change went unseen"
    return "bit-identical" if exact and step.get("graph_outputs_identical") else "DIFFERS"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "build"), help="folder for exact-norm-probe.json")
    parser.add_argument("--samples", type=int, default=2000, help="random inputs per shape and dtype")
    parser.add_argument("--replays", type=int, default=200, help="timed replays of each CUDA graph")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("exact_norm_probe: no CUDA device; this probe compares ATen's CUDA kernels", file=sys.stderr)
        return 2
    started = time.time()
    record = {"environment": environment(), "samples": args.samples, "shapes": {}}
    shapes = decode_shapes(record)
    for (shape, with_scale), calls in shapes.items():
        key = f"{list(shape)} scale={with_scale}"
        part = record["shapes"][key] = {"calls": calls}
        if with_scale or ((shape, True) not in shapes):
            try:
                part["mean"] = check_mean(tuple(shape), args.samples, args.seed)
            except Exception:  # noqa: BLE001
                part["mean"] = failure()
        try:
            part["norm"] = check_norm(tuple(shape), with_scale, args.samples, args.seed)
        except Exception:  # noqa: BLE001
            part["norm"] = failure()
    try:
        record["step"] = time_step(shapes, args.replays, args.seed)
    except Exception:  # noqa: BLE001
        record["step"] = failure()
    record["verdict"] = verdict(record)
    record["seconds"] = round(time.time() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact-norm-probe.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print("\n".join(summary(record)))
    print(f"wrote {out / 'exact-norm-probe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
