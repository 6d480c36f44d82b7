"""In-kernel scalar pieces of the group quantizer shared by the pack kernels (kernels/quantize.py,
kernels/pack_span.py): round half to even, the stored scale's encoding (FP8 E4M3 with the core's clamp, rounded to
nearest or up by the core's rule, or BF16 rounded up), exactly as qvg/quant.py does on every backend."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from qvg.quant import NEAREST_DIV

from .common import bf16_bits_to_f32

_NEAREST_DIV = tl.constexpr(NEAREST_DIV)  # FP8 scales of grids whose divisor is below this round to nearest


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _fp8_bits(q, NEAREST: tl.constexpr):
    """E4M3 bits of q in [2^-9, 448], with integer ops only (exact on every backend; the interpreter's own fp32 ->
    fp8 cast mishandles mantissa carries): NEAREST, the nearest E4M3 value (ties to even) for normal q (>= 2^-6);
    else, and for subnormal q, the smallest E4M3 value >= q (`qvg.quant._fp8_nearest`). Never 0x7F (NaN): q <= 448
    = 0x7E."""
    u = q.to(tl.uint32, bitcast=True)
    e = ((u >> 23) & 0xFF).to(tl.int32) - 127
    normal = ((e + 7) << 3) | ((u >> 20) & 7).to(tl.int32)
    rest = (u & 0xFFFFF).to(tl.int32)  # the 20 mantissa bits below E4M3's 3
    if NEAREST:  # a carry out of the mantissa moves into the exponent
        normal = normal + ((rest > 0x80000) | ((rest == 0x80000) & ((normal & 1) == 1))).to(tl.int32)
    else:
        normal = normal + (rest != 0).to(tl.int32)
    sub = -tl.floor(-q * 512.0)  # subnormals, rounded up: multiples of 2^-9 (8 -> 0x08 = 2^-6, the smallest normal)
    return tl.where(e < -6, sub.to(tl.int32), normal).to(tl.uint8)


@triton.jit
def _encode(raw, tscale, FP8: tl.constexpr, FP8_MAX: tl.constexpr, DIV: tl.constexpr):
    """Raw fp32 scale of a grid whose scale is the range / DIV -> (stored bits, decoded fp32 scale), with the core's
    clamp; FP8 rounded to nearest where DIV < `qvg.quant.NEAREST_DIV` (8), else up; BF16 rounded up."""
    if FP8:
        q = tl.minimum(tl.maximum(tl.math.div_rn(raw, tscale), 0.001953125), FP8_MAX)
        b = _fp8_bits(q, DIV < _NEAREST_DIV)
        return b, b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tscale
    else:
        q = tl.maximum(raw, 1.1754943508222875e-38)
        e = q.to(tl.bfloat16)
        b = e.to(tl.int16, bitcast=True)
        b = tl.where(e.to(tl.float32) < q, b + 1, b)
        return b, bf16_bits_to_f32(b)


@triton.jit
def _rne(v, RINT: tl.constexpr):
    """Round half to even: the hardware's (cvt.rni, RINT) or floor-based (the interpreter has no rint); the same
    value for every input (rint may give -0.0 where the floor form gives +0.0, which the codes never see: they are
    clamped and offset by OFFSET >= 1/2, or multiplied and subtracted)."""
    if RINT:
        return libdevice.rint(v)
    else:
        return _round_half_even(v)


@triton.jit
def head_tscale(hmax_ptr, mc_ptr, tscale_ptr, gh, first, TS_BOUND: tl.constexpr, TS_DIV: tl.constexpr,
                FP8_MAX: tl.constexpr, TSCALE_MIN: tl.constexpr):
    """Head gh's FP8 tscale as `qvg.quant.tensor_scale` / `bound_tscale` form it (a power of two): from the head's
    largest raw scale (hmax_ptr[gh], FP32 bits) or, TS_BOUND, from `scale_bound(hmax_ptr[gh], mc_ptr[gh])`; divided
    by TS_DIV unless 1. Stored by the head's `first` program."""
    smax = tl.load(hmax_ptr + gh).to(tl.float32, bitcast=True)
    if TS_BOUND:
        smax = smax * (1 + 2.0 ** -7) + tl.load(mc_ptr + gh)
    if TS_DIV != 1.0:
        smax = tl.math.div_rn(smax, TS_DIV)
    ts = tl.maximum(tl.math.div_rn(smax, FP8_MAX) * (1 + 2.0 ** -20), TSCALE_MIN)
    up = ((ts.to(tl.int32, bitcast=True) + 0x007FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    ts = tl.where(ts != ts, ts, up)  # `qvg.quant.pow2_ceil`: the next power of two (NaN stays NaN)
    if first:
        tl.store(tscale_ptr + gh, ts)
    return ts


@triton.jit
def auto_scales(amax, ts, OFFSET: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """The "auto" grid's two candidate scales of groups with max|x| = amax: (midrise's stored bits, flagged by their
    sign bit; its decoded scale; sym's stored bits; its decoded scale). At 1 bit both are midrise's."""
    mbits, ms = _encode(tl.math.div_rn(amax, OFFSET + 0.5), ts, FP8, FP8_MAX, OFFSET + 0.5)
    mbits = mbits | ((tl.zeros_like(mbits) + 1) << (mbits.dtype.primitive_bitwidth - 1))
    if BITS == 1:
        return mbits, ms, mbits, ms
    sbits, s = _encode(amax if OFFSET == 1.0 else tl.math.div_rn(amax, OFFSET), ts, FP8, FP8_MAX, OFFSET)
    return mbits, ms, sbits, s


@triton.jit
def add_floor(t, m, INTERP: tl.constexpr):
    """t + m rounded toward -inf, for a whole number m with t + m in [2^23, 2^24) (spacing 1): floor(t) + m, by one
    FP32 add in round-down mode, add.rm.f32 (the interpreter has no rounding modes: floor there). Inline PTX, not
    libdevice's fadd_rd: Triton links libdevice with flush-to-zero, which would take a negative subnormal t for 0.
    With m = 1.5 * 2^23 + c the sum's bits are 0x4B400000 + floor(t) + c: an integer code without a conversion."""
    if INTERP:
        return tl.floor(t) + m
    else:
        return tl.inline_asm_elementwise("add.rm.f32 $0, $1, $2;", "=r,r,r", [t, tl.zeros_like(t) + m],
                                         dtype=tl.float32, is_pure=True, pack=1)
