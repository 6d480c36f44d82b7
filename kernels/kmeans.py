"""Batched k-means steps (Triton) over [G, N, D]. Reference: qvg/kmeans.py (`assign`, `update`, `kmeans`).

- assign: distances |c|^2 - 2 x.c through tensor-core dot products (BF16 operands, FP32 accumulation), running
  argmin over centroid tiles (ties -> lowest index, like torch), ids written directly in their narrow dtype.
- update: deterministic segmented mean: tokens are stably sorted by id (torch), cluster boundaries found by
  searchsorted, and one program per (group, cluster) sums its tokens in a fixed order in FP32. No float atomics.
- kmeans: the reference's loop (and seeding) with these two steps, no host synchronisation inside.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.kmeans import KMeansResult, id_dtype
from qvg.kmeans import kmeans as ref_kmeans

from .common import INTERPRET, dot_bf16


@triton.jit
def _assign_kernel(x_ptr, c_ptr, csq_ptr, ids_ptr, dist_ptr, N, K, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, WANT_DIST: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    dcols = tl.arange(0, D)
    x = tl.load(x_ptr + (g * N + rows)[:, None] * D + dcols[None, :], mask=rmask[:, None], other=0.0)
    best = tl.full((BLOCK_N,), float("inf"), tl.float32)
    best_id = tl.zeros((BLOCK_N,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        c = tl.load(c_ptr + (g * K + ks)[:, None] * D + dcols[None, :], mask=kmask[:, None], other=0.0)
        csq = tl.load(csq_ptr + g * K + ks, mask=kmask, other=float("inf"))
        d = csq[None, :] - 2.0 * dot_bf16(x, tl.trans(c), tl.zeros((BLOCK_N, BLOCK_K), tl.float32), INTERP)
        m = tl.min(d, 1)
        i = tl.argmin(d, 1).to(tl.int32) + k0
        better = m < best
        best = tl.where(better, m, best)
        best_id = tl.where(better, i, best_id)
    tl.store(ids_ptr + g * N + rows, best_id.to(ids_ptr.dtype.element_ty), mask=rmask)
    if WANT_DIST:
        xf = x.to(tl.float32)
        tl.store(dist_ptr + g * N + rows, tl.maximum(best + tl.sum(xf * xf, 1), 0.0), mask=rmask)


@triton.jit
def _segment_mean_kernel(x_ptr, order_ptr, bounds_ptr, c_old_ptr, c_new_ptr, N, K, D: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    k = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    lo = tl.load(bounds_ptr + g * (K + 1) + k)
    hi = tl.load(bounds_ptr + g * (K + 1) + k + 1)
    dcols = tl.arange(0, D)
    acc = tl.zeros((D,), tl.float32)
    for i0 in range(lo, hi, BLOCK_N):
        idx = i0 + tl.arange(0, BLOCK_N)
        msk = idx < hi
        tok = tl.load(order_ptr + g * N + idx, mask=msk, other=0)
        xs = tl.load(x_ptr + (g * N + tok)[:, None] * D + dcols[None, :], mask=msk[:, None], other=0.0)
        acc += tl.sum(xs.to(tl.float32), 0)
    cnt = (hi - lo).to(tl.float32)
    old = tl.load(c_old_ptr + (g * K + k) * D + dcols)
    new = tl.where(cnt > 0, acc / tl.maximum(cnt, 1.0), old)
    tl.store(c_new_ptr + (g * K + k) * D + dcols, new)


def assign(x: torch.Tensor, c: torch.Tensor, want_dist: bool = False, block_n: int = 256, block_k: int = 64,
           num_warps: int = 8, num_stages: int = 2):
    """x [G, N, D] (bf16/fp32), c [G, K, D] fp32 -> (ids [G, N] narrow dtype, squared distance [G, N] or None)."""
    g, n, d = x.shape
    k = c.shape[1]
    c = c.to(torch.bfloat16).contiguous()  # the dot's operands are bf16 anyway; |c|^2 of the same values
    csq = c.float().pow(2).sum(-1)
    ids = torch.empty(g, n, device=x.device, dtype=id_dtype(k))
    dist = torch.empty(g, n, device=x.device, dtype=torch.float32) if want_dist else csq
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    _assign_kernel[(triton.cdiv(n, block_n), g)](x.contiguous(), c, csq, ids, dist, n, k, D=d, BLOCK_N=block_n,
                                                 BLOCK_K=min(block_k, triton.next_power_of_2(k)),
                                                 WANT_DIST=want_dist, INTERP=INTERPRET, num_warps=num_warps,
                                                 num_stages=num_stages)
    return ids, (dist if want_dist else None)


def update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, block_n: int = 32, num_warps: int = 2) -> torch.Tensor:
    """Deterministic centroid update: mean of each cluster's tokens; empty clusters keep `c`."""
    return update_with_counts(x, ids, c, block_n, num_warps)[0]


def update_with_counts(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, block_n: int = 32, num_warps: int = 2):
    """`update`, plus the cluster sizes [G, K] (from the sort's cluster boundaries)."""
    g, n, d = x.shape
    k = c.shape[1]
    keys = ids.to(torch.int32)
    sorted_ids, order = torch.sort(keys, dim=1, stable=True)
    probes = torch.arange(k + 1, device=x.device, dtype=torch.int32).expand(g, -1).contiguous()
    bounds = torch.searchsorted(sorted_ids, probes).to(torch.int32)  # [G, K+1]: cluster j is [bounds_j, bounds_j+1)
    c_old = c.float().contiguous()
    c_new = torch.empty_like(c_old)
    _segment_mean_kernel[(k, g)](x.contiguous(), order.to(torch.int32), bounds, c_old, c_new, n, k, D=d,
                                 BLOCK_N=block_n, num_warps=num_warps)
    return c_new, bounds[:, 1:] - bounds[:, :-1]


def kmeans(x: torch.Tensor, k: int, *, iters: int = 2, init: torch.Tensor | None = None, seed: int = 0,
           seeding: str = "k-means++", track: bool = False) -> KMeansResult:
    """`qvg.kmeans.kmeans` (same seeding, loop and result) with the Triton assignment and update steps."""
    return ref_kmeans(x, k, iters=iters, init=init, seed=seed, seeding=seeding, track=track,
                      assign_fn=lambda x_, c: assign(x_, c, True), update_fn=update_with_counts)
