"""qvg.kernels.quantize.quantize_packed (Triton) against qvg.quant.quantize_packed (torch): bitwise equal codes,
scales, zero points and tscales, for every grid / bit width / scale dtype, and for the fused PRQ residual path."""
import pytest
import torch
import triton
import triton.language as tl

import qvg
from kernel_helpers import assert_tensors_equal, clustered, gen, poisoned, raw_bits, token_spec, varied
from qvg.bitpack import unpack
from qvg.kernels.common import GRID_IDS
from qvg.kernels.encode import add_floor
from qvg.kernels.quantize import quantize_packed
from qvg.compression import prq
from qvg.quant import QuantSpec, bound_tscale, decode_scale, scale_bound, tensor_scale
from qvg.quant import quantize_packed as quantize_packed_ref


def _valid(grid: str, bits: int) -> bool:
    try:
        QuantSpec(bits=bits, grid=grid).check((1, 1, 1, 64))
    except ValueError:  # sym needs bits >= 2
        return False
    return True


SPECS = [(grid, bits) for grid in GRID_IDS for bits in (1, 2, 4, 8) if _valid(grid, bits)]  # the kernels' grids


def assert_matches_reference(got: dict, want: dict, what: str, device: str) -> None:
    """Bitwise equal stored tensors. On CUDA the per-head FP32 tscale is allowed 1 ulp: the kernel wrapper computes
    it with torch on the device, and torch's CUDA division by a Python scalar is not correctly rounded (see
    test_tscale_is_device_independent); codes, scales and zero points must still match bit for bit."""
    if device != "cpu" and "tscale" in want:
        ulps = (raw_bits(got["tscale"]).long() - raw_bits(want["tscale"]).long()).abs()
        assert int(ulps.max()) <= 1, f"{what}: tscale off by {int(ulps.max())} ulp"
        got = {k: v for k, v in got.items() if k != "tscale"}
        want = {k: v for k, v in want.items() if k != "tscale"}
    assert_tensors_equal(got, want, what)


def _hard_input(n: int = 37, d: int = 64, seed: int = 0) -> torch.Tensor:
    """[2, 2, N, D] fp32, one (batch, head) per regime: channel magnitudes 1e-3..1e3 / an all-zero head / tiny
    values (~1e-30) / rows whose magnitudes span 1e-30..1e3, with exact-zero rows and a constant row.
    N = 37 is not a multiple of the kernel's row block (32)."""
    g = gen(seed)
    x = torch.empty(2, 2, n, d)
    x[0, 0] = varied(1, 1, n, d, seed=seed)[0, 0]
    x[0, 1] = 0.0
    x[1, 0] = torch.randn(n, d, generator=g) * 1e-30
    x[1, 1] = torch.randn(n, d, generator=g) * torch.logspace(-30, 3, n)[:, None]
    x[1, 1, 3] = 0.0
    x[1, 1, 20] = 0.0
    x[1, 1, 11] = 0.75  # a constant row: every value sits on the group's max
    return x


def _check(x: torch.Tensor, spec: QuantSpec, device: str, block_n: int = 32, fused: bool = False,
           span: bool | str = False, what: str = "") -> None:
    want = quantize_packed_ref(x, spec)
    with poisoned():  # the kernel's own torch.empty outputs start as NaN / 0xFF
        got = quantize_packed(x.to(device), spec, block_n=block_n, fused=fused, span=span)
    assert all(t.device.type == device for t in got.values())
    assert_matches_reference(got, want, f"{spec} {what}", device)
    s = decode_scale({k: v.cpu() for k, v in got.items()}, spec)  # signed for "auto" (sign = midrise flag)
    assert torch.isfinite(s).all() and (s.abs() > 0).all(), f"{spec}: decoded scales not finite and nonzero"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("scale_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("grid,bits", SPECS)
def test_quantize_matches_reference(grid, bits, scale_dtype, group, fused, device):
    """fused: no raw-scale array, the head maximum by an integer atomic max, the stats formed in the pack pass."""
    spec = QuantSpec(bits=bits, grid=grid, group=group, scale_dtype=scale_dtype)
    _check(_hard_input(), spec, device, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grid,bits,scale_dtype", [("midrise", 2, "fp8"), ("sym", 4, "bf16"), ("asym", 2, "fp8"),
                                                   ("auto", 2, "fp8")])
