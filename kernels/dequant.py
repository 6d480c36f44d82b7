"""Fused multi-stage dequant (Triton): packed codes + scales + the assigned centroids of all S stages -> BF16 in
one pass, intermediates in registers. Reference: `qvg.decompress` (qvg/compression/prq.py, rtn.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.compression.registry import token_spec
from qvg.packed import Packed
from qvg.rope import RopeTables
from qvg.sequence import PER_TOKEN_METHODS, PackedSequence

from .common import (INTERPRET, bf16_bits_to_f32, cdiv, check_head_dim, decode_scale, dequant_codes, grid_constants,
                     raw_view, to_out)
from .launch import launch


@triton.jit
def _rope(v, rows, chunk, L, rmask, j0, rope_ptr, rpos_ptr, R, HW, WIDTH, D: tl.constexpr,
          W: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_H: tl.constexpr, SPLIT_W: tl.constexpr):
    """Rotate the pairs of a plane tile v [BLOCK_N, W] (channels 2 * j0 ...) with the factorized tables of
    qvg.rope.RopeTables: pair j reads the time, row or column row of the table by its band; rpos_ptr holds, per
    (slot, frame), the table rows of its time, first row and first column (`RopeTables.kernel_positions`: spatial
    offsets included)."""
    local = rows - chunk * L
    fi = (chunk * (L // HW) + local // HW) * 3  # the token's (slot, frame) in the positions table
    frame = tl.load(rpos_ptr + fi, mask=rmask, other=0)
    hh = tl.load(rpos_ptr + fi + 1, mask=rmask, other=0) + (local % HW) // WIDTH
    ww = tl.load(rpos_ptr + fi + 2, mask=rmask, other=0) + local % WIDTH
    j = j0 + tl.arange(0, W // 2)
    pos = tl.where((j >= SPLIT_W)[None, :], ww[:, None],
                   tl.where((j >= SPLIT_H)[None, :], hh[:, None], frame[:, None]))
    off = pos * (D // 2) + j[None, :]
    m2 = rmask[:, None]
    cos = tl.load(rope_ptr + off, mask=m2, other=1.0)
    sin = tl.load(rope_ptr + R * (D // 2) + off, mask=m2, other=0.0)
    e, o = tl.split(tl.reshape(v, (BLOCK_N, W // 2, 2)))
    return tl.reshape(tl.join(e * cos - o * sin, e * sin + o * cos), (BLOCK_N, W))


@triton.jit
def _widen(s, BLOCK_N: tl.constexpr, G2: tl.constexpr, W: tl.constexpr):
    """[BLOCK_N, G2] per-group values -> [BLOCK_N, W] (each repeated over its W / G2 columns)."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, G2, W // G2)), (BLOCK_N, W))


@triton.jit
def _crow(ids_ptr, st: tl.constexpr, GH, N, tok, rmask, gh, C, chunk, K):
    """Row of stage st's centroid table each token was assigned (ids [S, GH, N], tables [S, GH, C, K])."""
    cid = tl.load(ids_ptr + st * GH * N + tok, mask=rmask, other=0).to(tl.int64)
    return ((st * GH + gh).to(tl.int64) * C + chunk) * K + cid


