"""qvg.kernels.kmeans.kmeans writing its result straight into the caller's tensors (ids_out / cents_out: what
compress stores, with no copy kernels after it) gives bitwise what the result copied there gives: every update
method, fused and torch reseeding, warm and cold starts, 0-3 iterations, and clusters that empty out (the fused
reseeding then rewrites their BF16 rows too). Also the BF16 side outputs of each update and of the fused
reseeding on their own, and the warm start read in BF16 (no FP32 copy) against the torch loop's FP32 copy."""
import pytest
import torch

import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen
from qvg.kernels.kmeans import assign, kmeans, update_with_counts
from qvg.kernels.kmeans_delta import update_delta
from qvg.kernels.kmeans_reseed import reseed_empty_fused
from qvg.kmeans import id_dtype

UPDATES = {
    "segsum": dict(method="segsum", item=64, rows=16, sort_block=128),
    "segsum-rank": dict(method="segsum", item=64, rows=16, sort_block=128, block="rank", rank_rows=16),
    "segsum-delta": dict(method="segsum", item=64, rows=16, sort_block=128, incremental=True),
    "onehot": dict(method="onehot", block_k=16, block_n=16, chunk=64),
    "sort": dict(method="sort"),
}


def _data(g, n, d, k, seed, far):
    """Tokens and warm-start centroids; far: a third of the centroids far from every token (their clusters are
    empty after the first assignment, so the reseeding moves them)."""
    gn = gen(seed)
    c = torch.randn(g, k, d, generator=gn) * 0.3
    if far:
        c[:, : k // 3] += 20.0
    return torch.randn(g, n, d, generator=gn).bfloat16(), c.bfloat16()


@pytest.mark.parametrize("update", list(UPDATES))
@pytest.mark.parametrize("reseed", ["fused", "torch"])
@pytest.mark.parametrize("iters,warm", [(0, True), (1, True), (2, True), (3, True), (2, False)])
def test_outputs_written_in_place_equal_the_copied_result(update, reseed, iters, warm, device):
    g, n, d, k = 2, 160, 32, 24
    x, init = _data(g, n, d, k, seed=iters + 7 * warm, far=True)
    x = x.to(device)
    kw = dict(iters=iters, init=init.to(device) if warm else None, seed=3, assign_kw=dict(block_n=16, block_k=16),
              update_kw=UPDATES[update], reseed=reseed)
    want = kmeans(x, k, **kw)
    ids_out = torch.full((g, n), 255, dtype=id_dtype(k), device=device)  # poisoned: unwritten entries fail
    cents_out = torch.full((g, k, d), float("nan"), dtype=torch.bfloat16, device=device)
    got = kmeans(x, k, ids_out=ids_out, cents_out=cents_out, **kw)
    assert got.ids.data_ptr() == ids_out.data_ptr()
    assert_bitwise_equal(ids_out.cpu(), want.ids.cpu(), "ids")
    assert_bitwise_equal(cents_out.cpu(), want.centroids.bfloat16().cpu(), "BF16 centroids")
    assert_bitwise_equal(got.centroids.cpu(), want.centroids.cpu(), "FP32 centroids")


def test_some_clusters_empty_out(device):
    """The data of the test above does reseed clusters (else the reseeding's BF16 rows would go untested)."""
    g, n, d, k = 2, 160, 32, 24
    x, init = _data(g, n, d, k, seed=2 + 7, far=True)
    ids, _ = assign(x.to(device), init.to(device).float(), True, block_n=16, block_k=16)
    _, counts = update_with_counts(x.to(device), ids, init.to(device).float(), method="segsum", item=64, rows=16,
                                   sort_block=128)
    assert int((counts == 0).sum()) > 0


@pytest.mark.parametrize("update", ["segsum", "onehot", "sort"])
def test_update_bf16_out_is_the_rounding_of_its_centroids(update, device):
    g, n, d, k = 2, 200, 32, 20
    x, c = _data(g, n, d, k, seed=11, far=False)
    x, c = x.to(device), c.to(device).float()
    ids, _ = assign(x, c, True, block_n=16, block_k=16)
    out = torch.full((g, k, d), float("nan"), dtype=torch.bfloat16, device=device)
    kw = {key: v for key, v in UPDATES[update].items() if key != "incremental"}
    c_new, _ = update_with_counts(x, ids, c, bf16_out=out, **kw)
    assert_bitwise_equal(out.cpu(), c_new.bfloat16().cpu(), "bf16_out")


def test_delta_and_reseed_bf16_out(device):
    g, n, d, k = 2, 200, 32, 20
    x, c = _data(g, n, d, k, seed=5, far=True)
    x, c = x.to(device), c.to(device).float()
    ids0, _ = assign(x, c, True, block_n=16, block_k=16)
    sums = torch.empty(g, k, d, device=device)
    c1, n1 = update_with_counts(x, ids0, c, method="segsum", item=64, rows=16, sort_block=128, sums=sums)
    ids1, dist1 = assign(x, c1, True, block_n=16, block_k=16)
    out = torch.full((g, k, d), float("nan"), dtype=torch.bfloat16, device=device)
    c2, n2, _ = update_delta(x, ids0, ids1, c1, sums, n1, bf16_out=out)
    assert_bitwise_equal(out.cpu(), c2.bfloat16().cpu(), "delta bf16_out")
    assert int((n2 == 0).sum()) > 0  # the reseeding below has rows to move
    c3 = reseed_empty_fused(x, c2, n2, dist1, bf16_out=out)
    assert_bitwise_equal(out.cpu(), c3.bfloat16().cpu(), "reseed bf16_out")


def test_warm_start_read_in_bf16_equals_the_fp32_copy(device):
    """The kernel loop reads a BF16 warm start as it is; the torch loop's FP32 copy of it holds the same values."""
    g, n, d, k = 2, 160, 32, 24
    x, init = _data(g, n, d, k, seed=1, far=False)
    x, init = x.to(device), init.to(device)
    kw = dict(iters=2, seed=0, assign_kw=dict(block_n=16, block_k=16), update_kw=UPDATES["segsum"], reseed="fused")
    a = kmeans(x, k, init=init, **kw)
    b = kmeans(x, k, init=init.float(), **kw)
    assert_bitwise_equal(a.ids.cpu(), b.ids.cpu(), "ids")
    assert_bitwise_equal(a.centroids.cpu(), b.centroids.cpu(), "centroids")


def test_bad_outputs_are_refused(device):
    x, init = _data(1, 64, 16, 8, seed=0, far=False)
    x, init = x.to(device), init.to(device)
    with pytest.raises(ValueError, match="out must be"):
        kmeans(x, 8, init=init, iters=1, ids_out=torch.zeros(1, 64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="bf16_out must be"):
        kmeans(x, 8, init=init, iters=1, reseed="fused", update_kw=dict(method="segsum", item=64, rows=16,
                                                                       sort_block=64),
               cents_out=torch.zeros(1, 8, 16, device=device))
    # the reference loop itself is untouched: it still copies a warm start to FP32
    assert ref.kmeans(x.float(), 8, init=init, iters=0).centroids.dtype == torch.float32
