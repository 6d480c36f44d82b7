"""qvg.cache.KVCache: zones, commit / pack / evict bookkeeping, streaming warm start, attention and accounting."""
import pytest
import torch

import qvg.compression
from qvg.cache import CACHE_METHODS, KVCache
from qvg.sequence import PackedSequence

B, H, D, TPF, CF = 1, 2, 64, 16, 2  # batch, kv heads, head dim, tokens per frame, frames per chunk
T = TPF * CF  # tokens per chunk
SMALL = {"qvg": dict(centroids=8), "qvg-pro": dict(centroids=8), "kivi": dict(), "rtn": dict(), "quarot": dict(),
         "bf16": dict()}


COMPONENTS = ("codes", "scales", "ids", "centroids", "positions", "bf16", "workspace")  # memory()'s parts of total
ZONES = ("bf16_sink", "bf16_pending", "bf16_current", "bf16_residual")  # memory()'s parts of bf16


def _chunk(i, layers=1, scale=1.0):
    g = torch.Generator().manual_seed(100 + i)
    base = torch.randn(layers, 2, B, H, 1, D, generator=g) * 2  # a per-chunk offset: tokens cluster
    x = base + torch.randn(layers, 2, B, H, T, D, generator=g) * scale
    return x.to(torch.bfloat16)


def _query(seed=7):
    return torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _run(cache, n_chunks, layers=1):
    """Commit n_chunks chunks (each written twice: a noisy step, then the clean re-run), return the clean ones."""
    clean = []
    for i in range(n_chunks):
        x = _chunk(i, layers)
        for layer in range(layers):
            cache.write(layer, x[layer, 0] + 5, x[layer, 1] - 5)  # a denoising step's K/V, overwritten below
            cache.write(layer, x[layer, 0], x[layer, 1])
        cache.commit()
        clean.append(x)
    return clean


def _full_attention(q, ks, vs):
    k, v = torch.cat(ks, 2).float(), torch.cat(vs, 2).float()
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v)


def test_bf16_cache_equals_attention_over_everything_written():
    cache = KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF)
    clean = _run(cache, 3, layers=2)
    cur = _chunk(9, layers=2)
    q = _query()
    for layer in range(2):
        cache.write(layer, cur[layer, 0], cur[layer, 1])
        want = _full_attention(q, [c[layer, 0] for c in clean] + [cur[layer, 0]],
                               [c[layer, 1] for c in clean] + [cur[layer, 1]])
        torch.testing.assert_close(cache.attend(layer, q).float(), want, atol=2e-2, rtol=2e-2)
        k, v = cache.read(layer)
        assert torch.equal(k, torch.cat([c[layer, 0] for c in clean] + [cur[layer, 0]], 2))
    assert cache.frames == 3 * CF and cache.tokens() == 4 * T
    mem = cache.memory()
    assert mem["total"] == mem["bf16"] == mem["bf16_equivalent"] and mem["compression_ratio"] == 1.0


@pytest.mark.parametrize("method", ["bf16", "qvg"])
def test_rolling_window_keeps_the_sink_and_the_latest_frames(method):
    cache = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF,
                    **SMALL[method])
    clean = _run(cache, 6)
    assert cache.tokens() == T + 2 * T  # sink + window, nothing current
    k, _ = cache.read(0)
    want = torch.cat([clean[0][0, 0], clean[4][0, 0], clean[5][0, 0]], 2)
    assert k.shape == want.shape
    assert torch.equal(k[:, :, :T], want[:, :, :T])  # the sink stays BF16, exactly
    err = (k.float() - want.float()).norm() / want.float().norm()
    assert err < (1e-6 if method == "bf16" else 0.25), err
    assert cache.frames == 6 * CF


@pytest.mark.parametrize("method", ["qvg", "qvg-pro", "rtn"])
def test_a_layers_k_and_v_history_share_one_allocation(method):
    """While the history grows, each layer's K and V sequences live in one allocation (the caching allocator
    rounds each large block up by as much as 1 MiB: one block per layer, not two), and stay there in the ring."""
    cache = KVCache(2, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, **SMALL[method])
    for n in (1, 2, 2):  # growth, growth, then ring commits
        _run(cache, n, layers=2)
        for L in cache.layers:
            assert len({t.untyped_storage().data_ptr() for h in L.hist for t in h.tensors.values()}) == 1


