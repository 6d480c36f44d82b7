"""The public API: qvg.compress / decompress / methods / bits_per_element, and the Packed container."""
import itertools

import pytest
import torch

import qvg
from conftest import assert_within_half_step, clustered_kv, gen, randn, random_shapes, with_outliers
from qvg.compression import kivi as kivi_mod
from qvg.compression.registry import token_spec
from qvg.packed import COMPONENTS
from qvg.quant import dequantize_packed, step_size
from qvg.rotation import rotate, rotation

METHODS = ["rtn", "kivi", "quarot", "qvg", "qvg-pro"]
FAST_KMEANS = dict(centroids=16, iters=2)  # small k-means for property tests on short inputs


def opts(method, **extra):
    """Options that make `method` valid and fast on short inputs (N >= 16)."""
    return {**(FAST_KMEANS if method.startswith("qvg") else {}), **extra}


def mse(a, b):
    return ((a.float() - b.float()) ** 2).mean().item()


def smoothing(p, absolute=False):
    """Sum over the stages of each token's (stored, BF16) centroid: what QVG subtracted, [B, H, N, D] float32."""
    b, h, n, d = p.shape
    out = torch.zeros(b * h, n, d)
    for s in range(p.meta["stages"]):
        c = p.centroids[s].reshape(b * h, -1, d).float()
        g = torch.gather(c, 1, p.ids[s].reshape(b * h, n).long()[..., None].expand(-1, -1, d))
        out += g.abs() if absolute else g
    return out.view(b, h, n, d)


# --- registry and presets -----------------------------------------------------------------------------------------

def test_methods_list():
    assert qvg.methods() == METHODS
    details = qvg.methods(details=True)
    assert list(details) == METHODS
    for d in details.values():
        assert set(d) == {"summary", "defaults", "formula"} and d["summary"] and d["formula"]


def test_presets():
    d = qvg.methods(details=True)
    assert d["qvg"]["defaults"]["stages"] == 1 and d["qvg"]["defaults"]["block_size"] == 64
    assert d["qvg"]["defaults"]["centroids"] == 256 and d["qvg"]["defaults"]["bits"] == 2
    assert d["qvg-pro"]["defaults"]["stages"] == 4 and d["qvg-pro"]["defaults"]["block_size"] == 16
    assert d["kivi"]["defaults"]["block_size"] == 32 and d["kivi"]["defaults"]["grid"] == "asym"
    for m in METHODS:
        assert d[m]["defaults"]["bits"] == 2


