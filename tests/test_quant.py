"""qvg.quant: the scalar group quantizer (grids, group axes, FP8/BF16 scale storage, the half-step bound)."""
import itertools
import zlib

import pytest
import torch

from conftest import assert_within_half_step, gen, randn, with_outliers
from qvg.quant import (FP8_MAX, FP8_MIN, BF16_MIN, QuantSpec, decode_scale, dequantize, dequantize_packed, pow2_ceil,
                       quantize, quantize_packed, step_size)

GRID_BITS = [(g, b) for g in ("auto", "sym", "midrise", "asym") for b in (1, 2, 4, 8) if not (g == "sym" and b < 2)]
# (axis, group, shape): token groups split D; channel groups split N (KIVI keys)
LAYOUTS = [("token", 16, (2, 3, 37, 64)), ("token", 32, (1, 2, 45, 128)), ("token", 64, (2, 2, 29, 128)),
           ("channel", 16, (2, 2, 48, 64)), ("channel", 32, (1, 3, 96, 64)), ("channel", 64, (1, 2, 128, 32))]
SCALE_DTYPES = ("fp8", "bf16")

ALL_SPECS = [pytest.param(QuantSpec(bits=b, grid=g, axis=a, group=gr, scale_dtype=sd), shape,
                          id=f"{g}-int{b}-{a}{gr}-{sd}")
             for (g, b), (a, gr, shape), sd in itertools.product(GRID_BITS, LAYOUTS, SCALE_DTYPES)]


def spread_data(shape, seed, scale=1.0):
    """Gaussian data whose per-token magnitude spans ~3 decades, so group scales use a good part of E4M3's range."""
    g = gen(seed)
    mag = 10.0 ** (3 * torch.rand(*shape[:-1], 1, generator=g) - 1.5)
    return torch.randn(*shape, generator=g) * mag * scale


def round_trip(x, spec):
    codes, stored = quantize(x, spec)
    return codes, stored, dequantize(codes, stored, spec), step_size(stored, spec)


def grouped(x, spec):
    """Group view and reduction dim, written independently of qvg.quant."""
    if spec.axis == "token":
        return x.reshape(*x.shape[:-1], x.shape[-1] // spec.group, spec.group), -1
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] // spec.group, spec.group, x.shape[3]), 3


def raw_scale(x, stored, spec):
    """The un-rounded per-group scale each grid needs (asym: relative to the stored zero point)."""
    xg, rd = grouped(x.float(), spec)
    b = spec.bits
    if spec.grid == "auto":  # per group, sym's or midrise's scale: the stored sign says which
        s = stored["scale"].float()
        mid = xg.abs().amax(rd) / (2 ** (b - 1) - 0.5)
        return mid if b == 1 else torch.where(s < 0, mid, xg.abs().amax(rd) / (2 ** (b - 1) - 1))
    if spec.grid == "sym":
        return xg.abs().amax(rd) / (2 ** (b - 1) - 1)
    if spec.grid == "midrise":
        return xg.abs().amax(rd) / (2 ** (b - 1) - 0.5)
    return (xg.amax(rd) - stored["zero"].float()) / (2 ** b - 1)


# --- the half-step bound ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_error_within_half_step(spec, shape):
    spec.check(shape)
    x = spread_data(shape, seed=zlib.crc32(repr(spec).encode()) % 1000)
    codes, stored, x_hat, step = round_trip(x, spec)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert int(codes.max()) < 2 ** spec.bits
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    assert_within_half_step(x, x_hat, step, what=str(spec))
    # the packed path is the same quantizer
    packed = quantize_packed(x, spec)
    assert packed["codes"].shape[-1] == shape[-1] * spec.bits // 8
    assert torch.equal(dequantize_packed(packed, spec, shape[-1]), x_hat)


