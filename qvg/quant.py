"""Scalar group quantizer over [B, H, N, D] tensors.

Groups (`QuantSpec.axis`):
  "token"   - `group` contiguous channels of one token (the QVG / RTN layout); scales [B, H, N, D/group].
  "channel" - `group` consecutive tokens of one channel (KIVI keys); scales [B, H, N/group, D].

Grids (`QuantSpec.grid`), for b bits; s is the group's stored scale, c the unsigned code:
  "sym"      the paper's grid: 2^b - 1 levels (c - L) * s with L = 2^(b-1) - 1 and s = max|x| / L.
             INT2 = {-1, 0, +1} * s (only 3 of 4 codes used), INT4 = -7..7 * s. Needs b >= 2. Exact zero: best
             for heavy-tailed groups (most values far below the group's max).
  "midrise"  all 2^b levels, symmetric, no zero: (c - 2^(b-1) + 1/2) * s with s = max|x| / (2^(b-1) - 1/2).
             INT2 = {-1.5, -0.5, 0.5, 1.5} * s (a 1.5x finer step), 1-bit = +-max|x|. Best for flat groups.
  "auto"     the default: per group, whichever of "sym" and "midrise" reconstructs it with the smaller squared
             error, flagged by the sign bit of the stored scale (a scale is never negative, so the bit is free):
             no extra bytes, never worse than either grid for any group whose squared errors FP32 holds
             (|x| ~1e-19 to ~1e19; beyond, they overflow or vanish and it keeps "sym"). 1-bit: "midrise".
  "asym"     min/max affine (KIVI): zero + c * s with s = (max - zero) / (2^b - 1); the zero point is the group
             minimum rounded down to BF16 (so the range stays covered), stored per group.
Every grid reconstructs within |s|/2 of x, elementwise: |x - dequantize(quantize(x))| <= |s| / 2 (codes are
computed as x * (1/s), one IEEE reciprocal per group, which the kernels reproduce exactly; near a cell edge that
may pick the neighbouring level, off the bound by float rounding only).

Scale storage (`QuantSpec.scale_dtype`):
  "fp8"   FP8 E4M3 (1 byte). To use E4M3's range fully and never under- or overflow, group scales are stored
          relative to one FP32 scale per (batch, head), `tscale` = (largest group scale of that head) / 448,
          rounded up to a power of two (so the largest group scale maps into (224, 448], stored at [224, 448] after the
          rounding below, and every decoded scale is exact in BF16): stored = e4m3(clamp(s / tscale, 2^-9, 448)). 448 is
          E4M3's largest finite value and 2^-9 its smallest positive (subnormal) one, so no scale becomes 0 or inf. e4m3
          rounds to the nearest E4M3 value (ties to even) where that cannot clip the group: for values in E4M3's normal
          range (>= 2^-6), where rounding down lowers a scale by at most a factor 1 + 2^-4, of grids whose scale is the
          group's range over a divisor below 8 (`NEAREST_DIV`: every grid at 1 and 2 bits, sym and midrise at 4), max|x|
          then lands at most 8 * 2^-4 = 1/2 a step further out: INT4 sym's at 7 * 17/16 = 7.44 < 7.5 steps, midrise's at
          7.5 * 17/16 = 7.97 < 8, still inside the last level's cell. Elsewhere (subnormal values, whose step is up to
          the value itself; asym at 4 bits; every grid at 8) it rounds *up* to the next E4M3 value, which keeps the
          range covered. Either way no code clamps and the s/2 bound holds for the stored scale; rounding every scale up
          instead gave group quantization 5-12% more MSE (eval/results/fp8-rounding-cpu.json, INT2 / INT4).
          Cost: 32 bits per (batch, head), i.e. 32 / (N * D) bits per element.
          A caller that knows an upper bound on the head's largest |x| may pass the tscale of that bound instead
          (`bound_tscale`): the scales then sit a little lower in E4M3's range and the quantizer needs no pass over
          x before it encodes one. QVG does (qvg/compression/prq.py): the bound of the residual it stores is
          max|k-means input| + max|centroid|, which the k-means update finds while it reads the tokens anyway.
  "bf16"  BF16 (2 bytes), also rounded up; clamped below at 2^-126 (BF16's smallest normal).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .bitpack import SUPPORTED_BITS, pack, unpack

GRIDS = ("auto", "sym", "midrise", "asym")
AXES = ("token", "channel")
SCALE_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
FP8_MAX = 448.0
FP8_MIN = 2.0 ** -9
BF16_MIN = 2.0 ** -126
TSCALE_MIN = 2.0 ** -117  # FP8_MIN * TSCALE_MIN = 2^-126: decoded scales stay normal floats
FP8_NORMAL_MIN = 2.0 ** -6  # E4M3's smallest normal value
NEAREST_DIV = 8.0  # FP8 scales of grids whose divisor (range / scale) is below this round to nearest (module doc)


def check_block_size(group) -> None:
    """ValueError unless `group` (a block size: values per scale) is a positive integer."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"block size must be a positive integer, got {group!r}")


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 2
    grid: str = "auto"
    axis: str = "token"
    group: int = 64
    scale_dtype: str = "fp8"

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError naming the problem if this spec cannot quantize a tensor of `shape` [B, H, N, D]."""
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"unsupported bits {self.bits}; supported: {', '.join(map(str, SUPPORTED_BITS))}")
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; choose one of {GRIDS}")
        if self.grid == "sym" and self.bits < 2:
            raise ValueError("grid 'sym' needs bits >= 2 (its 1-bit grid is {0}); use grid 'midrise' or 'asym'")
        if self.axis not in AXES:
            raise ValueError(f"unknown group axis {self.axis!r}; choose one of {AXES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown scale dtype {self.scale_dtype!r}; choose one of {tuple(SCALE_DTYPES)}")
        check_block_size(self.group)
        n, d = shape[-2], shape[-1]
        if self.axis == "token" and d % self.group:
            raise ValueError(f"head dim D={d} is not divisible by block_size={self.group}")
        if self.axis == "channel" and n % self.group:
            raise ValueError(f"token count N={n} is not divisible by the token group size {self.group}")
        if d % (8 // self.bits):
            raise ValueError(f"head dim D={d} must be a multiple of {8 // self.bits} to pack {self.bits}-bit codes")

    def to_meta(self) -> dict:
        return asdict(self)

    @property
    def scale_bits(self) -> int:
        """Bits stored per group: the scale, plus a BF16 zero point for the asym grid."""
        return 8 * SCALE_DTYPES[self.scale_dtype].itemsize + (16 if self.grid == "asym" else 0)


# --- group views ------------------------------------------------------------------------------------------------

def _grouped(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, int]:
    """View x [B, H, N, D] with the group as its own dim; returns (view, reduction dim)."""
    if spec.axis == "token":
        return x.unflatten(-1, (x.shape[-1] // spec.group, spec.group)), -1  # [B, H, N, D/g, g]
    return x.unflatten(2, (x.shape[2] // spec.group, spec.group)), 3  # [B, H, N/g, g, D]


def _per_group(s: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Broadcastable view of a per-group tensor against the grouped view of x."""
    return s.unsqueeze(-1 if spec.axis == "token" else 3)


