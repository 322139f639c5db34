"""The llama.cpp route: a checkpoint converted by llama.cpp's own converter, quantized to Q4_K_M, read
with the ``gguf`` package and run with ``llama-cpp-python`` on the CPU; the chat-template pitfalls on
the way, and where llama.cpp keeps the Per-Layer-Embedding table.

The converter is not in the wheel: it ships in llama-cpp-python's source distribution, under
``vendor/llama.cpp``, beside the llama.cpp the wheel was built from. ``converter_dir`` finds it
(``$LLAMA_CPP_SOURCE``, the folder ``make llama-cpp`` extracts it to, or the course cache) or extracts it
from that source distribution.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import numbers
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from . import loading, models
from .errors import (
    CorruptCheckpointError,
    CourseError,
    InvalidChoiceError,
    LlamaCppMissingError,
    LlamaCppRouteError,
    ModelNotFoundError,
    require_choice,
    require_number,
    require_whole_number,
)
from .measure import prompt_ids
from .paths import GGUF_DIR, REPO_ROOT, cache_dir, write_text_atomically
from .placement import compute_device_of

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its vendored llama.cpp has the Gemma 4 graph and converter
GGUF_VERSION = "0.19.0"
INSTALL = f"pip install llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} gguf=={GGUF_VERSION}"
SOURCE_ENV = "LLAMA_CPP_SOURCE"  # a folder holding llama.cpp's convert_hf_to_gguf.py
CONVERTER = "convert_hf_to_gguf.py"
# where `make llama-cpp` extracts it (the Makefile's LLAMA_CPP_SOURCE), looked in also when JupyterLab was started
# without make, which is what exports LLAMA_CPP_SOURCE
MADE_CONVERTER_DIR = REPO_ROOT / ".cache" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "llama.cpp"
# what the converter needs from the source distribution: itself, its model classes, the gguf-py it puts
# first on its path (written with it), and Google's Gemma 4 templates that llama.cpp keeps for its tests
SOURCE_PARTS = (CONVERTER, "conversion/", "gguf-py/", "models/templates/google-gemma-4-")
PLE_TENSOR = "per_layer_token_embd.weight"  # llama.cpp's name for embed_tokens_per_layer
QUANT_TYPES = ("Q4_K_M", "Q8_0")
OUT_TYPES = ("bf16", "f16", "f32", "q8_0", "auto")


def _import_problem() -> str | None:
    """Why llama-cpp-python or gguf cannot be used here (missing, or its library fails to load), or None."""
    for name in ("llama_cpp", "gguf"):
        try:
            importlib.import_module(name)
        except (ImportError, OSError, RuntimeError) as err:  # a wheel built for another system fails with OSError
            return f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
    return None


def installed() -> bool:
    return _import_problem() is None


def require_llama_cpp() -> None:
    problem = _import_problem()
    if problem is not None:
        raise LlamaCppMissingError(
            f"llama-cpp-python or gguf cannot be imported ({problem}): run `{INSTALL}` (llama.cpp compiles from source, "
            f"several minutes on two cores; `make llama-cpp` builds it once and caches the wheel), then restart the kernel.")


def _has_converter(folder) -> bool:
    return folder is not None and (Path(folder) / CONVERTER).is_file()


def find_converter() -> Path | None:
    """The folder holding llama.cpp's converter, if it is on this machine already."""
    for folder in (os.environ.get(SOURCE_ENV), MADE_CONVERTER_DIR, cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"):
        if _has_converter(folder):
            return Path(folder).resolve()
    return None


def extract_converter(sdist: Path, dest: Path) -> Path:
    """Copy the converter, its model classes, its gguf-py and the Gemma 4 templates out of the
    llama-cpp-python source distribution into ``dest`` (written aside, then renamed into place)."""
    sdist, dest = Path(sdist), Path(dest)
    staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/vendor/llama.cpp/", 1)
                if len(parts) == 2 and member.isfile() and parts[1].startswith(SOURCE_PARTS):
                    target = staging / parts[1]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.extractfile(member).read())
        if not _has_converter(staging):
            raise LlamaCppRouteError(
                f"{sdist} holds no vendor/llama.cpp/{CONVERTER}: use llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s sdist.")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def converter_dir() -> Path:
    """llama.cpp's converter: found locally, or taken from the source distribution pip downloads
    (``pip download --no-binary``, answered from pip's cache when ``pip install`` fetched it already)."""
    found = find_converter()
    if found is not None:
        return found
    downloads = cache_dir() / "sdist"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(downloads)],
                          capture_output=True, text=True)
    sdists = sorted(downloads.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if done.returncode != 0 or not sdists:
        said = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", done.stderr).splitlines() if line.strip()]
        raise LlamaCppMissingError(
            f"Could not download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s source to get llama.cpp's converter "
            f"({said[-1] if said else 'pip wrote no file'}): run `make llama-cpp`, or set {SOURCE_ENV} to a "
            f"llama.cpp checkout.")
    converter = extract_converter(sdists[0], cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}")
    shutil.rmtree(downloads, ignore_errors=True)  # 76 MB, and pip keeps its own copy
    return converter


def _output_beside(source, dest) -> tuple:
    """(the final path, the hidden sibling written first): a kill or a full disk mid-write leaves no file under the
    final name that looks whole, and nothing ever writes over what it reads."""
    if not isinstance(dest, (str, os.PathLike)) or not str(dest).strip():
        raise LlamaCppRouteError(f"dest={dest!r} is not a file path; pass where the GGUF file should go.")
    dest = Path(dest)
    if dest.exists() and Path(source).exists() and dest.resolve() == Path(source).resolve():
        raise LlamaCppRouteError(f"{dest} is also the file read: choose another name for the output, which would "
                                 f"otherwise overwrite its own input.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest, dest.with_name(f".{dest.name}.partial")


def convert(checkpoint, outfile, outtype: str = "bf16") -> dict:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on a Hugging Face checkpoint folder, in a fresh process
    (as on the command line), written aside and renamed into place. Returns the file, its size and how long it took."""
    require_choice(outtype, OUT_TYPES, "outtype")
    outfile, aside = _output_beside(checkpoint, outfile)
    command = [sys.executable, str(converter_dir() / CONVERTER), str(checkpoint), "--outfile", str(aside), "--outtype", outtype]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:]
            raise LlamaCppRouteError(f"llama.cpp's converter refused {checkpoint}: {last[0] if last else 'no message'} "
                                     f"(run `{' '.join(command)}` to see the whole log).")
        os.replace(aside, outfile)
    finally:
        aside.unlink(missing_ok=True)
    return {"path": outfile, "bytes": outfile.stat().st_size, "seconds": time.perf_counter() - started,
            "command": f"python {CONVERTER} CHECKPOINT --outfile {outfile.name} --outtype {outtype}"}


def quantize(source, dest, kind: str = "Q4_K_M", threads: int | None = None) -> dict:
    """``llama-quantize SOURCE DEST Q4_K_M`` through llama-cpp-python's binding of ``llama_model_quantize``, written
    aside and renamed into place; never over ``source``."""
    threads = None if threads is None else require_whole_number(threads, "threads", unit="threads")
    require_llama_cpp()
    import llama_cpp

    require_choice(kind, QUANT_TYPES, "kind")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads or os.cpu_count() or 1
    dest, aside = _output_beside(source, dest)
    started = time.perf_counter()
    try:
        with _captured_logs():
            status = llama_cpp.llama_model_quantize(str(source).encode(), str(aside).encode(), ctypes.byref(params))
        if status != 0:
            raise LlamaCppRouteError(f"llama_model_quantize returned {status} for {source}: check that it is a GGUF file "
                                     f"in bf16, f16 or f32.")
        os.replace(aside, dest)
    finally:
        aside.unlink(missing_ok=True)
    return {"path": dest, "bytes": dest.stat().st_size, "seconds": time.perf_counter() - started}


class _captured_logs:
    """llama.cpp logs through llama-cpp-python's callback to ``sys.stderr`` (in a notebook, the cell's
    output), and some native code writes to file descriptor 2: both go to a buffer for the duration.
    ``.text`` holds what was logged."""

    def __enter__(self):
        self.buffer = io.StringIO()
        self.redirect = contextlib.redirect_stderr(self.buffer)
        self.redirect.__enter__()
        sys.__stderr__.flush()
        self.native = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.native.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.__stderr__.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.redirect.__exit__(*exc)
        self.native.seek(0)
        self.text = self.buffer.getvalue() + self.native.read().decode(errors="replace")
        self.native.close()


GGUF_MAGIC = b"GGUF"


def require_gguf_path(path) -> Path:
    """``path`` as a Path if it names a file that begins as a GGUF does; one sentence otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise InvalidChoiceError(f"path={path!r:.60} is not a file path; pass the path of a .gguf file, "
                                 f"such as the one gguf_route.convert returned.")
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path} {'is a folder' if path.is_dir() else 'does not exist'}; pass the .gguf file "
                                 f"that gguf_route.convert or quantize wrote.")
    with path.open("rb") as handle:
        start = handle.read(len(GGUF_MAGIC))
    if start != GGUF_MAGIC:
        shown = "is empty" if not start else "is not a GGUF file (it does not begin with GGUF)"
        raise CorruptCheckpointError(f"{path} {shown}; convert the checkpoint again with gguf_route.convert.")
    return path


