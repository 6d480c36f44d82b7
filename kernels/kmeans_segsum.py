"""Deterministic, memory-bound centroid update (Triton): counting sort of the tokens by cluster, then a
load-balanced segmented sum. Same contract as `qvg.kmeans.update_with_counts` (FP32 sums of the given x values,
IEEE division, empty clusters keep their old centroid, cluster sizes [G, K] int32); reached through
`qvg.kernels.kmeans.update_with_counts(..., method="segsum")`.

For x [G, N, D] and ids [G, N] (K clusters), five launches, fixed shapes, no host sync (CUDA-graph capturable), no
float atomics:
1. `_block_sort_kernel`: each block of SB tokens sorts its (id, token) keys in registers and counts its tokens
   per cluster (hist [G, NB, K], and where each cluster's run starts in the sorted block).
2. `_scan_kernel` (one program per group): cluster sizes, cluster starts in the sorted order (cstart [G, K+1]),
   each block's first slot per cluster (offs [G, NB, K]) and work-item starts (istart [G, K+1]: a cluster of c
   tokens gets ceil(c / ITEM) items).
3. `_scatter_kernel`: order[g, offs[b, id] + rank in the block's run of id] = token: a stable counting sort
   (within a cluster, tokens stay in index order).
   block="rank" replaces steps 1 and 3 (same order, no sort): `_block_rank_kernel` counts each token's rank in its
   cluster's run directly (per sub-block of R tokens: a running histogram read with tl.gather, plus an [R, R]
   comparison) with the block's cluster sizes, and `_scatter_rank_kernel` writes order[g, offs[b, id] + rank].
4. `_segsum_kernel`: a fixed grid of cdiv(N, ITEM) + K items per group (an upper bound of sum_k ceil(c_k/ITEM));
   item p finds its cluster from istart and sums its <= ITEM sorted tokens in FP32 (rows of ROWS tokens, then the
   rows), in a fixed order, into its own slot part[g, p]; surplus items write nothing.
5. `_segfinish_kernel`: each cluster adds its items' partials in item order, divides (IEEE div_rn) and keeps
   the old centroid when it is empty.
Every pass reads x once (the gathered rows of the sorted order); the rest moves ids-sized data. The work per item
is bounded by ITEM tokens however uneven the clusters are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, check_out, next_pow2, to_bf16
from .launch import launch


@triton.jit
def _block_sort_kernel(ids_ptr, keys_ptr, hist_ptr, lstart_ptr, N, K, NB, KP: tl.constexpr, SB: tl.constexpr,
                       BITONIC: tl.constexpr):
    """Per block of SB tokens: its (id, token) keys sorted (stable by construction: the token index breaks ties),
    its cluster sizes and their exclusive prefix (where each cluster's run starts in the sorted block). BITONIC:
    tl.sort in registers (the GPU); else each key is stored at its rank, counted by pairwise comparisons (the same
    array; the interpreter's tl.sort takes seconds per block)."""
    b = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, SB)
    rows = b * SB + t
    m = rows < N
    idv = tl.load(ids_ptr + g * N + rows, mask=m, other=0).to(tl.int32)
    keys = tl.where(m, idv * SB + t, 0x7FFFFFFF)  # distinct; padding sorts last
    if BITONIC:
        tl.store(keys_ptr + g * N + rows, tl.sort(keys), mask=m)
    else:
        rank = tl.sum((keys[None, :] < keys[:, None]).to(tl.int32), 1)
        tl.store(keys_ptr + g * N + b * SB + rank, keys, mask=m)
    ks = tl.arange(0, KP)
    hist = tl.histogram(idv, KP) - tl.where(ks == 0, SB - tl.sum(m.to(tl.int32), 0), 0)  # padding counted as 0
    tl.store(hist_ptr + (g * NB + b) * K + ks, hist, mask=ks < K)
    tl.store(lstart_ptr + (g * NB + b) * K + ks, tl.cumsum(hist, 0) - hist, mask=ks < K)


@triton.jit
def _block_rank_kernel(ids_ptr, rank_ptr, hist_ptr, N, K, NB, KP: tl.constexpr, SB: tl.constexpr, R: tl.constexpr):
    """Per block of SB tokens, without sorting: each token's rank among the block's earlier tokens of its cluster
    (the stable counting sort's offset inside the cluster's run), and the block's cluster sizes. R tokens at a
    time: the count of its id in the earlier sub-blocks (a running histogram, gathered) plus the earlier tokens of
    the same id in this sub-block (an [R, R] comparison)."""
    b = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    bins = tl.arange(0, KP)
    r = tl.arange(0, R)
    hist = tl.zeros((KP,), tl.int32)
    for j0 in range(0, SB, R):
        rows = b * SB + j0 + r
        m = rows < N
        idv = tl.load(ids_ptr + g * N + rows, mask=m, other=0).to(tl.int32)  # padding reads as id 0 ...
        same = (idv[None, :] == idv[:, None]) & (r[None, :] < r[:, None])  # [token, earlier token]
        tl.store(rank_ptr + g * N + rows, tl.gather(hist, idv, 0) + tl.sum(same.to(tl.int32), 1), mask=m)
        # ... and is taken back out of bin 0 (it only ever trails the real tokens)
        hist += tl.histogram(idv, KP) - tl.where(bins == 0, R - tl.sum(m.to(tl.int32), 0), 0)
    tl.store(hist_ptr + (g * NB + b) * K + bins, hist, mask=bins < K)


@triton.jit
def _scatter_rank_kernel(ids_ptr, rank_ptr, offs_ptr, order_ptr, N, K, NB, SB: tl.constexpr):
    """order[g, offs[b, id] + rank] = token (`_block_rank_kernel`'s ranks: the same stable order)."""
    b = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    rows = b * SB + tl.arange(0, SB)
    m = rows < N
    cid = tl.load(ids_ptr + g * N + rows, mask=m, other=0).to(tl.int64)
    slot = tl.load(offs_ptr + (g * NB + b) * K + cid, mask=m, other=0) + tl.load(rank_ptr + g * N + rows, mask=m,
                                                                                   other=0)
    tl.store(order_ptr + g * N + slot, rows, mask=m)


@triton.jit
def _scan_kernel(hist_ptr, offs_ptr, counts_ptr, cstart_ptr, istart_ptr, K, NB, ITEM, KP: tl.constexpr,
                 RB: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    tot = tl.zeros((KP,), tl.int32)
    for b0 in range(0, NB, RB):
        bs = b0 + tl.arange(0, RB)
        m2 = (bs < NB)[:, None] & kmask[None, :]
        tot += tl.sum(tl.load(hist_ptr + (g * NB + bs)[:, None] * K + ks[None, :], mask=m2, other=0), 0)
    items = (tot + ITEM - 1) // ITEM
    cst = tl.cumsum(tot, 0) - tot  # exclusive prefix sums
    ist = tl.cumsum(items, 0) - items
    tl.store(counts_ptr + g * K + ks, tot, mask=kmask)
    tl.store(cstart_ptr + g * (K + 1) + ks, cst, mask=kmask)
    tl.store(istart_ptr + g * (K + 1) + ks, ist, mask=kmask)
    tl.store(cstart_ptr + g * (K + 1) + K, tl.sum(tot, 0))
    tl.store(istart_ptr + g * (K + 1) + K, tl.sum(items, 0))
    run = cst
    for b0 in range(0, NB, RB):
        bs = b0 + tl.arange(0, RB)
        m2 = (bs < NB)[:, None] & kmask[None, :]
        off = (g * NB + bs)[:, None] * K + ks[None, :]
        h = tl.load(hist_ptr + off, mask=m2, other=0)
        tl.store(offs_ptr + off, run[None, :] + tl.cumsum(h, 0) - h, mask=m2)
        run += tl.sum(h, 0)


@triton.jit
def _scatter_kernel(keys_ptr, lstart_ptr, offs_ptr, order_ptr, N, K, NB, SB: tl.constexpr):
    """order[g, offs[b, id] + (position in the sorted block - where id's run starts)] = token."""
    b = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, SB)
    m = b * SB + i < N
    key = tl.load(keys_ptr + g * N + b * SB + i, mask=m, other=0)
    cid = key // SB
    row = (g * NB + b) * K + cid
    slot = tl.load(offs_ptr + row, mask=m, other=0) + i - tl.load(lstart_ptr + row, mask=m, other=0)
    tl.store(order_ptr + g * N + slot, b * SB + key % SB, mask=m)


@triton.jit
def _segsum_kernel(x_ptr, order_ptr, cstart_ptr, istart_ptr, part_ptr, amax_ptr, N, K, ITEM, MAXI, KP: tl.constexpr,
                   D: tl.constexpr, ROWS: tl.constexpr, AMAX: tl.constexpr):
    """AMAX: also the group's max|x| (every token is summed by exactly one item), as an integer max of its FP32
    bits into amax_ptr[g] (non-negative floats order like their bits: an order-independent, deterministic atomic;
    amax_ptr starts at 0)."""
    p = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, KP)
    ist = tl.load(istart_ptr + g * (K + 1) + ks, mask=ks < K, other=0x7FFFFFFF)
    k = tl.sum((ist <= p).to(tl.int32), 0) - 1  # the last cluster whose items start at or before p
    n_items = tl.load(istart_ptr + g * (K + 1) + K)
    j = p - tl.load(istart_ptr + g * (K + 1) + k)
    c1 = tl.load(cstart_ptr + g * (K + 1) + k + 1)
    lo = tl.load(cstart_ptr + g * (K + 1) + k) + j * ITEM
    hi = tl.minimum(lo + ITEM, c1)  # a surplus item (p >= n_items) has lo >= c1: no tokens
    dcols = tl.arange(0, D)
    acc = tl.zeros((ROWS, D), tl.float32)
    big = tl.zeros((ROWS, D), x_ptr.dtype.element_ty)  # (in x's own dtype: |x| and its max are exact there)
    for i0 in range(lo, hi, ROWS):
        idx = i0 + tl.arange(0, ROWS)
        m = idx < hi
        tok = tl.load(order_ptr + g * N + idx, mask=m, other=0)
        xr = tl.load(x_ptr + (g * N + tok)[:, None] * D + dcols[None, :], mask=m[:, None], other=0.0)
        acc += xr.to(tl.float32)
        if AMAX:
            big = tl.maximum(big, tl.abs(xr)).to(big.dtype)
    tl.store(part_ptr + (g * MAXI + p) * D + dcols, tl.sum(acc, 0), mask=dcols < tl.where(p < n_items, D, 0))
    if AMAX:
        if lo < hi:
            tl.atomic_max(amax_ptr + g, tl.max(tl.max(big, 1), 0).to(tl.float32).to(tl.int32, bitcast=True))


