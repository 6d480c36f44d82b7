"""RTN: round-to-nearest group quantization with QVG's group scheme (per-token groups of `block_size` channels)."""
from __future__ import annotations

import torch

from ..backend import use_kernels
from ..packed import Packed
from ..quant import dequantize_packed, quantize_packed, to_dtype
from .registry import QUANT_DEFAULTS, Method, register, scale_overhead_bits, token_spec


def compress(x: torch.Tensor, o: dict) -> dict[str, torch.Tensor]:
    if use_kernels(x):
        from ..kernels.quantize import quantize_packed as quantize_packed_triton
        return quantize_packed_triton(x, token_spec(o), fused=True, span="narrow")  # (the same bits as unfused)
    return quantize_packed(x, token_spec(o))


def decompress(p: Packed) -> torch.Tensor:
    if use_kernels(p.tensors["codes"], p.shape[-1]):
        from ..kernels.dequant import dequantize
        return dequantize(p)
    return to_dtype(dequantize_packed(p.tensors, token_spec(p.meta), p.shape[-1]), p.dtype)


def bits(shape, o) -> float:
    return o["bits"] + scale_overhead_bits(token_spec(o), shape[2], shape[3])


RTN = register(Method("rtn", "round-to-nearest, per-token groups of block_size channels", dict(QUANT_DEFAULTS),
                      compress, decompress, bits, "b + scale_bits/B (+ 32/(N*D) for FP8's per-head tscale)"))
