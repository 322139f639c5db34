"""Bad input gets one clear sentence that names the fix, never a deep traceback."""

import json

import pytest
import torch

from helpers import loading, synthetic, weights
from helpers.errors import (
    BitsandbytesMissingError,
    CourseError,
    CudaUnavailableError,
    DeviceMapKeyError,
    InsufficientGPUMemoryError,
    InvalidChoiceError,
    LibraryClashError,
    ModelNotFoundError,
    NoPLETableError,
    NotAGemma4CheckpointError,
    OutdatedTransformersError,
)


def assert_clean(excinfo):
    err = excinfo.value
    assert isinstance(err, CourseError)
    assert err.__cause__ is None and err.__suppress_context__ or err.__context__ is None
    assert "\n" not in str(err)


def test_a_missing_folder_names_what_to_pass_instead(tmp_path):
    with pytest.raises(ModelNotFoundError, match="existing folder") as excinfo:
        loading.load_model(str(tmp_path / "nope"), device="cpu")
    assert_clean(excinfo)


def test_an_unknown_hub_id_offline_says_how_to_get_it():
    with pytest.raises(ModelNotFoundError, match="HF_ENDPOINT") as excinfo:
        loading.load_model("google/gemma-4-E9B-nonexistent", device="cpu")
    assert_clean(excinfo)


def test_a_folder_without_config_or_of_another_model_is_refused(tmp_path):
    with pytest.raises(NotAGemma4CheckpointError, match="config.json"):
        loading.load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotAGemma4CheckpointError, match="not Gemma 4"):
        loading.load_model(str(tmp_path), device="cpu")


def test_ple_cpu_on_a_model_without_a_ple_table_says_use_ple_gpu(tmp_path):
    raw = synthetic.config_dict("tiny")
    raw["text_config"]["hidden_size_per_layer_input"] = 0  # like the larger Gemma 4 models
    path = synthetic.build(raw, tmp_path / "no-ple", progress=False)
    with pytest.raises(NoPLETableError, match="ple='gpu'") as excinfo:
        loading.load_model(str(path), quant="bf16", ple="cpu", device="cpu")
    assert_clean(excinfo)
    assert loading.load_model(str(path), quant="bf16", ple="gpu", device="cpu") is not None


def test_a_device_map_key_that_matches_no_module_is_refused_before_loading(tiny_path):
    with pytest.raises(DeviceMapKeyError, match="nearest real names are 'lm_head'"):
        loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu", device_map={"lm_heads": "cpu", "model": "cpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_says_how_to_get_a_gpu():
    with pytest.raises(CudaUnavailableError, match="device='cpu'") as excinfo:
        loading.load_model("tiny", device=0)
    assert_clean(excinfo)


