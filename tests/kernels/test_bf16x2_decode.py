"""kernels/common.py's BF16x2 decode steps against an exact torch reference: `codes_fma_bf16` (inline PTX on the
GPU, its FP32 emulation under the interpreter) must give bf16((c - off) * s + centroid) with the product exact and
one rounding, for every code plane of 2- and 4-bit bytes. Poisoned outputs: every element must be written."""
import pytest
import torch
import triton
import triton.language as tl

from kernel_helpers import gen, poisoned
from qvg.kernels.common import INTERPRET, codes_fma_bf16

R, W = 32, 32  # rows x columns of one tile (a plane of 2-bit codes at head dim 128)


@triton.jit
def _fma_kernel(byte_ptr, hs_ptr, nb_ptr, cent_ptr, out_ptr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                R: tl.constexpr, W: tl.constexpr, INTERP: tl.constexpr):
    rows = tl.arange(0, R)
    off = rows[:, None] * W + tl.arange(0, W)[None, :]
    byte = tl.load(byte_ptr + off)
    hs = tl.load(hs_ptr + rows)[:, None]  # one scale and base per row, as a plane within one group has
    nb = tl.load(nb_ptr + rows)[:, None]
    tl.store(out_ptr + off, codes_fma_bf16(byte, SHIFT, BITS, hs, nb, tl.load(cent_ptr + off), INTERP))


def _rne(x: torch.Tensor) -> torch.Tensor:
    """float64 values that fp32 holds exactly -> bf16, rounded once to nearest even."""
    assert torch.equal(x.float().double(), x), "the test data must be exact in fp32"
    return x.float().bfloat16()


@pytest.mark.parametrize("bits,plane", [(2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1)])
def test_codes_fma_bf16_is_one_rounding_of_the_exact_value(bits, plane, device):
    g = gen(bits * 10 + plane)
    byte = torch.randint(0, 256, (R, W), generator=g, dtype=torch.int32).to(torch.uint8)
    half = 2 ** (bits - 1)
    off = torch.where(torch.rand(R, generator=g) < 0.5, half - 1.0, half - 0.5)  # sym / midrise groups
    hs = (torch.rand(R, generator=g) * 0.3 + 0.01).bfloat16()
    nb = (-128.0 - 2 * off).bfloat16()
    # multiples of 2^-8 below 16 and scales >= 2^-7: every exact result is a multiple of 2^-14 below 32 (fp32-exact)
    cent = ((torch.randn(R, W, generator=g) * 4 * 256).round() / 256).clamp(-15, 15).bfloat16()
    c = ((byte.long() >> (plane * bits)) & (2 ** bits - 1)).double()
    want = _rne(2 * (c - off[:, None].double()) * hs.double()[:, None] + cent.double())
    with poisoned():
        out = torch.empty(R, W, dtype=torch.bfloat16, device=device)
    _fma_kernel[(1,)](byte.to(device), hs.to(device), nb.to(device), cent.to(device), out, SHIFT=plane * bits,
                      BITS=bits, R=R, W=W, INTERP=INTERPRET)
    got = out.cpu()
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert len(bad) == 0, f"{len(bad)} of {R * W} differ, first at {bad[:4].tolist()}: {got[tuple(bad[0])]} vs " \
        f"{want[tuple(bad[0])]}"

