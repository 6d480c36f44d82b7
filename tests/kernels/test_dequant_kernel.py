"""qvg.kernels.dequant.dequantize (Triton) against qvg.decompress / PackedSequence.decompress computed by the
torch path (packs are made and decoded on the CPU, where qvg always uses torch): bitwise equal output."""
import pytest
import torch
import triton
import triton.language as tl

import qvg
from qvg.compression import seeded
from kernel_helpers import assert_bitwise_equal, clustered, gen, poisoned, varied
from qvg.kernels import common
from qvg.kernels.dequant import dequantize
from qvg.packed import Packed
from qvg.sequence import PackedSequence

CASES = [  # method, options (every grid explicit: the method presets may change), original dtype, row block
    ("rtn", {"grid": "midrise"}, torch.bfloat16, 64),  # N = 72: two row blocks, the last ragged
    ("rtn", {"bits": 4, "grid": "sym", "scale_dtype": "bf16"}, torch.float32, 16),  # five, the last ragged
    ("rtn", {"bits": 1, "grid": "asym", "block_size": 16}, torch.bfloat16, 64),
    ("rtn", {"bits": 8, "grid": "asym", "scale_dtype": "bf16"}, torch.float32, 16),
    ("qvg", {"centroids": 8, "grid": "midrise"}, torch.bfloat16, 64),
    ("qvg", {"centroids": 8, "bits": 4, "grid": "sym", "scale_dtype": "bf16"}, torch.float32, 16),
    ("qvg", {"centroids": 8, "grid": "asym", "block_size": 32}, torch.bfloat16, 64),
    ("qvg", {"centroids": 8, "bits": 1, "block_size": 16, "grid": "midrise"}, torch.float32, 16),
    ("qvg-pro", {"centroids": 8, "grid": "midrise"}, torch.bfloat16, 64),
    ("qvg-pro", {"centroids": 8, "bits": 8, "grid": "sym"}, torch.float32, 16),
    ("qvg-pro", {"centroids": 8, "bits": 2, "grid": "asym", "scale_dtype": "bf16"}, torch.float32, 64),
    # stage counts around the kernel's first four (each id loaded once per block) and past them (loaded per plane)
    ("qvg-pro", {"centroids": 8, "stages": 2, "block_size": 16}, torch.bfloat16, 16),
    ("qvg-pro", {"centroids": 8, "stages": 3, "bits": 4}, torch.bfloat16, 64),
    ("qvg-pro", {"centroids": 8, "stages": 6, "block_size": 16}, torch.bfloat16, 16),
]


def _pack(method, opts, dtype, seed=0, n=72):
    x = clustered(1, 2, n, 64, seed=seed) + 0.1 * varied(1, 2, n, 64, seed=seed + 100)
    return qvg.compress(x.to(dtype), method, **seeded(method, seed), **opts)


def _nan_like(ref: torch.Tensor, device: str) -> torch.Tensor:
    return torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=device)


@pytest.mark.parametrize("method,opts,dtype,block_n", CASES)
def test_dequantize_matches_decompress(method, opts, dtype, block_n, device):
    p = _pack(method, opts, dtype)
    ref = qvg.decompress(p)  # CPU: the torch path
    assert ref.dtype == dtype
    pd = p.to(device)
    out = _nan_like(ref, device)
    got = dequantize(pd, out=out, block_n=block_n)
    assert got.data_ptr() == out.data_ptr()
    assert_bitwise_equal(got, ref, f"{method} {opts} out=")
    with poisoned():
        got2 = dequantize(pd, block_n=block_n)
    assert_bitwise_equal(got2, ref, f"{method} {opts} allocated")


@pytest.mark.parametrize("method,opts", [("rtn", {"grid": "midrise"}), ("rtn", {"grid": "auto", "bits": 4}),
                                         ("rtn", {"grid": "midrise", "bits": 4}),
                                         ("qvg-pro", {"centroids": 8, "grid": "midrise"})])
