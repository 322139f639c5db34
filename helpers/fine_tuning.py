"""Fine-tuning with LoRA adapters on a quantized base (QLoRA): which modules to wrap, the set-up a card
needs, a task random weights can learn, and a short training loop.

LoRA leaves every weight ``W`` of the base frozen and adds, beside each wrapped projection, two small
matrices ``A`` (in x r) and ``B`` (r x out): the layer computes ``x W + (x A B) * alpha / r``. ``B``
starts at zero, so the wrapped model starts exactly where the base is, and only ``A`` and ``B`` learn.
The PLE table is a lookup that no adapter touches and no gradient reaches: it stays on the CPU, frozen,
as it does for inference (``placement.offload_ple`` finds it under peft's ``base_model.model.`` prefix).

    from helpers import fine_tuning
    model = fine_tuning.qlora("e4b-shape", device=0)           # NF4, PLE on the CPU, adapters on the decoder
    batch = fine_tuning.pattern_batch(model, length=512)
    run = fine_tuning.train(model, batch, steps=20)            # run.losses falls
"""

from __future__ import annotations

import math
import numbers
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import loading, placement
from .errors import InvalidChoiceError, ModelNotFoundError, require_bool, require_number, require_positive_number, require_whole_number

# The attention and MLP projections of the text decoder. The towers' projections carry the same names
# but are Gemma4ClippableLinear wrappers, which peft refuses as LoRA targets; the tables are lookups.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_PATTERN = r".*language_model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + ")"
KEPT_OUT = {
    "vision_tower": "the vision tower: images are not what this task teaches",
    "audio_tower": "the audio tower: sound is not what this task teaches",
    "embed_tokens": "the token embeddings, tied to the output head: a lookup, frozen",
    placement.PLE_SUFFIX: "the PLE table: a lookup on the CPU, frozen",
    "per_layer_": "the PLE path's projections and gates: small, left as they are",
}
RANK = 8
ALPHA = 16
# tokens whose logits the loss makes at a time: 256 x 262,144 words x 16 bytes a value is about 1.07 GB, where a
# whole 2,048-token sequence's logits would take 8.6 GB (planner.LOGIT_BYTES_PER_VALUE says what those bytes are)
LOSS_CHUNK = 256
ADAM_STATE_BYTES = {"adamw": 8, "paged_adamw_8bit": 2}  # bytes of optimizer state per trainable parameter


def is_target(name: str) -> bool:
    """Whether a module name is one LoRA wraps (peft matches ``TARGET_PATTERN`` against the whole name)."""
    return re.fullmatch(TARGET_PATTERN, name) is not None


def lora_config(rank: int = RANK, alpha: int = ALPHA, dropout: float = 0.0):
    """peft's ``LoraConfig`` for the text decoder's projections (``B`` starts at zero: peft's default)."""
    from peft import LoraConfig

    rank = require_whole_number(rank, "rank")
    require_positive_number(alpha, "alpha")
    if require_number(dropout, "dropout") >= 1:
        raise InvalidChoiceError(f"dropout={dropout!r} would drop every input of the adapters; pass a fraction below 1, "
                                 f"such as 0.05 (or 0 for none).")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGET_PATTERN,
                      bias="none", task_type="CAUSAL_LM")


def adapter_shapes(model) -> dict:
    """(in, out) features of every projection LoRA wraps, by module name; works on a meta model."""
    placement.require_model(model)
    return {name: (module.in_features, module.out_features) for name, module in model.named_modules()
            if is_target(name) and hasattr(module, "in_features")}


def adapter_parameters(model, rank: int = RANK) -> int:
    """How many numbers the adapters hold: ``rank x (in + out)`` per wrapped projection."""
    rank = require_whole_number(rank, "rank")
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in adapter_shapes(model).values())


@dataclass
class Targets:
    """What LoRA wraps in a model and what it keeps out, and why."""
    wrapped: dict  # projection -> how many
    layers: int
    kept_out: dict  # part -> (modules, why)

    def __str__(self) -> str:
        counts = ", ".join(f"{name} x{count}" for name, count in self.wrapped.items())
        lines = [f"wrapped: {sum(self.wrapped.values())} projections in {self.layers} decoder layers ({counts})",
                 "kept out:"]
        lines += [f"  {part:<24} {modules:>4} modules  {why}" for part, (modules, why) in self.kept_out.items()]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def targets(model) -> Targets:
    """Which modules LoRA wraps and which it keeps out (the towers, the tables), counted on ``model``."""
    placement.require_model(model)
    names = [name for name, _ in model.named_modules()]
    wanted = [name for name in names if is_target(name) and ".lora_" not in name]
    wrapped = {projection: sum(name.endswith("." + projection) for name in wanted) for projection in PROJECTIONS}
    layers = len({re.search(r"layers\.(\d+)\.", name).group(1) for name in wanted})
    kept = {}
    for part, why in KEPT_OUT.items():
        inside = [name for name, module in model.named_modules()
                  if any(piece == part or (part.endswith("_") and piece.startswith(part)) for piece in name.split("."))
                  and next(module.parameters(recurse=False), None) is not None and ".lora_" not in name]
        if inside:
            kept[part] = (len(inside), why)
    return Targets(wrapped, layers, kept)


