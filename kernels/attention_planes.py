"""The on-chip packed-cache attention kernel, column plane by column plane (Triton). Reference: qvg.attention.

The packed codes are planar (qvg/bitpack.py): plane p of a token's code bytes holds its columns [p * W, (p + 1) *
W), W = D * BITS / 8 (2, 4 or 8 bits: at most 4 planes). So a K or V tile is decoded one plane at a time,
[BLOCK_N, W], with no reshape of the unpacked codes. Then either (JOIN, one-stage formats) the planes are
interleaved into one [BLOCK_N, D] tile by `_join4` (q loaded in the same column order, the output split back by
`_split4`), so the scores and p @ v are one dot each; or the scores are the sum over planes of q[:, plane] @
k_plane^T and the output is P accumulators [BLOCK_M, W] (qvg-pro ran faster so on the H100). Per element the
decode is `qvg.decompress`'s value: for 2- and 4-bit codes with at most one stage (qvg, RTN) in BF16x2 arithmetic
(`codes_fma_bf16`: ~2 instructions an element, exact with the power-of-two tscale), else codes x scale + the
centroid of every stage in FP32, rounded to BF16 once. The tiles of the BF16 tail (current chunk, BF16 zones)
follow the history's. Two schedules of the same work (`_attend_item`): `_attn_stream_kernel`, persistent programs
that share all (query block, key tile) pairs equally (stream-K; `_merge_stream` combines the query blocks split
between programs), and `_attn_planes_kernel`, a grid of (query block, key share, batch x head) programs
(`_merge_splits` combines the shares), both by log-sum-exp.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import codes_fma_bf16, decode_scale, dequant_codes, dot_bf16, to_bf16, to_out
from .dequant import _pick4, _rope, _widen


@triton.jit
def _stage_row(ids_ptr, st: tl.constexpr, stage_stride, rows, rmask, chunk, K):
    """Row of stage st's centroid table (of this head) each token was assigned."""
    cid = tl.load(ids_ptr + st * stage_stride + rows, mask=rmask, other=0).to(tl.int32)
    return chunk * K + cid


