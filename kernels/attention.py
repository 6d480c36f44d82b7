"""Attention over a packed QVG / RTN history plus a BF16 tail (Triton). Reference: qvg.attention.

`packed_attention`: the on-chip kernel (kernels/attention_planes.py): BLOCK_M queries of one query head at a time;
K / V tiles of BLOCK_N tokens are decoded on chip from codes, FP8 scales and centroid ids (levels x scale + the
assigned centroid of every stage), then QK^T, online softmax and PV as in flash attention; the tail's tiles follow
the history's. By default (one-stage formats) one persistent program per SM takes an equal share of all (query
block, key tile) pairs (stream-K), and the query blocks split between programs are merged from one partial block per
program; multi-stage formats split the keys into shares instead. The BF16 history is never allocated: the only
tensors are the packed history, the tail, q, the output and those partial blocks or shares. GQA: query head h reads
kv head h // (Hq / Hkv).
`staged_attention`: the history decoded window by window (<= 32 MiB) by the dequant kernel and attended by a flash
kernel that carries the softmax state.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from qvg.attention import check_attention_shapes
from qvg.rope import RopeTables
from qvg.sequence import PackedSequence

from .attention_planes import _attn_planes_kernel, _attn_stream_kernel, _merge_splits, _merge_stream
from .common import INTERPRET, cdiv, check_head_dim, dot_bf16, grid_constants, raw_view, sm_count
from .launch import launch
from .dequant import _rope_args, dequantize

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, INTERP: tl.constexpr):
    """One flash-attention step: scores of q against k, online-softmax rescale, accumulate p @ v."""
    s = dot_bf16(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), INTERP) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot_bf16(p, v, acc * alpha[:, None], INTERP)
    return m_new, l_i, acc


@triton.jit
def _flash_carry_kernel(q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, M, T, HQ, HKV, SH,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CARRY_IN: tl.constexpr,
                        FINAL: tl.constexpr, INTERP: tl.constexpr):
    """Flash attention of q over one BF16 segment [B, Hkv, T, D], continuing the online-softmax state (m, l, acc)
    of earlier segments (CARRY_IN) and either saving it (not FINAL) or writing the normalized output (FINAL).
    SH: elements between consecutive (batch, head) rows of K/V (T * D when contiguous; more for a view of the
    first T tokens of a longer buffer, such as the cache's BF16 zones)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    gh = (b * HKV + (bh % HQ) // (HQ // HKV)).to(tl.int64)
    qrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = qrows < M
    d = tl.arange(0, D)
    srow = bh.to(tl.int64) * M + qrows
    qoff = srow[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qoff, mask=qmask[:, None], other=0.0)
    if CARRY_IN:
        m_i = tl.load(m_ptr + srow, mask=qmask, other=0.0)
        l_i = tl.load(l_ptr + srow, mask=qmask, other=1.0)
        acc = tl.load(acc_ptr + qoff, mask=qmask[:, None], other=0.0)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
    k_ptr += gh * SH
    v_ptr += gh * SH
    for n0 in range(0, T, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        valid = rows < T
        toff = rows[:, None] * D + d[None, :]
        k = tl.load(k_ptr + toff, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + toff, mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, valid, qk_scale, INTERP)
    if FINAL:
        tl.store(out_ptr + qoff, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
    else:
        tl.store(m_ptr + srow, m_i, mask=qmask)
        tl.store(l_ptr + srow, l_i, mask=qmask)
        tl.store(acc_ptr + qoff, acc, mask=qmask[:, None])


STAGING_BYTES = 32 << 20  # K + V of one staged window: small enough to stay in L2 between the two kernels


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x itself if its tokens are contiguous within each (batch, head) and the (batch, head) rows are evenly
    spaced (the kernel's SH stride), else a contiguous copy."""
    b, h, t, d = x.shape
    if x.stride(3) == 1 and x.stride(2) == d and (b == 1 or x.stride(0) == h * x.stride(1)):
        return x
    return x.contiguous()


def staged_attention(q: torch.Tensor, k_hist: PackedSequence | None, v_hist: PackedSequence | None,
                     k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                     scale: float | None = None, window: int | None = None, block_m: int = 128, block_n: int = 64,
                     num_warps: int = 4, num_stages: int = 2, rope: RopeTables | None = None) -> torch.Tensor:
    """The history is decoded window by window (a few thousand tokens, <= STAGING_BYTES of BF16 K + V, reused)
    by the fused dequant kernel, and each window is attended by a flash kernel that carries the online-softmax
    state across windows; the tail comes last. Every packed token is decoded once per layer call (not once per
    query block, as on-chip decoding must), and the BF16 history never exists: the transient is one window plus
    the (m, l, acc) state. `rope`: the history keys were stored before RoPE; they are rotated as they are decoded
    (factorized tables, qvg.rope.RopeTables). The tail is taken as it is."""
    check_attention_shapes(q, k_hist, v_hist, k_tail, v_tail)
    check_head_dim(q.shape[-1])
    bsz, hq, m, d = q.shape
    segs = []
    if k_hist is not None:
        _, hkv, n, _ = k_hist.shape
        if window is None:
            window = max(block_n, (STAGING_BYTES // (2 * bsz * hkv * d * 2)) // block_n * block_n)
        segs += [(r0, min(n, r0 + window)) for r0 in range(0, n, window)]
    else:
        hkv = k_tail.shape[1]
    if k_tail is not None and k_tail.shape[2]:
        segs.append(None)
    if not segs:
        raise ValueError("attention needs a history or a tail")
    q = q.contiguous()
    out = torch.empty_like(q)
    if len(segs) > 1:
        m_buf = torch.empty(bsz * hq, m, device=q.device, dtype=torch.float32)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty(bsz * hq, m, d, device=q.device, dtype=torch.float32)
    else:
        m_buf = l_buf = acc_buf = out
    if k_hist is not None:
        kbuf = torch.empty(bsz * hkv * window * d, device=q.device, dtype=torch.bfloat16)
        vbuf = torch.empty_like(kbuf)
    scale = d ** -0.5 if scale is None else scale
    grid = (cdiv(m, block_m), bsz * hq)
    for i, seg in enumerate(segs):
        if seg is None:  # read in place when each (batch, head) row is contiguous (a view of the cache's zones)
            ks, vs = _rows_view(k_tail), _rows_view(v_tail)
            if ks.stride() != vs.stride():
                ks, vs = ks.contiguous(), vs.contiguous()
        else:
            shape = (bsz, hkv, seg[1] - seg[0], d)
            ks = dequantize(k_hist, out=kbuf[:shape[0] * shape[1] * shape[2] * d].view(shape), rows=seg, rope=rope)
            vs = dequantize(v_hist, out=vbuf[:shape[0] * shape[1] * shape[2] * d].view(shape), rows=seg)
        launch(_flash_carry_kernel, grid, q, ks, vs, out, m_buf, l_buf, acc_buf, scale * LOG2E, m, ks.shape[2], hq, hkv,
               ks.stride(1), D=d, BLOCK_M=block_m, BLOCK_N=block_n, CARRY_IN=i > 0, FINAL=i == len(segs) - 1,
               INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out


SPLIT_BYTES = 256 << 20  # the most the key splits' BF16 partial outputs may take
SPLIT_GAIN = 0.05  # the least modelled saving (fraction of the waves) worth a split


def wave_splits(programs: int, slots: int, tiles: int, most: int = 8) -> int:
    """Key splits (1..most, at most one per tile) that fill the GPU's waves best: the fewest waves per unit of
    work, ceil(programs * s / slots) / s (slots: programs resident at once), the smallest s on ties; 1 unless that
    saves at least SPLIT_GAIN of the waves (the merge is not free). At 4,680 queries x 12 heads in 256-query
    blocks (228 programs) on 132 SMs: 1 split takes 2 waves for 1.73 waves of work, 4 splits 7 for 6.91 (on the
    H100 4.23 against 5.08 ms at 32,760 keys, eval/results/kernels-h100.md)."""
    best, best_cost = 1, -(-programs // slots)
    for s in range(2, max(1, min(most, tiles)) + 1):
        cost = -(-programs * s // slots) / s
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best if best_cost <= (1 - SPLIT_GAIN) * -(-programs // slots) else 1


def stream_plan(items: int, tiles: int, programs: int, waves: bool = False) -> tuple[int, int, int]:
    """Stream-K's split of items x tiles (query block, key tile) pairs over at most `programs` persistent programs:
    (programs with work, full, per). Each first attends `full` items whole (waves: one a wave while there are at
    least `programs` items; else none), then `per` tiles of the rest in order; the last program may get fewer."""
    full = items // programs if waves else 0
    rest = items * tiles - full * programs * tiles
    if rest == 0:
        return programs, full, 0
    per = -(-rest // programs)
    return (programs if full else -(-rest // per)), full, per


def _slots(q: torch.Tensor, num_warps: int) -> int:
    """Attention programs resident at once: ~255 registers a thread, so 8 warps fill an SM (1 under the
    interpreter)."""
    return sm_count(q.device) * max(1, 8 // num_warps) if q.is_cuda else 1


FUSED_HEAD_DIM_MAX = 128  # (at 256 its default tiles overflow an H200's shared memory: eval/results/head-dims-h200.md)


def fused_head_dim(d: int, device: torch.device) -> bool:
    """Whether `packed_attention` (the on-chip read) takes head dim d on `device`: up to FUSED_HEAD_DIM_MAX on a
    GPU (the cache reads larger ones staged, `qvg.cache.gpu_read`); any the kernels take under the interpreter."""
    return device.type != "cuda" or d <= FUSED_HEAD_DIM_MAX


def rope_on_chip(device: torch.device) -> bool:
    """Whether the cache's fused read rotates pre-RoPE keys in packed_attention (on chip, again for every query block)
    rather than reading them staged (each key rotated once, as its window is decoded): only off a GPU (under the
    interpreter, where the tests run it). On the H200 at 12 heads x 4,680 queries over 32,760 keys the fused read
    with the rotation on chip took 19.6 ms (qvg) and 26.6 ms (qvg-pro), without it 3.1 and 7.2 ms, and the staged
    read with the rotation 2.6 and 2.7 ms (eval/results/rope-on-chip-h200.json): each 32-key tile gathers its FP32
    cos / sin rows again for every query block, 37 times over at 4,680 queries."""
    return device.type != "cuda"


_NO_THIRD_STAGE: set = set()  # packed_attention launch shapes whose 3-stage kernel ran out of shared memory


def packed_attention(q: torch.Tensor, k_hist: PackedSequence | None, v_hist: PackedSequence | None,
                     k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                     scale: float | None = None, block_m: int | None = None, block_n: int | None = None,
                     num_warps: int = 8,
                     num_stages: int | None = None, splits: int | None = None,
                     programs: int | None = None, waves: bool = False, rope: RopeTables | None = None) -> torch.Tensor:
    """softmax(q [history; tail]^T * scale) [history; tail] without materializing the history.
    q [B, Hq, M, D] bf16; histories from `PackedSequence.from_chunks`; tails [B, Hkv, T, D] bf16. `rope`: the
    history keys were stored before RoPE; each K tile is rotated on chip as it is decoded (factorized tables,
    qvg.rope.RopeTables: each plane decoded in FP32, rotated by the dequant kernel's `_rope`, rounded to BF16 once,
    the dequant kernel's arithmetic, which on a GPU may differ by an ulp where the compiler contracts the
    rotation's multiply-adds; the BF16x2 decode is not used then), plane by plane for 2- and 4-bit codes (8-bit codes
    are one plane; joined planes with a rotation fail Triton 3.6's sm_90 compile, so code planes narrower than a dot's
    16 columns, which must be joined, are refused on a GPU), in 128-query blocks of 32-key tiles by default. On a GPU
    rope takes only 32-key tiles: with 64-key tiles at head dim 128 Triton 3.6's sm_90 code gave wrong scores, NaN or
    out-of-bounds shared-memory reads (also with the rotation rewritten elementwise, and with one pipeline stage); at
    32-key tiles it agreed with the staged read (eval/results/rope-on-chip-h200.json). It is slow there: 19.6-26.6 ms
    at 32,760 keys against the staged read's 2.6-2.7 ms (the tables are gathered again for every query block), so the
    cache reads pre-RoPE keys staged on a GPU (`rope_on_chip`). The tail is taken as is.
    block_m None: 256 (128 with rope); block_n None: 64 (32 with rope); num_stages None with rope: 2. On a GPU rope
    takes only what was checked there: 32-key tiles and blocks of <= 128 queries.
    The kernel (kernels/attention_planes.py) decodes K / V tiles on chip one code plane at a time. The defaults
    (256-query blocks on 8 warps, 64-key tiles) were the fastest on the H100 for qvg and qvg-pro
    (eval/results/kernels-h100.md); num_stages None: 3 software-pipeline stages for one-stage formats and the BF16
    tail (on the H200 2% faster than 2 with key splits, 1.1-5% under stream-K at 32,760 to 327,600 keys), falling
    back to 2 where 3 do not fit in shared memory, and 2 for multi-stage formats. scale: positive (default D^-1/2).
    Schedules. Default on a GPU for one-stage formats (qvg, RTN, the BF16 tail), or `programs` or waves given: stream-K
    (`_attn_stream_kernel`): `programs` persistent programs (default: as many as fit at once, one per SM at 8 warps)
    share the query blocks x key tiles equally; a query block split between programs is merged by log-sum-exp
    (`_merge_stream`) from one BLOCK_M x D BF16 piece per program, so the transient is the output plus ~programs x
    BLOCK_M x D x 2 bytes (8.7 MB on 132 SMs), whatever the history's length. waves: each program first attends
    whole query blocks, one a wave, and only the rest is shared (`stream_plan`); on the H200 2.2-3.0% slower at
    32,760 keys and no faster at 327,600, so off by default (eval/results/profile-attention-h200.ab-acc0791.json). (The
    kernel that can take waves takes 5.5-9.3% less time than 147e7ab's without them, with the same schedule: a
    code-generation effect, not the schedule's; profile-attention-h200.ab-acc0791.json and .variants-acc0791.json;
    an edit of the stream-K loop can lose it: re-time it against 147e7ab's kernel.) `splits` given (default 1 under
    the interpreter, 0 for the plane-by-plane form on a GPU (multi-stage formats, and rope), whose qvg-pro kernel ran
    22% slower under stream-K: 8.66 against 7.12 ms on the H200,
    eval/results/profile-attention-h200.verify-0ef5823.json): the grid of (query block, key share, head) programs,
    each share attended by its own program and merged by log-sum-exp (a transient of splits BF16 copies of the output
    plus an fp32 log-sum-exp per query row; each share is rounded to BF16 before the merge); 0: the count whose
    programs fill the GPU's waves best (`wave_splits`), with the partials under SPLIT_BYTES."""
    check_attention_shapes(q, k_hist, v_hist, k_tail, v_tail)
    check_head_dim(q.shape[-1])
    if not fused_head_dim(q.shape[-1], q.device):
        raise ValueError(f"packed_attention takes head dims up to {FUSED_HEAD_DIM_MAX} on a GPU, got {q.shape[-1]}: "
                         "use staged_attention")
    bsz, hq, m, d = q.shape
    if scale is not None and not scale > 0:
        raise ValueError(f"packed attention needs a positive scale, got {scale}")
    if k_hist is not None:
        if k_hist.spec != v_hist.spec or k_hist.stages != v_hist.stages:
            raise ValueError("packed K and V must share options")
        if k_hist.spec.grid == "asym":
            raise ValueError("packed attention reads the sym / midrise grids")
        if k_hist.spec.bits not in (2, 4, 8):
            raise ValueError(f"packed attention reads 2-, 4- and 8-bit codes, not {k_hist.spec.bits}-bit")
        _, hkv, n, _ = k_hist.shape
    else:
        hkv, n = k_tail.shape[1], 0
    if rope is not None and k_hist is None:
        raise ValueError("rope: the tables must match a packed history (there is none: rope rotates its keys)")
    t = 0 if k_tail is None else k_tail.shape[2]
    if n + t == 0:
        raise ValueError("attention needs at least one key (history and tail are empty)")
    q = q.contiguous()
    out = torch.empty_like(q)
    dummy = q
    if k_hist is not None:
        consts = grid_constants(k_hist.spec)
        stages, L = k_hist.stages, k_hist.chunk_len
        kk = k_hist.tensors["centroids"].shape[-2] if stages else 1

        def args(s: PackedSequence):
            x = s.tensors
            return (x["codes"], raw_view(x["scale"]), x.get("tscale", dummy), x["ids"] if stages else dummy,
                    x["centroids"] if stages else dummy)
        kargs, vargs = args(k_hist), args(v_hist)
    else:
        consts = dict(BITS=8, GROUP=d, GRID=1, OFFSET=127.5, FP8=False)
        stages, L, kk = 0, 1, 1
        kargs = vargs = (dummy,) * 5
    rope_args = _rope_args(rope, dummy, L, n // L, d)  # (the tables checked once, before the launch)
    tk = k_tail.contiguous() if t else dummy
    tv = v_tail.contiguous() if t else dummy
    scale = d ** -0.5 if scale is None else scale
    narrow = d * consts["BITS"] // 8 < 16  # (a code plane narrower than a dot: planes must be joined)
    if rope is not None and q.is_cuda and narrow:
        raise ValueError(f"packed_attention(rope=...) reads code planes of >= 16 columns on a GPU (head dim x bits / 8"
                         f" = {d * consts['BITS'] // 8}): use staged_attention")
    if rope is not None and q.is_cuda and (block_n not in (None, 32) or (block_m or 128) > 128):
        raise ValueError(f"packed_attention(rope=...) takes 32-key tiles and blocks of <= 128 queries on a GPU, not "
                         f"block_n={block_n}, block_m={block_m} (64-key tiles gave wrong scores in Triton 3.6's sm_90 "
                         "code; larger blocks were not checked): use the defaults or staged_attention")
    block_n = (32 if rope is not None else 64) if block_n is None else block_n
    tiles = cdiv(n, block_n) + cdiv(t, block_n)
    if splits is not None and (programs is not None or waves):
        raise ValueError("give splits (the grid schedule) or programs / waves (stream-K), not both")
    if programs is not None and int(programs) < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    join = (stages <= 1 and (rope is None or consts["BITS"] == 8)) or narrow
    block_m = (128 if rope is not None else 256) if block_m is None else block_m
    asked = programs is not None or waves  # (stream-K asked for: no default schedule replaces it)
    if splits is None and not asked and INTERPRET:
        splits = 1
    elif splits is None and not asked and not join:  # (stream-K ran qvg-pro 22% slower on the H200)
        splits = 0
    items = cdiv(m, block_m) * bsz * hq
    if items * tiles >= 2 ** 30:  # (stream-K indexes the pairs in int32, and a share's end may pass the last)
        if asked:
            raise ValueError(f"stream-K takes < 2^30 (query block, key tile) pairs, got {items * tiles}: use splits")
        splits = 0 if splits is None else splits
    stream = splits is None
    if stream:
        programs, full, per = stream_plan(items, tiles, int(programs or _slots(q, num_warps)), waves)
        lse = torch.empty(2, programs, block_m, device=q.device, dtype=torch.float32)
        part = torch.empty(programs, block_m, d, device=q.device, dtype=torch.bfloat16) if programs > 1 else dummy
        kernel, grid = _attn_stream_kernel, (programs,)
        extra = dict(args=(bsz * hkv, items, per, full), consts={})
    else:
        if splits == 0:
            most = max(1, min(8, SPLIT_BYTES // (2 * bsz * hq * m * d)))
            splits = wave_splits(items, _slots(q, num_warps), tiles, most=most)
        splits = max(1, min(int(splits), tiles))
        part = lse = dummy
        if splits > 1:
            part = torch.empty(splits, bsz * hq, m, d, device=q.device, dtype=torch.bfloat16)
            lse = torch.empty(splits, bsz * hq, m, device=q.device, dtype=torch.float32)
        kernel, grid = _attn_planes_kernel, (cdiv(m, block_m), splits, bsz * hq)
        extra = dict(args=(splits,), consts=dict(SPLIT=splits > 1))

    if rope is not None:
        extra["consts"].update(ROPE=True, SPLIT_H=rope.split[0], SPLIT_W=rope.split[1])

    def run(n_stages):
        launch(kernel, grid, q, out, *kargs, *vargs, tk, tv, part, lse, scale * LOG2E, m, n, t, L, max(1, n // L), kk,
               hq, hkv, *extra["args"], *rope_args, D=d, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n,
               HAS_HIST=k_hist is not None, INTERP=INTERPRET, JOIN=join, num_warps=num_warps, num_stages=n_stages,
               **extra["consts"], **consts)
    # num_stages None: 3 for the joined form (qvg, RTN, the BF16 tail; see the docstring), 2 for qvg-pro's
    # plane-by-plane form (3 need more shared memory than a GPU has at 256 x 64) and where 3 did not fit before
    key = (q.device, q.dtype, d, block_m, block_n, num_warps, stages, stream, k_hist is not None,
           tuple(sorted({**extra["consts"], **consts}.items())))
    if num_stages is not None:
        run(num_stages)
    elif not join or rope is not None or key in _NO_THIRD_STAGE:  # (rope: 2, as checked on the H200)
        run(2)
    else:
        try:
            run(3)
        except OutOfResources:  # (remembered: a failed compile is not cached, it would be retried every call)
            _NO_THIRD_STAGE.add(key)
            run(2)
    if stream and programs > 1:
        launch(_merge_stream, (programs - 1, cdiv(block_m, 64)), part, lse, out, m, tiles, items, per, programs,
               full, D=d, BLOCK_M=block_m, ROWS=64, INTERP=INTERPRET, num_warps=4)
    elif not stream and splits > 1:
        launch(_merge_splits, (cdiv(m, 64), bsz * hq), part, lse, out, m, splits, D=d, BLOCK_M=64,
               INTERP=INTERPRET, num_warps=4)
    return out
