"""GPU compress path of rtn / qvg / qvg-pro: the Triton k-means steps and the fused residual + quantize + pack
kernel, in the same order of operations as the reference (qvg/compression/prq.py), so the result matches it.

Stage s clusters the BF16 rounding of x - sum_{t<s} C_t[ids_t] (FP32 arithmetic, the reference's order), formed
by one kernel from x and the stored ids / centroids; the last residual is formed again inside the pack kernel,
never written."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.compression.registry import token_spec

from .common import INTERPRET, to_bf16
from .kmeans import kmeans
from .quantize import _residual, quantize_packed


@triton.jit
def _residual_bf16_kernel(x_ptr, ids_ptr, cent_ptr, out_ptr, N, K, GH, D: tl.constexpr, STAGES: tl.constexpr,
                          BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    gh = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tok = gh.to(tl.int64) * N + rows
    col = tl.arange(0, D)
    r = _residual(x_ptr, ids_ptr, cent_ptr, tok, rmask, col, N, K, GH, gh, D, STAGES)
    tl.store(out_ptr + tok[:, None] * D + col[None, :], to_bf16(r, INTERP), mask=rmask[:, None])


def residual_bf16(x: torch.Tensor, ids: torch.Tensor, cents: torch.Tensor, stages: int,
                  block_n: int = 32) -> torch.Tensor:
    """x [G, N, D]; ids [S', G, N]; cents [S', G, K, D] BF16 -> BF16(x - sum_{s<stages} cents_s[ids_s]) [G, N, D]."""
    g, n, d = x.shape
    out = torch.empty(g, n, d, device=x.device, dtype=torch.bfloat16)
    _residual_bf16_kernel[(triton.cdiv(n, block_n), g)](x, ids, cents, out, n, cents.shape[-2], g, D=d,
                                                         STAGES=stages, BLOCK_N=block_n, INTERP=INTERPRET,
                                                         num_warps=4)
    return out


def compress_prq(x: torch.Tensor, o: dict, warm: torch.Tensor | None, iters: int) -> dict[str, torch.Tensor]:
    """x [B, H, N, D]; o: resolved options; warm: [S, B*H, K, D] centroids or None -> the tensors to store."""
    b, h, n, d = x.shape
    s_count, k = o.get("stages", 0), o.get("centroids", 1)
    if not s_count:
        return quantize_packed(x, token_spec(o))
    x = x.contiguous()
    g = b * h
    xg = x.view(g, n, d)
    ids_t = cents_t = None
    for s in range(s_count):
        r = xg.to(torch.bfloat16) if s == 0 else residual_bf16(xg, ids_t, cents_t, s)
        res = kmeans(r, k, iters=iters, init=None if warm is None else warm[s], seed=o["seed"] + s,
                     seeding=o["seeding"])
        if ids_t is None:
            ids_t = torch.empty(s_count, g, n, device=x.device, dtype=res.ids.dtype)
            cents_t = torch.empty(s_count, g, k, d, device=x.device, dtype=torch.bfloat16)
        ids_t[s] = res.ids
        cents_t[s] = res.centroids
    ids_t = ids_t.view(s_count, b, h, n)
    cents_t = cents_t.view(s_count, b, h, k, d)
    tensors = quantize_packed(x, token_spec(o), ids_t, cents_t)
    tensors["ids"] = ids_t
    tensors["centroids"] = cents_t
    return tensors
