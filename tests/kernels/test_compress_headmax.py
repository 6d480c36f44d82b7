"""The FP8 tensor scale's input found by the last k-means update (kernels/kmeans_segsum.py `head_absmax`) instead
of by the pack's own pass over x: the value against torch, the compress path's stored tensors bitwise those of the
stats pass (kernels/compress.py's "fast-stats-pass" variant), and the pass really skipped."""
import pytest
import torch

import qvg
from kernel_helpers import clustered, gen, poisoned
from qvg.compression import resolve_options
from qvg.kernels import kmeans as kk


@pytest.mark.parametrize("kw", [dict(), dict(item=16, rows=16, sort_block=32, finish_block=4)])
def test_update_segsum_head_absmax_is_the_residual_max(kw, device):
    """bits of max over tokens |fl32(x - bf16(new centroid of the token's cluster))|, per group; empty clusters
    (odd ids here) hold no token and do not count, a cluster split over several work items does."""
    g, n, d, k = 3, 203, 32, 12
    gn = gen(7)
    ids = torch.randint(0, k // 2, (g, n), generator=gn) * 2
    ids[1, :150] = 4  # one large cluster: many items
    x = (torch.randn(g, n, d, generator=gn) * 20 + 3).to(torch.bfloat16)
    x[2, 17, 5] = -900.0  # a lone extreme, below its centroid
    c = torch.randn(g, k, d, generator=gn)
    hmax = torch.zeros(g, dtype=torch.int32, device=device)
    with poisoned():
        new, cnt = kk.update_with_counts(x.to(device), ids.to(torch.uint8).to(device), c.to(device),
                                         method="segsum", head_absmax=hmax, **kw)
    cb = new.cpu().to(torch.bfloat16).float()
    r = x.float() - torch.gather(cb, 1, ids[..., None].expand(-1, -1, d))
    want = r.abs().flatten(1).amax(1)
    assert torch.equal(hmax.cpu().view(torch.float32), want)
    plain, _ = kk.update_with_counts(x.to(device), ids.to(torch.uint8).to(device), c.to(device), method="segsum",
                                     **kw)
    assert torch.equal(plain.cpu(), new.cpu()), "the extremes do not change the centroids"


class _Counting:
    """Stands in for a @triton.jit kernel: counts launches, then runs it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.fn[grid]


@pytest.mark.parametrize("grid,bits", [("auto", 2), ("midrise", 2), ("sym", 4), ("auto", 1)])
def test_compress_head_max_from_the_update_is_bitwise_the_stats_pass(grid, bits, device, monkeypatch):
    import qvg.kernels.quantize as kq
    from qvg.kernels.compress import compress_prq
    x = clustered(1, 2, 150, 64, clusters=5, spread=6.0, seed=11)
    x[..., :2] *= 12  # outlier channels, as real keys have
    x = x.to(torch.bfloat16).to(device)
    o = resolve_options("qvg", tuple(x.shape), centroids=8, bits=bits, grid=grid, block_size=32)
    warm = torch.randn(1, 2, 8, 64, generator=gen(3)).to(device) * 6  # some clusters stay empty
    stats = _Counting(kq._stats_kernel)
    monkeypatch.setattr(kq, "_stats_kernel", stats)
    with poisoned():
        fast = compress_prq(x, o, warm, 2, variant="fast")
    assert stats.calls == 0, "the pack's pass 1 ran"
    with poisoned():
        ref = compress_prq(x, o, warm, 2, variant="fast-stats-pass")
    assert stats.calls == 1
    assert set(fast) == set(ref)
    for name in ref:
        a, b = fast[name].cpu(), ref[name].cpu()
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    pk = qvg.Packed("qvg", tuple(x.shape), x.dtype, fast, o)
    assert torch.isfinite(qvg.decompress(pk).float()).all()


def test_compress_keeps_the_stats_pass_where_the_update_cannot_find_the_max(device, monkeypatch):
    """FP32 x (the k-means reads its BF16 rounding, the pack x itself) and several stages (the pack's residual is
    the FP32 chain, the last k-means reads its BF16 rounding): pass 1 stays."""
    import qvg.kernels.quantize as kq
    from qvg.kernels.compress import compress_prq
    stats = _Counting(kq._stats_kernel)
    monkeypatch.setattr(kq, "_stats_kernel", stats)
    x = clustered(1, 1, 64, 32, clusters=3, seed=2).to(device)
    compress_prq(x, resolve_options("qvg", tuple(x.shape), centroids=4, block_size=32), None, 1, variant="fast")
    xb = x.to(torch.bfloat16)
    compress_prq(xb, resolve_options("qvg-pro", tuple(x.shape), centroids=4, block_size=16), None, 1, variant="fast")
    assert stats.calls == 2
