"""qvg.eval.synthetic_kv: shapes, determinism, magnitudes, temporal continuity."""
from __future__ import annotations

import pytest
import torch

from qvg.eval.synthetic_kv import synthetic_chunks, synthetic_kv

SMALL = dict(frames=3, height=10, width=16, heads=2, head_dim=64)


def _frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """[B, H, N, D] -> [B, H, T, HW, D]."""
    b, h, n, d = x.shape
    return x.view(b, h, frames, n // frames, d)


def test_shapes_dtype_and_layout():
    k, v = synthetic_kv(frames=2, height=5, width=7, heads=3, head_dim=32, batch=2, dtype=torch.bfloat16)
    assert k.shape == v.shape == (2, 3, 2 * 5 * 7, 32)
    assert k.dtype == v.dtype == torch.bfloat16
    assert torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()
    assert not torch.equal(k, v)
    assert not torch.equal(k[0], k[1])  # batch entries are different scenes
    # T x H x W order: the tokens of frame t are k[:, :, t*H*W:(t+1)*H*W], so one frame alone is the same slice
    one = synthetic_kv(frames=1, height=5, width=7, heads=3, head_dim=32, batch=2, t0=1, dtype=torch.bfloat16)[0]
    assert torch.equal(k[:, :, 35:70], one)


def test_default_shape():
    k, v = synthetic_kv()
    assert k.shape == v.shape == (1, 12, 3 * 30 * 52, 128)
    assert k.dtype == torch.float32


def test_deterministic_given_seed():
    a = synthetic_kv(seed=3, **SMALL)
    b = synthetic_kv(seed=3, **SMALL)
    c = synthetic_kv(seed=4, **SMALL)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_chunking_does_not_change_the_data():
    """Consecutive chunks are slices of one video: 2 chunks of 3 frames == 1 chunk of 6 frames."""
    whole = synthetic_kv(**{**SMALL, "frames": 6}, seed=1)
    parts = list(synthetic_chunks(2, seed=1, **SMALL))
    assert len(parts) == 2
    for i in range(2):
        assert torch.equal(whole[i], torch.cat([parts[0][i], parts[1][i]], 2))


def test_magnitudes_like_real_kv():
    k, v = synthetic_kv()  # full size: the magnitudes are calibrated there
    kmax, vmax = float(k.abs().max()), float(v.abs().max())
    assert 30 <= kmax <= 300, kmax  # max|K| ~ 1e2
    assert 300 <= vmax <= 3000, vmax  # max|V| ~ 1e3
    # typical values are much smaller than the maximum: the large ones sit in a few outlier channels
    assert float(k.abs().median()) < 0.05 * kmax
    assert float(v.abs().median()) < 0.01 * vmax
    for x, n_out, factor in ((k, 3, 2.5), (v, 2, 8)):
        ch = x.abs().mean(2)[0]  # [H, D] mean |x| per channel
        top = ch.topk(n_out + 1, -1).values  # the outlier channels, then the largest ordinary one
        assert (top[:, 0] > factor * top[:, n_out]).all()  # every head has a dominant outlier channel


def test_outlier_amplitude_varies_across_tokens():
    k, _ = synthetic_kv(**SMALL)
    ch = k.abs().mean(2)[0].argmax(-1)  # the largest outlier channel of each head
    amp = k[0, torch.arange(k.shape[1]), :, ch].abs()  # [H, N]
    assert (amp.std(-1) / amp.mean(-1) > 0.1).all()


def test_temporally_smooth_and_chunks_continue():
    """Adjacent frames are similar, across a chunk boundary as much as inside a chunk; distant frames less so."""
    kw = dict(height=20, width=32, heads=2, head_dim=64, seed=2)
    c0, c1 = list(synthetic_chunks(2, **kw))
    far = synthetic_kv(t0=30, **kw)
    for i in range(2):
        f0, f1, ff = _frames(c0[i], 3), _frames(c1[i], 3), _frames(far[i], 3)
        var = float((c0[i] - c0[i].mean(2, keepdim=True)).pow(2).mean())
        inside = float((f0[:, :, 2] - f0[:, :, 1]).pow(2).mean()) / var
        across = float((f1[:, :, 0] - f0[:, :, 2]).pow(2).mean()) / var
        distant = float((ff[:, :, 0] - f0[:, :, 2]).pow(2).mean()) / var
        assert inside < 0.5 and across < 0.5, (inside, across)
        assert across < 2 * inside
        assert distant > 2 * across


def test_motion_zero_is_static_up_to_noise():
    kw = dict(height=8, width=8, heads=1, head_dim=32, seed=0)
    a = _frames(synthetic_kv(frames=2, motion=0.0, **kw)[0], 2)
    b = _frames(synthetic_kv(frames=2, motion=1.0, **kw)[0], 2)
    still = float((a[:, :, 1] - a[:, :, 0]).pow(2).mean())
    moving = float((b[:, :, 1] - b[:, :, 0]).pow(2).mean())
    assert still < moving


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        synthetic_kv(frames=0)
