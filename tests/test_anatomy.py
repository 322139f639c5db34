"""Reading the model: tree, sizes per device and dtype, tied weights, the PLE by suffix, the explorer."""

import pytest
from torch import nn

from helpers import anatomy, loading, synthetic, weights


@pytest.fixture(scope="module")
def tiny_nf4(tiny_path):
    return loading.load_model("tiny", quant="nf4", ple="cpu", device="cpu")


def test_the_e4b_budget_on_the_meta_device_matches_the_measured_reference():
    parts = weights.weight_bytes(weights.meta_model(synthetic.gemma4_config("e4b-shape")), "bf16", "gpu").by_course_part()
    reference = {"PLE table": 5.64e9, "embeddings (tied lm_head)": 1.34e9, "decoder layers": 7.89e9,
                 "vision tower": 0.34e9, "audio tower": 0.61e9}  # FINDINGS.md, E4B parameter budget (bf16)
    for part, expected in reference.items():
        assert parts[part] == pytest.approx(expected, rel=0.02), part


def test_tied_embedding_and_head_are_one_tensor_and_counted_once(tiny_nf4):
    groups = anatomy.tied_parameters(tiny_nf4)
    assert any({"lm_head.weight", "model.language_model.embed_tokens.weight"} <= set(g) for g in groups)
    embedding = tiny_nf4.get_submodule("model.language_model.embed_tokens").weight.numel()
    assert anatomy.parameter_count(tiny_nf4, count_tied_once=False) - anatomy.parameter_count(tiny_nf4) == embedding


def test_bytes_by_device_and_dtype_show_packed_4bit_weights_beside_bf16(tiny_nf4):
    totals = anatomy.bytes_by_device_and_dtype(tiny_nf4)
    assert ("cpu", "uint8") in totals and ("cpu", "bfloat16") in totals


def test_tree_stops_at_the_requested_depth_and_shows_sizes(tiny_nf4):
    shallow, deep = str(anatomy.tree(tiny_nf4, max_depth=1)), str(anatomy.tree(tiny_nf4, max_depth=3))
    assert "embed_tokens_per_layer" not in shallow and "embed_tokens_per_layer" in deep
    assert "kB" in deep and len(deep.splitlines()) > len(shallow.splitlines())


def test_modules_named_finds_the_ple_under_any_prefix(tiny_nf4):
    wrapper = nn.Module()
    wrapper.base_model = nn.Module()
    wrapper.base_model.model = tiny_nf4
    assert anatomy.modules_named(wrapper, "embed_tokens_per_layer") == [
        "base_model.model.model.language_model.embed_tokens_per_layer"]
    assert anatomy.modules_named(wrapper, "tokens_per_layer") == []  # whole name parts only


def test_the_explorer_walks_down_and_back_up(tiny_nf4):
    box = anatomy.explorer(tiny_nf4)
    path, children = box.children
    children.value = "model"
    assert path.value == "model"
    children.value = "model.language_model"
    assert path.value == "model.language_model"
    assert any("embed_tokens_per_layer" in label for label, _ in children.options)
    children.value = ".."
    assert path.value == "model"


def test_the_explorer_widget_does_not_keep_a_deleted_model_alive(tiny_path):
    import gc
    import weakref

    model = loading.load_model("tiny", quant="bf16", ple="cpu", device="cpu")
    box, gone = anatomy.explorer(model), weakref.ref(model)
    box.children[1].value = "model"  # a walk down reads the recorded tree, not the model
    del model
    gc.collect()
    assert gone() is None, "the widget (alive in ipywidgets' registry) holds the model: its memory is not given back"
    assert any("language_model" in label for label, _ in box.children[1].options)


def test_a_widget_that_holds_the_model_is_caught_by_the_weakref_check(tiny_path):
    """The control: a callback that closes over the model keeps it alive, and the check above says so."""
    import gc
    import weakref

    import ipywidgets as widgets

    model = loading.load_model("tiny", quant="bf16", ple="cpu", device="cpu")
    button, gone = widgets.Button(), weakref.ref(model)
    button.on_click(lambda _, held=model: held.eval())
    del model
    gc.collect()
    assert gone() is not None
    button.close()


def test_without_ipywidgets_the_explorer_names_the_fix_and_shows_the_text_tree(tiny_nf4, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_widgets(name, *args, **kwargs):
        if name == "ipywidgets":
            raise ImportError("No module named 'ipywidgets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_widgets)
    with pytest.warns(UserWarning, match="pip install ipywidgets"):
        shown = anatomy.explorer(tiny_nf4)
    assert isinstance(shown, anatomy.Tree) and "embed_tokens_per_layer" in str(shown)
