"""GPU compress path of rtn / qvg / qvg-pro: the Triton k-means steps and the fused residual + quantize + pack
kernel, in the same order of operations as the reference (qvg/compression/prq.py), so the result matches it."""
from __future__ import annotations

import torch

from qvg.compression.registry import token_spec

from .kmeans import kmeans
from .quantize import quantize_packed


def compress_prq(x: torch.Tensor, o: dict, warm: torch.Tensor | None, iters: int) -> dict[str, torch.Tensor]:
    """x [B, H, N, D]; o: resolved options; warm: [S, B*H, K, D] centroids or None -> the tensors to store."""
    b, h, n, d = x.shape
    s_count, k = o.get("stages", 0), o.get("centroids", 1)
    r = x.reshape(b * h, n, d)
    ids, cents = [], []
    for s in range(s_count):
        res = kmeans(r, k, iters=iters, init=None if warm is None else warm[s], seed=o["seed"] + s,
                     seeding=o["seeding"])
        c16 = res.centroids.to(torch.bfloat16)
        ids.append(res.ids)
        cents.append(c16)
        if s + 1 < s_count:  # the next stage clusters this residual (the last one is formed inside the pack kernel)
            r = r.float() - torch.gather(c16.float(), 1, res.ids.long()[..., None].expand(-1, -1, d))
    if not s_count:
        return quantize_packed(x, token_spec(o))
    ids_t = torch.stack(ids).view(s_count, b, h, n)
    cents_t = torch.stack(cents).view(s_count, b, h, k, d)
    tensors = quantize_packed(x, token_spec(o), ids_t, cents_t)
    tensors["ids"] = ids_t
    tensors["centroids"] = cents_t
    return tensors