@triton.jit
def _plane_scale(sraw, ts, p: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
                 BLOCK_N: tl.constexpr, W: tl.constexpr):
    """fp32 scales of plane p from a tile's raw scales [BLOCK_N, D / GROUP]: [BLOCK_N, 1] when the plane lies in
    one group, else [BLOCK_N, W] (each of its W / GROUP groups widened)."""
    NG: tl.constexpr = D // GROUP
    P: tl.constexpr = D // W
    s = decode_scale(sraw, ts, FP8)
    if GROUP >= W:
        if NG == 1:
            return s
        else:
            return tl.sum(tl.where((tl.arange(0, NG) == (p * W) // GROUP)[None, :], s, 0.0), 1)[:, None]
    else:
        G2: tl.constexpr = W // GROUP
        s3 = tl.reshape(s, (BLOCK_N, P, G2))
        return _widen(tl.sum(tl.where((tl.arange(0, P) == p)[None, :, None], s3, 0.0), 1), BLOCK_N, G2, W)


@triton.jit
def _plane(byte, sraw, ts, p: tl.constexpr, rows, rmask, chunk, crow0, crow1, crow2, crow3, ids_ptr, ids_stage_stride,
           K, cent_ptr, cent_stage_stride, L, rope_ptr, rpos_ptr, R, HW, WIDTH, D: tl.constexpr,
           BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr,
           STAGES: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, INTERP: tl.constexpr,
           ROPE: tl.constexpr, SPLIT_H: tl.constexpr, SPLIT_W: tl.constexpr):
    """Plane p of a packed tile -> bf16 [BLOCK_N, W]: columns [p * W, (p + 1) * W). Stages 0-3 use the centroid
    rows `_tile_raw` found; later ones (up to 16) load their ids here. ROPE (keys stored before RoPE): the plane's
    channel pairs are rotated by each token's 3D position (the dequant kernel's `_rope`, factorized tables) in FP32
    and rounded to BF16 once, as the dequant kernel writes them."""
    col = p * W + tl.arange(0, W)
    s = _plane_scale(sraw, ts, p, D, GROUP, FP8, BLOCK_N, W)
    if BITS <= 4 and STAGES <= 1 and not ROPE:  # codes x scale (+ the one centroid) in BF16x2: `codes_fma_bf16`
        neg_base = -128.0 - 2.0 * OFFSET
        if GRID == 3:  # auto: a negative scale marks a midrise group (offset + 1/2)
            neg_base = tl.where(s < 0, neg_base - 1.0, neg_base)
        cent = tl.zeros((BLOCK_N, W), tl.bfloat16)
        if STAGES == 1:
            cent = tl.load(cent_ptr + crow0[:, None] * D + col[None, :], mask=rmask[:, None], other=0.0)
        return codes_fma_bf16(byte, p * BITS, BITS, tl.abs(s) * 0.5, neg_base + tl.zeros_like(s), cent, INTERP)
    c = (byte >> (p * BITS)) & ((1 << BITS) - 1)
    v = dequant_codes(c, s, 0.0, OFFSET, GRID)
    for st in tl.static_range(STAGES):
        if st < 4:
            crow = _pick4(st, crow0, crow1, crow2, crow3)
        else:
            crow = _stage_row(ids_ptr, st, ids_stage_stride, rows, rmask, chunk, K)
        v += tl.load(cent_ptr + st * cent_stage_stride + crow[:, None] * D + col[None, :], mask=rmask[:, None],
                     other=0.0).to(tl.float32)
    if ROPE:
        v = _rope(v, rows, chunk, L, rmask, p * W // 2, rope_ptr, rpos_ptr, R, HW, WIDTH, D, W,
                  BLOCK_N, SPLIT_H, SPLIT_W)
    return to_bf16(v, INTERP)


@triton.jit
def _tile_raw(scale_ptr, tscale_ptr, ids_ptr, n0, N, L, K, ids_stage_stride, D: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """What tokens [n0, n0 + BLOCK_N) load from memory before their centroid gathers: raw scales, the per-token
    tscale and each stage's centroid row (tokens past N load zeros). (The code bytes: `_codes`.)"""
    NG: tl.constexpr = D // GROUP
    rows = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < N
    m2 = rmask[:, None]
    sraw = tl.load(scale_ptr + rows[:, None] * NG + tl.arange(0, NG)[None, :], mask=m2, other=0)
    chunk = rows // L
    ts = tl.full((BLOCK_N, 1), 1.0, tl.float32)
    if FP8:
        ts = tl.load(tscale_ptr + chunk, mask=rmask, other=1.0)[:, None]
    crow0 = chunk
    crow1 = chunk
    crow2 = chunk
    crow3 = chunk
    if STAGES > 0:
        crow0 = _stage_row(ids_ptr, 0, ids_stage_stride, rows, rmask, chunk, K)
    if STAGES > 1:
        crow1 = _stage_row(ids_ptr, 1, ids_stage_stride, rows, rmask, chunk, K)
    if STAGES > 2:
        crow2 = _stage_row(ids_ptr, 2, ids_stage_stride, rows, rmask, chunk, K)
    if STAGES > 3:
        crow3 = _stage_row(ids_ptr, 3, ids_stage_stride, rows, rmask, chunk, K)
    return sraw, ts, crow0, crow1, crow2, crow3


@triton.jit
def _tile_planes(byte, sraw, ts, crow0, crow1, crow2, crow3, n0, N, L, K, ids_ptr, ids_stage_stride, cent_ptr,
                 cent_stage_stride, rope_ptr, rpos_ptr, R, HW, WIDTH, D: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr,
                 STAGES: tl.constexpr, BLOCK_N: tl.constexpr, JOIN: tl.constexpr, INTERP: tl.constexpr,
                 ROPE: tl.constexpr, SPLIT_H: tl.constexpr, SPLIT_W: tl.constexpr):
    """The up to 4 planes of a tile from its `_tile_raw` loads (unused planes are plane 0); JOIN: the planes
    interleaved into one [BLOCK_N, D] tile (`_join4`), returned first. (The caller joins for one-stage formats, which
    were faster so on the H100, and wherever a plane is narrower than the 16 columns a GPU dot needs; qvg-pro's four
    stages ran faster plane by plane.)"""
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    rows = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < N
    chunk = rows // L
    x0 = _plane(byte, sraw, ts, 0, rows, rmask, chunk, crow0, crow1, crow2, crow3, ids_ptr, ids_stage_stride, K,
                cent_ptr, cent_stage_stride, L, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP, GRID,
                OFFSET, FP8, STAGES, BLOCK_N, W, INTERP, ROPE, SPLIT_H, SPLIT_W)
    x1 = x0
    x2 = x0
    x3 = x0
    if P > 1:
        x1 = _plane(byte, sraw, ts, 1, rows, rmask, chunk, crow0, crow1, crow2, crow3, ids_ptr, ids_stage_stride,
                    K, cent_ptr, cent_stage_stride, L, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                    GRID, OFFSET, FP8, STAGES, BLOCK_N, W, INTERP, ROPE, SPLIT_H, SPLIT_W)
    if P > 2:
        x2 = _plane(byte, sraw, ts, 2, rows, rmask, chunk, crow0, crow1, crow2, crow3, ids_ptr, ids_stage_stride,
                    K, cent_ptr, cent_stage_stride, L, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                    GRID, OFFSET, FP8, STAGES, BLOCK_N, W, INTERP, ROPE, SPLIT_H, SPLIT_W)
        x3 = _plane(byte, sraw, ts, 3, rows, rmask, chunk, crow0, crow1, crow2, crow3, ids_ptr, ids_stage_stride,
                    K, cent_ptr, cent_stage_stride, L, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                    GRID, OFFSET, FP8, STAGES, BLOCK_N, W, INTERP, ROPE, SPLIT_H, SPLIT_W)
    if JOIN:
        x0 = _join4(x0, x1, x2, x3, P)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3, P: tl.constexpr):
    """P planes [R, W] -> one [R, P * W] tile with its columns interleaved: column 4j + 2a + b (P = 4) holds
    column j of plane a + 2b; 2j + a (P = 2) column j of plane a. q, K and V interleaved alike give the same
    scores, and the output comes back by `_split4` (a join adds the fastest-varying axis: no data movement)."""
    if P == 1:
        return x0
    elif P == 2:
        return tl.reshape(tl.join(x0, x1), (x0.shape[0], 2 * x0.shape[1]))
    else:
        return tl.reshape(tl.join(tl.join(x0, x1), tl.join(x2, x3)), (x0.shape[0], 4 * x0.shape[1]))


@triton.jit
def _joined_cols(D: tl.constexpr, P: tl.constexpr):
    """The source column of each column of a `_join4`-interleaved row: c -> plane(c) * W + c // P."""
    c = tl.arange(0, D)
    if P == 4:
        plane = (c // 2) % 2 + 2 * (c % 2)
    elif P == 2:
        plane = c % 2
    else:
        plane = c * 0
    return plane * (D // P) + c // P


@triton.jit
def _split4(x, P: tl.constexpr):
    """The inverse of `_join4`: [R, P * W] -> its P planes (unused ones are plane 0)."""
    if P == 1:
        return x, x, x, x
    elif P == 2:
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        return a, b, a, a
    else:
        lo, hi = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 4, 2, 2)))
        a0, a1 = tl.split(lo)
        a2, a3 = tl.split(hi)
        return a0, a1, a2, a3


@triton.jit
def _scores(q0, q1, q2, q3, k0, k1, k2, k3, BLOCK_N: tl.constexpr, P: tl.constexpr, JOIN: tl.constexpr,
            INTERP: tl.constexpr):
    """q @ k^T summed over the P planes, or of the joined q0 and k0 (fp32 [BLOCK_M, BLOCK_N])."""
    s = dot_bf16(q0, tl.trans(k0), tl.zeros((q0.shape[0], BLOCK_N), tl.float32), INTERP)
    if not JOIN:  # (no early return: Triton would still compile the dots after it)
        if P > 1:
            s = dot_bf16(q1, tl.trans(k1), s, INTERP)
        if P > 2:
            s = dot_bf16(q2, tl.trans(k2), s, INTERP)
            s = dot_bf16(q3, tl.trans(k3), s, INTERP)
    return s


@triton.jit
def _accumulate(p, alpha, v0, v1, v2, v3, a0, a1, a2, a3, P: tl.constexpr, JOIN: tl.constexpr,
                INTERP: tl.constexpr):
    """acc * alpha + p @ v, plane by plane (or on the joined a0 and v0)."""
    a0 = dot_bf16(p, v0, a0 * alpha[:, None], INTERP)
    if not JOIN:
        if P > 1:
            a1 = dot_bf16(p, v1, a1 * alpha[:, None], INTERP)
        if P > 2:
            a2 = dot_bf16(p, v2, a2 * alpha[:, None], INTERP)
            a3 = dot_bf16(p, v3, a3 * alpha[:, None], INTERP)
    return a0, a1, a2, a3


@triton.jit
def _tail_planes(ptrs, valid, W: tl.constexpr, P: tl.constexpr, JOIN: tl.constexpr):
    """The P column planes of BF16 tail rows (`ptrs`: their first W columns), joined with JOIN."""
    m2 = valid[:, None]
    x0 = tl.load(ptrs, mask=m2, other=0.0)
    x1 = x0
    x2 = x0
    x3 = x0
    if P > 1:
        x1 = tl.load(ptrs + W, mask=m2, other=0.0)
    if P > 2:
        x2 = tl.load(ptrs + 2 * W, mask=m2, other=0.0)
        x3 = tl.load(ptrs + 3 * W, mask=m2, other=0.0)
    if JOIN:
        x0 = _join4(x0, x1, x2, x3, P)
    return x0, x1, x2, x3


@triton.jit
def _online_softmax(s, valid, ragged, m_i, l_i, qk_scale):
    """Scores (q k^T, unscaled) -> (p fp32, alpha, m_new, l_new) of one online-softmax step (m in log2 units of the
    scaled scores). Keys past the end are masked only in a `ragged` tile, and the scale is applied inside the
    exponent's argument (one FMA), as flash attention does: ~2 fewer instructions per score."""
    if ragged:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _codes(codes_ptr, n0, N, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """The code bytes of tokens [n0, n0 + BLOCK_N) (tokens past N load zeros)."""
    rows = n0 + tl.arange(0, BLOCK_N)
    return tl.load(codes_ptr + rows[:, None] * W + tl.arange(0, W)[None, :], mask=(rows < N)[:, None], other=0)


@triton.jit
def _attend_item(q_ptr, kc, ks, kt, kid, kcen, vc, vs, vt, vid, vcen, tk_ptr, tv_ptr, qk_scale, pid_m, bh, j0, j1,
                 M, N, T, L, C, K, HQ, HKV, GH, rope_ptr, rpos_ptr, R, HW, WIDTH, D: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr, OFFSET: tl.constexpr,
                 FP8: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_HIST: tl.constexpr, INTERP: tl.constexpr, JOIN: tl.constexpr, ROPE: tl.constexpr,
                 SPLIT_H: tl.constexpr, SPLIT_W: tl.constexpr):
    """Query block pid_m of batch x head bh over tiles [j0, j1) of its key sequence (the history tiles, then the tail
    tiles) -> the unnormalized accumulators a0..a3 (joined: a0 alone), the running max m_i (log2 units) and sum l_i.
    ROPE: the history's keys were stored before RoPE and are rotated as they are decoded (the tail is taken as is)."""
    b = bh // HQ
    h = bh % HQ
    gh = (b * HKV + h // (HQ // HKV)).to(tl.int64)
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    NG: tl.constexpr = D // GROUP
    kc += gh * N * W
    vc += gh * N * W
    ks += gh * N * NG
    vs += gh * N * NG
    kt += gh * C
    vt += gh * C
    kid += gh * N
    vid += gh * N
    kcen += gh * C * K * D
    vcen += gh * C * K * D
    qrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = qrows < M
    cols = tl.arange(0, W)
    qrow = (bh.to(tl.int64) * M + qrows)[:, None] * D + cols[None, :]
    q0 = tl.load(q_ptr + qrow, mask=qmask[:, None], other=0.0)
    q1 = q0
    q2 = q0
    q3 = q0
    if P > 1 and not JOIN:
        q1 = tl.load(q_ptr + qrow + W, mask=qmask[:, None], other=0.0)
    if P > 2 and not JOIN:
        q2 = tl.load(q_ptr + qrow + 2 * W, mask=qmask[:, None], other=0.0)
        q3 = tl.load(q_ptr + qrow + 3 * W, mask=qmask[:, None], other=0.0)
    if JOIN:  # one interleaved [BLOCK_M, D] q, tiles and accumulator: one dot each for the scores and p @ v
        # (q loaded straight in `_join4`'s column order, so it stays a shared-memory operand, not 64 registers)
        q0 = tl.load(q_ptr + (bh.to(tl.int64) * M + qrows)[:, None] * D + _joined_cols(D, P)[None, :],
                     mask=qmask[:, None], other=0.0)
        a0 = tl.zeros((BLOCK_M, D), tl.float32)
    else:
        a0 = tl.zeros((BLOCK_M, W), tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    # one stage's centroid tables, and its ids (int64: large batches of long histories; tl.cast, as GH is a constant
    # where a launch specializes it to 1, one KV head at batch 1)
    cstride = tl.cast(GH, tl.int64) * C * K * D
    istride = tl.cast(GH, tl.int64) * N
    nh = 0
    if HAS_HIST:
        nh = tl.cdiv(N, BLOCK_N)
    if HAS_HIST:
        # a tile's scales, tscale and centroid ids are loaded one iteration ahead, so an iteration waits only for
        # its centroid gathers, not for the id loads they depend on (on the H100 7-26% faster than loading them in
        # the iteration; eval/results/kernels-h100.md). Joined (one-stage) formats load a tile's code bytes in the
        # iteration that decodes them: carried, LLVM kept them one register a byte (on the H200 9.5% slower, 3.787
        # against 3.459 ms at 32,760 keys: profile-attention-h200.ab-inloop-1869649.json); qvg-pro's plane-by-plane
        # form carries them (7.2 against 7.7 ms: ...inloop-vs-main-0db2d4d.json)
        ksr, kts, kr0, kr1, kr2, kr3 = _tile_raw(ks, kt, kid, j0 * BLOCK_N, N, L, K, istride, D, BITS, GROUP, FP8,
                                                 STAGES, BLOCK_N)
        vsr, vts, vr0, vr1, vr2, vr3 = _tile_raw(vs, vt, vid, j0 * BLOCK_N, N, L, K, istride, D, BITS, GROUP, FP8,
                                                 STAGES, BLOCK_N)
        if not JOIN:
            kb = _codes(kc, j0 * BLOCK_N, N, W, BLOCK_N)
            vb = _codes(vc, j0 * BLOCK_N, N, W, BLOCK_N)
        for jj in range(j0, tl.minimum(j1, nh)):
            n0 = jj * BLOCK_N
            valid = (n0 + tl.arange(0, BLOCK_N)) < N
            nksr, nkts, nkr0, nkr1, nkr2, nkr3 = _tile_raw(ks, kt, kid, n0 + BLOCK_N, N, L, K, istride, D, BITS,
                                                           GROUP, FP8, STAGES, BLOCK_N)
            nvsr, nvts, nvr0, nvr1, nvr2, nvr3 = _tile_raw(vs, vt, vid, n0 + BLOCK_N, N, L, K, istride, D, BITS,
                                                           GROUP, FP8, STAGES, BLOCK_N)
            if JOIN:
                kbt = _codes(kc, n0, N, W, BLOCK_N)
                vbt = _codes(vc, n0, N, W, BLOCK_N)
            else:
                kbt = kb
                vbt = vb
                kb = _codes(kc, n0 + BLOCK_N, N, W, BLOCK_N)
                vb = _codes(vc, n0 + BLOCK_N, N, W, BLOCK_N)
            k0, k1, k2, k3 = _tile_planes(kbt, ksr, kts, kr0, kr1, kr2, kr3, n0, N, L, K, kid, istride, kcen,
                                          cstride, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                                          GRID, OFFSET, FP8, STAGES, BLOCK_N, JOIN, INTERP, ROPE, SPLIT_H, SPLIT_W)
            p, alpha, m_i, l_i = _online_softmax(_scores(q0, q1, q2, q3, k0, k1, k2, k3, BLOCK_N, P, JOIN, INTERP),
                                                 valid, n0 + BLOCK_N > N, m_i, l_i, qk_scale)
            v0, v1, v2, v3 = _tile_planes(vbt, vsr, vts, vr0, vr1, vr2, vr3, n0, N, L, K, vid, istride, vcen,
                                          cstride, rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                                          GRID, OFFSET, FP8, STAGES, BLOCK_N, JOIN, INTERP, False, 0, 0)
            a0, a1, a2, a3 = _accumulate(p, alpha, v0, v1, v2, v3, a0, a1, a2, a3, P, JOIN, INTERP)
            ksr, kts, kr0, kr1, kr2, kr3 = nksr, nkts, nkr0, nkr1, nkr2, nkr3
            vsr, vts, vr0, vr1, vr2, vr3 = nvsr, nvts, nvr0, nvr1, nvr2, nvr3
    for jj in range(tl.maximum(j0, nh) - nh, tl.minimum(j1, nh + tl.cdiv(T, BLOCK_N)) - nh):
        rows = jj * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows < T
        k0, k1, k2, k3 = _tail_planes(tk_ptr + (gh * T + rows)[:, None] * D + cols[None, :], valid, W, P, JOIN)
        p, alpha, m_i, l_i = _online_softmax(_scores(q0, q1, q2, q3, k0, k1, k2, k3, BLOCK_N, P, JOIN, INTERP),
                                             valid, jj * BLOCK_N + BLOCK_N > T, m_i, l_i, qk_scale)
        v0, v1, v2, v3 = _tail_planes(tv_ptr + (gh * T + rows)[:, None] * D + cols[None, :], valid, W, P, JOIN)
        a0, a1, a2, a3 = _accumulate(p, alpha, v0, v1, v2, v3, a0, a1, a2, a3, P, JOIN, INTERP)
    return a0, a1, a2, a3, m_i, l_i


@triton.jit
def _store_rows(orow, om, a0, a1, a2, a3, lsafe, W: tl.constexpr, P: tl.constexpr, JOIN: tl.constexpr,
                INTERP: tl.constexpr):
    """orow [BLOCK_M, W] (pointers to the first W columns of each output row; om its mask) <- the accumulators /
    lsafe [BLOCK_M, 1], plane by plane, in the pointers' dtype (rounded to nearest even, by hand under the
    interpreter)."""
    if JOIN:
        a0, a1, a2, a3 = _split4(a0, P)
    tl.store(orow, to_out(a0 / lsafe, orow, INTERP), mask=om)
    if P > 1:
        tl.store(orow + W, to_out(a1 / lsafe, orow, INTERP), mask=om)
    if P > 2:
        tl.store(orow + 2 * W, to_out(a2 / lsafe, orow, INTERP), mask=om)
        tl.store(orow + 3 * W, to_out(a3 / lsafe, orow, INTERP), mask=om)


@triton.jit
def _attn_planes_kernel(q_ptr, out_ptr, kc, ks, kt, kid, kcen, vc, vs, vt, vid, vcen, tk_ptr, tv_ptr, part_ptr,
                        lse_ptr, qk_scale, M, N, T, L, C, K, HQ, HKV, SPLITS, rope_ptr, rpos_ptr, R, HW, WIDTH,
                        D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr,
                        OFFSET: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_HIST: tl.constexpr,
                        INTERP: tl.constexpr, JOIN: tl.constexpr = True, SPLIT: tl.constexpr = False,
                        ROPE: tl.constexpr = False, SPLIT_H: tl.constexpr = 0, SPLIT_W: tl.constexpr = 0):
    """Program (query block, split, batch x head). The history tiles and then the tail tiles form one sequence of
    tiles; split s of SPLITS attends its s-th contiguous share. With SPLIT, each program writes its normalized
    output (BF16, half the bytes of fp32: each share is rounded to BF16 before the fp32 merge, an error of up to
    2^-9 of the shares' weighted magnitudes on top of the output's own rounding) and log2-sum-exp (fp32) to part /
    lse for `_merge_splits`; else the output itself (q's dtype)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    bh = tl.program_id(2)
    GH = tl.num_programs(2) // HQ * HKV
    nh = 0
    if HAS_HIST:
        nh = tl.cdiv(N, BLOCK_N)
    per = tl.cdiv(nh + tl.cdiv(T, BLOCK_N), SPLITS)
    j0 = pid_s * per
    a0, a1, a2, a3, m_i, l_i = _attend_item(q_ptr, kc, ks, kt, kid, kcen, vc, vs, vt, vid, vcen, tk_ptr, tv_ptr,
                                            qk_scale, pid_m, bh, j0, j0 + per, M, N, T, L, C, K, HQ, HKV, GH,
                                            rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP, GRID,
                                            OFFSET, FP8, STAGES, BLOCK_M, BLOCK_N, HAS_HIST, INTERP, JOIN, ROPE,
                                            SPLIT_H, SPLIT_W)
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    qrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = qrows < M
    qrow = (bh.to(tl.int64) * M + qrows)[:, None] * D + tl.arange(0, W)[None, :]
    if SPLIT:  # (a split with no tile: l = 0, its weight in the merge 0)
        l1 = tl.where(l_i > 0, l_i, 1.0)
        tl.store(lse_ptr + (pid_s * tl.num_programs(2) + bh).to(tl.int64) * M + qrows,
                 tl.where(l_i > 0, m_i + tl.math.log2(l1), float("-inf")), mask=qmask)
        _store_rows(part_ptr + (pid_s * tl.num_programs(2) * M).to(tl.int64) * D + qrow, qmask[:, None], a0, a1, a2,
                    a3, l1[:, None], W, P, JOIN, INTERP)
    else:
        _store_rows(out_ptr + qrow, qmask[:, None], a0, a1, a2, a3, l_i[:, None], W, P, JOIN, INTERP)


@triton.jit
def _attn_stream_kernel(q_ptr, out_ptr, kc, ks, kt, kid, kcen, vc, vs, vt, vid, vcen, tk_ptr, tv_ptr, part_ptr,
                        lse_ptr, qk_scale, M, N, T, L, C, K, HQ, HKV, GH, ITEMS, PER, FULL, rope_ptr, rpos_ptr,
                        R, HW, WIDTH, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        GRID: tl.constexpr, OFFSET: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_HIST: tl.constexpr,
                        INTERP: tl.constexpr, JOIN: tl.constexpr = True, ROPE: tl.constexpr = False,
                        SPLIT_H: tl.constexpr = 0, SPLIT_W: tl.constexpr = 0):
    """Stream-K schedule, after FULL data-parallel waves (0 unless packed_attention(waves=True)): persistent program
    p first attends items p, p + NP, .. (FULL of them) whole, the programs of a wave walking their key tiles in
    step, then tiles [G0 + p * PER, G0 + (p + 1) * PER) of the ITEMS x TI tiles past the waves' G0 = FULL * NP * TI
    (item i: query block pid_m = i % cdiv(M, BLOCK_M) of batch x head bh = i // cdiv(M, BLOCK_M)). An item it
    attends whole goes to out; the piece that starts an item goes to out too, with its log2-sum-exp in lse[0, p];
    the piece that continues an item begun by an earlier program (at most one a program: its first) to part[p]
    (BF16) and lse[1, p]. `_merge_stream` then combines the pieces of the items split between programs, so the
    transient is one BLOCK_M x D piece a program, not a share of the whole output."""
    p = tl.program_id(0)
    NP = tl.num_programs(0)
    nh = 0
    if HAS_HIST:
        nh = tl.cdiv(N, BLOCK_N)
    TI = nh + tl.cdiv(T, BLOCK_N)
    NMB = tl.cdiv(M, BLOCK_M)
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    cols = tl.arange(0, W)
    g0 = tl.minimum(FULL * NP * TI + p * PER, ITEMS * TI)  # (a program past the last tile: its waves only)
    g1 = tl.minimum(g0 + PER, ITEMS * TI)
    i0 = g0 // TI
    for it in range(0, FULL + tl.cdiv(g1, TI) - i0):
        wave = it < FULL
        i = tl.where(wave, it * NP + p, i0 + it - FULL)
        j0 = tl.where(wave, 0, tl.maximum(g0 - i * TI, 0))
        j1 = tl.where(wave, TI, tl.minimum(g1 - i * TI, TI))
        pid_m = i % NMB
        bh = i // NMB
        a0, a1, a2, a3, m_i, l_i = _attend_item(q_ptr, kc, ks, kt, kid, kcen, vc, vs, vt, vid, vcen, tk_ptr,
                                                tv_ptr, qk_scale, pid_m, bh, j0, j1, M, N, T, L, C, K, HQ, HKV, GH,
                                                rope_ptr, rpos_ptr, R, HW, WIDTH, D, BITS, GROUP,
                                                GRID, OFFSET, FP8, STAGES, BLOCK_M, BLOCK_N, HAS_HIST, INTERP, JOIN,
                                                ROPE, SPLIT_H, SPLIT_W)
        r = tl.arange(0, BLOCK_M)
        rmask = pid_m * BLOCK_M + r < M
        if j0 == 0:
            _store_rows(out_ptr + (bh.to(tl.int64) * M + pid_m * BLOCK_M + r)[:, None] * D + cols[None, :],
                        rmask[:, None], a0, a1, a2, a3, l_i[:, None], W, P, JOIN, INTERP)
            if j1 < TI:
                tl.store(lse_ptr + p.to(tl.int64) * BLOCK_M + r, m_i + tl.math.log2(l_i), mask=rmask)
        else:
            _store_rows(part_ptr + (p.to(tl.int64) * BLOCK_M + r)[:, None] * D + cols[None, :], rmask[:, None], a0,
                        a1, a2, a3, l_i[:, None], W, P, JOIN, INTERP)
            tl.store(lse_ptr + (NP + p).to(tl.int64) * BLOCK_M + r, m_i + tl.math.log2(l_i), mask=rmask)


@triton.jit
def _merge_stream(part_ptr, lse_ptr, out_ptr, M, TI, ITEMS, PER, NP, FULL, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  ROWS: tl.constexpr, INTERP: tl.constexpr):
    """Program (boundary k, row block): where program k's share begins inside an item (and no earlier boundary
    does), that item's pieces are merged by log-sum-exp: the first (program k - 1's, in out, lse[0, k - 1]) and
    the continuations of programs k .. (part[p], lse[1, p]); the result overwrites out. ROWS rows at a time of the
    item's BLOCK_M. The shares start after the FULL data-parallel waves' G0 = FULL * NP * TI tiles."""
    k = tl.program_id(0) + 1
    G0 = FULL * NP * TI
    g = G0 + k * PER
    i = g // TI
    if (g < ITEMS * TI) & (g % TI != 0) & (G0 + (k - 1) * PER <= i * TI):
        nmb = tl.cdiv(M, BLOCK_M)
        pid_m = i % nmb
        bh = i // nmb
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rmask = (r < BLOCK_M) & (pid_m * BLOCK_M + r < M)
        pb = tl.minimum(((i + 1) * TI - 1 - G0) // PER, NP - 1)
        off = r[:, None] * D + tl.arange(0, D)[None, :]
        orow = out_ptr + (bh.to(tl.int64) * M + pid_m * BLOCK_M) * D + off
        lse0 = tl.load(lse_ptr + (k - 1).to(tl.int64) * BLOCK_M + r, mask=rmask, other=0.0)
        mx = lse0
        for pp in range(k, pb + 1):
            mx = tl.maximum(mx, tl.load(lse_ptr + (NP + pp).to(tl.int64) * BLOCK_M + r, mask=rmask, other=0.0))
        w = tl.math.exp2(lse0 - mx)
        den = w
        acc = w[:, None] * tl.load(orow, mask=rmask[:, None], other=0.0).to(tl.float32)
        for pp in range(k, pb + 1):
            w = tl.math.exp2(tl.load(lse_ptr + (NP + pp).to(tl.int64) * BLOCK_M + r, mask=rmask, other=0.0) - mx)
            acc += w[:, None] * tl.load(part_ptr + tl.cast(pp, tl.int64) * BLOCK_M * D + off, mask=rmask[:, None],
                                        other=0.0).to(tl.float32)
            den += w
        tl.store(orow, to_out(acc / den[:, None], orow, INTERP), mask=rmask[:, None])


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, M, SPLITS, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  INTERP: tl.constexpr):
    """out = sum_s w_s part_s, w_s = 2^(lse_s - max) / sum: attention over the union of the splits' keys."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    mx = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for sp in range(SPLITS):
        mx = tl.maximum(mx, tl.load(lse_ptr + (sp * BH + bh).to(tl.int64) * M + rows, mask=rmask, other=0.0))
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    off = rows[:, None] * D + tl.arange(0, D)[None, :]
    for sp in range(SPLITS):
        w = tl.math.exp2(tl.load(lse_ptr + (sp * BH + bh).to(tl.int64) * M + rows, mask=rmask, other=0.0) - mx)
        acc += w[:, None] * tl.load(part_ptr + ((sp * BH + bh) * M).to(tl.int64) * D + off, mask=rmask[:, None],
                                    other=0.0).to(tl.float32)
        den += w
    tl.store(out_ptr + bh.to(tl.int64) * M * D + off, to_out(acc / den[:, None], out_ptr, INTERP),
             mask=rmask[:, None])
