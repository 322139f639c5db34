"""Messages a learner should not have to read: the expected ones, silenced where the course
triggers them, each explained once in the notebook that meets it. Anything else still shows."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

# (the logger that says it, the message) for each expected message
# bitsandbytes' int8 matmul casts bf16 inputs to fp16 and logs it at every call (notebook 02)
INT8_CAST = ("bitsandbytes.autograd._functions", r"MatMul8bitLt: inputs will be cast")
# accelerate asked for the map of a GPU this machine does not have, on purpose (notebooks 02, 03)
ABSENT_DEVICE = ("accelerate.utils.modeling", r"Device \d+ is not available")
# on CPUs with AVX512-BF16, bitsandbytes looks for an optional faster 4-bit kernel from the `kernels`
# package when it is imported, and falls back to its own without it (CPU runs of the tiny model only)
NO_KERNELS_PACKAGE = ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community")

# dispatch_model warns about offloaded weights whenever a map has a "cpu" entry, none offloaded or not (notebook 09)
CPU_ENTRY_IN_MAP = ("accelerate.big_modeling", r"Some parameters are on the meta device")
# torch._dynamo.explain of a step with accelerate's hooks recompiles each hooked module kind (notebook 09)
HOOKED_RECOMPILES = ("torch._dynamo.convert_frame", r"hit config\.recompile_limit")


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def silenced(*expected):
    """Drop the given (logger name, message pattern) pairs, from logging and from warnings, inside
    the block only. The logger is created if its module is not imported yet, so a message logged at
    import time is caught too."""
    handlers = []
    with warnings.catch_warnings():
        for logger_name, pattern in expected:
            warnings.filterwarnings("ignore", message=pattern)
            drop = _Drop(pattern)
            logger = logging.getLogger(logger_name)
            logger.addFilter(drop)
            handlers.append((logger, drop))
        try:
            yield
        finally:
            for logger, drop in handlers:
                logger.removeFilter(drop)