@pytest.mark.parametrize("method,every", [("qvg", 1), ("qvg-pro", 1), ("rtn", 1), ("qvg", 2)])
def test_full_window_commits_in_place(method, every, monkeypatch):
    """Once the rolling window is full, a commit overwrites the evicted unit's slot (the history's storage stays
    put) and holds what append-then-evict held: the same decoded history, the same bytes, attention equal up to
    summation order."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF * every,
              commit_every=every, **SMALL[method])
    ring = KVCache(1, method, **kw)
    _run(ring, 1 + 2 * every)
    ptr = ring.layers[0].hist[0].tensors["codes"].data_ptr()
    _run(ring, 3 * every)
    assert ring.layers[0].hist[0].tensors["codes"].data_ptr() == ptr and ring.layers[0].hist[0].head
    monkeypatch.setattr(PackedSequence, "replace_oldest",  # the old path: append, then evict
                        lambda self, chunk: self.append(chunk).drop_first(1))
    plain = KVCache(1, method, **kw)
    _run(plain, 1 + 2 * every)
    _run(plain, 3 * every)
    for a, b in zip(ring.read(0), plain.read(0)):
        assert torch.equal(a, b)
    assert ring.memory()["total"] == plain.memory()["total"]
    q = _query()
    for c in (ring, plain):
        c.write(0, *_chunk(99)[0])
    torch.testing.assert_close(ring.attend(0, q), plain.attend(0, q), atol=2e-2, rtol=0)


def test_commit_every_k_chunks_keeps_them_pending_in_bf16():
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, commit_every=2, **SMALL["qvg"])
    clean = _run(cache, 1)
    L = cache.layers[0]
    assert L.hist[0] is None and L.n_pending == T
    k, _ = cache.read(0)
    assert torch.equal(k, clean[0][0, 0])  # still exact
    _run(cache, 1)
    assert L.n_pending == 0 and L.hist[0].num_chunks == 1 and L.hist[0].chunk_len == 2 * T
    _run(cache, 3)
    assert L.hist[0].num_chunks == 2 and L.n_pending == T


def test_streaming_warm_start_uses_the_previous_units_centroids(monkeypatch):
    seen = []
    real = qvg.compression.compress

    def spy(x, method, **kw):
        seen.append(kw.get("init"))
        return real(x, method, **kw)
    monkeypatch.setattr(qvg.compression, "compress", spy)
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=CF, **SMALL["qvg"])
    _run(cache, 1)
    assert seen == [None, None]  # the first unit starts cold (K and V)
    first = [h.last_centroids().clone() for h in cache.layers[0].hist]
    _run(cache, 1)  # from the live history
    assert torch.equal(seen[2], first[0]) and torch.equal(seen[3], first[1])
    assert cache.layers[0].hist[0].num_chunks == 1


def test_warm_start_survives_eviction_of_the_whole_history(monkeypatch):
    seen = []
    real = qvg.compression.compress
    monkeypatch.setattr(qvg.compression, "compress", lambda x, m, **kw: seen.append(kw.get("init")) or real(x, m, **kw))
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=0, **SMALL["qvg"])
    _run(cache, 1)
    L = cache.layers[0]
    assert L.hist[0] is None and L.warm[0] is not None  # evicted at once, its centroids kept (and counted)
    kept = [w.clone() for w in L.warm]
    assert cache.memory()["centroids"] == sum(w.numel() * w.element_size() for w in L.warm)
    _run(cache, 1)
    assert torch.equal(seen[2], kept[0]) and torch.equal(seen[3], kept[1])


def test_window_with_multi_chunk_units_never_drops_below_the_window():
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, commit_every=2,
                    **SMALL["qvg"])
    past = []
    for i in range(8):
        _run(cache, 1)
        past.append(cache.tokens() // T)
    assert past[:2] == [1, 2] and min(past[2:]) >= 2 and max(past) <= 3, past


@pytest.mark.parametrize("method", ["bf16", "qvg"])
def test_commit_layer_then_commit_equals_commit(method):
    """Committing each layer right after its last write (as the model's clean re-run does) leaves the same cache
    as one commit() at the end, with a window so that eviction runs too; a committed layer takes no new write
    until commit(), and commits once."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF, **SMALL[method])
    a, b = KVCache(2, method, **kw), KVCache(2, method, **kw)
    _run(a, 5, layers=2)
    for i in range(5):
        x = _chunk(i, layers=2)
        for layer in range(2):
            b.write(layer, x[layer, 0], x[layer, 1])
            b.commit_layer(layer)
            with pytest.raises(RuntimeError, match="commit_layer"):
                b.write(layer, x[layer, 0], x[layer, 1])
            with pytest.raises(RuntimeError, match="committed already"):
                b.commit_layer(layer)
        b.commit()
    assert (a.frames, a.commits, a.tokens(1)) == (b.frames, b.commits, b.tokens(1))
    assert a.memory() == b.memory()
    for layer in range(2):
        for x, y in zip(a.read(layer), b.read(layer)):
            assert torch.equal(x, y)


def test_overwrite_only_the_last_write_is_committed():
    cache = KVCache(1, "bf16", chunk_frames=CF, tokens_per_frame=TPF)
    clean = _run(cache, 1)
    k, v = cache.read(0)
    assert torch.equal(k, clean[0][0, 0]) and torch.equal(v, clean[0][0, 1])


def test_qvg_int8_is_close_to_bf16():
    ref = KVCache(1, "bf16", chunk_frames=CF, tokens_per_frame=TPF)
    q8 = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, bits=8, centroids=8)
    _run(ref, 3)
    _run(q8, 3)
    q = _query()
    cur = _chunk(7)
    for c in (ref, q8):
        c.write(0, cur[0, 0], cur[0, 1])
    a, b = ref.attend(0, q).float(), q8.attend(0, q).float()
    assert ((a - b).norm() / a.norm()) < 1e-2
    assert q8.memory()["compression_ratio"] > 1.15  # (1.196: INT8 + tables, and the arrays' 256-byte alignment)