def expand_groups(s: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-group values [B, H, groups...] -> per-element [B, H, N, D]."""
    if spec.axis == "token":
        return s.repeat_interleave(spec.group, dim=-1)
    return s.repeat_interleave(spec.group, dim=2)


# --- scale storage ----------------------------------------------------------------------------------------------

def _round_up(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Convert positive fp32 values to `dtype`, rounding up to the next representable value instead of nearest."""
    r = q.to(dtype)
    raw = r.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
    return torch.where(r.float() < q, raw + 1, raw).view(dtype)


def _fp8_nearest(q: torch.Tensor, div: float) -> torch.Tensor:
    """Positive fp32 values in [2^-9, 448] -> E4M3: to nearest (ties to even) where q is normal and div (the
    grid's range / scale) is below NEAREST_DIV, else rounded up (see the module doc)."""
    up = _round_up(q, torch.float8_e4m3fn)
    if div >= NEAREST_DIV:
        return up
    return torch.where(q < FP8_NORMAL_MIN, up, q.to(torch.float8_e4m3fn))


def _round_down_bf16(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded toward -inf (for asym zero points, so the group minimum stays covered)."""
    r = q.to(torch.bfloat16)
    raw = r.view(torch.int16)
    step = torch.where(raw >= 0, -1, 1).to(torch.int16)  # toward -inf: smaller magnitude if >= +0, larger if < 0
    return torch.where(r.float() > q, raw + step, raw).view(torch.bfloat16)


def _div(a: torch.Tensor, value: float) -> torch.Tensor:
    """a / value rounded as IEEE division on every device (torch on CUDA turns a division by a Python number into a
    multiplication by its reciprocal, which can differ by 1 ulp from the kernels' division)."""
    return a / torch.full((), value, dtype=a.dtype, device=a.device)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x, for positive normal FP32 x, exactly (the mantissa's bits carried into the
    exponent: integer ops, the same bits on every device and in the kernels' `head_tscale`); NaN stays NaN."""
    x = x.float()
    return torch.where(torch.isnan(x), x, ((x.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32))


def tensor_scale(s: torch.Tensor) -> torch.Tensor:
    """Per-(batch, head) FP32 scale of the FP8 group scales: the power of two that maps the largest raw group scale
    into (224, 448] (from smax / 448 nudged up by 2^-20, so fp32 rounding never pushes it past 448). A power of two,
    so every decoded scale (E4M3 x tscale) is exact in BF16 and BF16 arithmetic decodes the codes exactly
    (kernels/common.py `codes_fma_bf16`). Floored at 2^-117 so that every decoded scale (>= 2^-9 x tscale) is a
    normal float with a finite reciprocal (heads whose largest value is below ~1e-33)."""
    return _tscale_of(s.flatten(2).amax(-1))  # [B, H]


def _tscale_of(smax: torch.Tensor) -> torch.Tensor:
    """The tscale of heads whose largest raw group scale is smax (see `tensor_scale`)."""
    return pow2_ceil((_div(smax, FP8_MAX) * (1 + 2.0 ** -20)).clamp(min=TSCALE_MIN))


def scale_divisor(spec: QuantSpec) -> float:
    """Raw group scale = max|x| / this, for the grid whose scale sets the tscale (sym's for "auto", midrise's at 1
    bit). Not defined for "asym" (its scale depends on the group's minimum too)."""
    if spec.grid == "asym":
        raise ValueError("the asym grid has no scale bound from max|x| alone")
    half = 2 ** (spec.bits - 1)
    if spec.grid == "midrise" or (spec.grid == "auto" and spec.bits == 1):
        return half - 0.5
    return half - 1.0


def scale_bound(m_in: torch.Tensor, m_c: torch.Tensor) -> torch.Tensor:
    """Upper bound (FP32, [B, H]) of |x - c| for every x of a head whose k-means input (the BF16 rounding of x) has
    max|.| = m_in and every c of its centroids |c| <= m_c: m_in * (1 + 2^-7) + m_c. The 2^-7 covers the BF16
    rounding of the input (2^-8 relative) and the FP32 roundings of the subtraction with room to spare."""
    return m_in.float() * (1 + 2.0 ** -7) + m_c.float()


def bound_tscale(bound: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The FP8 tscale [B, H] of heads whose max|x| is at most `bound` [B, H]: `tensor_scale` of the largest raw
    group scale that bound allows (bound / `scale_divisor`), so no stored scale can clamp at 448."""
    div = scale_divisor(spec)
    return _tscale_of(bound.float() if div == 1.0 else _div(bound.float(), div))


def encode_scale(s: torch.Tensor, spec: QuantSpec, tscale: torch.Tensor | None = None, *,
                 div: float) -> dict[str, torch.Tensor]:
    """Raw fp32 group scales [B, H, ...] (>= 0) of a grid whose scale is the group's range / `div` -> stored
    tensors (see module doc). `tscale` defaults to tensor_scale(s)."""
    if spec.scale_dtype == "bf16":
        return {"scale": _round_up(s.clamp(min=BF16_MIN), torch.bfloat16)}
    tscale = tensor_scale(s) if tscale is None else tscale
    q = (s / tscale[:, :, None, None]).clamp(FP8_MIN, FP8_MAX)
    return {"scale": _fp8_nearest(q, div), "tscale": tscale.float()}


def _flag(scale: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Set the sign bit of stored scales where `flag` (the "auto" grid's midrise marker)."""
    raw = scale.view(torch.uint8 if scale.element_size() == 1 else torch.int16)
    sign = torch.tensor(0x80 if raw.dtype == torch.uint8 else -32768, dtype=raw.dtype, device=raw.device)
    return torch.where(flag, raw | sign, raw).view(scale.dtype)


def decode_scale(stored: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Stored scales -> fp32 (signed: negative marks a midrise group of the "auto" grid)."""
    s = stored["scale"].float()
    if spec.scale_dtype == "fp8":
        s = s * stored["tscale"][:, :, None, None]
    return s


# --- quantize / dequantize ---------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, spec: QuantSpec,
             tscale: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """x [B, H, N, D] -> (unsigned codes uint8 [B, H, N, D], stored scale tensors). tscale [B, H] (FP8 scales,
    not asym): the per-head scale to store the group scales against, e.g. `bound_tscale` of a known bound of
    max|x| (default: `tensor_scale` of x's own largest group scale)."""
    if tscale is not None and (spec.scale_dtype != "fp8" or spec.grid == "asym"):
        raise ValueError("a given tscale needs FP8 scales and a grid other than asym")
    xg, rd = _grouped(x.float(), spec)
    b = spec.bits
    if spec.grid == "asym":
        zero = _round_down_bf16(xg.amin(rd))
        stored = encode_scale(_div(xg.amax(rd) - zero.float(), 2 ** b - 1), spec, div=2 ** b - 1)
        stored["zero"] = zero
        s = _per_group(decode_scale(stored, spec), spec)
        codes = torch.round((xg - _per_group(zero.float(), spec)) * torch.reciprocal(s)).clamp(0, 2 ** b - 1)
    else:
        amax = xg.abs().amax(rd)
        grid = "midrise" if spec.grid == "auto" and b == 1 else spec.grid
        if grid in ("sym", "auto"):
            lim = 2 ** (b - 1) - 1
            stored = encode_scale(_div(amax, lim), spec, tscale, div=lim)
            s = _per_group(decode_scale(stored, spec), spec)
            codes = torch.round(xg * torch.reciprocal(s)).clamp(-lim, lim) + lim
        if grid in ("midrise", "auto"):
            half = 2 ** (b - 1)
            m_stored = encode_scale(_div(amax, half - 0.5), spec, stored.get("tscale") if grid == "auto" else tscale,
                                    div=half - 0.5)
            m_s = _per_group(decode_scale(m_stored, spec), spec)
            m_codes = (torch.floor(xg * torch.reciprocal(m_s)) + half).clamp(0, 2 ** b - 1)
        if grid == "midrise":
            stored, codes = m_stored, m_codes
            if spec.grid == "auto":  # 1-bit auto: always midrise, flagged
                stored["scale"] = _flag(stored["scale"], torch.ones_like(amax, dtype=torch.bool))
        elif grid == "auto":  # keep, per group, the grid with the smaller squared error (ties: sym)
            e_sym = ((codes - lim) * s - xg).pow(2).sum(rd)
            e_mid = ((m_codes - (half - 0.5)) * m_s - xg).pow(2).sum(rd)
            use_mid = e_mid < e_sym
            codes = torch.where(_per_group(use_mid, spec), m_codes, codes)
            stored["scale"] = torch.where(use_mid, _flag(m_stored["scale"], use_mid), stored["scale"])
    return codes.to(torch.uint8).flatten(*((-2, -1) if spec.axis == "token" else (2, 3))), stored


def dequantize(codes: torch.Tensor, stored: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Inverse of `quantize`: -> fp32 [B, H, N, D]."""
    s = expand_groups(decode_scale(stored, spec), spec)
    c = codes.float()
    if spec.grid == "asym":
        return expand_groups(stored["zero"].float(), spec) + c * s
    if spec.grid == "sym":
        return (c - (2 ** (spec.bits - 1) - 1)) * s
    if spec.grid == "auto":  # negative scale: a midrise group
        return (c - torch.where(s < 0, 2 ** (spec.bits - 1) - 0.5, 2 ** (spec.bits - 1) - 1)) * s.abs()
    return (c - (2 ** (spec.bits - 1) - 0.5)) * s


def to_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decode y (FP32) as `dtype`, float16 saturated at its largest finite value: a finite input's decode can round
    past it (midrise's top level, and a scale rounded up, may lie above the group's max), which a cast makes inf."""
    if dtype == torch.float16:
        top = torch.finfo(torch.float16).max
        y = y.clamp(-top, top)
    return y.to(dtype)


def quantize_packed(x: torch.Tensor, spec: QuantSpec, tscale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize and bit-pack: -> {"codes": uint8 [B, H, N, D*bits/8], "scale": ..., ["zero"], ["tscale"]}.
    tscale: see `quantize`."""
    codes, stored = quantize(x, spec, tscale)
    return {"codes": pack(codes, spec.bits), **stored}


def dequantize_packed(tensors: dict[str, torch.Tensor], spec: QuantSpec, d: int) -> torch.Tensor:
    return dequantize(unpack(tensors["codes"], spec.bits, d), tensors, spec)


def step_size(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Per-element stored scale |s| [B, H, N, D]; the reconstruction error is at most |s| / 2."""
    return expand_groups(decode_scale(tensors, spec), spec).abs()
