"""KVCache(batch_commit=True): all layers' units of a commit packed in one compress call (K, then V), split back per
layer, bitwise the same cache as packing layer by layer (CPU; CUDA where present): histories, positions, reads,
attention and memory, through the cold first unit, sinks, units of several chunks, pre-RoPE keys and a rolling
window's ring and eviction."""
import pytest
import torch

import qvg.cache
from qvg.cache import KVCache
from qvg.rope import apply_rope, frame_angles
from qvg.sequence import PackedSequence

B, H, D, HW, CF, LAYERS = 2, 2, 64, (4, 4), 2, 3  # batch, kv heads, head dim, token grid, frames per chunk, layers
TPF = HW[0] * HW[1]
T = TPF * CF


def _positions(c):
    """Chunk c's frames: times 2c, 2c + 1, the camera panning (spatial offsets, different per batch row)."""
    t = torch.arange(c * CF, (c + 1) * CF)
    pos = torch.zeros(B, CF, 3, dtype=torch.int32)
    pos[..., 0] = t
    pos[..., 2] = t * torch.arange(1, B + 1)[:, None]
    return pos


def _kv(c, layer):
    """Clustered K (after RoPE) and V of chunk c in a layer; each layer and head at its own scale (a group mixed
    with another would show in its FP8 tensor scale and its k-means)."""
    g = torch.Generator().manual_seed(1000 * layer + c)
    proto = torch.randn(2, B, H, 4, D, generator=torch.Generator().manual_seed(layer)) * 3
    x = proto[:, :, :, torch.randint(0, 4, (T,), generator=g)] + 0.3 * torch.randn(2, B, H, T, D, generator=g)
    x = x * (1 + layer + torch.arange(H))[:, None, None].float()
    k = apply_rope(x[0], frame_angles(_positions(c), *HW, D)[:, None])
    return k.to(torch.bfloat16), x[1].to(torch.bfloat16)


def _step(caches, c, per_layer):
    """One chunk into every cache: positions, writes, commit_layer for the layers in per_layer, then commit()."""
    for cache in caches:
        if cache.key_storage == "pre-rope":
            cache.set_positions(_positions(c), *HW)
        for layer in range(LAYERS):
            cache.write(layer, *_kv(c, layer))
            if layer in per_layer:
                cache.commit_layer(layer)
        cache.commit()


def _same(a: KVCache, b: KVCache):
    assert a.memory() == b.memory()
    q = torch.randn(B, 2 * H, 8, D, generator=torch.Generator().manual_seed(a.commits)).to(torch.bfloat16)
    for layer, (la, lb) in enumerate(zip(a.layers, b.layers)):
        assert (la.n_sink, la.n_pending, la.n_cur) == (lb.n_sink, lb.n_pending, lb.n_cur)
        for i in range(2):
            ha, hb = la.hist[i], lb.hist[i]
            assert type(ha) is type(hb)
            if isinstance(ha, PackedSequence):
                assert ha.head == hb.head and ha.tensors.keys() == hb.tensors.keys()
                for name in ha.tensors:
                    assert torch.equal(ha.tensors[name], hb.tensors[name]), (layer, i, name)
            assert (la.warm[i] is None) == (lb.warm[i] is None)
            if la.warm[i] is not None:
                assert torch.equal(la.warm[i], lb.warm[i])
        assert len(la.pos_hist) == len(lb.pos_hist) and all(map(torch.equal, la.pos_hist, lb.pos_hist))
        assert len(la.pos_pending) == len(lb.pos_pending) and all(map(torch.equal, la.pos_pending, lb.pos_pending))
        for x, y in zip(a.read(layer), b.read(layer)):
            assert torch.equal(x, y)
        assert torch.equal(a.attend(layer, q), b.attend(layer, q))


def _count_compress(monkeypatch):
    calls = []
    real = qvg.cache.compression.compress

    def counted(x, *args, **kw):
        calls.append(x.shape[1])
        return real(x, *args, **kw)
    monkeypatch.setattr(qvg.cache.compression, "compress", counted)
    return calls