def add_adapters(model, rank: int = RANK, alpha: int = ALPHA, *, seed: int = 0):
    """Wrap ``model`` with peft's LoRA on the text decoder's projections (``A`` drawn from ``seed``, ``B`` zero)."""
    from peft import get_peft_model

    placement.require_model(model)
    config = lora_config(rank, alpha)
    seed = require_whole_number(seed, "seed", minimum=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def upcast_bytes(model) -> dict:
    """What ``peft.prepare_model_for_kbit_training`` would add, by part (``placement.part_of``), the largest first: it
    casts every bf16 and fp16 weight that is not 4-bit to fp32, the PLE table and the embeddings included."""
    placement.require_model(model)
    added: dict = {}
    for module_name, _, tensor_name, tensor in placement.unique_tensors(model):
        if isinstance(tensor, torch.nn.Parameter) and tensor.dtype in (torch.bfloat16, torch.float16) and \
                type(tensor).__name__ != "Params4bit":
            part = placement.part_of(f"{module_name}.{tensor_name}")
            added[part] = added.get(part, 0) + tensor.numel() * (4 - tensor.element_size())
    return dict(sorted(added.items(), key=lambda item: -item[1]))


def prepare(model, *, upcast: bool = False):
    """Ready a loaded model for LoRA training: every weight frozen, gradient checkpointing on (each decoder
    layer recomputed in the backward pass instead of kept). ``upcast=True`` runs peft's
    ``prepare_model_for_kbit_training`` instead, which also casts the bf16 weights to fp32 (``upcast_bytes``:
    on E4B the PLE table doubles in RAM and the embeddings on the GPU), worth it only where memory is plenty."""
    placement.require_model(model)
    require_bool(upcast, "upcast")
    checkpointing = {"use_reentrant": False}  # no input-grad hook needed, and the PLE lookup may return plain rows
    if upcast:
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs=checkpointing)
    model.requires_grad_(False)
    if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model


def qlora(source=None, device=0, rank: int = RANK, alpha: int = ALPHA, *, quant: str = "nf4", seed: int = 0, **load):
    """The course's QLoRA set-up: ``load_model(source, quant, ple="cpu")`` (4-bit layers computing in bf16, or
    fp16 on a card without it), every weight frozen, gradient checkpointing, LoRA adapters on the decoder."""
    model = loading.load_model(source, quant=quant, ple="cpu", device=device, **load)
    return add_adapters(prepare(model), rank, alpha, seed=seed)


def trainable(model) -> list:
    placement.require_model(model)
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def _require_learning_rate(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value >= 0 and math.isfinite(value)):
        # "1e-3" is text; 0 is the tests' control
        raise InvalidChoiceError(f"learning_rate={value!r} is not supported; pass a small positive number, e.g. 1e-3.")
    return float(value)


def optimizer_for(model, learning_rate: float = 1e-3):
    """bitsandbytes' paged 8-bit AdamW on a GPU (2 bytes of state per parameter, paged out under pressure);
    torch's AdamW on the CPU, where the paged optimizers do not run."""
    parameters = trainable(model)
    if not parameters:
        raise InvalidChoiceError("the model has no trainable parameters; wrap it with fine_tuning.add_adapters first.")
    learning_rate = _require_learning_rate(learning_rate)
    if parameters[0].device.type == "cuda":
        import bitsandbytes

        return bitsandbytes.optim.PagedAdamW8bit(parameters, lr=learning_rate)
    return torch.optim.AdamW(parameters, lr=learning_rate)


def optimizer_name(device) -> str:
    """The key of ``ADAM_STATE_BYTES`` that ``optimizer_for`` uses on ``device``."""
    return "paged_adamw_8bit" if torch.device(device).type == "cuda" else "adamw"