def test_dequantize_float16_near_its_max_saturates_as_the_reference(method, opts, device):
    """A float16 input up to 65,472 decodes past 65,504 where a level lies above the group's max (midrise's top
    level, its scale rounded up: INT4, max 65,472 = 7.5 x 32 x 272.8 -> 7.5 x 32 x 288 = 69,120; INT2: 1.5 x 128 x
    341 -> 352): the kernel saturates as the torch path does (`qvg.quant.to_dtype`), not to inf."""
    x = clustered(1, 2, 72, 64, seed=5)
    p = qvg.compress((x / x.abs().amax() * 65472).half(), method, **seeded(method, 5), **opts)
    ref = qvg.decompress(p)
    assert ref.dtype == torch.float16 and bool(torch.isfinite(ref).all())
    assert (ref.abs().amax().item() == 65504) is (method == "rtn")  # (saturated there; qvg-pro's residual fits)
    assert_bitwise_equal(dequantize(p.to(device), out=_nan_like(ref, device)), ref, f"{method} {opts}")
    x[0, 0, 3, 5] = float("nan")  # unchecked (as the cache commits): NaN stays NaN in both, not -65504
    p = qvg.compress((x / 65000).half(), method, check_finite=False, **seeded(method, 5), **opts)
    ref = qvg.decompress(p)
    assert bool(ref.isnan().any())
    got = dequantize(p.to(device), out=torch.full_like(ref, 12345.0, device=device))  # (poison: not a decoded value)
    assert torch.equal(got.isnan().cpu(), ref.isnan()) and torch.equal(got.nan_to_num().cpu(), ref.nan_to_num())


@pytest.mark.parametrize("method", ["rtn", "qvg", "qvg-pro"])
def test_dequantize_method_presets(method, device):
    """The methods' current preset options (whatever they are) go through the kernel."""
    p = _pack(method, {} if method == "rtn" else {"centroids": 8}, torch.bfloat16)
    ref = qvg.decompress(p)
    assert_bitwise_equal(dequantize(p.to(device), out=_nan_like(ref, device)), ref, f"{method} presets")


def test_dequantize_uint16_ids(device):
    """K = 300 centroids: uint16 ids."""
    p = _pack("qvg", {"centroids": 300, "iters": 1, "grid": "midrise"}, torch.bfloat16, n=320)
    assert p.tensors["ids"].dtype == torch.uint16
    ref = qvg.decompress(p)
    assert_bitwise_equal(dequantize(p.to(device), out=_nan_like(ref, device)), ref, "K=300")


def test_dequantize_refuses_rows_outside_the_tokens(device):
    """(a range past N read the next head's tokens, a negative one before the buffer)"""
    p = qvg.compress(torch.randn(1, 2, 24, 32, generator=gen(0)), "qvg", stages=1, centroids=4, block_size=16)
    p = p.to(device)
    for rows in ((20, 30), (-4, 4), (10, 5)):
        with pytest.raises(ValueError, match=r"rows must be a token range 0 <= r0 <= r1 <= 24"):
            dequantize(p, rows=rows)
    assert torch.equal(dequantize(p, rows=(20, 24)).cpu(), qvg.decompress(p.to("cpu"))[:, :, 20:24])


def test_dequantize_rejects_other_methods():
    p = qvg.compress(torch.randn(1, 1, 32, 64, generator=gen(0)), "kivi")
    with pytest.raises(ValueError, match="fused dequant kernel"):
        dequantize(p)


# --- PackedSequence -----------------------------------------------------------------------------------------------

SEQ_CASES = [("qvg", {"centroids": 8, "grid": "midrise"}, torch.bfloat16),
             ("qvg-pro", {"centroids": 8, "bits": 4, "grid": "sym"}, torch.bfloat16),
             ("rtn", {"scale_dtype": "bf16", "bits": 4, "grid": "midrise"}, torch.float32),
             ("rtn", {"scale_dtype": "bf16", "grid": "asym"}, torch.float32),
             ("qvg-pro", {"centroids": 8, "stages": 6, "block_size": 16}, torch.bfloat16)]  # ids past the 4th stage
L = 40  # tokens per chunk, not a multiple of the row block


@pytest.fixture(scope="module", params=SEQ_CASES, ids=["qvg", "qvg-pro-sym4", "rtn-bf16", "rtn-asym", "qvg-pro-s6"])
def sequence(request):
    method, opts, dtype = request.param
    chunks = [_pack(method, opts, dtype, seed=s, n=L) for s in (1, 2, 3)]
    seq = PackedSequence.from_chunks(chunks)
    ref = torch.cat([qvg.decompress(c) for c in chunks], 2)
    return seq, ref


def _seq_to(seq: PackedSequence, device: str) -> PackedSequence:
    return PackedSequence({k: v.to(device) for k, v in seq.tensors.items()}, seq.spec, seq.stages, seq.chunk_len,
                          seq.dtype)


def test_sequence_dequantize_whole(sequence, device):
    seq, ref = sequence
    assert_bitwise_equal(seq.decompress(), ref, "PackedSequence.decompress vs chunks")
    with poisoned():
        got = dequantize(_seq_to(seq, device), block_n=16)
    assert_bitwise_equal(got, ref, "kernel vs chunks")


