"""qvg.kernels.kmeans.kmeans writing its result straight into the caller's tensors (ids_out / cents_out: what
compress stores, with no copy kernels after it) gives bitwise what the result copied there gives: every update
method, fused and torch reseeding, warm and cold starts, 0-3 iterations, and data whose last update leaves clusters
empty (the fused reseeding then rewrites their BF16 rows). The direct writes are shown to happen (not the fallback
copy), the BF16 side outputs of each update and of the fused reseeding are checked on their own, and the warm start
read in BF16 (no FP32 copy) against the torch loop's FP32 copy."""
import weakref

import pytest
import torch

import qvg.kernels.kmeans as kk
import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen
from qvg.kernels.common import check_out
from qvg.kernels.kmeans import assign, kmeans, update_with_counts
from qvg.kernels.kmeans_delta import update_delta
from qvg.kernels.kmeans_reseed import reseed_empty_fused
from qvg.kmeans import id_dtype

UPDATES = {
    "segsum": dict(method="segsum", item=64, rows=16, sort_block=128),
    "segsum-delta": dict(method="segsum", item=64, rows=16, sort_block=128, incremental=True),
    "onehot": dict(method="onehot", block_k=16, block_n=16, chunk=64),
    "sort": dict(method="sort"),
}
G, N, D, K = 2, 160, 32, 24
DISTINCT = 8  # distinct tokens in the "repeated" data