def read(path):
    """The GGUF file as the ``gguf`` package reads it (metadata and tensor table; data memory-mapped). A file
    cut short anywhere, header or tensor data, is refused in one sentence."""
    path = require_gguf_path(path)
    require_llama_cpp()
    from gguf import GGUFReader

    cut = CorruptCheckpointError(f"{path} is cut short or corrupt; delete it and convert the checkpoint again with "
                                 f"gguf_route.convert.")
    try:
        reader = GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - whatever the parser meets in a damaged header, the answer is the same
        raise cut from None
    size = path.stat().st_size
    if any(int(t.data_offset) + int(t.n_bytes) > size for t in reader.tensors):
        raise cut
    return reader


def field_value(reader, key: str):
    """One metadata value: a string, a number, or a list of them."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def metadata(path) -> dict:
    """What llama.cpp will read from the file: architecture, tokenizer, special tokens, chat template."""
    reader = read(path)
    arch = field_value(reader, "general.architecture")
    if not arch:
        raise CorruptCheckpointError(f"{path} names no general.architecture, so llama.cpp cannot load it; convert the "
                                     f"checkpoint again with gguf_route.convert.")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "file type": field_value(reader, "general.file_type"),
        "blocks": field_value(reader, f"{arch}.block_count"),
        "shared KV layers": field_value(reader, f"{arch}.attention.shared_kv_layers"),
        "per-layer input width": field_value(reader, f"{arch}.embedding_length_per_layer_input"),
        "tokenizer": field_value(reader, "tokenizer.ggml.model"),
        "tokens": None if tokens is None else len(tokens.data),
        "bos id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "chat template": field_value(reader, "tokenizer.chat_template"),
    }


def tensors(path) -> list:
    """Every tensor: name, llama.cpp type, shape (llama.cpp order: fastest dimension first) and bytes."""
    return [{"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in t.shape], "bytes": int(t.n_bytes)}
            for t in read(path).tensors]


def tensor(path, name: str = PLE_TENSOR) -> dict:
    """One tensor's entry (as ``tensors`` lists it) by its llama.cpp name."""
    if not isinstance(name, str) or not name:
        raise InvalidChoiceError(f"name={name!r} is not a tensor name; pass a llama.cpp name such as {PLE_TENSOR!r}.")
    for entry in tensors(path):
        if entry["name"] == name:
            return entry
    raise LlamaCppRouteError(f"{path} has no tensor {name!r}: is it a Gemma 4 (E2B/E4B) GGUF?")