@pytest.mark.parametrize("rows", [(0, 120), (10, 50), (35, 117), (80, 120), (39, 41), (119, 120), (0, 1),
                                  (5, 115), (40, 80)])
def test_sequence_dequantize_rows(sequence, rows, device):
    seq, ref = sequence
    r0, r1 = rows
    want = ref[:, :, r0:r1]
    seq_d = _seq_to(seq, device)
    got = dequantize(seq_d, out=_nan_like(want, device), rows=rows, block_n=16)
    assert_bitwise_equal(got, want, f"rows {rows}")
    with poisoned():
        got = dequantize(seq_d, rows=rows)
    assert_bitwise_equal(got, want, f"rows {rows} (allocated, block 64)")


@pytest.mark.parametrize("grid", [dict(progs=1), dict(progs=2, plane_split=True), dict(plane_split=True),
                                  dict(progs=3, plane_split=True, block_n=16)])
@pytest.mark.parametrize("rows", [(0, 120), (35, 117)])
def test_sequence_dequantize_grids(sequence, rows, grid, device):
    """Persistent programs and one program per code plane write the same bits as the default grid."""
    seq, ref = sequence
    want = ref[:, :, rows[0]:rows[1]]
    got = dequantize(_seq_to(seq, device), out=_nan_like(want, device), rows=rows, **grid)
    assert_bitwise_equal(got, want, f"rows {rows} {grid}")


@pytest.mark.parametrize("grid", [dict(), dict(plane_split=True), dict(block_n=16, progs=2)])
@pytest.mark.parametrize("rows", [(0, 120), (35, 117)])
def test_sequence_dequantize_rope_matches_reference(sequence, rows, grid, device):
    """Keys stored before RoPE, rotated as they are decoded (factorized tables), bitwise equal to the torch path's
    decode then `apply_rope` (PackedSequence.decompress(rope)), on three grids (one program per block, one per
    code plane, persistent)."""
    from qvg.rope import RopeTables
    seq, _ = sequence
    rope = RopeTables(4, 5, 64, torch.tensor([0, 2, 9]), max_frames=12)  # 2 frames of 4 x 5 tokens per chunk (L)
    want = seq.decompress(rope)[:, :, rows[0]:rows[1]]
    rope_d = RopeTables(4, 5, 64, torch.tensor([0, 2, 9], device=device), max_frames=12)
    got = dequantize(_seq_to(seq, device), out=_nan_like(want, device), rows=rows, rope=rope_d, **grid)
    assert_bitwise_equal(got, want, f"rope rows {rows} {grid}")


@pytest.mark.parametrize("rows", [(0, 120), (35, 117)])
def test_sequence_dequantize_rope_with_spatial_offsets(sequence, rows, device):
    """Per-frame positions with spatial offsets both ways and times out of step, one before 0 (a panning camera):
    the kernel's rotation is bitwise the torch path's (decode, then `apply_rope` by `frame_angles` of them)."""
    from qvg.rope import RopeTables, apply_rope, frame_angles
    seq, _ = sequence
    pos = torch.tensor([[[-2, 0, 0], [1, -2, 3]], [[5, 1, -4], [4, 2, 0]], [[9, 0, 7], [10, -1, 7]]])
    rope = RopeTables(4, 5, 64, positions=pos)
    want = seq.decompress(rope)[:, :, rows[0]:rows[1]]
    exact = apply_rope(seq.decompress(dtype=torch.float32), frame_angles(pos, 4, 5, 64).reshape(-1, 32)).to(want.dtype)
    assert torch.equal(want, exact[:, :, rows[0]:rows[1]])  # (the reference rotates by those positions)
    rope_d = RopeTables(4, 5, 64, positions=pos.to(device))
    got = dequantize(_seq_to(seq, device), out=_nan_like(want, device), rows=rows, rope=rope_d)
    assert_bitwise_equal(got, want, f"rope with offsets, rows {rows}")


@pytest.mark.parametrize("method,opts", [("qvg", {"centroids": 8, "bits": 1, "block_size": 16, "grid": "midrise"}),
                                         ("qvg-pro", {"centroids": 8, "bits": 8, "grid": "sym"})])
