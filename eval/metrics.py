"""Frame metrics in pure torch (no torchvision / lpips, so they run wherever the tests do): PSNR and SSIM of
videos in [-1, 1]."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


PSNR_CAP = 100.0  # dB: what identical inputs give


def psnr(a: torch.Tensor, b: torch.Tensor, peak_to_peak: float = 2.0) -> float:
    """PSNR in dB of a vs b (any equal shapes, values in a range of `peak_to_peak`: 2 for [-1, 1]); identical
    inputs give PSNR_CAP, 100 dB (capped)."""
    _same_shape(a, b)
    mse = ((a.float() - b.float()) ** 2).mean().item()
    return PSNR_CAP if mse <= 1e-10 else min(PSNR_CAP, 10 * math.log10(peak_to_peak ** 2 / mse))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError unless a and b have one shape (broadcasting compared one frame with every other)."""
    if a.shape != b.shape:
        raise ValueError(f"frames of different shapes: {tuple(a.shape)} and {tuple(b.shape)}")


SSIM_WINDOW = 11  # pixels: the SSIM window's side (frames need at least this on each side)


def _gauss(size: int = SSIM_WINDOW, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-x ** 2 / (2 * sigma ** 2))
    return g / g.sum()


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM (Wang et al. 2004: 11 x 11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, valid region) of frames
    a, b [3, F, H, W] (or [C, H, W]) in [-1, 1], per channel and frame, averaged."""
    _same_shape(a, b)
    x = (a.float() + 1) / 2
    y = (b.float() + 1) / 2
    if x.dim() == 4:  # [C, F, H, W] -> [F * C, 1, H, W]
        x, y = x.transpose(0, 1), y.transpose(0, 1)
    x = x.reshape(-1, 1, *x.shape[-2:])
    y = y.reshape(-1, 1, *y.shape[-2:])
    g = _gauss()
    wx, wy = g.view(1, 1, 1, -1), g.view(1, 1, -1, 1)

    def blur(t):
        return F.conv2d(F.conv2d(t, wx), wy)

    mx, my = blur(x), blur(y)
    sxx, syy, sxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (sxx + syy + c2))
    return s.mean().item()