def bytes_by_type(path) -> dict:
    """Bytes per llama.cpp tensor type, largest first: what a "Q4_K_M" file is really made of."""
    totals = Counter()
    for entry in tensors(path):
        totals[entry["type"]] += entry["bytes"]
    return dict(totals.most_common())


def load(path, *, n_ctx: int = 512, n_gpu_layers: int = 0, threads: int | None = None, **options):
    """``llama_cpp.Llama`` on the file. ``n_gpu_layers=0`` (llama-cpp-python's default) keeps every layer
    on the CPU, ``-1`` offloads all; llama.cpp's own ``-ngl auto`` / ``--fit`` live in its command-line
    library, which llama-cpp-python does not bind."""
    n_ctx = require_whole_number(n_ctx, "n_ctx", unit="tokens")
    n_gpu_layers = require_whole_number(n_gpu_layers, "n_gpu_layers", minimum=-1, unit="layers (-1: all)")
    if threads is not None:
        threads = require_whole_number(threads, "threads")
    require_llama_cpp()
    from llama_cpp import Llama
    from llama_cpp._logger import set_verbose

    check_kv_sharing_order(path)
    with _captured_logs() as logs:
        llm = Llama(model_path=str(path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=threads or os.cpu_count(),
                    verbose=True, **options)
    llm.verbose = False
    set_verbose(False)
    llm.model_buffers = model_buffers(logs.text)
    return llm


def model_buffers(log: str) -> dict:
    """Bytes per llama.cpp buffer from its load log: ``CPU_Mapped`` is the file itself, mapped; ``CPU_REPACK``
    holds copies of matrices re-laid for the CPU's SIMD kernels; a GPU build adds ``CUDA0``."""
    found = re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", log)
    return {name: int(float(mib) * 1024**2) for name, mib in found}


def tokenize(llm, text: str) -> list:
    """Token ids as llama.cpp reads a rendered prompt: special tokens parsed, no BOS added (the template wrote it)."""
    require_llm(llm)
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def _plain(messages) -> list:
    """llama.cpp's chat API takes text content; list content is joined from its text parts."""
    plain = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(part["text"] for part in content if part.get("type") == "text")
        plain.append({"role": message["role"], "content": content})
    return plain


def _special_text(llm, token_id: int) -> str:
    return llm.detokenize([token_id], special=True).decode()


def render_jinja(llm, template: str, messages, **options) -> str:
    """A Jinja chat template rendered the way llama-cpp-python renders the GGUF's own (with the model's
    BOS and EOS text): what ``llama-cli --jinja`` and ``llama-server`` do with ``--chat-template-file``."""
    require_llm(llm)
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template=template, bos_token=_special_text(llm, llm.token_bos()),
                                    eos_token=_special_text(llm, llm.token_eos()), add_generation_prompt=True)
    return formatter(messages=messages, **options).prompt