@pytest.mark.parametrize("method", CACHE_METHODS)
def test_every_method_attends_and_accounts(method):
    cache = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, **SMALL[method])
    clean = _run(cache, 3)
    q = _query()
    cur = _chunk(8)
    cache.write(0, cur[0, 0], cur[0, 1])
    want = _full_attention(q, [c[0, 0] for c in clean] + [cur[0, 0]], [c[0, 1] for c in clean] + [cur[0, 1]])
    got = cache.attend(0, q).float()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()) < 0.35, method
    mem = cache.memory()
    parts = sum(v for k, v in mem.items() if k in COMPONENTS)
    assert parts == mem["total"]
    assert sum(mem[z] for z in ZONES) == mem["bf16"]
    L = cache.layers[0]  # the bytes of every allocation the layer holds (a packed sequence's arrays share one,
    arrays = list(L.buf) + [t for h in L.hist if h is not None  # their alignment padding included: it was left out)
                            for t in (h.tensors.values() if hasattr(h, "tensors") else
                                      [t for p in h for t in p.tensors.values()])]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in arrays}
    assert mem["total"] == sum(held.values())
    assert mem["bf16_equivalent"] == 2 * B * H * D * 2 * 4 * T


def test_memory_splits_bf16_by_zone():
    """bf16_sink: the sink's tokens; bf16_pending: the chunks waiting for commit_every; bf16_current: the rest of
    the buffers (the current chunk's slot, and the room left when a unit is packed). They sum to bf16 exactly, and
    total stays the sum of the components alone."""
    per_token = 2 * B * H * D * 2  # K and V in BF16
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, commit_every=2, **SMALL["qvg"])
    _run(cache, 2)  # chunk 0 fills the sink, chunk 1 waits for a second chunk
    cur = _chunk(9)
    cache.write(0, cur[0, 0], cur[0, 1])
    mem = cache.memory()
    assert [mem[z] for z in ZONES] == [T * per_token, T * per_token, T * per_token, 0]
    assert sum(mem[z] for z in ZONES) == mem["bf16"] and sum(mem[c] for c in COMPONENTS) == mem["total"]
    cache.commit()  # chunks 1 and 2 packed as one unit: the buffers keep their room for two chunks
    mem = cache.memory()
    assert [mem[z] for z in ZONES] == [T * per_token, 0, 2 * T * per_token, 0] and mem["codes"] > 0
    assert sum(mem[z] for z in ZONES) == mem["bf16"] and sum(mem[c] for c in COMPONENTS) == mem["total"]


