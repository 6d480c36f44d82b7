"""The core on CUDA (skipped without a GPU): same guarantees as on CPU — error bounds, determinism, real bytes."""
import pytest
import torch

import qvg
from qvg.kmeans import kmeans
from qvg.compression.registry import token_spec
from qvg.quant import step_size

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _clustered(g=4, n=3000, d=128, k=32, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(g, k, d, generator=gen) * 10
    ids = torch.randint(0, k, (g, n), generator=gen)
    x = torch.gather(centers, 1, ids[..., None].expand(-1, -1, d)) + torch.randn(g, n, d, generator=gen)
    return x.view(1, g, n, d).to(device)


@cuda
@pytest.mark.parametrize("method", qvg.methods())
def test_methods_on_cuda(method):
    x = _clustered().bfloat16()
    p = qvg.compress(x, method)
    assert p.device.type == "cuda"
    y = qvg.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_cuda
    p2 = qvg.compress(x, method)
    assert all(torch.equal(p.tensors[n], p2.tensors[n]) for n in p.tensors), "not deterministic on CUDA"
    if method in ("rtn", "qvg", "qvg-pro"):
        err = (y.float() - x.float()).abs()
        bound = step_size(p.tensors, token_spec(p.meta)) / 2
        assert bool((err <= bound * (1 + 2.0 ** -8) + 2.0 ** -8 * x.float().abs() + 1e-6).all())  # + bf16 rounding of y


@cuda
def test_qvg_beats_rtn_on_cuda():
    x = _clustered(seed=1)
    mse = {m: (qvg.decompress(qvg.compress(x, m)) - x).pow(2).mean().item() for m in ("rtn", "qvg")}
    assert mse["qvg"] < 0.5 * mse["rtn"], mse


@cuda
def test_kmeans_cuda_deterministic_and_warm():
    x = _clustered(g=12, n=5000).view(12, 5000, 128)
    a = kmeans(x, 256, iters=4, seed=3)
    b = kmeans(x, 256, iters=4, seed=3)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.centroids, b.centroids)
    assert a.ids.dtype == torch.uint8
    w = kmeans(x, 256, iters=2, init=a.centroids, track=True)
    assert bool((w.trace[1:] <= w.trace[:-1] * (1 + 1e-5)).all())


@cuda
@pytest.mark.parametrize("method", qvg.methods())
def test_non_finite_input_is_refused_on_cuda_after_the_queued_compression(method):
    """On CUDA the NaN/inf scan's verdict is waited for after the compression is queued (which then ran on the bad
    input): every method, cold and warm-started, still raises the one ValueError, and the device stays usable (no
    device-side assert from indices computed off NaN data: the next compression is the same as on a fresh input)."""
    kw = {"centroids": 16} if method.startswith("qvg") else {}
    x = _clustered(n=512).bfloat16()
    good = qvg.compress(x, method, **kw)
    for bad_value in (float("nan"), float("inf"), -float("inf")):
        bad = x.clone()
        bad[0, 1, 100, 7] = bad_value
        for init in ((None, good) if kw else (None,)):
            with pytest.raises(ValueError, match="non-finite"):
                qvg.compress(bad, method, init=init, **kw)
    again = qvg.compress(x, method, **kw)
    torch.cuda.synchronize()
    assert all(torch.equal(good.tensors[n], again.tensors[n]) for n in good.tensors)
    assert qvg.compress(bad, method, check_finite=False, **kw).device.type == "cuda"  # (no scan, no error)
