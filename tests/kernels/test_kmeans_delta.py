"""kernels/kmeans_delta.py: the incremental centroid update against the torch reference's fresh means, and k-means
with it (update_kw incremental=True) against the full update every iteration."""
import pytest
import torch

import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen, poisoned
from qvg.kernels import kmeans as kk
from qvg.kernels.kmeans_delta import update_delta


def _moved(i1: torch.Tensor, k: int, frac: float, seed: int) -> torch.Tensor:
    gn = gen(seed)
    flip = torch.rand(i1.shape, generator=gn) < frac
    return torch.where(flip, torch.randint(0, k, i1.shape, generator=gn), i1.long()).to(i1.dtype)


@pytest.mark.parametrize("progs,scan", [(0, 1024), (3, 64)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,frac", [(20, 0.1), (256, 0.03), (300, 1.0)])
def test_update_delta_equals_fresh_means(k, frac, x_dtype, progs, scan, device):
    """Moved tokens (a few, or all of them), a cluster emptied, a group where one token moved and one where none
    did; one program per group, or 3 (ragged slices, each scanned in several 64-token blocks): the new means, sizes and sums are the reference's (sums up to FP32 rounding order), the emptied
    cluster keeps its centroid and its sum is exactly 0."""
    gn = gen(k)
    g, n, d = 4, 700, 32
    x = (torch.randn(g, n, d, generator=gn) * 3).to(x_dtype)  # (700 tokens: 3 programs of 234, a ragged one)
    c = torch.randn(g, k, d, generator=gn)
    i1 = torch.randint(0, k, (g, n), generator=gn).to(kk.id_dtype(k))
    i2 = _moved(i1, k, frac, k + 1)
    i2 = i2.long()
    i2[0] = i1[0].long()  # nothing moved
    i2[1] = i1[1].long()
    i2[1, 5] = (int(i1[1, 5]) + 1) % k  # one token moved
    i2[2][i2[2] == 3] = 4  # cluster 3 empties
    i2 = i2.to(i1.dtype)
    dev = [t.to(device) for t in (x, i1, i2, c)]
    sums = torch.empty(g, k, d, device=device)
    _, n1 = kk.update_with_counts(dev[0], dev[1], dev[3], method="segsum", sums=sums)
    with poisoned():
        c2, n2, s2 = update_delta(dev[0], dev[1], dev[2], dev[3], sums, n1, progs=progs, scan_block=scan)
    want_c, want_n = ref.update_with_counts(x.float(), i2.long(), c)
    assert torch.equal(n2.cpu(), want_n.int())
    want_s = torch.zeros(g, k, d).scatter_add_(1, i2.long()[..., None].expand(-1, -1, d), x.float())
    scale = x.float().abs().amax().item() * n
    torch.testing.assert_close(s2.cpu(), want_s, rtol=0, atol=4 * scale * 2.0 ** -24)
    torch.testing.assert_close(c2.cpu(), want_c, rtol=1e-5, atol=1e-5)
    assert torch.equal(c2.cpu()[2, 3], c[2, 3]) and not s2.cpu()[2, 3].any()  # emptied: old centroid, sum 0
    again = update_delta(dev[0], dev[1], dev[2], dev[3], sums, n1, progs=progs, scan_block=scan)
    for a, b in zip(again, (c2, n2, s2)):
        assert_bitwise_equal(a, b, "deterministic")


def test_update_delta_more_programs_than_tokens(device):
    """Programs with no tokens of their own write zero partials."""
    gn = gen(3)
    x = torch.randn(1, 50, 16, generator=gn).bfloat16()
    c = torch.randn(1, 20, 16, generator=gn)
    i1 = torch.randint(0, 20, (1, 50), generator=gn).to(torch.uint8)
    i2 = _moved(i1, 20, 0.5, 4)
    dev = [t.to(device) for t in (x, i1, i2, c)]
    sums = torch.empty(1, 20, 16, device=device)
    _, n1 = kk.update_with_counts(dev[0], dev[1], dev[3], method="segsum", sums=sums)
    with poisoned():
        c2, n2, _ = update_delta(dev[0], dev[1], dev[2], dev[3], sums, n1, progs=64)
    want_c, want_n = ref.update_with_counts(x.float(), i2.long(), c)
    assert torch.equal(n2.cpu(), want_n.int())
    torch.testing.assert_close(c2.cpu(), want_c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("iters", [2, 3])
def test_kmeans_incremental_matches_full_updates(iters, device, monkeypatch):
    """Warm-started k-means with the incremental update equals full updates (ids exactly, centroids up to FP32
    rounding), with an empty cluster reseeded after the first update (a far-off initial centroid) and the first
    update still taking max|x|; a cold start runs full updates (bitwise the same as without the flag)."""
    import qvg.kernels.kmeans_delta as kd
    calls = []
    real = kd.update_delta
    monkeypatch.setattr(kk, "update_delta", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gn = gen(9)
    x = (torch.randn(2, 600, 32, generator=gn) * 2).bfloat16().to(device)
    init = torch.randn(2, 24, 32, generator=gn)
    init[:, 7] = 1e3  # nothing is nearest: empty after the first assignment, then reseeded
    init = init.to(device)
    kw = dict(method="segsum", item=256, rows=16)
    common = dict(iters=iters, reseed="fused", assign_kw=dict(mode="min"))
    first = kk.assign(x, init, mode="min")[0]
    assert not (first.long() == 7).any()
    full = kk.kmeans(x, 24, init=init, update_kw=kw, **common)
    amax = torch.zeros(2, dtype=torch.int32, device=device)
    inc = kk.kmeans(x, 24, init=init, update_kw=dict(kw, incremental=True), amax=amax, **common)
    assert len(calls) == iters - 1
    assert torch.equal(inc.ids, full.ids)
    assert (inc.ids.long() == 7).any()  # the reseeded cluster took tokens
    torch.testing.assert_close(inc.centroids, full.centroids, rtol=1e-5, atol=1e-5)
    assert torch.equal(amax.cpu(), kk.amax_bits(x).cpu())
    cold = kk.kmeans(x, 24, update_kw=dict(kw, incremental=True), **common)
    assert len(calls) == iters - 1  # (no delta update on a cold start)
    want = kk.kmeans(x, 24, update_kw=kw, **common)
    assert torch.equal(cold.ids, want.ids) and torch.equal(cold.centroids, want.centroids)
    with pytest.raises(ValueError, match="incremental=True needs"):
        kk.kmeans(x, 24, init=init, update_kw=dict(incremental=True), **common)
