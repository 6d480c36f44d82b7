"""qvg.kernels.kmeans_segsum (counting sort + load-balanced segmented sum) against torch: the sort equals torch's
stable sort, the update equals qvg.kmeans.update_with_counts (FP32 sums, IEEE division, empty clusters kept) on
uneven and empty clusters, outputs poisoned first, several tilings (items split inside one cluster, counting-sort
blocks of several sizes, a ragged last block)."""
import pytest
import torch

import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen, poisoned
from qvg.kernels import kmeans as kk
from qvg.kernels.kmeans_segsum import sort_by_cluster

TILINGS = [dict(), dict(item=32, rows=16, sort_block=64), dict(item=16, rows=16, sort_block=32),
           dict(item=64, rows=32, sort_block=128, finish_block=4)]


def _uneven_ids(g: int, n: int, k: int, seed: int) -> torch.Tensor:
    """[G, N] int64 cluster ids: group 0 has one cluster holding ~70% of the tokens (many work items), a few
    singletons and most clusters empty; the others are uniform over half the clusters (the rest empty)."""
    gn = gen(seed)
    ids = torch.randint(0, max(1, k // 2), (g, n), generator=gn) * 2  # even ids only: the odd ones stay empty
    big = torch.rand(n, generator=gn) < 0.7
    ids[0] = torch.where(big, 3, torch.randint(0, min(k, 6), (n,), generator=gn))
    ids[0, 5] = k - 1  # a singleton at the top id
    return ids.clamp(max=k - 1)


@pytest.mark.parametrize("block", [dict(block="sort"), dict(block="rank"), dict(block="rank", rank_rows=8),
                                   dict(block="rank", rank_rows=64, rank_warps=1),  # compress's "fast"
                                   dict(block="rank", rank_rows=32, rank_warps=2),
                                   dict(block="rank", rank_rows=16, rank_warps=4),
                                   dict(block="rank", rank_rows=128)])  # (more than some blocks: clamped)
@pytest.mark.parametrize("kw", TILINGS)
@pytest.mark.parametrize("k", [20, 256])
def test_sort_by_cluster_is_torch_stable_sort(kw, k, block, device):
    """Both block methods (tl.sort / counted ranks, the latter several sub-blocks per block) give torch's stable
    order, ragged last block included."""
    ids = _uneven_ids(3, 301, k, seed=k)
    item = kw.get("item", 256)
    with poisoned():
        order, counts, cstart, istart = sort_by_cluster(ids.to(torch.uint8).to(device), k, item,
                                                        kw.get("sort_block", 1024), **block)
    want = torch.sort(ids, dim=1, stable=True).indices
    assert order.dtype == torch.int32 and torch.equal(order.cpu().long(), want)
    wc = torch.zeros(3, k, dtype=torch.long).scatter_add_(1, ids, torch.ones_like(ids))
    assert torch.equal(counts.cpu().long(), wc)
    zero = torch.zeros(3, 1, dtype=torch.long)
    assert torch.equal(cstart.cpu().long(), torch.cat([zero, wc.cumsum(1)], 1))
    assert torch.equal(istart.cpu().long(), torch.cat([zero, ((wc + item - 1) // item).cumsum(1)], 1))


@pytest.mark.parametrize("bitonic", [False, True])
def test_sort_by_cluster_block_sorts(bitonic, device):
    """Both in-block sorts (tl.sort, the GPU default; ranks by comparison, the interpreter's) give torch's order."""
    ids = _uneven_ids(2, 150, 40, seed=9)
    order, *_ = sort_by_cluster(ids.to(torch.uint8).to(device), 40, 16, 32, bitonic=bitonic)
    assert torch.equal(order.cpu().long(), torch.sort(ids, dim=1, stable=True).indices)


@pytest.mark.parametrize("kw", TILINGS + [dict(block="rank"), dict(item=32, rows=16, sort_block=64, block="rank")])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_update_segsum_uneven_and_empty_clusters(kw, x_dtype, device):
    g, n, d, k = 3, 301, 32, 40
    ids = _uneven_ids(g, n, k, seed=1)
    x = (torch.randn(g, n, d, generator=gen(2)) * 20 + 5).to(x_dtype)
    c = torch.randn(g, k, d, generator=gen(3))
    with poisoned():
        new, cnt = kk.update_with_counts(x.to(device), ids.to(torch.uint8).to(device), c.to(device),
                                         method="segsum", **kw)
    want, wcnt = ref.update_with_counts(x.float(), ids, c)
    assert new.dtype == torch.float32 and cnt.dtype == torch.int32 and torch.isfinite(new.cpu()).all()
    assert torch.equal(cnt.cpu().float(), wcnt)
    torch.testing.assert_close(new.cpu(), want, atol=2e-6 * x.float().abs().amax().item(), rtol=0)
    empty = wcnt == 0
    assert empty.sum() > g * k // 3
    assert_bitwise_equal(new.cpu()[empty], c[empty], "empty clusters keep the old centroid")
    again, _ = kk.update_with_counts(x.to(device), ids.to(torch.uint8).to(device), c.to(device), method="segsum",
                                     **kw)
    assert_bitwise_equal(again, new, "segsum update is deterministic")


def test_update_segsum_singletons_are_exact(device):
    """A cluster of one token: its sum is the token itself, divided by 1 (bitwise its fp32 value)."""
    g, n, d, k = 2, 64, 16, 64
    x = torch.randn(g, n, d, generator=gen(4))
    ids = torch.stack([torch.randperm(n, generator=gen(5)) for _ in range(g)])
    new, cnt = kk.update_with_counts(x.to(device), ids.to(torch.uint8).to(device), torch.zeros(g, k, d).to(device),
                                     method="segsum", item=16, rows=16, sort_block=32)
    assert (cnt.cpu() == 1).all()
    assert_bitwise_equal(new.cpu(), torch.gather(x, 1, torch.argsort(ids, 1)[..., None].expand(-1, -1, d)),
                         "singletons")


@pytest.mark.parametrize("id_dtype", [torch.uint16, torch.int64])
@pytest.mark.parametrize("block", ["sort", "rank"])
def test_update_segsum_wide_ids(id_dtype, block, device):
    g, n, d, k = 1, 700, 16, 300
    x = torch.randn(g, n, d, generator=gen(6))
    ids = torch.randint(0, k, (g, n), generator=gen(7))
    ids[0, :200] = 17
    c = torch.randn(g, k, d, generator=gen(8))
    with poisoned():
        new, cnt = kk.update_with_counts(x.to(device), ids.to(id_dtype).to(device), c.to(device), method="segsum",
                                         item=64, rows=32, block=block)
    want, wcnt = ref.update_with_counts(x, ids, c)
    assert torch.equal(cnt.cpu().float(), wcnt)
    torch.testing.assert_close(new.cpu(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n,k,sb,rows", [(5, 7, 64, 64), (301, 300, 128, 32), (130, 20, 64, 16)])
def test_sort_by_cluster_rank_edge_cases(n, k, sb, rows, device):
    """Counted ranks: a group shorter than one sub-block, ids past 255 (uint16), and real id-0 tokens in a partial
    last sub-block (whose padding also reads as id 0) all give torch's stable order and sizes."""
    ids = torch.randint(0, k, (2, n), generator=gen(n + k))
    ids[:, -3:] = 0  # id 0 right before the padding
    ids[1, :2] = k - 1
    dt = torch.uint8 if k <= 256 else torch.int16
    with poisoned():
        order, counts, *_ = sort_by_cluster(ids.to(dt).to(device), k, 16, sb, block="rank", rank_rows=rows)
    assert torch.equal(order.cpu().long(), torch.sort(ids, dim=1, stable=True).indices)
    assert torch.equal(counts.cpu().long(), torch.zeros(2, k, dtype=torch.long).scatter_add_(1, ids,
                                                                                           torch.ones_like(ids)))


def test_sort_by_cluster_rank_rows_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="rank_rows must be a power of two"):
        sort_by_cluster(torch.zeros(1, 8, dtype=torch.uint8), 4, block="rank", rank_rows=48)