def _data(g, n, d, k, seed, far=False, repeated=False):
    """Tokens and warm-start centroids. far: a third of the centroids far from every token (their clusters are empty
    after the first assignment). repeated: the tokens take only DISTINCT < K values, so at most DISTINCT clusters
    are ever non-empty (equal tokens get the same id) and every update, the last one included, leaves some empty."""
    gn = gen(seed)
    c = torch.randn(g, k, d, generator=gn) * 0.3
    if far:
        c[:, : k // 3] += 20.0
    x = torch.randn(g, n, d, generator=gn)
    if repeated:
        x = x[:, torch.arange(n) % DISTINCT]
    return x.bfloat16(), c.bfloat16()


def _kw(update, reseed, iters, init):
    return dict(iters=iters, init=init, seed=3, assign_kw=dict(block_n=16, block_k=16), update_kw=UPDATES[update],
                reseed=reseed)


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("iters,warm", [(0, True), (1, True), (2, True), (3, True), (2, False)])
@pytest.mark.parametrize("reseed,repeated", [("fused", False), ("torch", False), ("fused", True)])
def test_outputs_written_in_place_equal_the_copied_result(update, reseed, iters, warm, repeated, device):
    """(repeated data with the torch reseeding adds nothing: without the fused reseeding the table is copied.)"""
    x, init = _data(G, N, D, K, seed=iters + 7 * warm, far=not repeated, repeated=repeated)
    x = x.to(device)
    kw = _kw(update, reseed, iters, init.to(device) if warm else None)
    want = kmeans(x, K, **kw)
    if repeated and iters:  # the last update left clusters empty: the reseeding moved them (and, fused, their BF16)
        assert max(len(torch.unique(row)) for row in want.ids.cpu()) <= DISTINCT < K  # (per group)
    ids_out = torch.full((G, N), 255, dtype=id_dtype(K), device=device)  # poisoned: unwritten entries fail
    cents_out = torch.full((G, K, D), float("nan"), dtype=torch.bfloat16, device=device)
    got = kmeans(x, K, ids_out=ids_out, cents_out=cents_out, **kw)
    assert got.ids.data_ptr() == ids_out.data_ptr()
    assert_bitwise_equal(ids_out.cpu(), want.ids.cpu(), "ids")
    assert_bitwise_equal(cents_out.cpu(), want.centroids.bfloat16().cpu(), "BF16 centroids")
    assert_bitwise_equal(got.centroids.cpu(), want.centroids.cpu(), "FP32 centroids")


@pytest.mark.parametrize("reseed,iters,direct", [("fused", 2, True), ("fused", 1, True), ("torch", 2, False),
                                                 ("fused", 0, False)])
def test_the_kernels_write_cents_out_themselves(reseed, iters, direct, monkeypatch, device):
    """With the fused reseeding and iters > 0 the BF16 table comes from the last update and reseeding, not from a
    copy of the result: the result handed back by the loop is altered here, and only a copy would see it."""
    real = kk.ref_kmeans

    def altered(*a, **k):
        r = real(*a, **k)
        return ref.KMeansResult(-r.centroids, r.ids, r.trace)  # (negation: exact both ways)
    monkeypatch.setattr(kk, "ref_kmeans", altered)
    x, init = _data(G, N, D, K, seed=4, repeated=True)
    x, init = x.to(device), init.to(device)
    cents_out = torch.full((G, K, D), float("nan"), dtype=torch.bfloat16, device=device)
    got = kmeans(x, K, cents_out=cents_out, **_kw("segsum-delta", reseed, iters, init))
    true_table = (-got.centroids).bfloat16().cpu()  # what the kernels computed
    assert not torch.equal(true_table, got.centroids.bfloat16().cpu())  # (so the two cases differ)
    assert_bitwise_equal(cents_out.cpu(), true_table if direct else got.centroids.bfloat16().cpu(), "cents_out")


def test_some_clusters_empty_out(device):
    """The far-centroid data empties clusters at the first update (the iters = 1 rows' reseeding)."""
    x, init = _data(G, N, D, K, seed=2 + 7, far=True)
    ids, _ = assign(x.to(device), init.to(device).float(), True, block_n=16, block_k=16)
    _, counts = update_with_counts(x.to(device), ids, init.to(device).float(), **UPDATES["segsum"])
    assert int((counts == 0).sum()) > 0


@pytest.mark.parametrize("update", ["segsum", "onehot", "sort"])
def test_update_bf16_out_is_the_rounding_of_its_centroids(update, device):
    x, c = _data(2, 200, 32, 20, seed=11)
    x, c = x.to(device), c.to(device).float()
    ids, _ = assign(x, c, True, block_n=16, block_k=16)
    out = torch.full((2, 20, 32), float("nan"), dtype=torch.bfloat16, device=device)
    c_new, _ = update_with_counts(x, ids, c, bf16_out=out, **UPDATES[update])
    assert_bitwise_equal(out.cpu(), c_new.bfloat16().cpu(), "bf16_out")


def test_delta_and_reseed_bf16_out(device):
    x, c = _data(2, 200, 32, 20, seed=5, far=True)
    x, c = x.to(device), c.to(device).float()
    ids0, _ = assign(x, c, True, block_n=16, block_k=16)
    sums = torch.empty(2, 20, 32, device=device)
    c1, n1 = update_with_counts(x, ids0, c, sums=sums, **UPDATES["segsum"])
    ids1, dist1 = assign(x, c1, True, block_n=16, block_k=16)
    out = torch.full((2, 20, 32), float("nan"), dtype=torch.bfloat16, device=device)
    c2, n2, _ = update_delta(x, ids0, ids1, c1, sums, n1, bf16_out=out)
    assert_bitwise_equal(out.cpu(), c2.bfloat16().cpu(), "delta bf16_out")
    assert int((n2 == 0).sum()) > 0  # the reseeding below has rows to move
    c3 = reseed_empty_fused(x, c2, n2, dist1, bf16_out=out)
    assert_bitwise_equal(out.cpu(), c3.bfloat16().cpu(), "reseed bf16_out")


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("iters", [1, 2])
def test_warm_start_read_in_bf16_equals_the_fp32_copy(update, iters, device):
    """The kernel loop reads a BF16 warm start as it is; the torch loop's FP32 copy of it holds the same values."""
    x, init = _data(G, N, D, K, seed=1, far=True)
    x, init = x.to(device), init.to(device)
    a = kmeans(x, K, **_kw(update, "fused", iters, init))
    b = kmeans(x, K, **_kw(update, "fused", iters, init.float()))
    assert_bitwise_equal(a.ids.cpu(), b.ids.cpu(), "ids")
    assert_bitwise_equal(a.centroids.cpu(), b.centroids.cpu(), "centroids")


def test_bad_outputs_are_refused(device):
    x, init = _data(1, 64, 16, 8, seed=0)
    x, init = x.to(device), init.to(device)
    with pytest.raises(ValueError, match="out must be"):
        kmeans(x, 8, init=init, iters=1, ids_out=torch.zeros(1, 64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="bf16_out must be"):
        kmeans(x, 8, init=init, iters=1, reseed="fused", update_kw=dict(method="segsum", item=64, rows=16,
                                                                       sort_block=64),
               cents_out=torch.zeros(1, 8, 16, device=device))
    # the reference loop itself is untouched: it still copies a warm start to FP32
    assert ref.kmeans(x.float(), 8, init=init, iters=0).centroids.dtype == torch.float32


def test_output_check_keeps_no_reference():
    """check_out holds on to nothing (a cache on it would keep every stored table alive)."""
    t = torch.zeros(2, 3)
    alive = weakref.ref(t)
    assert check_out(t, (2, 3), torch.float32, t.device, "t") is t
    del t
    assert alive() is None
