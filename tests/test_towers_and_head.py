"""E4B on a 4 GB card: the towers wait on the CPU and the token table is looked up there, with an output head of its
own on the GPU. The bf16 head is exact (its control, one ulp off, is not); a quantized head is smaller and not exact."""

import pytest
import torch
import transformers
from packaging.version import Version

from helpers import decoding, loading, measure, placement, synthetic, weights
from helpers.errors import InvalidChoiceError, TunedDecodeError
from helpers.weights import GPU_HEADROOM_BYTES, HEAD_BYTES_PER_WEIGHT


@pytest.fixture(scope="module")
def e4b_meta():
    return weights.meta_model(synthetic.gemma4_config("e4b-shape"))


@pytest.fixture(scope="module")
def prompt():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 300, (1, 48), generator=generator)
    assert len(set(ids[0].tolist())) > 30  # varied tokens, not one row looked up again and again
    return ids


@pytest.fixture(scope="module")
def tied_logits(tiny_path, prompt):
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu")
    with torch.no_grad():
        return model(prompt).logits


def devices_by_tensor(model, device_map) -> dict:
    owners = placement.key_for_each_name(device_map, list(model.state_dict()))
    return {name: device_map[key] for name, key in owners.items()}


def test_towers_and_the_token_table_leave_the_gpu_and_nothing_else_does(e4b_meta):
    device_map = loading.course_device_map(e4b_meta, 0, "cpu", "cpu", "nf4")
    assert "" not in device_map  # a "" key would load everything onto the GPU first
    placement.validate_device_map(e4b_meta, device_map)
    on_cpu = {name for name, device in devices_by_tensor(e4b_meta, device_map).items() if device == "cpu"}
    expected_prefixes = [*placement.tower_module_names(e4b_meta), *placement.token_table_names(e4b_meta),
                         *placement.ple_module_names(e4b_meta), "lm_head"]
    assert on_cpu and all(any(name.startswith(p + ".") for p in expected_prefixes) for name in on_cpu)
    layers = [name for name in devices_by_tensor(e4b_meta, device_map) if ".language_model.layers." in name]
    assert layers and not set(layers) & on_cpu


def test_the_plain_course_map_is_unchanged_by_the_new_switches(e4b_meta):
    assert loading.course_device_map(e4b_meta, 0, "cpu") == placement.ple_device_map(e4b_meta, 0)
    assert loading.course_device_map(e4b_meta, 0, "gpu") == {"": 0}


def test_an_untied_bf16_head_gives_the_tied_models_logits_bit_for_bit(tiny_path, prompt, tied_logits):
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu", towers="cpu", head="bf16")
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    assert placement.has_cpu_lookup(model.model.language_model.embed_tokens)
    with torch.no_grad():
        logits = model(prompt).logits
        assert torch.equal(logits, tied_logits)
        assert len(set(logits.argmax(-1)[0].tolist())) > 5  # the compared logits vary
        # the control: the head one ulp off in one row the prompt's argmax reads must be reported as different
        row = int(logits[0, -1].argmax())
        model.lm_head.weight.view(torch.int16)[row] += 1  # one bf16 ulp on every weight of that row
        assert not torch.equal(model(prompt).logits, tied_logits)


def test_the_models_first_parameter_is_not_one_served_from_host_memory_so_generate_keeps_its_inputs_on_the_gpu(tiny_path):
    # transformers' model.device is the first parameter's device, and generate moves its inputs there
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu", towers="cpu", head="bf16")
    served = [name for name, module in model.named_modules() if placement.runs_on_cpu(module)]
    assert {"model.vision_tower", "model.language_model.embed_tokens"} <= set(served)
    first = next(name for name, _ in model.named_parameters())
    assert not any(first.startswith(name + ".") for name in served), first
    # the control: loaded as it comes, the first parameter is one the switches serve from host memory (the vision
    # tower from transformers 5.17 on, the token table on 5.5.2, which registers the language model first)
    plain = loading.load_model(tiny_path, "nf4", "cpu", device="cpu")
    plain_first = next(name for name, _ in plain.named_parameters())
    assert any(plain_first.startswith(name + ".") for name in served), plain_first


@pytest.mark.parametrize("head", ["int8", "nf4"])
def test_a_quantized_head_is_smaller_and_its_logits_are_not_identical(tiny_path, prompt, tied_logits, head):
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu", towers="cpu", head=head)
    with torch.no_grad():
        logits = model(prompt).logits
    assert logits.shape == tied_logits.shape
    assert not torch.equal(logits, tied_logits)
    assert torch.corrcoef(torch.stack([logits.flatten().float(), tied_logits.flatten().float()]))[0, 1] > 0.9