CASES = {  # name: cache options
    "whole-history": dict(),
    "sink-every2-window": dict(sink_frames=CF, commit_every=2, window_frames=3 * CF),
    "ring-pre-rope": dict(sink_frames=CF, window_frames=2 * CF, key_storage="pre-rope"),
    "every2-ring-pre-rope": dict(commit_every=2, window_frames=4 * CF, key_storage="pre-rope"),
    "window0-pre-rope": dict(window_frames=0, key_storage="pre-rope"),  # the warm start outlives the history
}
METHODS = {"rtn": dict(bits=2), "qvg": dict(centroids=4), "qvg-pro": dict(centroids=4),
           "qvg-s0": dict(stages=0)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_batch_commit_is_bitwise_per_layer_commit(method, case, monkeypatch):
    opts = {**CASES[case], **METHODS[method]}
    name = "qvg" if method == "qvg-s0" else method
    a = KVCache(LAYERS, name, chunk_frames=CF, tokens_per_frame=TPF, **opts)
    b = KVCache(LAYERS, name, chunk_frames=CF, tokens_per_frame=TPF, batch_commit=True, **opts)
    assert b.batch_commit and not a.batch_commit
    calls = _count_compress(monkeypatch)
    every = opts.get("commit_every", 1)
    sink_chunks = opts.get("sink_frames", 0) // CF
    packs, wrapped = 0, False
    for c in range(9):
        # the model's commit_layer after each layer's last attention; or only commit(); or some layers first
        per_layer = [range(LAYERS), [], [1]][c % 3]
        _step([a], c, per_layer)
        calls.clear()
        _step([b], c, per_layer)
        due = c >= sink_chunks and (c + 1 - sink_chunks) % every == 0
        cold = name in ("qvg", "qvg-pro") and opts.get("stages") != 0 and packs == 0
        assert calls == ([] if not due else [H] * 2 * LAYERS if cold else [LAYERS * H] * 2), (c, calls)
        packs += due
        _same(a, b)
        wrapped |= isinstance(b.layers[0].hist[0], PackedSequence) and b.layers[0].hist[0].head != 0
    assert packs >= 3 and any(L.hist[0] is not None for L in b.layers) == (case != "window0-pre-rope")
    assert wrapped == ("ring" in case)  # the rolling window's ring wrapped


def test_kmeans_row_blocks_sized_by_the_group_count_do_not_matter(monkeypatch):
    """CPU k-means computes distances in row blocks sized by G x K (qvg.kmeans._rows_per_block): the batched call
    (G = layers x B x H) blocks rows where a layer's call does not (as at real size: 4,680 tokens, K = 64, 30
    layers). Forced here at a small size, the units are still bitwise the per-layer ones."""
    import qvg.kmeans
    monkeypatch.setattr(qvg.kmeans, "_CHUNK_ELEMS", 4 * 4 * T)  # per layer (G = 4, K = 4): one block of T rows
    assert qvg.kmeans._rows_per_block(B * H * LAYERS, T, 4) < T == qvg.kmeans._rows_per_block(B * H, T, 4)
    opts = dict(centroids=4, window_frames=2 * CF, key_storage="pre-rope")
    a = KVCache(LAYERS, "qvg-pro", chunk_frames=CF, tokens_per_frame=TPF, **opts)
    b = KVCache(LAYERS, "qvg-pro", chunk_frames=CF, tokens_per_frame=TPF, batch_commit=True, **opts)
    for c in range(4):
        _step([a, b], c, range(LAYERS))
        _same(a, b)


def test_commit_layer_only_marks_the_layer(monkeypatch):
    """With batch_commit, commit_layer compresses nothing (the pipeline calls it for every layer inside the clean
    re-run): the chunk waits in the pending zone, the layer takes no new write until commit()."""
    cache = KVCache(LAYERS, "rtn", chunk_frames=CF, tokens_per_frame=TPF, batch_commit=True)
    calls = _count_compress(monkeypatch)
    for layer in range(LAYERS):
        cache.write(layer, *_kv(0, layer))
        cache.commit_layer(layer)
        assert cache.layers[layer].n_pending == T and cache.layers[layer].hist[0] is None
    with pytest.raises(RuntimeError, match="commit_layer"):
        cache.write(0, *_kv(1, 0))
    assert calls == []
    cache.commit()
    assert calls == [LAYERS * H] * 2 and all(L.hist[0].num_chunks == 1 and not L.n_pending for L in cache.layers)


@pytest.mark.parametrize("method", ["kivi", "quarot"])
def test_other_methods_pack_layer_by_layer(method):
    """kivi / quarot keep per-layer packing (batch_commit is off for them): the same cache either way."""
    a = KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF)
    b = KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, batch_commit=True)
    assert not b.batch_commit
    for c in range(3):
        _step([a, b], c, range(LAYERS))
    for layer in range(LAYERS):
        for x, y in zip(a.read(layer), b.read(layer)):
            assert torch.equal(x, y)
    assert a.memory() == b.memory()


