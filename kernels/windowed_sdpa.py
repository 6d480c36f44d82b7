"""Attention over a packed history plus a BF16 tail through torch's best SDPA backend (cuDNN on Hopper): the
history is decoded window by window by the Triton dequant kernel into a bounded BF16 staging buffer, each window
is attended by SDPA returning its log-sum-exp, and the windows are merged exactly (softmax over the union).

Why beside `attention.staged_attention` (the same staging with our Triton flash kernel): on the H100 cuDNN's flash
attention runs at ~1.4x our kernel's throughput (eval/results/profile-pipeline-h100.json), and the decode is a
small part of the call, so this is the cache's default GPU path. The BF16 history of the whole cache never
exists: the transient is one window of one layer (`WINDOW_BYTES` of K + V), whatever the history length.

When the history and the tail fit one window (the common case: a rolling window of a few dozen latent frames),
the tail is copied behind the decoded history and one plain SDPA call does it all (no merge). That window can be
decoded ahead of time (`decode_window`, then `windowed_attention(..., decoded=...)`): the cache does so on a side
stream while the previous layer attends (`KVCache(prefetch_bytes=..., prefetch_at=...)`).
Reference: qvg.attention.attend_reference (tests/kernels/test_windowed_sdpa.py).
"""
from __future__ import annotations

import torch

from qvg.attention import check_attention_shapes, repeat_kv, sdpa_gqa
from qvg.rope import RopeTables
from qvg.sequence import PackedSequence

WINDOW_BYTES = 1 << 30  # BF16 K + V of one staging window (per layer call; Wan-1.3B: 174k tokens, 112 latent frames)


def sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v in q's dtype, its natural log-sum-exp [B, H, M] fp32); k, v with q's heads."""
    if q.is_cuda:
        for op in (_cudnn_lse, _flash_lse):
            try:
                return op(q, k, v, scale)
            except (RuntimeError, NotImplementedError):
                continue
    s = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhmn,bhnd->bhmd", torch.exp(s - lse[..., None]), v.float()).to(q.dtype), lse


def _cudnn_lse(q, k, v, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def _flash_lse(q, k, v, scale):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def merge_lse(acc: torch.Tensor | None, lse: torch.Tensor | None, out: torch.Tensor, out_lse: torch.Tensor):
    """Fold one window's (out, lse) into the running (acc fp32, lse): attention over the union of the keys."""
    if acc is None:
        return out.float(), out_lse
    new = torch.logaddexp(lse, out_lse)
    acc = acc * torch.exp(lse - new)[..., None] + out.float() * torch.exp(out_lse - new)[..., None]
    return acc, new


