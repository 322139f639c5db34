"""Bad input, as a careless or hostile user types it: each row is an input and the one CourseError
sentence it must get (its class and a phrase of the fix). No row may end in a bare library exception
or, worse, a silent wrong result. ``tools/bad_input_census.py`` runs the same table on any tree and
counts how each row was answered."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import io
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tool, write_small_gguf

from helpers import (
    anatomy,
    cards,
    course,
    decoding,
    download,
    environment,
    errors,
    exercises,
    faults,
    fine_tuning,
    gguf_route,
    host_memory,
    loading,
    long_context,
    measure,
    mirror,
    models,
    placement,
    planner,
    quantization,
    records,
    synthetic,
    weights,
)

NO_CUDA = not torch.cuda.is_available()
REPO = "google/gemma-4-E4B-it"


class Inputs:
    """The broken things the rows need, made on first use in ``root``."""

    def __init__(self, root: Path, tiny: Path):
        self.root, self.tiny = Path(root), Path(tiny)

    def folder(self, name: str) -> Path:
        path = self.root / name
        if not path.exists():
            shutil.copytree(self.tiny, path)
        return path

    def with_config(self, name: str, text: str) -> str:
        path = self.folder(name)
        (path / "config.json").write_text(text)
        return str(path)

    def with_weights(self, name: str, spoil) -> str:
        path = self.folder(name)
        shard = path / "model.safetensors"
        shard.write_bytes(spoil(shard.read_bytes()))
        return str(path)

    def a_file(self) -> Path:
        path = self.root / "a-file"
        path.write_text("not a folder")
        return path

    @functools.cached_property
    def meta(self):
        return weights.meta_model(synthetic.gemma4_config("tiny"))

    @functools.cached_property
    def model(self):
        return loading.load_model("tiny", quant="bf16", ple="gpu", device="cpu")

    def prompt(self, length: int = 16) -> torch.Tensor:
        return torch.randint(16, 272, (1, length), generator=torch.Generator().manual_seed(0))

    def past_the_window(self) -> torch.Tensor:
        return torch.full((1, TINY_WINDOW + 1), 20)

    def gguf(self, kind: str) -> Path:
        """A GGUF file that is missing, empty, not GGUF at all, or a real one cut in half."""
        path = self.root / f"{kind}.gguf"
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "not-gguf":
            path.write_text("this is a safetensors file, honest")
        elif kind == "truncated":
            write_small_gguf(path, rows=64)
            path.write_bytes(truncated(path.read_bytes()))
        return path


TINY_WINDOW = synthetic.gemma4_config("tiny").get_text_config().max_position_embeddings
UNWRITABLE = "/proc/gemma-course-cache"  # no process, root included, can create a folder here


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def garbled_header(data: bytes) -> bytes:
    return b"\xff" * 64 + data[64:]


def in_environment(name: str, value, call):
    """Run ``call`` with an environment variable set, and put it back."""
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return call()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# (what the user did, the call, the error class's name, a phrase of the sentence)
CASES = [
    # keep_bf16 given as a string was split into characters: a silent wrong answer in both places
    ("keep_bf16 as a string, planner", lambda i: planner.predict("tiny", keep_bf16="lm_head"),
     "InvalidChoiceError", "list of module names"),
    ("keep_bf16 as a string, loader", lambda i: loading.load_model("tiny", quant="nf4", device="cpu", keep_bf16="lm_head"),
     "InvalidChoiceError", "list of module names"),
    ("keep_bf16 as a string, quantization config", lambda i: quantization.quantization_config("nf4", keep_bf16="lm_head"),
     "InvalidChoiceError", "list of module names"),
    ("keep_bf16 as a string, weight bytes", lambda i: weights.weight_bytes(i.meta, "nf4", keep_bf16="lm_head"),
     "InvalidChoiceError", "list of module names"),
    ("keep_bf16 holding a number", lambda i: planner.predict("tiny", keep_bf16=[3]), "InvalidChoiceError", "list of module names"),
    # contexts
    ("negative context", lambda i: planner.predict("tiny", context=-100000), "InvalidChoiceError", "whole number of tokens"),
    ("zero context", lambda i: planner.predict("tiny", context=0), "InvalidChoiceError", "whole number of tokens"),
    ("fractional context", lambda i: planner.predict("tiny", context=8500.5), "InvalidChoiceError", "whole number of tokens"),
    ("context as text", lambda i: planner.predict("tiny", context="8500"), "InvalidChoiceError", "whole number of tokens"),
    ("context True", lambda i: planner.predict("tiny", context=True), "InvalidChoiceError", "whole number of tokens"),
    ("context past the model's window", lambda i: planner.predict("tiny", context=10**9), "InvalidChoiceError", "at most"),
    ("negative context, fits", lambda i: planner.fits("tiny", 8, context=-5), "InvalidChoiceError", "whole number of tokens"),
    ("negative card", lambda i: planner.fits("tiny", -8), "InvalidChoiceError", "card_gb"),
    ("card as text", lambda i: planner.fits("tiny", "8"), "InvalidChoiceError", "card_gb"),
    # config.json
    ("truncated config.json", lambda i: models.resolve(i.with_config("cut-config", '{"model_type": "gem')),
     "NotAGemma4CheckpointError", "not valid JSON"),
    ("config.json holding a list", lambda i: models.resolve(i.with_config("list-config", "[]")),
     "NotAGemma4CheckpointError", "JSON object"),
    ("config.json holding a string", lambda i: models.resolve(i.with_config("string-config", '"gemma4"')),
     "NotAGemma4CheckpointError", "JSON object"),
    ("truncated config.json, planner", lambda i: planner.predict(i.with_config("cut-config-2", '{"model_')),
     "NotAGemma4CheckpointError", "not valid JSON"),
    ("truncated config.json, loader", lambda i: loading.load_model(i.with_config("cut-config-3", "{"), quant="bf16", device="cpu"),
     "NotAGemma4CheckpointError", "not valid JSON"),
    # sources
    ("hub id with a trailing newline", lambda i: models.resolve(REPO + "\n"), "ModelNotFoundError", "not a valid hub id"),
    ("hub id with a leading space", lambda i: models.resolve(" " + REPO), "ModelNotFoundError", "not a valid hub id"),
    ("hub id with ..", lambda i: models.resolve("google/../gemma-4-E4B-it"), "ModelNotFoundError", "not a valid hub id"),
    ("hub id ending in ..", lambda i: models.resolve("google/.."), "ModelNotFoundError", "not a valid hub id"),
    ("resolve(5)", lambda i: models.resolve(5), "InvalidChoiceError", "hub id, a folder or"),
    ("resolve a list", lambda i: models.resolve(["tiny"]), "InvalidChoiceError", "hub id, a folder or"),
    ('resolve("")', lambda i: models.resolve(""), "InvalidChoiceError", "empty"),
    ("resolve of blanks", lambda i: models.resolve("   "), "InvalidChoiceError", "empty"),
    ("planner given a number", lambda i: planner.predict(5), "InvalidChoiceError", "hub id, a folder or"),
    ("processor given a number", lambda i: loading.load_processor(5), "InvalidChoiceError", "hub id, a folder or"),
    ('load_config("")', lambda i: models.load_config(""), "InvalidChoiceError", "empty"),
    ("synthetic build of a number", lambda i: synthetic.build(5), "InvalidChoiceError", "tiny, e2b-shape, e4b-shape"),
    ("synthetic seed as text", lambda i: synthetic.build("tiny", i.root / "seeded", seed="0"), "InvalidChoiceError", "seed"),
    ("synthetic build onto a file", lambda i: synthetic.build("tiny", i.a_file()), "InvalidChoiceError", "is a file"),
    ("synthetic build by no workers", lambda i: synthetic.build("tiny", i.root / "none", workers=0), "InvalidChoiceError",
     "workers=0"),
    ("synthetic weights by half a worker", lambda i: synthetic.write_weights(synthetic.gemma4_config("tiny"), i.root,
                                                                          workers=1.5), "InvalidChoiceError", "workers=1.5"),
    # devices
    ('device="tpu"', lambda i: loading.load_model("tiny", device="tpu"), "InvalidChoiceError", "device='tpu'"),
    ('device="mps"', lambda i: loading.load_model("tiny", device="mps"), "InvalidChoiceError", "device='mps'"),
    ("device=-1", lambda i: loading.load_model("tiny", device=-1), "InvalidChoiceError", "device=-1"),
    ("device=True", lambda i: loading.load_model("tiny", device=True), "InvalidChoiceError", "device=True"),
    ("device=1.5", lambda i: loading.load_model("tiny", device=1.5), "InvalidChoiceError", "device=1.5"),
    ('device="cuda:x"', lambda i: loading.load_model("tiny", device="cuda:x"), "InvalidChoiceError", "device='cuda:x'"),
    ('device_map={"": "cuda:3"} without CUDA', lambda i: loading.load_model("tiny", quant="bf16", device="cpu", device_map={"": "cuda:3"}),
     "CudaUnavailableError", "device_map"),
    ("device_map value tpu",
     lambda i: loading.load_model("tiny", quant="bf16", device="cpu", device_map={"model": "tpu", "lm_head": "cpu"}),
     "InvalidChoiceError", "device_map"),
    ('device_map="auto"', lambda i: loading.load_model("tiny", quant="bf16", device="cpu", device_map="auto"),
     "InvalidChoiceError", "dict"),
    ('offload_ple(model, "cuda") without CUDA', lambda i: placement.offload_ple(i.model, "cuda"), "CudaUnavailableError", "device='cpu'"),
    ('prefill_peak on the CPU', lambda i: measure.prefill_peak(i.model, loading.load_tokenizer("tiny"), 16, "cpu"),
     "InvalidChoiceError", "not a GPU"),
    ('prefill_peak on GPU 0 without CUDA', lambda i: measure.prefill_peak(i.model, loading.load_tokenizer("tiny"), 16, 0),
     "CudaUnavailableError", "no CUDA GPU"),
    ('snapshot_prefill on the CPU',
     lambda i: measure.snapshot_prefill(i.model, loading.load_tokenizer("tiny"), 16, i.root / "s.pickle", "cpu"),
     "InvalidChoiceError", "not a GPU"),
    *[(f"fits_context with decode_tokens {value!r}",
       lambda i, value=value: measure.fits_context(i.model, loading.load_tokenizer("tiny"), 16, "cuda", value),
       "InvalidChoiceError", "decode_tokens=") for value in (0, -1, 1.5, "8", True)],
    *[(f"placeholders_emitted with boost {value!r}",
       lambda i, value=value: measure.placeholders_emitted(i.model, list, boost=value).__enter__(), "InvalidChoiceError", "boost=")
      for value in (0.5, -1, "2", True, float("nan"))],
    ('offload_ple(model, "tpu")', lambda i: placement.offload_ple(i.model, "tpu"), "InvalidChoiceError", "device='tpu'"),
    ("offload_ple of a string", lambda i: placement.offload_ple("model"), "InvalidChoiceError", "load_model"),
    ("report of None", lambda i: placement.report(None), "InvalidChoiceError", "load_model"),
    ("module tree of a string", lambda i: anatomy.tree("model"), "InvalidChoiceError", "load_model"),
    ("module tree of negative depth", lambda i: anatomy.tree(i.meta, max_depth=-1), "InvalidChoiceError", "max_depth"),
    # other loader arguments
    ("weight bytes of an unknown quant", lambda i: weights.weight_bytes(i.meta, "q4"), "InvalidChoiceError", "choose one of"),
    ("weight bytes of an unknown placement", lambda i: weights.weight_bytes(i.meta, "nf4", "disk"), "InvalidChoiceError", "choose one of"),
    ('double_quant="yes"', lambda i: loading.load_model("tiny", device="cpu", double_quant="yes"), "InvalidChoiceError", "True or False"),
    ('check_memory="no"', lambda i: loading.load_model("tiny", device="cpu", check_memory="no"), "InvalidChoiceError", "True or False"),
    # weights on disk
    ("truncated safetensors", lambda i: loading.load_model(i.with_weights("cut-weights", truncated), quant="bf16", device="cpu"),
     "CorruptCheckpointError", "truncated or corrupt"),
    ("garbled safetensors header", lambda i: loading.load_model(i.with_weights("garbled", garbled_header), quant="bf16", device="cpu"),
     "CorruptCheckpointError", "truncated or corrupt"),
    ("empty safetensors", lambda i: loading.load_model(i.with_weights("empty", lambda data: b""), quant="bf16", device="cpu"),
     "CorruptCheckpointError", "truncated or corrupt"),
    # the cache
    ("GEMMA_COURSE_CACHE pointing at a file",
     lambda i: in_environment("GEMMA_COURSE_CACHE", str(i.a_file()), lambda: models.resolve("tiny")),
     "CourseError", "GEMMA_COURSE_CACHE"),
    ("GEMMA_COURSE_CACHE unwritable", lambda i: in_environment("GEMMA_COURSE_CACHE", UNWRITABLE, lambda: models.resolve("tiny")),
     "CourseError", "cannot write"),
    ("synthetic build into an unwritable folder", lambda i: synthetic.build("tiny", Path(UNWRITABLE) / "tiny"),
     "CourseError", "cannot write"),
    # downloads and the mirror
    ("download of a hub id with a newline", lambda i: download.download(REPO + "\n", i.root / "dl"),
     "ModelNotFoundError", "not a valid hub id"),
    ("download of an escaping id", lambda i: download.download("../../escape/x", i.root / "dl"),
     "ModelNotFoundError", "not a valid hub id"),
    ("download with zero attempts", lambda i: download.download(REPO, i.root / "dl", max_attempts=0), "InvalidChoiceError", "max_attempts"),
    ("download with a wait that is no number", lambda i: download.download(REPO, i.root / "dl", max_wait_s=float("nan")),
     "InvalidChoiceError", "max_wait_s"),
    ("download with an endless first wait", lambda i: download.download(REPO, i.root / "dl", first_wait_s=float("inf")),
     "InvalidChoiceError", "first_wait_s"),
    ("download into a file", lambda i: download.download(REPO, i.a_file()), "InvalidChoiceError", "is a file"),
    ("mirror endpoint without a scheme", lambda i: download.use_mirror("127.0.0.1:8090"), "InvalidChoiceError", "http://"),
    ("empty mirror endpoint", lambda i: download.use_mirror(""), "InvalidChoiceError", "http://"),
    ("verify a folder that does not exist", lambda i: download.verify(REPO, i.root / "never-downloaded"), "ModelNotFoundError", "download"),
    ("mirror repo id escaping its root", lambda i: mirror.prepare_repository(i.tiny, i.root / "mirrors", "../../../escape/x"),
     "MirrorError", "not a valid repo id"),
    ("mirror repo id with a newline", lambda i: mirror.Mirror(i.tiny, REPO + "\n", workdir=i.root / "m"),
     "MirrorError", "not a valid repo id"),
    ("mirror on every interface without classroom mode", lambda i: mirror.Mirror(i.tiny, REPO, host="0.0.0.0", workdir=i.root / "m"),
     "MirrorError", "classroom"),
    ("mirror port out of range", lambda i: mirror.Mirror(i.tiny, REPO, port=70000, workdir=i.root / "m"), "MirrorError", "port"),
    ("mirror of a folder without a model", lambda i: mirror.Mirror(i.root, REPO, workdir=i.root / "m"), "MirrorError", "config.json"),
    ("fault plan with an unknown kind", lambda i: faults.FaultyProxy("http://127.0.0.1:9", ["explode"]),
     "InvalidChoiceError", "choose one of"),
    ("fault proxy upstream without a scheme", lambda i: faults.FaultyProxy("127.0.0.1:9"), "InvalidChoiceError", "http://"),
]
CASES += [
    # long prompts
    *[(f"cache_growth with chunk {chunk}", lambda i, chunk=chunk: long_context.cache_growth(i.model, [i.prompt()], chunk=chunk),
       "InvalidChoiceError", "pass a whole number of tokens") for chunk in (0, -1, 1.5)],
    ("cache_growth of one tensor, not a list", lambda i: long_context.cache_growth(i.model, i.prompt()),
     "InvalidChoiceError", "non-empty list"),
    ("cache_growth of no prompts", lambda i: long_context.cache_growth(i.model, []), "InvalidChoiceError", "non-empty list"),
    ("cache_growth of an unknown cache", lambda i: long_context.cache_growth(i.model, [i.prompt()], "paged"),
     "InvalidChoiceError", "choose one of"),
    ("cache_growth past the model's positions", lambda i: long_context.cache_growth(i.model, [i.past_the_window()]),
     "InvalidChoiceError", "max_position_embeddings"),
    ("plain generate past the model's positions", lambda i: long_context.LongContext.plain(8).generate(i.model, i.past_the_window(), 1),
     "InvalidChoiceError", "max_position_embeddings"),
    ("tuned generate of a list of ids", lambda i: long_context.LongContext(chunk=8).generate(i.model, [1, 2, 3], 1),
     "InvalidChoiceError", "(1, n) integer tensor"),
    ("tuned generate of a batch of 2", lambda i: long_context.LongContext(chunk=8).generate(i.model, torch.ones(2, 4, dtype=torch.long), 1),
     "InvalidChoiceError", "pass one prompt"),
    ("tuned generate of an id past the vocabulary",
     lambda i: long_context.LongContext(chunk=8).generate(i.model, torch.tensor([[10**6]]), 1),
     "InvalidChoiceError", "own tokenizer"),
    ("tuned generate of no new tokens", lambda i: long_context.LongContext(chunk=8).generate(i.model, i.prompt(), 0),
     "InvalidChoiceError", "new_tokens=0"),
    ('tuned generate keep_logits="no"', lambda i: long_context.LongContext(chunk=8).generate(i.model, i.prompt(), 1, keep_logits="no"),
     "InvalidChoiceError", "True or False"),
    ("prefill logits through a string cache", lambda i: long_context.LongContext(chunk=8).prefill_logits(i.model, i.prompt(), "static"),
     "InvalidChoiceError", "new_cache"),
    ("LongContext of chunk 0", lambda i: long_context.LongContext(chunk=0), "InvalidChoiceError", "chunk=0"),
    ('LongContext grouped_attention="no"', lambda i: long_context.LongContext(grouped_attention="no"), "InvalidChoiceError",
     "True or False"),
    ("attention calls with chunk 0", lambda i: long_context.attention_calls(i.model, i.prompt(), 0), "InvalidChoiceError", "chunk=0"),
    ("attention calls with a dict for settings", lambda i: long_context.attention_calls(i.model, i.prompt(), 8, {"chunk": 8}),
     "InvalidChoiceError", "LongContext"),
    ('use_attention(m, "bogus")', lambda i: long_context.use_attention(i.model, "bogus"), "InvalidChoiceError", "choose one of"),
    ("use_attention of a string model", lambda i: long_context.use_attention("model", "sdpa"), "InvalidChoiceError", "load_model"),
    ("generated cache of kind None", lambda i: long_context.generated_cache(i.model, i.prompt(), None, 8), "InvalidChoiceError",
     "choose one of"),
    ("footprint of a string", lambda i: long_context.footprint("cache", i.model.config.get_text_config()), "InvalidChoiceError",
     "new_cache"),
    ("narrow a window by 0", lambda i: long_context.narrow_window(long_context.new_cache(i.model, "dynamic"), 0),
     "InvalidChoiceError", "by=0"),
    ("bytes by layer type of a dict", lambda i: long_context.bytes_by_layer_type({"a": 1}), "InvalidChoiceError", "LayerFootprint"),
    ("logits agree at a NaN tolerance", lambda i: long_context.logits_agree(torch.ones(3), torch.ones(3), float("nan")),
     "InvalidChoiceError", "atol=nan"),
    ("logits agree of lists", lambda i: long_context.logits_agree([1.0], [1.0]), "InvalidChoiceError", "tensor of logits"),
    ("register attention under no name", lambda i: long_context.register_grouped_sdpa(""), "InvalidChoiceError", "non-empty name"),
    # GGUF files
    *[(f"gguf {reader} of a {kind} file", lambda i, call=call, kind=kind: call(i.gguf(kind)), error, phrase)
      for reader, call in (("metadata", gguf_route.metadata), ("tensor", gguf_route.tensor), ("load", gguf_route.load))
      for kind, error, phrase in (("missing", "ModelNotFoundError", "does not exist"), ("empty", "CorruptCheckpointError", "is empty"),
                                  ("not-gguf", "CorruptCheckpointError", "not a GGUF file"),
                                  ("truncated", "CorruptCheckpointError", "cut short"))],
    ("gguf metadata of a folder", lambda i: gguf_route.metadata(i.root), "ModelNotFoundError", "is a folder"),
    ("gguf metadata of a number", lambda i: gguf_route.metadata(5), "InvalidChoiceError", "file path"),
    ("gguf tensor named by a number", lambda i: gguf_route.tensor(i.gguf("missing"), 3), "InvalidChoiceError", "tensor name"),
    ("gguf load with n_ctx 0", lambda i: gguf_route.load(i.gguf("missing"), n_ctx=0), "InvalidChoiceError", "n_ctx=0"),
    ("gguf load with half a thread", lambda i: gguf_route.load(i.gguf("missing"), threads=0.5), "InvalidChoiceError", "threads=0.5"),
    ("gguf generate of a string llm", lambda i: gguf_route.generate("llm", [1, 2]), "InvalidChoiceError", "gguf_route.load"),
    *[(f"gguf measure with new_tokens {value!r}", lambda i, value=value: gguf_route.measure(i.gguf("missing"), [1, 2], value),
       "InvalidChoiceError", "new_tokens=") for value in (0, -1, "8", True, 1.5)],
    ("gguf measure of a prompt that is a number", lambda i: gguf_route.measure(i.gguf("missing"), 7), "InvalidChoiceError",
     "list of ints"),
    ("gguf logits of a string llm", lambda i: gguf_route.logits("llm", []), "InvalidChoiceError", "gguf_route.load"),
    # fine-tuning
    *[(f"add_adapters with seed {seed!r}", lambda i, seed=seed: fine_tuning.add_adapters(i.model, seed=seed),
       "InvalidChoiceError", "seed=") for seed in (1.5, -1, "0")],
    *[(f"optimizer_for with learning_rate {rate!r}", lambda i, rate=rate: fine_tuning.optimizer_for(i.model, rate),
       "InvalidChoiceError", "small positive number") for rate in ("abc", "1e-3", True, -1e-3, float("inf"))],
    *[(f"adapter_parameters with rank {rank!r}", lambda i, rank=rank: fine_tuning.adapter_parameters(i.model, rank),
       "InvalidChoiceError", "rank=") for rank in (0, -1, 1.5, "8", True, float("nan"))],
    # sizes, counts and devices of the planner's and the cards' building blocks
    *[(f"{name} {value!r}", lambda i, call=call, value=value: call(value), "InvalidChoiceError", phrase)
      for name, call, phrase in (
          ("cards.size_label of", cards.size_label, "number above zero"),
          ("cards.describe on device", cards.describe, "not a GPU"),
          ("kv_cache_bytes at context", lambda v: planner.kv_cache_bytes("tiny", v), "whole number of tokens"),
          ("kv_cache_bytes with bytes_per_value", lambda v: planner.kv_cache_bytes("tiny", 64, v), "whole number of bytes"),
          ("chunked_prefill_terms with chunk", lambda v: planner.chunked_prefill_terms("tiny", 256, v), "whole number of tokens"),
          ("logits_bytes of positions", lambda v: planner.logits_bytes("tiny", v), "whole number"),
          ("decode_bytes_per_token at context", lambda v: planner.decode_bytes_per_token("tiny", context=v), "whole number"),
          ("largest_true with resolution", lambda v: planner.largest_true(0, 100, bool, v), "whole number"),
          ("human_bytes of", placement.human_bytes, "finite number"),
          ("bf16_is_native of compute capability", environment.bf16_is_native, "whole number"),
          ("exercises.within with tolerance", lambda v: exercises.within(1.0, 1.0, v), "finite number"),
          ("gguf_route.rate over seconds", lambda v: gguf_route.rate(10, v), "finite number"),
          ("pattern_batch with seed", lambda v: fine_tuning.pattern_batch(synthetic.gemma4_config("tiny"), 8, seed=v),
           "whole number"))
      for value in (-1, "8", True, float("nan"))],
    *[(f"exact_normal with {name} {value!r}", lambda i, name=name, value=value: synthetic.exact_normal("k", 4, **{name: value}),
       "InvalidChoiceError", f"{name}=") for name in ("mean", "std") for value in ("8", True, float("nan"), float("inf"))],
    ("exact_normal with a negative std", lambda i: synthetic.exact_normal("k", 4, std=-1.0), "InvalidChoiceError", "std=-1.0"),
    *[(f"write_weights with seed {value!r}",
       lambda i, value=value: synthetic.write_weights(synthetic.gemma4_config("tiny"), i.root / "w", seed=value, progress=False),
       "InvalidChoiceError", "seed=") for value in (-1, 1.5, "0", True)],
    # the identity checks' own tools: a prompt length, a step count, the control's row
    *[(f"{name} {value!r}", lambda i, call=call, value=value: call(i, value), "InvalidChoiceError", phrase)
      for name, call, phrase in (
          ("prompt_ids of length", lambda i, v: measure.prompt_ids(loading.load_tokenizer("tiny"), v, "cpu"),
           "whole number of tokens"),
          ("compare_logits over steps", lambda i, v: measure.compare_logits(torch.zeros(2, 3), torch.zeros(2, 3), v),
           "whole number"),
          ("compare_rounding over steps", lambda i, v: measure.compare_rounding(torch.zeros(2, 3), torch.zeros(2, 3), v),
           "whole number"),
          ("ple_row_nudged at token", lambda i, v: measure.ple_row_nudged(i.model, v).__enter__(), "token_id="))
      for value in (-1, "8", True, float("nan"))],
    ("ple_row_nudged past the table", lambda i: measure.ple_row_nudged(i.model, 10**9).__enter__(), "InvalidChoiceError",
     "the last row of the PLE table"),
    ("gguf quantize with half a thread", lambda i: gguf_route.quantize(i.gguf("missing"), i.root / "q.gguf", threads=0.5),
     "InvalidChoiceError", "threads=0.5"),
    ("largest_true with a predicate that is no function", lambda i: planner.largest_true(0, 100, 5), "InvalidChoiceError",
     "not a function"),
    ("CARD_GB=True", lambda i: cards.simulate(True), "SimulatedCardError", "number of gigabytes"),
    # the tuned decode's parts, and the mirror's front and start
    *[(f"pinned_sliding_counters advancing by {value!r}",
       lambda i, value=value: decoding.pinned_sliding_counters(long_context.new_cache(i.model, "static", 16), value).__enter__(),
       "InvalidChoiceError", "new_tokens=") for value in (-1, 1.5, True, "1")],
    ("pinned_sliding_counters of no cache", lambda i: decoding.pinned_sliding_counters(None).__enter__(),
     "InvalidChoiceError", "new_cache"),
    *[(f"loop_host_reads over {value!r} tokens",
       lambda i, value=value: decoding.loop_host_reads(i.model, i.prompt(), decoding.Decoder(compile=None), value),
       "InvalidChoiceError", "new_tokens=") for value in (0, -1, 1.5, True, "3")],
    ("mirror front serving before it holds a port",
     lambda i: mirror.Front(mirror.LOOPBACK, mirror.free_port(), {REPO}).serve(8091), "MirrorError", "bind()"),
    *[(f"mirror front relaying to port {value!r}", lambda i, value=value: bound_front_serving(value), "MirrorError",
       "upstream_port=") for value in (0, 70000, True, "8091")],
    *[(f"mirror start with timeout {value!r}",
       lambda i, value=value: mirror.Mirror(i.tiny, REPO, workdir=i.root / "m").start(value), "InvalidChoiceError",
       "timeout=") for value in (0, -1, "60", float("nan"))],
    # exercises
    ("exercise check with a misspelt context", lambda i: exercises.check("00.1", "x", sorce="tiny"), "InvalidChoiceError",
     "source=MODEL_NAME"),
]
# numbers no check of their own covered, found by the drift test below (every number parameter reaches a check)
CASES += [
    *[(f"greedy of {value!r} new tokens", lambda i, value=value: measure.greedy(i.model, loading.load_tokenizer("tiny"), value),
       "InvalidChoiceError", "new_tokens=") for value in ("8", 1.5, 0, True, None, float("nan"))],
    *[(f"LoRA dropout {value!r}", lambda i, value=value: fine_tuning.lora_config(dropout=value), "InvalidChoiceError",
       "dropout=") for value in ("0.1", -0.1, 1.0, float("nan"), True)],
    *[(f"fault proxy dropping after {value!r} bytes", lambda i, value=value: faults.FaultyProxy("http://127.0.0.1:9",
       drop_after_bytes=value), "InvalidChoiceError", "drop_after_bytes=") for value in (-1, "64k", 1.5)],
    *[(f"fault proxy stalling {value!r} s", lambda i, value=value: faults.FaultyProxy("http://127.0.0.1:9", stall_s=value),
       "InvalidChoiceError", "stall_s=") for value in (-1, float("inf"), "3")],
    ("fault proxy on port '8090'", lambda i: faults.FaultyProxy("http://127.0.0.1:9", port="8090"), "MirrorError", "port="),
    *[(f"host sampler every {value!r} s", lambda i, value=value: host_memory.PeakSampler(value), "InvalidChoiceError",
       "interval_s=") for value in (0, float("nan"), "0.02")],
    ("mirror front on port '8090'", lambda i: mirror.Front(mirror.LOOPBACK, "8090", {REPO}), "MirrorError", "port="),
    ("mirror repository with a negative LFS threshold",
     lambda i: mirror.prepare_repository(i.tiny, i.root / "mirrors", REPO, lfs_threshold=-1), "InvalidChoiceError",
     "lfs_threshold="),
    ("byte range of a file whose size is text", lambda i: mirror.byte_range("bytes=0-3", "100"), "InvalidChoiceError", "size="),
    *[(f"training on sequences of {value!r}", lambda i, value=value: planner.training_fits("tiny", 8, sequence=value),
       "InvalidChoiceError", "sequence=") for value in (0, "512", 1.5)],
    ("random stream of seed True", lambda i: synthetic.tensor_key(True, "x"), "InvalidChoiceError", "seed="),
    ("nearest names, none asked", lambda i: placement.nearest_names("x", ["a"], 0), "InvalidChoiceError", "n="),
    ("profile range of -1 forwards", lambda i: decoding.decode_range(-1), "InvalidChoiceError", "forwards="),
    ("card table of a list of records", lambda i: planner.decode_on_cards([{"decode_tokens_per_s": 1.0}]),
     "InvalidChoiceError", "steps="),
    ("sampled busy share of a table row", lambda i: records.sampled_busy(("cudagraphs", "68.3")), "InvalidChoiceError",
     "record="),
]


# the records' readers and the planner's string choices: a typo read as "not measured yet", or a bare KeyError
CASES += [
    *[(f"records.{name} of model {value!r}", lambda i, call=call, value=value: call(value), "InvalidChoiceError", "model=")
      for name, call in [("decode_speeds", lambda v: records.decode_speeds(model=v)),
                         ("largest_contexts", lambda v: records.largest_contexts(model=v)),
                         ("long_context_goal", lambda v: records.long_context_goal(model=v)),
                         ("preset_records", lambda v: records.preset_records("decode-speed", model=v))]
      for value in ("e4b", 5)],
    ("records.decode_speed of quant 'NF4'", lambda i: records.decode_speed("ple-cpu", quant="NF4"), "InvalidChoiceError",
     "quant="),
    ("records.preset_records of preset None", lambda i: records.preset_records(None), "InvalidChoiceError", "preset="),
    ("records.decode_rates_over_runs of preset ''", lambda i: records.decode_rates_over_runs(""), "InvalidChoiceError",
     "preset="),
    *[(f"records.{name} of a model never run on a GPU", lambda i, call=call: call(), "NoRecordError", "run")
      for name, call in [("gpu_tier", lambda: records.gpu_tier("e4b")), ("training_peaks", lambda: records.training_peaks("e4b")),
                         ("gguf_route", lambda: records.gguf_route("e4b")),
                         ("speed_record", lambda: records.speed_record(route="ple-everywhere"))]],
    ("accelerate's estimate for quant 'NF4'", lambda i: planner.accelerate_estimate("tiny", "NF4"), "InvalidChoiceError",
     "quant="),
    ("KV cache of a cache kind 'bogus'", lambda i: planner.kv_cache_bytes("tiny", 8, cache="bogus"), "InvalidChoiceError",
     "cache="),
    ("bitsandbytes asked for quant 'NF4'", lambda i: loading.require_bitsandbytes("NF4"), "InvalidChoiceError", "quant="),
    ("a load's verdict for ple 'disk'", lambda i: loading.load_verdict(None, torch.device("cpu"), "nf4", "disk"),
     "InvalidChoiceError", "ple="),
    ("a load's verdict for towers 'CPU'",
     lambda i: loading.load_verdict(None, torch.device("cpu"), "nf4", "cpu", towers="CPU"), "InvalidChoiceError", "towers="),
    ("a load's verdict for head 'NF4'",
     lambda i: loading.load_verdict(None, torch.device("cpu"), "nf4", "cpu", head="NF4"), "InvalidChoiceError", "head="),
    ("the course's device map with ple 'CPU'", lambda i: loading.course_device_map(i.meta, "cpu", "CPU"),
     "InvalidChoiceError", "ple="),
    ("the course's device map with towers 'off'", lambda i: loading.course_device_map(i.meta, "cpu", "cpu", towers="off"),
     "InvalidChoiceError", "towers="),
    ("an output head in 'fp8'", lambda i: placement.output_head(torch.zeros(4, 8), "fp8", torch.device("cpu")),
     "InvalidChoiceError", "head="),
]

# paths that are missing, or a folder where a file is read (or the other way round)
CASES += [
    ("planner calibration that is not there", lambda i: planner.load_calibration(i.root / "no-calibration.json"),
     "NoRecordError", "calibrate"),
    ("record JSON that is a folder", lambda i: records.read_json(i.root), "NoRecordError", "a folder"),
    ("record lines of a missing file", lambda i: records.record_lines(i.root / "none.jsonl"), "NoRecordError", "nothing"),
    ("records folder that is a file", lambda i: records.latest_records(i.a_file()), "NoRecordError", "folder of records"),
    ("cited speeds from a missing folder", lambda i: records.cited_decode_speeds(i.root / "no-folder"), "NoRecordError",
     "decode-speeds.json"),
    ("checkpoint folder without weights", lambda i: models.check_weight_files(i.root), "CorruptCheckpointError",
     ".safetensors"),
    ("adapter size of a folder never saved", lambda i: fine_tuning.adapter_bytes(i.root / "no-adapter"), "ModelNotFoundError",
     "save_adapter"),
    ("adapter loaded from a folder never saved", lambda i: fine_tuning.load_beside(i.model, i.root / "no-adapter"),
     "ModelNotFoundError", "save_adapter"),
    ("trace that profile never wrote", lambda i: decoding.trace_events(i.root / "no-trace.json"), "NoRecordError",
     "profile"),
]


def bound_front_serving(upstream_port):
    """A front that holds its port, asked to relay to ``upstream_port``; the port is given back either way."""
    front = mirror.Front(mirror.LOOPBACK, mirror.free_port(), {REPO})
    front.bind()
    try:
        front.serve(upstream_port)
    finally:
        front.close()


# rows that need the optional llama.cpp packages (gguf writes the truncated file, llama-cpp-python loads)
LLAMA_CPP_ROWS = {case[0] for case in CASES if "truncated file" in case[0] or case[0].startswith("gguf load of a")}
CUDA_ONLY_ROWS = {'device_map={"": "cuda:3"} without CUDA', 'offload_ple(model, "cuda") without CUDA',
                  "prefill_peak on GPU 0 without CUDA"}


def error_class(name: str):
    """Course errors live in errors.py or beside the module that owns them (download, mirror)."""
    for module in (errors, download, mirror):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def answer(case, inputs: Inputs) -> tuple:
    """How a row was answered: ("clear", message) when it is the expected CourseError sentence, else
    ("wrong class" | "no phrase" | "several lines" | "bare exception" | "silent", detail)."""
    what, call, class_name, phrase = case
    try:
        returned = call(inputs)
    except errors.CourseError as err:
        message = str(err)
        if not isinstance(err, error_class(class_name)):
            return "wrong class", f"{type(err).__name__}: {message}"
        if phrase not in message:
            return "no phrase", message
        if "\n" in message.strip():
            return "several lines", message
        return "clear", message
    except Exception as err:  # noqa: BLE001 - exactly what the census counts
        return "bare exception", f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    if isinstance(returned, mirror.Mirror):
        returned.stop()
    return "silent", repr(returned)[:120]


@pytest.fixture(scope="module")
def inputs(tiny_path, tmp_path_factory):
    return Inputs(tmp_path_factory.mktemp("bad-inputs"), tiny_path)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_gets_one_course_error_sentence_that_names_the_fix(case, inputs):
    if case[0] in CUDA_ONLY_ROWS and not NO_CUDA:
        pytest.skip("this machine has CUDA")
    if case[0] in LLAMA_CPP_ROWS and not gguf_route.installed():
        pytest.skip("llama-cpp-python and gguf are not installed (make llama-cpp)")
    outcome, detail = answer(case, inputs)
    assert outcome == "clear", f"{case[0]}: {outcome}: {detail}"


def test_the_battery_covers_every_case_the_issue_lists():
    rows = " | ".join(case[0] for case in CASES)
    for listed in ("keep_bf16 as a string", "negative context", "fractional context", "context past",
                   "truncated config.json", "config.json holding a list", "trailing newline", "hub id with ..", "resolve(5)",
                   'resolve("")', 'device="tpu"', 'device="mps"', "device=-1", "device=True", 'device_map={"": "cuda:3"}',
                   "truncated safetensors", "garbled safetensors", "GEMMA_COURSE_CACHE pointing at a file",
                   "GEMMA_COURSE_CACHE unwritable", 'offload_ple(model, "cuda")'):
        assert listed in rows, listed


def test_the_census_tells_a_clear_answer_from_a_bare_exception_and_a_silent_result(inputs):
    # the control: the classifier must be able to report each failure it counts
    assert answer(("", lambda i: {}["missing"], "CourseError", ""), inputs)[0] == "bare exception"
    assert answer(("", lambda i: 42, "CourseError", ""), inputs)[0] == "silent"
    assert answer(("", lambda i: planner.predict("tiny", "q4"), "InvalidChoiceError", "no such words"), inputs)[0] == "no phrase"
    assert answer(("", lambda i: planner.predict("tiny", "q4"), "InvalidChoiceError", "choose one of"), inputs)[0] == "clear"


# Good inputs beside the bad: the validators must not refuse what the course teaches.
ACCEPTED = [
    ("keep_bf16 as a list", lambda i: planner.predict("tiny", context=512, keep_bf16=["lm_head"]).resident_bytes),
    ("keep_bf16 as a tuple", lambda i: quantization.quantization_config("nf4", keep_bf16=("model.vision_tower",)).llm_int8_skip_modules),
    ("context at the model's window", lambda i: planner.predict("tiny", context=synthetic.gemma4_config("tiny").get_text_config()
                                                                  .max_position_embeddings).peak_bytes),
    ("a numpy integer context", lambda i: planner.predict("tiny", context=__import__("numpy").int64(512)).peak_bytes),
    ("a card of 7.5 GB", lambda i: planner.fits("tiny", 7.5, context=512).loads),
    ("a folder as a Path", lambda i: models.resolve(i.tiny)),
    ('device="cpu"', lambda i: placement.require_device("cpu")),
    ("a torch.device", lambda i: placement.require_device(torch.device("cpu"))),
    ("a device map of cpu entries", lambda i: loading.load_model("tiny", quant="bf16", device="cpu",
                                                                 device_map={"model": "cpu", "lm_head": "cpu"})),
    ("offload_ple onto the cpu", lambda i: placement.offload_ple(i.model, "cpu")),
    ("a card size, a zero size and a numpy count", lambda i: [cards.size_label(8), placement.human_bytes(0),
                                                              planner.kv_cache_bytes("tiny", __import__("numpy").int64(64))]),
    ("a compute capability of 7.5 and a tolerance of 0", lambda i: [environment.bf16_is_native(7, 5),
                                                                   exercises.within(1.0, 1.0, 0)]),
    ("a learning rate of 2e-4 and a numpy one", lambda i: [fine_tuning.optimizer_for(i.model, rate)
                                                         for rate in (2e-4, __import__("numpy").float32(1e-3))]),
]


@pytest.mark.parametrize("call", [row[1] for row in ACCEPTED], ids=[row[0] for row in ACCEPTED])
def test_a_good_input_beside_each_bad_one_is_accepted(call, inputs):
    assert call(inputs) is not None


def test_keep_bf16_as_a_list_changes_the_prediction_and_the_loaded_model_alike(inputs):
    import bitsandbytes as bnb

    plain = planner.predict("tiny", "nf4", "gpu", 512).resident_bytes
    kept = planner.predict("tiny", "nf4", "gpu", 512, keep_bf16=["model.vision_tower"]).resident_bytes
    assert kept > plain
    model = loading.load_model("tiny", quant="nf4", ple="gpu", device="cpu", keep_bf16=["model.vision_tower"])
    kept_linears = [name for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and not isinstance(module, bnb.nn.Linear4bit)]
    assert kept_linears and all(name.startswith("model.vision_tower") or name == "lm_head" for name in kept_linears)


CLI_CASES = [
    (["predict", "tiny", "--context", "-5"], "context=-5 is not supported; pass a whole number of tokens"),
    (["predict", "tiny", "--context", "0"], "context=0 is not supported"),
    (["predict", "tiny", "--context", str(TINY_WINDOW + 1)], f"at most {TINY_WINDOW:,} (the model's max_position_embeddings)"),
    (["predict", "tiny", "--context", "512", "--quant", "q4"], "choose one of"),
    (["predict", "", "--context", "512"], "empty"),
]


@pytest.mark.parametrize("argv,phrase", CLI_CASES, ids=[" ".join(argv) for argv, _ in CLI_CASES])
def test_the_planner_cli_answers_a_bad_input_with_the_sentence_and_exit_code_2(argv, phrase, capsys):
    assert planner.main(argv) == 2
    captured = capsys.readouterr()
    assert phrase in captured.err and "Traceback" not in captured.err and "fits" not in captured.out


def test_the_planner_cli_refuses_a_fractional_context_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as stopped:
        planner.main(["predict", "tiny", "--context", "8500.5"])
    assert stopped.value.code == 2 and "--context: invalid int value" in capsys.readouterr().err


def test_the_planner_cli_still_answers_a_good_input(capsys):
    # the control beside the refusals
    assert planner.main(["predict", "tiny", "--context", "512"]) == 0
    assert "512-token prefill" in capsys.readouterr().out


# every command line of helpers (python -m helpers.<module> ...), each with bad input: (what, module, argv, phrase)
CLI_ROWS = [
    ("chat probe --model nope", "chat", lambda i: ["probe", "--model", "nope"], "No folder 'nope'"),
    ("chat with an unknown command", "chat", lambda i: ["prob"], "invalid choice"),
    ("course with no command", "course", lambda i: [], "arguments are required"),
    ("course colab --bogus", "course", lambda i: ["colab", "--bogus"], "unrecognized arguments"),
    ("course lab --port -1", "course", lambda i: ["lab", "--port", "-1", "--no-browser"], "port=-1 is not supported"),
    ("course lab --port 99999", "course", lambda i: ["lab", "--port", "99999", "--no-browser"], "is too large"),
    ("environment --bogus", "environment", lambda i: ["--bogus"], "unrecognized arguments"),
    ("environment --model nope", "environment", lambda i: ["--model", "nope"], "no such folder, hub id or synthetic name"),
    ("environment --model an empty string", "environment", lambda i: ["--model", ""], "is empty"),
    ("environment --model a folder without config.json", "environment", lambda i: ["--model", str(i.root)],
     "a folder without config.json"),
    ("gguf_route measure nope", "gguf_route", lambda i: ["measure", "nope"], "No folder 'nope'"),
    ("gguf_route measure --prompt-tokens 0", "gguf_route", lambda i: ["measure", "tiny", "--prompt-tokens", "0"],
     "--prompt-tokens=0 is not supported"),
    ("gguf_route measure --new-tokens -3", "gguf_route", lambda i: ["measure", "tiny", "--new-tokens", "-3"],
     "--new-tokens=-3 is not supported"),
    ("gguf_route measure --work a file", "gguf_route", lambda i: ["measure", "tiny", "--work", str(i.a_file())], "is a file"),
    ("gguf_route with an unknown command", "gguf_route", lambda i: ["measur", "tiny"], "invalid choice"),
    ("mirror serve a missing folder", "mirror", lambda i: ["serve", str(i.root / "missing")], "has no config.json"),
    ("mirror serve --port 70000", "mirror", lambda i: ["serve", str(i.tiny), "--port", "70000"], "is not a TCP port"),
    ("mirror serve --host 0.0.0.0 without --classroom", "mirror", lambda i: ["serve", str(i.tiny), "--host", "0.0.0.0"],
     "would expose the mirror"),
    ("mirror serve --classroom --host an address this machine lacks", "mirror",
     lambda i: ["serve", str(i.tiny), "--classroom", "--host", "192.0.2.1"], "no such address"),
    ("planner predict nope", "planner", lambda i: ["predict", "nope"], "No folder 'nope'"),
    ("planner predict --context -5", "planner", lambda i: ["predict", "tiny", "--context", "-5"], "context=-5 is not supported"),
    ("planner predict --quant q4", "planner", lambda i: ["predict", "tiny", "--quant", "q4"], "choose one of"),
    ("synthetic tiny --workers 0", "synthetic", lambda i: ["tiny", "--workers", "0"], "workers=0 is not supported"),
    ("synthetic with an unknown shape", "synthetic", lambda i: ["huge"], "invalid choice"),
]


def cli_answer(row, inputs: Inputs) -> tuple:
    """How a command line answered: ("clear", its last line) when it exits non-zero with the phrase and no
    traceback, else ("bare exception" | "silent" | "no phrase", detail)."""
    what, module, argv, phrase = row
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = importlib.import_module(f"helpers.{module}").main(argv(inputs))
    except SystemExit as stopped:  # argparse's own refusal: usage, then one error line, exit status 2
        code = stopped.code
    except Exception as error:  # noqa: BLE001 - exactly what the census counts
        return "bare exception", f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    said = err.getvalue() + out.getvalue()
    if not code:
        return "silent", said.strip()[-120:]
    if phrase not in said or "Traceback" in said:
        return "no phrase", said.strip()[-200:]
    return "clear", next(line for line in said.splitlines() if phrase in line).strip()


@pytest.mark.parametrize("row", CLI_ROWS, ids=[row[0] for row in CLI_ROWS])
def test_a_command_line_answers_bad_input_with_one_sentence_and_a_failing_exit_status(row, inputs):
    outcome, detail = cli_answer(row, inputs)
    assert outcome == "clear", f"python -m helpers.{row[0]}: {outcome}: {detail}"


def test_every_command_line_of_helpers_is_in_the_battery():
    modules = {path.stem for path in (Path(__file__).parents[1] / "helpers").glob("*.py")
               if "__main__" in path.read_text()}
    assert modules == {row[1] for row in CLI_ROWS}
    good = ("planner predict tiny", "planner", lambda i: ["predict", "tiny", "--context", "512"], "fits")
    assert cli_answer(good, None)[0] == "silent"  # the control: a good input runs, and is told apart


def census_tool():
    return tool("bad_input_census")


def test_the_census_command_reports_no_bare_and_no_silent_answer_in_one_line(tmp_path):
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(root / "tools" / "bad_input_census.py"), "--json", str(tmp_path / "c.json")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=root)
    lines = [line for line in done.stdout.splitlines() if "bad inputs:" in line]
    assert len(lines) == 1, done.stdout + done.stderr
    counts = re.search(r"(\d+) bad inputs: bare (\d+) / silent (\d+) / clear (\d+)", lines[0])
    total, bare, silent, clear = map(int, counts.groups())
    assert (bare, silent) == (0, 0) and clear == total > 100 and done.returncode == 0, done.stdout
    import json

    assert len(json.loads((tmp_path / "c.json").read_text())["rows"]) == total


def test_the_census_line_shows_a_bare_and_a_silent_answer_when_there_are_some():
    # the control: the one line can report what the test above requires to be zero
    from collections import Counter

    line = census_tool().summary(Counter({"bare exception": 2, "silent": 1, "clear": 5, "no phrase": 1}), 9, Path("h"))
    assert "bare 2 / silent 1 / clear 5" in line and "no phrase 1" in line


def unchecked_booleans(source: str, module: str) -> list:
    """``module.function(parameter)`` for each boolean parameter (annotated ``bool`` or defaulting to True/False) of a
    public function or method that neither ``require_bool`` checks nor is handed on as ``name=name``."""
    import ast

    tree = ast.parse(source)
    found = []
    for node in tree.body + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        positional, keywords = node.args.args, node.args.kwonlyargs
        defaults = dict(zip([a.arg for a in positional][len(positional) - len(node.args.defaults):], node.args.defaults))
        defaults.update({a.arg: d for a, d in zip(keywords, node.args.kw_defaults) if d is not None})
        body = ast.unparse(node)
        for arg in positional + keywords:
            default = defaults.get(arg.arg)
            boolean = (arg.annotation is not None and ast.unparse(arg.annotation) in ("bool", "bool | None")) or (
                isinstance(default, ast.Constant) and isinstance(default.value, bool))
            if boolean and f"require_bool({arg.arg}" not in body and f"{arg.arg}={arg.arg}" not in body:
                found.append(f"{module}.{node.name}({arg.arg})")
    return found


def test_no_boolean_parameter_of_helpers_takes_a_truthy_string_for_a_yes():
    """``enable_thinking="no"`` once turned thinking on: every boolean of the public API goes through require_bool (or
    is handed on by name to a function that does). The control: a function that only tests its flag is found."""
    helpers_dir = Path(__file__).resolve().parents[1] / "helpers"
    found = [name for path in sorted(helpers_dir.glob("*.py")) for name in unchecked_booleans(path.read_text(), path.stem)]
    assert found == []
    control = "def f(x, *, flag: bool = True):\n    return x if flag else None\n\ndef g(x, verbose=False):\n    return x\n"
    assert unchecked_booleans(control, "m") == ["m.f(flag)", "m.g(verbose)"]
    handed = "def f(x, *, flag: bool = True):\n    return h(x, flag=flag)\n"
    assert unchecked_booleans(handed, "m") == []


def is_number(annotation: str, default, *_) -> bool:
    """A parameter annotated int or float, or defaulting to one (not a bool)."""
    return annotation in ("int", "float", "int | None", "float | None") or (
        isinstance(default, ast.Constant) and type(default.value) in (int, float))


def choice_annotations(sources: dict) -> set:
    """The names helpers gives its choices: ``Quant = Literal["bf16", ...]`` and the like."""
    return {node.targets[0].id for source in sources.values() for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
            and ast.unparse(node.value.value) == "Literal"}


def compared_with_words(annotation: str, default, function, name: str) -> bool:
    """A text parameter that ``function`` compares with fixed words (``towers == "cpu"``, ``head in ("a", "b")``,
    ``(towers, head) != ("cpu", "nf4")``): a choice in all but its annotation."""
    def is_word(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    def holds_name(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == name) or (
            isinstance(node, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name for e in node.elts))

    def words(node) -> bool:
        return is_word(node) or (isinstance(node, (ast.Tuple, ast.Set, ast.List)) and bool(node.elts)
                                 and all(is_word(e) for e in node.elts))

    if not (annotation in ("str", "str | None") or (isinstance(default, ast.Constant) and isinstance(default.value, str))):
        return False
    return any(isinstance(compare, ast.Compare) and holds_name(compare.left) and any(map(words, compare.comparators))
               for compare in ast.walk(function))


def unchecked_numbers(sources: dict, wanted=is_number) -> list:
    """``module.function(parameter)`` (``module.Class.method`` for a method) for each parameter ``wanted`` picks (by
    default a number) of a public function or method that reaches no ``require_*``/``check_*`` call: neither passes
    it to one nor hands it on (by name or position) to a helpers function, or a dataclass whose ``__post_init__``,
    that does."""
    functions = {}  # callee name -> [(qualified name, FunctionDef, parameter names)]
    owners = {}  # id(method) -> its class's name, for what ``cls(...)`` calls
    for module, source in sources.items():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, []).append((f"{module}.{node.name}", node, positional_names(node)))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        owners[id(item)] = node.name
                        functions.setdefault(item.name, []).append(
                            (f"{module}.{node.name}.{item.name}", item, positional_names(item)[1:]))
                        if item.name == "__post_init__":  # a dataclass: its fields are what the constructor takes
                            fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                                      and isinstance(s.target, ast.Name)]
                            functions.setdefault(node.name, []).append((f"{module}.{node.name}", item, fields))
    memo: dict = {}

    def reaches_check(node, name: str, seen=frozenset()) -> bool:
        key = (id(node), name)
        if key not in memo and key not in seen:
            memo[key] = any(call_checks(call, name, seen | {key}, owners.get(id(node)))
                            for call in ast.walk(node) if isinstance(call, ast.Call))
        return memo.get(key, False)

    def call_checks(call, name: str, seen, owner) -> bool:
        def uses(expr) -> bool:
            return any((isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name
                       and isinstance(n.value, ast.Name) and n.value.id == "self") for n in ast.walk(expr))

        callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        callee = owner if callee == "cls" else callee
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        if re.search(r"(^|_)(require|check)", callee) and any(uses(a) for a in arguments):
            return True
        for _, target, names in functions.get(callee, []):
            handed = [names[i] for i, a in enumerate(call.args) if i < len(names) and uses(a)]
            handed += [keyword.arg for keyword in call.keywords if keyword.arg and uses(keyword.value)]
            if any(reaches_check(target, h, seen) for h in handed):
                return True
        return False

    found = []
    for candidates in functions.values():
        for qualified, node, _ in candidates:
            if node.name.startswith("_") and node.name != "__init__" or qualified.split(".")[-2:-1] == ["_"]:
                continue
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = dict(zip([a.arg for a in positional][len(positional) - len(args.defaults):], args.defaults))
            defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
            for arg in positional + args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                default = defaults.get(arg.arg)
                if wanted(annotation, default, node, arg.arg) and not reaches_check(node, arg.arg):
                    found.append(f"{qualified}({arg.arg})")
    return sorted(set(found))


def positional_names(node) -> list:
    return [a.arg for a in node.args.posonlyargs + node.args.args]


# the checks' own bounds, which the course's code sets: not an argument a learner passes
CHECKS_OWN_BOUNDS = ["errors.require_number(minimum)", "errors.require_whole_number(maximum)",
                     "errors.require_whole_number(minimum)"]


def test_no_number_parameter_of_helpers_reaches_its_work_unchecked():
    """``measure.greedy(new_tokens=True)`` once decoded one token and ``lora_config(dropout="0.1")`` built a config: every
    number of the public API reaches a require_*/check_* call, itself or through what it is handed to, so a new
    function is held to it as it is added. The control: a number used only in arithmetic is found; one handed on by
    position to a function that checks it, or to a dataclass whose __post_init__ does, is not."""
    helpers_dir = Path(__file__).resolve().parents[1] / "helpers"
    assert unchecked_numbers({path.stem: path.read_text() for path in sorted(helpers_dir.glob("*.py"))}) == CHECKS_OWN_BOUNDS
    control = {"m": (
        "def f(model, steps: int = 3):\n    return model * steps\n\n"
        "def g(x, size=8):\n    return h(x, size)\n\n"
        "def h(x, size: int):\n    return require_whole_number(size, 'size') + x\n\n"
        "class Settings:\n    chunk: int\n    def __post_init__(self):\n        require_whole_number(self.chunk, 'chunk')\n"
        "    @classmethod\n    def plain(cls, chunk: int = 4):\n        return cls(chunk)\n")}
    assert unchecked_numbers(control) == ["m.f(steps)"]


def test_no_choice_of_helpers_takes_a_value_outside_its_literal_unchecked():
    """``require_bitsandbytes("NF4")`` passed where only the four quantizations exist: every parameter annotated with
    one of helpers' Literal choices (Quant, Placement) reaches require_choice, itself or through what it is handed
    to. The control: a choice only compared is found."""
    helpers_dir = Path(__file__).resolve().parents[1] / "helpers"
    sources = {path.stem: path.read_text() for path in sorted(helpers_dir.glob("*.py"))}
    choices = choice_annotations(sources)
    assert {"Quant", "Placement"} <= choices
    assert unchecked_numbers(sources, lambda annotation, *_: annotation in choices) == []
    control = {"m": 'Kind = Literal["a", "b"]\n\ndef f(kind: Kind = "a"):\n    return kind == "a"\n\n'
                    'def g(kind: Kind):\n    return require_choice(kind, ("a", "b"), "kind")\n'}
    assert unchecked_numbers(control, lambda annotation, *_: annotation in choice_annotations(control)) == ["m.f(kind)"]


# text compared with fixed words where any text has an answer: a question, not a choice
ANY_TEXT_ANSWERED = ["mirror.is_loopback(host)",  # any host name: loopback or not
                     "mirror.refusal(method)",  # an HTTP method the front does not serve gets its 405 sentence
                     "placement.modules_matched_by(key)"]  # "" is the device map's key for the whole model


def test_no_text_parameter_compared_with_fixed_words_takes_another_word_unchecked():
    """``load_verdict(..., towers="CPU")`` once gave a wrong hint and ``course_device_map(..., ple="CPU")`` kept the PLE
    table on the GPU: a text parameter that is compared with fixed words is a choice, so it reaches require_choice
    like one. The control: a word only compared is found; one checked first is not."""
    helpers_dir = Path(__file__).resolve().parents[1] / "helpers"
    sources = {path.stem: path.read_text() for path in sorted(helpers_dir.glob("*.py"))}
    assert unchecked_numbers(sources, compared_with_words) == ANY_TEXT_ANSWERED
    control = {"m": 'def f(towers: str = "gpu", head="tied"):\n    return (towers, head) != ("cpu", "nf4")\n\n'
                    'def g(ple: str):\n    require_choice(ple, ("gpu", "cpu"), "ple")\n    return ple == "cpu"\n\n'
                    'def h(path: str):\n    return "," in path\n'}
    assert unchecked_numbers(control, compared_with_words) == ["m.f(head)", "m.f(towers)"]


@pytest.mark.parametrize("call", [
    lambda tmp: course.setup(dev="no", venv=tmp / "venv"),
    lambda tmp: course.lab_command("python", browser="no"),
    lambda tmp: course.lab_command("python", as_root=1),
    lambda tmp: course.render_colab_cells(write="no"),
    lambda tmp: download.use_mirror("http://127.0.0.1:9", disable_xet="no"),
    lambda tmp: loading.will_load("tiny", double_quant="no"),
    lambda tmp: planner.predict_host("tiny", offload_after_load="no"),
    lambda tmp: decoding.graph_breaks(None, None, ple_outside="no"),
], ids=["setup dev", "lab browser", "lab as_root", "colab write", "mirror disable_xet", "will_load double_quant",
        "predict_host offload_after_load", "graph_breaks ple_outside"])
def test_a_truthy_string_for_a_boolean_is_refused_before_any_work(call, tmp_path, monkeypatch):
    from helpers.errors import CourseError

    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")  # use_mirror would otherwise change it for the session
    with pytest.raises(CourseError, match="pass True or False"):
        call(tmp_path)
    assert not (tmp_path / "venv").exists()


def test_a_real_boolean_is_still_taken_where_the_strings_are_refused():
    from helpers import course

    assert "--no-browser" in course.lab_command("python", browser=False)
    assert "--no-browser" not in course.lab_command("python", browser=True)


# path parameters of functions that need nothing else: which answers are not silent
PATH_WORDS = ("path", "folder", "directory", "dest", "destination", "model_dir", "home")
# a link to the path; a folder it makes where missing; why a folder cannot be written, found either way
ANSWERS_ABOUT_THE_PATH = {"links.page_url", "paths.writable_folder", "environment.write_problem"}
DIGESTS_OF_FILES_FOUND = {"checksums.sha256", "checksums.git_blob_sha1"}  # the mirror's and verify's, after they list
STARTS_WORK = {"course.setup", "course.lab", "mirror.serve", "mirror.start", "synthetic.build", "download.download"}


def path_answers(functions, root: Path) -> dict:
    """``{"module.function(parameter=missing|a-file)": "clear" | "empty" | "bare ..." | "silent ..."}`` for each
    function of ``functions`` whose only required argument is a path, called with a path that does not exist and
    with a file where a folder may be meant."""
    a_file = root / "a-file"
    a_file.write_text("not what you think")
    found = {}
    for qualified, function in functions:
        parameters = list(inspect.signature(function).parameters.values())
        required = [p.name for p in parameters if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for parameter in parameters:
            if not any(parameter.name == w or parameter.name.endswith("_" + w) for w in PATH_WORDS):
                continue
            if set(required) - {parameter.name}:
                continue
            for number, bad in enumerate((root / f"missing-{len(found)}", a_file)):
                key = f"{qualified}({parameter.name}={'a-file' if number else 'missing'})"
                try:
                    returned = function(**{parameter.name: bad})
                    found[key] = ("empty" if returned is False or (not returned and returned is not None)
                                  else "a file taken" if number and returned == bad  # require_record_file's answer
                                  else f"silent {repr(returned)[:60]}")
                except errors.CourseError as error:
                    found[key] = "clear" if "\n" not in str(error).strip() else "several lines"
                except Exception as error:  # noqa: BLE001 - what the test is for
                    found[key] = f"bare {type(error).__name__}: {str(error)[:60]}"
    return found


def public_functions():
    import importlib
    import pkgutil

    import helpers

    for info in pkgutil.iter_modules(helpers.__path__):
        module = importlib.import_module(f"helpers.{info.name}")
        for name, function in vars(module).items():
            qualified = f"{info.name}.{name}"
            if (not name.startswith("_") and inspect.isfunction(function) and function.__module__ == module.__name__
                    and qualified not in STARTS_WORK):
                yield qualified, function


def test_every_function_taking_only_a_path_answers_a_missing_one_and_a_file_for_a_folder_in_one_sentence(tmp_path):
    """``planner.load_calibration`` of a missing file raised a bare FileNotFoundError, ``records.read_json`` of a folder
    an IsADirectoryError, ``fine_tuning.adapter_bytes`` and ``decoding.trace_events`` likewise, and a records folder
    that is a file read as "nothing recorded": each function of helpers whose only required argument is a path
    answers with one sentence, or with an empty answer (False, no records), never a bare exception and never a
    value read from nowhere. The control: a function that reads the path blindly is reported bare."""
    import os

    saved = dict(os.environ)
    try:
        found = path_answers(public_functions(), tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert len({key.split("(")[0] for key in found}) >= 40  # the walk reaches the readers
    wrong = {key: answer for key, answer in found.items() if answer not in ("clear", "empty", "a file taken")
             and key.split("(")[0] not in ANSWERS_ABOUT_THE_PATH | DIGESTS_OF_FILES_FOUND}
    assert wrong == {}

    def blind(path):
        return Path(path).read_text()

    def named(directory):
        return f"{directory}/x"

    (tmp_path / "control").mkdir()
    control = path_answers([("m.blind", blind), ("m.named", named)], tmp_path / "control")
    assert control["m.blind(path=missing)"].startswith("bare FileNotFoundError")
    assert control["m.named(directory=missing)"].startswith("silent")
