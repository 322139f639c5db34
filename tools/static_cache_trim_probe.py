"""A probe, not yet part of the tuned path: the static cache's full-attention layers are preallocated for the whole
prompt, so every prefill chunk's attention runs over all of it, the positions not yet written only masked out.
Slicing keys, values and mask to the written positions (read from the mask's last row) should do less work for
the same result. This runs one E4B-shaped NF4 model (PLE on the CPU) uncapped through one long prompt three ways,
in one process: plain ``generate(prefill_chunk_size=...)``, the tuned path as it is, and the tuned path trimmed;
prints prefill seconds, peaks, and whether each run's logits equal the others' over the decoded steps, beside a
control (the trimmed run with one position too few kept) that must differ.

    python tools/static_cache_trim_probe.py e4b-shape 131072 8 > data/gpu-tier/static-cache-trim-e4b-shape.json
"""

import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import decoding, loading, long_context, measure  # noqa: E402

SETTINGS = measure.reproducible_kernels()  # at import: before the first matmul (cuDNN's attention off)


def trimmed(drop: int = 0):
    """The grouped SDPA function, with keys, values and mask cut to the written positions (``drop``: that many
    fewer, the control)."""
    grouped = long_context.grouped_sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.dtype == torch.bool and key.shape[2] > query.shape[2]:
            written = int(attention_mask[0, 0, -1].nonzero().max()) + 1 - drop
            key, value, attention_mask = key[:, :, :written], value[:, :, :written], attention_mask[..., :written]
        return grouped(module, query, key, value, attention_mask, **kwargs)
    return forward


@dataclass(frozen=True)
class Cut(long_context.LongContext):
    """The tuned path with attention cut to the written positions, registered under a name of its own."""

    drop: int = 0

    @property
    def attention(self) -> str:
        return long_context.register_grouped_sdpa(f"{long_context.GROUPED_SDPA}_cut{self.drop}", trimmed(self.drop))


def run(model, ids, new_tokens, settings):
    if ids.is_cuda:  # the previous run's cached blocks would count as this one's reserved
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    decoding.synchronize(ids.device)
    began = time.perf_counter()
    out = settings.generate(model, ids, new_tokens, keep_logits=True)
    decoding.synchronize(ids.device)
    seconds = time.perf_counter() - began
    logits = torch.stack([step[0] for step in out.logits]).float().cpu()
    peaks = ({"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
              "reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2)} if ids.is_cuda else {})
    return logits, {"seconds": round(seconds, 2), **peaks,
                    "distinct_tokens": len(set(out.sequences[0, ids.shape[1]:].tolist()))}


def main(model_name: str, positions: int, new_tokens: int) -> dict:
    tokenizer = loading.load_tokenizer(model_name)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # the CPU: a smoke test on tiny
    model = loading.load_model(model_name, quant="nf4" if device.type == "cuda" else "bf16", ple="cpu",
                               device=device.index if device.type == "cuda" else "cpu")
    ids = measure.prompt_ids(tokenizer, long_context.longest_prompt(positions, new_tokens), device)
    tuned, plain = long_context.LongContext(), long_context.LongContext.plain()
    results = {"command": f"python tools/static_cache_trim_probe.py {model_name} {positions} {new_tokens}",
               "model": model_name, "date": datetime.date.today().isoformat(),
               "prompt_tokens": ids.shape[1], "new_tokens": new_tokens, "kernels": SETTINGS,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    logits = {}
    for name, settings in (("plain", plain), ("tuned", tuned), ("tuned-trimmed", Cut()), ("tuned-trimmed-again", Cut()),
                           ("control-one-short", Cut(drop=1))):
        logits[name], results[name] = run(model, ids, new_tokens, settings)
        print(name, results[name], file=sys.stderr, flush=True)
    for a, b in (("tuned-trimmed", "plain"), ("tuned-trimmed", "tuned"), ("tuned", "plain"),
                 ("tuned-trimmed", "tuned-trimmed-again"), ("control-one-short", "tuned-trimmed")):
        results[f"{a} vs {b}"] = {"identical": torch.equal(logits[a], logits[b]),
                                  "max_abs_diff": (logits[a] - logits[b]).abs().max().item()}
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), indent=1))
