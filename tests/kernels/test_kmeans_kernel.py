"""qvg.kernels.kmeans (Triton assign / update / kmeans) against qvg.kmeans (torch, fp32).

The kernel's distances use BF16 dot operands (FP32 accumulation), so ids may differ from the fp32 reference near
ties; they must agree exactly wherever the reference's best-vs-second gap exceeds the BF16 error bound."""
import pytest
import torch

import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen, poisoned
from qvg.kernels import kmeans as kk
from qvg.kernels.compress import COMPRESS_VARIANTS


def _blobs(g: int, n: int, d: int, k: int, *, sep: float = 3.0, noise: float = 0.5, seed: int = 0):
    """[G, N, D] tokens around k centres per group (centres N(0, sep^2)); returns (x, centres [G, K, D])."""
    gn = gen(seed)
    centres = torch.randn(g, k, d, generator=gn) * sep
    labels = torch.randint(0, k, (g, n), generator=gn)
    x = torch.gather(centres, 1, labels[..., None].expand(-1, -1, d)) + noise * torch.randn(g, n, d, generator=gn)
    return x, centres


def _margin_ok(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Tokens whose reference best-vs-second distance gap exceeds twice the BF16-operand error bound of
    |c|^2 - 2 x.c (each of x, c rounded to BF16: relative 2^-8 each -> |err(x.c)| <= ~2^-7 |x||c|)."""
    d = torch.cdist(x.double(), c.double()) ** 2
    two = d.topk(2, dim=-1, largest=False).values
    bound = 2.0 ** -6 * x.double().norm(dim=-1) * c.double().norm(dim=-1).amax(-1, keepdim=True)
    return (two[..., 1] - two[..., 0]) > 2 * bound


@pytest.mark.parametrize("k", [20, 256, 300])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_assign(k, x_dtype, packed, device):
    x, centres = _blobs(2, 150 if k <= 256 else 400, 32, min(k, 24), seed=k)
    x = x.to(x_dtype)
    c = torch.cat([centres, torch.randn(2, k - centres.shape[1], 32, generator=gen(1)) * 3], 1)  # K centroids
    with poisoned():
        ids, dist = kk.assign(x.to(device), c.to(device), want_dist=True, packed=packed)
    assert ids.dtype == (torch.uint8 if k <= 256 else torch.uint16) and ids.shape == x.shape[:2]
    assert torch.isfinite(dist).all()
    ids, dist = ids.cpu().long(), dist.cpu()
    rid, rdist = ref.assign(x.float(), c)
    assert int(ids.max()) < k
    agree = (ids == rid).float().mean().item()
    assert agree >= 0.99, agree
    sure = _margin_ok(x.float(), c)
    assert sure.float().mean() > 0.5  # the exact check below covers most tokens
    assert torch.equal(ids[sure], rid[sure])
    # distances: |x|^2 + |c|^2 - 2 x.c cancels, so the BF16 dot error is relative to |x||c|, not to the distance
    bf16_err = 2.0 ** -6 * x.float().norm(dim=-1) * c.norm(dim=-1).amax(-1, keepdim=True)
    assert ((dist - rdist).abs() <= bf16_err + 1e-2 * rdist).all()
    if x_dtype == torch.bfloat16:  # only the centroids are rounded: the distances are close to fp32's
        assert ((dist - rdist).norm() / rdist.norm()).item() < 1e-2
    # the returned distance is the one of the returned centroid, up to the bf16 dot error
    dd = ((x.float() - torch.gather(c, 1, ids[..., None].expand(-1, -1, 32))) ** 2).sum(-1)
    assert ((dist - dd).abs() <= bf16_err + 1e-4 * dd).all()
    ids2, _ = kk.assign(x.to(device), c.to(device), packed=packed)
    assert torch.equal(ids2.cpu().long(), ids)


def test_assign_packed_ties_go_to_the_lower_id(device):
    """Duplicated centroids give equal distances: the packed integer min must return the lower id, as torch."""
    x, centres = _blobs(1, 64, 16, 8, seed=4)
    c = torch.cat([centres, centres], 1)  # ids j and j + 8 are the same centroid
    ids, _ = kk.assign(x.to(device), c.to(device), packed=True)
    assert int(ids.max()) < 8


def test_assign_without_dist_and_block_sizes(device):
    x, c = _blobs(3, 130, 64, 40, seed=4)
    a, none = kk.assign(x.to(device), c.to(device))
    assert none is None
    b, _ = kk.assign(x.to(device), c.to(device), block_n=16, block_k=16)
    assert torch.equal(a.cpu(), b.cpu())
    rid, _ = ref.assign(x, c)
    sure = _margin_ok(x, c)
    assert torch.equal(a.cpu().long()[sure], rid[sure])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["onehot", "sort", "segsum"])
def test_update(x_dtype, method, device):
    k = 20
    x, centres = _blobs(2, 150, 32, 12, seed=9)
    x = x.to(x_dtype)
    c = torch.cat([centres, torch.full((2, k - 12, 32), 1e4)], 1)  # 8 far-away centroids stay empty
    rid, _ = ref.assign(x.float(), c)
    ids = rid.to(torch.uint8)
    counts = torch.zeros(2, k).scatter_add_(1, rid, torch.ones(2, 150))
    empty = counts == 0
    assert empty[:, 12:].all() and empty.sum() >= 16
    with poisoned():
        new, cnt = kk.update_with_counts(x.to(device), ids.to(device), c.to(device), method=method)
    new = new.cpu()
    assert torch.equal(cnt.cpu().long(), counts.long())
    want = ref.update(x.float(), rid, c)
    assert new.dtype == torch.float32 and torch.isfinite(new).all()
    mag = x.float().abs().amax()
    torch.testing.assert_close(new, want, atol=1e-4 * mag.item(), rtol=0)
    assert_bitwise_equal(new[empty], c[empty], "empty clusters keep the old centroid")
    again = kk.update(x.to(device), ids.to(device), c.to(device), method=method).cpu()
    assert_bitwise_equal(again, new, "update is deterministic")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(method="onehot"), dict(method="onehot", block_k=32, block_n=16, chunk=64),
                                dict(method="sort"), dict(method="segsum", block="sort", item=32, rows=16),
                                dict(method="segsum", block="rank", item=64, rows=16, sort_block=64)])
def test_update_amax(kw, x_dtype, device):
    """update_with_counts(amax=) writes each group's max|x| (FP32 bits) while it reads x, and the same centroids;
    one far token per group (its own cluster, or in the middle of a big one), one group's maximum negative."""
    k = 40
    x, _ = _blobs(3, 333, 32, 12, seed=21)
    x[0, 100, 5] = 900.0
    x[1, 7, 31] = -1200.0
    x = x.to(x_dtype)
    c = x[:, :k].float().clone()
    ids = ref.assign(x.float(), c)[0].to(torch.uint8)
    plain = kk.update(x.to(device), ids.to(device), c.to(device), **kw).cpu()
    amax = torch.zeros(3, dtype=torch.int32, device=device)
    new = kk.update(x.to(device), ids.to(device), c.to(device), amax=amax, **kw).cpu()
    assert_bitwise_equal(new, plain, "amax= changes no centroid")
    assert torch.equal(amax.cpu().view(torch.float32), x.float().abs().amax((1, 2)))
    assert torch.equal(amax.cpu(), kk.amax_bits(x))


@pytest.mark.parametrize("iters", [0, 2])
def test_kmeans_amax(iters, device):
    """kmeans(amax=) fills the buffer once (the first update, or a torch reduction without one), same result."""
    x, _ = _blobs(2, 200, 32, 8, seed=3)
    x = x.to(torch.bfloat16).to(device)
    kw = dict(iters=iters, seed=1, update_kw=dict(method="segsum", item=32, rows=16, sort_block=64, block="rank"))
    amax = torch.zeros(2, dtype=torch.int32, device=device)
    a, b = kk.kmeans(x, 8, **kw), kk.kmeans(x, 8, amax=amax, **kw)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.centroids, b.centroids)
    assert torch.equal(amax.cpu().view(torch.float32), x.float().abs().amax((1, 2)).cpu())


