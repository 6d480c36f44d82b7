"""qvg/streams.py: the generation stream (a no-op on CPU; on CUDA: the block off the default stream, handed over
both ways) and the cache's side streams never being it."""
import pytest
import torch

from qvg.streams import generation_stream, reserved

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_block_changes_nothing():
    with generation_stream("cpu") as s:
        assert s is None
        x = torch.ones(3) * 2
    assert x.sum().item() == 6


@cuda
def test_block_runs_on_its_own_stream_in_order():
    default = torch.cuda.default_stream()
    a = torch.zeros(1 << 22, device="cuda")
    a.add_(1)  # queued on the default stream before the block
    with generation_stream("cuda") as s:
        assert torch.cuda.current_stream() == s != default and reserved("cuda") == s
        b = a * 3  # waits for the add
        with generation_stream("cuda") as inner:  # already off the default stream: unchanged
            assert inner == s
    c = b + 1  # the default stream waits for the block
    assert torch.cuda.current_stream() == default
    assert torch.equal(c, torch.full_like(c, 4))
    with pytest.raises(RuntimeError, match="boom"):
        with generation_stream("cuda"):
            raise RuntimeError("boom")
    assert torch.cuda.current_stream() == default
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine), generation_stream("cuda") as kept:  # a caller's own stream is kept
        assert kept == mine


def _next_draw_is(target):
    """Draw from torch's stream pool (32 streams handed out in turn) until its next draw is `target`."""
    for _ in range(33):
        if torch.cuda.Stream() == target:
            break
    else:
        raise AssertionError("target is not a pool stream")
    for _ in range(31):
        torch.cuda.Stream()


@cuda
def test_cache_side_streams_skip_the_stream_the_chunk_runs_on():
    from qvg.cache import _stream
    with generation_stream("cuda") as gen:
        pass
    _next_draw_is(gen)  # on the default stream: the generation stream is still avoided
    side = _stream({}, torch.device("cuda"))
    assert side not in (gen, torch.cuda.default_stream())
    mine = torch.cuda.Stream()
    _next_draw_is(mine)
    with torch.cuda.stream(mine):  # the current stream is avoided
        side = _stream({}, torch.device("cuda"))
    assert side not in (gen, mine)
