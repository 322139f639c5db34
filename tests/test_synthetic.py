import hashlib
import json

import pytest
import torch

from helpers import synthetic
from helpers.errors import CourseError, InvalidChoiceError


def test_tiny_round_trips_through_from_pretrained_with_same_names_shapes_and_values(tiny_path):
    from safetensors.torch import load_file
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.bfloat16)
    saved = load_file(tiny_path / "model.safetensors")
    state = model.state_dict()
    assert saved, "no tensors saved"
    for name, tensor in saved.items():
        assert name in state, name
        assert torch.equal(state[name], tensor), name
    assert "model.language_model.embed_tokens_per_layer.weight" in saved


def test_tiny_keeps_every_structural_feature_of_e4b():
    config = synthetic.gemma4_config("tiny")
    text = config.get_text_config()
    assert text.hidden_size_per_layer_input > 0  # PLE
    assert text.num_kv_shared_layers > 0  # KV sharing...
    shared = text.layer_types[-text.num_kv_shared_layers:]
    assert set(shared) == {"sliding_attention", "full_attention"}  # ...over both attention types
    raw_text = synthetic.config_dict("tiny")["text_config"]
    assert raw_text["global_head_dim"] != raw_text["head_dim"]  # full layers have wider heads
    assert config.vision_config is not None and config.audio_config is not None
    assert text.tie_word_embeddings


def test_e4b_shape_has_the_reference_parameter_count_and_ple_shape():
    from helpers.weights import meta_model

    model = meta_model(synthetic.gemma4_config("e4b-shape"))
    unique = {id(p): p for p in model.parameters()}
    assert sum(p.numel() for p in unique.values()) == 7_941_100_832  # FINDINGS.md, real E4B shapes
    ple = model.get_submodule("model.language_model.embed_tokens_per_layer")
    assert tuple(ple.weight.shape) == (262144, 42 * 256)


def test_interrupted_build_leaves_nothing_a_loader_could_mistake_for_a_checkpoint(tmp_path, monkeypatch):
    written = []

    def crash_on_the_third_tensor(tensor):
        written.append(tensor.shape)
        if len(written) == 3:
            raise KeyboardInterrupt
        return real(tensor)

    real = synthetic._raw_bytes
    monkeypatch.setattr(synthetic, "_raw_bytes", crash_on_the_third_tensor)
    dest = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        synthetic.build("tiny", dest, progress=False)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_the_streamed_build_lays_out_the_files_exactly_as_save_pretrained_does(tmp_path):
    from safetensors import safe_open
    from transformers import Gemma4ForConditionalGeneration

    config = synthetic.gemma4_config("tiny")
    streamed = synthetic.build("tiny", tmp_path / "streamed", progress=False)
    Gemma4ForConditionalGeneration._from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "library")

    def layout(folder):
        tensors = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(shard, "pt") as handle:
                tensors.update({key: (handle.get_slice(key).get_shape(), handle.get_slice(key).get_dtype())
                                for key in handle.keys()})
        return tensors

    assert layout(streamed) == layout(tmp_path / "library")
    assert json.loads((streamed / "config.json").read_text()) == json.loads((tmp_path / "library" / "config.json").read_text())