def test_quantize_bf16_input_and_other_shapes(grid, bits, scale_dtype, fused, device):
    """BF16 input, D = 128 with groups of 32, several row blocks with a ragged last one (and, fused, several
    programs per head feeding the head maximum)."""
    x = varied(1, 3, 70, 128, seed=3).bfloat16()
    _check(x, QuantSpec(bits=bits, grid=grid, group=32, scale_dtype=scale_dtype), device, block_n=16, fused=fused)


@pytest.mark.parametrize("grid,bits", SPECS)
def test_quantize_word_and_byte_plane_or_agree(grid, bits, device):
    """The pack's code planes ORed as 32-bit words (the default) and byte by byte (words=False): the same stored
    tensors, both equal to the reference, at every grid and bit width (1, 2, 4, 8: 8, 4, 2 and 1 planes)."""
    spec = QuantSpec(bits=bits, grid=grid, group=16, scale_dtype="fp8")
    x = _hard_input()
    want = quantize_packed_ref(x, spec)
    for words in (True, False):
        with poisoned():
            got = quantize_packed(x.to(device), spec, fused=True, words=words)
        assert_matches_reference(got, want, f"{spec} words={words}", device)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d,bits,grid", [(16, 1, "midrise"), (16, 1, "auto"), (16, 2, "auto"), (32, 1, "asym")])
def test_quantize_narrow_rows(d, bits, grid, fused, device):
    """Rows of D * bits / 8 = 2 or 4 bytes: the pack's byte-wise plane OR (rows not a whole number of 32-bit
    words) and its word-wise one on a single word."""
    x = varied(1, 2, 37, d, seed=7)
    _check(x, QuantSpec(bits=bits, grid=grid, group=16, scale_dtype="fp8"), device, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
def test_quantize_fp8_scale_spread(fused, device):
    """Group scales spanning far more than E4M3's range within one head: the small ones clamp at 2^-9 * tscale,
    exactly like the reference."""
    x = torch.randn(1, 1, 33, 64, generator=gen(5)) * torch.logspace(-12, 3, 33)[:, None]
    _check(x, QuantSpec(bits=2, grid="midrise", group=16, scale_dtype="fp8"), device, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,opts", [
    ("qvg", {}),
    ("qvg", {"grid": "midrise"}),
    ("qvg-pro", {"grid": "midrise"}),
    ("qvg", {"bits": 4, "grid": "sym", "scale_dtype": "bf16"}),
    ("qvg", {"grid": "asym"}),
    ("qvg-pro", {"bits": 1, "block_size": 32, "grid": "midrise"}),
])
def test_fused_prq_residual_matches_compress(method, opts, x_dtype, fused, device):
    """quantize_packed(x, spec, ids, centroids, bound=) quantizes x - sum_s C_s[ids_s] exactly as qvg.compress's
    torch path does (same stored codes, scales, zero points, tscale: FP8 scales take the tscale of the bound
    max|last k-means input| + max|last centroids|, given as the kernels' compress finds it)."""
    x = clustered(1, 2, 72, 64, seed=7).to(x_dtype)
    p = qvg.compress(x, method, centroids=8, **opts)  # CPU: the torch reference path
    assert p.tensors["ids"].shape[0] == p.meta["stages"] >= 1
    want = {k: v for k, v in p.tensors.items() if k not in ("ids", "centroids")}
    spec = token_spec(p.meta)
    bound = None
    if spec.scale_dtype == "fp8" and spec.grid != "asym":
        m_in, m_c = _last_stage_maxima(x, p.tensors["ids"], p.tensors["centroids"])
        bound = (m_in.view(torch.int32).to(device), m_c.to(device))
    with poisoned():
        got = quantize_packed(x.to(device), spec, p.tensors["ids"].to(device),
                              p.tensors["centroids"].to(device), fused=fused, bound=bound)
    assert_matches_reference(got, want, f"{method} {opts}", device)


