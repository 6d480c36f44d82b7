"""Incremental centroid update (Triton) for a k-means iteration after the first. Same contract as
`qvg.kmeans.update_with_counts` (means of each cluster's tokens, IEEE division, an empty cluster keeps its old
centroid), given the previous iteration's ids, FP32 cluster sums and sizes.

Warm-started, the second assignment moves few tokens (1.3-6.8% per PRQ stage on the benchmark's stand-in at the
LongCat span: eval/results/moved-tokens.json), so instead of summing every cluster again (kernels/kmeans_segsum.py
reads all of x), only the moved tokens are read:
1. `_delta_kernel` (P programs per group, each on a contiguous 1/P of the tokens): the indices of its tokens whose
   id changed, in token order (a running prefix sum), then those tokens in tiles: the signed one-hot (+1 at the new
   id, -1 at the old) times their rows on tensor cores (exact products, FP32 accumulation in an order fixed by the
   tokens), a [K, D] partial per program and the size changes;
2. `_delta_finish_kernel`: old sums plus the programs' partials in program order, divided (`store_means`).
No float atomics, fixed launch shapes (CUDA-graph capturable, no host sync): deterministic. The number of programs
per group depends only on N (one per `chunk` tokens), so a group's bits do not depend on how many groups are
batched or on the GPU. The sums are the fresh sums up to FP32 rounding of the old sums and of the moved rows (an
error relative to the old sums, not the new ones: a cluster that loses most of its tokens keeps a little of it; an
emptied cluster's sum is reset to 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, dot_exact, next_pow2
from .launch import launch
from .kmeans_segsum import bf16_out_args, store_means


@triton.jit
def _delta_kernel(x_ptr, prev_ptr, ids_ptr, idx_ptr, part_ptr, dcnt_ptr, N, K, PROGS, CH, D: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, PARTS: tl.constexpr,
                  INTERP: tl.constexpr):
    """Program p of group g, tokens [p * CH, (p + 1) * CH): their moved tokens' indices in token order (a running
    prefix sum) into its slice of idx, then those tokens in tiles: sum of sign x row per cluster, size changes."""
    p = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    lo = p * CH
    hi = tl.minimum(lo + CH, N)
    moved = tl.program_id(0) * 0
    for n0 in range(lo, hi, SCAN):
        t = n0 + tl.arange(0, SCAN)
        m = t < hi
        f = ((tl.load(prev_ptr + g * N + t, mask=m, other=0) != tl.load(ids_ptr + g * N + t, mask=m, other=0))
             & m).to(tl.int32)
        tl.store(idx_ptr + g * N + lo + moved + tl.cumsum(f, 0) - f, t, mask=f > 0)
        moved += tl.sum(f, 0)
    tl.debug_barrier()  # (the CTA's stores above are visible to all its threads below)
    ks = tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, D)
    acc = tl.zeros((BLOCK_K, D), tl.float32)
    dn = tl.zeros((BLOCK_K,), tl.int32)
    for e0 in range(0, moved, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        m = e < moved
        tok = tl.load(idx_ptr + g * N + lo + e, mask=m, other=0)
        old = tl.where(m, tl.load(prev_ptr + g * N + tok, mask=m, other=0).to(tl.int32), -1)
        new = tl.where(m, tl.load(ids_ptr + g * N + tok, mask=m, other=0).to(tl.int32), -1)
        sign = (ks[:, None] == new[None, :]).to(tl.int32) - (ks[:, None] == old[None, :]).to(tl.int32)
        xr = tl.load(x_ptr + (g * N + tok)[:, None] * D + dcols[None, :], mask=m[:, None], other=0.0)
        sb = sign.to(tl.float32).to(tl.bfloat16)  # -1, 0, 1: exact
        acc = dot_exact(sb, xr, acc, PARTS, INTERP)
        dn += tl.sum(sign, 1)
    kmask = ks < K
    base = (g * PROGS + p) * K + ks
    tl.store(part_ptr + base[:, None] * D + dcols[None, :], acc, mask=kmask[:, None])
    tl.store(dcnt_ptr + base, dn, mask=kmask)


@triton.jit
def _delta_finish_kernel(sums_ptr, counts_ptr, part_ptr, dcnt_ptr, c_old_ptr, c_new_ptr, sums_out_ptr,
                         counts_out_ptr, cb_ptr, K, PROGS, D: tl.constexpr, BLOCK_K: tl.constexpr, CB: tl.constexpr,
                         INTERP: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask, dcols = ks < K, tl.arange(0, D)
    off = (g * K + ks)[:, None] * D + dcols[None, :]
    acc = tl.load(sums_ptr + off, mask=kmask[:, None], other=0.0)
    cnt = tl.load(counts_ptr + g * K + ks, mask=kmask, other=0)
    for p in range(0, PROGS):  # in program order
        base = (g * PROGS + p) * K + ks
        acc += tl.load(part_ptr + base[:, None] * D + dcols[None, :], mask=kmask[:, None], other=0.0)
        cnt += tl.load(dcnt_ptr + base, mask=kmask, other=0)
    store_means(acc, cnt, c_old_ptr, c_new_ptr, g, ks, kmask, K, D, cb_ptr, CB, INTERP)
    tl.store(sums_out_ptr + off, tl.where((cnt > 0)[:, None], acc, 0.0), mask=kmask[:, None])  # emptied: exactly 0
    tl.store(counts_out_ptr + g * K + ks, cnt, mask=kmask)


def update_delta(x: torch.Tensor, prev_ids: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, sums: torch.Tensor,
                 counts: torch.Tensor, progs: int = 0, chunk: int = 8192, block_n: int = 32, num_warps: int = 8,
                 num_stages: int = 3, scan_block: int = 1024, bf16_out: torch.Tensor | None = None):
    """x [G, N, D] (made contiguous: pass it so, or the whole of x is copied); prev_ids, ids [G, N] (the previous
    and this assignment); c [G, K, D] (the centroids ids were assigned to); sums [G, K, D] FP32 / counts [G, K]
    int32 of prev_ids -> (centroids [G, K, D] FP32, sizes [G, K] int32, sums [G, K, D] FP32) of ids.
    progs: programs per group (0: one per `chunk` tokens; 4 at the LongCat span's 29,640). bf16_out: a contiguous
    BF16 [G, K, D] tensor to receive the centroids' BF16 rounding as well."""
    g, n, d = x.shape
    k = c.shape[1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"delta update needs D a power of two >= 16, got {d}")
    dev = x.device
    if progs <= 0:
        progs = cdiv(n, chunk)
    idx = torch.empty(g, n, device=dev, dtype=torch.int32)
    block_k = max(16, next_pow2(k))
    part = torch.empty(g, progs, k, d, device=dev, dtype=torch.float32)
    dcnt = torch.empty(g, progs, k, device=dev, dtype=torch.int32)
    launch(_delta_kernel, (progs, g), x.contiguous(), prev_ids.contiguous(), ids.contiguous(), idx, part, dcnt, n, k,
           progs, cdiv(n, progs), D=d, BLOCK_K=block_k, BLOCK_N=block_n, SCAN=scan_block,
           PARTS=1 if x.dtype == torch.bfloat16 else 3, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    c_new = torch.empty(g, k, d, device=dev, dtype=torch.float32)
    sums_new = torch.empty_like(c_new)
    counts_new = torch.empty(g, k, device=dev, dtype=torch.int32)
    fk = min(32, block_k)
    cb, cb_kw = bf16_out_args(bf16_out, c_new)
    launch(_delta_finish_kernel, (cdiv(k, fk), g), sums.contiguous(), counts.contiguous(), part, dcnt,
           c.contiguous(), c_new, sums_new, counts_new, cb, k, progs, D=d, BLOCK_K=fk, num_warps=4, **cb_kw)
    return c_new, counts_new, sums_new
