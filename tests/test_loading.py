"""The course loader on the tiny model, CPU only: every quantization, both PLE placements."""

import pytest
import torch
from conftest import tiny_prompt

from helpers import loading, placement
from helpers.errors import InsufficientGPUMemoryError

QUANTS = ["bf16", "nf4", "fp4", "int8"]


def greedy(model, tokenizer, new_tokens=24):
    inputs = tiny_prompt(tokenizer)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def loaded(tiny_path):
    cache = {}

    def get(quant, ple):
        if (quant, ple) not in cache:
            cache[(quant, ple)] = loading.load_model("tiny", quant=quant, ple=ple, device="cpu")
        return cache[(quant, ple)]

    return get


@pytest.mark.parametrize("quant", QUANTS)
def test_ple_on_cpu_gives_the_same_greedy_tokens_as_ple_on_gpu_placement(loaded, tiny_tokenizer, quant):
    assert greedy(loaded(quant, "cpu"), tiny_tokenizer) == greedy(loaded(quant, "gpu"), tiny_tokenizer)


@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_quantized_loads_replace_decoder_linears_with_bitsandbytes_layers(loaded, quant):
    import bitsandbytes as bnb

    model = loaded(quant, "cpu")
    wanted = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    q_proj = model.get_submodule("model.language_model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, wanted)
    assert not isinstance(model.get_submodule("lm_head"), wanted)  # tied to the embeddings
    ple = model.get_submodule("model.language_model.embed_tokens_per_layer")
    assert ple.weight.dtype == torch.bfloat16  # an embedding: never quantized


def test_ple_cpu_load_installs_the_cpu_lookup_and_leaves_no_offload_hook(loaded):
    model = loaded("nf4", "cpu")
    ple = model.get_submodule("model.language_model.embed_tokens_per_layer")
    assert placement.has_cpu_lookup(ple)
    assert not hasattr(ple, "_hf_hook")
    assert ple.weight.device.type == "cpu"


def test_keep_bf16_keeps_named_modules_unquantized_and_lm_head_too(tiny_path):
    import bitsandbytes as bnb

    model = loading.load_model("tiny", quant="nf4", ple="gpu", device="cpu",
                               keep_bf16=["model.vision_tower", "per_layer_model_projection"])
    assert not isinstance(model.get_submodule("model.language_model.per_layer_model_projection"), bnb.nn.Linear4bit)
    assert not isinstance(model.get_submodule("lm_head"), bnb.nn.Linear4bit)
    assert isinstance(model.get_submodule("model.language_model.layers.0.mlp.up_proj"), bnb.nn.Linear4bit)


def test_skip_list_replaces_the_default_so_quantization_config_adds_lm_head_back():
    config = loading.quantization_config("nf4", keep_bf16=["model.vision_tower"])
    assert config.llm_int8_skip_modules == ["lm_head", "model.vision_tower"]
    assert loading.quantization_config("nf4").llm_int8_skip_modules is None  # transformers' defaults apply


def test_cpu_entry_on_a_gpu_map_sets_the_offload_flag_bitsandbytes_demands():
    assert loading.quantization_config("nf4", cpu_entries=True).llm_int8_enable_fp32_cpu_offload
    assert loading.quantization_config("int8", cpu_entries=True).llm_int8_enable_fp32_cpu_offload
    assert loading.quantization_config("bf16", cpu_entries=True) is None


def test_a_custom_device_map_is_used_when_every_key_matches(tiny_path):
    model = loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu",
                               device_map={"model": "cpu", "lm_head": "cpu"})
    assert model.get_submodule("model.language_model.layers.0.mlp.up_proj").weight.device.type == "cpu"


def test_load_processor_gives_something_that_applies_the_chat_template(tiny_path):
    processor = loading.load_processor("tiny")
    out = tiny_prompt(processor)
    assert out["input_ids"].shape[0] == 1


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_ple_on_cpu_gives_bit_identical_logits_at_every_step_and_a_one_ulp_control_does_not(loaded, tiny_tokenizer, quant):
    from helpers import measure

    reference = measure.greedy(loaded(quant, "gpu"), tiny_tokenizer, 48, keep_logits=True)
    offloaded = loaded(quant, "cpu")
    same = measure.compare_logits(reference["logits"], measure.greedy(offloaded, tiny_tokenizer, 48, keep_logits=True)["logits"])
    assert same == {"identical": True, "max_abs_diff": 0.0, "steps": 48, "first_difference": None}
    last_prompt_token = int(measure.prompt_ids(tiny_tokenizer, 32, "cpu")[0, -1])
    with measure.ple_row_nudged(offloaded, last_prompt_token):
        nudged = measure.greedy(offloaded, tiny_tokenizer, 48, keep_logits=True)
    control = measure.compare_logits(reference["logits"], nudged["logits"])
    assert control["identical"] is False and control["max_abs_diff"] > 0
    again = measure.greedy(offloaded, tiny_tokenizer, 48, keep_logits=True)  # the nudge is undone on exit
    assert again["logits_sha256"] == reference["logits_sha256"]
    assert reference["distinct_tokens"] >= 10  # what is compared varies


def test_the_course_map_passes_its_own_validator_when_given_back_to_load_model(tiny_path):
    from helpers import models, weights

    course_map = placement.ple_device_map(weights.meta_model(models.load_config("tiny")), "cpu")
    model = loading.load_model("tiny", quant="bf16", ple="cpu", device="cpu", device_map=course_map)
    assert placement.has_cpu_lookup(model.get_submodule("model.language_model.embed_tokens_per_layer"))