def render_embedded(llm, messages, **options) -> str:
    """The prompt from the template embedded in the GGUF (``tokenizer.chat_template``): what
    ``llama-cli -cnv`` and ``--jinja`` use, and what ``Llama.create_chat_completion`` uses by default."""
    require_llm(llm)
    return render_jinja(llm, llm.metadata["tokenizer.chat_template"], messages, **options)


def render_builtin(name: str, messages) -> str | None:
    """The prompt from one of llama.cpp's built-in C++ templates (``llama_chat_apply_template``), what
    ``--chat-template NAME`` gives with ``--no-jinja``. None where llama.cpp has no template of that name."""
    require_llama_cpp()
    import llama_cpp

    plain = _plain(messages)
    chat = (llama_cpp.llama_chat_message * len(plain))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in plain])
    size = 4096 + sum(len(m["content"]) for m in plain) * 2
    buffer = ctypes.create_string_buffer(size)
    written = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(plain), True, buffer, size)
    return None if written < 0 else buffer.raw[:written].decode()


def render_name_as_jinja(llm, name: str, messages) -> str:
    """What llama.cpp does with ``--chat-template NAME`` now that ``--jinja`` is on by default: the name
    is not looked up but used as the template's source (common/chat.cpp), so the prompt is the name itself."""
    require_llm(llm)
    return render_jinja(llm, name, _plain(messages))


def stop_tokens(llm) -> list:
    """The ids llama.cpp ends generation on (end-of-generation tokens, read from the vocabulary)."""
    require_llm(llm)
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def require_llm(llm):
    """``llm`` if it is a llama.cpp model (what ``load`` returned)."""
    if not all(hasattr(llm, name) for name in ("n_vocab", "n_ctx", "eval", "tokenize", "detokenize")):
        raise InvalidChoiceError(f"llm={llm!r:.40} is not a llama.cpp model; pass what gguf_route.load returned.")
    return llm


def _require_id_list(ids) -> None:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidChoiceError(f"ids={ids!r:.40} is not a prompt of token ids; pass a non-empty list of ints, "
                                 f"as gguf_route.tokenize gives.")