@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_stored_tensor_layout(spec, shape):
    b, h, n, d = shape
    _, stored = quantize(randn(*shape, seed=1), spec)
    groups = (b, h, n, d // spec.group) if spec.axis == "token" else (b, h, n // spec.group, d)
    assert stored["scale"].shape == groups
    assert stored["scale"].dtype == (torch.float8_e4m3fn if spec.scale_dtype == "fp8" else torch.bfloat16)
    assert ("tscale" in stored) == (spec.scale_dtype == "fp8")
    if spec.scale_dtype == "fp8":
        assert stored["tscale"].shape == (b, h) and stored["tscale"].dtype == torch.float32
    assert ("zero" in stored) == (spec.grid == "asym")
    if spec.grid == "asym":
        assert stored["zero"].shape == groups and stored["zero"].dtype == torch.bfloat16
    assert spec.scale_bits == (8 if spec.scale_dtype == "fp8" else 16) + (16 if spec.grid == "asym" else 0)


# --- grids use the documented levels ------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,bits,expected", [("midrise", 2, 4), ("sym", 2, 3), ("asym", 2, 4),
                                                ("midrise", 1, 2), ("sym", 4, 15), ("midrise", 4, 16)])
def test_distinct_codes_used(grid, bits, expected):
    x = randn(2, 2, 256, 64, seed=3)
    codes, _ = quantize(x, QuantSpec(bits=bits, grid=grid))
    assert codes.unique().numel() == expected
    if grid == "sym":
        assert int(codes.max()) == 2 ** bits - 2  # the top code is never used


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_midrise_int2_levels(scale_dtype):
    spec = QuantSpec(bits=2, grid="midrise", scale_dtype=scale_dtype)
    x = randn(1, 2, 64, 64, seed=4)
    codes, stored = quantize(x, spec)
    x_hat = dequantize(codes, stored, spec)
    ratio = x_hat / step_size(stored, spec)
    levels = (ratio * 2).round() / 2
    torch.testing.assert_close(ratio, levels, rtol=1e-6, atol=0)
    assert torch.equal(levels.unique(), torch.tensor([-1.5, -0.5, 0.5, 1.5]))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_sym_int2_levels(scale_dtype):
    spec = QuantSpec(bits=2, grid="sym", scale_dtype=scale_dtype)
    x = randn(1, 2, 64, 64, seed=5)
    codes, stored = quantize(x, spec)
    ratio = dequantize(codes, stored, spec) / step_size(stored, spec)
    torch.testing.assert_close(ratio, ratio.round(), rtol=1e-6, atol=0)
    assert torch.equal(ratio.round().unique(), torch.tensor([-1.0, 0.0, 1.0]))


def test_midrise_step_finer_than_sym_int2():
    x = randn(2, 2, 128, 64, seed=6)
    s_sym = step_size(quantize(x, QuantSpec(bits=2, grid="sym"))[1], QuantSpec(bits=2, grid="sym"))
    s_mid = step_size(quantize(x, QuantSpec(bits=2, grid="midrise"))[1], QuantSpec(bits=2, grid="midrise"))
    ratio = (s_sym / s_mid).median().item()
    assert 1.3 < ratio < 1.7  # ~1.5x, up to the FP8 rounding of each


# --- scale storage: rounding, FP8 clamp, extremes ------------------------------------------------------------------

E4M3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive finite E4M3 value


def rounds_to_nearest(spec):
    """The core's rule, written out: FP8 scales round to nearest (normal values) when the grid's divisor (range /
    scale; auto: its larger one, midrise's) is below 8, i.e. at 1-2 bits, and at 4 bits but for asym."""
    return spec.scale_dtype == "fp8" and (spec.bits <= 2 or (spec.bits == 4 and spec.grid != "asym"))


