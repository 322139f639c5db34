"""Device maps, the CPU lookup and placement reports, checked against transformers and accelerate."""

import pytest
import torch
from torch import nn

from helpers import placement, synthetic, weights
from helpers.errors import DeviceMapKeyError, NoPLETableError


@pytest.fixture(scope="module")
def e4b_meta():
    return weights.meta_model(synthetic.gemma4_config("e4b-shape"))


def test_ple_device_map_has_no_empty_key_and_sends_only_the_table_to_cpu(e4b_meta):
    device_map = placement.ple_device_map(e4b_meta, 0)
    assert "" not in device_map
    assert [k for k, v in device_map.items() if v == "cpu"] == ["model.language_model.embed_tokens_per_layer"]


def test_ple_device_map_covers_every_parameter_exactly_as_accelerate_checks(e4b_meta):
    from accelerate.utils import check_device_map

    check_device_map(e4b_meta, placement.ple_device_map(e4b_meta, 0))  # raises if anything is left out


def test_a_key_that_matches_no_module_is_refused_and_the_nearest_real_names_given(e4b_meta):
    with pytest.raises(DeviceMapKeyError, match="model.language_model.embed_tokens_per_layer"):
        placement.validate_device_map(e4b_meta, {"": 0, "model.language_model.embed_tokens_per_layers": "cpu"})


def test_the_maintainers_example_keys_name_no_gemma_4_module_and_are_refused(e4b_meta):
    # the seed issue's reply: {"model.layers.1": 0, ...}; Gemma 4 nests its decoder under language_model
    with pytest.raises(DeviceMapKeyError, match="model.language_model.layers"):
        placement.validate_device_map(e4b_meta, {"model.layers.1": 0, "model.layers.31": "cpu", "lm_head": 0})


def seed_style_map(model) -> dict:
    """The seed issue's advice done right for Gemma 4: every part by its full name, each decoder layer
    its own key, the PLE table on the CPU."""
    device_map = {key: 0 for key in placement.ple_device_map(model, 0) if key != "model.language_model.layers"}
    layers = model.get_submodule("model.language_model.layers")
    device_map.update({f"model.language_model.layers.{i}": 0 for i in range(len(layers))})
    device_map["model.language_model.embed_tokens_per_layer"] = "cpu"
    return device_map


def auto_map(model) -> dict:
    return placement.auto_device_map(model, {0: "7GiB", "cpu": "48GiB"})


@pytest.mark.parametrize("build", [lambda m: placement.ple_device_map(m, 0), seed_style_map, auto_map],
                         ids=["the course's map", "the seed issue's per-module map", "accelerate's infer_auto_device_map"])
def test_real_per_module_maps_are_accepted(e4b_meta, build):
    placement.validate_device_map(e4b_meta, build(e4b_meta))


@pytest.mark.parametrize("build", [lambda m: placement.ple_device_map(m, 0), seed_style_map, auto_map,
                                   lambda m: {"": 0, "model.language_model.layers.1": "cpu"}],
                         ids=["course", "seed", "auto", "layers.1 alone"])
def test_the_key_matching_rule_is_exactly_transformers_own_on_this_version(e4b_meta, build):
    # a drift test: if transformers changes how keys match parameter names, this fails
    from transformers.integrations.accelerate import expand_device_map

    device_map = build(e4b_meta)
    names = list(e4b_meta.state_dict().keys())
    ours = {name: device_map[key] if key is not None else device_map.get("", "cpu")
            for name, key in placement.key_for_each_name(device_map, names).items()}
    assert ours == expand_device_map(device_map, names)


def test_layers_1_also_catches_layers_10_to_19_when_they_have_no_key_of_their_own(e4b_meta):
    names = list(e4b_meta.state_dict().keys())
    caught = {name.split(".")[3] for name, key in placement.key_for_each_name(
        {"": 0, "model.language_model.layers.1": "cpu"}, names).items() if key}
    assert caught == {"1", *(str(i) for i in range(10, 20))}
    with pytest.raises(DeviceMapKeyError, match="layers.10"):
        placement.validate_device_map(e4b_meta, {"": 0, "model.language_model.layers.1": "cpu"})


