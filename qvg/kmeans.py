"""Batched streaming k-means over [G, N, D] (G = batch x heads), in one batched call.

- Cold start, seeded: "k-means++" (default; D^2 sampling, one batched step per centroid) or "random" (K distinct
  tokens per group). All random numbers come from a CPU `torch.Generator` seeded with `seed` and are then moved to
  the device, so a seed means the same draws on every device.
- Warm start: `init` [G, K, D] (the previous chunk's centroids: the streaming centroid cache).
- A fixed number of Lloyd iterations (assign, then update); the result is the last assignment and the centroids
  updated from it. No `.item()`, no data-dependent Python control flow: no host synchronisation.
- Deterministic: assignment is argmin over a distance matrix (ties -> lowest index); the centroid update is an
  order-fixed reduction (one-hot matmul on GPU; index_add_ on CPU, which is sequential there). Same inputs and
  seed give bitwise-identical ids on the same device.
- Empty clusters are re-seeded on far-off tokens (`reseed_empty`).
- ids are uint8 when K <= 256 and uint16 when K <= 65536.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

MAX_K = 65536
SEEDINGS = ("k-means++", "random")
_CHUNK_ELEMS = 1 << 24  # cap on G * n * K per distance / one-hot block (64 MiB in fp32)


class KMeansResult(NamedTuple):
    centroids: torch.Tensor  # [G, K, D] float32
    ids: torch.Tensor  # [G, N] uint8 / uint16
    trace: torch.Tensor | None  # [iters + 1] mean squared distance: after each assignment, then of the result


def id_dtype(k: int) -> torch.dtype:
    if not 1 <= k <= MAX_K:
        raise ValueError(f"centroids must be in [1, {MAX_K}], got {k}")
    return torch.uint8 if k <= 256 else torch.uint16


def _rows_per_block(g: int, n: int, k: int) -> int:
    return max(1, min(n, _CHUNK_ELEMS // max(1, g * k)))


def assign(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid for each token. x [G, N, D], c [G, K, D] -> (ids int64 [G, N], squared distance [G, N])."""
    g, n, _ = x.shape
    c_sq = (c * c).sum(-1)  # [G, K]
    ids, dist = [], []
    step = _rows_per_block(g, n, c.shape[1])
    for lo in range(0, n, step):
        xb = x[:, lo:lo + step]
        d = torch.baddbmm(c_sq.unsqueeze(1), xb, c.transpose(1, 2), alpha=-2.0)  # |c|^2 - 2 x.c   [G, n, K]
        m, i = d.min(-1)
        ids.append(i)
        dist.append((m + (xb * xb).sum(-1)).clamp(min=0))
    return torch.cat(ids, 1), torch.cat(dist, 1)


def update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Centroid = mean of its tokens; empty clusters keep `c`. Deterministic on CPU and GPU."""
    return update_with_counts(x, ids, c)[0]


def update_with_counts(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`update`, plus the cluster sizes [G, K] (which the step computes anyway)."""
    g, n, d = x.shape
    k = c.shape[1]
    if x.is_cuda:  # one-hot matmul: fixed-order reduction on tensor cores, no float atomics
        sums = torch.zeros(g, k, d, device=x.device, dtype=torch.float32)
        counts = torch.zeros(g, k, device=x.device, dtype=torch.float32)
        ar = torch.arange(k, device=x.device)
        step = _rows_per_block(g, n, k)
        for lo in range(0, n, step):
            onehot = (ids[:, None, lo:lo + step] == ar[None, :, None]).float()  # [G, K, n]
            sums += torch.bmm(onehot, x[:, lo:lo + step])
            counts += onehot.sum(-1)
    else:  # CPU index_add_ runs sequentially: deterministic
        flat = (ids + torch.arange(g, device=x.device)[:, None] * k).reshape(-1)
        sums = torch.zeros(g * k, d, dtype=torch.float32).index_add_(0, flat, x.reshape(-1, d)).view(g, k, d)
        counts = torch.zeros(g * k, dtype=torch.float32).index_add_(0, flat, torch.ones(g * n)).view(g, k)
    return torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], c), counts


def reseed_empty(x: torch.Tensor, c: torch.Tensor, counts: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Move the centroids of empty clusters (counts == 0) onto far-off tokens. Candidates: the token farthest from
    its assigned centroid in each of K equal slices of the tokens (spread over the chunk; one pass over `dist`),
    ranked by distance; the i-th empty cluster (by index) takes the i-th candidate. Without this, clusters that
    empty out stay dead along a streaming warm-start chain (measured: a third of K by the fourth chunk). Pure
    tensor ops, no host sync, deterministic (first maximum per slice, stable sort)."""
    g, n, d = x.shape
    k = c.shape[1]
    slices = min(k, n)
    width = n // slices  # (the last n mod slices tokens are never candidates)
    best, arg = dist[:, :slices * width].float().reshape(g, slices, width).max(-1)  # [G, slices]
    cand = arg + torch.arange(slices, device=x.device) * width
    cand = torch.gather(cand, 1, torch.sort(best, dim=1, descending=True, stable=True).indices)
    empty = counts == 0
    rank = (empty.long().cumsum(1) - 1).clamp(0, slices - 1)
    repl = _gather(x, torch.gather(cand, 1, rank)).float()  # (gather first: x may be a large bf16 tensor)
    return torch.where(empty[..., None], repl, c)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [G, N, D], idx [G, m] -> [G, m, D]."""
    return torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))