def test_bad_batch_commit():
    with pytest.raises(ValueError, match="batch_commit"):
        KVCache(LAYERS, "qvg", chunk_frames=CF, tokens_per_frame=TPF, batch_commit="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphed, batched compression)")
@pytest.mark.parametrize("method", ["rtn", "qvg"])
def test_batch_commit_on_cuda_matches_per_layer(method):
    """On CUDA the batched units are one graph replay over all layers: still the per-layer result, bitwise."""
    opts = dict(window_frames=2 * CF, key_storage="pre-rope", **({"centroids": 4} if method == "qvg" else {}))
    a = KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, **opts)
    b = KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, batch_commit=True, **opts)
    for c in range(5):
        for cache in (a, b):
            cache.set_positions(_positions(c), *HW)
            for layer in range(LAYERS):
                cache.write(layer, *(t.cuda() for t in _kv(c, layer)))
                cache.commit_layer(layer)
            cache.commit()
    assert b._graphed._graphs
    for layer in range(LAYERS):
        for i in range(2):
            for name, t in a.layers[layer].hist[i].tensors.items():
                assert torch.equal(t, b.layers[layer].hist[i].tensors[name]), (layer, i, name)


def test_bench_pipeline_method_flags():
    """bench_pipeline times the option as "NAME:batch" (flags in any order, with "pre-rope")."""
    from qvg.eval.bench_pipeline import new_cache, parse_method

    class Model:
        @staticmethod
        def tokens_per_latent_frame(h, w):
            return h * w // 4
    assert parse_method("qvg:batch:pre-rope") == ("qvg", {"batch", "pre-rope"})
    for method, batch, storage in [("qvg", False, "post-rope"), ("qvg:batch", True, "post-rope"),
                                   ("qvg:pre-rope", False, "pre-rope"), ("qvg-pro:pre-rope:batch", True, "pre-rope"),
                                   ("bf16:batch", False, "post-rope")]:
        cache = new_cache(Model, method, 21, {"centroids": 64})
        assert (cache.batch_commit, cache.key_storage) == (batch, storage), method
    with pytest.raises(ValueError, match="unknown flag"):
        parse_method("qvg:batched")


@pytest.mark.parametrize("storage", ["post-rope", "pre-rope"])
def test_model_forward_with_batch_commit_is_bitwise_the_same(storage):
    """Through the causal Wan model as the pipeline runs it (denoising steps, then the clean re-run with
    commit_layer after each layer's attention, then commit()): the same outputs and the same cache. Chunks: the
    sink, the cold unit, then batched warm units in a wrapping ring."""
    from qvg.pipelines.causal_wan import CausalWanTransformer
    torch.manual_seed(0)
    model = CausalWanTransformer(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=LAYERS,
                                 rope_max_seq_len=64).eval()
    g = torch.Generator().manual_seed(1)
    x, txt = torch.randn(1, 4, 5 * CF, 8, 8, generator=g), torch.randn(1, 7, 32, generator=g)
    runs = []
    for batch in (False, True):
        cache = KVCache(LAYERS, "qvg", chunk_frames=CF, tokens_per_frame=16, centroids=4, sink_frames=CF,
                        window_frames=2 * CF, key_storage=storage, batch_commit=batch)
        outs = []
        with torch.no_grad():
            for c in range(5):
                xc = x[:, :, c * CF:(c + 1) * CF]
                outs.append(model(xc, torch.tensor([500.0]), txt, frame_offset=c * CF, cache=cache))
                outs.append(model(xc, torch.zeros(1), txt, frame_offset=c * CF, cache=cache, commit=True))
                cache.commit()
        runs.append((outs, cache))
    (oa, a), (ob, b) = runs
    assert all(map(torch.equal, oa, ob)) and b.layers[0].hist[0].num_chunks == 2
    _same(a, b)
