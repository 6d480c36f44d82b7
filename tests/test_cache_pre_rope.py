"""KVCache with key_storage="pre-rope": keys are packed before RoPE and rotated again on read (CPU).

The positions the model gives (`set_positions`) follow each packed unit through commits, the rolling window's
ring and eviction; the tables the GPU path hands the dequant kernel say the same rotation; pre-RoPE packing
loses less than post-RoPE packing on keys whose content repeats at different positions."""
import pytest
import torch

from qvg.cache import KVCache
from qvg.rope import apply_rope, frame_angles

B, H, D, HW, CF = 1, 2, 64, (4, 4), 2  # batch, kv heads, head dim, token grid, frames per chunk
TPF = HW[0] * HW[1]
T = TPF * CF


def _positions(c, shift=True):
    """Chunk c's frames: time 2c, 2c + 1; a camera panning one column per frame (or none)."""
    t = torch.arange(c * CF, (c + 1) * CF)
    pos = torch.zeros(B, CF, 3, dtype=torch.int32)
    pos[..., 0] = t
    if shift:
        pos[..., 2] = t
        pos[..., 1] = -(t // 3)
    return pos


def _content(c):
    """Pre-RoPE keys / values of chunk c: the scene's few content vectors, repeated in a new order (what k-means
    should find; c >= 100: the values' vectors)."""
    proto = torch.randn(B, H, 4, D, generator=torch.Generator().manual_seed(c // 100)) * 3
    g = torch.Generator().manual_seed(c)
    pick = torch.randint(0, 4, (T,), generator=g)
    return proto[:, :, pick] + 0.05 * torch.randn(B, H, T, D, generator=g)


def _feed(cache, n, shift=True, layers=1):
    """Commit n chunks; return each chunk's keys after RoPE and its values."""
    ks, vs = [], []
    for c in range(n):
        pos = _positions(c, shift)
        k = apply_rope(_content(c), frame_angles(pos, *HW, D)[:, None]).to(torch.bfloat16)
        v = _content(100 + c).to(torch.bfloat16)
        cache.set_positions(pos, *HW)
        for layer in range(layers):
            cache.write(layer, k, v)
        cache.commit()
        ks.append(k)
        vs.append(v)
    return ks, vs


def test_frame_angles_match_the_models_rope_with_offsets():
    """qvg.rope.frame_angles gives exactly the rotation the causal Wan model applies, spatial offsets included."""
    from qvg.pipelines.causal_wan import CausalWanTransformer
    m = CausalWanTransformer(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
                             out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=64)
    off = torch.tensor([[[0, 1], [-2, 3], [5, -4]]])
    m.rope.frame_offset, m.rope.spatial_offsets = 7, off
    try:
        cos, sin = m.rope(torch.zeros(1, 4, 3, 8, 8))
    finally:
        m.rope.frame_offset, m.rope.spatial_offsets = 0, None
    pos, h, w = m.rope_positions((1, 4, 3, 8, 8), 7, None, off)
    assert pos.tolist() == [[[7, 0, 1], [8, -2, 3], [9, 5, -4]]] and (h, w) == (4, 4)
    a = frame_angles(pos, h, w, 64)[0]
    assert torch.allclose(cos[0, :, 0, 0::2].double(), a.cos(), atol=1e-6)
    assert torch.allclose(sin[0, :, 0, 1::2].double(), a.sin(), atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_keys_read_back_after_rope_through_commits_ring_and_eviction(window):
    """At 8 bits the read-back keys equal the written (post-RoPE) keys to quantization error, for the whole history
    and for a rolling window that wraps its ring and evicts (a positions mix-up would rotate by the wrong angles)."""
    cache = KVCache(2, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=window, key_storage="pre-rope",
                    bits=8, centroids=4)
    ks, vs = _feed(cache, 7, layers=2)
    keep = len(ks) if window is None else window // CF  # exactly the window remains after a commit
    for layer in range(2):
        k, v = cache.read(layer)
        want_k, want_v = torch.cat(ks[-keep:], 2).float(), torch.cat(vs[-keep:], 2).float()
        assert k.shape == want_k.shape
        assert (k.float() - want_k).norm() / want_k.norm() < 1e-2
        assert (v.float() - want_v).norm() / want_v.norm() < 1e-2
    assert len(cache.layers[0].pos_hist) == (7 if window is None else keep)
    assert cache.memory()["positions"] == 2 * sum(p.numel() * 4 for p in cache.layers[0].pos_hist)



def test_pending_positions_shared_by_the_layers_count_once():
    """A pending chunk's positions are one tensor that every layer holds: memory() counted it once per layer."""
    cache = KVCache(3, "rtn", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope", commit_every=2)
    _feed(cache, 1, layers=3)
    assert cache.memory()["positions"] == B * CF * 3 * 4  # int32 [B, CF, 3], once
    _feed(cache, 2, layers=3)  # (the second chunk packs the unit: each layer's own [B, 2 CF, 3]; one pending)
    assert cache.memory()["positions"] == 3 * B * 2 * CF * 3 * 4 + B * CF * 3 * 4


def test_pre_rope_packs_positional_keys_better_and_attention_follows():
    """Repeated content under moving RoPE: pre-RoPE INT2 keys are closer than post-RoPE INT2 keys, and so is the
    attention over them; BF16 caches attend the same either way."""
    q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    err = {}
    for ks in ("post-rope", "pre-rope"):
        cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, key_storage=ks, bits=2, centroids=4)
        keys, _ = _feed(cache, 4)
        k, _ = cache.read(0)
        ref = torch.cat(keys, 2).float()
        err[ks] = ((k.float() - ref).norm() / ref.norm()).item()
    assert err["pre-rope"] < 0.5 * err["post-rope"]
    outs = []
    for ks in ("post-rope", "pre-rope"):
        cache = KVCache(1, "bf16", chunk_frames=CF, tokens_per_frame=TPF, key_storage=ks)
        _feed(cache, 3)
        cache.write(0, *(_content(50 + i).to(torch.bfloat16) for i in range(2)))
        outs.append(cache.attend(0, q))
    assert torch.equal(outs[0], outs[1])


def test_rope_tables_say_the_same_rotation_as_the_angles():
    """The GPU path's factorized tables (each ring slot's frames, for the dequant kernel) rotate the packed history
    as the angles do, after the ring wrapped, and with spatial offsets (a moving camera) too."""
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=6, key_storage="pre-rope",
                    bits=8, centroids=4)
    _feed(cache, 5, shift=False)
    L = cache.layers[0]
    assert L.hist[0].head == 2  # wrapped; with 3 slots a wrong slot order rotates by the wrong frames
    tables = cache._rope_tables(L, "cpu")
    by_tables = L.hist[0].decompress(rope=tables).float()
    by_angles = apply_rope(L.hist[0].decompress(), cache._angles(L.pos_hist, "cpu", D))
    assert torch.allclose(by_tables, by_angles, atol=2e-2 * by_angles.abs().max().item())
    moving = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope", bits=8, centroids=4)
    _feed(moving, 2)
    M = moving.layers[0]
    assert torch.stack(M.pos_hist)[..., 1:].any()  # (the history holds spatial offsets)
    by_tables = M.hist[0].decompress(rope=moving._rope_tables(M, "cpu")).float()
    by_angles = apply_rope(M.hist[0].decompress(), moving._angles(M.pos_hist, "cpu", D))
    assert torch.allclose(by_tables, by_angles, atol=2e-2 * by_angles.abs().max().item())


def test_pre_rope_model_rollout_matches_post_rope_in_bf16_and_at_8_bits():
    """Through the causal Wan model (which calls set_positions each forward): a BF16 cache gives bitwise the same
    output with either storage, QVG at 8 bits stays within 1% of it."""
    from qvg.pipelines.causal_wan import CausalWanTransformer
    torch.manual_seed(0)
    m = CausalWanTransformer(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
                             out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                             rope_max_seq_len=64).eval()
    g = torch.Generator().manual_seed(1)
    x, t, txt = torch.randn(1, 4, 6, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g)

    def run(**kw):
        cache = KVCache(2, chunk_frames=2, tokens_per_frame=16, **kw)
        outs = []
        with torch.no_grad():
            for c in range(3):
                off = torch.tensor([[[c, -c], [c + 1, -c], ]])
                outs.append(m(x[:, :, 2 * c:2 * c + 2], t, txt, frame_offset=2 * c, cache=cache,
                              spatial_offsets=off))
                cache.commit()
        return torch.cat(outs, 2)
    ref = run(method="bf16")
    assert torch.equal(ref, run(method="bf16", key_storage="pre-rope"))
    got = run(method="qvg", key_storage="pre-rope", bits=8, centroids=8)
    assert (got - ref).norm() / ref.norm() < 1e-2


def test_errors():
    with pytest.raises(ValueError, match="key_storage must be one of"):
        KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre")
    with pytest.raises(ValueError, match="pre-rope key storage is for"):
        KVCache(1, "kivi", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope")
    cache = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope", centroids=4)
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        cache.set_positions(torch.zeros(1, CF + 1, 3, dtype=torch.int32), *HW)
    with pytest.raises(ValueError, match="token grid does not hold"):
        cache.set_positions(_positions(0), 3, 3)
    cache.write(0, _content(0).to(torch.bfloat16), _content(1).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="call set_positions"):
        cache.commit()


@pytest.mark.parametrize("every", [1, 2])
def test_a_commit_refused_for_its_positions_changes_nothing(every):
    """A commit without positions (or with positions of another batch) raised after the layers before the last had
    counted the chunk: a retry packed it twice (commit_every 2: a unit of the wrong length, then an unrelated error);
    positions given after a write for another batch broadcast the keys' history to that batch, then failed at the
    values. Now both are refused before any layer changes, and the retry holds each chunk once."""
    ref = KVCache(2, "rtn", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope", commit_every=every)
    _feed(ref, 4, layers=2)
    cache = KVCache(2, "rtn", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope", commit_every=every)
    for c in range(4):
        pos = _positions(c)
        k = apply_rope(_content(c), frame_angles(pos, *HW, D)[:, None]).to(torch.bfloat16)
        v = _content(100 + c).to(torch.bfloat16)
        for layer in range(2):
            cache.write(layer, k, v)
        state = [(L.n_sink, L.n_pending, L.n_cur, len(L.pos_pending)) for L in cache.layers]
        with pytest.raises(RuntimeError, match="commit: pre-rope key storage: call set_positions"):
            cache.commit()
        cache.set_positions(pos.expand(2, -1, -1), *HW)  # (after the write: a batch of 2 for K/V of batch 1)
        with pytest.raises(ValueError, match="commit: K/V of batch 1, but set_positions gave positions for batch 2"):
            cache.commit()
        with pytest.raises(ValueError, match="commit_layer: K/V of batch 1"):
            cache.commit_layer(0)
        assert [(L.n_sink, L.n_pending, L.n_cur, len(L.pos_pending)) for L in cache.layers] == state
        assert cache.frames == c * CF and not any(L.committed for L in cache.layers)
        cache.set_positions(pos, *HW)
        cache.commit()
    for layer in range(2):
        for a, b in zip(cache.read(layer), ref.read(layer)):
            assert torch.equal(a, b)
    assert cache.memory() == ref.memory() and cache.tokens(0) == 4 * T


@pytest.mark.parametrize("method", ["qvg", "rtn"])
@pytest.mark.parametrize("sink,every,window", [(4, 1, None), (0, 2, None), (4, 2, 8), (2, 1, 4)])
def test_pre_rope_matches_post_rope_with_sinks_units_and_windows(method, sink, every, window):
    """With a BF16 sink, units of several chunks (commit_every) and a rolling window, a pre-RoPE cache at 8 bits
    holds and attends to what a post-RoPE cache does (its positions follow the units it packs and evicts)."""
    q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    caches = {}
    for ks in ("post-rope", "pre-rope"):
        c = KVCache(1, method, chunk_frames=CF, tokens_per_frame=TPF, sink_frames=sink, commit_every=every,
                    window_frames=window, key_storage=ks, bits=8, **({"centroids": 4} if method == "qvg" else {}))
        _feed(c, 7)
        c.set_positions(_positions(7), *HW)
        c.write(0, _content(7).to(torch.bfloat16), _content(107).to(torch.bfloat16))
        caches[ks] = c
    (kp, vp), (kq, vq) = caches["post-rope"].read(0), caches["pre-rope"].read(0)
    assert kp.shape == kq.shape and torch.equal(vp, vq)
    assert (kq.float() - kp.float()).norm() / kp.float().norm() < 2e-2
    outs = [c.attend(0, q).float() for c in caches.values()]
    assert (outs[1] - outs[0]).norm() / outs[0].norm() < 2e-2
    L = caches["pre-rope"].layers[0]
    units = L.hist[0].num_chunks if L.hist[0] is not None else 0
    assert len(L.pos_hist) == units and len(L.pos_pending) * T == L.n_pending
    assert caches["pre-rope"]._positions is not None  # set for the chunk being written
    caches["pre-rope"].commit()
    assert caches["pre-rope"]._positions is None  # a commit forgets them: the next chunk must give its own
