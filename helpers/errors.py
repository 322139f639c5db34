"""One exception family for the course: every message is one sentence that names the fix."""

import math
import numbers


class CourseError(Exception):
    """Base class. ``str(err)`` is the whole message a learner needs."""


class ModelNotFoundError(CourseError):
    """A path that does not exist or a hub id that cannot be fetched."""


class NotAGemma4CheckpointError(CourseError):
    """A folder that holds no Gemma 4 checkpoint."""


class NoPLETableError(CourseError):
    """``ple="cpu"`` asked of a model without ``embed_tokens_per_layer``."""


class DeviceMapKeyError(CourseError):
    """A device-map key that matches no module (transformers ignores these silently)."""


class CudaUnavailableError(CourseError):
    """CUDA asked for on a machine that has none."""


class BitsandbytesMissingError(CourseError):
    """A quantization that needs bitsandbytes, which is not installed."""


class InsufficientGPUMemoryError(CourseError):
    """The chosen placement does not fit on the card."""


class OutdatedTransformersError(CourseError):
    """A transformers release without Gemma 4."""


class InvalidChoiceError(CourseError):
    """An argument outside the choices the course supports."""


def require_choice(value, allowed, what: str):
    """``value`` if it is one of ``allowed``, else one ``InvalidChoiceError`` sentence listing them."""
    if isinstance(value, str) and value in allowed:
        return value
    raise InvalidChoiceError(f"{what}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}.")


class CorruptCheckpointError(CourseError):
    """A weights file that is truncated, garbled or differs from its recorded checksum."""


class UnwritableFolderError(CourseError):
    """A folder the course must write to (its cache, a build, a download) that it cannot write."""


def require_bool(value, what: str) -> bool:
    """``value`` if it is ``True`` or ``False`` (not ``"yes"``, not ``1``)."""
    if isinstance(value, bool):
        return value
    raise InvalidChoiceError(f"{what}={value!r} is not supported; pass True or False.")


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


def require_positive_number(value, what: str) -> float:
    """``value`` if it is a real number above zero (``"8"`` and ``True`` are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
        raise InvalidChoiceError(f"{what}={value!r} is not supported; pass a number above zero, such as 8.")
    return value


class ChatMessageError(CourseError):
    """A chat message the processor would reject or read wrongly."""


class LlamaCppMissingError(CourseError):
    """The llama.cpp route asked for without llama-cpp-python, gguf or llama.cpp's converter."""
