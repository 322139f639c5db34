"""4-bit and 8-bit quantization with bitsandbytes: the config, what it converts, what it costs."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch

from .errors import require_bool, require_choice, require_model, require_module_names
from .noise import INT8_CAST, silenced

QUANTS = ("bf16", "nf4", "fp4", "int8")
Quant = Literal["bf16", "nf4", "fp4", "int8"]


def quantization_config(quant: Quant, *, cpu_entries: bool = False, keep_bf16=(), compute_dtype=torch.bfloat16,
                        double_quant: bool = False):
    """The ``BitsAndBytesConfig`` for a quant choice (``None`` for bf16).

    ``cpu_entries``: the device map sends a module to the CPU, which bitsandbytes refuses
    unless ``llm_int8_enable_fp32_cpu_offload`` is set (it only keeps those modules
    unquantized; the PLE table is an embedding and is never quantized anyway).
    ``keep_bf16``: extra modules to leave unquantized. ``llm_int8_skip_modules`` replaces
    transformers' default list, so ``lm_head`` is added back here.
    ``compute_dtype``: what 4-bit layers compute in; ``torch.float16`` on a T4 (no native bf16).
    ``double_quant``: quantize the per-block scales too (about 0.4 bits per weight saved).
    """
    from transformers import BitsAndBytesConfig

    require_choice(quant, QUANTS, "quant")
    keep_bf16 = require_module_names(keep_bf16)
    require_bool(cpu_entries, "cpu_entries")
    require_bool(double_quant, "double_quant")
    if quant == "bf16":
        return None
    skip = list(dict.fromkeys(["lm_head", *keep_bf16])) if keep_bf16 else None
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=cpu_entries,
                                  llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
        llm_int8_enable_fp32_cpu_offload=cpu_entries,
        llm_int8_skip_modules=skip,
    )


def layer_kinds(model) -> Counter:
    """How many layers of each kind the model holds: what bitsandbytes converted and what it left."""
    require_model(model)
    kinds: Counter = Counter()
    for _, module in model.named_modules():
        if not any(True for _ in module.children()) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            kinds[type(module).__name__] += 1
    return kinds


def quant_of(model) -> str:
    """The ``QUANTS`` choice a loaded model was quantized with, read from its layers."""
    require_model(model)
    import bitsandbytes as bnb

    for _, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            return "int8"
        if isinstance(module, bnb.nn.Linear4bit):
            return module.weight.quant_type
    return "bf16"


def unquantized_linears(model) -> list:
    """Names of plain ``nn.Linear`` layers that stayed in bf16."""
    require_model(model)
    import bitsandbytes as bnb

    converted = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not isinstance(module, converted)]


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of one plain forward over ``input_ids`` (float32, on the CPU): keep them, free the model."""
    require_model(model)
    with torch.no_grad(), silenced(INT8_CAST):
        return model(input_ids=input_ids.to(model.device)).logits.float().cpu()


def logit_agreement(reference, candidate, input_ids: torch.Tensor) -> dict:
    """Next-token agreement of ``candidate`` with ``reference`` (a model, or logits from ``logits_of``,
    so two large models need not be on the GPU at once) at every position of ``input_ids``.

    On synthetic weights this checks the machinery (is the quantized model computing the same
    function, roughly), not the quality of the real model.
    """
    ref = reference if isinstance(reference, torch.Tensor) else logits_of(reference, input_ids)
    out = logits_of(candidate, input_ids)
    ref_logp, out_logp = ref.log_softmax(-1), out.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - out_logp)).sum(-1)
    return {
        "top1_agreement": (ref.argmax(-1) == out.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "positions": int(ref.shape[0] * ref.shape[1]),
    }
