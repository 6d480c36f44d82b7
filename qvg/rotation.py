"""Per-head randomized Hadamard rotation along the head dim (QuaRot's KV rotation).

R = diag(signs) H_D / sqrt(D) is orthogonal: rotate(x) = x R and unrotate(y) = y R^T invert each other exactly. The signs are
drawn from a CPU generator seeded with `seed`, so they are metadata (the seed), not stored bytes.
"""
from __future__ import annotations

import torch


def hadamard(d: int, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [d, d] (d a power of two), float32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got D={d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(device)


def rotation(d: int, seed: int = 0, signs: bool = True, device=None) -> torch.Tensor:
    """The orthogonal matrix R [d, d] applied as x @ R (rows of x are tokens)."""
    r = hadamard(d)
    if signs:
        s = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
        r = s[:, None] * r  # diag(s) H
    return r.to(device)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return x.float() @ r


def unrotate(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return y @ r.T
