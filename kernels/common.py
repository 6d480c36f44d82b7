"""Pieces shared by the Triton kernels: how a `QuantSpec` maps to kernel constants, and in-kernel decoding of
stored scales. The storage layout itself is defined (and documented) by the torch reference in qvg/quant.py and
qvg/bitpack.py; the kernels only read and write it."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qvg.backend import kernel_head_dim
from qvg.quant import QuantSpec

GRID_IDS = {"sym": 0, "midrise": 1, "asym": 2, "auto": 3}
# TRITON_INTERPRET=1 (CPU) truncates fp32 -> bf16 casts; the GPU rounds to nearest even. Under the interpreter the
# kernels round by hand so CI checks the same numbers the GPU produces.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid sizes (`triton.cdiv` is a constexpr function in Triton 3.6: a wrapper call
    of a few microseconds per use)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as `triton.next_power_of_2` on the host, without its wrapper."""
    return 1 << max(n - 1, 0).bit_length()


def check_head_dim(d: int) -> None:
    """ValueError unless the kernels take head dim d (`qvg.backend.kernel_head_dim`: a power of two from 16 to 256;
    qvg.compress and the cache run the torch reference for the others)."""
    if not kernel_head_dim(d):
        raise ValueError(f"the Triton kernels take a head dim that is a power of two from 16 to 256, got {d} "
                         "(qvg.compress, qvg.decompress and KVCache run the torch reference for it)")