def test_update_onehot_splits(device):
    """Several token splits (summed in a fixed order) and a centroid block that is not full."""
    k = 40
    x, _ = _blobs(2, 333, 32, k, seed=12)
    x = x * 50
    c = x[:, :k].clone()
    rid, _ = ref.assign(x, c)
    new, cnt = kk.update_with_counts(x.to(device), rid.to(torch.uint8).to(device), c.to(device), method="onehot",
                                     block_k=32, block_n=16, chunk=64)
    want, wcnt = ref.update_with_counts(x, rid, c)
    torch.testing.assert_close(new.cpu(), want, atol=1e-5 * x.abs().amax().item(), rtol=0)
    assert torch.equal(cnt.cpu().float(), wcnt)


@pytest.mark.parametrize("method", ["onehot", "sort", "segsum"])
def test_update_uint16_ids(method, device):
    k = 300
    x, _ = _blobs(1, 600, 32, 50, seed=2)
    c = x[:, :k].clone()
    rid, _ = ref.assign(x, c)
    new = kk.update(x.to(device), rid.to(torch.uint16).to(device), c.to(device), method=method).cpu()
    torch.testing.assert_close(new, ref.update(x, rid, c), atol=1e-4 * x.abs().amax().item(), rtol=0)


MIN_MODES = [dict(mode="min"), dict(mode="min", block_k=256, num_warps=8), dict(mode="min", block_k=16, block_n=32),
             dict(mode="min", block_k=512, progs=2), dict(mode="min", block_n=16, progs=3),
             dict(mode="min", block_k=256, progs=2, num_stages=3)]  # (k = 300: two centroid tiles, 3 deep)