def _last_stage_maxima(x, ids, cents):
    """(max|BF16 input of the last stage's k-means|, max|its centroids|) per (batch, head), FP32 [B*H], the way
    qvg.compression.prq forms that input (x - the earlier stages' centroids, in FP32, then rounded to BF16)."""
    s_count, b, h, n = ids.shape
    r = x.float().reshape(b * h, n, -1)
    for s in range(s_count - 1):
        r = r - prq._gather(cents[s].reshape(b * h, -1, r.shape[-1]), ids[s].reshape(b * h, n))
    m_in = r.to(torch.bfloat16).abs().amax((1, 2)).float()
    return m_in, cents[s_count - 1].reshape(b * h, -1).abs().amax(1).float()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grid,bits", [(g, b) for g, b in SPECS if g != "asym"])
def test_quantize_with_bound_matches_reference(grid, bits, fused, device):
    """bound=(m_in, m_c): the tscale `bound_tscale(scale_bound(m_in, m_c))`, as the reference stores it given that
    tscale; bounds from the input's own maximum, above it (a loose centroid term) and, on the hard input's regimes
    (zero / tiny / wide heads), with tscale floored at TSCALE_MIN. Every stored scale stays finite and nonzero."""
    spec = QuantSpec(bits=bits, grid=grid, group=16, scale_dtype="fp8")
    x = _hard_input()
    m_in = x.to(torch.bfloat16).abs().amax((2, 3)).float().flatten()
    for m_c in (torch.zeros_like(m_in), m_in * 0.75 + 1e-3):
        want = quantize_packed_ref(x, spec, tscale=bound_tscale(scale_bound(m_in, m_c), spec).view(2, 2))
        with poisoned():
            got = quantize_packed(x.to(device), spec, fused=fused,
                                  bound=(m_in.view(torch.int32).to(device), m_c.to(device)))
        assert_matches_reference(got, want, f"{spec} m_c={m_c.tolist()}", device)
        s = decode_scale({k: v.cpu() for k, v in got.items()}, spec)
        assert torch.isfinite(s).all() and (s.abs() > 0).all()


def test_quantize_out_is_checked(device):
    """out= (fused) without the tscale an FP8 spec stores wrote it to scratch and lost it; a strided view was written
    past its own elements into the tensor it views."""
    from qvg.kernels.quantize import quantize_packed_outputs
    x = torch.randn(1, 2, 8, 32, generator=gen(0)).to(device)
    spec = QuantSpec(bits=2, group=16, grid="sym", scale_dtype="fp8")
    good = quantize_packed_outputs(1, 2, 8, 32, spec, device)
    with pytest.raises(ValueError, match=r"out must hold \['codes', 'scale', 'tscale'\], got \['codes', 'scale'\]"):
        quantize_packed(x, spec, fused=True, out={k: v for k, v in good.items() if k != "tscale"})
    big = torch.zeros(1, 2, 8, 16, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"out\['codes'\] must be a contiguous torch.uint8 tensor"):
        quantize_packed(x, spec, fused=True, out={**good, "codes": big[..., :8]})
    assert big.eq(0).all()
    got = quantize_packed(x, spec, fused=True, out=good)
    assert got is good and all(torch.equal(got[k], v) for k, v in quantize_packed(x, spec, fused=True).items())


def test_quantize_bound_needs_fp8_and_no_asym():
    x = torch.randn(1, 1, 8, 16)
    bound = (torch.zeros(1, dtype=torch.int32), torch.zeros(1))
    for spec in (QuantSpec(grid="asym"), QuantSpec(scale_dtype="bf16")):
        with pytest.raises(ValueError, match="needs FP8 scales"):
            quantize_packed(x, QuantSpec(**{**spec.to_meta(), "group": 16}), bound=bound)
        with pytest.raises(ValueError, match="needs FP8 scales"):
            quantize_packed_ref(x, QuantSpec(**{**spec.to_meta(), "group": 16}), tscale=torch.ones(1, 1))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grid,bits", [("sym", 2), ("midrise", 4), ("asym", 2), ("asym", 8)])