def test_memory_counts_kivis_full_precision_tail_as_bf16_residual():
    """KIVI keeps the key tokens that fill no token group (here 40 per chunk, groups of 32) in 16 bits inside its
    packed units: part of bf16, in its own zone."""
    cache = KVCache(1, "kivi", chunk_frames=2, tokens_per_frame=20)
    for i in range(2):
        x = torch.randn(2, B, H, 40, D, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        cache.write(0, x[0], x[1])
        cache.commit()
    mem = cache.memory()
    residual = sum(p.tensors["residual"].nbytes for p in cache.layers[0].hist[0])
    assert mem["bf16_residual"] == residual == 2 * B * H * 8 * D * 2  # 2 units x 8 key tokens (values: none)
    assert sum(mem[z] for z in ZONES) == mem["bf16"] and sum(mem[c] for c in COMPONENTS) == mem["total"]


def test_reset_holds_no_bytes_and_starts_over():
    """reset() forgets the zones, the history and the compression graphs' workspace (on CPU there are no graphs:
    a stand-in entry checks that reset drops them and their bytes); the reset cache then works like a new one."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF, commit_every=2,
              **SMALL["qvg"])
    cache = KVCache(1, "qvg", **kw)
    _run(cache, 5)
    cache._graphed._graphs["stand-in"], cache._graphed.nbytes = {}, 4096
    assert cache.memory()["workspace"] == 4096 and cache.memory()["total"] > 4096
    cache.reset()
    mem = cache.memory()
    assert all(mem[k] == 0 for k in (*COMPONENTS, *ZONES, "total", "bf16_equivalent")), mem
    assert not cache._graphed._graphs and (cache.frames, cache.commits, cache.tokens()) == (0, 0, 0)
    fresh = KVCache(1, "qvg", **kw)
    _run(cache, 3)
    _run(fresh, 3)
    assert cache.memory() == fresh.memory()
    for a, b in zip(cache.read(0), fresh.read(0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", sorted(SMALL))
def test_reads_count_history_reads_by_the_path_that_ran(method):
    """KVCache.reads: one count per attend that read a compressed history. On CPU that is the torch path
    ("reference") for every compressing method; bf16 holds no compressed history and counts nothing, and neither
    does an attend before the first commit. reset() clears the counts."""
    cache = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, **SMALL[method])
    q = torch.randn(B, H, CF * TPF, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for i in range(3):
        x = _chunk(i)
        cache.write(0, x[0, 0], x[0, 1])
        cache.attend(0, q)
        cache.commit()
    assert cache.reads == ({} if method == "bf16" else {"reference": 2})
    cache.reset()
    assert cache.reads == {}


def test_deterministic():
    outs = []
    for _ in range(2):
        cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, **SMALL["qvg"])
        _run(cache, 2)
        outs.append(cache.read(0)[0])
    assert torch.equal(outs[0], outs[1])


def test_bad_input():
    with pytest.raises(ValueError, match="unknown cache method"):
        KVCache(1, "fp4", chunk_frames=CF, tokens_per_frame=TPF)
    with pytest.raises(ValueError, match="multiple of chunk_frames"):
        KVCache(1, "qvg", chunk_frames=3, tokens_per_frame=TPF, sink_frames=1)
    with pytest.raises(ValueError, match="positive integer"):
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, commit_every=0)
    with pytest.raises(ValueError, match="takes no options"):
        KVCache(1, "bf16", chunk_frames=CF, tokens_per_frame=TPF, bits=2)
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, **SMALL["qvg"])
    with pytest.raises(RuntimeError, match="write it first"):
        cache.commit()
    with pytest.raises(RuntimeError, match="holds nothing"):
        cache.attend(0, torch.randn(B, H, T, D))
    with pytest.raises(ValueError, match="expects k and v"):
        cache.write(0, torch.randn(B, H, T + 1, D), torch.randn(B, H, T + 1, D))
    _run(cache, 1)
    with pytest.raises(ValueError, match="do not match"):
        cache.write(0, torch.randn(B, H + 1, T, D), torch.randn(B, H + 1, T, D))


def test_bf16_equivalent_is_what_a_bf16_cache_holds_between_chunks():
    """Between chunks a BF16 cache holds its history only; a compressed cache also keeps the current chunk's BF16
    slot. That slot is bytes the compressed cache holds, not BF16-equivalent bytes: its equivalent equals the
    BF16 cache's total at the same moment (no inflated ratio on short videos)."""
    B, H, D, T = 1, 2, 64, 32
    g = torch.Generator().manual_seed(0)
    caches = {m: KVCache(1, m, chunk_frames=1, tokens_per_frame=T, cuda_graphs=False,
                         **({} if m == "bf16" else {"bits": 4, "centroids": 4}))
              for m in ("bf16", "qvg")}
    for _ in range(3):
        k, v = torch.randn(2, B, H, T, D, generator=g).bfloat16()
        for c in caches.values():
            c.write(0, k, v)
            c.commit()
    bf, q = caches["bf16"].memory(), caches["qvg"].memory()
    assert bf["compression_ratio"] == 1.0 and q["bf16_equivalent"] == bf["total"] == 2 * B * H * D * 2 * 3 * T
    assert q["bf16_current"] > 0 and q["compression_ratio"] == q["bf16_equivalent"] / q["total"]


@pytest.mark.parametrize("window,sink", [(None, 0), (3, 0), (6, 0), (6, 3), (9, 3)])
def test_bf16_equivalent_is_what_a_bf16_cache_holds_with_a_rolling_window(window, sink):
    """With a rolling window too, at every point (between chunks and while one is written): once its window has
    wrapped, the BF16 ring keeps the slot of the chunk being written, between chunks as well, and a compressed
    cache's equivalent counts it (qvg-generate's window runs reported a cache 36% smaller than BF16's as 1.28x
    larger)."""
    B, H, D, T = 1, 2, 64, 16
    g = torch.Generator().manual_seed(1)
    caches = {m: KVCache(2, m, chunk_frames=3, tokens_per_frame=T, window_frames=window, sink_frames=sink,
                         cuda_graphs=False, **({} if m == "bf16" else {"centroids": 4}))
              for m in ("bf16", "qvg", "qvg-pro")}
    for _ in range(6):
        for layer in range(2):
            k, v = torch.randn(2, B, H, 3 * T, D, generator=g).bfloat16()
            for c in caches.values():
                c.write(layer, k, v)
        for c in caches.values():  # (a layer committed before commit(), as the pipelines' re-run does)
            c.commit_layer(0)
        for point in ("writing", "between"):
            bf = caches["bf16"].memory()["total"]
            for m in ("qvg", "qvg-pro"):
                mem = caches[m].memory()
                assert mem["bf16_equivalent"] == bf, (m, point, caches[m].frames)
                assert mem["compression_ratio"] == bf / mem["total"]
            if point == "writing":
                for c in caches.values():
                    c.commit()


def test_async_commit_option():
    with pytest.raises(ValueError, match="async_commit must be True or False"):
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, async_commit="yes")
    with pytest.raises(ValueError, match="defer_commits must be True or False"):
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, defer_commits=1)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):  # ("no" turned graphs on)
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, cuda_graphs="no")
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ValueError, match="prefetch_bytes must be a non-negative integer"):
            KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, prefetch_bytes=bad)
    with pytest.raises(ValueError, match="prefetch_at must be one of before, after"):
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, prefetch_at="during")
    for name in ("commit_sms", "prefetch_sms"):
        for bad in (0, True, 1.5, "8"):
            with pytest.raises(ValueError, match=f"{name} must be a positive integer or None"):
                KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, **{name: bad})
    # on the CPU there is no side stream: both settings commit in line, with the same result
    caches = [KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, async_commit=flag,
                      **SMALL["qvg"]) for flag in (True, False)]
    for c in caches:
        _run(c, 3)
    for a, b in zip(caches[0].read(0), caches[1].read(0)):
        assert torch.equal(a, b)
    assert not caches[0]._side


