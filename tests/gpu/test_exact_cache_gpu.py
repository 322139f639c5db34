"""GPU tier, issue 31: the static cache's write of one decode token in one Triton kernel (helpers.exact_cache)
leaves E4B's cache layers as transformers' own update does on CUDA, beside a control one slot off."""

import copy
import types

import pytest
import torch

from helpers import decoding, exact_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# E4B's and E2B's key-value heads and head dims of the layers that write (sliding: 256, full: 512)
SHAPES = ((2, 256), (2, 512), (1, 256), (1, 512))


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("heads, d", SHAPES)
def test_the_one_launch_write_leaves_the_cache_as_the_librarys_update_on_cuda_and_one_slot_off_is_told_apart(kind, heads, d):
    pytest.importorskip("triton", reason="PyTorch's CUDA wheels bring triton")
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    gen = torch.Generator(device="cuda").manual_seed(heads * d)
    states = lambda n: [torch.randn(1, heads, n, d, device="cuda", generator=gen).bfloat16() for _ in range(2)]  # noqa: E731
    library = (StaticLayer(max_cache_len=64) if kind == "full"
               else StaticSlidingWindowLayer(max_cache_len=64, sliding_window=64))
    library.update(*states(32))
    ours = copy.deepcopy(library)
    assert decoding.write_tokens_in_one_launch(types.SimpleNamespace(layers=[ours])) == 1  # the decoder's own swap
    assert isinstance(ours, decoding.ONE_LAUNCH_LAYERS)
    for _ in range(31):
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in states(1))  # the attention's head layout
        assert exact_cache.writable(ours, k, v)
        nudged = copy.deepcopy(ours)
        nudged.cumulative_length.add_(1)
        want = library.update(k, v)
        assert not torch.equal(nudged.update(k, v)[0].view(torch.int16), want[0].view(torch.int16))  # the control
        got = ours.update(k, v)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got))
        assert torch.equal(library.cumulative_length, ours.cumulative_length)
    assert torch.count_nonzero(ours.keys[:, :, 32:63]) > 0.9 * heads * 31 * d  # the steps wrote what was compared