@pytest.mark.parametrize("kw", MIN_MODES)
@pytest.mark.parametrize("k", [20, 256, 300])
def test_assign_min_mode_equals_tiles(kw, k, device):
    """mode="min" (one reduction per token, one tile or a persistent loop) returns the tiled kernel's ids and
    distances bitwise, duplicated centroids (ties) included."""
    x, centres = _blobs(2, 150, 32, min(k, 24), seed=k + 1)
    c = torch.cat([centres, torch.randn(2, k - centres.shape[1], 32, generator=gen(2)) * 3], 1)
    c[:, k - 1] = c[:, 3]  # a tie: the lower id wins
    c[:, k // 2] = c[:, 5]
    want, wdist = kk.assign(x.bfloat16().to(device), c.to(device), True)
    with poisoned():
        ids, dist = kk.assign(x.bfloat16().to(device), c.to(device), True, **kw)
    ids2, none = kk.assign(x.bfloat16().to(device), c.to(device), **kw)
    assert none is None and torch.equal(ids2.cpu(), ids.cpu())
    if device == "cpu" or (kw.get("block_n", 64), kw.get("num_warps", 4)) == (64, 4):
        assert_bitwise_equal(ids, want, f"ids {kw}")
        assert_bitwise_equal(dist, wdist, f"distances {kw}")
        return
    # other token tiles or warp counts split the GPU's tensor-core dot differently (its FP32 sums round
    # differently): every id a nearest centroid, distances within FP32 rounding
    torch.testing.assert_close(dist.cpu(), wdist.cpu(), rtol=1e-5, atol=1e-4)
    full = torch.cdist(x.bfloat16().float(), c.bfloat16().float()).pow(2)  # the kernel's operands
    got = full.gather(2, ids.cpu().long()[..., None])[..., 0]
    assert (got <= full.amin(2) * (1 + 1e-5) + 1e-4).all(), f"ids {kw} are not nearest centroids"


FAST = {k: v for k, v in COMPRESS_VARIANTS["fast"].items() if k != "pack_kw"}


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("variant", [{}, FAST])
def test_kmeans_end_to_end(warm, variant, device):
    x, centres = _blobs(2, 300, 32, 16, seed=5)
    k = 16
    init = (centres + 0.3 * torch.randn(centres.shape, generator=gen(6))) if warm else None
    want = ref.kmeans(x, k, iters=3, init=init, seed=3, track=True)
    got = kk.kmeans(x.to(device), k, iters=3, init=None if init is None else init.to(device), seed=3, track=True,
                    **variant)
    assert got.ids.dtype == torch.uint8 and got.centroids.dtype == torch.float32
    torch.testing.assert_close(got.trace.cpu(), want.trace, rtol=1e-2, atol=0)
    agree = (got.ids.cpu() == want.ids).float().mean().item()
    assert agree > 0.97, agree
    again = kk.kmeans(x.to(device), k, iters=3, init=None if init is None else init.to(device), seed=3, track=True,
                      **variant)
    assert torch.equal(again.ids.cpu(), got.ids.cpu())
    assert_bitwise_equal(again.centroids, got.centroids, "kmeans is deterministic")