@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_decoded_scale_rounding_is_tight(spec, shape):
    x = spread_data(shape, seed=7)
    _, stored = quantize(x, spec)
    raw = raw_scale(x, stored, spec)
    dec = decode_scale(stored, spec).abs()
    if spec.scale_dtype == "fp8":
        ts = stored["tscale"][:, :, None, None]
        q = (raw / ts).clamp(max=FP8_MAX)
        normal = q >= 2.0 ** -6  # E4M3's normal values are 1/8 apart relatively; below, the spacing is 2^-9
        assert normal.float().mean() > 0.5
        if rounds_to_nearest(spec):  # the nearest E4M3 value, by a table lookup (random data: no exact ties)
            table = E4M3.to(q.dtype)
            want = table[(q[normal].unsqueeze(-1) - table).abs().argmin(-1)]
            assert torch.equal((dec / ts)[normal], want)
            assert (dec[~normal] >= raw[~normal]).all()
            assert (dec[normal] < raw[normal]).any() and (dec[normal] > raw[normal]).any()
        else:
            assert (dec >= raw).all(), f"decoded scale below raw by up to {(raw - dec).max().item():.3g}"
            assert (dec[normal] <= raw[normal] * 1.125 * (1 + 1e-6)).all()
        # the tscale is a power of two and the largest group of every head is stored in [224, 448] (its raw
        # scale maps into (224, 448]; nearest may round it to 224. auto: the tscale follows the sym candidate, so
        # a head whose largest group went midrise may top out lower)
        assert torch.equal(stored["tscale"], pow2_ceil(stored["tscale"]))
        top = stored["scale"].float().abs().flatten(2).amax(-1)
        assert (top <= FP8_MAX).all()
        if not (spec.grid == "auto" and spec.bits > 1):
            assert (top >= FP8_MAX / 2).all()
    else:  # BF16: rounded up
        assert (dec >= raw).all(), f"decoded scale below raw by up to {(raw - dec).max().item():.3g}"
        normal = raw >= BF16_MIN
        assert (dec[normal] <= raw[normal] * (1 + 2.0 ** -7) * (1 + 1e-6)).all()


@pytest.mark.parametrize("grid,bits", [("sym", 2), ("sym", 4), ("midrise", 1), ("midrise", 2), ("midrise", 4),
                                       ("auto", 2), ("auto", 4), ("asym", 1), ("asym", 2)])
def test_nearest_scale_never_clamps(grid, bits):
    """The worst case of rounding a scale down: s / tscale a tie 2^e (1 + 2^-4) of E4M3, which rounds to the even
    2^e, so max|x| sits at divisor * 17/16 steps (INT4 sym: 7.44, midrise: 7.97). The codes, computed here without
    a clamp, are still in the grid's range, and the half-step bound holds (auto: its sym candidate is the tie)."""
    spec = QuantSpec(bits=bits, grid=grid, group=16)
    half = 2 ** (bits - 1)
    div = {"sym": half - 1, "midrise": half - 0.5, "auto": half - 1, "asym": 2 ** bits - 1}[grid]
    q = 2.0 ** torch.arange(-6, 8).float() * (1 + 2.0 ** -4)  # ties, in every normal binade below 448
    amax = torch.cat([torch.tensor([300.0]), q]) * div  # token 0 sets the tscale to 1 (300 in (224, 448])
    x = torch.rand(1, 1, amax.numel(), 16, generator=gen(3)) * amax[:, None]  # asym: range [0, amax], zero 0
    x[..., 0] = amax
    x[..., 1] = 0.0
    if grid != "asym":  # signed values, max|x| = amax on both sides
        x[..., 2::2] *= -1
        x[..., 1] = -amax
    codes, stored, x_hat, step = round_trip(x, spec)
    assert torch.equal(stored["tscale"], torch.ones(1, 1))
    dec = decode_scale(stored, spec)[0, 0, :, 0]  # one group per token; signed (auto: negative = midrise)
    if grid != "auto":
        assert torch.equal(dec[1:], 2.0 ** torch.arange(-6, 8).float())  # every tie rounded down, to even
    s, xr = dec.abs()[:, None], x[0, 0]
    if grid == "asym":
        c = torch.round((xr - stored["zero"].float()[0, 0]) / s)
    else:
        mid = (dec < 0)[:, None] if grid == "auto" else torch.tensor(grid == "midrise")
        c = torch.where(mid, torch.floor(xr / s) + half, torch.round(xr / s) + half - 1)
    assert 0 <= c.min() and c.max() <= 2 ** bits - 1 - (grid == "sym")
    assert_within_half_step(x, x_hat, step, what=str(spec))


