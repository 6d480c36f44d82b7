"""Helpers shared by the kernel tests (imported as `kernel_helpers`; tests/kernels/ is on sys.path under pytest)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from qvg.quant import QuantSpec

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def token_spec(meta: dict) -> QuantSpec:
    """The per-token group quantizer of an rtn / qvg / qvg-pro pack, from its (resolved) options `Packed.meta`."""
    return QuantSpec(bits=meta["bits"], grid=meta["grid"], axis="token", group=meta["block_size"],
                     scale_dtype=meta["scale_dtype"])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@contextmanager
def poisoned():
    """Inside the block, torch.empty / torch.empty_like return tensors whose bytes are all 0xFF (NaN for fp32,
    bf16 and fp8 E4M3, 255 for uint8, -1 for signed ints), so any output element a kernel does not write shows
    up. Wrap only the kernel call, not the reference."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.numel():
            t.untyped_storage().fill_(0xFF)
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view of a tensor (for bitwise comparisons that treat NaN == NaN and -0 != +0)."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view(_RAW[t.element_size()])
    return t


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = raw_bits(got), raw_bits(want)
    bad = g != w
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {i}: "
                             f"got {got.detach().cpu()[i]} want {want.detach().cpu()[i]}")


def assert_tensors_equal(got: dict, want: dict, what: str = "") -> None:
    """Two dicts of stored tensors hold the same names and bitwise-equal tensors."""
    assert set(got) == set(want), f"{what}: tensors {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{what} [{name}]")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def varied(b: int, h: int, n: int, d: int, seed: int = 0) -> torch.Tensor:
    """fp32 [B, H, N, D]: randn with channel magnitudes spanning 1e-3 .. 1e3 (channels shuffled per head)."""
    g = gen(seed)
    mag = torch.logspace(-3, 3, d)[torch.stack([torch.randperm(d, generator=g) for _ in range(b * h)])]
    return torch.randn(b, h, n, d, generator=g) * mag.view(b, h, 1, d)


def clustered(b: int, h: int, n: int, d: int, *, clusters: int = 8, spread: float = 4.0, noise: float = 0.5,
              seed: int = 0) -> torch.Tensor:
    """Gaussian-mixture tokens [B, H, N, D] (what QVG's k-means smoothing is built for)."""
    g = gen(seed)
    centres = torch.randn(b, h, clusters, d, generator=g) * spread
    which = torch.randint(0, clusters, (b, h, n), generator=g)
    return torch.gather(centres, 2, which[..., None].expand(-1, -1, -1, d)) + noise * torch.randn(b, h, n, d,
                                                                                                    generator=g)


def self_forcing_chunk(cache, x: torch.Tensor, q: torch.Tensor, layers: int, denoise: int = 2,
                       transient: bool = True, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One chunk of the Self-Forcing pattern on `cache`: `denoise` denoising steps (their writes transient when
    `transient`), then the clean re-run, each layer committed right after its re-run attention, then commit().
    Layer l writes K = x[2l] + step (strided, as the model's) and V = x[2l + 1] - step; with `positions` [1, F, 3]
    (a 4 x 4 token grid) the keys are rotated by RoPE first, as the model writes them. -> every attention output."""
    from qvg.rope import apply_rope, frame_angles
    outs = []
    for step in range(denoise + 1):
        if positions is not None:
            cache.set_positions(positions, 4, 4)
        for layer in range(layers):
            k, v = x[2 * layer:2 * layer + 1] + step, x[2 * layer + 1:2 * layer + 2] - step
            if positions is not None:
                ang = frame_angles(positions, 4, 4, k.shape[-1])[:, None].to(k.device)
                k = apply_rope(k.float(), ang).bfloat16()
            cache.write(layer, k.transpose(2, 3).contiguous().transpose(2, 3), v,
                        transient=transient and step < denoise)
            outs.append(cache.attend(layer, q))
            if step == denoise:
                cache.commit_layer(layer)
    cache.commit()
    return outs
