"""Batched k-means steps (Triton) over [G, N, D]. Reference: qvg/kmeans.py (`assign`, `update`, `kmeans`).

- assign: distances |c|^2 - 2 x.c through tensor-core dot products (BF16 operands, FP32 accumulation), running
  argmin over centroid tiles (ties -> lowest index, like torch), ids written directly in their narrow dtype.
  mode="min": the same result with one (value, index) reduction per token, one centroid tile or a persistent
  loop over token blocks (variants timed by `python -m qvg.eval.profile_compress --variants`).
- update (K <= 512): one-hot products on tensor cores, the one-hot tile built in registers from the ids (never
  in memory): per (centroid block, token split) a partial sum, then the splits summed in a fixed order. Exact
  products, FP32 accumulation in an order fixed by the shapes: deterministic. No float atomics.
- update (larger K): tokens stably sorted by id (torch), cluster boundaries found by searchsorted, and one
  program per (group, cluster) sums its tokens in a fixed order in FP32.
- update method="segsum": counting sort + load-balanced segmented sum, memory-bound (kernels/kmeans_segsum.py);
  with incremental=True (`kmeans`, warm starts) every later update reads only the moved tokens
  (kernels/kmeans_delta.py).
- reseed="fused": the empty-cluster reseeding in one launch (kernels/kmeans_reseed.py).
- kmeans: the reference's loop (and seeding) with these two steps, no host synchronisation inside.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.kmeans import KMeansResult, id_dtype
from qvg.kmeans import kmeans as ref_kmeans

from .common import INTERPRET, cdiv, check_head_dim, check_out, dot_bf16, dot_exact, next_pow2, sm_count, to_bf16
from .launch import launch
from .kmeans_delta import update_delta
from .kmeans_reseed import RESEED_MAX_K, reseed_empty_fused
from .kmeans_segsum import bf16_out_args, check_bf16_out, store_means, update_segsum


@triton.jit
def _assign_kernel(x_ptr, c_ptr, csq_ptr, ids_ptr, dist_ptr, N, K, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, WANT_DIST: tl.constexpr, PACKED: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    dcols = tl.arange(0, D)
    x = tl.load(x_ptr + (g * N + rows)[:, None] * D + dcols[None, :], mask=rmask[:, None], other=0.0)
    best = tl.full((BLOCK_N,), float("inf"), tl.float32)
    best_id = tl.zeros((BLOCK_N,), tl.int32)
    key_best = tl.full((BLOCK_N,), 0x7FFFFFFF, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        c = tl.load(c_ptr + (g * K + ks)[:, None] * D + dcols[None, :], mask=kmask[:, None], other=0.0)
        csq = tl.load(csq_ptr + g * K + ks, mask=kmask, other=float("inf"))
        d = csq[None, :] - 2.0 * dot_bf16(x, tl.trans(c), tl.zeros((BLOCK_N, BLOCK_K), tl.float32), INTERP)
        if PACKED:  # one integer min: order-preserving int32 of the distance, low 8 bits replaced by the id
            u = d.to(tl.int32, bitcast=True)
            key = tl.where(kmask[None, :], ((u ^ ((u >> 31) & 0x7FFFFFFF)) & -256) | ks[None, :], 0x7FFFFFFF)
            key_best = tl.minimum(key_best, tl.min(key, 1))
        else:
            m = tl.min(d, 1)
            i = tl.argmin(d, 1).to(tl.int32) + k0
            better = m < best
            best = tl.where(better, m, best)
            best_id = tl.where(better, i, best_id)
    if PACKED:
        best_id = key_best & 255
        kb = key_best & -256
        best = (kb ^ ((kb >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
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


@triton.jit
def _assign_min_kernel(x_ptr, c_ptr, csq_ptr, ids_ptr, dist_ptr, N, K, NBLK, PROGS, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, WANT_DIST: tl.constexpr,
                       INTERP: tl.constexpr):
    """`_assign_kernel`'s result (same distances, ties -> lowest id) with ONE (value, index) reduction per token:
    all K centroids in one tile (ONE_TILE), or an elementwise running minimum over the centroid tiles (strict <:
    the earlier tile keeps a tie) reduced once at the end. Program p of a group takes token blocks p, p + PROGS,
    ... (PROGS < NBLK: persistent; a single tile is then loaded once per program)."""
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    dcols = tl.arange(0, D)
    kt = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        c1 = tl.load(c_ptr + (g * K + kt)[:, None] * D + dcols[None, :], mask=(kt < K)[:, None], other=0.0)
        csq1 = tl.load(csq_ptr + g * K + kt, mask=kt < K, other=float("inf"))
    for blk in range(pid, NBLK, PROGS):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        x = tl.load(x_ptr + (g * N + rows)[:, None] * D + dcols[None, :], mask=rmask[:, None], other=0.0)
        if ONE_TILE:
            d = csq1[None, :] - 2.0 * dot_bf16(x, tl.trans(c1), tl.zeros((BLOCK_N, BLOCK_K), tl.float32), INTERP)
            best, best_id = tl.min(d, 1, return_indices=True)
        else:
            run = tl.full((BLOCK_N, BLOCK_K), float("inf"), tl.float32)
            base = tl.zeros((BLOCK_N, BLOCK_K), tl.int32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + kt
                c = tl.load(c_ptr + (g * K + ks)[:, None] * D + dcols[None, :], mask=(ks < K)[:, None], other=0.0)
                csq = tl.load(csq_ptr + g * K + ks, mask=ks < K, other=float("inf"))
                d = csq[None, :] - 2.0 * dot_bf16(x, tl.trans(c), tl.zeros((BLOCK_N, BLOCK_K), tl.float32), INTERP)
                better = d < run
                run = tl.where(better, d, run)
                base = tl.where(better, k0, base)
            best = tl.min(run, 1)
            best_id = tl.min(tl.where(run == best[:, None], base + kt[None, :], 0x7FFFFFFF), 1)
        tl.store(ids_ptr + g * N + rows, best_id.to(ids_ptr.dtype.element_ty), mask=rmask)
        if WANT_DIST:
            xf = x.to(tl.float32)
            tl.store(dist_ptr + g * N + rows, tl.maximum(best + tl.sum(xf * xf, 1), 0.0), mask=rmask)


@triton.jit
def _prep_centroids_kernel(c_ptr, cb_ptr, csq_ptr, R, D: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """Rows of c (any float dtype) -> their BF16 rounding and |BF16 row|^2 in FP32: the assignment's operands."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < R
    off = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    cb = to_bf16(tl.load(c_ptr + off, mask=m[:, None], other=0.0).to(tl.float32), INTERP)
    tl.store(cb_ptr + off, cb, mask=m[:, None])
    cf = cb.to(tl.float32)
    tl.store(csq_ptr + rows, tl.sum(cf * cf, 1), mask=m)


