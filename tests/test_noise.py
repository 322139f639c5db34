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
