"""Which implementation runs: the Triton kernels (qvg.kernels) for CUDA tensors when triton imports, the
pure-torch reference otherwise (always on CPU). QVG_BACKEND=torch forces the reference everywhere."""
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


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and _enabled()  # (per call on the cache's hot path: no torch.device built)