def _zero_some_groups(x, spec, seed):
    """Zero ~1/4 of the groups and the whole of head (0, 0)."""
    x = x.clone()
    xg, rd = grouped(x, spec)  # a view
    keep = torch.rand(xg.shape[:rd] if rd == -1 else xg.shape[:3] + xg.shape[4:], generator=gen(seed)) > 0.25
    xg.mul_(keep.unsqueeze(rd).float())
    x[0, 0] = 0
    return x


EXTREME = [pytest.param(m, id=f"mag{m:g}") for m in (1e-6, 1e-30, 1e4, 1e6)]


@pytest.mark.parametrize("mag", EXTREME)
@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_extreme_magnitudes_and_zero_groups(spec, shape, mag):
    x = _zero_some_groups(randn(*shape, seed=8, scale=mag), spec, seed=9)
    _, stored, x_hat, step = round_trip(x, spec)
    dec = decode_scale(stored, spec).abs()
    assert torch.isfinite(dec).all() and (dec > 0).all(), "decoded scales must be finite and strictly positive"
    if spec.scale_dtype == "fp8":
        q = stored["scale"].float().abs()  # (the sign bit flags the "auto" grid's midrise groups)
        assert (q >= FP8_MIN).all() and (q <= FP8_MAX).all()
        assert torch.isfinite(stored["tscale"]).all() and (stored["tscale"] > 0).all()
    assert torch.isfinite(x_hat).all()
    assert_within_half_step(x, x_hat, step, what=f"{spec} x{mag:g}")
    # zeros stay (nearly) zero: within half of a tiny positive step
    zero = x == 0
    assert (x_hat[zero].abs() <= step[zero] / 2 * (1 + 1e-5)).all()


def _fp8_scale_tightness(mag):
    """Largest decoded/raw scale ratio over the groups of an INT4 fp8 quantization of N(0, mag^2) data."""
    spec = QuantSpec(bits=4, grid="midrise", scale_dtype="fp8")
    x = randn(2, 2, 64, 64, seed=15, scale=mag)
    _, stored = quantize(x, spec)
    return (decode_scale(stored, spec).abs() / raw_scale(x, stored, spec)).max().item()


@pytest.mark.parametrize("mag", [1.0, 1e-6, 1e-30, 1e6])
def test_fp8_scales_stay_tight_at_extreme_magnitudes(mag):
    """The stored E4M3 scale is at most 1/8 above the raw one (rounded up or to nearest), whatever the data's
    magnitude."""
    assert _fp8_scale_tightness(mag) <= 1.125 * (1 + 1e-6)


def test_fp8_scales_stay_tight_for_tiny_heads():
    assert _fp8_scale_tightness(1e-36) <= 1.125 * (1 + 1e-6)


@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_all_zero_tensor(spec, shape):
    x = torch.zeros(shape)
    _, stored, x_hat, step = round_trip(x, spec)
    dec = decode_scale(stored, spec).abs()
    assert torch.isfinite(dec).all() and (dec > 0).all()
    assert torch.isfinite(x_hat).all()
    assert x_hat.abs().max().item() < 1e-30
    assert_within_half_step(x, x_hat, step)


@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_wide_dynamic_range_within_a_head(spec, shape):
    """Group scales 10^-8 .. 10^8 apart inside one head: many hit the FP8 clamp at 2^-9, the bound still holds."""
    g = gen(10)
    mag = 10.0 ** (16 * torch.rand(*shape[:-1], 1, generator=g) - 8)
    x = torch.randn(*shape, generator=g) * mag
    _, stored, x_hat, step = round_trip(x, spec)
    dec = decode_scale(stored, spec).abs()
    assert torch.isfinite(dec).all() and (dec > 0).all()
    assert_within_half_step(x, x_hat, step, what=str(spec))


