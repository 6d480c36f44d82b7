"""Attention over a packed history plus a BF16 tail: the pure-torch reference (and CPU fallback) of
kernels/attention.py. It materializes the history, which the kernel never does.

q [B, Hq, M, D]; history K/V: `PackedSequence` with Hkv heads (Hq a multiple of Hkv: GQA); tail K/V
[B, Hkv, T, D] (the chunk being denoised and any BF16 sink/recent zone). No mask: past chunks are fully visible
and the current chunk attends to itself bidirectionally (block-causal at chunk granularity).
"""
from __future__ import annotations

import torch

from .sequence import PackedSequence


def check_attention_shapes(q: torch.Tensor, k_hist, v_hist, k_tail: torch.Tensor | None,
                           v_tail: torch.Tensor | None) -> None:
    """ValueError unless q is [B, Hq, M, D], the history's K and V (packed) and the tail's K and V are each given
    together with one shape [B, Hkv, N or T, D], and Hq is a multiple of Hkv: the kernels index one with the
    other's sizes, so a mismatch read out of bounds (NaN, or another head's tokens) instead of failing."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, M, D], got {list(q.shape)}")
    b, hq, _, d = q.shape
    parts = {}
    for name, k, v in (("history", k_hist, v_hist), ("tail", k_tail, v_tail)):
        if (k is None) != (v is None):
            raise ValueError(f"give the {name}'s K and V together (one of them is None)")
        if k is not None:
            if len(k.shape) != 4 or tuple(k.shape) != tuple(v.shape):
                raise ValueError(f"the {name}'s K and V must be [B, Hkv, tokens, D] of one shape, got "
                                 f"{list(k.shape)} and {list(v.shape)}")
            parts[name] = tuple(k.shape)
    if not parts:
        raise ValueError("attention needs a history or a tail")
    for name, (kb, hkv, _, kd) in parts.items():
        if (kb, kd) != (b, d):
            raise ValueError(f"the {name}'s batch and head dim ({kb}, {kd}) must be the queries' ({b}, {d})")
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if len({p[1] for p in parts.values()}) > 1:
        raise ValueError(f"the history and the tail must have the same kv heads, got {parts['history'][1]} and "
                         f"{parts['tail'][1]}")


def attend_reference(q: torch.Tensor, k_hist: PackedSequence | None, v_hist: PackedSequence | None,
                     k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                     scale: float | None = None, rope=None, exact: bool = False) -> torch.Tensor:
    """`rope` (qvg.rope.RopeTables): the history keys were stored before RoPE and are rotated on read. exact: the
    history decoded in FP32 without its BF16 rounding (the values the packed data stands for), else as the
    reference decode rounds it (bit-equal to the kernels' dequant); FP32 attention either way."""
    ks, vs = [], []
    if k_hist is not None:
        dt = torch.float32 if exact else None
        ks.append(k_hist.decompress(rope, dt).float())
        vs.append(v_hist.decompress(dtype=dt).float())
    if k_tail is not None:
        ks.append(k_tail.float())
        vs.append(v_tail.float())
    if not ks:
        raise ValueError("attention needs a history or a tail")
    return sdpa_gqa(q.float(), torch.cat(ks, 2), torch.cat(vs, 2), scale).to(q.dtype)


def repeat_kv(k: torch.Tensor, v: torch.Tensor, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, N, D] with each kv head repeated for its hq / Hkv query heads (GQA); themselves if equal."""
    rep = hq // k.shape[1]
    if rep * k.shape[1] != hq:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    if rep > 1:
        return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return k, v


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """SDPA of q [B, Hq, M, D] over k, v [B, Hkv, N, D] (Hq a multiple of Hkv: each kv head serves Hq/Hkv query
    heads), in q's dtype."""
    k, v = repeat_kv(k, v, q.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale)
