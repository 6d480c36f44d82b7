"""kernels/compress.py's presets: the default "auto" picks one by shape (`pick_variant`, from the whole-compress
sweeps in eval/results/compress-sweep-h100.md), every preset returns the same compression, and the benchmark's
`compress=` flag selects one."""
import types

import pytest
import torch

import qvg
from kernel_helpers import clustered, poisoned
from qvg.kernels import compress as kc


@pytest.mark.parametrize("groups,tokens,k,want", [
    (12, 4680, 64, "fast-onehot"),  # a Self-Forcing chunk with the cache's K (the pipeline's commits)
    (12, 4680, 256, "fast-onehot"),
    (12, 9360, 128, "fast-onehot"),  # two chunks per unit
    (12, 37440, 64, "fast-onehot-1024"),
    (32, 29640, 64, "fast-onehot-1024"),
    (12, 14040, 128, "fast-sort"),
    (12, 37440, 256, "fast-sort"),
    (32, 14820, 128, "fast-sort"),
    (32, 29640, 256, "fast"),  # the LongCat span: unchanged
    (32, 29640, 128, "fast"),
    (1, 100, 1024, "fast-sort"),  # K above the measured one-hot range
])
def test_pick_variant_follows_the_sweeps(groups, tokens, k, want):
    assert kc.pick_variant(groups, tokens, k) == want


def test_resolve_variant():
    assert kc.resolve_variant("auto", 12, 4680, 64) is kc.COMPRESS_VARIANTS["fast-onehot"]
    assert kc.resolve_variant(None, 32, 29640, 256) is kc.COMPRESS_VARIANTS["fast"]  # the default is "auto"
    assert kc.resolve_variant("fast-sort", 12, 4680, 64) is kc.COMPRESS_VARIANTS["fast-sort"]
    own = {"assign_kw": {}}
    assert kc.resolve_variant(own, 1, 1, 1) is own
    with pytest.raises(ValueError, match="unknown compress variant 'nope'"):
        kc.resolve_variant("nope", 1, 1, 1)


def test_use_variant_sets_and_restores():
    assert kc.COMPRESS_VARIANT == "auto"
    with kc.use_variant("fast"):
        assert kc.COMPRESS_VARIANT == "fast"
        assert kc.resolve_variant(None, 12, 4680, 64) is kc.COMPRESS_VARIANTS["fast"]
    assert kc.COMPRESS_VARIANT == "auto"
    with pytest.raises(RuntimeError), kc.use_variant("fast-sort"):
        raise RuntimeError("inside")
    assert kc.COMPRESS_VARIANT == "auto"
    with pytest.raises(ValueError, match="unknown compress variant"), kc.use_variant("nope"):
        pass
    assert kc.COMPRESS_VARIANT == "auto"


@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_presets_compress_alike(method, device):
    """The one-hot presets and the segmented-sum presets give the same ids and (up to the order of the FP32 cluster
    sums) the same centroids and codes; "auto" is the preset it picks, bitwise."""
    x = clustered(1, 2, 96, 64, clusters=6, seed=4).to(device)
    o = qvg.compress(x.cpu(), method, centroids=6, iters=2, grid="midrise").meta
    out = {}
    for name in ("auto", "fast-onehot", "fast", "fast-sort"):
        with poisoned():
            out[name] = kc.compress_prq(x, o, None, 2, variant=name)
    assert kc.pick_variant(2, 96, 6) == "fast-onehot"
    for t in out["auto"]:
        assert torch.equal(out["auto"][t], out["fast-onehot"][t]), t
    for name in ("fast", "fast-sort"):
        assert torch.equal(out[name]["ids"], out["fast-onehot"]["ids"]), name
        torch.testing.assert_close(out[name]["centroids"].float(), out["fast-onehot"]["centroids"].float(),
                                   rtol=1e-2, atol=1e-2)


def test_bench_pipeline_compress_flag():
    """`qvg:compress=NAME` builds a cache tagged with that preset (`_fill` and the chunk runner apply it); an unknown
    preset is refused before anything runs."""
    from qvg.eval import bench_pipeline as bp
    model = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: 16)
    cache = bp.new_cache(model, "qvg:compress=fast-sort", 6, {"centroids": 4})
    assert cache.method == "qvg" and cache.bench_compress_variant == "fast-sort"
    with bp._variant(cache):
        assert kc.COMPRESS_VARIANT == "fast-sort"
    assert kc.COMPRESS_VARIANT == "auto"
    assert bp.new_cache(model, "qvg:noprefetch", 6, {}).bench_compress_variant is None
    with pytest.raises(ValueError, match="unknown compress variant 'nope'"):
        bp.new_cache(model, "qvg:compress=nope", 6, {})
    with pytest.raises(ValueError, match="unknown method flag"):
        bp.new_cache(model, "qvg:bogus", 6, {})