def pattern_batch(model_or_config, length: int, batch: int = 1, pattern: int = 16, seed: int = 0) -> torch.Tensor:
    """A copy task random weights can learn: every row is one fixed pattern of ``pattern`` token ids, repeated to
    ``length``. Only the first repeat is unpredictable; after it, each token is the one ``pattern`` places back."""
    length = require_whole_number(length, "length", minimum=2, unit="tokens")
    batch = require_whole_number(batch, "batch")
    pattern = require_whole_number(pattern, "pattern", minimum=1, maximum=length, unit="tokens")
    config = getattr(model_or_config, "config", model_or_config)
    vocab = (getattr(config, "text_config", None) or config).vocab_size
    seed = require_whole_number(seed, "seed", minimum=0)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(16, vocab, (pattern,), generator=generator)  # past the special tokens
    return ids.repeat(math.ceil(length / pattern))[:length].expand(batch, length).clone()


def require_batch(model, input_ids) -> torch.Tensor:
    """``input_ids`` if they are a batch the model can learn from: a (batch, tokens) tensor of token ids, at least two
    tokens a row (one to predict the next), each id in the vocabulary, within the model's positions."""
    text = placement.require_model(model).config.get_text_config()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise InvalidChoiceError(f"input_ids must be a 2-D tensor of token ids (batch x tokens), not {type(input_ids).__name__}"
                                 f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}; "
                                 "fine_tuning.pattern_batch makes one.")
    require_whole_number(input_ids.shape[0], "the batch", unit="rows")
    require_whole_number(input_ids.shape[1], "the sequence length", minimum=2, maximum=text.max_position_embeddings,
                         unit="tokens", maximum_is="the model's max_position_embeddings")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= text.vocab_size:
        raise InvalidChoiceError(f"input_ids holds {low if low < 0 else high}, outside the vocabulary of {text.vocab_size:,}: "
                                 "tokenize with this model's own tokenizer.")
    return input_ids


def _chunk_loss_sum(head, softcap, hidden, targets):
    logits = head(hidden)
    if softcap is not None:  # as the model's own forward does before its loss
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum")


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                   chunk: int | None = LOSS_CHUNK) -> torch.Tensor:
    """The next-token loss of ``model`` on ``input_ids`` (labels: the inputs; -100 marks a position to skip), the
    mean over the predicted positions, as ``model(input_ids, labels=...).loss`` gives it.

    ``chunk``: the output head makes the logits of ``chunk`` positions at a time, and each chunk is recomputed in the
    backward pass (``torch.utils.checkpoint``), so one chunk's logits exist at once instead of the whole sequence's
    (262,144 per token on Gemma 4). ``None``: the model's own forward, every logit at once."""
    from torch.utils.checkpoint import checkpoint

    require_batch(model, input_ids)
    labels = input_ids if labels is None else labels
    if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape or labels.dtype != torch.long:
        raise InvalidChoiceError(f"labels must be a tensor of token ids shaped like input_ids {tuple(input_ids.shape)}; "
                                 "pass None to learn the inputs themselves.")
    if chunk is None:
        return model(input_ids=input_ids, labels=labels, use_cache=False).loss
    chunk = require_whole_number(chunk, "chunk", unit="tokens")
    outer = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    if not (hasattr(outer, "model") and hasattr(outer, "lm_head")):
        raise InvalidChoiceError(f"{type(outer).__name__} has no .model and .lm_head to chunk the loss over; pass chunk=None "
                                 "to use the model's own loss.")
    hidden = outer.model(input_ids=input_ids, use_cache=False, return_dict=True).last_hidden_state[:, :-1]
    targets = labels[:, 1:].to(hidden.device)
    softcap = getattr(outer.config.get_text_config(), "final_logit_softcapping", None)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], chunk):
        part = (outer.lm_head, softcap, hidden[:, start:start + chunk], targets[:, start:start + chunk])
        total = total + (checkpoint(_chunk_loss_sum, *part, use_reentrant=False) if recompute else _chunk_loss_sum(*part))
    return total / (targets != -100).sum().clamp(min=1)


