"""QuaRot-KV: a per-head randomized Hadamard rotation along D, then RTN; the inverse rotation on read.
The rotation is rebuilt from the seed, so it costs no stored bytes."""
from __future__ import annotations

from functools import lru_cache

import torch

from ..packed import Packed
from ..quant import dequantize_packed, quantize_packed, to_dtype
from ..rotation import rotate, rotation, unrotate
from .registry import QUANT_DEFAULTS, Method, register, scale_overhead_bits, token_spec


@lru_cache(maxsize=32)
def _rotation(d: int, seed: int, signs: bool, device: str) -> torch.Tensor:
    return rotation(d, seed, signs, device)


def _r(o: dict, d: int, device) -> torch.Tensor:
    return _rotation(d, o["seed"], o["signs"], str(device))


def compress(x: torch.Tensor, o: dict) -> dict[str, torch.Tensor]:
    return quantize_packed(rotate(x, _r(o, x.shape[-1], x.device)), token_spec(o))


def decompress(p: Packed) -> torch.Tensor:
    y = dequantize_packed(p.tensors, token_spec(p.meta), p.shape[-1])
    return to_dtype(unrotate(y, _r(p.meta, p.shape[-1], y.device)), p.dtype)


def bits(shape, o) -> float:
    return o["bits"] + scale_overhead_bits(token_spec(o), shape[2], shape[3])


QUAROT = register(Method("quarot", "randomized Hadamard rotation per head, then RTN (needs a power-of-two D)",
                         {**QUANT_DEFAULTS, "seed": 0, "signs": True}, compress, decompress, bits,
                         "b + scale_bits/B (+ 32/(N*D)); the rotation is regenerated from the seed"))
