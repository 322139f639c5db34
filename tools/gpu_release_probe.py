"""Does ``del model; loading.release_gpu()`` hand a model's GPU memory back under a simulated card?
Notebook 02 on an 8 GB card found 5.5 GB still reserved after its bf16 reference was deleted. This loads
each route of notebook 02's comparison in turn, as the notebook does, and records what is left after
each release; where memory is still allocated it names what refers to the CUDA tensors left.

    CARD_GB=8 GEMMA_MODEL=e4b-shape python tools/gpu_release_probe.py --out release-probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
import torch  # noqa: E402

from helpers import cards, loading, measure, quantization  # noqa: E402


def holders(limit: int = 3, depth: int = 4) -> list:
    """The largest CUDA tensors still alive, each with the chain of object types that keeps it."""
    tensors = sorted((o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda),
                     key=lambda t: t.numel() * t.element_size(), reverse=True)[:limit]
    found = []
    for tensor in tensors:
        chain, current = [], tensor
        for _ in range(depth):
            referrers = [r for r in gc.get_referrers(current) if r is not tensors and not isinstance(r, type(sys._getframe()))]
            if not referrers:
                break
            current = referrers[0]
            chain.append(type(current).__qualname__ + (f" keys {sorted(current)[:6]}" if isinstance(current, dict) else ""))
        found.append({"bytes": tensor.numel() * tensor.element_size(), "shape": list(tensor.shape), "held_by": chain})
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="e2b-shape")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cap = cards.simulate()
    ids = measure.prompt_ids(loading.load_tokenizer(args.model), 64, "cpu")
    steps = []
    for quant in ("bf16", "int8", "nf4"):
        started = time.perf_counter()
        model = loading.load_model(args.model, quant=quant, ple="cpu", device=0)
        quantization.logits_of(model, ids)
        loaded = {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}
        del model
        left = loading.release_gpu()
        steps.append({"quant": quant, "loaded": loaded, "after_release": left, "seconds": round(time.perf_counter() - started, 1),
                      "still_held": holders() if left["allocated_bytes"] > 2**28 else []})
        print(json.dumps(steps[-1]), flush=True)
    args.out.write_text(json.dumps({"card_gb": cap, "model": args.model, "steps": steps}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
