"""KIVI: keys quantized per channel over groups of `block_size` tokens, values per token over groups of
`block_size` channels; asymmetric min/max grid with BF16 scale and zero point (the paper's 16-bit formulation;
scale_dtype="fp8" is allowed). The most recent `residual` tokens, and for keys the tail of N that does not fill a
whole token group, are kept in full precision (16-bit) in the `residual` tensor: KIVI's FP window."""
from __future__ import annotations

import torch

from ..packed import Packed
from ..quant import QuantSpec, check_block_size, dequantize_packed, quantize_packed, to_dtype
from .registry import QUANT_DEFAULTS, Method, register, scale_overhead_bits

ROLES = ("key", "value")


def spec(o: dict) -> QuantSpec:
    return QuantSpec(bits=o["bits"], grid=o["grid"], axis="channel" if o["role"] == "key" else "token",
                     group=o["block_size"], scale_dtype=o["scale_dtype"])


def quantized_tokens(n: int, o: dict) -> int:
    """How many of the N tokens are quantized (the rest are the full-precision residual)."""
    if o["role"] not in ROLES:
        raise ValueError(f"KIVI role must be one of {ROLES}, got {o['role']!r}")
    if not isinstance(o["residual"], int) or o["residual"] < 0:
        raise ValueError(f"residual must be a non-negative integer, got {o['residual']!r}")
    check_block_size(o["block_size"])  # (before its modulo below)
    nq = max(0, n - o["residual"])
    return nq - nq % o["block_size"] if o["role"] == "key" else nq


def compress(x: torch.Tensor, o: dict) -> dict[str, torch.Tensor]:
    nq = quantized_tokens(x.shape[2], o)
    fp = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    tensors = quantize_packed(x[:, :, :nq], spec(o)) if nq else {}
    # (always a copy: a view would keep the caller's buffer, which a cache reuses for its next chunk)
    tensors["residual"] = x[:, :, nq:].to(fp, memory_format=torch.contiguous_format, copy=True)
    return tensors


def decompress(p: Packed) -> torch.Tensor:
    res = p.tensors["residual"].float()
    if "codes" not in p.tensors:
        return to_dtype(res, p.dtype)
    q = dequantize_packed(p.tensors, spec(p.meta), p.shape[-1])
    return to_dtype(torch.cat([q, res], 2), p.dtype)


def bits(shape, o) -> float:
    n, d = shape[2], shape[3]
    nq = quantized_tokens(n, o)
    if nq == 0:
        return 16.0
    q = o["bits"] + scale_overhead_bits(spec(o), nq, d)
    return (nq * q + (n - nq) * 16) / n


KIVI = register(Method(
    "kivi", "KIVI: keys per channel over token groups, values per token; asymmetric, BF16 scale + zero; FP window",
    {**QUANT_DEFAULTS, "block_size": 32, "grid": "asym", "scale_dtype": "bf16", "role": "key", "residual": 0},
    compress, decompress, bits,
    "(Nq/N) * (b + 32/G) + (1 - Nq/N) * 16, Nq = quantized tokens, G = group size"))
