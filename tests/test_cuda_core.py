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
@pytest.mark.parametrize("read", ["window", "staged", "fused"])
@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("method", ["rtn", "qvg", "qvg-pro"])
def test_every_head_dim_on_cuda(method, d, read):
    """Head dims the Triton kernels take (powers of two, 16-256) run them, others (80, 96) the torch reference on
    the GPU (`kernel_head_dim`): compress / decompress within the quantizer's bound, and a cache's commit and
    attend agree with SDPA over its own read() (a Triton compile error at D=96 before)."""
    from qvg.backend import kernel_head_dim
    from qvg.cache import KVCache
    x = _clustered(g=2, n=512, d=d, k=8).bfloat16()
    kw = dict(block_size=16, **({} if method == "rtn" else {"centroids": 16}))
    p = qvg.compress(x, method, **kw)
    y = qvg.decompress(p)
    assert y.shape == x.shape and y.is_cuda
    assert torch.equal(y.cpu(), qvg.decompress(p.to("cpu")))  # (either path on the GPU decodes as the CPU does)
    bound = step_size(p.tensors, token_spec(p.meta)) / 2
    assert bool(((y.float() - x.float()).abs() <= bound * (1 + 2.0 ** -8) + 2.0 ** -8 * x.float().abs() + 1e-6).all())
    c = KVCache(1, method, chunk_frames=1, tokens_per_frame=256, sink_frames=0, read=read, **kw)
    for i in range(3):  # two committed chunks, then the current one
        c.write(0, x[:, :, 256 * (i % 2):256 * (i % 2 + 1)], x[:, :, 256 * (i % 2):256 * (i % 2 + 1)].flip(-1))
        if i < 2:
            c.commit()
    q = torch.randn(1, 2, 64, d, device="cuda", dtype=torch.bfloat16)
    out = c.attend(0, q)
    k, v = c.read(0)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert (out.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    assert (c.reads["reference"] == 0) is kernel_head_dim(d), c.reads


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
    big = x.double()
    big[0, 0, 3, 5] = 1e39  # float64 beyond float32's range: inf where the methods compute (the CUDA scan too)
    with pytest.raises(ValueError, match="magnitudes above 1e36"):
        qvg.compress(big, method, **kw)
    near = x.clone()
    near[0, 1, 2, 3] = 3e37  # finite float32 past the limit: refused on CUDA too
    with pytest.raises(ValueError, match="magnitudes above 1e36"):
        qvg.compress(near, method, **kw)


@cuda
def test_the_finite_verdict_is_awaited_after_the_compression_is_queued(monkeypatch):
    """The order on CUDA: the scan is queued, then the compression, then its verdict is awaited; and a NaN input
    whose options are also wrong is named non-finite first, as on the CPU."""
    import dataclasses

    import qvg.compression as C
    log, real_later, real_get = [], C._finite_later, C.get_method

    def later(x):
        log.append("scan queued")
        check = real_later(x)
        return lambda: (log.append("verdict awaited"), check())

    def get_method(name):
        m = real_get(name)
        return dataclasses.replace(m, compress=lambda *a: (log.append("compression queued"), m.compress(*a))[1])
    monkeypatch.setattr(C, "_finite_later", later)
    monkeypatch.setattr(C, "get_method", get_method)
    x = _clustered(n=256).bfloat16()
    qvg.compress(x, "rtn")
    assert log == ["scan queued", "compression queued", "verdict awaited"], log
    x[0, 0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        qvg.compress(x, "rtn", bits=3)  # (bits=3 alone: "unsupported bits")
    with pytest.raises(ValueError, match="non-finite"):
        qvg.compress(torch.full((1, 1, 4, 64), float("nan")), "rtn", bits=3)  # (CPU: the same)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_finite_verdict_waits_on_the_inputs_device():
    """x on cuda:1 while cuda:0 is current, behind a long kernel on cuda:1: the verdict is the scan's, not the
    pinned buffer's value before the copy lands."""
    with torch.cuda.device(0):
        for _ in range(3):
            x = _clustered(n=256, device="cuda:1").bfloat16()
            x[0, 0, 3, 5] = float("nan")
            with torch.cuda.device(1):
                torch.cuda._sleep(50_000_000)  # cuda:1 busy: the scan and its copy land late
            with pytest.raises(ValueError, match="non-finite"):
                qvg.compress(x, "rtn")
            assert qvg.compress(x.nan_to_num(), "rtn").device == torch.device("cuda:1")
