"""QVG: Semantic-Aware Smoothing + Progressive Residual Quantization.

Per (batch, head), stage s = 1..S runs k-means on the current residual (stage 1: the tokens themselves; k-means
reads its BF16 rounding, the residual itself is kept in FP32), stores
the BF16 centroids and the per-token ids, and subtracts each token's (BF16) centroid. The last residual is stored
with the group quantizer. Decompression replays the stages: x = dequant(codes) + sum_s centroids_s[ids_s].
S = 0 is plain RTN. `init` (the previous chunk's centroids) warm-starts every stage's k-means: the streaming
centroid cache.
"""
from __future__ import annotations

import torch

from ..backend import use_kernels
from ..kmeans import id_dtype, kmeans
from ..packed import Packed
from ..quant import bound_tscale, dequantize_packed, quantize_packed, scale_bound, to_dtype
from .registry import QUANT_DEFAULTS, Method, register, scale_overhead_bits, token_spec

COLD_ITERS = 8  # Lloyd iterations when no warm start is given (the first chunk)
WARM_ITERS = 2  # ... when warm-started from the previous chunk's centroids


def _gather(c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """c [G, K, D], ids [G, N] -> [G, N, D] (float32)."""
    return torch.gather(c.float(), 1, ids.long()[..., None].expand(-1, -1, c.shape[-1]))


def init_centroids(init, o: dict, shape) -> torch.Tensor | None:
    """`init` (a Packed from a previous chunk, or a [S, B, H, K, D] tensor) -> [S, B*H, K, D], checked."""
    if init is None or o["stages"] == 0:  # nothing to warm-start (S = 0 is plain RTN)
        return None
    c = init.tensors.get("centroids") if isinstance(init, Packed) else init
    b, h, _, d = shape
    want = (o["stages"], b, h, o["centroids"], d)
    if not isinstance(c, torch.Tensor) or tuple(c.shape) != want:
        got = tuple(c.shape) if isinstance(c, torch.Tensor) else \
            f"a Packed of {init.method!r}, which has no centroids" if isinstance(init, Packed) else type(init).__name__
        raise ValueError(f"init: a qvg / qvg-pro Packed or centroids of shape [S, B, H, K, D] = {list(want)}, got "
                         f"{got}")
    return c.detach().reshape(want[0], b * h, want[3], d)  # (as x: nothing stored keeps an autograd graph)


def compress(x: torch.Tensor, o: dict, init=None) -> dict[str, torch.Tensor]:
    warm = init_centroids(init, o, x.shape)
    iters = o["iters"] if o["iters"] is not None else (WARM_ITERS if warm is not None else COLD_ITERS)
    if use_kernels(x):
        from ..kernels.compress import compress_prq
        return compress_prq(x, o, warm, iters)
    return compress_torch(x, o, warm, iters)


def bf16_centroids(c: torch.Tensor, stage: int) -> torch.Tensor:
    """What the format stores of stage `stage`'s k-means centroids c [G, K, D] (FP32): their BF16 rounding."""
    return c.to(torch.bfloat16)


def compress_torch(x: torch.Tensor, o: dict, warm: torch.Tensor | None, iters: int,
                   store=bf16_centroids) -> dict[str, torch.Tensor]:
    """The torch path of `compress` (warm: `init_centroids`' [S, B*H, K, D] or None). store(c, stage) -> the BF16
    centroids kept (default `bf16_centroids`; eval/centroid_precision.py passes coarser roundings to measure them):
    each stage subtracts exactly what is kept, so decompression replays it."""
    b, h, n, d = x.shape
    s_count, k = o["stages"], o["centroids"]
    r = x.float().reshape(b * h, n, d)
    ids, cents = [], []
    tscale = None
    for s in range(s_count):
        # k-means clusters the BF16 rounding of the residual (what the GPU kernels read: half the bytes); the
        # residual chain itself and the quantized last residual stay exact in FP32
        r16 = r.to(torch.bfloat16)
        res = kmeans(r16, k, iters=iters, init=None if warm is None else warm[s], seed=o["seed"] + s,
                     seeding=o["seeding"])
        c16 = store(res.centroids, s)
        r = r - _gather(c16, res.ids)  # subtract what is stored, so decompression replays exactly
        ids.append(res.ids)
        cents.append(c16)
        if s == s_count - 1:
            tscale = residual_tscale(r16, c16, token_spec(o), (b, h))
    tensors = quantize_packed(r.view(b, h, n, d), token_spec(o), tscale)
    if s_count:
        tensors["ids"] = torch.stack(ids).view(s_count, b, h, n)
        tensors["centroids"] = torch.stack(cents).view(s_count, b, h, k, d)
    return tensors


def residual_tscale(r16: torch.Tensor, c16: torch.Tensor, spec, bh: tuple[int, int]) -> torch.Tensor | None:
    """The FP8 tscale [B, H] of the stored residual, from a bound rather than a pass over it: the last stage's
    k-means input r16 [G, N, D] (BF16) and its centroids c16 [G, K, D] bound every |residual| by
    `scale_bound(max|r16|, max|c16|)` (the GPU path reads both maxima off passes it makes anyway: the k-means
    update reads every token, so the quantizer needs no pass of its own before it encodes a scale). None where the
    spec has no such tscale (BF16 scales, the asym grid)."""
    if spec.scale_dtype != "fp8" or spec.grid == "asym":
        return None
    m_in = r16.abs().amax((1, 2)).float()
    m_c = c16.abs().amax((1, 2)).float()
    return bound_tscale(scale_bound(m_in, m_c), spec).view(*bh)


def decompress(p: Packed) -> torch.Tensor:
    if use_kernels(p.tensors["codes"], p.shape[-1]):
        from ..kernels.dequant import dequantize
        return dequantize(p)
    b, h, n, d = p.shape
    y = dequantize_packed(p.tensors, token_spec(p.meta), d).view(b * h, n, d)
    for s in range(p.meta["stages"]):
        c = p.tensors["centroids"][s].reshape(b * h, -1, d)
        y = y + _gather(c, p.tensors["ids"][s].reshape(b * h, n))
    return to_dtype(y.view(b, h, n, d), p.dtype)


def bits(shape, o) -> float:
    n, d = shape[2], shape[3]
    s, k = o["stages"], o["centroids"]
    id_bits = 8 * id_dtype(k).itemsize
    return o["bits"] + scale_overhead_bits(token_spec(o), n, d) + id_bits * s / d + 16 * s * k / n


_PRQ = {**QUANT_DEFAULTS, "seed": 0, "stages": 1, "centroids": 256, "iters": None, "seeding": "k-means++"}
FORMULA = "b + scale_bits/B + id_bits*S/D + 16*S*K/N (+ 32/(N*D) for FP8's per-head tscale)"


QVG = register(Method("qvg", "k-means smoothing + PRQ, S=1, B=64, K=256", _PRQ, compress, decompress, bits,
                      FORMULA, warm_start=True))
QVG_PRO = register(Method("qvg-pro", "k-means smoothing + PRQ, S=4, B=16, K=256",
                          {**_PRQ, "stages": 4, "block_size": 16}, compress, decompress, bits, FORMULA,
                          warm_start=True))
