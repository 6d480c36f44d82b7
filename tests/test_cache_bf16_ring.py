"""Method bf16's rolling window as a ring (KVCache bf16_rolling="ring", the default): a commit of a full window
moves no bytes, the next chunk takes the evicted chunk's slot, and everything a user sees (read, tokens, memory,
attention up to the order of its sums) equals the shifting cache (bf16_rolling="shift")."""
import pytest
import torch

from qvg.cache import KVCache

B, H, D, TPF, CF = 1, 2, 16, 8, 1
T = TPF * CF


def _cache(mode, sink, window, layers=1):
    return KVCache(layers, "bf16", chunk_frames=CF, tokens_per_frame=TPF, sink_frames=sink, window_frames=window,
                   bf16_rolling=mode)


def _steps(mode, sink, window, chunks=9):
    """Per chunk and layer: (attention of a step, attention of the re-run, read after the re-run, attention and read
    after the commit, memory); the cache at the end."""
    cache = _cache(mode, sink, window, layers=2)
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    seen = []
    for _ in range(chunks):
        for layer in range(2):
            cache.write(layer, rnd(B, H, T, D), rnd(B, H, T, D), transient=True)  # a denoising step
            a = cache.attend(layer, rnd(B, 2 * H, T, D))  # (GQA)
            cache.write(layer, rnd(B, H, T, D), rnd(B, H, T, D))  # the clean re-run
            seen.append((a, cache.attend(layer, rnd(B, 2 * H, T, D)), cache.read(layer)))
        cache.commit()
        for layer in range(2):  # (an attend with no current chunk: the ring's history is then split in two)
            seen.append((cache.attend(layer, rnd(B, 2 * H, T, D)), cache.read(layer), cache.memory(), cache.tokens()))
    return seen, cache


def _same(ring: list, shift: list) -> None:
    """What a ring cache and a shifting one gave, item by item: attention (tensors) up to BF16 rounding (the same
    tokens summed in slot order), reads (K, V pairs) bitwise, memory and token counts equal."""
    for x, y in zip(ring, shift, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x.float(), y.float(), atol=8e-3, rtol=0)
        elif isinstance(x, tuple):
            assert all(torch.equal(u, w) for u, w in zip(x, y))
        else:
            assert x == y


@pytest.mark.parametrize("sink,window", [(0, 3), (1, 3), (2, 2), (0, 1), (1, 0), (1, None)])
def test_ring_equals_shift(sink, window):
    ring, cr = _steps("ring", sink, window)
    shift, cs = _steps("shift", sink, window)
    for a, b in zip(ring, shift):
        _same(a, b)
    if window:  # the ring turned: 9 commits, sink chunks first, then one turn per commit past the window
        turns = 9 - sink - window
        assert [L.head for L in cr.layers] == [turns % (window + 1)] * 2
        assert all(L.head == 0 for L in cs.layers)


def test_a_full_window_commit_moves_nothing_and_the_next_chunk_takes_the_evicted_slot():
    cache = _cache("ring", 1, 2)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(6)]
    for x in chunks[:3]:  # sink, then a full window
        cache.write(0, x[0], x[1])
        cache.commit()
    L = cache.layers[0]
    for i, x in enumerate(chunks[3:], 3):
        cache.write(0, x[0], x[1])
        before = [b.clone() for b in L.buf]
        ptrs = [b.data_ptr() for b in L.buf]
        cache.commit()  # drops chunk i - 2
        assert [b.data_ptr() for b in L.buf] == ptrs and all(torch.equal(a, b) for a, b in zip(before, L.buf))
        evicted = chunks[i - 2]
        slot = L.cur_start()
        assert torch.equal(L.buf[0][:, :, slot:slot + T], evicted[0])  # the next write goes over the evicted chunk
        k, v = cache.read(0)
        assert torch.equal(k, torch.cat([chunks[0][0], chunks[i - 1][0], x[0]], 2))


def test_bad_rolling_mode():
    with pytest.raises(ValueError, match="bf16_rolling must be one of ring, shift"):
        _cache("roll", 0, 2)


@pytest.mark.parametrize("seed", range(10))
def test_ring_equals_shift_on_random_schedules(seed):
    """Random layouts and call orders (2-frame chunks, batch 2, sinks, windows, commit_every, pre-rope storage,
    per-layer commits, attends right after a commit, reset after the ring turned): the ring and the shift agree."""
    r = torch.Generator().manual_seed(seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=r))]  # noqa: E731
    cf, layers = 2, 2
    opts = dict(chunk_frames=cf, tokens_per_frame=4, sink_frames=cf * pick(0, 1, 2),
                window_frames=pick(None, 0, cf, 2 * cf, 4 * cf), commit_every=pick(1, 2),
                key_storage=pick("post-rope", "pre-rope"))
    caches = [KVCache(layers, "bf16", bf16_rolling=m, **opts) for m in ("ring", "shift")]
    g = torch.Generator().manual_seed(100 + seed)
    for step in range(12):
        if step == 8 and pick(True, False):
            for c in caches:
                c.reset()
        kv = [torch.randn(2, 2, 2, 8, 8, generator=g).to(torch.bfloat16) for _ in range(layers)]
        q = torch.randn(2, 4, 8, 8, generator=g).to(torch.bfloat16)
        per_layer = pick(True, False)
        outs = []
        for c in caches:
            got = []
            for layer in range(layers):
                c.write(layer, kv[layer][0], kv[layer][1])
                got.append(c.attend(layer, q))
                if per_layer:
                    c.commit_layer(layer)
                    got.append(c.read(layer))
            c.commit()
            got += [c.attend(layer, q) for layer in range(layers)] + [c.read(layer) for layer in range(layers)]
            got += [c.memory(), c.tokens()]
            outs.append(got)
        _same(*outs)
