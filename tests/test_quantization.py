"""What bitsandbytes converts, the skip-list traps, and the cost measured as logit agreement."""

import pytest
import torch
from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

from helpers import loading, quantization, synthetic, weights


def load_raw(tiny_path, config):
    return AutoModelForImageTextToText.from_pretrained(tiny_path, dtype=torch.bfloat16, device_map={"": "cpu"},
                                                       quantization_config=config)


def test_nf4_converts_linears_and_leaves_embeddings_norms_and_the_ple_table(tiny_path):
    model = loading.load_model("tiny", quant="nf4", ple="gpu", device="cpu")
    kinds = quantization.layer_kinds(model)
    assert kinds["Linear4bit"] > 0
    assert kinds["Gemma4TextScaledWordEmbedding"] == 2  # embed_tokens and the PLE table stay bf16
    assert kinds["Gemma4RMSNorm"] > 0
    assert quantization.unquantized_linears(model) == ["lm_head"]  # the default skip list keeps the head


def test_a_bare_module_name_in_llm_int8_skip_modules_matches_nothing(tiny_path):
    bare = load_raw(tiny_path, BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["vision_tower", "lm_head"]))
    full = load_raw(tiny_path, BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["model.vision_tower", "lm_head"]))
    assert not any("vision_tower" in name for name in quantization.unquantized_linears(bare))
    assert any("vision_tower" in name for name in quantization.unquantized_linears(full))


def test_a_custom_skip_list_replaces_the_default_and_quantizes_lm_head(tiny_path):
    custom = load_raw(tiny_path, BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["model.vision_tower"]))
    assert "lm_head" not in quantization.unquantized_linears(custom)
    course = loading.load_model("tiny", quant="nf4", ple="gpu", device="cpu", keep_bf16=["model.vision_tower"])
    assert "lm_head" in quantization.unquantized_linears(course)


def test_a_model_agrees_with_itself_and_quantization_costs_some_agreement(tiny_path):
    ids = torch.randint(16, 272, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu")
    same = quantization.logit_agreement(reference, reference, ids)
    assert same["top1_agreement"] == 1.0 and abs(same["mean_kl"]) < 1e-6 and same["positions"] == 48
    nf4 = quantization.logit_agreement(reference, loading.load_model("tiny", quant="nf4", ple="gpu", device="cpu"), ids)
    assert 0 < nf4["mean_kl"] and nf4["top1_agreement"] < 1.0


def quant_state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values() if torch.is_tensor(t))


def test_double_quantization_saves_on_e4b_sized_layers_but_costs_on_tiny_ones():
    import bitsandbytes.functional as F

    def state_bytes(rows, cols, double):
        weight = torch.randn(rows, cols, dtype=torch.bfloat16)
        return quant_state_bytes(F.quantize_4bit(weight, blocksize=64, compress_statistics=double, quant_type="nf4")[1])

    assert state_bytes(10240, 2560, True) < 0.5 * state_bytes(10240, 2560, False)  # an E4B MLP projection
    assert state_bytes(64, 64, True) > state_bytes(64, 64, False)  # fixed per-layer tables dominate
    meta = weights.meta_model(synthetic.gemma4_config("e4b-shape"))
    assert weights.weight_bytes(meta, "nf4", "cpu", double_quant=True).gpu_bytes < weights.weight_bytes(meta, "nf4", "cpu").gpu_bytes


def test_e4b_weights_by_course_part_add_up_and_the_ple_is_the_largest_single_table():
    meta = weights.meta_model(synthetic.gemma4_config("e4b-shape"))
    estimate = weights.weight_bytes(meta, "bf16", "gpu")
    parts = estimate.by_course_part()
    assert sum(parts.values()) == estimate.gpu_bytes
    assert parts["PLE table"] == pytest.approx(5.64e9, rel=0.01)
    assert parts["decoder layers"] > parts["PLE table"] > parts["embeddings (tied lm_head)"]