def test_a_prefix_key_that_also_catches_the_ple_table_is_refused(e4b_meta):
    names = [n for n, _ in e4b_meta.named_modules()]
    caught = placement.modules_matched_by("model.language_model.embed_tokens", names)
    assert "model.language_model.embed_tokens_per_layer" in caught  # transformers matches by string prefix
    with pytest.raises(DeviceMapKeyError, match="also catches"):
        placement.validate_device_map(e4b_meta, {"": 0, "model.language_model.embed_tokens": "cpu"})


def test_a_map_that_leaves_tensors_without_a_device_is_refused_before_loading(e4b_meta):
    from accelerate.utils import check_device_map

    partial = {k: v for k, v in placement.ple_device_map(e4b_meta, 0).items() if k != "lm_head"}
    del partial["model.language_model.norm"]
    with pytest.raises(ValueError):
        check_device_map(e4b_meta, partial)  # what accelerate says, after the load
    with pytest.raises(DeviceMapKeyError, match="no device"):
        placement.validate_device_map(e4b_meta, partial)


def test_cpu_lookup_is_bit_identical_to_the_embedding_it_replaces():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    torch.manual_seed(0)
    table = Gemma4TextScaledWordEmbedding(300, 96, padding_idx=0, embed_scale=96 ** 0.5).to(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 17))
    expected = table(ids)
    placement.install_cpu_lookup(table, "cpu")
    assert torch.equal(table(ids), expected)


def test_installing_the_lookup_takes_accelerates_offload_hook_off_and_restores_the_weight():
    from accelerate.hooks import attach_align_device_hook

    torch.manual_seed(0)
    table = nn.Embedding(50, 8)
    expected = table.weight.detach().clone()
    attach_align_device_hook(table, execution_device="cpu", offload=True, weights_map=table.state_dict())
    assert table.weight.device.type == "meta"  # what a "cpu" device-map entry leaves behind
    assert "offload hook" in str(placement.report(table))
    placement.install_cpu_lookup(table, "cpu")
    assert not hasattr(table, "_hf_hook")
    assert torch.equal(table.weight, expected)


def test_offload_ple_finds_the_table_under_a_peft_style_prefix(tiny_path):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.bfloat16).eval()
    wrapper = nn.Module()
    wrapper.base_model = nn.Module()
    wrapper.base_model.model = model
    ids = torch.randint(16, 272, (1, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        placement.offload_ple(wrapper, "cpu")
        after = model(input_ids=ids).logits
    assert placement.ple_module_names(wrapper) == ["base_model.model.model.language_model.embed_tokens_per_layer"]
    assert placement.has_cpu_lookup(model.get_submodule("model.language_model.embed_tokens_per_layer"))
    assert torch.equal(before, after)
    assert placement.part_of("base_model.model.model.language_model.layers.0.mlp") == "model.language_model.layers"


def test_a_model_without_a_ple_table_gets_a_clear_error_not_an_attribute_error():
    with pytest.raises(NoPLETableError, match="ple='gpu'"):
        placement.offload_ple(nn.Sequential(nn.Linear(4, 4)))


def test_report_works_without_hf_device_map_and_counts_tied_weights_once(tiny_path):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.bfloat16)
    assert not hasattr(model, "hf_device_map")  # the article's AttributeError
    report = placement.report(model)
    unique = {p.data_ptr(): p for p in model.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in unique.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert report.bytes_by_device() == {"cpu": param_bytes + buffer_bytes}
    assert "hf_device_map is absent" in str(report)
    as_dict = report.as_dict()
    assert as_dict["hf_device_map"] is None and "model.language_model.embed_tokens_per_layer" in as_dict["parts"]


def test_report_marks_the_table_as_looked_up_on_cpu_after_offload(tiny_path):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.bfloat16)
    placement.offload_ple(model, "cpu")
    where = placement.report(model).parts["model.language_model.embed_tokens_per_layer"]
    assert any(place.startswith("cpu (lookup on cpu") for place in where)
