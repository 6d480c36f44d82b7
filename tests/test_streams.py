"""qvg/streams.py: the generation stream (a no-op on CPU; on CUDA: the block off the default stream, handed over
both ways) and the cache's side streams never being it."""
import contextlib

import pytest
import torch

from qvg.streams import generation_stream, reserved

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_block_changes_nothing():
    with generation_stream("cpu") as s:
        assert s is None
        x = torch.ones(3) * 2
    assert x.sum().item() == 6


def test_green_stream_without_green_contexts_is_one_clear_error(monkeypatch):
    """Where torch has no green contexts with streams (CPU builds, older torch), green_stream says so."""
    from torch.cuda import green_contexts

    from qvg.streams import green_stream
    monkeypatch.setattr(green_contexts, "SUPPORTED", False)
    with pytest.raises(RuntimeError, match="green contexts with streams are not available in torch"):
        green_stream("cuda:0", 16)


@cuda
def test_green_stream_runs_in_order_with_the_caller():
    """Work on a green context's stream follows the usual stream handshakes (CUDA: skipped where torch has no green
    contexts with streams)."""
    from qvg.streams import green_stream
    try:
        g = green_stream("cuda", 16)
    except RuntimeError as e:
        pytest.skip(str(e))
    assert green_stream("cuda", 16) is g  # (one per device and SM count)
    a = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(200_000_000)
    a.add_(1)
    g.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(g):
        b = a * 3
    torch.cuda.current_stream().wait_stream(g)
    assert b.sum().item() == 3 * a.numel()


@cuda
def test_block_runs_on_its_own_stream_in_order():
    default = torch.cuda.default_stream()
    a = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(200_000_000)  # (the default stream busy for a while: a missing wait would read zeros below)
    a.add_(1)  # queued on the default stream before the block
    with generation_stream("cuda") as s:
        assert torch.cuda.current_stream() == s != default and reserved("cuda") == s
        torch.cuda._sleep(200_000_000)  # (and the block's stream: a missing wait on exit would read b unwritten)
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


class _FakeStream:
    """Records the handoffs (CPU: the CUDA calls of qvg.streams replaced by fakes)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def test_handoffs_both_ways_on_entry_and_exit_exceptions_included(monkeypatch):
    from qvg import streams
    log, current = [], []
    default = _FakeStream("default", log)
    made = []

    def new_stream(index):
        made.append(_FakeStream(f"gen{index}", log))
        return made[-1]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()
    monkeypatch.setattr(streams, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current[-1] if current else default)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda index=None: default)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    with streams.generation_stream("cuda") as s:
        assert current == [s] and s.name == "gen0" and streams.reserved("cuda:0") is s
        with streams.generation_stream("cuda:0") as inner:  # already off the default stream: unchanged
            assert inner is s
    assert log == ["gen0 waits for default", "default waits for gen0"] and current == []
    log.clear()
    with pytest.raises(KeyError):
        with streams.generation_stream("cuda"):
            raise KeyError("boom")
    assert log == ["gen0 waits for default", "default waits for gen0"] and current == [] and len(made) == 1
    mine = _FakeStream("mine", log)
    log.clear()
    with on(mine), streams.generation_stream("cuda") as kept:  # a caller's own stream is kept, no handoff
        assert kept is mine
    assert log == []


def test_side_stream_draws_skip_the_current_and_the_generation_stream(monkeypatch):
    from qvg import cache as cache_mod
    from qvg import streams
    cur, gen, other = (_FakeStream(n, []) for n in ("current", "gen", "other"))
    draws = iter([cur, gen, other])  # the pool's next draws: the chunk's stream, the generation stream, a free one
    monkeypatch.setattr(streams, "_STREAMS", {0: gen})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: cur)
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev=None: next(draws))
    held = {}
    assert cache_mod._stream(held, torch.device("cuda")) is other
    assert cache_mod._stream(held, torch.device("cuda")) is other  # made once


def test_dropped_or_reset_caches_make_the_generation_stream_wait_too(monkeypatch):
    """Blocks of a cache freed outside the pipeline's block go back to the generation stream's pool: that stream
    waits for the cache's side streams as well as the current one (once when they are the same)."""
    from qvg import cache as cache_mod
    from qvg import streams
    log = []
    default, gen, side = (_FakeStream(n, log) for n in ("default", "gen", "side"))
    monkeypatch.setattr(streams, "_STREAMS", {0: gen})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for current, want in ((default, ["default waits for side", "gen waits for side"]), (gen, ["gen waits for side"])):
        log.clear()
        monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None, c=current: c)
        cache_mod._owners_wait({torch.device("cuda", 0): side})
        assert log == want


def test_the_pipeline_runs_each_chunk_inside_the_block_and_leaves_it_before_yielding(monkeypatch):
    from qvg.cache import KVCache
    from qvg.pipelines import self_forcing
    from qvg.pipelines.tiny import build_tiny
    tr, _, text = build_tiny(seed=0)
    inside, events = [], []

    @contextlib.contextmanager
    def block(dev):
        events.append(("enter", str(dev)))
        inside.append(True)
        try:
            yield None
        finally:
            inside.pop()
            events.append(("exit",))
    monkeypatch.setattr(self_forcing, "generation_stream", block)
    hook = tr.register_forward_pre_hook(lambda *_: events.append(("forward", bool(inside))))
    try:
        cache = KVCache(len(tr.blocks), "qvg", chunk_frames=3, tokens_per_frame=16, centroids=8)
        for _ in self_forcing.SelfForcingPipeline(tr).generate(text("a prompt"), 6, (8, 8), cache, seed=3):
            assert not inside  # the caller's code runs outside the block
            events.append(("yield",))
    finally:
        hook.remove()
    one_chunk = [("enter", "cpu")] + [("forward", True)] * 5 + [("exit",), ("yield",)]
    assert events == one_chunk * 2
