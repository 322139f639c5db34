"""One exception family for the course: every message is one sentence that names the fix, followed by
the link to its entry in docs/troubleshooting.md (``entry``: the heading's anchor; tests/test_troubleshooting.py
checks that every class has one and that it resolves)."""

import errno
import math
import numbers

from . import links


class CourseError(Exception):
    """Base class. ``str(err)`` is the whole message a learner needs, then where to read more."""

    entry = "every-course-error-is-one-sentence"

    @property
    def sentence(self) -> str:
        """The message without its link."""
        return super().__str__()

    @property
    def help_url(self) -> str:
        return links.troubleshooting(self.entry)

    def __str__(self) -> str:
        # the link goes inside the sentence, before its full stop, so the message stays one sentence
        sentence = self.sentence
        body, stop = (sentence[:-1], ".") if sentence.endswith(".") else (sentence, "")
        return f"{body} (help: {self.help_url}){stop}"


class ModelNotFoundError(CourseError):
    """A path that does not exist or a hub id that cannot be fetched."""

    entry = "model-not-found-or-gated"


class NotAGemma4CheckpointError(CourseError):
    """A folder that holds no Gemma 4 checkpoint."""

    entry = "not-a-gemma-4-checkpoint"


class NoPLETableError(CourseError):
    """``ple="cpu"`` asked of a model without ``embed_tokens_per_layer``."""

    entry = "no-ple-table"


class DeviceMapKeyError(CourseError):
    """A device-map key that matches no module (transformers ignores these silently)."""

    entry = "a-device-map-key-that-matches-no-module"


class CudaUnavailableError(CourseError):
    """CUDA asked for on a machine that has none."""

    entry = "no-cuda-cpu-only-torch"


class BitsandbytesMissingError(CourseError):
    """A quantization that needs bitsandbytes, which is not installed."""

    entry = "bitsandbytes-missing"


class InsufficientGPUMemoryError(CourseError):
    """The chosen placement does not fit on the card."""

    entry = "out-of-memory-at-load"


class HostMemoryError(CourseError):
    """Not enough free host RAM to pin a table the GPU should read in place."""

    entry = "not-enough-host-memory-to-pin-a-table"


class OutdatedTransformersError(CourseError):
    """A transformers release without Gemma 4."""

    entry = "transformers-too-old"


class LibraryClashError(CourseError):
    """Two installed releases that cannot be imported together (an older transformers beside a newer kernels)."""

    entry = "transformers-and-kernels-clash"


class InvalidChoiceError(CourseError):
    """An argument outside the choices the course supports."""

    entry = "an-argument-the-course-does-not-support"


def require_choice(value, allowed, what: str):
    """``value`` if it is one of ``allowed``, else one ``InvalidChoiceError`` sentence listing them."""
    if isinstance(value, str) and value in allowed:
        return value
    raise InvalidChoiceError(f"{what}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}.")


class CorruptCheckpointError(CourseError):
    """A weights file that is truncated, garbled or differs from its recorded checksum."""

    entry = "truncated-or-corrupt-checkpoint"


class UnwritableFolderError(CourseError):
    """A folder the course must write to (its cache, a build, a download) that it cannot write."""

    entry = "a-folder-the-course-cannot-write"


def require_bool(value, what: str) -> bool:
    """``value`` if it is ``True`` or ``False`` (not ``"yes"``, not ``1``)."""
    if isinstance(value, bool):
        return value
    raise InvalidChoiceError(f"{what}={value!r} is not supported; pass True or False.")


def brief(value) -> str:
    """``value`` as an error sentence shows it: its repr where short, else its type."""
    return repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"