def check_out(t: torch.Tensor, shape, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    """t if a kernel can write a [shape] `dtype` result on `device` into it (contiguous), else ValueError naming
    `what` (device: a tensor's, so with its index)."""
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{what} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids size themselves by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid_constants(spec: QuantSpec) -> dict:
    """Kernel constexprs of a per-token spec: GRID id, level offset (code -> level), bits, group, FP8 flag."""
    if spec.axis != "token":
        raise ValueError("the kernels handle per-token groups (the QVG / RTN layout); use the torch path otherwise")
    half = 2 ** (spec.bits - 1)
    # auto: OFFSET is sym's level offset; a negative (flagged) scale means midrise, offset OFFSET + 1/2
    offset = {"sym": half - 1, "midrise": half - 0.5, "asym": 0.0, "auto": half - 1}[spec.grid]
    return dict(GRID=GRID_IDS[spec.grid], OFFSET=offset, BITS=spec.bits, GROUP=spec.group,
                FP8=spec.scale_dtype == "fp8")


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """FP8 / BF16 tensors as same-size integers, so kernels load raw bits and decode them (works under
    TRITON_INTERPRET=1 too, which has no FP8 pointers)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


@triton.jit
def bf16_bits_to_f32(bits):
    """BF16 bit patterns (int16) -> fp32, exactly (a shift; the interpreter's own cast loses subnormals)."""
    return (bits.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def decode_scale(raw, tscale, FP8: tl.constexpr):
    """Stored scale bits -> fp32 scale (FP8 E4M3 x per-head tscale, or BF16)."""
    if FP8:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tscale
    else:
        return bf16_bits_to_f32(raw)


@triton.jit
def _code_minus(c, sub, NO_I2F: tl.constexpr):
    """float(c) - sub for unsigned integer codes c < 2^8 and sub a multiple of 1/2 below 2^8. NO_I2F: c enters as
    the mantissa of 2^22 (unit in the last place 1/2) and 2^22 + sub is subtracted, exact since every value involved
    is a multiple of 1/2 below 2^23: no int -> float conversion, which on sm_90 is the quarter-rate I2F, one per
    decoded element. The same bits either way."""
    if NO_I2F:
        return ((c.to(tl.uint32) << 1) | 0x4A800000).to(tl.float32, bitcast=True) - (4194304.0 + sub)
    else:
        return c.to(tl.float32) - sub


@triton.jit
def dequant_codes(c, s, z, OFFSET: tl.constexpr, GRID: tl.constexpr, NO_I2F: tl.constexpr = False):
    """Unsigned integer codes -> fp32 values, same arithmetic as qvg.quant.dequantize. NO_I2F: see `_code_minus`.
    On the H100 it made the one-stage dequant 0-5% faster (the most at the pipeline's read) and the four-stage one
    2.7-4.8% slower (eval/results/profile-dequant-h100.md; not profiled: the four-stage kernel's integer units,
    which unpack its BF16 centroid rows, may be what the I2F ran beside)."""
    if GRID == 2:
        return z + _code_minus(c, 0.0, NO_I2F) * s
    elif GRID == 3:  # auto: the scale's sign bit selects midrise (offset + 1/2) over sym
        return _code_minus(c, tl.where(s < 0, OFFSET + 0.5, OFFSET), NO_I2F) * tl.abs(s)
    else:
        return _code_minus(c, OFFSET, NO_I2F) * s


@triton.jit
def to_bf16(v, EMULATE_RNE: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even (by hand when EMULATE_RNE, i.e. under the interpreter)."""
    if EMULATE_RNE:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def to_out(v, ptr, EMULATE_RNE: tl.constexpr):
    """Cast fp32 to the element type of `ptr` (bf16 with round-to-nearest-even; fp16 saturated at its largest finite
    value, as `qvg.quant.to_dtype`; else as is)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return to_bf16(v, EMULATE_RNE)
    elif ptr.dtype.element_ty == tl.float16:
        return tl.clamp(v, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)  # (NaN kept, as
        # torch.clamp keeps it: a NaN K / V from a cache's unchecked commit still shows)
    else:
        return v.to(ptr.dtype.element_ty)


@triton.jit
def dot_bf16(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b with BF16 operands and FP32 accumulation. Under the interpreter (whose BF16 dot is broken) the
    operands are rounded to BF16 and multiplied in FP32, which is the same arithmetic."""
    if EMULATE:
        return tl.dot(to_bf16(a.to(tl.float32), True).to(tl.float32),
                      to_bf16(b.to(tl.float32), True).to(tl.float32), acc)
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def dot_exact(a, x, acc, PARTS: tl.constexpr, EMULATE: tl.constexpr):
    """acc + a @ x for a BF16-exact a (a one-hot, signs) and x BF16 (PARTS = 1) or FP32 split into PARTS BF16 pieces
    (hi + mid + lo carry its 24 mantissa bits): exact products, FP32 accumulation."""
    if PARTS == 1:
        return dot_bf16(a, x, acc, EMULATE)
    else:
        xf = x.to(tl.float32)
        for _ in tl.static_range(PARTS):
            piece = to_bf16(xf, EMULATE)
            acc = dot_bf16(a, piece, acc, EMULATE)
            xf = xf - piece.to(tl.float32)
        return acc


# One inline-PTX step per 4 codes (their 4 bytes in one register): each code c (bits SHIFT.. of its byte, moved to
# bits 1.. by a funnel rotate) becomes the BF16 128 + 2c by a byte permute with 0x43 (BF16 128 has ulp 1 up to 256),
# then d = (128 + 2c) - (128 + 2 off) = 2 (c - off) exactly, then d * (s / 2) + centroid in one rounding: all in
# BF16x2 (HFMA2) arithmetic, ~2 instructions an element against ~7 for the FP32 decode.
_CODES_FMA_BF16 = tl.constexpr("""{
.reg .b32 t, a, b, one;
mov.b32 one, 0x3F803F80;
shf.r.wrap.b32 t, $2, $2, $3;
and.b32 t, t, $7;
prmt.b32 a, t, 0x43434343, 0x4140;
prmt.b32 b, t, 0x43434343, 0x4342;
fma.rn.bf16x2 a, a, one, $13;
fma.rn.bf16x2 b, b, one, $14;
fma.rn.bf16x2 $0, a, $11, $15;
fma.rn.bf16x2 $1, b, $12, $16;
}""")


@triton.jit
def codes_fma_bf16(byte, SHIFT: tl.constexpr, BITS: tl.constexpr, half_scale, neg_base, cent, EMULATE: tl.constexpr):
    """bf16((c - off) * s + cent) for the BITS-bit codes c = (byte >> SHIFT) & (2^BITS - 1) (BITS <= 4), with
    half_scale = |s| / 2 and neg_base = -(128 + 2 off) (off a multiple of 1/2 below 64), rounded to BF16 here: the
    product is exact and the sum rounded once, by HFMA2. With a power-of-two tscale (`qvg.quant.tensor_scale`),
    |s| / 2 is exact in BF16 and the result is the reference's (`dequant_codes` in FP32, then rounded), except where
    the reference's FP32 sum itself rounds first; with another tscale (data packed before it was a power of two) the
    scale carries its BF16 rounding, 2^-9 of the codes' term. EMULATE (the interpreter, which runs no PTX): the same
    arithmetic in FP32, rounded to nearest even."""
    tl.static_assert(byte.dtype == tl.uint8, "codes_fma_bf16 reads uint8 code bytes (4 to a register)")
    hs = to_bf16(half_scale.to(tl.float32), EMULATE)  # (the interpreter's own cast truncates)
    nb = neg_base.to(tl.bfloat16)  # (exact: an integer below 256)
    if EMULATE:
        c = (byte.to(tl.int32) >> SHIFT) & ((1 << BITS) - 1)
        d = (128 + 2 * c).to(tl.float32) + nb.to(tl.float32)
        return to_bf16(d * hs.to(tl.float32) + cent.to(tl.float32), True)
    else:
        rot = tl.full(byte.shape, (SHIFT + 31) % 32, tl.int32)
        mask = tl.full(byte.shape, (((1 << BITS) - 1) << 1) * 0x01010101, tl.int32)
        return tl.inline_asm_elementwise(_CODES_FMA_BF16, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                         [byte, rot, mask, tl.broadcast_to(hs, byte.shape),
                                          tl.broadcast_to(nb, byte.shape), cent.to(tl.bfloat16)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)

