"""`qvg.kmeans.reseed_empty` as one Triton launch (the torch version is ~12 small kernels per k-means iteration:
slice maxima, a sort, gathers, a cumsum). Same candidates, same order, same result bitwise.

One program per group; when the group has no empty cluster (the usual case) it only reads the counts. Otherwise:
(1) the first maximum of `dist` in each of S = min(K, N) equal slices of width N // S and
its token (the candidate); (2) each candidate's position in the descending stable order of those maxima (pairwise
comparisons), written into a scratch row in that order; (3) the i-th empty cluster (by index) takes the i-th
candidate's token. A CTA barrier separates the phases that go through memory. No host sync."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2, to_bf16
from .kmeans_segsum import bf16_out_args
from .launch import launch

RESEED_MAX_K = 512  # the slice maxima are held in one program's registers


@triton.jit
def _reseed_kernel(x_ptr, dist_ptr, counts_ptr, c_ptr, best_ptr, sorted_ptr, cb_ptr, N, K, S, W, D: tl.constexpr,
                   SP: tl.constexpr, BW: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr,
                   INTERP: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    n_empty = tl.program_id(0) * 0  # usually none: then the candidate passes (over all of dist) are skipped
    for k0 in range(0, K, KB):
        ks = k0 + tl.arange(0, KB)
        n_empty += tl.sum(((tl.load(counts_ptr + g * K + ks, mask=ks < K, other=1) == 0) & (ks < K)).to(tl.int32), 0)
    if n_empty > 0:
        _reseed_group(x_ptr, dist_ptr, counts_ptr, c_ptr, best_ptr, sorted_ptr, cb_ptr, N, K, S, W, D, SP, BW, TB,
                      KB, CB, INTERP, g)


@triton.jit
def _reseed_group(x_ptr, dist_ptr, counts_ptr, c_ptr, best_ptr, sorted_ptr, cb_ptr, N, K, S, W, D: tl.constexpr,
                  SP: tl.constexpr, BW: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr,
                  INTERP: tl.constexpr, g):
    ss = tl.arange(0, SP)
    smask = ss < S
    best = tl.full((SP,), -float("inf"), tl.float32)
    arg = tl.zeros((SP,), tl.int32)
    for w0 in range(0, W, BW):  # per slice: the first maximum (strict >: an earlier column block keeps a tie)
        ws = w0 + tl.arange(0, BW)
        v = tl.load(dist_ptr + g * N + ss[:, None] * W + ws[None, :], mask=smask[:, None] & (ws < W)[None, :],
                    other=-float("inf"))
        m, i = tl.max(v, 1, return_indices=True)
        better = m > best
        best = tl.where(better, m, best)
        arg = tl.where(better, i + w0, arg)
    tl.store(best_ptr + g * SP + ss, best)
    tl.debug_barrier()
    pos = tl.zeros((SP,), tl.int32)  # descending, stable: larger maxima first, then lower slice index
    for t0 in range(0, SP, TB):
        ts = t0 + tl.arange(0, TB)
        bt = tl.load(best_ptr + g * SP + ts)[None, :]
        ahead = (bt > best[:, None]) | ((bt == best[:, None]) & (ts[None, :] < ss[:, None]))
        pos += tl.sum((ahead & (ts < S)[None, :]).to(tl.int32), 1)
    tl.store(sorted_ptr + g * SP + pos, arg + ss * W, mask=smask)
    tl.debug_barrier()
    dcols = tl.arange(0, D)
    seen = g.to(tl.int32) * 0  # empty clusters before this block
    for k0 in range(0, K, KB):
        ks = k0 + tl.arange(0, KB)
        empty = (tl.load(counts_ptr + g * K + ks, mask=ks < K, other=1) == 0) & (ks < K)
        e = empty.to(tl.int32)
        rank = tl.minimum(tl.maximum(seen + tl.cumsum(e, 0) - 1, 0), S - 1)
        seen += tl.sum(e, 0)
        tok = tl.load(sorted_ptr + g * SP + rank, mask=empty, other=0)
        row = tl.load(x_ptr + (g * N + tok)[:, None] * D + dcols[None, :], mask=empty[:, None], other=0.0)
        rf = row.to(tl.float32)
        tl.store(c_ptr + (g * K + ks)[:, None] * D + dcols[None, :], rf, mask=empty[:, None])
        if CB:  # the BF16 table the update wrote: its reseeded rows too
            tl.store(cb_ptr + (g * K + ks)[:, None] * D + dcols[None, :], to_bf16(rf, INTERP), mask=empty[:, None])


def reseed_empty_fused(x: torch.Tensor, c: torch.Tensor, counts: torch.Tensor, dist: torch.Tensor,
                       bf16_out: torch.Tensor | None = None) -> torch.Tensor:
    """`qvg.kmeans.reseed_empty` (x [G, N, D], c [G, K, D] fp32, counts [G, K], dist [G, N] fp32) in one launch.
    Writes the reseeded rows into `c` IN PLACE (the update's fresh output) and returns it. K <= RESEED_MAX_K.
    bf16_out: the BF16 rounding of c (as the update wrote it with its `bf16_out`): its reseeded rows are rewritten
    too, so that it stays the BF16 rounding of the returned c."""
    g, n, d = x.shape
    k = c.shape[1]
    if k > RESEED_MAX_K or c.dtype != torch.float32 or not c.is_contiguous() or d & (d - 1):
        raise ValueError("reseed_empty_fused: K <= 512, c contiguous fp32, D a power of two")
    s = min(k, n)
    sp = max(16, next_pow2(s))
    best = torch.empty(g, sp, device=x.device, dtype=torch.float32)
    order = torch.empty(g, sp, device=x.device, dtype=torch.int32)
    cb, cb_kw = bf16_out_args(bf16_out, c)
    launch(_reseed_kernel, (g,), x.contiguous(), dist.float().contiguous(), counts.contiguous(), c, best, order, cb, n,
           k, s, n // s, D=d, SP=sp, BW=max(1, min(32, 8192 // sp)), TB=min(sp, 64), KB=min(sp, 64), num_warps=8,
           **cb_kw)
    return c