def require_model(model, what: str = "model"):
    """``model`` if it is a torch module (a loaded model, a meta skeleton, a PEFT wrapper)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidChoiceError(f"{what}={brief(model)} is not a model; pass the model that load_model returned.")
    return model


def require_tokenizer(value, what: str = "tokenizer"):
    """``value`` if it is a transformers tokenizer, or a processor holding one (its ``.tokenizer``)."""
    from transformers import PreTrainedTokenizerBase

    if not isinstance(getattr(value, "tokenizer", value), PreTrainedTokenizerBase):
        raise InvalidChoiceError(f"{what}={brief(value)} is not a tokenizer or processor; pass what loading.load_tokenizer or "
                                 "loading.load_processor returned.")
    return value


def require_module_names(value, what: str = "keep_bf16") -> tuple:
    """A list or tuple of module names as a tuple; a bare string would be split into characters."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)) or not all(
            isinstance(name, str) and name for name in value):
        raise InvalidChoiceError(
            f"{what}={value!r} is not a list of module names; pass a list such as ['lm_head', 'model.vision_tower'].")
    return tuple(value)


def require_whole_number(value, what: str, *, minimum: int = 1, maximum: int | None = None, unit: str = "",
                         maximum_is: str = "") -> int:
    """``value`` as an int if it is a whole number in [minimum, maximum]; ``True`` and ``8500.5`` are not.
    ``maximum_is`` says where the maximum comes from."""
    unit_text = f" of {unit}" if unit else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidChoiceError(f"{what}={value!r} is not supported; pass a whole number{unit_text}, at least {minimum}.")
    if maximum is not None and value > maximum:
        source = f" ({maximum_is})" if maximum_is else ""
        raise InvalidChoiceError(f"{what}={value!r} is too large; pass a whole number{unit_text}, at most {maximum:,}{source}.")
    return int(value)


def require_number(value, what: str, *, minimum: float = 0.0) -> float:
    """``value`` if it is a finite real number of at least ``minimum`` (a size in bytes, a tolerance, a time)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= minimum):
        at_least = f", at least {minimum:g}" if math.isfinite(minimum) else ""
        raise InvalidChoiceError(f"{what}={value!r} is not supported; pass a finite number{at_least}.")
    return value


def require_positive_number(value, what: str) -> float:
    """``value`` if it is a real number above zero (``"8"`` and ``True`` are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
        raise InvalidChoiceError(f"{what}={value!r} is not supported; pass a number above zero, such as 8.")
    return value


class ChatMessageError(CourseError):
    """A chat message the processor would reject or read wrongly."""

    entry = "string-indices-must-be-integers-plain-string-content"


class LlamaCppMissingError(CourseError):
    """The llama.cpp route asked for without llama-cpp-python, gguf or llama.cpp's converter."""

    entry = "llamacpp-missing"


class SimulatedCardError(CourseError):
    """A ``CARD_GB`` that is not a card this GPU can stand in for."""

    entry = "card_gb-is-not-a-card-size"


class ChatTemplateError(CourseError):
    """A chat the template or processor cannot render."""

    entry = "template-errors"


class ReplyInProgressError(CourseError):
    """A chat asked for a new turn while the last reply is still streaming."""

    entry = "the-previous-reply-is-still-being-written"


class LlamaCppRouteError(CourseError):
    """llama.cpp's converter, quantizer or file reader refused a checkpoint."""

    entry = "llamacpp-refused-a-checkpoint"


class TunedDecodeError(CourseError):
    """The tuned decode (hooks off, static cache, CUDA graphs) asked of a model it cannot run on as loaded."""

    entry = "the-tuned-decode-refuses-a-model"


class SyntheticInitError(CourseError):
    """A model's init asks for something a synthetic build cannot draw the same on every machine."""

    entry = "a-synthetic-build-refuses-a-models-init"


class RecordFileError(CourseError):
    """A record file in data/ that is cut short or not JSON (a kill mid-write, a hand edit)."""

    entry = "a-record-file-is-cut-short-or-not-json"


class NoRecordError(RecordFileError, FileNotFoundError):
    """A record the course reads is not there: a model, quantization or route nobody has measured yet (a
    FileNotFoundError too, for code that waits for a record to appear)."""

    entry = "a-record-the-course-reads-is-not-there"


class DiskFullError(CourseError):
    """No space left for what the course writes: a download, a build, a conversion."""

    entry = "disk-full"


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit (FAT32, ulimit -f)


def is_no_room(error: BaseException) -> bool:
    """Whether ``error`` says the disk (or a quota, or a file-size limit) has no room for the write."""
    return isinstance(error, OSError) and error.errno in NO_ROOM