def test_preset_applied_and_overridable():
    x = randn(1, 2, 300, 64, seed=0)
    p = qvg.compress(x, "qvg-pro", centroids=16, iters=1)
    assert p.meta["stages"] == 4 and p.meta["block_size"] == 16
    assert p.scale.shape == (1, 2, 300, 64 // 16)
    assert p.ids.shape == (4, 1, 2, 300) and p.centroids.shape == (4, 1, 2, 16, 64)
    q = qvg.compress(x, "qvg-pro", centroids=16, iters=1, block_size=64, stages=2)
    assert q.meta["stages"] == 2 and q.meta["block_size"] == 64
    assert q.scale.shape == (1, 2, 300, 1) and q.ids.shape == (2, 1, 2, 300)
    # None means "the preset"
    assert qvg.compress(x, "rtn", bits=None).meta == qvg.compress(x, "rtn").meta


# --- shapes and dtypes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHODS)
def test_decompress_shape_and_dtype(method, dtype):
    x = randn(2, 3, 77, 64, seed=1, dtype=dtype)
    p = qvg.compress(x, method, **opts(method))
    assert p.method == method and p.shape == (2, 3, 77, 64) and p.dtype == dtype
    y = qvg.decompress(p)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert mse(x, y) < 0.5 * mse(x, torch.zeros_like(x))  # it is an approximation of x


@pytest.mark.parametrize("method", METHODS)
def test_non_contiguous_input(method):
    x = randn(1, 2, 64, 48, seed=2).transpose(2, 3)  # [1, 2, 48, 64], non-contiguous
    assert not x.is_contiguous()
    a = qvg.decompress(qvg.compress(x, method, **opts(method)))
    b = qvg.decompress(qvg.compress(x.contiguous(), method, **opts(method)))
    assert torch.equal(a, b)


# --- error bounds on random shapes and magnitudes -----------------------------------------------------------------

MAGNITUDES = [pytest.param(1e-3, False, id="1e-3"), pytest.param(1.0, False, id="1"),
              pytest.param(1e2, True, id="1e2-outliers"), pytest.param(1e3, False, id="1e3")]
CASES = ["rtn", "quarot", "kivi-key", "kivi-value", "qvg", "qvg-pro"]


def property_inputs(case, mag, outliers):
    seed = CASES.index(case) * 10 + int(outliers)
    for i, (b, h, n, d) in enumerate(random_shapes(seed, 3, n=(37, 301, 1013))):
        x = randn(b, h, n, d, seed=seed * 100 + i, scale=mag)
        if outliers:
            x = with_outliers(x, channels=4, factor=1e3, seed=seed + i)
        yield x


def assert_kivi_bound(x, p):
    o = p.meta
    nq = kivi_mod.quantized_tokens(x.shape[2], o)
    res = p.residual
    assert res.shape == (*x.shape[:2], x.shape[2] - nq, x.shape[3])
    y = qvg.decompress(p)
    # the residual tokens are exact at 16 bits (bf16 for a float32 input)
    assert torch.equal(y[:, :, nq:], x[:, :, nq:].to(res.dtype).to(x.dtype))
    if nq:
        spec = kivi_mod.spec(o)
        assert_within_half_step(x[:, :, :nq], y[:, :, :nq], step_size(p.tensors, spec), what="kivi")


@pytest.mark.parametrize("mag,outliers", MAGNITUDES)
@pytest.mark.parametrize("case", CASES)
def test_error_within_analytic_bound(case, mag, outliers):
    method, _, role = case.partition("-") if case.startswith("kivi") else (case, "", "")
    for x in property_inputs(case, mag, outliers):
        extra = {"role": role} if role else {}
        if method.startswith("qvg"):  # the preset K=256 where N allows it
            extra = dict(centroids=256 if x.shape[2] >= 256 else 16, iters=2)
        p = qvg.compress(x, method, **opts(method, **extra))
        y = qvg.decompress(p)
        assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
        d = x.shape[-1]
        if method == "kivi":
            assert_kivi_bound(x, p)
            continue
        spec = token_spec(p.meta)
        step = step_size(p.tensors, spec)
        if method == "quarot":
            r = rotation(d, p.meta["seed"], p.meta["signs"])
            xr = rotate(x, r)
            assert_within_half_step(xr, dequantize_packed(p.tensors, spec, d), step, what="quarot (rotated)")
            # rotation is orthogonal: per-token L2 error <= L2 norm of the per-element bound
            err = (x - y).norm(dim=-1)
            bound = (step / 2).norm(dim=-1) * (1 + 1e-4) + 1e-5 * x.norm(dim=-1)
            assert (err <= bound).all()
        elif method == "rtn":
            assert_within_half_step(x, y, step, what=case)
        else:  # qvg, qvg-pro: the error is the residual's quantization error, up to the rounding of adding and
            # subtracting the centroids (relative to their size, not x's)
            assert_within_half_step(x, y, step, what=case, magnitude=x.abs() + smoothing(p, absolute=True))


@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_qvg_error_is_residual_quantization_error(method):
    x = clustered_kv(1, 2, 300, 64, clusters=8, seed=3)
    p = qvg.compress(x, method, centroids=8, iters=3)
    residual = x - smoothing(p)
    r_hat = dequantize_packed(p.tensors, token_spec(p.meta), x.shape[-1])
    torch.testing.assert_close(x - qvg.decompress(p), residual - r_hat, rtol=0, atol=1e-5)


def test_qvg_uint16_ids_within_bound():
    x = clustered_kv(1, 2, 700, 64, clusters=400, seed=26)
    p = qvg.compress(x, "qvg", centroids=300, stages=2, iters=2)
    assert p.ids.dtype == torch.uint16 and int(p.ids.long().max()) > 255
    y = qvg.decompress(p)
    step = step_size(p.tensors, token_spec(p.meta))
    assert_within_half_step(x, y, step, what="qvg K=300", magnitude=x.abs() + smoothing(p, absolute=True))


# --- QVG vs RTN on clustered data ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clustered():
    return clustered_kv(1, 2, 1024, 64, clusters=32, spread=10.0, noise=0.3, seed=4)


@pytest.mark.parametrize("centroids", [32, 256])
@pytest.mark.parametrize("bits", [2, 4])
def test_qvg_beats_rtn_on_clustered(clustered, bits, centroids):
    e_rtn = mse(clustered, qvg.decompress(qvg.compress(clustered, "rtn", bits=bits, block_size=64)))
    p = qvg.compress(clustered, "qvg", bits=bits, block_size=64, centroids=centroids)
    e_qvg = mse(clustered, qvg.decompress(p))
    assert e_qvg < 0.5 * e_rtn, (e_qvg, e_rtn)


@pytest.mark.parametrize("bits", [2, 4])
def test_mse_decreases_with_stages(clustered, bits):
    errs = [mse(clustered, qvg.decompress(qvg.compress(clustered, "qvg", bits=bits, stages=s, centroids=32)))
            for s in range(5)]
    for a, b in zip(errs, errs[1:]):
        assert b <= a * 1.01, errs
    assert errs[1] < 0.5 * errs[0]


def test_stages_zero_equals_rtn_bitwise():
    x = randn(2, 2, 129, 128, seed=5)
    for kw in ({}, dict(bits=4, block_size=32, scale_dtype="bf16"), dict(grid="asym"), dict(grid="sym", bits=8)):
        a = qvg.compress(x, "qvg", stages=0, **kw)
        b = qvg.compress(x, "rtn", **kw)
        assert a.tensors.keys() == b.tensors.keys() == ({"codes", "scale", "zero", "tscale"} & a.tensors.keys())
        for k in a.tensors:
            assert torch.equal(a.tensors[k].view(torch.uint8), b.tensors[k].view(torch.uint8)), k
        assert torch.equal(qvg.decompress(a), qvg.decompress(b))


# --- determinism and warm start -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_deterministic(method):
    x = randn(1, 2, 200, 64, seed=6)
    outs = [qvg.compress(x.clone(), method, **qvg.compression.seeded(method, 3), **opts(method)) for _ in range(3)]
    for p in outs[1:]:
        assert p.tensors.keys() == outs[0].tensors.keys()
        for k in p.tensors:
            assert torch.equal(p.tensors[k].view(torch.uint8), outs[0].tensors[k].view(torch.uint8))
        assert torch.equal(qvg.decompress(p), qvg.decompress(outs[0]))


def test_kmeans_methods_are_the_warm_started_ones_and_the_ui_spells_them_alike():
    from qvg.app.ui_run import KMEANS
    assert qvg.compression.kmeans_methods() == ("qvg", "qvg-pro") == KMEANS
    assert qvg.compression.seeded("rtn", 3) == {} and qvg.compression.seeded("quarot", 3) == {"seed": 3}


@pytest.mark.parametrize("method", ["qvg", "quarot"])
def test_seed_matters(method):
    x = randn(1, 2, 200, 64, seed=7)
    a, b = (qvg.decompress(qvg.compress(x, method, seed=s, **opts(method))) for s in (0, 1))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("method", ["rtn", "kivi"])
def test_a_seed_is_refused_where_nothing_is_random(method):
    """rtn and kivi have no random part: a seed is refused (it was taken and ignored, and reported as an option)."""
    assert "seed" not in qvg.compression.methods(details=True)[method]["defaults"]
    with pytest.raises(ValueError, match=f"method '{method}' takes no option 'seed'"):
        qvg.compress(randn(1, 2, 64, 64, seed=1), method, seed=3)


def test_quarot_without_signs_is_seed_independent():
    x = randn(1, 2, 100, 64, seed=8)
    a, b = (qvg.decompress(qvg.compress(x, "quarot", seed=s, signs=False)) for s in (0, 1))
    assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_warm_start(method):
    g = gen(9)
    x1, x2 = clustered_kv(1, 2, 400, 64, clusters=16, seed=10), clustered_kv(1, 2, 400, 64, clusters=16, seed=10)
    x2 = x2 + 0.05 * torch.randn(x2.shape, generator=g)  # the "next chunk": similar content
    p1 = qvg.compress(x1, method, centroids=16)
    cold = qvg.compress(x2, method, centroids=16)
    warm = qvg.compress(x2, method, centroids=16, init=p1)
    assert {k: v.shape for k, v in warm.tensors.items()} == {k: v.shape for k, v in cold.tensors.items()}
    assert {k: v.dtype for k, v in warm.tensors.items()} == {k: v.dtype for k, v in cold.tensors.items()}
    assert warm.meta == cold.meta
    y = qvg.decompress(warm)
    assert y.shape == x2.shape and mse(x2, y) <= 1.1 * mse(x2, qvg.decompress(cold))
    # the init may be given as the centroid tensor [S, B, H, K, D] as well; a warm start defaults to 2 iterations
    same = qvg.compress(x2, method, centroids=16, init=p1.centroids, iters=2)
    for k in warm.tensors:
        assert torch.equal(warm.tensors[k].view(torch.uint8), same.tensors[k].view(torch.uint8))


def test_warm_start_from_converged_centroids_changes_nothing():
    x = clustered_kv(1, 2, 300, 64, clusters=8, seed=11)
    p = qvg.compress(x, "qvg", centroids=8, iters=30)
    q = qvg.compress(x, "qvg", centroids=8, init=p)
    assert torch.equal(q.ids, p.ids)
    assert torch.equal(q.centroids, p.centroids)


@pytest.mark.parametrize("bad", ["S", "K", "D", "tensor"])
def test_warm_start_wrong_init_shape(bad):
    x = randn(1, 2, 100, 64, seed=12)
    p = qvg.compress(x, "qvg", centroids=8, iters=1)
    init = {"S": lambda: qvg.compress(x, "qvg", centroids=8, iters=1, stages=2),
            "K": lambda: qvg.compress(x, "qvg", centroids=4, iters=1),
            "D": lambda: qvg.compress(randn(1, 2, 100, 128, seed=13), "qvg", centroids=8, iters=1),
            "tensor": lambda: p.centroids[0]}[bad]()
    with pytest.raises(ValueError, match=r"init: a qvg / qvg-pro Packed or centroids of shape \[S, B, H, K, D\]"):
        qvg.compress(x, "qvg", centroids=8, init=init)


# --- storage accounting -------------------------------------------------------------------------------------------

ACCOUNTING = [("rtn", {}), ("rtn", dict(bits=4, block_size=32, scale_dtype="bf16")), ("rtn", dict(bits=1)),
              ("rtn", dict(bits=8, grid="asym")), ("kivi", {}), ("kivi", dict(role="value")),
              ("kivi", dict(residual=70, scale_dtype="fp8")), ("quarot", {}), ("quarot", dict(bits=4)),
              ("qvg", dict(centroids=16, iters=1)), ("qvg", dict(centroids=300, iters=0, stages=2)),
              ("qvg", dict(centroids=16, iters=1, grid="asym", scale_dtype="bf16")),
              ("qvg-pro", dict(centroids=16, iters=1))]


@pytest.mark.parametrize("method,kw", ACCOUNTING, ids=[f"{m}-{i}" for i, (m, _) in enumerate(ACCOUNTING)])
def test_nbytes_and_components(method, kw):
    x = randn(2, 2, 333, 64, seed=14)
    p = qvg.compress(x, method, **kw)
    total = sum(t.numel() * t.element_size() for t in p.tensors.values())
    assert p.nbytes == total
    comps = p.components()
    assert sum(comps.values()) == p.nbytes
    assert set(comps) <= set(COMPONENTS.values())
    assert "codes" in comps and "scales" in comps
    assert ("ids" in comps) == ("centroids" in comps) == method.startswith("qvg")
    assert ("bf16" in comps) == (method == "kivi")
    assert p.bits_per_element == pytest.approx(8 * p.nbytes / x.numel(), rel=1e-12)
    # the analytic formula is the storage layout: exact agreement
    assert qvg.bits_per_element(method, x.shape, **kw) == pytest.approx(p.bits_per_element, rel=1e-12)
    if method.startswith("qvg"):
        assert p.ids.dtype == (torch.uint8 if p.meta["centroids"] <= 256 else torch.uint16)
        assert p.centroids.dtype == torch.bfloat16


@pytest.mark.parametrize("method", METHODS)
def test_bits_per_element_matches_nbytes_large(method):
    shape = (1, 2, 8192, 128)
    x = randn(*shape, seed=15)
    kw = {"iters": 1} if method.startswith("qvg") else {}
    p = qvg.compress(x, method, **kw)
    analytic = qvg.bits_per_element(method, shape)
    assert analytic == pytest.approx(p.nbytes * 8 / x.numel(), rel=1e-12)


def test_bits_per_element_qvg_k256_n29640():
    shape = (1, 1, 29640, 128)
    p = qvg.compress(randn(*shape, seed=16), "qvg", iters=1)
    assert p.centroids.shape == (1, 1, 1, 256, 128)
    assert qvg.bits_per_element("qvg", shape) == pytest.approx(p.nbytes * 8 / (29640 * 128), rel=1e-12)
    assert p.bits_per_element == pytest.approx(2.3257, abs=1e-4)


@pytest.mark.parametrize("method,expected,digits", [("rtn", 2.125, 3), ("kivi", 3.00, 2), ("quarot", 2.125, 3),
                                                    ("qvg", 2.326, 3), ("qvg-pro", 3.303, 3)])
def test_bit_budget_readme_table(method, expected, digits):
    """The README's INT2 column at N=29640, D=128, to the digits printed there (kivi: 3.0035, the 29640 % 32 = 8
    tail tokens are 16-bit); the bits don't depend on B or H."""
    for shape in [(1, 12, 29640, 128), (2, 1, 29640, 128)]:
        assert round(qvg.bits_per_element(method, shape), digits) == expected


def test_bits_per_element_formula_terms():
    n, d = 29640, 128
    fp8_tscale = 32 / (n * d)
    assert qvg.bits_per_element("qvg", (1, 1, n, d)) == pytest.approx(2 + 8 / 64 + 8 / d + 16 * 256 / n + fp8_tscale)
    assert qvg.bits_per_element("qvg", (1, 1, n, d), centroids=1024, stages=2) == pytest.approx(
        2 + 8 / 64 + 16 * 2 / d + 16 * 2 * 1024 / n + fp8_tscale)
    assert qvg.bits_per_element("rtn", (1, 1, n, d), scale_dtype="bf16", bits=4, block_size=32) == 4 + 16 / 32
    assert qvg.bits_per_element("kivi", (1, 1, 100, d), residual=40) == pytest.approx((32 * 3 + 68 * 16) / 100)


# --- bad inputs ---------------------------------------------------------------------------------------------------

BAD = [
    ("rank3", lambda: qvg.compress(randn(2, 10, 64, seed=0), "rtn"), "rank"),
    ("rank5", lambda: qvg.compress(randn(1, 1, 2, 10, 64, seed=0), "qvg"), "rank"),
    ("block", lambda: qvg.compress(randn(1, 1, 10, 96, seed=0), "rtn"), "not divisible by block_size"),
    ("block-qvg", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", block_size=48), "block_size"),
    ("bits3", lambda: qvg.compress(randn(1, 1, 10, 64, seed=0), "rtn", bits=3), "unsupported bits"),
    ("bits3-qvg", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", bits=3), "unsupported bits"),
    ("bits3-kivi", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", bits=3), "unsupported bits"),
    ("centroids>N", lambda: qvg.compress(randn(1, 1, 100, 64, seed=0), "qvg"), r"centroids \(256\) > tokens"),
    ("centroids>N-pro", lambda: qvg.compress(randn(1, 1, 100, 64, seed=0), "qvg-pro", centroids=101), "> tokens"),
    ("centroids>65536", lambda: qvg.compress(randn(1, 1, 100, 64, seed=0), "qvg", centroids=70000), "centroids"),
    ("nan", lambda: qvg.compress(torch.full((1, 1, 4, 64), float("nan")), "rtn"), "non-finite"),
    ("inf", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0).index_fill(3, torch.tensor([5]), float("inf")),
                                 "qvg"), "non-finite"),
    ("-inf", lambda: qvg.compress(torch.full((1, 1, 4, 64), -float("inf")), "kivi"), "non-finite"),
    ("method", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "gptq"), "unknown method"),
    ("method-bits", lambda: qvg.bits_per_element("qvg2", (1, 1, 4, 64)), "unknown method"),
    ("option", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", groupsize=32), "takes no option"),
    ("option-stages-rtn", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", stages=1), "takes no option"),
    ("option-bits-per-element", lambda: qvg.bits_per_element("kivi", (1, 1, 4, 64), signs=True), "takes no option"),
    ("init-rtn", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", init=torch.zeros(1, 1, 1, 4, 64)),
     "takes no init"),
    ("init-kivi", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", init=torch.zeros(1)), "takes no init"),
    ("quarot-D96", lambda: qvg.compress(randn(1, 1, 4, 96, seed=0), "quarot", block_size=32), "power-of-two"),
    ("decompress-tensor", lambda: qvg.decompress(torch.zeros(1, 1, 4, 64)), "Packed"),
    ("decompress-dict", lambda: qvg.decompress({"codes": torch.zeros(1)}), "Packed"),
    ("not-tensor", lambda: qvg.compress([[[[1.0]]]], "rtn"), "torch.Tensor"),
    ("int-dtype", lambda: qvg.compress(torch.zeros(1, 1, 4, 64, dtype=torch.int32), "rtn"), "floating-point"),
    ("fp8-dtype", lambda: qvg.compress(torch.zeros(1, 1, 4, 64).to(torch.float8_e4m3fn), "rtn"), "floating-point"),
    ("bpe-of-a-tensor", lambda: qvg.bits_per_element("rtn", torch.zeros(1, 1, 4, 64)), "takes the shape, not"),
    ("empty", lambda: qvg.compress(torch.zeros(1, 1, 0, 64), "rtn"), "empty"),
    ("grid", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", grid="nf4"), "unknown grid"),
    ("sym-1bit", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", grid="sym", bits=1), "sym"),
    ("scale-dtype", lambda: qvg.compress(randn(1, 1, 4, 64, seed=0), "rtn", scale_dtype="e5m2"), "scale dtype"),
    ("stages", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", stages=17), "stages"),
    ("stages-neg", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", stages=-1), "stages"),
    ("iters", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", iters=-1), "iters"),
    ("seeding", lambda: qvg.compress(randn(1, 1, 300, 64, seed=0), "qvg", seeding="kmeans||"), "seeding"),
    ("kivi-role", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", role="query"), "role"),
    ("kivi-residual", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", residual=-1), "residual"),
    # (float64 beyond float32's range passed the check and every method returned NaN)
    ("f64-range", lambda: qvg.compress(torch.full((1, 1, 64, 64), 1e39, dtype=torch.float64), "rtn"),
     r"non-finite values \(NaN or inf\) or magnitudes above 1e36"),
    # (finite float32 near its maximum decoded NaN: rtn's FP8 and BF16 scales overflowed, kivi's max - zero)
    *((f"f32-near-max-{m}", lambda m=m: qvg.compress(randn(1, 1, 64, 64, seed=0) * 1e37 / 4, m),
       r"magnitudes above 1e36") for m in ("rtn", "kivi", "qvg")),
    # (a ZeroDivisionError from KIVI's token groups before)
    ("kivi-block0", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", block_size=0), "block size must be"),
    ("kivi-block0-bits", lambda: qvg.bits_per_element("kivi", (1, 1, 64, 64), block_size=0), "block size must be"),
    ("kivi-block0-value", lambda: qvg.compress(randn(1, 1, 64, 64, seed=0), "kivi", role="value", block_size=0),
     "block size must be"),
]


@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in BAD])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("method", METHODS)
def test_float16_near_its_max_decodes_finite(method):
    """Finite float16 input up to 65,000 decodes to finite values, saturated at 65,504 (a decode past it, from
    midrise's top level or a scale rounded up above the group's max, was cast to inf before)."""
    x = randn(1, 2, 64, 64, seed=21)
    x = (x / x.abs().amax() * 65000).half()
    y = qvg.decompress(qvg.compress(x, method, **opts(method)))
    assert y.dtype == torch.float16 and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("kw", [dict(bits=3), dict(grid="nf4")], ids=["bits3", "grid"])
def test_kivi_validates_options_on_short_input(kw):
    with pytest.raises(ValueError):
        qvg.compress(randn(1, 1, 20, 64, seed=0), "kivi", **kw)  # N=20 < block 32: everything is residual


# --- Packed -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_packed_to_round_trip(method):
    x = randn(1, 2, 100, 64, seed=18)
    p = qvg.compress(x, method, **opts(method))
    q = p.to("cpu")
    assert q is not p and q.method == p.method and q.shape == p.shape and q.dtype == p.dtype
    assert q.meta == p.meta and q.meta is not p.meta
    assert q.device == torch.device("cpu") and q.nbytes == p.nbytes
    for k in p.tensors:
        assert q.tensors[k].dtype == p.tensors[k].dtype and torch.equal(q.tensors[k].view(torch.uint8),
                                                                        p.tensors[k].view(torch.uint8))
    assert torch.equal(qvg.decompress(q), qvg.decompress(p))
    assert torch.equal(qvg.decompress(p.to(torch.device("cpu"))), qvg.decompress(p))


def test_packed_attribute_access_and_repr():
    p = qvg.compress(randn(1, 2, 100, 64, seed=19), "qvg", centroids=8, iters=1)
    assert p.codes is p.tensors["codes"] and p.ids is p.tensors["ids"]
    with pytest.raises(AttributeError, match="residual"):
        p.residual
    r = repr(p)
    assert "qvg" in r and "bits/elem" in r and str(p.nbytes) in r


def test_packed_torch_save_round_trip(tmp_path):
    p = qvg.compress(randn(1, 2, 100, 64, seed=20), "qvg", centroids=8, iters=1)
    torch.save(p, tmp_path / "p.pt")
    q = torch.load(tmp_path / "p.pt", weights_only=False)
    assert torch.equal(qvg.decompress(q), qvg.decompress(p))


# --- KIVI specifics -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,block", [(100, 32), (37, 16), (31, 32), (64, 32)])
def test_kivi_key_tail_in_residual(n, block):
    x = randn(1, 2, n, 64, seed=21)
    p = qvg.compress(x, "kivi", role="key", block_size=block)
    nq = n - n % block
    assert p.residual.shape == (1, 2, n % block, 64)
    assert ("codes" in p.tensors) == (nq > 0)
    if nq:
        assert p.codes.shape == (1, 2, nq, 64 * 2 // 8) and p.scale.shape == (1, 2, nq // block, 64)
    y = qvg.decompress(p)
    assert torch.equal(y[:, :, nq:], x[:, :, nq:].bfloat16().float())
    if nq == 0:
        assert qvg.bits_per_element("kivi", x.shape, block_size=block) == 16.0


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("r", [0, 1, 10, 40, 100, 150])
def test_kivi_residual_keeps_last_tokens(role, r):
    n = 100
    x = randn(1, 2, n, 64, seed=22)
    p = qvg.compress(x, "kivi", role=role, residual=r)
    y = qvg.decompress(p)
    kept = min(r, n)
    nq = n - kept
    if role == "key":
        nq -= nq % 32
    assert p.residual.shape[2] == n - nq >= kept
    assert torch.equal(y[:, :, n - kept:], x[:, :, n - kept:].bfloat16().float())
    assert_kivi_bound(x, p)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kivi_residual_keeps_16bit_input_exactly(dtype):
    x = randn(1, 1, 50, 64, seed=23, dtype=dtype)
    p = qvg.compress(x, "kivi", residual=18)
    assert p.residual.dtype == dtype
    assert torch.equal(qvg.decompress(p)[:, :, 32:], x[:, :, 32:])


def test_kivi_key_groups_over_tokens_value_over_channels():
    x = randn(1, 1, 64, 64, seed=24)
    k = qvg.compress(x, "kivi", role="key")
    v = qvg.compress(x, "kivi", role="value")
    assert k.scale.shape == (1, 1, 2, 64)  # [N/G, D]: per channel, groups of 32 tokens
    assert v.scale.shape == (1, 1, 64, 2)  # [N, D/G]: per token, groups of 32 channels


# --- combinations of options all round-trip -----------------------------------------------------------------------

OPTION_GRID = list(itertools.product(["rtn", "quarot", "qvg"], [1, 2, 4, 8], ["auto", "midrise", "asym", "sym"],
                                     ["fp8", "bf16"]))


@pytest.mark.parametrize("method,bits,grid,sd", [c for c in OPTION_GRID if not (c[2] == "sym" and c[1] == 1)])
def test_option_combinations(method, bits, grid, sd):
    x = randn(1, 2, 50, 64, seed=25)
    kw = dict(bits=bits, grid=grid, scale_dtype=sd, block_size=32, **opts(method))
    p = qvg.compress(x, method, **kw)
    y = qvg.decompress(p)
    assert torch.isfinite(y).all()
    assert qvg.bits_per_element(method, x.shape, **kw) == pytest.approx(p.bits_per_element, rel=1e-12)
    if method != "quarot":
        assert_within_half_step(x, y, step_size(p.tensors, token_spec(p.meta)), what=f"{method} {kw}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [16, 48, 64])
def test_packed_storage_owns_its_bytes(method, n):
    """Nothing a Packed holds is a view of the input (KIVI's full-precision residual was, for BF16 input: a cache
    reusing its chunk buffer then read every unit's keys as the newest chunk's)."""
    x = randn(1, 1, n, 64, seed=8).to(torch.bfloat16)
    p = qvg.compress(x, method, **opts(method))
    before = qvg.decompress(p).clone()
    x.zero_()
    assert torch.equal(qvg.decompress(p), before)


def test_packed_storage_holds_no_autograd_graph():
    x = torch.randn(1, 2, 300, 64, requires_grad=True)
    for method in qvg.methods():
        p = qvg.compress(x, method, **({"centroids": 32} if method.startswith("qvg") else {}))
        assert all(t.grad_fn is None and not t.requires_grad for t in p.tensors.values()), method
    for method in ("qvg", "qvg-pro"):  # a warm start from centroids that require grad (were stored with its graph)
        s = 4 if method == "qvg-pro" else 1
        init = torch.randn(s, 1, 2, 32, 64, requires_grad=True)
        p = qvg.compress(x, method, centroids=32, init=init * 2)
        assert all(t.grad_fn is None and not t.requires_grad for t in p.tensors.values()), method


@pytest.mark.parametrize("kw", [dict(bits=True), dict(bits=2.0), dict(block_size=32.0), dict(seed="a"),
                                dict(seed=1.5)])
def test_integer_options_are_checked(kw):
    with pytest.raises(ValueError, match="must be an integer"):
        qvg.compress(torch.randn(1, 1, 40, 64), "quarot", **kw)


def test_bits_per_element_checks_rank():
    with pytest.raises(ValueError, match="rank 4"):
        qvg.bits_per_element("qvg", (2, 300, 64))


def test_option_values_a_library_user_gets_wrong():
    """Out-of-range seeds, truthy strings for flags and a warm start from a method without centroids are one
    ValueError naming the option (were torch's 'Overflow when unpacking long long', accepted, and '... got None')."""
    x = randn(1, 1, 64, 64, seed=9)
    for method, kw, msg in (("qvg", dict(seed=2 ** 70), r"seed must be in \[0, 2\*\*63 - 1\]"),
                            ("qvg", dict(seed=-1), r"seed must be in \[0, 2\*\*63 - 1\]"),
                            ("quarot", dict(signs="no"), "signs must be True or False"),
                            ("rtn", dict(check_finite="no"), "check_finite must be True or False"),
                            ("qvg", dict(init="abc", centroids=4), "init: a qvg / qvg-pro Packed .* got str"),
                            ("qvg", dict(init=qvg.compress(x, "rtn"), centroids=4), "a Packed of 'rtn', which has no")):
        with pytest.raises(ValueError, match=msg):
            qvg.compress(x, method, **kw)
