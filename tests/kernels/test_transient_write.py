"""KVCache.write(..., transient=True), the denoising steps' writes: on the GPU path (the dequant kernel and the
windowed SDPA; on the CPU under the Triton interpreter) the cache holds k and v by reference and the next attend
copies them once, straight into the staging window. Attention outputs and the committed history are bitwise those
of plain writes, in the Self-Forcing pattern (transient denoising forwards, then the clean re-run committing each
layer), through the rolling window's wrap, with and without the CUDA decode prefetch. A transient chunk that was
attended can't be attended again, committed or read (one clear error), on every path; one not yet attended is stored
first, as a plain write."""
import pytest
import torch

import qvg.backend
from kernel_helpers import clustered, self_forcing_chunk
from qvg.cache import KVCache

TPF, CF, LAYERS = 16, 2, 2


@pytest.fixture(autouse=True)
def _kernel_path(device, monkeypatch):
    """The cache's GPU read path on the CPU too (the Triton interpreter runs the kernels on CPU tensors)."""
    if device == "cpu":
        monkeypatch.setattr(qvg.backend, "use_kernels", lambda t: True)


def _cache(**kw):
    return KVCache(LAYERS, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, centroids=4,
                   block_size=32, **kw)


def _chunk(c, x, q, transient: bool):
    return self_forcing_chunk(c, x, q, LAYERS, transient=transient)


def _data(device, seed):
    return clustered(2 * LAYERS, 2, CF * TPF, 32, spread=1.0, noise=0.5, seed=seed).bfloat16().to(device)


@pytest.mark.parametrize("prefetch", [True, False])
def test_transient_writes_equal_plain_writes(device, prefetch):
    if prefetch and device != "cuda":
        pytest.skip("the decode prefetch runs on CUDA only")
    kw = {} if prefetch else {"prefetch_bytes": 0}
    caches = [_cache(**kw), _cache(**kw)]
    q = torch.randn(1, 4, CF * TPF, 32).bfloat16().to(device)  # 4 query heads over 2 kv heads (GQA)
    for i in range(4):  # the history grows, then the ring fills and wraps
        x = _data(device, 40 + i)
        outs = [_chunk(c, x, q, transient) for c, transient in zip(caches, (True, False))]
        for j, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), (i, j)
    for layer in range(LAYERS):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)
    if prefetch:
        assert caches[0].prefetch_stats == caches[1].prefetch_stats and caches[0].prefetch_stats["used"] > 0


def test_attended_transient_chunk_cannot_be_committed_or_read(device):
    c = _cache(prefetch_bytes=0)
    q = torch.randn(1, 2, CF * TPF, 32).bfloat16().to(device)
    _chunk(c, _data(device, 1), q, transient=True)  # (history exists from here: the next writes can be held)
    x = _data(device, 2)
    for layer in range(LAYERS):
        c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2], transient=True)
    assert c.layers[0].loose is not None
    c.attend(0, q)
    for call in (lambda: c.commit_layer(0), c.commit, lambda: c.read(0), lambda: c.attend(0, q)):
        with pytest.raises(RuntimeError, match="transient=True and has been attended"):
            call()
    c.write(0, x[:1], x[1:2])  # written again (plain): then it commits
    c.commit()
    assert c.frames == 2 * CF


def test_unattended_transient_chunk_is_stored_like_a_plain_write(device):
    caches = [_cache(prefetch_bytes=0), _cache(prefetch_bytes=0)]
    q = torch.randn(1, 2, CF * TPF, 32).bfloat16().to(device)
    for c, transient in zip(caches, (True, False)):
        _chunk(c, _data(device, 3), q, transient=False)
        x = _data(device, 4)
        for layer in range(LAYERS):
            c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2], transient=transient)
    assert caches[0].layers[1].loose is not None
    assert all(torch.equal(a, b) for a, b in zip(caches[0].read(1), caches[1].read(1)))  # read stores it
    for c in caches:
        c.commit()  # commit stores layer 0's
    for layer in range(LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(caches[0].read(layer), caches[1].read(layer)))


def test_with_a_sink_the_write_is_stored_at_once(device):
    c = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF, centroids=4,
                block_size=32, prefetch_bytes=0)
    q = torch.randn(1, 2, CF * TPF, 32).bfloat16().to(device)
    for i in range(3):
        x = _data(device, 10 + i)
        c.write(0, x[:1], x[1:2])
        c.commit()
    c.write(0, x[:1], x[1:2], transient=True)  # the tail is sink + current: one buffer, so no reference is held
    assert c.layers[0].loose is None
    c.attend(0, q)
    with pytest.raises(RuntimeError, match="has been attended"):  # (the same contract as without a sink)
        c.commit()
    c.write(0, x[:1], x[1:2])
    c.commit()


def _pre_rope_chunk(c, x, q, transient: bool, frame0: int):
    from qvg.rope import apply_rope, frame_angles
    pos = torch.zeros(1, CF, 3, dtype=torch.int32)
    pos[..., 0] = torch.arange(frame0, frame0 + CF)
    c.set_positions(pos, 4, 4)
    ang = frame_angles(pos, 4, 4, 32).to(x.device)[:, None]
    outs = []
    for step in range(3):
        for layer in range(LAYERS):
            k = apply_rope(x[2 * layer:2 * layer + 1].float() + step, ang).bfloat16()
            c.write(layer, k, x[2 * layer + 1:2 * layer + 2], transient=transient and step < 2)
            outs.append(c.attend(layer, q))
            if step == 2:
                c.commit_layer(layer)
    c.commit()
    return outs


def test_pre_rope_keys(device):
    """Keys stored before RoPE (the kernel rotates the history as it decodes): transient equals plain."""
    caches = [_cache(prefetch_bytes=0, key_storage="pre-rope") for _ in range(2)]
    q = torch.randn(1, 2, CF * TPF, 32).bfloat16().to(device)
    for i in range(4):
        x = _data(device, 50 + i)
        outs = [_pre_rope_chunk(c, x, q, transient, i * CF) for c, transient in zip(caches, (True, False))]
        assert all(torch.equal(a, b) for a, b in zip(*outs)), i


def test_tail_outside_the_last_window(device, monkeypatch):
    """A history longer than one staging window: the held tail is attended on its own and merged by log-sum-exp
    (the path of histories over 1 GiB), equal to plain writes."""
    import qvg.kernels.windowed_sdpa as ws
    monkeypatch.setattr(ws, "window_tokens", lambda k_hist, window_bytes=0: 24)  # (shorter than a 32-token chunk)
    caches = [_cache(prefetch_bytes=0), _cache(prefetch_bytes=0)]
    q = torch.randn(1, 2, CF * TPF, 32).bfloat16().to(device)
    for i in range(3):
        x = _data(device, 60 + i)
        outs = [_chunk(c, x, q, transient) for c, transient in zip(caches, (True, False))]
        assert all(torch.equal(a, b) for a, b in zip(*outs)), i