def require_llama_ids(llm, ids, new_tokens: int = 0) -> list:
    """``ids`` as a list of ints if ``llm`` (what ``load`` returned) can read them and ``new_tokens`` more
    within its context; one sentence otherwise (llama.cpp itself would read an empty or oversized prompt)."""
    require_llm(llm)
    _require_id_list(ids)
    new_tokens = require_whole_number(new_tokens, "new_tokens", minimum=0, unit="tokens")
    vocabulary = llm.n_vocab()
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocabulary:
            raise InvalidChoiceError(f"ids holds {token!r}, not a token id of this model's vocabulary of {vocabulary:,}: "
                                     f"tokenize with gguf_route.tokenize.")
    if len(ids) + new_tokens > llm.n_ctx():
        raise InvalidChoiceError(f"A prompt of {len(ids):,} tokens and {new_tokens:,} new ones does not fit the context "
                                 f"of {llm.n_ctx():,} this model was loaded with: load it with a larger n_ctx.")
    return [int(token) for token in ids]


def generate(llm, prompt_ids: list, max_tokens: int = 32) -> dict:
    """Greedy tokens after ``prompt_ids``, with llama.cpp's own timers (``llama_perf_context``)."""
    max_tokens = require_whole_number(max_tokens, "max_tokens", unit="tokens")
    prompt_ids = require_llama_ids(llm, prompt_ids, max_tokens)
    import llama_cpp  # after the checks: an llm from load means llama-cpp-python is there

    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    new_ids = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token) or len(new_ids) == max_tokens:
            break
        new_ids.append(token)
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {
        "ids": new_ids,
        "text": llm.detokenize(new_ids, special=True).decode(errors="replace"),
        "prefill_tokens": perf.n_p_eval, "prefill_seconds": perf.t_p_eval_ms / 1e3,
        "decode_tokens": perf.n_eval, "decode_seconds": perf.t_eval_ms / 1e3,
    }


def rate(tokens: int, seconds: float) -> float | None:
    """Tokens per second, None where nothing was timed."""
    require_whole_number(tokens, "tokens", minimum=0)
    require_number(seconds, "seconds")
    return round(tokens / seconds, 1) if seconds > 0 and tokens > 0 else None


def rss_bytes() -> int:
    """This process's resident memory now: its heap plus the pages of mapped files it has touched."""
    import psutil

    return psutil.Process().memory_info().rss


def check_kv_sharing_order(path) -> None:
    """llama.cpp (0.3.36's vendored copy) lets a KV-shared layer reuse layer ``first_shared - 2`` if it is a
    sliding layer and ``first_shared - 1`` if full (llama-model.cpp), which holds when the last layer before
    the shared ones is full attention and the one before it sliding, as in E2B and E4B. Any other order
    aborts the whole process (a GGML_ASSERT, no Python exception): refuse it here instead."""
    reader = read(path)
    arch = field_value(reader, "general.architecture")
    shared = field_value(reader, f"{arch}.attention.shared_kv_layers") or 0
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if not shared or not pattern:
        return
    first = len(pattern) - int(shared)
    if first < 2 or pattern[first - 1] or not pattern[first - 2]:
        raise LlamaCppRouteError(
            f"{Path(path).name}: its layer {first - 1} (the last before the KV-shared layers) must be full attention and "
            f"layer {first - 2} sliding, as in Gemma 4 E2B/E4B; llama.cpp would abort the Python process on this file: "
            f"rebuild the synthetic checkpoint with the course's current configs.")


def logits(llm, ids: list):
    """llama.cpp's next-token logits after ``ids`` (the model must be loaded with ``logits_all=True``)."""
    import numpy as np

    ids = require_llama_ids(llm, ids)
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[len(ids) - 1])


