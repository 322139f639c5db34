"""How many ATen operators one decode step of a Gemma 4 shape runs, at each level of the tuned decoder's fusions.

Traced on the meta device (no weights, no GPU): each fused kernel stands in as one operator, views are not
counted, and attention is eager (sdpa's mask check reads meta tensors), so a GPU runs about ``layers`` fewer
kernels than attention's share here, and the static cache adds its writes. The GPU profile (``make bench
PRESET=decode-fused``) counts the real kernels; this says where they come from and what the next fusion would save.

    python tools/decode_census.py e4b-shape            # one line per level
    python tools/decode_census.py e4b-shape --top 12   # and the commonest operators of the last level
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: helpers without an install
from helpers import exact_layer, exact_norm, exact_rotary, models  # noqa: E402

VIEWS = {"view", "_unsafe_view", "t", "expand", "transpose", "unsqueeze", "select", "slice", "as_strided", "permute",
         "squeeze", "alias", "detach", "reshape", "empty", "empty_like"}
LEVELS = ("eager", "norms", "rotary", "layers", "activations")  # each adds one Decoder fusion to the one before


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _one_op(x, *args, **kwargs):
    return torch.ops.aten.clone(x)


def _joined(x, weight32, eps, residual, *, scale=None, next_weight32=None, next_eps=None):
    out = torch.ops.aten.clone(residual)
    return (out, torch.empty_like(out)) if next_weight32 is not None else out


@contextlib.contextmanager
def _fused(model, level: str):
    """The model with the fusions up to ``level`` in place, each fused kernel one operator."""
    from transformers.models.gemma4 import modeling_gemma4

    depth = LEVELS.index(level)
    with contextlib.ExitStack() as stack:
        if depth >= 1:
            norms = exact_norm.norm_modules(model)
            for norm in norms:
                norm.forward = _one_op
            stack.callback(lambda: [vars(norm).pop("forward", None) for norm in norms])
        if depth >= 2:
            original = vars(modeling_gemma4)[exact_rotary.FUNCTION]
            setattr(modeling_gemma4, exact_rotary.FUNCTION, lambda x, cos, sin, unsqueeze_dim=1: _one_op(x))
            stack.callback(setattr, modeling_gemma4, exact_rotary.FUNCTION, original)
        if depth >= 3:
            for module, name, stand_in in ((exact_layer, "is_decode_input", lambda h: h.numel() == h.shape[-1]),
                                           (exact_norm, "fused_residual_norm", _joined),
                                           (exact_layer, "fused_gelu_mul", lambda gate, other: _one_op(gate))):
                stack.callback(setattr, module, name, getattr(module, name))
                setattr(module, name, stand_in)
            stack.enter_context(exact_layer.fuse_layers(model, activations=depth >= 4))
        yield


def census(shape: str) -> dict:
    """{level: Counter of operators} for one decode step (batch 1, one token) of ``shape``."""
    from transformers.models.gemma4 import modeling_gemma4

    text = copy.deepcopy(models.load_config(shape).get_text_config())
    text._attn_implementation = "eager"
    with torch.device("meta"):
        model = modeling_gemma4.Gemma4ForCausalLM(text).to(torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    found = {}
    for level in LEVELS:
        with _fused(model, level), torch.no_grad(), Census() as seen:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        found[level] = seen.counts
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="e4b-shape")
    parser.add_argument("--top", type=int, default=0, help="list the commonest operators of the last level")
    parser.add_argument("--json", action="store_true", help="print {level: operators} as JSON")
    args = parser.parse_args(argv)
    found = census(args.shape)
    if args.json:
        print(json.dumps({level: sum(counts.values()) for level, counts in found.items()}))
        return 0
    for level, counts in found.items():
        print(f"{level:12} {sum(counts.values()):6,} operators a step")
    for name, count in found[LEVELS[-1]].most_common(args.top):
        print(f"  {count:6,} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
