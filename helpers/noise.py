"""Messages a learner should not have to read: the expected ones, silenced where the course
triggers them, each explained once in the notebook that meets it. Anything else still shows."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

from .errors import InvalidChoiceError

# (the logger that says it, the message) for each expected message
# bitsandbytes' int8 matmul casts bf16 inputs to fp16 and logs it at every call (notebook 02)
INT8_CAST = ("bitsandbytes.autograd._functions", r"MatMul8bitLt: inputs will be cast")
# accelerate asked for the map of a GPU this machine does not have, on purpose (notebooks 02, 03)
ABSENT_DEVICE = ("accelerate.utils.modeling", r"Device \d+ is not available")
# on CPUs with AVX512-BF16, bitsandbytes looks for an optional faster 4-bit kernel from the `kernels`
# package when it is imported, and falls back to its own without it (CPU runs of the tiny model only)
NO_KERNELS_PACKAGE = ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community")

# dispatch_model warns about offloaded weights whenever a map has a "cpu" entry; the course's own lookups then take
# them back to the CPU, so the warning is false wherever the course made the map (load_model, notebook 09's step)
CPU_ENTRY_IN_MAP = ("accelerate.big_modeling", r"Some parameters are on the meta device")
# torch._dynamo.explain of a step with accelerate's hooks recompiles each hooked module kind (notebook 09)
HOOKED_RECOMPILES = ("torch._dynamo.convert_frame", r"hit config\.recompile_limit")
# torch 2.11 warns, at a profiler's start, that events do not carry across cycles; each of the course's profiles is
# one cycle (notebook 09)
PROFILER_ONE_CYCLE = ("torch.profiler.profiler", r"(Warning: )?Profiler clears events at the end of each cycle")
# torch's profiler library (kineto) in torch 2.12 and later writes a line at each profiler start and stop, from C++
# straight to the process's stderr (notebook 09)
PROFILER_MARKS = "USDT:"


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


@contextlib.contextmanager
def native_lines_dropped(prefix: str):
    """Drop the lines starting with ``prefix`` that native code writes to the process's stderr (file descriptor 2,
    which no Python filter sees) inside the block; every other line is written on to ``sys.stderr`` after it."""
    if not isinstance(prefix, str) or not prefix:
        raise InvalidChoiceError(f"prefix={prefix!r} is not the start of a line to drop; pass a non-empty string, "
                                 f"e.g. noise.PROFILER_MARKS.")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(prefix))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
