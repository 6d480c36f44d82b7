"""Row argmin of a distance tile with the index search on tensor cores (Triton; used by the k-means assignment).

A (value, index) reduction costs several compare / select operations per element (the ALU pipe limits the
k-means assignment, eval/results/kernels-h100.md). Here each element costs one min and one compare: the row's
one-hot (d == min) is multiplied on tensor cores by a constant tie-weight matrix whose column j gives the ids
j * P + r (P = BLOCK_K / 16) the weights 2^-2r. A column's sum is then a sum of distinct powers 2^-2r over the row's
tied ids in it; the largest term (the lowest id) sets the sum's exponent, since all the others add up to under a
third of it. The first nonzero column and that exponent give the lowest id holding the minimum: the result of
tl.min(d, 1, return_indices=True) (ties -> lowest index), with the minimum itself exact.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import dot_bf16

TIE_COLS = tl.constexpr(16)  # tie-weight columns; BLOCK_K / 16 ids per column, so BLOCK_K in [16, 1024]


@triton.jit
def tie_weights(K, BLOCK_K: tl.constexpr):
    """[BLOCK_K, 16] BF16: row i (an id < K) holds 2^-2r in column i // P (P = BLOCK_K / 16, r = i % P), zeros
    elsewhere (rows >= K all zero)."""
    P: tl.constexpr = BLOCK_K // TIE_COLS
    i = tl.arange(0, BLOCK_K)[:, None]
    j = tl.arange(0, TIE_COLS)[None, :]
    r = (i % P).to(tl.float32)
    return tl.where((i // P == j) & (i < K), tl.exp2(-2.0 * r), 0.0).to(tl.bfloat16)


@triton.jit
def argmin_mma(d, w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """d [BLOCK_N, BLOCK_K] FP32, w = `tie_weights(K, BLOCK_K)` -> (row minima, the lowest column holding each
    (int32; 0 for a row with no minimum, all NaN))."""
    P: tl.constexpr = BLOCK_K // TIE_COLS
    m = tl.min(d, 1)
    hot = tl.where(d == m[:, None], 1.0, 0.0).to(tl.bfloat16)
    s = dot_bf16(hot, w, tl.zeros((BLOCK_N, TIE_COLS), tl.float32), INTERP)
    cols = tl.arange(0, TIE_COLS)[None, :]
    first = tl.min(tl.where(s > 0, cols, TIE_COLS), 1)
    top = tl.max(tl.where(cols == first[:, None], s, 0.0), 1)
    r = (127 - ((top.to(tl.int32, bitcast=True) >> 23) & 255)) >> 1  # top = 2^-2r (1 + under a third)
    return m, tl.where(first < TIE_COLS, first * P + r, 0)
