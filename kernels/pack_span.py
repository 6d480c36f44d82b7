"""The fused quantize + pack pass (kernels/quantize.py's `_pack_kernel` with RECOMPUTE) with every quantization
group inside one thread, for the grids sym / midrise / auto. Same stored bits; reference: qvg.quant.quantize_packed
(and the residual loop of qvg.compression.prq).

Why. `_pack_kernel` works on [BLOCK_N, D] tiles that Triton lays out as 8 contiguous columns per thread, so a
64-column group is spread over 8 threads and each thread repeats its groups' scalar work (two scale encodings and
IEEE divisions per candidate grid, the error sums' shuffles) for 4 groups: on the H100 that kernel issues ~54
instructions per element (eval/results/kernels-h100.md, ncu), most of them this replicated per-group work.

Layout. A program takes BLOCK_N tokens; each token's D columns are split into NS = D / SPAN spans of SPAN
contiguous columns (SPAN = max(GROUP, W), W = D * BITS / 8 the packed row's bytes, so a span holds whole groups
and whole code planes), and each (token, span) row is one thread's. The tile is held as [R, CH, 8]: R = BLOCK_N * NS
rows, CH = SPAN / 8 chunks of 8 columns. The 8 columns are one 16-byte load; of the two strided axes, Triton 3.6's
coalescing lays the first (rows) over the threads, so each thread holds all CH chunks of its row (Triton 3.9 breaks
that tie the other way: the same results, slower). The group reductions, the scale encodings and the plane ORs then
stay in registers, once per group. Only the span partials of a packed row meet across threads (NS - 1 shuffles per
32-bit word).

Rounding and packing on the FMA pipe. A code is an FP32 add or two: x / s + 1.5 * 2^23 lands in [2^23, 2^24), where
FP32's spacing is 1, so the add rounds x / s to an integer (to nearest even for sym; toward -inf for midrise,
`add_floor`), and adding the code's offset (exact) leaves the sum's bits at 0x4B400000 + the code. (Sym's offset is
added after the rounding: ties to even do not commute with an odd shift.) Subtracting the constant gives the rounded
value for the error sums; the bits, masked to the code's width, go into the packed words as multiply-adds. No
rint / floor / float-to-int conversions (sm_90's conversion unit does 16 per clock per SM against 128 FP32 adds) and
few integer or compare ops (the ALU pipe runs at half the FMA pipe's rate, and ncu found it this pass's busiest
pipe). The same values as the reference's round-half-to-even and floor.

The clamps of the code ranges are left out: the stored scale is max|r| / L (L = the grid's divisor) rounded up, or
to nearest E4M3 where L < 8 and the value is normal, which lowers it by at most a factor 1 + 2^-4 (stored scales
never clamp at 448: the tscale is the head's largest scale or a bound of it). So |r| * (1/s) <= L (1 + 2^-4)
(1 + 3 ulp), below sym's L + 1/2 (INT4: 7.44 < 7.5) and midrise's L + 1/2 = HALF (7.97 < 8): the rounded codes
are already in range, and the stored codes and scales are the reference's, bitwise. (The masking above keeps a
value out of range, which only non-finite input or a wrong bound can give, inside its own field.) The auto grid's
two squared-error sums are added in another order than torch's (and, in `narrow` mode, over two or more threads), so
where the two candidates' errors tie to the last bit the choice may differ from the reference's, as it could in the
8-columns-per-thread pack: the tests compare bitwise on random and hand-made inputs, where no such tie occurs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .encode import _encode, add_floor, auto_scales, head_tscale


def span_width(d: int, bits: int, group: int, narrow: bool = False) -> int:
    """Columns per thread: whole groups and whole code planes (0 where this kernel does not apply); narrow: whole
    code planes only, so a group wider than a plane spans GROUP / W threads (half the registers for qvg's INT2 B64)."""
    def pow2(v):
        return v > 0 and (v & (v - 1)) == 0

    w = d * bits // 8
    span = w if narrow and group > w else max(group, w)
    ok = (pow2(d) and pow2(group) and pow2(w) and group >= 8 and w >= 8 and d % span == 0
          and (span % group == 0 or group % span == 0) and span % w == 0)
    return span if ok else 0


@triton.jit
def _load_rows(ptr, start, rmask, R: tl.constexpr, CH: tl.constexpr):
    """[R, CH, 8] FP32: row i holds elements start[i] .. start[i] + 8 CH of ptr. BF16 is read as 32-bit words of two
    values and widened by a shift (low half) and a mask (high half) on the words: two instructions per pair where
    the widening of separate BF16 values took three."""
    if ptr.dtype.element_ty == tl.bfloat16:
        off = (start // 2)[:, None, None] + (tl.arange(0, CH) * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
        w = tl.load(ptr.to(tl.pointer_type(tl.uint32)) + off, mask=rmask[:, None, None], other=0)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (R, CH, 8))  # columns 2e, 2e + 1 of each word, in order
    else:
        off = start[:, None, None] + (tl.arange(0, CH) * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]
        return tl.load(ptr + off, mask=rmask[:, None, None], other=0.0).to(tl.float32)


@triton.jit
def _across(v, R: tl.constexpr, TPG: tl.constexpr, MAX: tl.constexpr):
    """Per-row group partials v [R, 1] combined over the TPG adjacent rows (threads) of each group, the result on
    each of them (a max, or a sum: lower row first); v itself when a group is one thread's."""
    if TPG == 1:
        return v
    else:
        v2 = tl.reshape(v, (R // TPG, TPG))
        if MAX:
            red = tl.max(v2, 1)
        else:
            red = tl.sum(v2, 1)
        return tl.reshape(tl.broadcast_to(red[:, None], (R // TPG, TPG)), (R, 1))


@triton.jit
def _opaque(v, INTERP: tl.constexpr):
    """v, hidden from the compiler's algebra (a register move), so that a product by a power of two it holds stays
    a multiply-add on the FMA pipe rather than becoming a shift on the ALU pipe."""
    if INTERP:
        return v
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _pack_span_kernel(x_ptr, ids_ptr, cent_ptr, hmax_ptr, mc_ptr, tscale_ptr, codes_ptr, scale_ptr, N, K, GH,
                      D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr,
                      OFFSET: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, STAGES: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPAN: tl.constexpr, TS_DIV: tl.constexpr,
                      TSCALE_MIN: tl.constexpr, TS_BOUND: tl.constexpr, RECODE: tl.constexpr = False,
                      INTERP: tl.constexpr = False):
    """RECODE (auto grid): the chosen grid's codes formed again from r after the choice, instead of both
    candidates' codes kept in registers until it (fewer registers, a few more instructions per element)."""
    pid_n = tl.program_id(0)
    gh = tl.program_id(1)
    NS: tl.constexpr = D // SPAN  # spans per token
    R: tl.constexpr = BLOCK_N * NS  # rows: one (token, span) per thread
    CH: tl.constexpr = SPAN // 8  # 8-column chunks per span
    TPG: tl.constexpr = GROUP // SPAN if GROUP > SPAN else 1  # threads per group (adjacent rows), narrow spans
    NGS: tl.constexpr = SPAN // GROUP if GROUP <= SPAN else 1  # groups (or a part of one) per span
    GC: tl.constexpr = GROUP // 8 if GROUP <= SPAN else CH  # chunks per group, in this thread
    P: tl.constexpr = 8 // BITS  # code planes
    W: tl.constexpr = D // P  # packed bytes per token = columns per plane
    SPW: tl.constexpr = SPAN // W  # planes per span
    WC: tl.constexpr = W // 8  # chunks per plane
    row = tl.arange(0, R)
    tokl = row // NS
    sp = row % NS
    rows = pid_n * BLOCK_N + tokl  # [R]
    rmask = rows < N
    tok = gh.to(tl.int64) * N + rows
    r = _load_rows(x_ptr, tok * D + sp * SPAN, rmask, R, CH)  # [R, CH, 8] FP32
    for st in tl.static_range(STAGES):  # the reference's order: x - C_0[id_0] - C_1[id_1] - ...
        cid = tl.load(ids_ptr + st * GH * N + tok, mask=rmask, other=0).to(tl.int64)
        crow = (st * GH + gh).to(tl.int64) * K + cid
        r -= _load_rows(cent_ptr, crow * D + sp * SPAN, rmask, R, CH)
    rg = tl.reshape(r, (R, NGS, GC, 8))
    amax = _across(tl.max(tl.max(tl.abs(rg), 3), 2), R, TPG, True)  # [R, NGS]
    ts = 1.0
    if FP8:  # the tscale: from the head's largest raw scale (hmax, a pass before) or from a bound (TS_BOUND)
        ts = head_tscale(hmax_ptr, mc_ptr, tscale_ptr, gh, pid_n == 0, TS_BOUND, TS_DIV, FP8_MAX, TSCALE_MIN)
    HALF: tl.constexpr = 2 ** (BITS - 1)  # codes: sym rne(x / s) + HALF - 1; midrise floor(x / s) + HALF
    MAG: tl.constexpr = 12582912.0  # 1.5 * 2^23 (see the module docstring)
    KM: tl.constexpr = MAG + HALF  # + midrise's code offset (floor commutes with it; rne does not with an odd one:
    #                                sym's offset is added after its rounding)
    if GRID == 3:  # auto: both candidates, then per group the one with the smaller squared error (ties: sym)
        mbits, ms, sbits, s = auto_scales(amax, ts, OFFSET, BITS, FP8, FP8_MAX)
        inv_m = tl.math.div_rn(1.0, ms)[:, :, None, None]
        um = add_floor(rg * inv_m, KM, INTERP)  # bits: 0x4B400000 + the midrise code
        if BITS == 1:  # 1-bit auto is midrise, flagged
            sbits = mbits
            c = um.to(tl.int32, bitcast=True)
        else:
            inv_s = tl.math.div_rn(1.0, s)[:, :, None, None]
            us = rg * inv_s + MAG  # rounded to nearest even: bits 0x4B400000 + rne(x / s)
            es = (us - MAG) * s[:, :, None, None] - rg  # (code - (HALF - 1)) * s
            em = ((um - KM) + 0.5) * ms[:, :, None, None] - rg  # (code - (HALF - 1/2)) * ms, exactly
            use_mid = _across(tl.sum(tl.sum(em * em, 3), 2), R, TPG, False) < \
                _across(tl.sum(tl.sum(es * es, 3), 2), R, TPG, False)
            sbits = tl.where(use_mid, mbits, sbits)
            mid = use_mid[:, :, None, None]
            if RECODE:  # the chosen candidate's sum again (bitwise the same), instead of both kept until here
                t = rg * tl.where(mid, inv_m, inv_s)
                c = tl.where(mid, add_floor(t, KM, INTERP), (t + MAG) + (HALF - 1)).to(tl.int32, bitcast=True)
            else:
                c = tl.where(mid, um, us + (HALF - 1)).to(tl.int32, bitcast=True)
    else:
        raw = tl.math.div_rn(amax, OFFSET)  # sym: max|x| / (2^(b-1) - 1); midrise: / (2^(b-1) - 1/2)
        sbits, s = _encode(raw, ts, FP8, FP8_MAX, OFFSET)
        inv = tl.math.div_rn(1.0, s)[:, :, None, None]
        if GRID == 0:
            c = ((rg * inv + MAG) + (HALF - 1)).to(tl.int32, bitcast=True)
        else:
            c = add_floor(rg * inv, KM, INTERP).to(tl.int32, bitcast=True)
    gcol = (sp * SPAN // GROUP)[:, None] + tl.arange(0, NGS)[None, :]  # [R, NGS]: the group's index in its token
    tl.store(scale_ptr + tok[:, None] * (D // GROUP) + gcol, sbits, mask=rmask[:, None])
    # planar packing: chunk j of the span is plane sp * SPW + j // WC, bytes 8 (j % WC) .. + 8 of the row. A 32-bit
    # word of 4 bytes is sum(code * 2^(8 e + plane * BITS)) over its codes and this span's planes, formed with
    # multiply-adds. The code is its raw bits 0x4B400000 + code masked to the code's width (the constant's low bits
    # are 0), so even a value that is not a valid code (a NaN input, a tscale bound that is not one) stays in its
    # own bit field and cannot corrupt its neighbours'.
    c5 = tl.reshape((c & (2 ** BITS - 1)).to(tl.uint32), (R, SPW, WC, 2, 4))
    plane = (sp * SPW)[:, None] + tl.arange(0, SPW)[None, :]  # [R, SPW]
    pmul = tl.full((R, SPW), 1, tl.uint32) << (plane * BITS).to(tl.uint32)
    emul = tl.full((4,), 1, tl.uint32) << (tl.arange(0, 4) * 8).to(tl.uint32)
    mult = _opaque(pmul[:, :, None] * emul[None, None, :], INTERP)  # [R, SPW, 4]: once per row
    word = tl.sum(tl.sum(c5 * mult[:, :, None, None, :], 4), 1)  # [R, WC, 2]
    word = tl.sum(tl.reshape(word, (BLOCK_N, NS, WC, 2)), 1)  # the token's spans ORed (disjoint bits: sum == OR)
    wtok = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    woff = (gh.to(tl.int64) * N + wtok)[:, None, None] * (W // 4) + (tl.arange(0, WC) * 2)[None, :, None] \
        + tl.arange(0, 2)[None, None, :]
    tl.store(codes_ptr.to(tl.pointer_type(tl.uint32)) + woff, word, mask=(wtok < N)[:, None, None])
