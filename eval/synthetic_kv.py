"""Synthetic video-like KV for tests and analyses (a stand-in until real KV is captured from a running model).

Once the generation pipeline exists, KV captured from the real model (e.g. Self-Forcing / Wan2.1 chunks) replaces
this generator in every analysis; until then it gives the compression methods data with the structure that QVG's
claims rest on, at realistic sizes and magnitudes. Nothing here is fitted to a real model.

Model. A token is a point p = (t, y, x) of a video latent: t the absolute frame index, y = (row + 1/2) / height,
x = (col + 1/2) / width in [0, 1]. Tokens are laid out T x H x W (frame-major, then rows, then columns), so a chunk
of `frames` frames has N = frames * height * width tokens. Per head h and channel c, with a scene fixed by `seed`:

    kv[h, p, c] = sum_j w_j(p) E[j, h, c]                          semantic regions
                + (F(p) @ P)[h, c]                                 smooth variation within regions
                + sum_o a_o(p) * 1[c = c_o(h)]                      outlier channels
                + mu[h, c] + sigma_n * noise[h, p, c]               per-head offset, per-token noise

  * Regions: J objects (J drawn in [8, 24]). Object j has a logit field
        f_j(p) = b_j + sum_m A_jm cos(2 pi <k_jm, (x, y) - v_j t> + w_jm t + phi_jm),
    a few low spatial frequencies (0.5-2.5 cycles per frame width) translated with a slow velocity v_j (about 0.01 of
    the frame per latent frame) and a slow phase drift w_jm. w(p) = softmax_j(f_j(p) / tau) with a small tau: sharp
    but continuous region boundaries that move slowly, so consecutive frames (and chunks) are similar.
    E[j] are random per-head embeddings (different for keys and values).
  * Within-region variation: F(p) = cos(2 pi <q_m, (t, y, x)> + psi_m), M random low-frequency Fourier features of
    the position (temporal frequencies below 0.05 cycles per frame), through a random projection P [M, H*D].
  * Outlier channels: a few channels per head (keys 3, values 2) carry large values of a fixed sign whose amplitude
    varies smoothly across tokens and with the region:
        a_o(p) = base_o * exp(sigma * (g_o(p) + sum_j w_j(p) r_oj) + 0.1 * eps_o(p)),
    g_o a smooth field of the position (Fourier features through a random projection), r_oj a per-object offset,
    eps_o per-token noise (a ~10% amplitude jitter that no smooth or per-region model captures). Typical |value|
    is ~1-2; the outlier channels reach max|K| ~ 1e2 and max|V| ~ 1e3 (values: larger, heavier-tailed outliers).
  * Noise: i.i.d. Gaussian per token and channel (std 0.6 keys, 0.8 values: idiosyncratic per-token content, not
    just measurement noise, so the tokens are not trivially clusterable), drawn per absolute frame from a
    generator seeded with (seed, t), so the data do not depend on how frames are chunked:
    synthetic_kv(frames=6, t0=0) equals synthetic_kv(frames=3, t0=0) followed by synthetic_kv(frames=3, t0=3).

`motion` (default 1) scales the scene time t in all the fields above (not the noise): 0.25 is a four times slower
scene, 0 a static one whose frames differ only by the noise.

Calibration and limits. The magnitudes follow the brief for real video-DiT KV (max|K| ~ 1e2, max|V| ~ 1e3, typical
values ~1). The per-token noise and the amplitude jitter set how clusterable the tokens are: with small noise
(std 0.25 / 0.3, no jitter) QVG's INT2 MSE reduction over RTN with the paper's 3-level grid (`grid="sym"`, B=64)
is ~29x (keys) and ~19x (values) in a 4-head calibration run; with the values used here it is ~11x and ~9-10x,
the same order as the paper's ~6.9x / ~2.6x on real KV. It is not fitted further. Known differences from real KV: Lloyd's k-means converges here in 1-2
iterations from k-means++ seeds (the objective is mostly the per-token noise), so how much a warm start saves
cannot be judged on this data; there is no RoPE; heads are independent draws of one scene.

Everything is deterministic given `seed` (CPU torch.Generator), vectorized, and fast (12 heads x 4680 tokens x 128
channels, keys and values, in well under a second on a CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import torch

__all__ = ["synthetic_kv", "synthetic_chunks", "DESCRIPTION"]

DESCRIPTION = ("synthetic video-like KV (qvg.eval.synthetic_kv): drifting semantic regions with per-head random "
               "embeddings + smooth Fourier-feature variation + smoothly varying outlier channels "
               "(max|K|~1e2, max|V|~1e3) + per-token noise; a stand-in for real captured KV")

_REGION_FREQS = 4  # Fourier terms per object logit field
_FEATURES = 32  # Fourier features of (t, y, x) for the within-region variation
_TAU = 0.08  # softmax temperature of the region logits (logit std ~1): sharp, continuous boundaries


@dataclass(frozen=True)
class _Role:
    """Per-role (key / value) scales."""
    embed: float  # std of the region embeddings
    vary: float  # std of the within-region smooth variation
    offset: float  # std of the per-head per-channel offset
    noise: float  # std of the per-token noise
    n_out: int  # outlier channels per head
    out_base: float  # median outlier amplitude
    out_sigma: float  # log-amplitude spread (smooth + per-object part)
    out_jitter: float  # per-token log-amplitude noise (the part no smooth / per-region model captures)


_KEY = _Role(embed=1.6, vary=0.7, offset=0.5, noise=0.6, n_out=3, out_base=10.0, out_sigma=0.5, out_jitter=0.1)
_VALUE = _Role(embed=2.0, vary=0.9, offset=0.2, noise=0.8, n_out=2, out_base=40.0, out_sigma=0.7, out_jitter=0.1)


class _Scene:
    """The random parameters of one scene (depends on seed, heads, head_dim only)."""

    def __init__(self, seed: int, heads: int, head_dim: int):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        u = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
        self.heads, self.head_dim = heads, head_dim
        j = int(torch.randint(8, 25, (1,), generator=g))
        self.n_obj = j
        # region logit fields: frequencies (cycles per frame, in x/y), phases, amplitudes, velocities, phase drift
        mag = 0.5 + 2.0 * u(j, _REGION_FREQS)
        ang = 2 * math.pi * u(j, _REGION_FREQS)
        self.reg_k = torch.stack([mag * torch.cos(ang), mag * torch.sin(ang)], -1)  # [J, R, 2] (kx, ky)
        self.reg_phi = 2 * math.pi * u(j, _REGION_FREQS)
        self.reg_amp = r(j, _REGION_FREQS).abs() / math.sqrt(_REGION_FREQS / 2)
        vang = 2 * math.pi * u(j)
        vmag = 0.004 + 0.012 * u(j)  # fraction of the frame per latent frame
        self.reg_v = torch.stack([vmag * torch.cos(vang), vmag * torch.sin(vang)], -1)  # [J, 2] (vx, vy)
        self.reg_w = 2 * math.pi * 0.02 * r(j, _REGION_FREQS)  # slow phase drift, radians per frame
        self.reg_b = 0.3 * r(j)
        # Fourier features of (t, y, x) shared by the within-region variation and the outlier amplitude fields
        fq = torch.stack([0.04 * r(_FEATURES).clamp(-1.2, 1.2),  # cycles per frame
                          1.5 * r(_FEATURES), 1.5 * r(_FEATURES)], -1)  # cycles per frame height / width
        self.feat_q = fq  # [M, 3]
        self.feat_psi = 2 * math.pi * u(_FEATURES)
        self.roles = {name: self._role(role, g, j) for name, role in (("k", _KEY), ("v", _VALUE))}

    def _role(self, role: _Role, g: torch.Generator, j: int) -> dict:
        h, d = self.heads, self.head_dim
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        m = _FEATURES
        out = {
            "embed": role.embed * r(j, h * d),
            "proj": role.vary * r(m, h * d) * math.sqrt(2.0 / m),  # features have variance 1/2
            "offset": role.offset * r(h * d),
        }
        n_out = min(role.n_out, d)
        ch = torch.stack([torch.randperm(d, generator=g)[:n_out] for _ in range(h)])  # [H, n_out]
        out["out_index"] = (torch.arange(h)[:, None] * d + ch).reshape(-1)  # flat channel index into H*D
        no = h * n_out
        out["out_sign"] = torch.where(torch.rand(no, generator=g) < 0.5, -1.0, 1.0)
        out["out_proj"] = r(m, no) * math.sqrt(2.0 / m) * 0.8  # smooth part of the log-amplitude
        out["out_region"] = 0.6 * r(j, no)  # per-object part of the log-amplitude
        out["out_base"] = role.out_base * torch.exp(0.3 * r(no))
        out["out_sigma"] = role.out_sigma
        out["noise"] = role.noise
        out["out_jitter"] = role.out_jitter
        return out


@lru_cache(maxsize=8)
def _scene(seed: int, heads: int, head_dim: int) -> _Scene:
    return _Scene(seed, heads, head_dim)


def _positions(frames: int, height: int, width: int, t0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.arange(t0, t0 + frames, dtype=torch.float32)
    y = (torch.arange(height, dtype=torch.float32) + 0.5) / height
    x = (torch.arange(width, dtype=torch.float32) + 0.5) / width
    tt, yy, xx = torch.meshgrid(t, y, x, indexing="ij")  # T x H x W order
    return tt.reshape(-1), yy.reshape(-1), xx.reshape(-1)


def _noise(seed: int, t0: int, frames: int, tokens_per_frame: int, hd: int, role: int) -> torch.Tensor:
    """Per-token standard normal noise [N, hd], drawn per absolute frame (independent of the chunking)."""
    out = torch.empty(frames * tokens_per_frame, hd)
    for f in range(frames):
        g = torch.Generator().manual_seed((int(seed) * 7919 + (t0 + f) * 2 + role) * 104729 + 1)
        out[f * tokens_per_frame:(f + 1) * tokens_per_frame] = torch.randn(tokens_per_frame, hd, generator=g)
    return out


def synthetic_kv(frames: int = 3, height: int = 30, width: int = 52, heads: int = 12, head_dim: int = 128,
                 batch: int = 1, t0: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32,
                 motion: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one chunk of a synthetic video: (k, v), each [batch, heads, N, head_dim] with
    N = frames * height * width tokens in T x H x W order, covering absolute frames t0 .. t0 + frames - 1 of the
    scene fixed by `seed` (so t0 = 0, frames, 2 * frames, ... are consecutive chunks of one video). Batch entries
    are independent scenes (seeds seed, seed + 1, ...). `motion` scales the speed at which the scene evolves
    (region drift, phase drift, temporal frequencies): 1 is the default, 0 a static scene whose frames differ only
    by the per-token noise. See the module docstring for the model."""
    if min(frames, height, width, heads, head_dim, batch) < 1:
        raise ValueError("frames, height, width, heads, head_dim and batch must all be >= 1")
    ks, vs = [], []
    for b in range(batch):
        k, v = _one(frames, height, width, heads, head_dim, t0, seed + b, float(motion))
        ks.append(k)
        vs.append(v)
    return torch.stack(ks).to(dtype), torch.stack(vs).to(dtype)


