"""One k-means iteration in one pass over the tokens (Triton): assignment and the centroid sums of the new
clusters together. Reference: `qvg.kmeans` (one `assign`, then `update_with_counts` on its ids).

The separate steps read x [G, N, D] twice per iteration (assign, then update). Here a persistent program holds all
K <= 256 centroids of its group on chip and, per block of tokens:
1. distances |c|^2 - 2 x.c by one tensor-core dot product (BF16 operands, FP32 accumulation) and one (value,
   index) min per token (ties -> lowest id): the same arithmetic and ids as `kmeans.assign(mode="min",
   block_k >= K)` with the same block_n / num_warps;
2. ids and distances stored (the distances feed the empty-cluster reseeding);
3. the block's one-hot tile [K, BLOCK_N], built in registers from those ids, times the x tile on tensor cores:
   exact products, added to the program's FP32 sums [K, D] and counts.
Each program then writes its partial sums; `_onehot_finish_kernel` adds the programs' partials in program order,
divides (IEEE) and keeps the old centroid of an empty cluster. Fixed grid and shapes: deterministic (no float
atomics), no host sync, CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.kmeans import id_dtype

from .common import INTERPRET, dot_bf16, sm_count, to_bf16

FUSED_MAX_K = 256  # the program's FP32 sums [K, D] live in registers


@triton.jit
def _assign_update_kernel(x_ptr, c_ptr, csq_ptr, ids_ptr, dist_ptr, sums_ptr, cnt_ptr, N, K, NBLK, PROGS,
                          D: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
                          INTERP: tl.constexpr, TRANS: tl.constexpr = False, HIST: tl.constexpr = False):
    """Program (p, g) takes token blocks p, p + PROGS, ... of group g and writes its partial sums [K, D] and
    cluster sizes [K] at slot (g, p)."""
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    dcols = tl.arange(0, D)
    kt = tl.arange(0, KP)
    kmask = kt < K
    c = tl.load(c_ptr + (g * K + kt)[:, None] * D + dcols[None, :], mask=kmask[:, None], other=0.0)
    csq = tl.load(csq_ptr + g * K + kt, mask=kmask, other=float("inf"))
    if TRANS:
        acc = tl.zeros((D, KP), tl.float32)
    else:
        acc = tl.zeros((KP, D), tl.float32)
    cnt = tl.zeros((KP,), tl.int32)
    for blk in range(pid, NBLK, PROGS):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        x = tl.load(x_ptr + (g * N + rows)[:, None] * D + dcols[None, :], mask=rmask[:, None], other=0.0)
        d = csq[None, :] - 2.0 * dot_bf16(x, tl.trans(c), tl.zeros((BLOCK_N, KP), tl.float32), INTERP)
        best, best_id = tl.min(d, 1, return_indices=True)
        tl.store(ids_ptr + g * N + rows, best_id.to(ids_ptr.dtype.element_ty), mask=rmask)
        xf = x.to(tl.float32)
        tl.store(dist_ptr + g * N + rows, tl.maximum(best + tl.sum(xf * xf, 1), 0.0), mask=rmask)
        idv = tl.where(rmask, best_id, -1)  # padding rows match no centroid
        if TRANS:
            oh = idv[:, None] == kt[None, :]  # [BLOCK_N, KP], the distances' layout
        else:
            oh = kt[:, None] == idv[None, :]  # [KP, BLOCK_N]
        ohb = tl.where(oh, 1.0, 0.0).to(tl.bfloat16)
        for _ in tl.static_range(PARTS):  # BF16 x: exact; FP32 x as PARTS BF16 pieces (hi + mid + lo)
            part = x if PARTS == 1 else to_bf16(xf, INTERP)
            if TRANS:
                acc = dot_bf16(tl.trans(part), ohb, acc, INTERP)
            else:
                acc = dot_bf16(ohb, part, acc, INTERP)
            if PARTS > 1:
                xf = xf - part.to(tl.float32)
        if HIST:
            cnt += tl.histogram(tl.where(rmask, best_id, 0), KP) - tl.where(kt == 0, BLOCK_N - tl.sum(
                rmask.to(tl.int32), 0), 0)
        elif TRANS:
            cnt += tl.sum(oh.to(tl.int32), 0)
        else:
            cnt += tl.sum(oh.to(tl.int32), 1)
    base = (g * PROGS + pid) * K + kt
    if TRANS:
        tl.store(sums_ptr + base[None, :] * D + dcols[:, None], acc, mask=kmask[None, :])
    else:
        tl.store(sums_ptr + base[:, None] * D + dcols[None, :], acc, mask=kmask[:, None])
    tl.store(cnt_ptr + base, cnt, mask=kmask)


def assign_update(x: torch.Tensor, c: torch.Tensor, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                  progs: int | str = "auto", trans: bool = False, hist: bool = False):
    """One k-means iteration: x [G, N, D] (bf16 / fp32), c [G, K, D] (K <= FUSED_MAX_K) ->
    (ids [G, N] narrow dtype, squared distances [G, N] fp32, new centroids [G, K, D] fp32, cluster sizes [G, K]
    int32): `assign(x, c, want_dist=True)` and `update_with_counts(x, ids, c)` in one pass over x.
    progs: programs per group (persistent; each writes one partial); "auto": about one per SM over all groups."""
    from .kmeans import _onehot_finish_kernel
    g, n, d = x.shape
    k = c.shape[1]
    if k > FUSED_MAX_K:
        raise ValueError(f"assign_update holds at most {FUSED_MAX_K} centroids per group, got {k}")
    cb = c.to(torch.bfloat16).contiguous()  # the dot's operands are bf16 anyway; |c|^2 of the same values
    csq = cb.float().pow(2).sum(-1)
    kp = max(16, triton.next_power_of_2(k))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    nblk = triton.cdiv(n, block_n)
    if progs == "auto":
        progs = nblk if INTERPRET or not x.is_cuda else max(1, sm_count(x.device) // g)
    progs = max(1, min(int(progs), nblk))
    ids = torch.empty(g, n, device=x.device, dtype=id_dtype(k))
    dist = torch.empty(g, n, device=x.device, dtype=torch.float32)
    sums = torch.empty(g, progs, k, d, device=x.device, dtype=torch.float32)
    cnt = torch.empty(g, progs, k, device=x.device, dtype=torch.int32)
    _assign_update_kernel[(progs, g)](x.contiguous(), cb, csq, ids, dist, sums, cnt, n, k, nblk, progs, D=d, KP=kp,
                                      BLOCK_N=block_n, PARTS=1 if x.dtype == torch.bfloat16 else 3,
                                      INTERP=INTERPRET, TRANS=trans, HIST=hist, num_warps=num_warps,
                                      num_stages=num_stages)
    c_new = torch.empty(g, k, d, device=x.device, dtype=torch.float32)
    counts = torch.empty(g, k, device=x.device, dtype=torch.int32)
    fk = min(32, kp)
    _onehot_finish_kernel[(triton.cdiv(k, fk), g)](sums, cnt, c.float().contiguous(), c_new, counts, k, progs, D=d,
                                                   BLOCK_K=fk, num_warps=4)
    return ids, dist, c_new, counts