def window_tokens(k_hist: PackedSequence, window_bytes: int = WINDOW_BYTES) -> int:
    """Tokens of one staging window: BF16 K + V of that many tokens take at most `window_bytes`."""
    bsz, hkv, _, d = k_hist.shape
    return max(1, window_bytes // (2 * bsz * hkv * d * 2))


def decode_window(k_hist: PackedSequence, v_hist: PackedSequence, extra: int = 0,
                  rope: RopeTables | None = None, rows: tuple[int, int] | None = None, out: tuple | None = None):
    """History rows `rows` (default: all) decoded into BF16 [B, H, r1 - r0 + extra, D] K and V buffers (new, or
    `out`); their last `extra` rows are left for the tail. (The cache also runs it ahead of time on a side stream
    into buffers it allocated on the main one: `KVCache(prefetch_bytes=...)`.)"""
    from .dequant import dequantize
    r0, r1 = rows or (0, k_hist.shape[2])
    bsz, hkv, _, d = k_hist.shape
    if out is None:
        ks = torch.empty(bsz, hkv, r1 - r0 + extra, d, device=k_hist.tensors["codes"].device,
                         dtype=torch.bfloat16)
        out = ks, torch.empty_like(ks)
    ks, vs = out
    dequantize(k_hist, out=ks, rows=(r0, r1), rope=rope)
    dequantize(v_hist, out=vs, rows=(r0, r1))
    return ks, vs


def windowed_attention(q: torch.Tensor, k_hist: PackedSequence | None, v_hist: PackedSequence | None,
                       k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                       scale: float | None = None, window_bytes: int = WINDOW_BYTES,
                       rope: RopeTables | None = None, decoded: tuple | None = None,
                       before_sdpa=None, split_rows: int | None = None) -> torch.Tensor:
    """softmax(q [history; tail]^T * scale) [history; tail]. q [B, Hq, M, D]; histories: PackedSequence with Hkv
    heads (Hq a multiple of Hkv); tails [B, Hkv, T, D] BF16 (views are fine). `rope`: the history keys were stored
    before RoPE and are rotated as they are decoded. `decoded`: the (K, V) buffers `decode_window(k_hist, v_hist,
    T, rope)` returned (history and tail in one window), decoded ahead of time; the tail is copied into them.
    before_sdpa: called once, right before the first SDPA call is queued (the cache queues its next prefetch there).
    split_rows (history and tail in one window only): the SDPA call is split in two, queries [0, split_rows) and the
    rest, and before_sdpa is called between them (`query_split`: the second call is the last partial wave, whose
    idle SMs then run what before_sdpa queued on a side stream). Each query row is attended as unsplit (on a GPU
    each half may run another SDPA kernel: equal to BF16 rounding)."""
    check_attention_shapes(q, k_hist, v_hist, k_tail, v_tail)
    bsz, hq, m, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    n = 0 if k_hist is None else k_hist.shape[2]
    t = 0 if k_tail is None else k_tail.shape[2]
    if n == 0:
        if before_sdpa is not None:
            before_sdpa()
        return sdpa_gqa(q, k_tail, v_tail, scale)
    cap = window_tokens(k_hist, window_bytes)
    bounds = [(r0, min(n, r0 + cap)) for r0 in range(0, n, cap)]
    tail_inline = t and bounds[-1][1] - bounds[-1][0] + t <= cap  # the tail rides in the last window
    one = len(bounds) == 1 and (tail_inline or not t)  # history and tail in one window: one SDPA call
    if decoded is not None and (not one or decoded[0].shape[2] != n + t):
        raise ValueError(f"decoded buffers of {decoded[0].shape[2]} tokens do not hold one window of {n} history "
                         f"+ {t} tail tokens")
    acc = lse = None
    for i, (r0, r1) in enumerate(bounds):
        extra = t if tail_inline and i == len(bounds) - 1 else 0
        ks, vs = decoded if decoded is not None else decode_window(k_hist, v_hist, extra, rope, (r0, r1))
        decoded = None  # (the buffers go with the window: the next one reuses the memory)
        if extra:
            ks[:, :, r1 - r0:] = k_tail
            vs[:, :, r1 - r0:] = v_tail
        if one and split_rows and 0 < split_rows < m:
            return _split_sdpa(q, ks, vs, scale, split_rows, before_sdpa)
        if before_sdpa is not None:
            before_sdpa()
            before_sdpa = None
        if one:
            return sdpa_gqa(q, ks, vs, scale)
        acc, lse = merge_lse(acc, lse, *sdpa_lse(q, *repeat_kv(ks, vs, hq), scale))
        del ks, vs
    if t and not tail_inline:
        acc, lse = merge_lse(acc, lse, *sdpa_lse(q, *repeat_kv(k_tail.contiguous(), v_tail.contiguous(), hq), scale))
    return acc.to(q.dtype)


def _split_sdpa(q, ks, vs, scale, rows: int, between=None) -> torch.Tensor:
    """SDPA of q's first `rows` queries, `between()`, then the rest; the two outputs joined along the queries in
    [B, M, H, D] memory (the layout the model's output projection reads), returned as the [B, H, M, D] view."""
    ks, vs = repeat_kv(ks, vs, q.shape[1])  # (once for both halves)
    first = sdpa_gqa(q[:, :, :rows], ks, vs, scale)
    if between is not None:
        between()
    second = sdpa_gqa(q[:, :, rows:], ks, vs, scale)
    return torch.cat([first.transpose(1, 2), second.transpose(1, 2)], 1).transpose(1, 2)


def query_split(m: int, programs_per_row_block: int, sms: int, block: int = 128) -> int | None:
    """Queries of the first of two SDPA calls so that it fills whole waves and the second is the last partial wave:
    the largest multiple t of `block` rows (t < the row blocks of m) with t x programs_per_row_block (batch x heads)
    a multiple of `sms` (assuming one program per SM and per block of 128 queries) and the rest less than one wave;
    None where there is no partial wave, or no such t."""
    blocks, p = -(-m // block), programs_per_row_block
    if blocks * p % sms == 0:
        return None
    for t in range(blocks - 1, 0, -1):
        if t * p % sms == 0:
            return t * block if (blocks - t) * p < sms else None
    return None
