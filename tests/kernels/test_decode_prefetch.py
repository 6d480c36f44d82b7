"""KVCache's decode prefetch (CUDA only): the next layer's history decoded on a side stream while a layer
attends (queued just before or after its SDPA) gives bitwise the same attention outputs and history as decoding in
line, is used in the Self-Forcing pattern (denoising forwards, then the clean re-run with per-layer commits), is
dropped when its layer commits first, stays within its byte budget, is skipped when its buffers can't be allocated
and holds nothing across `commit()` or `reset()`."""
import pytest
import torch

from kernel_helpers import clustered
from qvg.cache import PREFETCH_AT, KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")

TPF, CF, LAYERS = 48, 2, 3
CASES = [("qvg", {"centroids": 8}, "post-rope"), ("qvg", {"centroids": 8}, "pre-rope"),
         ("qvg-pro", {"centroids": 8}, "post-rope"), ("rtn", {"bits": 4}, "post-rope")]


def _cache(method, opts, storage, **kw):
    return KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF,
                   key_storage=storage, **opts, **kw)


def _chunk(c, x, q, denoise: int = 2):
    """`denoise` forwards of writes + attention, then the clean re-run committing each layer, then commit()."""
    if c.key_storage == "pre-rope":
        pos = torch.zeros(1, CF, 3, dtype=torch.int32)
        pos[..., 0] = torch.arange(c.frames, c.frames + CF)
        c.set_positions(pos, 6, 8)
    outs = []
    for step in range(denoise + 1):
        for layer in range(LAYERS):
            c.write(layer, x[2 * layer:2 * layer + 1] + step, x[2 * layer + 1:2 * layer + 2])
            outs.append(c.attend(layer, q))
            if step == denoise:
                c.commit_layer(layer)
    c.commit()
    return outs


@pytest.mark.parametrize("at", PREFETCH_AT)
@pytest.mark.parametrize("method,opts,storage", CASES)
def test_prefetch_equals_in_line(method, opts, storage, at):
    caches = [_cache(method, opts, storage, prefetch_at=at), _cache(method, opts, storage, prefetch_bytes=0)]
    q = torch.randn(1, 4, CF * TPF, 64, device="cuda").bfloat16()  # 4 query heads over 2 kv heads (GQA)
    for i in range(6):  # sink, growth, then the ring fills and wraps
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, spread=1.0, noise=0.5, seed=60 + i).bfloat16().cuda()
        outs = [_chunk(c, x, q) for c in caches]
        for j, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (method, storage, i, j)
        assert all(L.prefetch is None for L in caches[0].layers)  # nothing held across commit()
    for layer in range(LAYERS):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)
    used = caches[0].prefetch_stats["used"]
    # once the history exists: every read but each chunk's first one of layer 0 (4 chunks x (3 forwards x 3 - 1))
    assert used >= 4 * (3 * LAYERS - 1), caches[0].prefetch_stats
    assert caches[1].prefetch_stats == {"used": 0, "dropped": 0, "no_memory": 0} and not caches[1]._ahead


def test_stale_prefetch_is_dropped():
    caches = [_cache("qvg", {"centroids": 8}, "post-rope"),
              _cache("qvg", {"centroids": 8}, "post-rope", prefetch_bytes=0)]
    q = torch.randn(1, 2, CF * TPF, 64, device="cuda").bfloat16()
    for i in range(3):
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, seed=70 + i).bfloat16().cuda()
        for c in caches:
            _chunk(c, x, q)
    x = clustered(2 * LAYERS, 2, CF * TPF, 64, seed=80).bfloat16().cuda()
    outs = []
    for c in caches:
        got = []
        for layer in range(LAYERS):
            c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2])
        got.append(c.attend(0, q))  # prefetches layer 1 ...
        c.commit_layer(1)  # ... whose history then changes: the prefetch is stale
        got.append(c.attend(1, q))
        c.commit_layer(0)
        c.commit_layer(2)
        c.commit()
        got += list(c.read(1))
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert caches[0].prefetch_stats["dropped"] >= 1