def prep_centroids(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c [G, K, D] -> (BF16 c, |BF16 c|^2 [G, K] FP32) in one launch (the torch form took four)."""
    g, k, d = c.shape
    c = c.contiguous()
    cb = torch.empty(g, k, d, device=c.device, dtype=torch.bfloat16)
    csq = torch.empty(g, k, device=c.device, dtype=torch.float32)
    if d & (d - 1):  # the kernel's row is one power-of-two tile
        cb.copy_(c)
        return cb, cb.float().pow(2).sum(-1)
    block = max(1, min(64, 8192 // d))
    launch(_prep_centroids_kernel, (cdiv(g * k, block),), c, cb, csq, g * k, D=d, BLOCK=block, INTERP=INTERPRET,
           num_warps=4)
    return cb, csq


ASSIGN_MODES = ("tiles", "min")


def assign(x: torch.Tensor, c: torch.Tensor, want_dist: bool = False, block_n: int = 64, block_k: int = 64,
           num_warps: int = 4, num_stages: int = 2, packed: bool = False, mode: str = "tiles", progs: int = 0,
           per_sm: int = 2, out: torch.Tensor | None = None):
    """x [G, N, D] (bf16/fp32), c [G, K, D] (fp32, or any float dtype: the dot reads its BF16 rounding) -> (ids
    [G, N] narrow dtype, squared distance [G, N] or None).
    packed (K <= 256; measured no faster on an H100, eval/results/profile-compress-h100.json): the argmin is one
    integer min over (distance with its last 8 mantissa bits replaced by the id): ties within 2^-15 relative go to
    the lower id, the returned distance is that truncated value.
    mode "min" (`_assign_min_kernel`, same result as "tiles"): one reduction per token; block_k >= K puts all
    centroids in one tile; progs > 0: that many programs per group loop over the token blocks (persistent);
    progs="auto": about per_sm programs per SM over all groups (at least one per group). out: a contiguous [G, N]
    tensor of the ids' dtype that receives the ids (returned as them)."""
    check_head_dim(x.shape[-1])
    if mode not in ASSIGN_MODES:
        raise ValueError(f"unknown assign mode {mode!r}; choose one of {ASSIGN_MODES}")
    g, n, d = x.shape
    k = c.shape[1]
    c, csq = prep_centroids(c)  # the dot's operands are bf16 anyway; |c|^2 of the same values
    ids = (torch.empty(g, n, device=x.device, dtype=id_dtype(k)) if out is None
           else check_out(out, (g, n), id_dtype(k), x.device, "assign: out"))
    dist = torch.empty(g, n, device=x.device, dtype=torch.float32) if want_dist else csq
    block_n = min(block_n, max(16, next_pow2(n)))
    block_k = min(block_k, max(16, next_pow2(k)))
    if mode == "min":
        nblk = cdiv(n, block_n)
        if progs == "auto":
            progs = nblk if INTERPRET or not x.is_cuda else max(1, per_sm * sm_count(x.device) // g)
        progs = nblk if progs <= 0 else min(progs, nblk)
        launch(_assign_min_kernel, (progs, g), x.contiguous(), c, csq, ids, dist, n, k, nblk, progs, D=d,
               BLOCK_N=block_n, BLOCK_K=block_k, ONE_TILE=block_k >= k, WANT_DIST=want_dist, INTERP=INTERPRET,
               num_warps=num_warps, num_stages=num_stages)
        return ids, (dist if want_dist else None)
    launch(_assign_kernel, (cdiv(n, block_n), g), x.contiguous(), c, csq, ids, dist, n, k, D=d, BLOCK_N=block_n,
           BLOCK_K=block_k, WANT_DIST=want_dist, PACKED=packed and k <= 256, INTERP=INTERPRET, num_warps=num_warps,
           num_stages=num_stages)
    return ids, (dist if want_dist else None)


@triton.jit
def _onehot_partial_kernel(x_ptr, ids_ptr, sums_ptr, cnt_ptr, amax_ptr, N, K, CHUNK, SPLITS, D: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr,
                           AMAX: tl.constexpr):
    """Per (centroid block, token split, group): sums[k] = onehot(ids == k) @ x over the split's tokens, on tensor
    cores (exact products, FP32 accumulation in a fixed order), and the split's cluster sizes. FP32 x is split
    into PARTS BF16 pieces (hi + mid + lo carries its 24 mantissa bits). AMAX: the first centroid block's programs
    also take the group's max|x| (an integer max of FP32 bits into amax_ptr[g], as in kmeans_segsum)."""
    kb = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    dcols = tl.arange(0, D)
    acc = tl.zeros((BLOCK_K, D), tl.float32)
    cnt = tl.zeros((BLOCK_K,), tl.int32)
    big = tl.zeros((BLOCK_N, D), tl.float32)
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, N)
    for n0 in range(lo, hi, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        m = rows < hi
        idv = tl.where(m, tl.load(ids_ptr + g * N + rows, mask=m, other=0).to(tl.int32), -1)
        oh = ks[:, None] == idv[None, :]
        x = tl.load(x_ptr + (g * N + rows)[:, None] * D + dcols[None, :], mask=m[:, None], other=0.0)
        if AMAX:
            big = tl.maximum(big, tl.abs(x.to(tl.float32)))
        ohb = tl.where(oh, 1.0, 0.0).to(tl.bfloat16)
        acc = dot_exact(ohb, x, acc, PARTS, INTERP)
        cnt += tl.sum(oh.to(tl.int32), 1)
    kmask = ks < K
    base = (g * SPLITS + sp) * K + ks
    tl.store(sums_ptr + base[:, None] * D + dcols[None, :], acc, mask=kmask[:, None])
    tl.store(cnt_ptr + base, cnt, mask=kmask)
    if AMAX:
        if kb == 0:
            tl.atomic_max(amax_ptr + g, tl.max(tl.max(big, 1), 0).to(tl.int32, bitcast=True))


@triton.jit
def _onehot_finish_kernel(sums_ptr, cnt_ptr, c_old_ptr, c_new_ptr, counts_ptr, cb_ptr, K, SPLITS, D: tl.constexpr,
                          BLOCK_K: tl.constexpr, CB: tl.constexpr, INTERP: tl.constexpr):
    """Sum the splits in order, divide by the cluster size (IEEE), keep the old centroid of an empty cluster."""
    kb = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < K
    dcols = tl.arange(0, D)
    acc = tl.zeros((BLOCK_K, D), tl.float32)
    cnt = tl.zeros((BLOCK_K,), tl.int32)
    for sp in range(0, SPLITS):
        base = (g * SPLITS + sp) * K + ks
        acc += tl.load(sums_ptr + base[:, None] * D + dcols[None, :], mask=kmask[:, None], other=0.0)
        cnt += tl.load(cnt_ptr + base, mask=kmask, other=0)
    store_means(acc, cnt, c_old_ptr, c_new_ptr, g, ks, kmask, K, D, cb_ptr, CB, INTERP)
    tl.store(counts_ptr + g * K + ks, cnt, mask=kmask)


DELTA_MAX_K = 512  # the incremental update's [K, D] accumulator per program: above this, full updates
ONEHOT_MAX_K = 512  # above this the one-hot product's K x N x D work outgrows the sort + segmented sum


def update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, **kw) -> torch.Tensor:
    """Deterministic centroid update: mean of each cluster's tokens; empty clusters keep `c`."""
    return update_with_counts(x, ids, c, **kw)[0]


def update_with_counts(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, method: str | None = None,
                       amax: torch.Tensor | None = None, **kw):
    """`update`, plus the cluster sizes [G, K] int32. method: "onehot" (default for K <= 512: one-hot products on
    tensor cores, split over tokens, splits summed in a fixed order), "sort" (stable sort by id + segmented sum) or
    "segsum" (counting sort + load-balanced segmented sum, memory-bound: kernels/kmeans_segsum.py).
    amax: an int32 [G] tensor of zeros that receives each group's max|x| as FP32 bits (`amax_bits`); the onehot and
    segsum kernels take it while they read x, "sort" with a torch reduction. bf16_out (keyword, every method): a
    contiguous BF16 [G, K, D] tensor that receives the new centroids' BF16 rounding too (the finishing kernel writes
    it; "sort" copies)."""
    check_head_dim(x.shape[-1])
    method = method or ("onehot" if c.shape[1] <= ONEHOT_MAX_K else "sort")
    if method == "segsum":
        return update_segsum(x, ids, c, amax=amax, **kw)
    if method == "onehot":
        return _update_onehot(x, ids, c, amax=amax, **kw)
    if method == "sort":
        if amax is not None:
            amax.copy_(amax_bits(x))
        return _update_sort(x, ids, c, **kw)
    raise ValueError(f"unknown update method {method!r}")


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """max|x| over each group of x [G, ...] as the int32 bits of its FP32 value (the update kernels' `amax`)."""
    return x.flatten(1).abs().amax(1).float().view(torch.int32)


def _update_onehot(x, ids, c, block_k: int = 64, block_n: int = 32, chunk: int = 4096, num_warps: int = 4,
                   num_stages: int = 3, amax: torch.Tensor | None = None, bf16_out: torch.Tensor | None = None):
    g, n, d = x.shape
    k = c.shape[1]
    block_k = min(block_k, max(16, next_pow2(k)))
    chunk = max(block_n, chunk // block_n * block_n)
    splits = cdiv(n, chunk)
    sums = torch.empty(g, splits, k, d, device=x.device, dtype=torch.float32)
    cnt = torch.empty(g, splits, k, device=x.device, dtype=torch.int32)
    launch(_onehot_partial_kernel, (cdiv(k, block_k), splits, g), x.contiguous(), ids.contiguous(), sums, cnt,
           cnt if amax is None else amax, n, k, chunk, splits, D=d, BLOCK_K=block_k, BLOCK_N=block_n,
           PARTS=1 if x.dtype == torch.bfloat16 else 3, INTERP=INTERPRET, AMAX=amax is not None, num_warps=num_warps,
           num_stages=num_stages)
    c_new = torch.empty(g, k, d, device=x.device, dtype=torch.float32)
    counts = torch.empty(g, k, device=x.device, dtype=torch.int32)
    fk = min(32, max(16, next_pow2(k)))
    cb, cb_kw = bf16_out_args(bf16_out, c_new)
    launch(_onehot_finish_kernel, (cdiv(k, fk), g), sums, cnt, c.contiguous(), c_new, counts, cb, k, splits, D=d,
           BLOCK_K=fk, num_warps=4, **cb_kw)
    return c_new, counts


def _update_sort(x, ids, c, block_n: int = 32, num_warps: int = 2, bf16_out: torch.Tensor | None = None):
    g, n, d = x.shape
    k = c.shape[1]
    keys = ids.to(torch.int32)
    sorted_ids, order = torch.sort(keys, dim=1, stable=True)
    probes = torch.arange(k + 1, device=x.device, dtype=torch.int32).expand(g, -1).contiguous()
    bounds = torch.searchsorted(sorted_ids, probes).to(torch.int32)  # [G, K+1]: cluster j is [bounds_j, bounds_j+1)
    c_old = c.float().contiguous()
    c_new = torch.empty_like(c_old)
    launch(_segment_mean_kernel, (k, g), x.contiguous(), order.to(torch.int32), bounds, c_old, c_new, n, k, D=d,
           BLOCK_N=block_n, num_warps=num_warps)
    if bf16_out is not None:
        check_bf16_out(bf16_out, c_new).copy_(c_new)
    return c_new, bounds[:, 1:] - bounds[:, :-1]


def kmeans(x: torch.Tensor, k: int, *, iters: int = 2, init: torch.Tensor | None = None, seed: int = 0,
           seeding: str = "k-means++", track: bool = False, assign_kw: dict | None = None,
           update_kw: dict | None = None, reseed: str = "torch", amax: torch.Tensor | None = None,
           ids_out: torch.Tensor | None = None, cents_out: torch.Tensor | None = None) -> KMeansResult:
    """`qvg.kmeans.kmeans` (same seeding, loop and result) with the Triton assignment and update steps.
    assign_kw / update_kw: options of `assign` / `update_with_counts` (variants, tiles); reseed: "torch"
    (`qvg.kmeans.reseed_empty`) or "fused" (the same in one launch, K <= 512: kernels/kmeans_reseed.py).
    amax: an int32 [G] tensor of zeros that receives each group's max|x| (FP32 bits): the first update reads x
    anyway and takes it (with iters = 0 a torch reduction does).
    update_kw incremental=True (with method="segsum"): on warm starts with K <= DELTA_MAX_K, every update after the
    first reads only the tokens whose id changed (kernels/kmeans_delta.py), from the previous update's cluster sums
    (a cold start's early iterations move many tokens, and the delta's one-hot product costs K x D per moved token);
    otherwise every update is the segmented sum.
    ids_out / cents_out: tensors [G, N] of the ids' dtype / BF16 [G, K, D] (contiguous) that receive the result's
    ids / the BF16 rounding of its centroids: the last assignment writes the ids there, and with iters > 0 and the
    fused reseeding the last update and reseeding write the BF16 table (else it is copied at the end); the result's
    ids are ids_out. With iters > 0 a warm start is read in its own dtype (the steps take any float dtype: no FP32
    copy of it); the returned centroids are FP32."""
    check_head_dim(x.shape[-1])
    akw, ukw = dict(assign_kw or {}), dict(update_kw or {})
    incremental = ukw.pop("incremental", False)
    if incremental and ukw.get("method") != "segsum":
        raise ValueError('kmeans: update_kw incremental=True needs method="segsum"')
    incremental = incremental and init is not None and k <= DELTA_MAX_K  # (measured there: warm starts, K <= 256)
    if amax is not None and iters == 0:
        amax.copy_(amax_bits(x))
    if reseed not in ("torch", "fused"):
        raise ValueError(f"unknown reseed {reseed!r}; choose torch or fused")
    fused = reseed == "fused" and k <= RESEED_MAX_K
    direct = cents_out is not None and iters > 0 and fused  # the last update + reseeding write cents_out
    first = [amax]
    last = {}  # incremental: the previous update's ids, cluster sums and sizes
    calls = {"assign": 0, "update": 0}

    def assign_fn(x_, c_):
        calls["assign"] += 1  # the last one (number max(iters, 1)) gives the returned ids
        return assign(x_, c_, True, out=ids_out if calls["assign"] == max(iters, 1) else None, **akw)

    def update_fn(x_, i_, c_):
        a, first[0] = first[0], None  # the first update only: x is the same at every iteration
        calls["update"] += 1
        cb = cents_out if direct and calls["update"] == iters else None
        if not incremental:
            return update_with_counts(x_, i_, c_, amax=a, bf16_out=cb, **ukw)
        if last:
            c_new, counts, sums = update_delta(x_, last["ids"], i_, c_, last["sums"], last["counts"], bf16_out=cb)
        else:
            sums = torch.empty(c_.shape, device=c_.device, dtype=torch.float32)
            c_new, counts = update_with_counts(x_, i_, c_, amax=a, sums=sums, bf16_out=cb, **ukw)
        last.update(ids=i_, sums=sums, counts=counts)
        return c_new, counts

    def reseed_fn(x_, c_, counts, dist):
        cb = cents_out if direct and calls["update"] == iters else None
        return reseed_empty_fused(x_, c_, counts, dist, bf16_out=cb)

    res = ref_kmeans(x, k, iters=iters, init=init, seed=seed, seeding=seeding, track=track, assign_fn=assign_fn,
                     update_fn=update_fn, reseed_fn=reseed_fn if fused else None, init_fp32=iters == 0)
    if (ids_out is not None or cents_out is not None) and (calls["assign"], calls["update"]) != (max(iters, 1), iters):
        raise RuntimeError(f"kmeans: the loop made {calls['assign']} assignments and {calls['update']} updates for "
                           f"{iters} iterations; ids_out / cents_out are written by assignment {max(iters, 1)} and "
                           f"update {iters}")
    if cents_out is not None and not direct:
        check_bf16_out(cents_out, res.centroids).copy_(res.centroids)
    return res