def check_bf16_out(t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """t if it can take the BF16 rounding of the centroid table c in place, else ValueError."""
    return check_out(t, c.shape, torch.bfloat16, c.device, "bf16_out")


def bf16_out_args(bf16_out: torch.Tensor | None, c: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The (cb_ptr, constexprs) a kernel that writes the FP32 centroid table c takes for an optional BF16 copy of it
    (`store_means`' CB; with none, c stands in as the unused pointer)."""
    return (c if bf16_out is None else check_bf16_out(bf16_out, c)), {"CB": bf16_out is not None, "INTERP": INTERPRET}


@triton.jit
def store_means(acc, cnt, c_old_ptr, c_new_ptr, g, ks, kmask, K, D: tl.constexpr, cb_ptr, CB: tl.constexpr,
                INTERP: tl.constexpr):
    """Centroid rows ks of group g: the sums acc [BLOCK_K, D] divided by the sizes cnt (IEEE), the old centroid where
    a cluster is empty (c_old in any float dtype). CB: their BF16 rounding (RNE) into cb_ptr too (a k-means' last
    update writes the stored BF16 table directly)."""
    off = (g * K + ks)[:, None] * D + tl.arange(0, D)[None, :]
    old = tl.load(c_old_ptr + off, mask=kmask[:, None], other=0.0).to(tl.float32)
    new = tl.where((cnt > 0)[:, None], tl.math.div_rn(acc, tl.maximum(cnt, 1).to(tl.float32)[:, None]), old)
    tl.store(c_new_ptr + off, new, mask=kmask[:, None])
    if CB:
        tl.store(cb_ptr + off, to_bf16(new, INTERP), mask=kmask[:, None])


@triton.jit
def _segfinish_kernel(part_ptr, istart_ptr, counts_ptr, c_old_ptr, c_new_ptr, sums_ptr, cb_ptr, K, MAXI,
                      D: tl.constexpr, BLOCK_K: tl.constexpr, SUMS: tl.constexpr, CB: tl.constexpr,
                      INTERP: tl.constexpr):
    """Each cluster of the block adds its items' partial sums in item order, then `store_means`; SUMS: the cluster
    sums too, into sums_ptr [G, K, D] FP32."""
    g = tl.program_id(1).to(tl.int64)
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask, dcols = ks < K, tl.arange(0, D)
    s = tl.load(istart_ptr + g * (K + 1) + ks, mask=kmask, other=0)
    nit = tl.load(istart_ptr + g * (K + 1) + ks + 1, mask=kmask, other=0) - s
    acc = tl.zeros((BLOCK_K, D), tl.float32)
    for j in range(0, tl.max(nit, 0)):  # each cluster's items in order
        acc += tl.load(part_ptr + (g * MAXI + s + j)[:, None] * D + dcols[None, :], mask=(j < nit)[:, None],
                       other=0.0)
    store_means(acc, tl.load(counts_ptr + g * K + ks, mask=kmask, other=0), c_old_ptr, c_new_ptr, g, ks, kmask, K, D,
                cb_ptr, CB, INTERP)
    if SUMS:
        tl.store(sums_ptr + (g * K + ks)[:, None] * D + dcols[None, :], acc, mask=kmask[:, None])


def sort_by_cluster(ids: torch.Tensor, k: int, item: int = 256, sort_block: int = 1024, bitonic: bool | None = None,
                    block: str = "sort", rank_rows: int = 32, rank_warps: int = 1):
    """Stable counting sort of each group's tokens by cluster id (steps 1-3). ids [G, N] -> (order [G, N] int32:
    token indices, cluster by cluster, each cluster's in index order; counts [G, K] int32; cstart [G, K+1] int32:
    where each cluster starts in `order`; istart [G, K+1] int32: each cluster's first work item of `item` tokens,
    istart[:, K] = the group's number of items). sort_block: tokens sorted per program (a power of two); bitonic:
    sort them with tl.sort (default: except under the interpreter). block="rank": no sort at all, each token's rank
    in its cluster's run counted directly (`_block_rank_kernel`, rank_rows tokens at a time, on rank_warps warps);
    the same order."""
    if block not in ("sort", "rank"):
        raise ValueError(f"unknown block method {block!r}; choose sort or rank")
    if rank_rows < 1 or rank_rows & (rank_rows - 1):
        raise ValueError(f"rank_rows must be a power of two, got {rank_rows}")
    if sort_block & (sort_block - 1):
        raise ValueError("sort_block must be a power of two")
    g, n = ids.shape
    dev = ids.device
    ids = ids.contiguous()
    kp = max(32, next_pow2(k))  # histogram bins: a power of two, at least a warp
    nb = cdiv(n, sort_block)
    keys = torch.empty(g, n, device=dev, dtype=torch.int32)  # sorted keys, or each token's rank
    hist = torch.empty(g, nb, k, device=dev, dtype=torch.int32)
    offs = torch.empty(g, nb, k, device=dev, dtype=torch.int32)
    counts = torch.empty(g, k, device=dev, dtype=torch.int32)
    cstart = torch.empty(g, k + 1, device=dev, dtype=torch.int32)
    istart = torch.empty(g, k + 1, device=dev, dtype=torch.int32)
    order = torch.empty(g, n, device=dev, dtype=torch.int32)
    if block == "rank":
        launch(_block_rank_kernel, (nb, g), ids, keys, hist, n, k, nb, KP=kp, SB=sort_block,
               R=min(rank_rows, sort_block), num_warps=rank_warps)
        scatter, scatter_args = _scatter_rank_kernel, (ids, keys)
    else:
        lstart = torch.empty(g, nb, k, device=dev, dtype=torch.int32)
        launch(_block_sort_kernel, (nb, g), ids, keys, hist, lstart, n, k, nb, KP=kp, SB=sort_block,
               BITONIC=not INTERPRET if bitonic is None else bitonic, num_warps=4)
        scatter, scatter_args = _scatter_kernel, (keys, lstart)
    launch(_scan_kernel, (g,), hist, offs, counts, cstart, istart, k, nb, item, KP=kp,
           RB=max(1, min(next_pow2(nb), 8192 // kp)), num_warps=4)
    launch(scatter, (nb, g), *scatter_args, offs, order, n, k, nb, SB=sort_block, num_warps=4)
    return order, counts, cstart, istart


def update_segsum(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor, item: int = 256, rows: int = 32,
                  sort_block: int = 1024, num_warps: int = 4, num_stages: int = 2, finish_block: int = 16,
                  block: str = "sort", rank_rows: int = 32, rank_warps: int = 1,
                  amax: torch.Tensor | None = None, sums: torch.Tensor | None = None,
                  bf16_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, N, D] (bf16 / fp32), ids [G, N] (any integer dtype, values < K), c [G, K, D] -> (centroids [G, K, D]
    fp32, cluster sizes [G, K] int32). item: most tokens one work item sums (a multiple of rows); rows: tokens
    summed per step; sort_block: tokens per counting-sort block (a power of two); block: how a block orders its
    tokens ("sort": tl.sort; "rank": counted ranks, no sort; rank_rows / rank_warps: its tiling; `sort_by_cluster`).
    amax: an int32 [G] tensor of zeros to receive each group's max|x| as FP32 bits (read while summing).
    sums: an FP32 [G, K, D] tensor to receive the cluster sums (what kernels/kmeans_delta.py updates).
    bf16_out: a contiguous BF16 [G, K, D] tensor to receive the centroids' BF16 rounding as well."""
    g, n, d = x.shape
    k = c.shape[1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"segsum update needs D a power of two >= 16, got {d}")
    if item % rows:
        raise ValueError("item must be a multiple of rows")
    order, counts, cstart, istart = sort_by_cluster(ids, k, item, sort_block, block=block, rank_rows=rank_rows,
                                                    rank_warps=rank_warps)
    maxi = cdiv(n, item) + k  # >= sum_k ceil(c_k / item)
    part = torch.empty(g, maxi, d, device=x.device, dtype=torch.float32)
    c_new = torch.empty(g, k, d, device=x.device, dtype=torch.float32)
    launch(_segsum_kernel, (maxi, g), x.contiguous(), order, cstart, istart, part, part if amax is None else amax, n, k,
           item, maxi, KP=next_pow2(k), D=d, ROWS=rows, AMAX=amax is not None, num_warps=num_warps,
           num_stages=num_stages)
    cb, cb_kw = bf16_out_args(bf16_out, c_new)
    launch(_segfinish_kernel, (cdiv(k, finish_block), g), part, istart, counts, c.contiguous(), c_new,
           part if sums is None else sums, cb, k, maxi, D=d, BLOCK_K=finish_block, SUMS=sums is not None, num_warps=4,
           **cb_kw)
    return c_new, counts