def test_only_commits_that_allocate_nothing_are_in_place():
    """KVCache._in_place (what may run on the side stream): bf16 always; a packed method once its rolling window
    is full (the new unit overwrites the oldest one's slot); never while the history grows, nor for kivi."""
    def states(method, window, n=4, **kw):
        cache = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=window, **kw,
                        **SMALL[method])
        out = []
        for i in range(n):
            x = _chunk(i)
            cache.write(0, x[0, 0], x[0, 1])
            out.append(cache._in_place(cache.layers[0]))
            cache.commit()
        return out
    assert states("qvg", 2 * CF) == [False, False, True, True]  # two chunks fill the window, then the ring
    assert states("qvg", None) == [False] * 4
    assert states("kivi", 2 * CF) == [False] * 4
    assert states("bf16", 2 * CF) == [True] * 4
    assert states("qvg-pro", CF, sink_frames=CF) == [False, False, True, True]  # the sink, one unit, the ring
    # units of two chunks: the first chunk of a unit only waits (in line), the second packs into the ring slot
    assert states("rtn", 2 * CF, n=8, commit_every=2) == [False, False, False, True, False, True, False, True]


@pytest.mark.parametrize("method", ["bf16", "qvg"])
def test_transient_write_serves_one_attention_on_every_path(method):
    """CPU (the reference path): a transient write attends like a plain one; once attended it can't be attended
    again, committed or read (the same contract as the GPU path, which never stores it); written again, it commits."""
    caches = [KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, **SMALL.get(method, {})) for _ in range(2)]
    q = _query()
    for c in caches:
        c.write(0, *_chunk(0)[0].to(torch.bfloat16).unbind(0))
        c.commit()
    x = _chunk(1)[0].to(torch.bfloat16)
    outs = []
    for c, transient in zip(caches, (True, False)):
        c.write(0, x[0], x[1], transient=transient)
        outs.append(c.attend(0, q))
    assert torch.equal(*outs)
    c = caches[0]
    for call in (lambda: c.attend(0, q), c.commit, lambda: c.read(0), lambda: c.commit_layer(0)):
        with pytest.raises(RuntimeError, match="transient=True and has been attended"):
            call()
    c.write(0, x[0], x[1])
    c.commit()
    caches[1].commit()
    assert all(torch.equal(a, b) for a, b in zip(c.read(0), caches[1].read(0)))