def test_sequence_dequantize_rope_1_and_8_bits(method, opts, device):
    """Pre-RoPE keys at 1 bit (8 planes, stored plane by plane) and 8 bits (one plane), bitwise equal to the torch
    path's decode then `apply_rope`."""
    from qvg.rope import RopeTables
    seq = PackedSequence.from_chunks([_pack(method, opts, torch.bfloat16, seed=s, n=L) for s in (1, 2, 3)])
    want = seq.decompress(RopeTables(4, 5, 64, torch.tensor([0, 2, 9]), max_frames=12))
    rope_d = RopeTables(4, 5, 64, torch.tensor([0, 2, 9], device=device), max_frames=12)
    got = dequantize(_seq_to(seq, device), out=_nan_like(want, device), rope=rope_d, block_n=16)
    assert_bitwise_equal(got, want, f"rope {method} {opts}")


@pytest.mark.parametrize("method,opts,dtype,block_n", CASES)
def test_dequantize_plane_split_matches_decompress(method, opts, dtype, block_n, device):
    """One program per code plane (1, 2, 4 and 8 planes: 8, 4, 2 and 1 bits) writes the same bits."""
    p = _pack(method, opts, dtype)
    ref = qvg.decompress(p)
    got = dequantize(p.to(device), out=_nan_like(ref, device), block_n=block_n, plane_split=True)
    assert_bitwise_equal(got, ref, f"{method} {opts} plane_split")


# --- every stored scale value ---------------------------------------------------------------------------------------

def test_all_fp8_scale_bytes_through_dequant(device):
    """An 8-bit rtn pack by hand whose token t has FP8 scale byte t (all 256 E4M3 encodings: 254 values and the
    two NaNs 0x7F / 0xFF, which a real pack never stores) and codes 0 / 255 / 128 (levels -127.5, +127.5, +0.5),
    decoded to fp32: the 254 non-NaN scales give exactly the torch result."""
    shape = (1, 1, 256, 16)
    o = qvg.compress(torch.ones(shape), "rtn", bits=8, block_size=16, grid="midrise", scale_dtype="fp8").meta
    codes = torch.tensor([0, 255, 128, 255] * 4, dtype=torch.uint8).expand(1, 1, 256, 16).contiguous()
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(1, 1, 256, 1)
    p = Packed("rtn", shape, torch.float32, {"codes": codes, "scale": scale, "tscale": torch.tensor([[0.375]])}, o)
    ref = qvg.decompress(p)
    got = dequantize(p.to(device), out=torch.full(shape, 7.0, device=device)).cpu()
    finite = torch.isfinite(ref[0, 0, :, 0])
    assert int(finite.sum()) == 254 and not finite[0x7F] and not finite[0xFF]
    assert int((ref[0, 0, finite] == 0).all(-1).sum()) == 2  # only +-0 (0x00, 0x80) decode to a zero scale
    assert_bitwise_equal(got[0, 0, finite], ref[0, 0, finite], "fp8 byte sweep")