def test_the_estimate_moves_the_towers_and_the_table_and_counts_the_head_it_keeps(e4b_meta):
    tied = weights.weight_bytes(e4b_meta, "nf4", "cpu")
    towers = weights.weight_bytes(e4b_meta, "nf4", "cpu", towers="cpu")
    tower_bytes = sum(size for part, size in tied.by_course_part().items() if part in ("vision tower", "audio tower"))
    assert tower_bytes > 0 and tied.gpu_bytes - towers.gpu_bytes > tower_bytes  # the projections leave too
    table = e4b_meta.get_submodule(placement.token_table_names(e4b_meta)[0]).weight
    for head, per_weight in HEAD_BYTES_PER_WEIGHT.items():
        untied = weights.weight_bytes(e4b_meta, "nf4", "cpu", towers="cpu", head=head)
        assert towers.gpu_bytes - untied.gpu_bytes == pytest.approx(table.numel() * (2 - per_weight), abs=4)
        assert untied.cpu_bytes == towers.cpu_bytes + table.numel() * 2


def test_e4b_text_only_with_an_nf4_head_is_predicted_to_fit_a_4_gb_card_and_the_tied_model_is_not(e4b_meta):
    fits = weights.weight_bytes(e4b_meta, "nf4", "cpu", towers="cpu", head="nf4").gpu_bytes + GPU_HEADROOM_BYTES
    tied = weights.weight_bytes(e4b_meta, "nf4", "cpu").gpu_bytes + GPU_HEADROOM_BYTES
    assert fits < 4e9 < tied


@pytest.mark.parametrize("arguments", [dict(towers="no"), dict(head="fp8"), dict(head=True),
                                       dict(towers="cpu", device_map={"": "cpu"})])
def test_a_wrong_towers_or_head_is_refused_in_one_sentence_before_loading(tiny_path, arguments):
    with pytest.raises(InvalidChoiceError):
        loading.load_model(tiny_path, "nf4", "cpu", device="cpu", **arguments)


needs_ple_outside = pytest.mark.skipif(Version(transformers.__version__) < Version("5.17.0"),
                                       reason="this transformers takes no per_layer_inputs (tests/test_decoding.py)")


@needs_ple_outside
@pytest.mark.parametrize("compile_mode", [None, "cudagraphs"], ids=["loop", "graph-buffers"])
def test_the_tuned_decode_runs_with_the_towers_and_table_on_the_cpu_and_gives_generates_logits(tiny_path, compile_mode):
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu", towers="cpu", head="bf16")
    ids = measure.prompt_ids(loading.load_tokenizer(tiny_path), 32, "cpu")
    with measure.math_attention():
        expected = decoding.plain_greedy(model, ids, 16, static_cache=True, keep_logits=True)
        run = decoding.TunedGreedy(model, decoding.Decoder(compile=compile_mode)).greedy(ids, 16, keep_logits=True)
    assert len(set(expected.tokens)) > 8
    assert run.tokens == expected.tokens
    assert measure.compare_logits(expected.logits, run.logits)["identical"]


def test_a_captured_decode_refuses_an_int8_head_before_it_runs(tiny_path):
    model = loading.load_model(tiny_path, "nf4", "cpu", device="cpu", head="int8")
    with pytest.raises(TunedDecodeError, match="head='nf4'"):
        decoding.TunedGreedy(model, decoding.Decoder(compile="cudagraphs"))
    decoding.TunedGreedy(model, decoding.Decoder(compile=None, ple_outside=False))  # the eager loop can run it


@pytest.fixture(scope="module")
def table():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(3 * 96 + 17, 128, generator=generator).to(torch.bfloat16)  # slices that do not divide it


