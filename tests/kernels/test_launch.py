"""`kernels.launch.FastLaunch`: the direct launch of a cached compiled kernel gives bitwise the same output as
Triton's own launch path, and its key separates what Triton specializes on (constexpr values, tensor dtype and
16-byte alignment, integers equal to 1 or divisible by 16, compile options)."""
import pytest
import torch

from kernel_helpers import clustered
from qvg import compression
from qvg.kernels import dequant as dq
from qvg.kernels.launch import FastLaunch, _spec
from qvg.sequence import PackedSequence


def _history(device, chunks=3, n=64):
    x = clustered(1, 2, n, 128, seed=3).bfloat16().to(device)
    return PackedSequence.from_chunks([compression.compress(x, "qvg", bits=2, centroids=8)] * chunks)


def test_key_holds_every_parameter_and_the_specializations(device):
    calls = []

    class Spy(FastLaunch):
        def __call__(self, grid, *a, **k):
            calls.append(self.key(a, k))
            return super().__call__(grid, *a, **k)
    spy = Spy(dq._dequant_kernel)
    saved, dq._DEQUANT = dq._DEQUANT, spy
    try:
        seq = _history(device)
        dq.dequantize(seq)
        dq.dequantize(seq, rows=(1, 2 * 64))
    finally:
        dq._DEQUANT = saved
    (key_a, params_a), (key_b, params_b) = calls
    assert len(params_a) == len(spy.names) and sum(spy.constexpr) >= 10
    assert key_a != key_b  # r0 = 1 is specialized (== 1), r0 = 0 is not
    assert ("num_warps", 4) in key_a[0]
    t = torch.zeros(32, dtype=torch.uint8, device=device)
    assert _spec(t, False) != _spec(t[1:], False)  # 16-byte alignment
    assert _spec(1, False) != _spec(2, False) != _spec(16, False) and _spec(2, False) == _spec(3, False)
    assert _spec(2 ** 31, False) != _spec(3, False) and _spec(64, True) != _spec(128, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch is CUDA's")
def test_direct_launch_equals_triton_launch():
    from qvg.kernels.launch import _hooks_set
    seq = _history("cuda")
    fast = dq._DEQUANT
    assert fast.direct and not _hooks_set()
    before = fast.direct_launches
    outs = [dq.dequantize(seq) for _ in range(3)]  # (compiled or cached by earlier tests, then direct)
    assert fast.direct_launches >= before + 2
    saved = fast.direct
    fast.direct = False  # Triton's own path
    try:
        want = dq.dequantize(seq)
        want_rows = dq.dequantize(seq, rows=(1, 100))
    finally:
        fast.direct = saved
    for o in outs:
        assert torch.equal(o, want)
    for _ in range(2):  # an out view 2 bytes off the 16-byte alignment: its own compiled kernel, the same bits
        odd = torch.empty(1 * 2 * 99 * 128 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(1, 2, 99, 128)
        assert torch.equal(dq.dequantize(seq, rows=(1, 100), out=odd), want_rows)