def test_options_checked_when_the_cache_is_made():
    """Bad options (a typo, bits 3) fail when the cache is made, not at the first commit; qvg / qvg-pro default to
    default_centroids of the unit (compress's preset of 256 would cost more than it saves on small chunks)."""
    from qvg.cache import default_centroids
    for kw, msg in ((dict(bits=3), "unsupported bits 3"), (dict(blocksize=32), "takes no option 'blocksize'"),
                    (dict(stages=99), r"stages must be an integer in \[0, 16\]"),
                    (dict(centroids=4096), r"centroids \(4096\) > tokens N \(768\)")):
        with pytest.raises(ValueError, match=msg):
            KVCache(2, "qvg", chunk_frames=3, tokens_per_frame=256, **kw)
    with pytest.raises(ValueError, match="unsupported bits 5"):
        KVCache(2, "kivi", chunk_frames=3, tokens_per_frame=256, bits=5)
    assert KVCache(2, "qvg-pro", chunk_frames=3, tokens_per_frame=256).options["centroids"] == default_centroids(768)
    assert KVCache(2, "qvg", chunk_frames=3, tokens_per_frame=256, commit_every=2).options["centroids"] == \
        default_centroids(1536)
    assert KVCache(2, "qvg", chunk_frames=3, tokens_per_frame=256, centroids=5).options["centroids"] == 5


def test_layer_and_query_mistakes_are_one_clear_error():
    c = KVCache(2, "bf16", chunk_frames=1, tokens_per_frame=4)
    k = torch.randn(1, 2, 4, 8)
    for bad in (2, -1, True, "0"):
        with pytest.raises(ValueError, match=r"write: layer must be an integer in \[0, 1\]"):
            c.write(bad, k, k)
    c.write(0, k, k)
    for q in (torch.randn(1, 2, 4, 16), torch.randn(1, 3, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 4, 8)):
        with pytest.raises(ValueError, match=r"attend: q must be \[1, Hq, M, 8\]"):
            c.attend(0, q)
    assert c.attend(0, torch.randn(1, 4, 3, 8)).shape == (1, 4, 3, 8)  # GQA: 4 query heads over 2


