"""KVCache's batched commits (`commit_batch_bytes`): once the rolling window is full, `commit()` packs the units
of several layers' K and V in one compression (heads concatenated) and splits the result back into each layer's
ring slot. Per-head methods make that bitwise the cache per-layer commits leave (CPU here; the GPU kernels and the
side stream: tests/kernels/test_async_commit.py)."""
import pytest
import torch

import qvg.compression
from qvg.cache import COMMIT_BATCH_BYTES, KVCache
from qvg.sequence import split_heads

B, H, D, TPF, CF, LAYERS = 1, 2, 64, 16, 2, 3
T = TPF * CF
LAYER_BYTES = 2 * B * H * T * D * 2  # one layer's BF16 K + V unit
OPTIONS = {"qvg": dict(centroids=8), "qvg-pro": dict(centroids=8), "rtn": dict(), "kivi": dict()}


def _feed(cache, chunks, start=0):
    for c in range(start, start + chunks):
        g = torch.Generator().manual_seed(c)
        x = (torch.randn(LAYERS, 2, B, H, 1, D, generator=g) * 2
             + torch.randn(LAYERS, 2, B, H, T, D, generator=g)).to(torch.bfloat16)
        for layer in range(LAYERS):
            cache.write(layer, x[layer, 0], x[layer, 1])
        cache.commit()


def _cache(method, batch, **kw):
    return KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF,
                   commit_batch_bytes=batch, **{**OPTIONS[method], **kw})


def _same(a, b):
    assert a.memory() == b.memory() and a.tokens() == b.tokens()
    for layer in range(LAYERS):
        for x, y in zip(a.read(layer), b.read(layer)):
            assert torch.equal(x, y)
        for ha, hb in zip(a.layers[layer].hist, b.layers[layer].hist):
            assert ha.head == hb.head and ha.tensors.keys() == hb.tensors.keys()
            assert all(torch.equal(ha.tensors[n], hb.tensors[n]) for n in ha.tensors)


@pytest.mark.parametrize("method", ["qvg", "qvg-pro", "rtn"])
@pytest.mark.parametrize("batch", [LAYER_BYTES, 2 * LAYER_BYTES, COMMIT_BATCH_BYTES])
def test_batched_commits_leave_the_per_layer_cache(method, batch):
    """Groups of one layer, of two (3 layers: 2 + 1), and all layers: bitwise the per-layer cache, through the
    ring's wrap (6 chunks in a 2-chunk window)."""
    a, b = _cache(method, 0), _cache(method, batch)
    _feed(a, 6)
    _feed(b, 6)
    _same(a, b)


def test_batched_commits_with_pre_rope_keys():
    kw = dict(key_storage="pre-rope")
    caches = [_cache("qvg", 0, **kw), _cache("qvg", COMMIT_BATCH_BYTES, **kw)]
    for c in range(5):
        pos = torch.zeros(B, CF, 3, dtype=torch.int32)
        pos[..., 0] = torch.arange(c * CF, (c + 1) * CF)
        for cache in caches:
            cache.set_positions(pos, 4, 4)
            _feed(cache, 1, start=c)
    _same(*caches)


def test_one_compression_per_group_warm_started_from_each_layers_centroids(monkeypatch):
    """The fill grows the history (per layer, K and V apart); then each commit() is one call per group of at most
    commit_batch_bytes, whose init is every layer's K and V centroids in order."""
    calls = []
    real = qvg.compression.compress

    def spy(x, method, **kw):
        calls.append((x.shape[1], kw.get("init")))
        return real(x, method, **kw)
    cache = _cache("qvg", 2 * LAYER_BYTES)
    _feed(cache, 2)  # growth: in line, one call per layer and K / V
    monkeypatch.setattr(qvg.compression, "compress", spy)
    warm = [h.last_centroids().clone() for L in cache.layers for h in L.hist]
    _feed(cache, 1, start=2)
    assert [h for h, _ in calls] == [4 * H, 2 * H]  # layers 0-1, then layer 2
    assert torch.equal(calls[0][1], torch.cat(warm[:4], 2)) and torch.equal(calls[1][1], torch.cat(warm[4:], 2))


def test_only_ring_commits_of_per_token_methods_are_batched(monkeypatch):
    """kivi packs K and V differently, and commits that grow the history allocate: both stay per layer."""
    calls = []
    real = qvg.compression.compress
    monkeypatch.setattr(qvg.compression, "compress", lambda x, m, **kw: calls.append(x.shape[1]) or real(x, m, **kw))
    _feed(_cache("kivi", COMMIT_BATCH_BYTES), 4)
    assert set(calls) == {H}


def test_commit_batch_bytes_is_checked():
    for bad in (-1, 1.5, True, "256"):
        with pytest.raises(ValueError, match="commit_batch_bytes must be a non-negative integer"):
            _cache("qvg", bad)


def test_split_heads_refuses_a_wrong_split():
    x = torch.randn(B, 3 * H, T, D).to(torch.bfloat16)
    p = qvg.compression.compress(x, "qvg", centroids=8)
    parts = split_heads(p, [H, 2 * H])
    assert [q.shape for q in parts] == [(B, H, T, D), (B, 2 * H, T, D)]
    with pytest.raises(ValueError, match="split_heads"):
        split_heads(p, [H, H])
