"""GPU tier: the shaped synthetic checkpoints built on the GPU box are the bytes recorded in data/builds/ (built on
another machine, by `python -m helpers.synthetic SHAPE --force --record`): every machine gets the same weights."""

import pytest
import torch

from helpers import synthetic

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shape", ["tiny", "e2b-shape", "e4b-shape"])
def test_a_shaped_build_on_this_machine_is_the_recorded_bytes(shape):
    recorded = synthetic.recorded_weights_sha256(shape)
    assert recorded, f"no sha256 recorded for {shape}: run python -m helpers.synthetic {shape} --force --record"
    assert synthetic.weights_sha256(synthetic.build(shape)) == recorded