def test_a_gpu_without_native_bf16_gets_fp16_4_bit_compute_and_the_cpu_keeps_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert loading.default_compute_dtype(torch.device("cuda", 0)) == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # an RTX 4060
    assert loading.default_compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert loading.default_compute_dtype(torch.device("cpu")) == torch.bfloat16


def test_release_gpu_says_when_a_model_is_still_referenced(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 6 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 5.5 * 10**9)  # a bf16 E2B still held
    with pytest.warns(loading.GPUStillInUseNotice, match="5.50 GB is still allocated"):
        loading.release_gpu()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 10**6)  # only scraps: nothing to say
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loading.release_gpu()["allocated_bytes"] == 10**6


def test_release_gpu_clears_cublas_workspaces_before_emptying_the_cache_else_a_deleted_models_segment_stays_reserved(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    loading.release_gpu()
    assert calls == ["workspaces", "empty_cache"]


def models_alive() -> int:
    import gc

    from transformers import PreTrainedModel

    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, PreTrainedModel))


def failing_quantizer(self, model, **kwargs):
    raise RuntimeError("the quantizer failed after the weights were loaded")


def failing_eval(self, *args, **kwargs):
    raise RuntimeError("the model's own code failed after it was built")


@pytest.mark.parametrize("where, target, replacement", [
    ("in the quantizer", "transformers.quantizers.quantizer_bnb_4bit.Bnb4BitHfQuantizer._process_model_after_weight_loading",
     failing_quantizer),
    ("in the model after loading", "transformers.PreTrainedModel.eval", failing_eval),
])
def test_a_load_that_fails_partway_holds_nothing_afterwards_and_without_the_give_back_the_model_stays(
        tiny_path, monkeypatch, where, target, replacement):
    """The traceback of a failed load (which a notebook keeps) refers to the half-built model; loading gives it
    back. The control, without the give-back, keeps a model alive. On a GPU the tier checks the memory itself."""
    monkeypatch.setattr(target, replacement)
    before = models_alive()
    with pytest.raises(RuntimeError, match="failed") as caught:
        loading.load_model("tiny", quant="nf4", ple="cpu", device="cpu")
    assert models_alive() == before, where
    monkeypatch.setattr(loading, "give_back_failed_load", lambda *args: None)
    try:
        loading.load_model("tiny", quant="nf4", ple="cpu", device="cpu")
    except RuntimeError as error:
        kept = error  # as sys.last_value keeps it in a notebook
    assert models_alive() > before, "the control should keep the half-built model alive"
    del kept, caught


class _LoaderLeftRunning:
    """from_pretrained as transformers 5 runs it: weight copies in a thread pool that an error shuts down without
    waiting (shutdown(wait=False, cancel_futures=True)), so a copy already started finishes after the error."""

    copy_done = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        import threading
        import time
        from concurrent.futures import ThreadPoolExecutor

        cls.copy_done = threading.Event()
        pool = ThreadPoolExecutor(max_workers=1)
        started = threading.Event()

        def copy():
            started.set()
            time.sleep(0.5)
            cls.copy_done.set()

        pool.submit(copy)
        started.wait()
        pool.shutdown(wait=False, cancel_futures=True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_failed_load_empties_the_cache_only_after_the_loader_threads_transformers_left_running_have_finished(
        tiny_path, monkeypatch):
    """Emptying the cache while a loader thread still copies leaves its blocks reserved (4.7 GB of a 6 GB card on
    the GPU tier). The control gives back without waiting: the copy is still in flight when the cache is emptied."""
    import threading

    monkeypatch.setattr(loading.models, "auto_class_for", lambda config: _LoaderLeftRunning)
    done_at_release = []
    monkeypatch.setattr(loading, "release_gpu", lambda **kwargs: done_at_release.append(_LoaderLeftRunning.copy_done.is_set()))
    with pytest.raises(InsufficientGPUMemoryError, match="Ran out of GPU memory"):
        loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu")
    assert done_at_release == [True]
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _LoaderLeftRunning.from_pretrained()
    loading.give_back_failed_load(caught.value, threads_before=set(threading.enumerate()))  # the control: no wait
    assert done_at_release == [True, False]
    _LoaderLeftRunning.copy_done.wait(5)


OFFLOADED_TO_META = "Some parameters are on the meta device because they were offloaded to the cpu."


@pytest.mark.parametrize("own_map", [False, True], ids=["course-map", "own-map-control"])
def test_the_course_map_does_not_tell_the_learner_its_ple_table_was_offloaded_to_meta(own_map, tiny_path,
                                                                                       monkeypatch, caplog):
    """accelerate's dispatch_model logs OFFLOADED_TO_META for any "cpu" entry of a map on a GPU. With the course's map
    load_model then takes the table back to the CPU and serves its rows (no meta, no hook), so the sentence is false
    and stays out; a learner's own map keeps it, true for their entries (the control)."""
    import logging

    real = loading.models.auto_class_for

    class LoggingLikeDispatch:  # a CPU machine never reaches dispatch_model's warning: say it where it would
        def __init__(self, cls):
            self.cls = cls

        def from_pretrained(self, *args, **kwargs):
            logging.getLogger("accelerate.big_modeling").warning(OFFLOADED_TO_META)
            return self.cls.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(loading.models, "auto_class_for", lambda config: LoggingLikeDispatch(real(config)))
    skeleton = loading.meta_model(loading.models.load_config(tiny_path))
    own = loading.course_device_map(skeleton, "cpu", "cpu") if own_map else None
    with caplog.at_level(logging.WARNING, logger="accelerate.big_modeling"):
        model = loading.load_model("tiny", quant="bf16", ple="cpu", device="cpu", device_map=own)
    assert model is not None
    assert (OFFLOADED_TO_META in caplog.text) == own_map