def test_kivi_history_is_not_the_next_chunks_buffer():
    """KIVI keeps keys of units under its 32-token groups (and any tail) at full precision; that tail was a view of
    the cache's chunk buffer, so every unit read back as the newest chunk's keys (one kv head, 16-token chunks)."""
    c = KVCache(1, "kivi", chunk_frames=1, tokens_per_frame=16, bits=8)
    ks = []
    for i in range(3):
        k = torch.randn(1, 1, 16, 64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        ks.append(k)
        c.write(0, k, k.clone())
        c.commit()
    z = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    c.write(0, z, z)
    k_read, v_read = c.read(0)
    assert torch.equal(k_read[:, :, :48], torch.cat(ks, 2))  # (full precision: exact)
    assert (v_read[:, :, :48].float() - torch.cat(ks, 2).float()).abs().max() < 0.05  # (8-bit values)


def test_written_tensors_keep_no_autograd_graph_alive():
    """K/V written with grad (a model run without no_grad) are stored as values: the chunks' graphs and inputs are
    freed (they stayed alive through the buffer's in-place copies), and reads need no grad."""
    import gc
    import weakref
    c = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=64, window_frames=2, centroids=4)
    lin, refs = torch.nn.Linear(64, 64), []
    for _ in range(6):
        x = torch.randn(1, 2, 64, 64, requires_grad=True)
        refs.append(weakref.ref(x))
        k = torch.nn.functional.gelu(lin(x))
        c.write(0, k, lin(x))
        c.attend(0, k)
        c.commit()
    del x, k
    gc.collect()
    assert not any(r() is not None for r in refs)
    c.write(0, torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64))
    assert not any(t.requires_grad for t in c.read(0))


def test_library_mistakes_are_one_clear_error():
    """What a library user gets wrong is one ValueError / RuntimeError naming the fix, not an error deep inside."""
    c = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=16, centroids=4)
    with pytest.raises(RuntimeError, match="read: layer 0 holds nothing"):
        c.read(0)
    k = torch.randn(1, 2, 16, 64)
    for a, b, msg in ((k.numpy(), k, "as torch tensors, got ndarray"), (k.long(), k, "floating-point k and v"),
                      (k, k.bool(), "floating-point k and v")):
        with pytest.raises(ValueError, match=msg):
            c.write(0, a, b)
    c.write(0, k, k)
    with pytest.raises(ValueError, match="attend: q must be floating point"):
        c.attend(0, torch.ones(1, 2, 4, 64, dtype=torch.long))
    for kw, msg in ((dict(window=4), "did you mean window_frames"), (dict(sink=3), "did you mean sink_frames")):
        for method in ("qvg", "bf16"):
            with pytest.raises(ValueError, match=msg):
                KVCache(1, method, chunk_frames=1, tokens_per_frame=16, **kw)
    for kw in (dict(role="value"), dict(residual=32)):  # (the cache's zones are KIVI's window; its roles are fixed)
        with pytest.raises(ValueError, match="kivi in the cache takes no"):
            KVCache(1, "kivi", chunk_frames=1, tokens_per_frame=16, **kw)
    pre = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=16, centroids=4, key_storage="pre-rope")
    with pytest.raises(ValueError, match="got list"):
        pre.set_positions([[[0, 0, 0]]], 4, 4)
    pre.set_positions(torch.zeros(2, 1, 3, dtype=torch.long), 4, 4)
    with pytest.raises(ValueError, match="K/V of batch 1, but set_positions gave positions for batch 2"):
        pre.write(0, k, k)
    pre.set_positions(torch.zeros(1, 1, 3, dtype=torch.long), 4, 4)  # (one row serves a batch of 2)
    pre.write(0, torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64))
    bf = KVCache(1, "bf16", chunk_frames=1, tokens_per_frame=16, key_storage="pre-rope")  # (packs nothing: no RoPE)
    bf.set_positions(torch.zeros(3, 1, 3, dtype=torch.long), 4, 4)
    bf.write(0, k, k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the kernels' read: needs a CUDA GPU"))])
def test_one_row_and_per_sample_positions_mix_across_chunks(device):
    """A pre-RoPE cache given one shared row for some chunks and per-sample rows (that differ) for others reads as if
    every chunk had per-sample rows (the units' positions did not concatenate: a size error deep in torch at the next
    read), within a unit of several chunks too."""
    def run(rows, every):
        c = KVCache(1, "rtn", chunk_frames=1, tokens_per_frame=16, key_storage="pre-rope", bits=8, commit_every=every)
        g = torch.Generator().manual_seed(0)
        for pos in rows:
            k, v = (torch.randn(2, 2, 16, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
            c.set_positions(pos, 4, 4)
            c.write(0, k, v)
            out = c.attend(0, torch.randn(2, 2, 16, 64, generator=g).to(device, torch.bfloat16))
            c.commit()
        return out
    shared = lambda i: torch.tensor([[[i, 0, 0]]])  # noqa: E731
    apart = lambda i: torch.tensor([[[i, 0, 0]], [[i + 7, 1, 2]]])  # noqa: E731  (each sample its own position)
    for every in (1, 2):
        for kinds in ("sasa", "ass", "saa"):
            mixed = [shared(i) if k == "s" else apart(i) for i, k in enumerate(kinds)]
            assert torch.equal(run(mixed, every), run([p.expand(2, 1, 3) for p in mixed], every)), (every, kinds)


def test_the_head_dim_is_checked_at_the_first_write():
    """Options the model's head dim decides are checked when K/V first arrive (a block size D does not divide was
    found at the first commit, after a whole forward), and a unit too small for the method's fixed costs, which
    packs into more bits than BF16 (a token-by-token, LLM-style cache), is a warning."""
    import warnings
    c = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=16, centroids=4, block_size=48)
    with pytest.raises(ValueError, match="write: K/V of head dim 64: .*not divisible by block_size=48"):
        c.write(0, torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64))
    tiny = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=1, centroids=1)
    with pytest.warns(UserWarning, match=r"packs a unit of 1 tokens x 64 channels into 18.8 bits per element"):
        tiny.write(0, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once per head dim, and none for units that pack well)
        tiny.write(0, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
        KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=256).write(0, torch.randn(1, 2, 256, 64),
                                                                      torch.randn(1, 2, 256, 64))