def _one(frames, height, width, heads, head_dim, t0, seed, motion) -> tuple[torch.Tensor, torch.Tensor]:
    sc = _scene(int(seed), int(heads), int(head_dim))
    t, y, x = _positions(frames, height, width, t0)
    t = t * motion  # scene time
    n, hd = t.numel(), heads * head_dim
    # region weights [N, J]
    px = x[:, None] - sc.reg_v[None, :, 0] * t[:, None]  # [N, J]
    py = y[:, None] - sc.reg_v[None, :, 1] * t[:, None]
    arg = 2 * math.pi * (sc.reg_k[None, :, :, 0] * px[..., None] + sc.reg_k[None, :, :, 1] * py[..., None]) \
        + sc.reg_w[None] * t[:, None, None] + sc.reg_phi[None]  # [N, J, R]
    logits = sc.reg_b[None] + (sc.reg_amp[None] * torch.cos(arg)).sum(-1)
    w = torch.softmax(logits / _TAU, -1)  # [N, J]
    # Fourier features [N, M]
    pos = torch.stack([t, y, x], -1)  # [N, 3]
    feat = torch.cos(2 * math.pi * pos @ sc.feat_q.T + sc.feat_psi[None])
    outs = []
    for i, name in enumerate(("k", "v")):
        ro = sc.roles[name]
        z = w @ ro["embed"] + feat @ ro["proj"] + ro["offset"][None]
        no = ro["out_index"].numel()
        eps = _noise(seed, t0, frames, height * width, hd + no, i)
        z += ro["noise"] * eps[:, :hd]
        log_amp = ro["out_sigma"] * (feat @ ro["out_proj"] + w @ ro["out_region"]) + ro["out_jitter"] * eps[:, hd:]
        amp = ro["out_base"][None] * torch.exp(log_amp)  # [N, H*n_out]
        z[:, ro["out_index"]] += ro["out_sign"][None] * amp
        outs.append(z.view(n, heads, head_dim).transpose(0, 1).contiguous())  # [H, N, D]
    return outs[0], outs[1]


def synthetic_chunks(n_chunks: int, frames: int = 3, *, t0: int = 0, **kwargs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield `n_chunks` consecutive chunks (k, v) of one scene: frames t0 + i * frames .. t0 + (i + 1) * frames - 1.
    Other keyword arguments go to `synthetic_kv`."""
    for i in range(n_chunks):
        yield synthetic_kv(frames=frames, t0=t0 + i * frames, **kwargs)
