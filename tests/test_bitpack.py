"""qvg.bitpack: planar packing of 1/2/4/8-bit codes into uint8 rows."""
import pytest
import torch

from conftest import gen, random_shapes
from qvg.bitpack import SUPPORTED_BITS, pack, packed_width, unpack


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("seed", range(4))
def test_round_trip_exact(bits, seed):
    planes = 8 // bits
    for b, h, n, _ in random_shapes(seed, 3):
        d = planes * (1 + seed * 7 % 13)  # any multiple of the plane count, not only powers of two
        codes = torch.randint(0, 2 ** bits, (b, h, n, d), generator=gen(seed), dtype=torch.uint8)
        p = pack(codes, bits)
        assert p.dtype == torch.uint8
        assert p.shape == (b, h, n, d * bits // 8)
        out = unpack(p, bits, d)
        assert out.dtype == torch.uint8
        assert torch.equal(out, codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_round_trip_extreme_codes(bits):
    for v in (0, 2 ** bits - 1):
        codes = torch.full((3, 64), v, dtype=torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits, 64), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_accepts_wider_int_dtypes(bits):
    codes = torch.randint(0, 2 ** bits, (5, 16), generator=gen(1))  # int64
    assert torch.equal(unpack(pack(codes, bits), bits).long(), codes)


def _reference_pack(row: list[int], bits: int) -> list[int]:
    """The documented layout, written out by hand: byte w holds codes w, w+W, w+2W, ... from the low bits up."""
    w = len(row) * bits // 8
    out = []
    for byte in range(w):
        v = 0
        for p in range(8 // bits):
            v |= row[byte + p * w] << (bits * p)
        out.append(v)
    return out


def test_planar_layout_hand_example_2bit():
    # D = 8 codes of 2 bits -> W = 2 bytes; byte 0 = codes 0, 2, 4, 6; byte 1 = codes 1, 3, 5, 7 (low bits first).
    row = [1, 2, 3, 0, 2, 1, 0, 3]
    byte0 = 1 | (3 << 2) | (2 << 4) | (0 << 6)
    byte1 = 2 | (0 << 2) | (1 << 4) | (3 << 6)
    assert pack(torch.tensor([row]), 2).tolist() == [[byte0, byte1]] == [[0x2D, 0xD2]]


def test_planar_layout_hand_example_4bit():
    # D = 4 codes of 4 bits -> W = 2: byte 0 = code 0 | code 2 << 4, byte 1 = code 1 | code 3 << 4.
    assert pack(torch.tensor([[0x1, 0x2, 0xA, 0xF]]), 4).tolist() == [[0xA1, 0xF2]]


def test_planar_layout_hand_example_1bit():
    # D = 16 codes of 1 bit -> W = 2: byte 0 holds even codes 0, 2, ..., 14 as bits 0..7; byte 1 the odd ones.
    row = [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1]
    #        even codes (0,2,..,14): 1,0,1,0,0,0,0,1 -> 0b10000101; odd codes (1,3,..,15): 0,0,1,0,0,1,0,1 -> 0b10100100
    assert pack(torch.tensor([row]), 1).tolist() == [[0b10000101, 0b10100100]]
    assert pack(torch.tensor([row]), 1).tolist() == [_reference_pack(row, 1)]


@pytest.mark.parametrize("bits", (1, 2, 4))
def test_planar_layout_matches_reference(bits):
    d = 8 * 6
    codes = torch.randint(0, 2 ** bits, (7, d), generator=gen(bits))
    got = pack(codes, bits).tolist()
    assert got == [_reference_pack(r, bits) for r in codes.tolist()]


@pytest.mark.parametrize("bits", (1, 2, 4))
def test_planes_unpack_by_shift_and_mask(bits):
    """The point of the layout: shifting the whole row by b*p and masking yields codes [p*W, (p+1)*W)."""
    d = 64
    w = d * bits // 8
    codes = torch.randint(0, 2 ** bits, (3, d), generator=gen(10 + bits), dtype=torch.uint8)
    p = pack(codes, bits)
    for plane in range(8 // bits):
        assert torch.equal((p >> (bits * plane)) & (2 ** bits - 1), codes[:, plane * w:(plane + 1) * w])


def test_8bit_is_identity():
    codes = torch.randint(0, 256, (2, 3, 5), generator=gen(0), dtype=torch.uint8)
    assert torch.equal(pack(codes, 8), codes)
    assert torch.equal(unpack(codes, 8), codes)


@pytest.mark.parametrize("d,bits,width", [(8, 1, 1), (64, 1, 8), (64, 2, 16), (64, 4, 32), (64, 8, 64),
                                          (128, 2, 32), (4, 2, 1), (2, 4, 1), (24, 1, 3)])
def test_packed_width(d, bits, width):
    assert packed_width(d, bits) == width
    assert pack(torch.zeros(1, d, dtype=torch.uint8), bits).shape[-1] == width


@pytest.mark.parametrize("d,bits", [(7, 1), (12, 1), (6, 2), (3, 4), (1, 2), (130, 1)])
def test_width_not_multiple_of_planes_raises(d, bits):
    with pytest.raises(ValueError, match="multiple of"):
        packed_width(d, bits)
    with pytest.raises(ValueError, match="multiple of"):
        pack(torch.zeros(2, d, dtype=torch.uint8), bits)


@pytest.mark.parametrize("bits", (0, 3, 5, 16))
def test_unsupported_bits_raise(bits):
    with pytest.raises(ValueError, match="unsupported bits"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="unsupported bits"):
        unpack(torch.zeros(1, 8, dtype=torch.uint8), bits)


def test_unpack_checks_expected_width():
    p = pack(torch.zeros(1, 16, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="expected"):
        unpack(p, 2, 20)