@pytest.mark.parametrize("factor", (1e3, 1e5))
@pytest.mark.parametrize("spec,shape", ALL_SPECS)
def test_outlier_channels(spec, shape, factor):
    x = with_outliers(randn(*shape, seed=11), channels=3, factor=factor, seed=12)
    assert x.abs().max() > factor / 4
    _, stored, x_hat, step = round_trip(x, spec)
    assert_within_half_step(x, x_hat, step, what=str(spec))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float64))
def test_input_dtypes(dtype):
    spec = QuantSpec(bits=4)
    x = randn(1, 2, 40, 64, seed=13, dtype=dtype)
    _, _, x_hat, step = round_trip(x, spec)
    assert x_hat.dtype == torch.float32
    assert_within_half_step(x.float(), x_hat, step)


def test_quantize_is_deterministic():
    spec = QuantSpec(bits=2)
    x = randn(2, 2, 64, 64, seed=14)
    a, b = quantize_packed(x, spec), quantize_packed(x.clone(), spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                                        for k in a if a[k].dtype != torch.float32)
    assert torch.equal(a["tscale"], b["tscale"])


# --- QuantSpec.check ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,shape,match", [
    (dict(bits=3), (1, 1, 8, 64), "unsupported bits"),
    (dict(bits=1, grid="sym"), (1, 1, 8, 64), "sym"),
    (dict(grid="nf4"), (1, 1, 8, 64), "unknown grid"),
    (dict(axis="head"), (1, 1, 8, 64), "unknown group axis"),
    (dict(scale_dtype="fp16"), (1, 1, 8, 64), "unknown scale dtype"),
    (dict(group=0), (1, 1, 8, 64), "positive integer"),
    (dict(group=48), (1, 1, 8, 64), "not divisible by block_size"),
    (dict(axis="channel", group=32), (1, 1, 40, 64), "not divisible by the token group"),
    (dict(bits=2, group=2), (1, 1, 8, 2), "multiple of 4"),
])
def test_spec_check_errors(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(**kwargs).check(shape)


# --- the "auto" grid ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("scale_dtype", ["fp8", "bf16"])
def test_auto_grid_never_worse_than_sym_or_midrise_per_group(bits, scale_dtype):
    """auto keeps, per group, the better of sym and midrise (flagged by the scale's sign bit): per-group squared
    error <= min of the two, on heavy-tailed and flat groups alike."""
    g = torch.Generator().manual_seed(40)
    flat = torch.rand(1, 2, 64, 128, generator=g) * 2 - 1
    heavy = torch.randn(1, 2, 64, 128, generator=g) * torch.where(torch.rand(1, 2, 64, 128, generator=g) < 0.03,
                                                                 50.0, 1.0)
    x = torch.cat([flat, heavy], 2)
    errs = {}
    for grid in ("auto", "sym", "midrise"):
        spec = QuantSpec(bits=bits, grid=grid, group=32, scale_dtype=scale_dtype)
        codes, stored = quantize(x, spec)
        errs[grid] = (dequantize(codes, stored, spec) - x).pow(2).unflatten(-1, (4, 32)).sum(-1)
        if grid == "auto":
            flags = stored["scale"].float() < 0
    if scale_dtype == "bf16":  # (with FP8 the standalone grids' scales round against other per-head tscales)
        assert bool((errs["auto"] <= torch.minimum(errs["sym"], errs["midrise"]) * (1 + 1e-6) + 1e-12).all())
    assert 0 < flags.float().mean() < 1  # both grids get used on this mix
    assert errs["auto"].sum() < min(errs["sym"].sum(), errs["midrise"].sum())


def test_pow2_ceil_is_the_next_power_of_two():
    x = torch.tensor([1.0, 1.5, 2.0 ** -117, 3 * 2.0 ** -20, 448.0, 2.0 ** 100 * 1.0000001, 0.75])
    want = torch.tensor([1.0, 2.0, 2.0 ** -117, 2.0 ** -18, 512.0, 2.0 ** 101, 1.0])
    assert torch.equal(pow2_ceil(x), want)
    assert pow2_ceil(torch.tensor([float("nan")])).isnan().all()  # (a NaN head stays NaN, not a zero scale)