@triton.jit
def _pick4(i: tl.constexpr, a0, a1, a2, a3):
    """a_i for a compile-time i < 4 (Triton has no lists of tensors)."""
    if i == 0:
        return a0
    elif i == 1:
        return a1
    elif i == 2:
        return a2
    else:
        return a3


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, zero_ptr, tscale_ptr, ids_ptr, cent_ptr, out_ptr, N, L, C, K, GH,
                    ROW0, ROW_END, OUT_N, rope_ptr, rpos_ptr, R, HW, WIDTH,
                    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr,
                    OFFSET: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROPE: tl.constexpr, SPLIT_H: tl.constexpr, SPLIT_W: tl.constexpr, INTERP: tl.constexpr,
                    NBLK, PROGS, PLANE_SPLIT: tl.constexpr):
    """Program (i, gh, q) decodes token blocks i, i + PROGS, ... (< NBLK) of group gh: every code plane, or only
    plane q with PLANE_SPLIT (then a program gathers 1/P of each centroid row: its centroid tables stay small)."""
    pid = tl.program_id(0)
    gh = tl.program_id(1)
    P: tl.constexpr = 8 // BITS  # planes per byte
    W: tl.constexpr = D // P  # bytes per row
    p0 = tl.program_id(2) if PLANE_SPLIT else 0
    NP: tl.constexpr = 1 if PLANE_SPLIT else P
    G2: tl.constexpr = W // GROUP if GROUP < W else 1  # groups per plane
    gi = tl.arange(0, G2)
    cols = tl.arange(0, W)
    for pid_n in range(pid, NBLK, PROGS):
        rows = ROW0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # tokens [ROW0, ROW_END) -> output rows [0, OUT_N)
        rmask = rows < ROW_END
        tok = gh.to(tl.int64) * N + rows  # flat token index
        otok = gh.to(tl.int64) * OUT_N + rows - ROW0
        m2 = rmask[:, None]
        byte = tl.load(codes_ptr + tok[:, None] * W + cols[None, :], mask=m2, other=0)
        chunk = rows // L  # a PackedSequence holds C chunks of L tokens, each with its own tscale and centroids
        ts = 1.0
        if FP8:
            ts = tl.load(tscale_ptr + gh.to(tl.int64) * C + chunk, mask=rmask, other=1.0)[:, None]
        # each stage's centroid row, from its own id load once for every plane (the first 4 stages; a [BLOCK_N, S]
        # id tile would need a reduction per stage, through shared memory with barriers)
        crow0 = tok
        crow1 = tok
        crow2 = tok
        crow3 = tok
        if STAGES > 0:
            crow0 = _crow(ids_ptr, 0, GH, N, tok, rmask, gh, C, chunk, K)
        if STAGES > 1:
            crow1 = _crow(ids_ptr, 1, GH, N, tok, rmask, gh, C, chunk, K)
        if STAGES > 2:
            crow2 = _crow(ids_ptr, 2, GH, N, tok, rmask, gh, C, chunk, K)
        if STAGES > 3:
            crow3 = _crow(ids_ptr, 3, GH, N, tok, rmask, gh, C, chunk, K)
        # the planes' values are stored after every plane's gathers (up to 4 planes, so 2-8 bits): a store between
        # them keeps the next plane's loads behind it (out may alias the inputs for all the compiler knows), so the
        # per-plane form waited out one gather latency per plane (-10 to -18% at S4/B16 on the H100,
        # eval/results/profile-dequant-h100.md)
        DEFER: tl.constexpr = NP <= 4
        if DEFER:
            v0 = tl.zeros([BLOCK_N, W], tl.float32)
            v1 = v0
            v2 = v0
            v3 = v0
        for pi in tl.static_range(NP):
            p = p0 + pi
            col = p * W + cols
            c = (byte >> (p * BITS)) & ((1 << BITS) - 1)
            # the plane's G2 scales per row (one load each), then widened to its W columns
            goff = tok[:, None] * (D // GROUP) + (p * W) // GROUP + gi[None, :]
            s = _widen(decode_scale(tl.load(scale_ptr + goff, mask=m2, other=0), ts, FP8), BLOCK_N, G2, W)
            z = 0.0
            if GRID == 2:
                z = _widen(bf16_bits_to_f32(tl.load(zero_ptr + goff, mask=m2, other=0)), BLOCK_N, G2, W)
            v = dequant_codes(c, s, z, OFFSET, GRID, STAGES == 1)  # (the case timed faster without I2F)
            for st in tl.static_range(STAGES):
                if st < 4:
                    crow = _pick4(st, crow0, crow1, crow2, crow3)
                else:
                    crow = _crow(ids_ptr, st, GH, N, tok, rmask, gh, C, chunk, K)
                v += tl.load(cent_ptr + crow[:, None] * D + col[None, :], mask=m2, other=0.0).to(tl.float32)
            if ROPE:  # keys stored before RoPE: rotate channel pairs (2j, 2j+1) by the token's 3D position
                v = _rope(v, rows, chunk, L, rmask, p * W // 2, rope_ptr, rpos_ptr, R, HW, WIDTH,
                          D, W, BLOCK_N, SPLIT_H, SPLIT_W)
            if DEFER:
                if pi == 0:
                    v0 = v
                elif pi == 1:
                    v1 = v
                elif pi == 2:
                    v2 = v
                else:
                    v3 = v
            else:
                tl.store(out_ptr + otok[:, None] * D + col[None, :], to_out(v, out_ptr, INTERP), mask=m2)
        if DEFER:
            orow = out_ptr + otok[:, None] * D + (p0 * W + cols)[None, :]
            for pi in tl.static_range(NP):
                tl.store(orow + pi * W, to_out(_pick4(pi, v0, v1, v2, v3), out_ptr, INTERP), mask=m2)


def dequantize(packed: Packed | PackedSequence, out: torch.Tensor | None = None, block_n: int = 32,
               rows: tuple[int, int] | None = None, num_warps: int = 4, rope: RopeTables | None = None,
               progs: int = 0, plane_split: bool = False) -> torch.Tensor:
    """Triton version of `qvg.decompress` (rtn / qvg / qvg-pro, per-token groups) and of
    `PackedSequence.decompress` (with `rope`: keys stored before RoPE, rotated as they are decoded).
    progs > 0: that many programs per group (and plane) loop over the token blocks; plane_split: one program per
    code plane (1/P of each centroid row gathered per program). Every choice writes the same bits. (Tried on the
    H100 and removed, eval/results/profile-dequant-h100.md: 32-bit offsets, S4/B16 1.2-3.9% slower at the benchmark
    spans and S1/B64 within the noise; persistent programs that load the next block's ids early, up to 35% slower;
    PTX prefetch of the centroid rows, 1.3-2.9x slower; persistent loops software-pipelined 2-3 deep, 12-92% slower.)
    The defaults
    (32-token blocks, 4 warps, one program per block) were the fastest of eval/bench_kernels.py's sweep on the
    H100 for S4/B16 at both spans and for S1/B64 at the LongCat span, within 2% of the fastest (64 x 4) for S1/B64
    at the Self-Forcing span (eval/results/kernels-h100.dequant-1439d16.json, each dequant row's `configs`). `out`: a
    contiguous [B, H, >= r1 - r0, D] tensor on the packed data's device (row i <- token r0 + i). A PackedSequence is
    decoded in slot order: after `replace_oldest` has wrapped its ring (`head` > 0), `PackedSequence.decompress`
    returns the oldest chunk first and this its slots as stored (attention does not depend on the keys' order)."""
    if isinstance(packed, PackedSequence):
        spec, stages, chunk_len = packed.spec, packed.stages, packed.chunk_len
    elif packed.method in PER_TOKEN_METHODS:
        spec, stages, chunk_len = token_spec(packed.meta), packed.meta.get("stages", 0), packed.shape[2]
    else:
        raise ValueError(f"the fused dequant kernel reads {PER_TOKEN_METHODS}, not {packed.method!r}")
    b, h, n, d = packed.shape
    check_head_dim(d)
    t = packed.tensors
    r0, r1 = (0, n) if rows is None else rows  # optional token range [r0, r1) -> out [B, H, r1 - r0, D]
    if not 0 <= r0 <= r1 <= n:  # (a range past n read the next head's tokens, a negative one before the buffer)
        raise ValueError(f"dequantize: rows must be a token range 0 <= r0 <= r1 <= {n}, got {rows!r}")
    if out is None:
        out = torch.empty(b, h, r1 - r0, d, dtype=packed.dtype, device=t["codes"].device)
    _check_out(out, (b, h, r1 - r0, d), t["codes"].device)
    dummy = t["codes"]
    k = t["centroids"].shape[-2] if stages else 1
    nblk = cdiv(r1 - r0, block_n)
    progs = nblk if progs <= 0 else min(progs, nblk)
    planes = 8 // spec.bits if plane_split else 1
    grid = (progs, b * h, planes)
    launch(_dequant_kernel, grid, t["codes"], raw_view(t["scale"]), raw_view(t["zero"]) if "zero" in t else dummy,
           t.get("tscale", dummy), t["ids"] if stages else dummy, t["centroids"] if stages else dummy, out, n,
           chunk_len, n // chunk_len, k, b * h, r0, r1, out.shape[2],
           *_rope_args(rope, dummy, chunk_len, n // chunk_len, d), D=d, STAGES=stages, BLOCK_N=block_n, ROPE=rope is not None, SPLIT_H=rope.split[0] if rope else 0,
           SPLIT_W=rope.split[1] if rope else 0, INTERP=INTERPRET, NBLK=nblk, PROGS=progs, PLANE_SPLIT=plane_split,
           num_warps=num_warps, enable_fp_fusion=False, **grid_constants(spec))
    return out


def _check_out(out: torch.Tensor, need: tuple, device) -> None:
    """The kernel writes row-major [B * H, out.shape[2], D] from out's first element: anything else is refused."""
    b, h, rows, d = need
    if out.dim() != 4 or out.shape[:2] != (b, h) or out.shape[3] != d or out.shape[2] < rows or \
            not out.is_contiguous() or out.device != device:
        raise ValueError(f"dequantize: out must be a contiguous [{b}, {h}, >= {rows}, {d}] tensor on {device}, got "
                         f"{'contiguous' if out.is_contiguous() else 'non-contiguous'} {list(out.shape)} on "
                         f"{out.device}")


def _rope_args(rope: RopeTables | None, dummy: torch.Tensor, chunk_len: int, chunks: int, head_dim: int) -> tuple:
    """The kernels' rope arguments: table, per-(slot, frame) table rows, table rows R, tokens per frame, width
    (after `RopeTables.check`, and on the history's device)."""
    if rope is None:
        return dummy, dummy, 0, 1, 1
    rope.check(head_dim, chunk_len, chunks)
    if rope.table.device != dummy.device:
        raise ValueError(f"rope: the tables are on {rope.table.device}, the packed history on {dummy.device}")
    hw = rope.height * rope.width
    return rope.table, rope.kernel_positions(chunk_len // hw), rope.table.shape[1], hw, rope.width
