"""How many bytes the weights take on the GPU and the CPU, before anything is loaded.

Sizes come from a model built on the ``meta`` device (no memory for weights) and
accelerate's own ``compute_module_sizes``; quantized linear layers are then counted at
their packed size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import require_bool, require_choice, require_module_names
from .models import auto_class_for
from .placement import (
    HEADS,
    PLACEMENTS,
    PLE_SUFFIX,
    TOKEN_TABLE_SUFFIX,
    TOWER_SUFFIXES,
    TOWERS,
    Placement,
    part_of,
    require_model,
    unique_tensors,
)
from .quantization import QUANTS, Quant

# CUDA context, cuBLAS workspaces and the first activations need room beyond the weights.
GPU_HEADROOM_BYTES = 600 * 1024**2

# bytes per weight element, including bitsandbytes' per-block statistics
# (4-bit: one fp32 absmax per 64 weights; 8-bit: one fp32 scale per output row, ignored)
QUANT_BYTES_PER_WEIGHT = {"bf16": 2.0, "nf4": 0.5 + 4 / 64, "fp4": 0.5 + 4 / 64, "int8": 1.0}
# double quantization: 8-bit absmax per 64 weights, plus one fp32 scale per 256 of those blocks
DOUBLE_QUANT_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
COURSE_PARTS = {  # coarse parts for charts, by the last component of placement.part_of()
    "embed_tokens_per_layer": "PLE table",
    "embed_tokens": "embeddings (tied lm_head)",
    "lm_head": "output head (untied)",
    "layers": "decoder layers",
    "vision_tower": "vision tower",
    "audio_tower": "audio tower",
}
NOT_QUANTIZED_BY_DEFAULT = ("lm_head",)
# an untied output head: bitsandbytes' int8 keeps one fp32 scale per row (vocabulary x 4 bytes, counted per weight)
HEAD_BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "nf4": QUANT_BYTES_PER_WEIGHT["nf4"]}


@dataclass
class WeightEstimate:
    gpu_bytes: int
    cpu_bytes: int
    by_part: dict = field(default_factory=dict)  # part -> bytes on the GPU

    def __str__(self) -> str:
        return f"weights: {self.gpu_bytes / 1e9:.2f} GB on GPU, {self.cpu_bytes / 1e9:.2f} GB on CPU"

    def by_course_part(self) -> dict:
        """GPU bytes grouped into the parts the course talks about (PLE, decoder layers, towers, ...)."""
        grouped: dict = {}
        for part, size in self.by_part.items():
            grouped[course_part(part)] = grouped.get(course_part(part), 0) + size
        return grouped


def meta_model(config):
    """The model for ``config`` on the meta device: names and shapes, no memory."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class_for(config).from_config(config, dtype=torch.bfloat16)  # buffers such as inv_freq stay float32, as when loaded
    model.tie_weights()  # on meta, from_config leaves lm_head untied; the checkpoint shares it
    return model


def _is_quantized_linear_weight(module_name: str, module, tensor_name: str, skip: tuple) -> bool:
    if tensor_name != "weight" or not isinstance(module, torch.nn.Linear):
        return False
    return not any(module_name == s or module_name.endswith("." + s) or module_name.startswith(s) for s in skip)


def course_part(part: str) -> str:
    return COURSE_PARTS.get(part.split(".")[-1], "other")


def weight_bytes(model, quant: Quant = "nf4", ple: Placement = "cpu", keep_bf16=(), double_quant: bool = False,
                 towers: str = "gpu", head: str = "tied") -> WeightEstimate:
    """Predict the GPU and CPU bytes of the weights for a quantization, PLE placement, towers' placement and output
    head (``placement.TOWERS``, ``placement.HEADS``)."""
    from accelerate.utils import compute_module_sizes

    require_model(model)
    require_choice(quant, QUANTS, "quant")
    require_choice(ple, PLACEMENTS, "ple")
    keep_bf16 = require_module_names(keep_bf16)
    require_bool(double_quant, "double_quant")
    require_choice(towers, TOWERS, "towers")
    require_choice(head, HEADS, "head")
    per_element = QUANT_BYTES_PER_WEIGHT[quant]
    if double_quant and quant in ("nf4", "fp4"):
        per_element = DOUBLE_QUANT_BYTES_PER_WEIGHT
    skip = tuple(NOT_QUANTIZED_BY_DEFAULT) + tuple(keep_bf16)
    sizes = compute_module_sizes(model)
    gpu = cpu = 0
    by_part: dict = {}
    for module_name, module, tensor_name, tensor in unique_tensors(model):
        full = f"{module_name}.{tensor_name}" if module_name else tensor_name
        size = sizes[full]
        if quant != "bf16" and _is_quantized_linear_weight(module_name, module, tensor_name, skip):
            size = int(tensor.numel() * per_element)
        last = module_name.split(".")[-1]
        in_a_tower = any(f".{suffix}." in f".{module_name}." for suffix in TOWER_SUFFIXES)
        if (ple == "cpu" and last == PLE_SUFFIX) or (towers == "cpu" and in_a_tower):
            cpu += size
            continue
        if head != "tied" and last == TOKEN_TABLE_SUFFIX and tensor_name == "weight":
            cpu += size  # looked up on the CPU; the GPU holds the head of its own, counted below
            size = int(tensor.numel() * HEAD_BYTES_PER_WEIGHT[head])
            full = "lm_head"
        gpu += size
        part = part_of(full)
        by_part[part] = by_part.get(part, 0) + size
    return WeightEstimate(gpu_bytes=gpu, cpu_bytes=cpu, by_part=by_part)
