"""Expected library messages are silenced where the course triggers them; everything else still shows."""

import logging

from helpers import noise


def test_the_int8_cast_message_is_dropped_inside_the_block_and_a_new_message_still_shows(caplog):
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    with caplog.at_level(logging.WARNING), noise.silenced(noise.INT8_CAST):
        logger.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.bfloat16")
        logger.warning("something new went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something new went wrong"]


def test_outside_the_block_nothing_is_silenced(caplog):
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    with noise.silenced(noise.INT8_CAST):
        pass
    with caplog.at_level(logging.WARNING):
        logger.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.bfloat16")
    assert len(caplog.records) == 1


def test_a_native_line_with_the_profilers_mark_is_dropped_and_every_other_native_line_still_shows(capfd):
    """What C++ writes to the process's stderr bypasses every Python filter: kineto's start and stop marks are
    dropped there, inside the block only; the same lines written outside it are the control."""
    import os

    with noise.native_lines_dropped(noise.PROFILER_MARKS):
        os.write(2, b"USDT:2026-12-08 SyncActivityProfilerHandler.cpp:52] profiler_start\nCUPTI said something new\n")
    inside = capfd.readouterr().err
    os.write(2, b"USDT:2026-12-08 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    outside = capfd.readouterr().err
    assert "USDT:" not in inside and "CUPTI said something new" in inside
    assert "profiler_start" in outside


def test_an_error_inside_the_native_filter_gives_stderr_back_and_keeps_the_other_lines(capfd):
    import os

    import pytest

    with pytest.raises(RuntimeError), noise.native_lines_dropped(noise.PROFILER_MARKS):
        os.write(2, b"kept before the error\n")
        raise RuntimeError("inside")
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err
    assert "kept before the error" in err and "after the block" in err


def test_the_profilers_one_cycle_warning_is_dropped_and_another_profiler_warning_still_shows():
    import warnings

    one_cycle = ("Warning: Profiler clears events at the end of each cycle. Only events from the current cycle will "
                 "be reported. To keep events across cycles, set acc_events=True.")  # torch 2.11's profiler.py
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with noise.silenced(noise.PROFILER_ONE_CYCLE):
            warnings.warn(one_cycle, UserWarning, stacklevel=1)
            warnings.warn("Profiler found no CUDA kernels", UserWarning, stacklevel=1)
        warnings.warn(one_cycle, UserWarning, stacklevel=1)  # the control: outside the block it shows
    assert [str(w.message) for w in shown] == ["Profiler found no CUDA kernels", one_cycle]


def test_a_native_filter_with_no_prefix_is_refused_in_one_sentence_before_stderr_is_touched():
    import pytest

    from helpers.errors import CourseError

    for prefix in ("", None, b"USDT:"):
        with pytest.raises(CourseError, match="non-empty string"), noise.native_lines_dropped(prefix):
            pass