def seed_centroids(x: torch.Tensor, k: int, seed: int = 0, seeding: str = "k-means++") -> torch.Tensor:
    """Cold-start centroids [G, K, D] drawn from the tokens of x [G, N, D]."""
    g, n, _ = x.shape
    gen = torch.Generator().manual_seed(seed)
    if seeding == "random":  # K distinct tokens per group
        idx = torch.rand(g, n, generator=gen).argsort(-1)[:, :k].to(x.device)
        return _gather(x, idx)
    if seeding != "k-means++":
        raise ValueError(f"unknown seeding {seeding!r}; choose one of {SEEDINGS}")
    # one row of K draws per group, in group order: group i's draws do not depend on how many groups are batched
    # (drawn [K, G] they did: a head compressed alone or beside others got other centroids)
    u = torch.rand(g, k, generator=gen, dtype=torch.float64).t().unsqueeze(-1).to(x.device)
    c = torch.empty(g, k, x.shape[-1], device=x.device, dtype=x.dtype)
    c[:, 0] = _gather(x, (u[0] * n).long().clamp(max=n - 1))[:, 0]
    d2 = ((x - c[:, :1]) ** 2).sum(-1)  # [G, N]
    for j in range(1, k):  # D^2 sampling by inverse CDF: one searchsorted per step, no host sync
        cdf = d2.double().cumsum(-1)
        idx = torch.searchsorted(cdf, u[j] * cdf[:, -1:], right=True).clamp(max=n - 1)
        c[:, j] = _gather(x, idx)[:, 0]
        d2 = torch.minimum(d2, ((x - c[:, j:j + 1]) ** 2).sum(-1))
    return c


def objective(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Mean squared distance of each token to its assigned centroid (a 0-dim device tensor)."""
    return (x.float() - _gather(c.float(), ids.long())).pow(2).sum(-1).mean()


def kmeans(x: torch.Tensor, k: int, *, iters: int = 2, init: torch.Tensor | None = None, seed: int = 0,
           seeding: str = "k-means++", track: bool = False, assign_fn=None, update_fn=None,
           reseed_fn=None, init_fp32: bool = True) -> KMeansResult:
    """Batched Lloyd k-means. x [G, N, D]; init [G, K, D] warm-starts (the seeding is then skipped).

    One iteration = assign every token to its nearest centroid, then move each centroid to the mean of its
    tokens (an empty cluster's centroid moves onto a token far from its own centroid: `reseed_empty`). The
    result is the last assignment and the centroids updated from it, so every returned centroid of a non-empty
    cluster is the mean of its returned tokens (the smallest residual for that partition): `iters` iterations cost
    `iters` assignment passes (one when iters=0, which returns the seeds and their assignment).

    track=True also returns the mean squared token-to-centroid distance after each assignment plus that of the
    returned (ids, centroids) pair: [iters + 1] values (a device tensor; reading it is the caller's only sync).
    assign_fn (-> ids, distances) / update_fn (-> centroids, cluster sizes) / reseed_fn (`reseed_empty`'s contract)
    swap in other implementations of the steps (the Triton kernels use this loop). init_fp32=False: `init` is used in
    its own dtype (no FP32 copy) by step implementations that read any float dtype; the centroids returned after an
    update are FP32 either way.
    """
    if x.dim() != 3:
        raise ValueError(f"k-means input must be [G, N, D], got shape {tuple(x.shape)}")
    g, n, d = x.shape
    dt = id_dtype(k)
    if k > n:
        raise ValueError(f"centroids ({k}) > tokens N ({n})")
    if init is None:
        c = seed_centroids(x.float(), k, seed, seeding)
    else:
        if tuple(init.shape) != (g, k, d):
            raise ValueError(f"init centroids must have shape {(g, k, d)}, got {tuple(init.shape)}")
        c = init.to(device=x.device, dtype=torch.float32) if init_fp32 else init.to(x.device)
    if assign_fn is None:
        x = x.float()
    assign_fn = assign_fn or assign
    update_fn = update_fn or update_with_counts
    reseed_fn = reseed_fn or reseed_empty
    trace = []
    ids, dist = assign_fn(x, c)
    for i in range(iters):
        if track:
            trace.append(dist.mean())
        c, counts = update_fn(x, ids, c)
        c = reseed_fn(x, c, counts, dist)
        if i + 1 < iters:
            ids, dist = assign_fn(x, c)
    if track:
        trace.append(objective(x, ids, c) if iters else dist.mean())
    return KMeansResult(c, ids.to(dt), torch.stack(trace) if track else None)