@dataclass
class TrainingRun:
    """What ``train`` returns: the loss of each step, the steps skipped for overflow, the time and the peak."""
    losses: list
    skipped: list = field(default_factory=list)  # steps whose loss or gradients were not finite (fp16 overflow)
    seconds: float = 0.0
    peak_bytes: int | None = None  # the GPU's peak allocated (None on the CPU)
    sequence: int = 0
    loss_chunk: int | None = LOSS_CHUNK  # positions whose logits existed at once (None: the whole sequence)

    @property
    def steps_per_second(self) -> float:
        return len(self.losses) / self.seconds if self.seconds else float("nan")

    def __str__(self) -> str:
        peak = "" if self.peak_bytes is None else f", peak {self.peak_bytes / 1e9:.2f} GB"
        skipped = f"; {len(self.skipped)} step(s) overflowed and were skipped" if self.skipped else "; no overflow"
        return (f"{len(self.losses)} steps of {self.sequence:,} tokens: loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}, "
                f"{self.steps_per_second:.2f} steps/s{peak}{skipped}")

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def train(model, batch: torch.Tensor, steps: int = 20, learning_rate: float = 1e-3, *, optimizer=None,
          progress: bool = True, loss_chunk: int | None = LOSS_CHUNK) -> TrainingRun:
    """Train the adapters on ``batch`` (labels are the inputs: the model shifts them) for ``steps`` steps, the loss
    made ``loss_chunk`` positions at a time (``causal_lm_loss``).

    Overflow check: where the loss or the gradient norm is not finite (fp16 compute on a T4 can overflow),
    that step is skipped, as ``torch.amp.GradScaler`` does, and recorded in ``TrainingRun.skipped``."""
    from tqdm.auto import trange

    placement.require_model(model)
    steps = require_whole_number(steps, "steps")
    require_bool(progress, "progress")
    optimizer = optimizer or optimizer_for(model, learning_rate)
    parameters = trainable(model)
    device = placement.compute_device_of(model)
    batch = batch.to(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    run = TrainingRun(losses=[], sequence=batch.shape[-1], loss_chunk=loss_chunk)
    start = time.perf_counter()
    bar = trange(steps, desc="training", disable=not progress)
    for step in bar:
        loss = causal_lm_loss(model, batch, chunk=loss_chunk)
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm=1.0)
            finite = bool(torch.isfinite(norm))
        if finite:
            optimizer.step()
        else:
            run.skipped.append(step)
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{run.losses[-1]:.3f}")
    if on_gpu:
        torch.cuda.synchronize(device)
        run.peak_bytes = torch.cuda.max_memory_allocated(device)
    run.seconds = time.perf_counter() - start
    model.eval()
    return run


# ------------------------------------------------------------------ saving, loading, merging

def save_adapter(model, folder) -> Path:
    """Write the adapters alone (``adapter_model.safetensors`` and ``adapter_config.json``), aside first and then
    renamed, so a kill leaves the old folder or the new one."""
    placement.require_model(model)
    folder = Path(folder)
    aside = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    model.save_pretrained(aside)
    if folder.exists():
        old = folder.with_name(folder.name + f".old-{os.getpid()}")
        os.replace(folder, old)
        os.replace(aside, folder)
        shutil.rmtree(old)
    else:
        os.replace(aside, folder)
    return folder


def load_adapter(base, folder):
    """A base model (loaded as before) with the saved adapters on top (``peft.PeftModel.from_pretrained``)."""
    from peft import PeftModel

    placement.require_model(base, "base")
    return PeftModel.from_pretrained(base, Path(folder))


def load_beside(model, folder, name: str = "reloaded") -> str:
    """Load a saved adapter beside the ones ``model`` has, on the same base (no second copy of the weights), and
    make it the active one; ``model.set_adapter("default")`` switches back."""
    placement.require_model(model)
    model.load_adapter(require_adapter_folder(folder), adapter_name=name)
    model.set_adapter(name)
    return name


def merge(model):
    """Fold the adapters into the base weights (``merge_and_unload``). On a bf16 base the sum is rounded to bf16;
    on an NF4 base peft dequantizes, adds and quantizes again, so most of a small update is lost to the 4-bit grid."""
    placement.require_model(model)
    return model.merge_and_unload()


def require_adapter_folder(folder) -> Path:
    """``folder`` if it holds a saved adapter, else one sentence (peft's own error comes from deep in a load)."""
    if not isinstance(folder, (str, Path)) or not (Path(folder) / "adapter_model.safetensors").is_file():
        shown = str(folder) if isinstance(folder, (str, Path)) else repr(folder)
        raise ModelNotFoundError(f"No saved adapter at {shown} (no adapter_model.safetensors in it): save one with "
                                 f"fine_tuning.save_adapter(model, folder) first.")
    return Path(folder)


def adapter_bytes(folder) -> int:
    """Bytes of the saved adapter file (what you share instead of the whole model)."""
    return (require_adapter_folder(folder) / "adapter_model.safetensors").stat().st_size