def test_a_sharded_build_has_an_index_naming_every_tensor_once(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setattr(synthetic, "MAX_SHARD_BYTES", 200_000)
    folder = synthetic.build("tiny", tmp_path / "sharded", progress=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    stored = [key for shard in shards for key in safe_open(shard, "pt").keys()]
    assert sorted(stored) == sorted(index["weight_map"])
    from transformers import Gemma4ForConditionalGeneration

    Gemma4ForConditionalGeneration.from_pretrained(folder)  # transformers reads it without complaint


def test_a_large_embedding_is_initialised_in_row_blocks_with_the_padding_row_zeroed(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    blocks = []
    real = synthetic._embedding_block

    def counted(model, module_name, rows, seed):
        block = real(model, module_name, rows, seed)
        blocks.append(block.shape[0])
        return block

    monkeypatch.setattr(synthetic, "EMBEDDING_BLOCK_BYTES", 64 * 64 * 2)  # 64 rows of tiny's width
    monkeypatch.setattr(synthetic, "_embedding_block", counted)
    weights = load_file(synthetic.build("tiny", tmp_path / "blocked", progress=False) / "model.safetensors")
    table = weights["model.language_model.embed_tokens.weight"].float()
    assert len(blocks) >= 5 and sum(blocks) >= table.shape[0]
    pad = synthetic.gemma4_config("tiny").get_text_config().pad_token_id
    assert torch.count_nonzero(table[pad]) == 0 and torch.count_nonzero(table[pad + 1]) > 0
    assert table.std().item() == pytest.approx(0.02, rel=0.1)
    assert len({tuple(block[:2]) for block in table.split(64)}) > 1  # blocks are not copies of one another


def test_worker_processes_write_the_same_bytes_as_one_process_so_a_build_does_not_depend_on_the_machine(
        tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "MAX_SHARD_BYTES", 200_000)  # several shards, written side by side
    monkeypatch.setattr(synthetic, "EMBEDDING_BLOCK_BYTES", 64 * 64 * 2)
    alone = synthetic.build("tiny", tmp_path / "alone", progress=False, workers=1)
    side_by_side = synthetic.build("tiny", tmp_path / "side-by-side", progress=False, workers=2)
    markers = [json.loads((path / synthetic.COMPLETE_MARKER).read_text()) for path in (alone, side_by_side)]
    assert (markers[0]["workers"], markers[1]["workers"]) == (0, 2)
    shards = sorted(name for name in markers[0]["sha256"] if name.endswith(".safetensors"))
    assert len(shards) > 1
    assert all(markers[0]["sha256"][name] == markers[1]["sha256"][name] for name in shards)
    assert markers[1]["peak_rss_bytes"] > markers[0]["peak_rss_bytes"]  # the workers' memory is counted too


def test_each_tensor_draws_from_its_own_stream_so_two_modules_of_one_shape_differ():
    model = synthetic.skeleton(synthetic.gemma4_config("tiny"))
    fills = synthetic.course_init_fills(model)
    first, second = (synthetic._materialise(model, f"model.language_model.layers.{i}.mlp.gate_proj", fills, 0).weight.clone()
                     for i in (0, 1))
    again = synthetic._materialise(model, "model.language_model.layers.0.mlp.gate_proj", fills, 0).weight
    other_seed = synthetic._materialise(model, "model.language_model.layers.0.mlp.gate_proj", fills, 1).weight
    assert first.shape == second.shape and not torch.equal(first, second)
    assert torch.equal(first, again)  # the same module, made again (by another worker), is the same
    assert not torch.equal(first, other_seed)


def test_a_stretch_of_a_stream_is_the_same_bits_as_that_part_of_the_whole_so_row_blocks_do_not_matter():
    whole = synthetic.exact_normal("0/table", 10_000, std=0.02)
    parts = torch.cat([synthetic.exact_normal("0/table", 3_333, start=start, std=0.02) for start in (0, 3_333, 6_666)]
                      + [synthetic.exact_normal("0/table", 1, start=9_999, std=0.02)])
    assert torch.equal(whole.view(torch.int16), parts.view(torch.int16))
    shifted = synthetic.exact_normal("0/table", 10_000, start=1, std=0.02)  # the control: one draw late
    assert torch.equal(whole[1:].view(torch.int16), shifted[:-1].view(torch.int16))
    assert not torch.equal(whole.view(torch.int16), shifted.view(torch.int16))
    assert len(set(whole.float().tolist())) > 1_000 and whole.float().std().item() == pytest.approx(0.02, rel=0.05)
    assert abs(whole.float().mean().item()) < 0.002


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_exact_draws_round_the_same_float32_values_to_each_dtype(dtype):
    wide = synthetic.exact_normal("0/w", 4_096, std=0.5, dtype=torch.float32)
    assert torch.equal(synthetic.exact_normal("0/w", 4_096, std=0.5, dtype=dtype), wide.to(dtype))


def test_the_build_refuses_an_init_whose_bits_would_depend_on_the_machine():
    from transformers import initialization

    weight = torch.empty(4, 4)
    with pytest.raises(CourseError, match="uniform_"), synthetic.exact_random_init({id(weight): ("0/w", 0)}):
        initialization.uniform_(weight)
    with pytest.raises(CourseError, match="torch's random generator"), synthetic.exact_random_init({}):
        torch.randn(3)
    with synthetic.exact_random_init({id(weight): ("0/w", 0)}):
        initialization.normal_(weight, std=0.02)
    assert torch.equal(weight.view(-1), synthetic.exact_normal("0/w", 16, std=0.02, dtype=torch.float32))
    assert initialization.TORCH_INIT_FUNCTIONS["normal_"] is torch.nn.init.normal_  # restored


def test_tiny_is_the_same_bytes_as_recorded_so_every_machine_gets_the_same_weights(tiny_path, tmp_path):
    """The recorded sha256 (data/builds/tiny.json, `python -m helpers.synthetic tiny --force --record`) against a
    fresh build on this machine; the control, seed 1, must differ. make test also runs this under other CPUs'
    kernels (ATEN_CPU_CAPABILITY=default and avx2)."""
    recorded = synthetic.recorded_weights_sha256("tiny")
    assert recorded and synthetic.weights_sha256(tiny_path) == recorded
    other_seed = synthetic.build("tiny", tmp_path / "seed-1", seed=1, progress=False)
    assert synthetic.weights_sha256(other_seed) != recorded


def test_a_build_drawn_by_the_older_single_stream_init_is_rebuilt_not_reused(tmp_path):
    path = synthetic.build("tiny", tmp_path / "old", progress=False)
    marker = json.loads((path / synthetic.COMPLETE_MARKER).read_text())
    marker.pop("init_scheme")
    (path / synthetic.COMPLETE_MARKER).write_text(json.dumps(marker))
    (path / "model.safetensors").write_bytes(b"drawn the old way")
    assert synthetic.build("tiny", path, progress=False) == path
    assert json.loads((path / synthetic.COMPLETE_MARKER).read_text())["init_scheme"] == synthetic.INIT_SCHEME
    assert set(synthetic.verify(path).values()) == {"ok"}


def test_the_course_init_scales_q_k_and_post_norms_and_nothing_else(tiny_path):
    from safetensors.torch import load_file

    weights = load_file(tiny_path / "model.safetensors")
    post = [k for k in weights if k.split(".")[-2] in synthetic.POST_NORMS and "language_model" in k]
    assert post and all(torch.all(weights[k] == synthetic.POST_NORM_SCALE) for k in post)
    other_norms = [k for k in weights if k.endswith("layernorm.weight") and k not in post]
    assert other_norms and all(torch.all(weights[k] == 1) for k in other_norms)


def test_staging_folders_of_a_dead_builder_are_removed_at_the_next_build(tmp_path):
    stale = tmp_path / ".ckpt.partial-deadbeef"
    (stale / "sub").mkdir(parents=True)
    (stale / "model-00001-of-00004.safetensors").write_bytes(b"half a shard")
    synthetic.build("tiny", tmp_path / "ckpt", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_the_build_marker_carries_a_hash_of_every_file(tiny_path):
    import hashlib

    hashes = json.loads((tiny_path / synthetic.COMPLETE_MARKER).read_text())["sha256"]
    files = {p.name for p in tiny_path.iterdir()} - {synthetic.COMPLETE_MARKER}
    assert set(hashes) == files
    assert all(hashlib.sha256((tiny_path / name).read_bytes()).hexdigest() == digest for name, digest in hashes.items())


def test_a_finished_build_is_reused_not_rebuilt(tmp_path):
    dest = synthetic.build("tiny", tmp_path / "a", progress=False)
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    assert synthetic.build("tiny", dest, progress=False) == dest
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp


def test_processes_asking_at_once_build_once_and_never_replace_a_checkpoint_being_read(tmp_path, monkeypatch):
    import threading
    import time

    real_build, builds = synthetic._build_unlocked, []

    def slow_build(*args):
        builds.append(threading.get_ident())
        time.sleep(0.5)  # the others ask while this build runs
        return real_build(*args)

    monkeypatch.setattr(synthetic, "_build_unlocked", slow_build)
    synthetic.gemma4_config("tiny")  # transformers' lazy imports are not thread-safe; processes each import alone
    dest, results = tmp_path / "shared", []
    askers = [threading.Thread(target=lambda: results.append(synthetic.build("tiny", dest, progress=False)))
              for _ in range(3)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(builds) == 1 and results == [dest] * 3
    assert synthetic.is_complete(dest) and [p.name for p in tmp_path.iterdir()] == ["shared"]


def test_build_refuses_to_write_into_a_foreign_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidChoiceError, match="not a synthetic checkpoint"):
        synthetic.build("tiny", tmp_path, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_same_seed_gives_identical_weights(tmp_path):
    from safetensors.torch import load_file

    a = load_file(synthetic.build("tiny", tmp_path / "a", progress=False) / "model.safetensors")
    b = load_file(synthetic.build("tiny", tmp_path / "b", progress=False) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_synthetic_tokenizer_puts_special_tokens_at_the_config_ids(tiny_tokenizer):
    config = synthetic.gemma4_config("tiny")
    assert tiny_tokenizer.convert_tokens_to_ids("<|image|>") == config.image_token_id
    assert tiny_tokenizer.convert_tokens_to_ids("<turn|>") == config.eos_token_id[-1]
    text = "Grüße, 世界!"
    assert tiny_tokenizer.decode(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_takes_list_content_as_the_multimodal_processor_requires(tiny_tokenizer):
    as_list = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    as_str = [{"role": "user", "content": "hi"}]
    rendered = tiny_tokenizer.apply_chat_template(as_list, add_generation_prompt=True, tokenize=False)
    assert rendered == tiny_tokenizer.apply_chat_template(as_str, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|turn>model\n") and "hi<turn|>" in rendered


@pytest.mark.gpu  # the GPU image has torchvision; the CPU tier's torch build has none that imports
@pytest.mark.skipif(not synthetic.torchvision_available(), reason="Gemma 4's processor needs torchvision")
def test_autoprocessor_loads_the_synthetic_processor_and_applies_the_chat_template(tiny_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_path)
    out = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
    )
    assert out["input_ids"].shape[0] == 1


def test_build_marker_records_seed_and_config_fingerprint(tiny_path):
    marker = json.loads((tiny_path / synthetic.COMPLETE_MARKER).read_text())
    assert marker["seed"] == synthetic.DEFAULT_SEED
    assert marker["config_sha256_12"] == synthetic.config_fingerprint(synthetic.gemma4_config("tiny"))


def test_unknown_shape_names_the_choices():
    with pytest.raises(InvalidChoiceError, match="tiny, e2b-shape, e4b-shape"):
        synthetic.build("e8b-shape")


@pytest.mark.parametrize("shape", list(synthetic.SHAPES))
def test_the_last_layer_before_the_kv_shared_ones_is_full_attention_as_llama_cpp_assumes(shape):
    text = synthetic.gemma4_config(shape).get_text_config()
    first_shared = text.num_hidden_layers - text.num_kv_shared_layers
    assert text.layer_types[first_shared - 1] == "full_attention"
    assert text.layer_types[first_shared - 2] == "sliding_attention"


@pytest.mark.parametrize("shape", list(synthetic.SHAPES))
def test_the_tokenizer_fills_every_id_once_so_llama_cpps_converter_can_read_them_in_order(shape):
    config = synthetic.gemma4_config(shape)
    vocab, specials = synthetic.vocabulary(config)
    assert sorted(vocab.values()) == list(range(config.get_text_config().vocab_size))
    assert all(vocab[token] == i for token, i in specials.items())
    assert {f"<0x{b:02X}>" for b in range(256)} <= set(vocab)


def test_the_tokenizer_is_sentencepiece_style_bpe_with_byte_fallback_and_merges(tiny_tokenizer):
    pieces = tiny_tokenizer.tokenize("Where does the table live?")
    assert "▁the" in pieces and "<0x57>" in pieces  # a merge, and "W" (no token of its own) as its byte
    backend = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    assert backend["model"]["type"] == "BPE" and backend["model"]["byte_fallback"]
    assert backend["decoder"]["type"] == "Sequence"


def test_an_older_build_gets_the_current_tokenizer_and_template_and_keeps_its_weights(tmp_path):
    path = synthetic.build("tiny", tmp_path / "old", progress=False)
    weights = (path / "model.safetensors").stat().st_mtime_ns
    marker = json.loads((path / synthetic.COMPLETE_MARKER).read_text())
    marker.pop("text_format")
    (path / synthetic.COMPLETE_MARKER).write_text(json.dumps(marker))
    (path / "chat_template.jinja").write_text(synthetic.TURNS_ONLY_TEMPLATE)
    assert synthetic.build("tiny", path, progress=False) == path
    assert (path / "chat_template.jinja").read_text() == synthetic.CHAT_TEMPLATE
    refreshed = json.loads((path / synthetic.COMPLETE_MARKER).read_text())
    assert refreshed["text_format"] == synthetic.TEXT_FORMAT
    assert refreshed["sha256"]["chat_template.jinja"] == hashlib.sha256(synthetic.CHAT_TEMPLATE.encode()).hexdigest()
    assert (path / "model.safetensors").stat().st_mtime_ns == weights


def greedy_distinct_tokens_at_e4b_width(post_norm_scale: float, tokens: int = 48) -> int:
    """Greedy decoding of a model with E4B's hidden width, vocabulary scale and 12 of its layers (thin
    MLPs and PLE for speed), initialised as the course's synthetic checkpoints are."""
    from transformers import Gemma4ForConditionalGeneration

    raw = synthetic.config_dict("e4b-shape")
    text = raw["text_config"]
    text.update(intermediate_size=256, hidden_size_per_layer_input=16, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=12, layer_types=text["layer_types"][:12], num_kv_shared_layers=6,
                vocab_size=32768, vocab_size_per_layer_input=32768)
    raw["vision_config"]["num_hidden_layers"] = raw["audio_config"]["num_hidden_layers"] = 1
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration._from_config(synthetic.gemma4_config(raw), dtype=torch.float32).eval()
    fills = {name: post_norm_scale if name.split(".")[-1] in synthetic.POST_NORMS else fill
             for name, fill in synthetic.course_init_fills(model).items()}
    for name, module in model.named_modules():  # drawn exactly, as a build draws them: the same model everywhere
        if [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]:
            synthetic._materialise(model, name, fills, 0)
    model.tie_weights()
    with torch.no_grad():
        ids = torch.tensor([[2, *range(1000, 1031)]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
    return len(set(out[0, ids.shape[1]:].tolist()))


def test_at_e4b_width_the_course_init_keeps_greedy_output_varied_where_the_default_repeats_one_token():
    assert greedy_distinct_tokens_at_e4b_width(synthetic.POST_NORM_SCALE) >= 5
    assert greedy_distinct_tokens_at_e4b_width(1.0) <= 2  # the control: the library's default init collapses


@pytest.mark.parametrize("cpus, available_gb, workers", [(16, 128, 8), (16, 10, 3), (2, 24, 2), (8, 2, 1)])
def test_a_large_build_uses_at_most_half_the_free_memory_so_a_small_machine_is_not_swamped(
        monkeypatch, cpus, available_gb, workers):
    import psutil

    monkeypatch.setattr(synthetic.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": available_gb * 1e9})())
    assert synthetic._default_workers(16 * 10**9) == workers
    assert workers * synthetic.WORKER_BYTES <= max(available_gb * 1e9 / 2, synthetic.WORKER_BYTES)
    assert synthetic._default_workers(synthetic.PARALLEL_FROM_BYTES - 1) == 1  # tiny: one process, no spawning


def test_a_full_disk_during_a_build_gets_one_sentence_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    import errno

    from helpers.errors import DiskFullError

    def full(path, offset, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synthetic, "_write_at", full)
    dest = tmp_path / "tiny"
    with pytest.raises(DiskFullError, match="no room on the disk") as refused:
        synthetic.build("tiny", dest, workers=1, progress=False)
    assert "\n" not in str(refused.value) and "GEMMA_COURSE_CACHE" in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no staging folder


def test_an_error_that_is_not_a_full_disk_is_not_called_one(tmp_path, monkeypatch):
    # the control: only a write with no room is reported as a full disk
    import errno

    def broken(path, offset, data):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(synthetic, "_write_at", broken)
    with pytest.raises(OSError) as raised:
        synthetic.build("tiny", tmp_path / "tiny", workers=1, progress=False)
    assert not isinstance(raised.value, CourseError) and raised.value.errno == errno.EIO
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(__import__("sys").platform == "win32", reason="ulimit -f (RLIMIT_FSIZE) is a POSIX limit")
@pytest.mark.parametrize("limit", [200_000, None], ids=["a-file-size-limit", "control-no-limit"])
def test_a_build_under_a_file_size_limit_says_so_and_leaves_nothing_behind(tmp_path, limit):
    import os
    import subprocess
    import sys

    dest = tmp_path / "tiny"
    script = ("import resource, signal, sys\n"
              "from helpers import synthetic\n"
              "from helpers.errors import DiskFullError\n"
              f"if {limit!r}:\n"
              "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              f"    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit!r}, {limit!r}))\n"
              "try:\n"
              f"    synthetic.build('tiny', {str(dest)!r}, workers=1, progress=False)\n"
              "except DiskFullError as err:\n"
              "    print(err)\n"
              "    sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=300)
    if limit:
        assert run.returncode == 3 and "no room on the disk" in run.stdout and "Traceback" not in run.stderr, run.stderr
        assert list(tmp_path.iterdir()) == []
    else:
        assert run.returncode == 0, run.stderr
        assert synthetic.is_complete(dest)


def test_the_build_command_refuses_no_workers_in_one_sentence_before_building(capsys):
    assert synthetic.main(["tiny", "--workers", "0"]) == 2
    captured = capsys.readouterr()
    assert "workers=0" in captured.err and "Traceback" not in captured.err and "built in" not in captured.out


def test_the_build_command_still_builds_with_one_worker(capsys):
    # the control beside the refusal
    assert synthetic.main(["tiny", "--workers", "1"]) == 0
    assert "built in" in capsys.readouterr().out
