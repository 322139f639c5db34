"""One exception family for the course: every message is one sentence that names the fix."""


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


class ChatMessageError(CourseError):
    """A chat message the processor would reject or read wrongly."""


class LlamaCppMissingError(CourseError):
    """The llama.cpp route asked for without llama-cpp-python, gguf or llama.cpp's converter."""