def test_missing_bitsandbytes_says_pip_install_or_bf16(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(BitsandbytesMissingError, match="pip install bitsandbytes"):
        loading.load_model("tiny", quant="nf4", device="cpu")
    loading.require_bitsandbytes("bf16")  # bf16 needs no bitsandbytes


def test_not_enough_gpu_memory_is_said_before_loading_with_the_fix(monkeypatch):
    estimate = weights.weight_bytes(weights.meta_model(synthetic.gemma4_config("e4b-shape")), "nf4", "gpu")
    monkeypatch.setattr(loading.cards, "budget_bytes", lambda device: int(7.5e9))  # an 8 GB card, in use
    with pytest.raises(InsufficientGPUMemoryError, match="ple='cpu'") as excinfo:
        loading.check_fits(estimate, torch.device("cuda", 0), "nf4", "gpu")
    assert "9.5" in str(excinfo.value) or "10.1" in str(excinfo.value)
    on_cpu = weights.weight_bytes(weights.meta_model(synthetic.gemma4_config("e4b-shape")), "nf4", "cpu")
    loading.check_fits(on_cpu, torch.device("cuda", 0), "nf4", "cpu")  # fits once the PLE is on the CPU


def test_the_fit_check_needs_the_weights_plus_600_mib_of_headroom_and_not_one_byte_more(monkeypatch):
    # the headroom covers the CUDA context, cuBLAS workspaces and the first activations
    estimate = weights.weight_bytes(weights.meta_model(synthetic.gemma4_config("e4b-shape")), "nf4", "cpu")
    exactly = estimate.gpu_bytes + 600 * 1024**2
    monkeypatch.setattr(loading.cards, "budget_bytes", lambda device: exactly)
    loading.check_fits(estimate, torch.device("cuda", 0), "nf4", "cpu")
    monkeypatch.setattr(loading.cards, "budget_bytes", lambda device: exactly - 1)
    with pytest.raises(InsufficientGPUMemoryError):
        loading.check_fits(estimate, torch.device("cuda", 0), "nf4", "cpu")


@pytest.mark.parametrize("freed_by_collecting", [True, False])
def test_a_load_short_only_of_what_a_deleted_model_awaiting_the_garbage_collector_holds_goes_ahead(monkeypatch,
                                                                                                   freed_by_collecting):
    # notebook 03 on a 4.5 GB card: probes deleted in a loop still held their memory until gc ran, and the next load,
    # which fits an empty card, was refused
    estimate = weights.weight_bytes(weights.meta_model(synthetic.gemma4_config("e4b-shape")), "nf4", "cpu")
    needed = estimate.gpu_bytes + 600 * 1024**2
    collected = []
    monkeypatch.setattr(loading, "release_gpu", lambda warn=True: collected.append(warn))
    monkeypatch.setattr(loading.cards, "budget_bytes",
                        lambda device: needed if collected and freed_by_collecting else needed - 1)
    if freed_by_collecting:
        loading.check_fits(estimate, torch.device("cuda", 0), "nf4", "cpu")
    else:  # the control: still short after collecting, refused in one sentence
        with pytest.raises(InsufficientGPUMemoryError, match="does not load"):
            loading.check_fits(estimate, torch.device("cuda", 0), "nf4", "cpu")
    assert collected == [False]


@pytest.mark.parametrize("kwargs", [{"quant": "q4_k_m"}, {"ple": "disk"}])
def test_an_unsupported_choice_lists_the_supported_ones(kwargs):
    with pytest.raises(InvalidChoiceError, match="choose one of"):
        loading.load_model("tiny", device="cpu", **kwargs)


def test_a_transformers_release_without_gemma4_is_refused_with_the_upgrade_command():
    with pytest.raises(OutdatedTransformersError, match="pip install -U"):
        loading.check_transformers("4.57.6")


def importing(monkeypatch, raised: Exception) -> None:
    """Make the import of transformers' hub-kernel table raise ``raised``, as a broken stack would."""
    def import_module(name, *args):
        raise raised

    monkeypatch.setattr(loading.importlib, "import_module", import_module)


def test_a_transformers_that_cannot_import_beside_a_newer_kernels_gets_one_sentence_not_a_library_traceback(monkeypatch):
    loading.require_importable_transformers()  # the installed stack imports
    # the message kernels' LayerRepository raises for transformers 5.5.2-5.12 beside kernels >= 0.15
    importing(monkeypatch, ValueError("Either a revision or a version must be specified."))
    with pytest.raises(LibraryClashError, match=r"cannot be imported beside kernels .*46291.*pip install -U transformers"):
        loading.require_importable_transformers()


def test_another_value_error_inside_transformers_import_is_not_taken_for_the_kernels_clash(monkeypatch):
    # the control: only the clash's own message is translated; anything else keeps its traceback
    importing(monkeypatch, ValueError("something else broke"))
    with pytest.raises(ValueError, match="something else"):
        loading.require_importable_transformers()
    importing(monkeypatch, ModuleNotFoundError("transformers.integrations.hub_kernels"))
    loading.require_importable_transformers()  # a release without hub kernels has nothing to clash with


def test_releases_with_the_use_cache_false_bug_warn_and_name_the_issue():
    with pytest.warns(UserWarning, match="45242"):
        loading.check_transformers("5.5.1")
    loading.check_transformers("5.5.2")
