"""Does the tuned decode's CUDA-graph step capture for each quantization, as the first model of a fresh process?

Each case runs in a process of its own (``--case``), so nothing a previous model set up lazily (a cuBLAS
workspace, a kernel's first launch) can help it:

    python tools/capture_probe.py e4b-shape --out build/capture-probe.json

A case loads the model with the PLE on the CPU, decodes ``--new-tokens`` greedy tokens with
``decoding.Decoder()`` and with plain ``generate`` and a static cache, and compares their logits bit for bit. The
case ``bf16-own-stream`` captures on a stream of its own, as the course did before (the control that must fail if
the warm-up stream is what makes the first capture work); ``bf16-after-nf4`` loads an NF4 model first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = ("bf16", "bf16-own-stream", "bf16-after-nf4", "nf4", "fp4", "int8")


def run_case(model_name: str, case: str, new_tokens: int, kernels: str = "reproducible") -> dict:
    import torch

    from helpers import decoding, loading, measure
    from helpers.errors import CourseError

    if kernels == "reproducible":
        measure.reproducible_kernels()
    quant = case.split("-")[0]
    if case == "bf16-own-stream":
        decoding.StepGraphs.capture_on_warmup_stream = False
    result = {"case": case, "model": model_name, "quant": quant, "kernels": kernels}
    try:
        decoding.Decoder().check_quant(quant)
    except CourseError as error:
        result.update(refused_before_loading=str(error))
    tokenizer = loading.load_tokenizer(model_name)
    ids = measure.prompt_ids(tokenizer, 32, 0)
    if case == "bf16-after-nf4":
        first = loading.load_model(model_name, quant="nf4", ple="cpu", device=0)
        decoding.TunedGreedy(first).greedy(ids, 4)
        del first
        torch.cuda.empty_cache()
    model = loading.load_model(model_name, quant=quant, ple="cpu", device=0)
    reference = decoding.plain_greedy(model, ids, new_tokens, static_cache=True, keep_logits=True)
    result["distinct_tokens"] = len(set(reference.tokens))
    try:
        tuned = decoding.TunedGreedy(model)
        run = tuned.greedy(ids, new_tokens, keep_logits=True)
    except CourseError as error:
        result.update(captured=False, error=f"{type(error).__name__}: {error}")
        return result
    result.update(captured=tuned.graphs.captured > 0, replayed=tuned.graphs.replayed,
                  identical=measure.compare_logits(reference.logits, run.logits)["identical"],
                  tokens_per_s=round(tuned.greedy(ids, new_tokens).tokens_per_s, 1))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a course model name, e.g. tiny or e4b-shape")
    parser.add_argument("--case", choices=CASES, help="run one case in this process and print its JSON")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kernels", choices=("reproducible", "default"), default="reproducible",
                        help="reproducible: measure.reproducible_kernels() first (a fixed cuBLAS workspace, attention off "
                             "cuDNN); default: PyTorch's own choices, as a learner's kernel has them")
    parser.add_argument("--out", type=Path, help="write every case's result here (JSON)")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.model, args.case, args.new_tokens, args.kernels)))
        return 0
    from helpers import synthetic
    from helpers.models import is_synthetic
    from lab.records import write_record

    if is_synthetic(args.model):
        synthetic.build(args.model)
    results = []
    for case in args.cases:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, args.model, "--case", case, "--new-tokens", str(args.new_tokens),
                               "--kernels", args.kernels],
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if done.returncode == 0 and lines else {
            "case": case, "crashed": done.returncode, "stderr_tail": done.stderr.strip().splitlines()[-3:]}
        result["seconds"] = round(time.perf_counter() - began, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        write_record(args.out, {"command": "python tools/capture_probe.py " + " ".join(argv or sys.argv[1:]),
                                "date": time.strftime("%Y-%m-%d"), "results": results})
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