def test_a_gpu_cache_at_a_head_dim_no_kernel_takes_warns_once(monkeypatch):
    """At head dim 96 on a GPU a packed-read cache runs the torch reference, whose read materializes each layer's
    BF16 history: its first write says so once (ReferenceReadWarning); head dim 128, CPU caches and methods without
    a packed read do not warn. (kernels_on stands in for a CUDA device where triton imports.)"""
    import warnings

    import qvg.cache
    from qvg.cache import ReferenceReadWarning
    monkeypatch.setattr(qvg.cache, "kernels_on", lambda device: True)
    for method, d, warns in (("qvg", 96, True), ("rtn", 80, True), ("qvg", 128, False), ("kivi", 96, False)):
        cache = KVCache(2, method, chunk_frames=1, tokens_per_frame=32, block_size=16,
                        **({"centroids": 4} if method == "qvg" else {}))
        x = torch.randn(1, 1, 32, d, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cache.write(0, x, x)
            cache.write(1, x, x)
        got = [str(w.message) for w in seen if issubclass(w.category, ReferenceReadWarning)]
        assert len(got) == warns, (method, d, got)
        assert not got or f"head dim {d} is not one the Triton kernels take" in got[0]


@pytest.mark.parametrize("method", ["rtn", "qvg"])
def test_a_window_shorter_than_the_chunks_a_unit_waits_for_is_refused(method):
    """Pending chunks past the window are evicted while nothing is packed: with a window under commit_every - 1
    chunks a unit never filled, and the cache stayed BF16 without a word. Refused; the smallest window that
    packs is taken and packs."""
    with pytest.raises(ValueError, match=f"a window of {CF} frames evicts the chunks waiting to be packed before "
                                         f"there are commit_every = 3 of them: {method} would never pack a unit"):
        KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=CF, commit_every=3)
    KVCache(1, "bf16", chunk_frames=CF, tokens_per_frame=TPF, window_frames=0, commit_every=3)  # (packs nothing)
    cache = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, commit_every=3)
    for _ in range(3):
        cache.write(0, torch.randn(1, 2, T, 64), torch.randn(1, 2, T, 64))
        cache.commit()
    assert cache.memory()["codes"] > 0
