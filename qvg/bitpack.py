"""Bit packing of 1/2/4-bit codes into uint8 along the last dimension (8-bit codes are stored as they are).

Layout ("planar", chosen so a kernel unpacks with shifts only, never an interleave): a row of D codes of b bits
is stored in W = D * b / 8 bytes. With P = 8 / b planes, code d lives in byte (d mod W) at bit offset
b * (d div W). So byte w holds codes w, w + W, w + 2W, ... from the low bits up, and shifting the whole row by
b * p and masking yields the contiguous slice of codes [p*W, (p+1)*W). D must be a multiple of P.
"""
from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def packed_width(d: int, bits: int) -> int:
    """Bytes per row of `d` codes of `bits` bits."""
    planes = 8 // bits
    if d % planes:
        raise ValueError(f"the last dimension ({d}) must be a multiple of {planes} to pack {bits}-bit codes")
    return d // planes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last dim into uint8 [..., D * bits / 8]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits {bits}; supported: {SUPPORTED_BITS}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    w = packed_width(codes.shape[-1], bits)
    planes = codes.unflatten(-1, (8 // bits, w))  # [..., P, W]
    out = torch.zeros(codes.shape[:-1] + (w,), dtype=torch.uint8, device=codes.device)
    for p in range(8 // bits):
        out |= planes[..., p, :] << (bits * p)
    return out


def unpack(packed: torch.Tensor, bits: int, d: int | None = None) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., W] -> uint8 codes [..., W * 8 / bits]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits {bits}; supported: {SUPPORTED_BITS}")
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)  # one per plane
    planes = (packed.unsqueeze(-2) >> shifts.view(-1, 1)) & mask  # [..., P, W]
    out = planes.flatten(-2)
    if d is not None and out.shape[-1] != d:
        raise ValueError(f"packed row holds {out.shape[-1]} codes, expected {d}")
    return out