def test_quantize_subnormal_input(grid, bits, fused, device, request):
    """Inputs below FP32's smallest normal (~1e-40): the BF16 scales clamp at 2^-126, the asym zero point is the
    group minimum rounded down to (subnormal) BF16."""
    x = torch.randn(1, 2, 33, 64, generator=gen(11)) * 1e-40
    x[0, 1] *= 100.0  # ~1e-38: around the normal / subnormal boundary
    _check(x, QuantSpec(bits=bits, grid=grid, group=16, scale_dtype="bf16"), device, fused=fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares CPU and CUDA torch")
def test_tscale_is_device_independent():
    raw = torch.rand(4, 8, 64, 4, generator=gen(0)) * torch.logspace(-3, 3, 8)[None, :, None, None]
    assert torch.equal(raw_bits(tensor_scale(raw.cuda())), raw_bits(tensor_scale(raw)))


@pytest.mark.parametrize("span", [True, "recode", "narrow", "narrow-recode"])
@pytest.mark.parametrize("grid,bits,group,d", [
    ("auto", 2, 64, 128), ("auto", 2, 16, 128), ("auto", 4, 64, 128), ("auto", 1, 32, 64), ("auto", 8, 16, 64),
    ("sym", 2, 64, 128), ("sym", 4, 16, 64), ("midrise", 2, 32, 64), ("midrise", 1, 16, 64), ("auto", 4, 128, 128)])
@pytest.mark.parametrize("stages,x_dtype", [(0, torch.float32), (1, torch.float32), (3, torch.float32),
                                            (1, torch.bfloat16)])
def test_span_pack_matches_reference(span, grid, bits, group, d, stages, x_dtype, device):
    """quantize_packed(span=...): one thread per group span (kernels/pack_span.py) stores the reference's bits, for
    the PRQ residual of 0, 1 or 3 stages, with the tscale of a pass over x (hmax) and of a bound; N = 70 leaves the
    last token block ragged. The hard input (heads of zeros / tiny / wide values, a constant row on the group max)
    checks the dropped code clamps."""
    from qvg.kernels.pack_span import span_width
    assert span_width(d, bits, group, narrow="narrow" in str(span))
    spec = QuantSpec(bits=bits, grid=grid, group=group, scale_dtype="fp8")
    n, k = 70, 5
    x = torch.cat([_hard_input(n, d, seed=1), varied(2, 2, n, d, seed=2)], 0).to(x_dtype)  # [4, 2, N, D]
    g = gen(3)
    ids = torch.randint(0, k, (stages, 4, 2, n), generator=g).to(torch.uint8)
    cents = (torch.randn(stages, 4, 2, k, d, generator=g) * 0.3).to(torch.bfloat16)
    r = x.float()
    for st in range(stages):
        r = r - prq._gather(cents[st].reshape(8, k, d), ids[st].reshape(8, n).long()).view(4, 2, n, d)
    for bound in (None, (r.abs().amax((2, 3)).flatten(), torch.zeros(8))):
        ts = None if bound is None else bound_tscale(scale_bound(*bound), spec).view(4, 2)
        want = quantize_packed_ref(r, spec, tscale=ts)
        dev_bound = None if bound is None else (bound[0].view(torch.int32).to(device), bound[1].to(device))
        with poisoned():
            got = quantize_packed(x.to(device), spec, ids.to(device) if stages else None,
                                  cents.to(device) if stages else None, fused=True, bound=dev_bound, span=span)
        assert_matches_reference(got, want, f"{spec} stages={stages} bound={bound is not None}", device)


@pytest.mark.parametrize("span", [True, "recode", "narrow"])
@pytest.mark.parametrize("grid,bits", [("sym", 2), ("sym", 4), ("auto", 2), ("auto", 4), ("midrise", 2)])
def test_span_pack_exact_ties(span, grid, bits, device):
    """Values exactly halfway between two levels (BF16 scales make s exact: max|x| = 2^(b-1) - 1 gives s = 1), where
    round-half-to-even matters: the span kernel's codes are the reference's."""
    lim = 2 ** (bits - 1) - 1
    g = gen(9)
    halves = (torch.randint(-lim, lim, (4, 3, 40, 64), generator=g) + 0.5).float()
    halves[..., 0] = lim  # each group's max: s = 1 (sym), 1 / 1.5 * lim... (midrise, exact in BF16 at lim = 1)
    _check(halves, QuantSpec(bits=bits, grid=grid, group=64, scale_dtype="bf16"), device, fused=True, span=span,
           what="ties")


@pytest.mark.parametrize("span", [True, "narrow"])
@pytest.mark.parametrize("grid,bits", [("midrise", 2), ("auto", 2), ("auto", 4)])
def test_span_pack_subnormal_ratios(span, grid, bits, device):
    """Groups whose max is ~1e10 holding values ~-1e-34: x / s is a negative subnormal, whose floor is -1 (a
    flush-to-zero add would make it 0); the codes are the reference's."""
    x = torch.randn(1, 2, 40, 64, generator=gen(4))
    x[..., 0] = 3e10
    x[..., 1::7] = -1.5e-34
    x[..., 2::7] = 1.5e-34
    _check(x, QuantSpec(bits=bits, grid=grid, group=64, scale_dtype="fp8"), device, fused=True, span=span,
           what="subnormal ratios")


@pytest.mark.parametrize("span", [True, "narrow"])
def test_span_pack_contains_a_nan(span, device):
    """A NaN in one group (with a finite tscale bound given) garbles that group's codes only: every other group of
    the head, the same token's included, is packed as the reference packs it."""
    spec = QuantSpec(bits=2, grid="auto", group=32, scale_dtype="fp8")
    x = varied(1, 1, 40, 128, seed=6)
    bound = (x.abs().amax((2, 3)).flatten(), torch.zeros(1))
    want = quantize_packed_ref(x, spec, tscale=bound_tscale(scale_bound(*bound), spec).view(1, 1))
    x[0, 0, 5, 40] = float("nan")  # token 5, group 1 (columns 32..63): plane 1, bytes 8..31
    with poisoned():
        got = quantize_packed(x.to(device), spec, fused=True, span=span,
                              bound=(bound[0].view(torch.int32).to(device), bound[1].to(device)))
    codes = unpack(got["codes"].cpu(), 2, 128)
    ref_codes = unpack(want["codes"], 2, 128)
    keep = torch.ones(40, 128, dtype=torch.bool)
    keep[5, 32:64] = False
    assert torch.equal(codes[0, 0][keep], ref_codes[0, 0][keep])
    scale_keep = torch.ones(40, 4, dtype=torch.bool)
    scale_keep[5, 1] = False
    assert torch.equal(got["scale"].cpu().view(torch.uint8)[0, 0][scale_keep],
                       want["scale"].view(torch.uint8)[0, 0][scale_keep])


def test_span_width():
    from qvg.kernels.pack_span import span_width
    assert span_width(128, 2, 64) == 64 and span_width(128, 2, 16) == 32 and span_width(128, 8, 16) == 128
    assert span_width(128, 4, 128) == 128 and span_width(64, 1, 16) == 16
    assert span_width(128, 2, 4) == 0  # groups under 8 columns: the default kernel
    assert span_width(96, 2, 32) == 0  # D not a multiple of a power-of-two span
    assert span_width(128, 2, 64, narrow=True) == 32 and span_width(128, 1, 128, narrow=True) == 16
    assert span_width(128, 4, 64, narrow=True) == 64  # (a group no wider than a plane: as without narrow)


@triton.jit
def _round_floor_kernel(t_ptr, rq_ptr, ri_ptr, fq_ptr, fi_ptr, n, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    t = tl.load(t_ptr + i, mask=m)
    u = t + 12582912.0  # the span pack's sym codes: rounded to nearest even
    v = add_floor(t, 12582912.0, INTERP)  # ... its midrise codes: rounded down
    tl.store(rq_ptr + i, u - 12582912.0, mask=m)
    tl.store(ri_ptr + i, u.to(tl.int32, bitcast=True) - 0x4B400000, mask=m)
    tl.store(fq_ptr + i, v - 12582912.0, mask=m)
    tl.store(fi_ptr + i, v.to(tl.int32, bitcast=True) - 0x4B400000, mask=m)


def test_magic_round_and_floor(device):
    """The span pack's codes: t + 1.5 * 2^23 rounds t to nearest even and `add_floor` toward -inf, the integer read
    off the sum's bits; against torch.round / torch.floor on ties, integers, their FP32 neighbours, tiny, large and
    random values (|t| < 2^22)."""
    base = torch.tensor([0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 1.0, -1.0, 3.0, -7.0, 127.0, -128.0, 1e-30,
                         -1e-30, 0.49999997, -0.49999997, 4194303.5, -4194303.5, 4194302.5, 1234.5678])
    t = torch.cat([base, torch.nextafter(base, torch.full_like(base, 1e9)),
                   torch.nextafter(base, torch.full_like(base, -1e9)), torch.randn(200, generator=gen(1)) * 100])
    t = t[t.abs() < 2 ** 22]
    out = [torch.empty_like(t), torch.empty(t.shape, dtype=torch.int32), torch.empty_like(t),
           torch.empty(t.shape, dtype=torch.int32)]
    dev = [o.to(device) for o in out]
    _round_floor_kernel[(1,)](t.to(device), *dev, t.numel(), BLOCK=triton.next_power_of_2(t.numel()),
                              INTERP=device == "cpu")
    rq, ri, fq, fi = (o.cpu() for o in dev)
    assert torch.equal(rq, torch.round(t)) and torch.equal(ri, torch.round(t).int())
    assert torch.equal(fq, torch.floor(t)) and torch.equal(fi, torch.floor(t).int())


def _scale_rounding_edges(div: float, signed: bool) -> torch.Tensor:
    """[1, 1, N, 64] fp32, a token per edge case of the stored FP8 scale for a grid whose scale is the range / div
    (auto: its sym candidate's): raw scale / tscale (tscale 1, set by the last token) at E4M3's exact ties in every
    normal binade (to even: down and up), their FP32 neighbours, around the subnormal boundary 2^-6 and the clamp
    2^-9, and just under 448 (rounds to 448 = 0x7E)."""
    e = torch.arange(-6, 9).float()[:, None]
    m = torch.arange(8).float()[None, :]
    ties = (2.0 ** e * (1 + m / 8 + 1 / 16)).flatten()
    ties = ties[ties < 448]
    q = torch.cat([ties, ties * (1 - 2.0 ** -23), ties * (1 + 2.0 ** -23),
                   torch.tensor([2.0 ** -6, 2.0 ** -6 * (1 - 2.0 ** -12), 2.0 ** -6 * (1 + 2.0 ** -20), 1.5 * 2.0 ** -9,
                                 0.7 * 2.0 ** -9, 3 * 2.0 ** -10, 447.5, 448 * (1 - 2.0 ** -12)])])
    amax = q * div
    x = torch.rand(1, 1, q.numel(), 64, generator=gen(12)) * amax[:, None]
    x[..., 0] = amax
    x[..., 1] = 0.0  # unsigned (asym): zero point 0, range amax
    if signed:
        x[..., 2::2] *= -1
    return x


@pytest.mark.parametrize("path", ["two-pass", "fused", "span"])
@pytest.mark.parametrize("grid,bits", [("sym", 2), ("sym", 4), ("sym", 8), ("midrise", 1), ("midrise", 2),
                                       ("midrise", 4), ("midrise", 8), ("auto", 1), ("auto", 2), ("auto", 4),
                                       ("auto", 8), ("asym", 1), ("asym", 2), ("asym", 4)])
def test_quantize_fp8_scale_rounding_edges(grid, bits, path, device):
    """The stored FP8 scale's rounding (`kernels/encode.py` `_fp8_bits`: integer ops; the reference: torch's own
    cast, to nearest even, or rounded up) on its edge cases, bitwise the reference's, and the dropped code clamps of
    the span pack hold there (codes bitwise too)."""
    if path == "span" and grid == "asym":
        pytest.skip("the span pack has no asym grid")
    half = 2 ** (bits - 1)
    div = {"sym": half - 1, "midrise": half - 0.5, "auto": half - 1 if bits > 1 else 0.5, "asym": 2 ** bits - 1}[grid]
    x = _scale_rounding_edges(div, signed=grid != "asym")
    spec = QuantSpec(bits=bits, grid=grid, group=64, scale_dtype="fp8")
    assert torch.equal(quantize_packed_ref(x, spec)["tscale"], torch.ones(1, 1))  # the edges sit where intended
    _check(x, spec, device, fused=path != "two-pass",
           span=path == "span", what=path)
