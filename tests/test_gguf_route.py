"""The llama.cpp route on tiny: llama.cpp's own converter accepts the synthetic checkpoint, Q4_K_M
quantization, the GGUF's metadata, the same prompt ids and next-token logits as transformers, the
forced built-in templates against the embedded one, and the stop tokens.

Needs llama-cpp-python, gguf and llama.cpp's converter (``make llama-cpp`` installs them and sets
``LLAMA_CPP_SOURCE``); without them only the install message is tested."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import chat, gguf_route, loading, synthetic
from helpers.errors import CourseError, LlamaCppMissingError

QUESTION = "Where does the PLE table live?"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
needs_llama_cpp = pytest.mark.skipif(
    not gguf_route.installed() or gguf_route.find_converter() is None,
    reason=f"llama-cpp-python, gguf or llama.cpp's converter is missing (make llama-cpp, or set {gguf_route.SOURCE_ENV})")


@pytest.mark.parametrize("failure", [ModuleNotFoundError("No module named 'llama_cpp'"),
                                     OSError("libllama.so: cannot open shared object file")])
def test_without_a_working_llama_cpp_python_the_route_names_the_pinned_install_command(monkeypatch, failure):
    def unavailable(name):
        raise failure

    monkeypatch.setattr(gguf_route.importlib, "import_module", unavailable)
    assert not gguf_route.installed()
    with pytest.raises(LlamaCppMissingError, match=f"llama-cpp-python=={gguf_route.LLAMA_CPP_PYTHON_VERSION}") as missing:
        gguf_route.require_llama_cpp()
    assert str(failure) in str(missing.value)


@pytest.fixture(scope="module")
def gguf_files(tiny_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    bf16 = gguf_route.convert(tiny_path, folder / "tiny-bf16.gguf")
    q4 = gguf_route.quantize(bf16["path"], folder / "tiny-Q4_K_M.gguf")
    return {"bf16": bf16, "q4": q4}


@pytest.fixture(scope="module")
def llm(gguf_files):
    return gguf_route.load(gguf_files["q4"]["path"])


@needs_llama_cpp
def test_llama_cpps_converter_refuses_a_byte_level_tokenizer_with_its_own_message(tiny_path, tmp_path):
    """The control for the tokenizer the synthetic checkpoints now carry: the one they had before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    copy = shutil.copytree(tiny_path, tmp_path / "tiny-byte-level")
    vocab, _ = synthetic.vocabulary(synthetic.gemma4_config("tiny"))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_vocab = {token: i for token, i in vocab.items() if not token.startswith("<0x")}
    byte_vocab.update({symbol: vocab[f"<0x{n:02X}>"] for n, symbol in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>").save_pretrained(copy)
    with pytest.raises(CourseError, match="Cannot find Llama BPE tokenizer"):
        gguf_route.convert(copy, tmp_path / "refused.gguf")


@needs_llama_cpp
def test_the_gguf_carries_gemma4_the_checkpoints_template_and_its_special_token_ids(gguf_files):
    config = synthetic.gemma4_config("tiny")
    text = config.get_text_config()
    meta = gguf_route.metadata(gguf_files["q4"]["path"])
    assert meta["architecture"] == "gemma4" and meta["tokenizer"] == "gemma4"
    assert meta["chat template"] == synthetic.CHAT_TEMPLATE
    assert (meta["tokens"], meta["bos id"], meta["eos id"]) == (text.vocab_size, text.bos_token_id, text.eos_token_id)
    assert (meta["blocks"], meta["shared KV layers"]) == (text.num_hidden_layers, text.num_kv_shared_layers)


@needs_llama_cpp
def test_the_ple_table_is_one_tensor_of_layers_times_width_per_token_and_q4_k_m_shrinks_it(gguf_files):
    text = synthetic.gemma4_config("tiny").get_text_config()
    bf16 = gguf_route.tensor(gguf_files["bf16"]["path"])
    q4 = gguf_route.tensor(gguf_files["q4"]["path"])
    shape = [text.num_hidden_layers * text.hidden_size_per_layer_input, text.vocab_size_per_layer_input]
    assert bf16["shape"] == q4["shape"] == shape
    assert bf16["type"] == "BF16" and bf16["bytes"] == shape[0] * shape[1] * 2
    assert q4["type"] != "BF16" and q4["bytes"] < bf16["bytes"]
    assert gguf_files["q4"]["bytes"] < gguf_files["bf16"]["bytes"]
    assert sum(gguf_route.bytes_by_type(gguf_files["q4"]["path"]).values()) == sum(
        t["bytes"] for t in gguf_route.tensors(gguf_files["q4"]["path"]))


@needs_llama_cpp
def test_llama_cpp_reads_the_embedded_templates_prompt_as_the_same_ids_as_transformers(llm, tiny_tokenizer):
    embedded = gguf_route.render_embedded(llm, MESSAGES)
    expected = chat.render(tiny_tokenizer, MESSAGES)
    assert embedded == expected.text
    assert gguf_route.tokenize(llm, embedded) == expected.ids


@needs_llama_cpp
def test_thinking_renders_the_same_through_llama_cpp_python_and_transformers(llm, tiny_tokenizer):
    assert gguf_route.render_embedded(llm, MESSAGES, enable_thinking=True) == \
        chat.render(tiny_tokenizer, MESSAGES, enable_thinking=True).text


@needs_llama_cpp
def test_the_forced_gemma_template_writes_gemma_1_to_3_turn_markers_that_gemma4_reads_as_plain_text(llm, tiny_tokenizer):
    forced = gguf_route.render_builtin("gemma", MESSAGES)
    assert forced == f"<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    forced_ids = gguf_route.tokenize(llm, forced)
    embedded_ids = gguf_route.tokenize(llm, gguf_route.render_embedded(llm, MESSAGES))
    turn = tiny_tokenizer.convert_tokens_to_ids("<|turn>")
    assert forced_ids != embedded_ids and turn in embedded_ids and turn not in forced_ids
    assert tiny_tokenizer.decode(forced_ids, skip_special_tokens=False) == forced  # spelled out byte by byte


@needs_llama_cpp
def test_gemma3_is_no_built_in_template_and_with_jinja_on_the_name_itself_becomes_the_prompt(llm):
    assert gguf_route.render_builtin("gemma3", MESSAGES) is None
    assert gguf_route.render_name_as_jinja(llm, "gemma3", MESSAGES) == "gemma3"
    assert gguf_route.render_name_as_jinja(llm, "gemma", MESSAGES) == "gemma"


@needs_llama_cpp
def test_llama_cpp_ends_generation_on_the_generation_configs_stop_tokens(llm, tiny_path):
    generation = json.loads((tiny_path / "generation_config.json").read_text())
    assert gguf_route.stop_tokens(llm) == sorted(generation["eos_token_id"])


@needs_llama_cpp
def test_the_converted_model_computes_transformers_next_token_logits(gguf_files, tiny_path, tiny_tokenizer):
    model = loading.load_model(tiny_path, quant="bf16", ple="cpu", device="cpu")
    converted = gguf_route.load(gguf_files["bf16"]["path"], logits_all=True)
    same = gguf_route.compare_logits(converted, model, chat.render(tiny_tokenizer, MESSAGES).ids)
    assert same["logit_std"] > 0.05  # the logits vary: a flat vector would match anything
    assert same["correlation"] > 0.999 and same["same_top_token"]
    assert same["max_abs_difference"] < same["logit_std"] / 5
    assert same["control_correlation"] < 0.9  # the control: another position's logits do not match


@needs_llama_cpp
def test_the_q4_k_m_model_generates_varied_tokens_on_the_cpu(llm, tiny_tokenizer):
    run = gguf_route.generate(llm, chat.render(tiny_tokenizer, MESSAGES).ids, max_tokens=16)
    assert run["prefill_tokens"] > 0 and len(run["ids"]) > 0
    assert len(set(run["ids"])) > 1


@needs_llama_cpp
def test_a_layer_order_llama_cpp_cannot_share_kv_over_is_refused_before_it_aborts_the_process(tmp_path):
    raw = synthetic.config_dict("tiny")
    raw["text_config"]["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    checkpoint = synthetic.build(raw, tmp_path / "old-order", progress=False)
    converted = gguf_route.convert(checkpoint, tmp_path / "old-order.gguf")
    with pytest.raises(CourseError, match="must be full attention"):
        gguf_route.check_kv_sharing_order(converted["path"])


@needs_llama_cpp
def test_the_tiny_gguf_passes_the_kv_sharing_order_check(gguf_files):
    gguf_route.check_kv_sharing_order(gguf_files["q4"]["path"])


@needs_llama_cpp
def test_quantizing_a_file_onto_itself_is_refused_and_the_source_is_left_whole(gguf_files):
    source = gguf_files["bf16"]["path"]
    before = source.read_bytes()
    with pytest.raises(CourseError, match="overwrite its own input"):
        gguf_route.quantize(source, source)
    assert source.read_bytes() == before


@needs_llama_cpp
def test_a_quantization_that_fails_midway_leaves_no_file_under_the_final_name(gguf_files, tmp_path, monkeypatch):
    import llama_cpp

    def cut_short(source, dest, params):  # writes part of its output, then fails, as a full disk would
        with open(dest, "wb") as handle:
            handle.write(b"GGUF" + b"\0" * 100)
        return 1

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", cut_short)
    dest = tmp_path / "cut.gguf"
    with pytest.raises(CourseError, match="returned 1"):
        gguf_route.quantize(gguf_files["bf16"]["path"], dest)
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_that_fails_midway_leaves_no_file_under_the_final_name(tiny_path, tmp_path, monkeypatch):
    import subprocess

    def cut_short(command, **kwargs):  # the converter wrote part of its output, then died
        Path(command[command.index("--outfile") + 1]).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(command, 1, "", "OSError: [Errno 28] No space left on device")

    monkeypatch.setattr(gguf_route.subprocess, "run", cut_short)
    monkeypatch.setattr(gguf_route, "converter_dir", lambda: tmp_path)
    with pytest.raises(CourseError, match="No space left"):
        gguf_route.convert(tiny_path, tmp_path / "out" / "tiny.gguf")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_converter_download_is_named_in_one_clean_sentence_without_pips_colour_codes(monkeypatch, tmp_path):
    # pip colours its last line: the learner saw "(['\x1b[0m'])" in place of why the download failed
    monkeypatch.setattr(gguf_route, "find_converter", lambda: None)
    monkeypatch.setattr(gguf_route, "cache_dir", lambda: tmp_path)
    failed = subprocess.CompletedProcess([], 1, "", "\x1b[31mERROR: No matching distribution found\x1b[0m\n\x1b[0m\n")
    monkeypatch.setattr(gguf_route.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(LlamaCppMissingError) as missing:
        gguf_route.converter_dir()
    assert "(ERROR: No matching distribution found)" in str(missing.value) and "\x1b" not in str(missing.value)


def test_the_converter_make_extracted_is_found_without_llama_cpp_source_set(monkeypatch, tmp_path):
    """JupyterLab started without make (python -m helpers.course lab) has no LLAMA_CPP_SOURCE: notebook 08 must still
    find the converter `make llama-cpp` extracted, not fall back to pip downloading the source."""
    made = tmp_path / "made" / "llama.cpp"
    monkeypatch.delenv(gguf_route.SOURCE_ENV, raising=False)
    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(gguf_route, "MADE_CONVERTER_DIR", made)
    assert gguf_route.find_converter() is None  # the control: nothing there yet
    made.mkdir(parents=True)
    (made / gguf_route.CONVERTER).write_text("# llama.cpp's converter\n")
    assert gguf_route.find_converter() == made.resolve()


def test_the_converter_folder_the_course_looks_in_is_the_one_the_makefile_extracts_to():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    version = next(line.split(":=")[1].strip() for line in makefile.splitlines() if line.startswith("LLAMA_CPP_PYTHON :="))
    folder = next(line.split(":=")[1].strip() for line in makefile.splitlines() if line.startswith("LLAMA_CPP_DIR :="))
    source = next(line.split(":=")[1].strip() for line in makefile.splitlines()
                  if line.startswith("export LLAMA_CPP_SOURCE :="))
    made = source.replace("$(CURDIR)/", "").replace("$(LLAMA_CPP_DIR)", folder).replace("$(LLAMA_CPP_PYTHON)", version)
    assert version == gguf_route.LLAMA_CPP_PYTHON_VERSION
    assert gguf_route.MADE_CONVERTER_DIR == Path(__file__).resolve().parents[1] / made
