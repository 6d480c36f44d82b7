"""Shared helpers and fixtures for the CPU test suite of the `qvg` core.

All randomness goes through explicit `torch.Generator`s seeded by the test, so every run draws the same data.
Tests marked `slow` (over ~20 s on 2 CPU cores) are skipped unless `--runslow` is given (or QVG_RUN_SLOW=1).
"""
from __future__ import annotations

import os
import random

# Most tensors here are small, so torch's OpenMP threads spend their time at barriers. With the default (active,
# spinning) wait policy, a CPU shared with other processes makes each barrier wait for a descheduled spinner:
# tests then run ~100x slower (seconds instead of milliseconds). Sleeping waiters avoid that. Must be set before
# torch (libgomp) loads; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# imageio-ffmpeg starts ffmpeg (the tests' mp4 readers) with preexec_fn, a fork that runs Python code before exec and
# can deadlock when other threads run (the UI tests' in-process server): this is its own switch for plain starts.
# (The product's writer, app/mp4.py, never starts ffmpeg that way.)
os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels run under Triton's CPU interpreter, and TRITON_INTERPRET=1 must be set before triton
# is first imported: triton.language's own @jit helpers are built then, in the mode then set (built compiled, an
# interpreted kernel that calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel"). Test
# modules outside tests/kernels/ can import triton while pytest collects them, before tests/kernels/conftest.py
# runs (`pytest tests/ -k rope` did), so it is set here, in the conftest pytest loads first. An explicit
# TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- pytest plumbing ----------------------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~20 s on 2 CPU cores; skipped unless --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("QVG_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or QVG_RUN_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --- random data --------------------------------------------------------------------------------------------------

def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed`."""
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int = 0, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def with_outliers(x: torch.Tensor, *, channels: int = 3, factor: float = 1e3, seed: int = 0) -> torch.Tensor:
    """x [..., N, D] with `channels` random channels per (batch, head) scaled by ~`factor`, varying per token
    (the per-token multiplier is in [0.5, 1.5] x factor, with a random sign)."""
    g = gen(seed)
    d = x.shape[-1]
    out = x.clone()
    lead = x.shape[:-2]
    idx = torch.rand(*lead, d, generator=g).argsort(-1)[..., :channels]  # [..., channels]
    mult = factor * (0.5 + torch.rand(*x.shape[:-1], channels, generator=g))
    mult = mult * torch.where(torch.rand(*x.shape[:-1], channels, generator=g) < 0.5, -1.0, 1.0)
    idx_t = idx.unsqueeze(-2).expand(*x.shape[:-1], channels)
    out.scatter_(-1, idx_t, torch.gather(x, -1, idx_t) * mult.to(x.dtype))
    return out


def clustered_kv(b: int, h: int, n: int, d: int, *, clusters: int = 32, spread: float = 10.0, noise: float = 0.3,
                 seed: int = 0) -> torch.Tensor:
    """A Gaussian-mixture KV tensor [B, H, N, D]: per (batch, head), `clusters` centres drawn N(0, spread^2), each
    token = a uniformly chosen centre + N(0, noise^2). Large spread / small noise = strongly clustered tokens,
    the regime QVG's k-means smoothing is built for."""
    g = gen(seed)
    centres = torch.randn(b, h, clusters, d, generator=g) * spread
    which = torch.randint(0, clusters, (b, h, n), generator=g)
    x = torch.gather(centres, 2, which[..., None].expand(-1, -1, -1, d))
    return x + noise * torch.randn(b, h, n, d, generator=g)


def blobs(n: int, d: int, k: int, *, sep: float = 20.0, noise: float = 0.5, seed: int = 0):
    """Well-separated blobs for k-means: returns (x [n, d] float32, true labels [n] int64). Every blob gets at
    least one point (labels are a shuffled round-robin)."""
    g = gen(seed)
    centres = torch.randn(k, d, generator=g) * sep
    labels = torch.arange(n) % k
    labels = labels[torch.randperm(n, generator=g)]
    return centres[labels] + noise * torch.randn(n, d, generator=g), labels


def random_shapes(seed: int, count: int, *, b=(1, 2), h=(1, 3), n=(37, 301, 1013), d=(64, 128)):
    """`count` seeded random [B, H, N, D] shapes: B, H uniform in their inclusive ranges, N and D from the lists."""
    rng = random.Random(seed)
    return [(rng.randint(*b), rng.randint(*h), rng.choice(n), rng.choice(d)) for _ in range(count)]


# --- assertions ---------------------------------------------------------------------------------------------------

def assert_within_half_step(x: torch.Tensor, x_hat: torch.Tensor, step: torch.Tensor, *, what: str = "",
                            magnitude: torch.Tensor | None = None) -> None:
    """|x - x_hat| <= step / 2 elementwise, with slack for float32 rounding: 1e-5 * step + 1e-6 * magnitude, where
    magnitude is |x| unless given (e.g. |x| + the magnitudes of centroids added and subtracted on the way)."""
    x, x_hat, step = x.float(), x_hat.float(), step.float()
    assert torch.isfinite(x_hat).all(), f"{what}: non-finite reconstruction"
    err = (x - x_hat).abs()
    bound = step / 2 + 1e-5 * step + 1e-6 * (x.abs() if magnitude is None else magnitude)
    bad = err > bound
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements exceed step/2; first at {i}: x={x[i].item():.6g} "
                             f"x_hat={x_hat[i].item():.6g} err={err[i].item():.6g} step={step[i].item():.6g}")


@pytest.fixture
def shapes():
    """The seeded random-shape generator, as a fixture."""
    return random_shapes


@pytest.fixture
def sigint_default():
    """SIGINT as Python's default (KeyboardInterrupt) during the test: a suite started in the background by a shell
    without job control inherits SIGINT ignored, which qvg keeps ignored (`qvg.outputs.sigterm_raises`: no Ctrl-C
    reaches such a process), so the tests that raise SIGINT would see nothing happen."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
