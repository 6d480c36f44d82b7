"""Which implementation runs: the Triton kernels (qvg.kernels) for CUDA tensors when triton imports and the head
dim is one they take (`kernel_head_dim`), the pure-torch reference otherwise (always on CPU). QVG_BACKEND=torch
forces the reference everywhere."""
from __future__ import annotations

import os
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports (the CPU torch wheel brings none; kernels/ modules import it at their top)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _enabled() -> bool:
    return os.environ.get("QVG_BACKEND", "auto") != "torch" and triton_available()


def kernels_on(device) -> bool:
    """Whether tensors on `device` run the Triton kernels: a CUDA device, triton importable, no QVG_BACKEND=torch."""
    return torch.device(device).type == "cuda" and _enabled()


def kernel_head_dim(d: int) -> bool:
    """Whether the Triton kernels take head dim `d`: a power of two from 16 to 256 (each holds a token's D values
    in one `tl.arange`, which Triton sizes in powers of two). Others (80, 96, ...) run the torch reference on a
    GPU too, slower (the same decode; k-means of the same quality, not the same bits)."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def use_kernels(t: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether `t` runs the Triton kernels: on CUDA, `kernels_on`'s conditions and a head dim they take (`head_dim`,
    else t's last dim). (Per call on the cache's hot path: no torch.device built.)"""
    return t.is_cuda and _enabled() and kernel_head_dim(t.shape[-1] if head_dim is None else head_dim)
