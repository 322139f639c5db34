"""Is greedy decoding on this GPU deterministic run to run, and where do two placements first differ?

    python tools/determinism_probe.py e4b-shape 256 --record   # also writes data/gpu-tier/determinism-<model>.json

Runs, in one process, under measure.reproducible_kernels() (cuBLAS's fixed workspace, attention off cuDNN):
the PLE-on-GPU model twice with cuDNN's attention allowed again (the library default), then three times as
the course compares, once without keeping logits; then the PLE-on-CPU model, before and after a long prefill.
Prints the first step whose logits differ and by how much.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers import loading, measure  # noqa: E402

SETTINGS = measure.reproducible_kernels()  # at import: before the first matmul


def first_difference(a, b) -> dict:
    steps = min(len(a), len(b))
    for step in range(steps):
        if not torch.equal(a[step], b[step]):
            return {"first_differing_step": step, "max_abs_diff_there": (a[step] - b[step]).abs().max().item()}
    return {"first_differing_step": None}


def main(model_name: str, tokens: int) -> dict:
    tokenizer = loading.load_tokenizer(model_name)
    out = {"settings": SETTINGS}
    model = loading.load_model(model_name, quant="nf4", ple="gpu", device=0)
    torch.backends.cuda.enable_cudnn_sdp(True)
    library = [measure.greedy(model, tokenizer, tokens, keep_logits=True) for _ in range(2)]
    out["cudnn_attention_run_to_run"] = first_difference(library[0]["logits"], library[1]["logits"])
    measure.reproducible_kernels()  # back to the course's settings
    runs = [measure.greedy(model, tokenizer, tokens, keep_logits=True) for _ in range(3)]
    out["gpu_run_to_run"] = [first_difference(runs[0]["logits"], r["logits"]) for r in runs[1:]]
    plain = measure.greedy(model, tokenizer, tokens)
    out["gpu_tokens_with_vs_without_logits"] = plain["tokens"] == runs[0]["tokens"]
    del model
    loading.release_gpu()
    model = loading.load_model(model_name, quant="nf4", ple="cpu", device=0)
    cpu = measure.greedy(model, tokenizer, tokens, keep_logits=True)
    out["cpu_vs_gpu_placement"] = first_difference(runs[0]["logits"], cpu["logits"])
    measure.prefill_peak(model, tokenizer, 8500, torch.device("cuda", 0))  # what the GPU tier does first
    after = [measure.greedy(model, tokenizer, tokens, keep_logits=True) for _ in range(2)]
    out["cpu_after_a_long_prefill_vs_before"] = first_difference(cpu["logits"], after[0]["logits"])
    out["cpu_after_a_long_prefill_run_to_run"] = first_difference(after[0]["logits"], after[1]["logits"])
    out["distinct_tokens"] = runs[0]["distinct_tokens"]
    return out


if __name__ == "__main__":
    found = main(sys.argv[1], int(sys.argv[2]))
    print(json.dumps(found))
    if "--record" in sys.argv:
        from helpers.paths import GPU_TIER_DIR
        from lab.records import environment, write_record

        found.update(environment(), model=sys.argv[1], new_tokens=int(sys.argv[2]),
                     command=f"python tools/determinism_probe.py {sys.argv[1]} {sys.argv[2]} --record")
        write_record(GPU_TIER_DIR / f"determinism-{sys.argv[1]}.json", found)