def compare_logits(llm, model, ids: list) -> dict:
    """llama.cpp's next-token logits against transformers' for the same ids. The control is transformers'
    logits at the middle of the prompt, which must not match: without it a loose check could pass anything."""
    import numpy as np
    import torch

    with torch.no_grad():
        reference = model(torch.tensor([ids], device=compute_device_of(model))).logits[0].float().cpu().numpy()
    ours = logits(llm, ids)
    return {
        "correlation": float(np.corrcoef(ours, reference[-1])[0, 1]),
        "max_abs_difference": float(np.abs(ours - reference[-1]).max()),
        "logit_std": float(reference[-1].std()),
        "same_top_token": int(ours.argmax()) == int(reference[-1].argmax()),
        "control_correlation": float(np.corrcoef(ours, reference[len(ids) // 2])[0, 1]),
    }


def measure(path, prompt_ids: list, new_tokens: int = 32, threads: int | None = None) -> dict:
    """The llama.cpp route on this CPU: load time, resident memory after loading and after generating,
    prefill and decode speed from llama.cpp's own timers."""
    new_tokens = require_whole_number(new_tokens, "new_tokens", unit="tokens")
    _require_id_list(prompt_ids)
    before = rss_bytes()
    started = time.perf_counter()
    llm = load(path, n_ctx=max(512, len(prompt_ids) + new_tokens + 8), threads=threads)
    load_seconds = time.perf_counter() - started
    after_load = rss_bytes()
    run = generate(llm, prompt_ids, new_tokens)
    return {
        "file_bytes": Path(path).stat().st_size,
        "load_seconds": round(load_seconds, 3),
        "rss_added_by_load_bytes": after_load - before,
        "rss_added_after_generate_bytes": rss_bytes() - before,
        "model_buffers_bytes": llm.model_buffers,
        "prefill_tokens_per_s": rate(run["prefill_tokens"], run["prefill_seconds"]),
        "decode_tokens_per_s": rate(run["decode_tokens"], run["decode_seconds"]),
        "seconds_per_new_token": round((run["prefill_seconds"] + run["decode_seconds"]) / max(len(run["ids"]), 1), 5),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(run["ids"]),
        "distinct_new_tokens": len(set(run["ids"])),
        "threads": threads or os.cpu_count(),
    }


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The llama.cpp route on a checkpoint, on this CPU: convert, quantize, read, run.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("measure", help="convert to bf16, quantize to Q4_K_M, read the PLE tensor, load and generate")
    run.add_argument("model", help="a synthetic name (tiny, e4b-shape), a hub id or a folder")
    run.add_argument("--work", default=None, help="folder for the GGUF files (default: the course cache)")
    run.add_argument("--prompt-tokens", type=int, default=128)
    run.add_argument("--new-tokens", type=int, default=32)
    run.add_argument("--keep-bf16", action="store_true", help="keep the bf16 GGUF (as large as the checkpoint)")
    run.add_argument("--record", action="store_true", help=f"write the result to {GGUF_DIR}/<model>.json")
    args = parser.parse_args(argv)
    try:  # bad input, refused before the minutes of converting: its sentence, not a traceback
        require_whole_number(args.prompt_tokens, "--prompt-tokens", unit="tokens")
        require_whole_number(args.new_tokens, "--new-tokens", unit="tokens")
        name = models.requested(args.model)
        checkpoint = models.resolve(name)
        work = Path(args.work) if args.work else cache_dir() / "gguf" / checkpoint.name
        if work.exists() and not work.is_dir():
            raise InvalidChoiceError(f"--work {work} is a file; pass a folder for the GGUF files (it is made if missing).")
        require_llama_cpp()
        work.mkdir(parents=True, exist_ok=True)
        return _measure_and_record(args, name, checkpoint, work)
    except CourseError as err:
        print(err, file=sys.stderr)
        return 2


def _measure_and_record(args, name: str, checkpoint: Path, work: Path) -> int:
    import json
    import platform

    bf16 = convert(checkpoint, work / "model-bf16.gguf")
    print(f"converted in {bf16['seconds']:.0f} s: {bf16['bytes'] / 1e9:.2f} GB")
    q4 = quantize(bf16["path"], work / "model-Q4_K_M.gguf")
    print(f"quantized in {q4['seconds']:.0f} s: {q4['bytes'] / 1e9:.2f} GB")
    if not args.keep_bf16:
        bf16["path"].unlink()
    check_kv_sharing_order(q4["path"])
    ple = tensor(q4["path"])
    tokenizer = loading.load_tokenizer(name)
    ids = prompt_ids(tokenizer, args.prompt_tokens, "cpu")[0].tolist()
    result = measure(q4["path"], ids, args.new_tokens)
    record = {
        "model": name, "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")),
        "bf16_gguf_bytes": bf16["bytes"], "convert_seconds": round(bf16["seconds"], 1),
        "q4_k_m_bytes": q4["bytes"], "quantize_seconds": round(q4["seconds"], 1),
        "q4_k_m_bytes_by_type": bytes_by_type(q4["path"]), "ple_tensor": ple, **result,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m helpers.gguf_route measure {name} --record",
    }
    print(json.dumps(record, indent=1))
    if args.record:
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        write_text_atomically(GGUF_DIR / f"{name}.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