@pytest.mark.parametrize("head", ["int8", "nf4"])
def test_the_head_quantized_a_slice_of_rows_at_a_time_holds_the_whole_tables_bits(table, head, monkeypatch):
    # a 4 GB card cannot hold the bf16 table beside the model, so the head is quantized in slices of rows
    import bitsandbytes as bnb

    monkeypatch.setattr(placement, "HEAD_ROWS_PER_STEP", 96)
    sliced = placement.output_head(table, head, torch.device("cpu"))
    if head == "int8":
        whole, scales, _ = bnb.functional.int8_vectorwise_quant(table.to(torch.float16))
        assert torch.equal(sliced.weight.CB, whole) and torch.equal(sliced.weight.SCB, scales)
        control = sliced.weight.CB.clone()
        control[100, 0] += 1  # one step of one weight in the second slice must show
        assert not torch.equal(control, whole)
        return
    whole, state = bnb.functional.quantize_4bit(table, blocksize=64, quant_type="nf4")
    assert torch.equal(sliced.weight.data, whole) and torch.equal(sliced.weight.quant_state.absmax, state.absmax)
    assert torch.equal(bnb.functional.dequantize_4bit(sliced.weight.data, sliced.weight.quant_state),
                       bnb.functional.dequantize_4bit(whole, state))
    control = sliced.weight.quant_state.absmax.clone()
    control[2 * 96 * 128 // 64] *= 2  # the first block of the third slice
    assert not torch.equal(control, state.absmax)


def test_the_quantized_heads_hold_the_bytes_the_planner_counts(table):
    for head in ("int8", "nf4"):
        layer = placement.output_head(table, head, torch.device("cpu"))
        held = sum(t.numel() * t.element_size() for t in (layer.weight.data, *(
            [layer.weight.SCB] if head == "int8" else [layer.weight.quant_state.absmax])))
        assert held == pytest.approx(table.numel() * HEAD_BYTES_PER_WEIGHT[head], rel=0.05), head


def test_pinning_a_table_without_the_free_ram_to_copy_it_is_refused_in_one_sentence(monkeypatch):
    # a kernel that ran out of host RAM while pinning would die without a word (Colab: 12.7 GB for everything)
    from helpers.errors import HostMemoryError

    table = torch.zeros(1000, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(placement, "free_host_bytes", lambda: placement.PIN_MARGIN_BYTES)  # the margin, no more
    with pytest.raises(HostMemoryError, match="close other programs or notebooks, or load with head='tied'"):
        placement.mapped_view(table, "cuda:0", ", or load with head='tied'")
    monkeypatch.setattr(placement, "free_host_bytes", lambda: 10 * placement.PIN_MARGIN_BYTES)  # the control
    if not torch.cuda.is_available():
        assert placement.mapped_view(table, "cuda:0") is None  # past the RAM check; no GPU here to map to


def image_prompt(seed: int):
    """One random picture as Gemma 4's image processor gives it (the PIL backend where torchvision is missing),
    after BOS and before 16 text tokens, its soft-token placeholders in between."""
    from PIL import Image
    from transformers import Gemma4ImageProcessor

    vision = synthetic.gemma4_config("tiny").vision_config
    processor = Gemma4ImageProcessor(image_seq_length=vision.default_output_length,
                                     max_soft_tokens=vision.default_output_length, pooling_kernel_size=3,
                                     do_normalize=False)
    generator = torch.Generator().manual_seed(seed)
    picture = Image.fromarray((torch.rand(224, 224, 3, generator=generator) * 255).to(torch.uint8).numpy())
    pixels = processor(picture, return_tensors="pt")
    soft_tokens = int(pixels["num_soft_tokens_per_image"][0])
    ids = torch.cat([torch.tensor([[2]]), torch.full((1, soft_tokens), synthetic.gemma4_config("tiny").image_token_id),
                     torch.randint(10, 300, (1, 16), generator=torch.Generator().manual_seed(0))], dim=1)
    return ids, pixels["pixel_values"], pixels["image_position_ids"]


def logits_with_image(model, ids, pixel_values, image_position_ids):
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixel_values.to(model.dtype), image_position_ids=image_position_ids).logits


def audio_prompt(seed: int):
    """One second of random sound as Gemma 4's audio feature extractor gives it (128 mel bins, 16 kHz), after BOS
    and before 16 text tokens, one audio soft-token placeholder per frame left after the tower's two stride-2 convs."""
    from transformers import Gemma4AudioFeatureExtractor

    wave = (torch.rand(16_000, generator=torch.Generator().manual_seed(seed)) * 0.6 - 0.3).numpy()
    found = Gemma4AudioFeatureExtractor()([wave], sampling_rate=16_000, return_tensors="pt")
    frames = found["input_features_mask"][0]
    for _ in range(2):  # the placeholders the processor writes: what survives two stride-2 convolutions
        frames = frames[::2][:(len(frames) - 1) // 2 + 1]
    ids = torch.cat([torch.tensor([[2]]), torch.full((1, int(frames.sum())), synthetic.gemma4_config("tiny").audio_token_id),
                     torch.randint(10, 300, (1, 16), generator=torch.Generator().manual_seed(0))], dim=1)
    return ids, found["input_features"], found["input_features_mask"]


def logits_with_audio(model, ids, input_features, input_features_mask):
    with torch.no_grad():
        return model(input_ids=ids, input_features=input_features.to(model.dtype),
                     input_features_mask=input_features_mask).logits


# each input: how it is made, how the model reads it, its tower, and a weight of the tower every such input reads
INPUTS = {"image": (image_prompt, logits_with_image, "model.vision_tower", "patch_embedder.input_proj.weight"),
          "sound": (audio_prompt, logits_with_audio, "model.audio_tower", "subsample_conv_projection.input_proj_linear.weight")}


@pytest.mark.parametrize("kind", INPUTS)
def test_an_image_or_a_sound_runs_through_the_towers_in_host_memory_with_the_logits_of_the_towers_in_place(tiny_path,
                                                                                                            kind):
    make, logits_with, tower, nudged = INPUTS[kind]
    resident = loading.load_model(tiny_path, "bf16", "cpu", device="cpu")
    waiting = loading.load_model(tiny_path, "bf16", "cpu", device="cpu", towers="cpu")
    towers = placement.tower_module_names(waiting)
    assert tower in towers and all(placement.runs_on_cpu(waiting.get_submodule(name)) for name in towers)
    given = make(seed=1)
    reference = logits_with(resident, *given)
    assert torch.equal(logits_with(waiting, *given), reference)
    # what is compared depends on the input: another one moves the text's logits after it
    assert not torch.equal(logits_with(resident, *make(seed=2)), reference)
    # control: one weight of the waiting tower one bf16 ulp up must show in the logits
    weight = waiting.get_submodule(tower).get_parameter(nudged)
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0].copy_(torch.nextafter(weight[0], torch.full_like(weight[0], float("inf"))))
    try:
        assert not torch.equal(logits_with(waiting, *given), reference)
    finally:
        with torch.no_grad():
            weight.copy_(kept)


def test_a_tower_kept_in_host_memory_by_choice_gives_the_same_logits_and_visits_again_after(tiny_path):
    waiting = loading.load_model(tiny_path, "bf16", "cpu", device="cpu", towers="cpu")
    image = image_prompt(seed=1)
    reference = logits_with_image(waiting, *image)
    vision = ["model.vision_tower", "model.embed_vision"]
    with placement.towers_stay_in_host_memory(waiting, vision) as kept:
        assert not any(module._tower_visits for module in kept)
        assert torch.equal(logits_with_image(waiting, *image), reference)
    with pytest.raises(RuntimeError, match="inside"), placement.towers_stay_in_host_memory(waiting):
        raise RuntimeError("an error inside the block")
    for name in placement.tower_module_names(waiting):
        module = waiting.get_submodule(name)
        assert placement.runs_on_cpu(module) and module._tower_visits
        assert all(p.device.type == "cpu" for p in module.parameters())
    assert torch.equal(logits_with_image(waiting, *image), reference)
    with pytest.raises(InvalidChoiceError, match="not a tower waiting in host memory"):
        placement.towers_stay_in_host_memory(waiting, ["model.language_model"]).__enter__()


def test_a_tower_visits_only_a_gpu_with_room_for_it_and_never_while_it_is_being_trained(monkeypatch):
    from helpers import cards

    tower = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    placement.install_cpu_tower(tower, "cuda:0")
    size = sum(p.numel() * p.element_size() for p in tower.parameters())
    monkeypatch.setattr(cards, "budget_bytes", lambda device: size + 1)
    with torch.no_grad():
        assert placement._tower_may_visit(tower, torch.device("cuda:0"))
    assert not placement._tower_may_visit(tower, torch.device("cuda:0"))  # gradients on: its copy would be lost
    monkeypatch.setattr(cards, "budget_bytes", lambda device: size - 1)
    with torch.no_grad():
        assert not placement._tower_may_visit(tower, torch.device("cuda:0"))  # no room: it runs on the CPU
        assert not placement._tower_may_visit(tower, torch.device("cpu"))


def test_a_visit_puts_the_host_tensors_back_even_when_the_call_fails():
    tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    host = [t.data for t in (*tower.parameters(), *tower.buffers())]
    with pytest.raises(RuntimeError, match="inside"), placement._visiting(tower, torch.device("cpu")):
        visiting = [t.data for t in (*tower.parameters(), *tower.buffers())]
        assert all(t.data_ptr() != kept.data_ptr() and torch.equal(t, kept) for t, kept in zip(visiting, host))
        raise RuntimeError("an error inside the visit")
    assert all(t.data_ptr() == kept.data_ptr() for t, kept in zip((*tower.parameters(), *tower.buffers()), host))