def test_budget_and_reset():
    q = torch.randn(1, 2, CF * TPF, 64, device="cuda").bfloat16()
    window = 2 * 2 * (CF * TPF * 2 + CF * TPF) * 64 * 2  # K + V of sink + 1 unit of history + the current chunk
    small = _cache("qvg", {"centroids": 8}, "post-rope", prefetch_bytes=window - 1)
    for i in range(3):  # the third chunk reads a history
        _chunk(small, clustered(2 * LAYERS, 2, CF * TPF, 64, seed=90 + i).bfloat16().cuda(), q)
    assert small.prefetch_stats["used"] == 0 and not small._ahead  # over its budget: decoded in line
    c = _cache("qvg", {"centroids": 8}, "post-rope")
    for i in range(3):
        _chunk(c, clustered(2 * LAYERS, 2, CF * TPF, 64, seed=90 + i).bfloat16().cuda(), q)
    assert c.prefetch_stats["used"] > 0
    x = clustered(2, 2, CF * TPF, 64, seed=99).bfloat16().cuda()
    c.write(0, x[:1], x[1:])
    c.attend(0, q)
    assert c.layers[1].prefetch is not None  # queued ...
    c.reset()  # ... and dropped (the current stream waited for it first)
    assert c.memory()["total"] == 0 and all(L.prefetch is None for L in c.layers)



def test_out_of_memory_decodes_in_line(monkeypatch):
    """A prefetch whose buffers can't be allocated is skipped (counted) and none is tried again before commit(): the
    layers decode in line, same outputs."""
    import qvg.cache as cache_module

    def no_memory(*args):
        raise torch.cuda.OutOfMemoryError("test")
    caches = [_cache("qvg", {"centroids": 8}, "post-rope"), _cache("qvg", {"centroids": 8}, "post-rope",
                                                                   prefetch_bytes=0)]
    q = torch.randn(1, 2, CF * TPF, 64, device="cuda").bfloat16()
    monkeypatch.setattr(cache_module, "_window_pair", no_memory)
    for i in range(4):  # (the sink fills, then the history; chunks 2 and 3 have one to prefetch)
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, seed=95 + i).bfloat16().cuda()
        for a, b in zip(*[_chunk(c, x, q) for c in caches]):
            assert torch.equal(a, b)
    # one failed try per chunk that has a history to prefetch (none after it until commit()), nothing queued
    assert caches[0].prefetch_stats == {"used": 0, "dropped": 0, "no_memory": 2} and not caches[0]._ahead


@pytest.mark.parametrize("method,opts,storage", CASES[1:3])
def test_split_sdpa_prefetch(method, opts, storage, monkeypatch):
    """prefetch_at="split" with the SDPA call split for real (query_split finds no partial wave at these sizes, so
    the split is forced): the prefetch is used, the outputs match in-line decoding to BF16 rounding (each half may
    run another SDPA kernel) and the history is bitwise the same."""
    import qvg.kernels.windowed_sdpa as ws
    monkeypatch.setattr(KVCache, "_split_rows", staticmethod(lambda q: q.shape[2] // 3))
    splits = []
    real = ws._split_sdpa
    monkeypatch.setattr(ws, "_split_sdpa", lambda *a: splits.append(1) or real(*a))
    # (without a prefetch to queue, the call is not split: prefetch_bytes=0 with "split")
    caches = [_cache(method, opts, storage, prefetch_at="split"),
              _cache(method, opts, storage, prefetch_bytes=0, prefetch_at="split")]
    q = torch.randn(1, 4, CF * TPF, 64, device="cuda").bfloat16()
    for i in range(5):
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, spread=1.0, noise=0.5, seed=160 + i).bfloat16().cuda()
        for j, (a, b) in enumerate(zip(*[_chunk(c, x, q) for c in caches])):
            assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2), (method, storage, i, j)
    for layer in range(LAYERS):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)
    assert caches[0].prefetch_stats["used"] >= 3 * (3 * LAYERS - 1), caches[0].prefetch_stats
    # every split queued a prefetch (the in-line cache never split)
    assert 0 < len(splits) <= caches[0].prefetch_stats["used"] + caches[0].prefetch_stats["dropped"]