@triton.jit
def _decode_kernel(raw_ptr, out_ptr, tscale, N, FP8: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    tl.store(out_ptr + i, common.decode_scale(tl.load(raw_ptr + i, mask=m, other=0), tscale, FP8), mask=m)


def _decode(raw: torch.Tensor, fp8: bool, ts: float, device: str) -> torch.Tensor:
    out = torch.full(raw.shape, 7.0, device=device)
    _decode_kernel[(triton.cdiv(raw.numel(), 1024),)](raw.to(device), out, ts, raw.numel(), FP8=fp8, BLOCK=1024)
    return out.cpu()


@triton.jit
def _codes_kernel(c_ptr, s_ptr, z_ptr, out_ptr, N, OFFSET: tl.constexpr, GRID: tl.constexpr, NO_I2F: tl.constexpr,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    v = common.dequant_codes(tl.load(c_ptr + i, mask=m, other=0), tl.load(s_ptr + i, mask=m, other=1.0),
                             tl.load(z_ptr + i, mask=m, other=0.0), OFFSET, GRID, NO_I2F)
    tl.store(out_ptr + i, v, mask=m)


@pytest.mark.parametrize("grid,offset", [(0, 0.0), (0, 1.0), (0, 7.0), (0, 127.0), (1, 0.5), (1, 1.5), (1, 7.5),
                                         (1, 127.5), (2, 0.0), (3, 0.0), (3, 1.0), (3, 7.0), (3, 127.0)])
def test_dequant_codes_without_i2f(grid, offset, device):
    """dequant_codes' NO_I2F form (float(c) - offset from the code's bits as a mantissa) = the I2F form, bit for bit,
    for every code byte with positive and negative (auto: midrise-flagged) scales."""
    c = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2)
    s = torch.cat([torch.full((256,), 0.37), torch.full((256,), -1.7e-3)])
    z = torch.randn(512, generator=gen(4))
    outs = []
    for flag in (False, True):
        out = torch.full((512,), float("nan"), device=device)
        _codes_kernel[(1,)](c.to(device), s.to(device), z.to(device), out, 512, OFFSET=offset, GRID=grid,
                            NO_I2F=flag, BLOCK=512)
        outs.append(out.cpu())
    assert_bitwise_equal(outs[1], outs[0], f"grid {grid} offset {offset}")
    assert not torch.isnan(outs[1]).any()


FP8_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
BF16_BITS = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
INTERPRETER_ONLY = pytest.mark.xfail(common.INTERPRET, strict=True, reason="Triton interpreter bug (compiled "
                                     "kernels on the GPU are right)")


def test_decode_scale_fp8_values(device):
    """common.decode_scale on the 254 non-NaN FP8 E4M3 bytes (x tscale) = torch's decoding, bit for bit."""
    want = FP8_BYTES.view(torch.float8_e4m3fn).float() * 0.375
    keep = ~torch.isnan(want)
    assert int(keep.sum()) == 254
    assert_bitwise_equal(_decode(FP8_BYTES, True, 0.375, device)[keep], want[keep], "fp8")


@INTERPRETER_ONLY
def test_decode_scale_fp8_nan(device):
    """0x7F / 0xFF are E4M3's NaNs (the interpreter decodes them as +-480, as if E4M3 had no NaN encoding)."""
    got = _decode(FP8_BYTES, True, 0.375, device)
    assert torch.isnan(got[[0x7F, 0xFF]]).all()


def _bf16_subnormal(bits: torch.Tensor) -> torch.Tensor:
    v = bits.view(torch.bfloat16).float()
    return (v != 0) & (v.abs() < 2.0 ** -126)


def test_decode_scale_bf16_values(device):
    """common.decode_scale on every BF16 bit pattern except subnormals (zeros, normals, infs, NaNs)."""
    want = BF16_BITS.view(torch.bfloat16).float()
    got = _decode(BF16_BITS, False, 1.0, device)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    keep = ~nan & ~_bf16_subnormal(BF16_BITS)
    assert int(keep.sum()) == 65536 - 2 * 127 - 2 * 127
    assert_bitwise_equal(got[keep], want[keep], "bf16")


def test_decode_scale_bf16_subnormals(device):
    sub = _bf16_subnormal(BF16_BITS)
    assert int(sub.sum()) == 254
    want = BF16_BITS.view(torch.bfloat16).float()
    assert_bitwise_equal(_decode(BF16_BITS, False, 1.0, device)[sub], want[sub], "bf16 subnormals")


def test_rope_tables_that_do_not_fit_are_refused(sequence, device):
    """Tables for another head dim, another frame size, fewer slots than chunks, other frames per chunk, or on
    another device: one clear error before any launch (the kernel would rotate by the wrong rows or read past the
    tables). The history: 3 chunks of 40 tokens, head dim 64."""
    from qvg.rope import RopeTables
    seq = _seq_to(sequence[0], device)
    frame0 = torch.tensor([0, 2, 9], device=device)
    pos = torch.zeros(3, 2, 3, dtype=torch.int32, device=device)
    cases = [(RopeTables(4, 5, 32, frame0, 12), "head dim 64, the tables' 32"),
             (RopeTables(3, 5, 64, frame0, 12), "40 tokens per chunk are not whole 3 x 5 frames"),
             (RopeTables(4, 5, 64, frame0[:2], 12), "3 chunks, the tables hold 2 slots"),
             (RopeTables(2, 5, 64, positions=pos), "4 frames per chunk, the positions hold 2")]
    if device != "cpu":
        cases.append((RopeTables(4, 5, 64, frame0.cpu(), 12), "the tables are on cpu"))
    for rope, why in cases:
        with pytest.raises(ValueError, match=why):
            dequantize(seq, rope=rope)


def test_out_must_be_a_contiguous_big_enough_buffer(sequence, device):
    """The kernel writes row-major [B * H, out rows, D] from out's first element: a strided or short `out` is
    refused with one clear error (it would be written in the wrong layout or out of bounds)."""
    seq = _seq_to(sequence[0], device)
    b, h, n, d = seq.shape
    good = torch.empty(b, h, n + 2, d, dtype=seq.dtype, device=device)
    for bad in (good[:, :, :n], good[:, :, :n - 1], good.transpose(2, 3), good[:, :1]):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            dequantize(seq, out=bad)
    assert_bitwise_equal(dequantize(seq, out=good)[:, :, :n], sequence[1], "rows 0..n of a longer buffer")
