"""kernels/compress.py's presets: the default "auto" picks one by shape (`pick_variant`, from the whole-compress
sweeps in eval/results/compress-sweep-h100.md), every preset returns the same compression, and the benchmark's
`compress=` flag selects one."""
import types

import pytest
import torch

import qvg
from kernel_helpers import clustered, gen, poisoned
from qvg.kernels import compress as kc


@pytest.mark.parametrize("groups,tokens,k,want", [
    (12, 4680, 64, "fast-onehot"),  # a Self-Forcing chunk with the cache's K (the pipeline's commits)
    (12, 4680, 256, "fast-onehot"),
    (12, 9360, 128, "fast-sort-delta"),  # two chunks per unit
    (96, 4680, 64, "fast-onehot"),  # a batch of 8 chunks
    (12, 37440, 64, "fast-onehot-1024"),
    (32, 29640, 64, "fast-onehot-1024"),
    (12, 14040, 128, "fast-sort-delta"),
    (12, 37440, 256, "fast-sort-delta"),
    (32, 14820, 128, "fast-sort-delta"),
    (32, 29640, 256, "fast-delta"),  # the LongCat span
    (32, 29640, 128, "fast-delta"),
    (1, 100, 1024, "fast-sort-delta"),  # K above the measured one-hot range
])
def test_pick_variant_follows_the_sweeps(groups, tokens, k, want):
    assert kc.pick_variant(groups, tokens, k) == want


def test_resolve_variant():
    assert kc.resolve_variant("auto", 12, 4680, 64) is kc.COMPRESS_VARIANTS["fast-onehot"]
    assert kc.resolve_variant(None, 32, 29640, 256) is kc.COMPRESS_VARIANTS["fast-delta"]  # the default is "auto"
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


@pytest.mark.parametrize("grid", ["midrise", "auto"])
@pytest.mark.parametrize("method,n,warm", [("qvg", 96, False), ("qvg-pro", 96, False), ("qvg", 1100, True)])
def test_presets_compress_alike(method, n, warm, grid, device):
    """Every preset gives the same ids and (up to the order of the FP32 cluster sums) the same centroids; "auto" is
    the preset it picks, bitwise. n = 1100: several 512- and 1024-token one-hot splits, warm-started as the cache
    does."""
    x = clustered(1, 2, n, 64, clusters=6, seed=4)
    prev = qvg.compress(clustered(1, 2, n, 64, clusters=6, seed=5), method, centroids=6, iters=2, grid=grid)
    o = prev.meta
    init = prev.tensors["centroids"].reshape(o["stages"], 2, 6, 64).to(device) if warm else None
    out = {}
    for name in ("auto", "fast-onehot", "fast-onehot-1024", "fast", "fast-sort", "fast-bytes", "fast-s2", "fast-span",
                 "fast-nospan", "fast-recode", "fast-narrow-recode", "fast-delta", "fast-sort-delta"):
        with poisoned():
            out[name] = kc.compress_prq(x.to(device), o, init, 2, variant=name)
    assert kc.pick_variant(2, n, 6) == "fast-onehot"
    for t in out["auto"]:
        assert torch.equal(out["auto"][t], out["fast-onehot"][t]), t
    for t in out["fast"]:  # the assignment's 2-deep prefetch; the packs: one group span per thread (or a group
        # over threads, "narrow"), with or without recoding, and 8 columns per thread with a word- or byte-wise OR
        for name in ("fast-s2", "fast-span", "fast-nospan", "fast-bytes", "fast-recode", "fast-narrow-recode"):
            assert torch.equal(out[name][t], out["fast"][t]), (name, t)  # all the same bits
    for name in ("fast-delta", "fast-sort-delta"):  # incremental second updates: the same BF16 centroids up to an ulp
        base = out[name.replace("-delta", "")]["centroids"].float()
        assert ((out[name]["centroids"].float() - base).abs() <= base.abs() * 2.0 ** -7 + 1e-30).all(), name
    for name in ("fast-onehot-1024", "fast", "fast-sort", "fast-delta", "fast-sort-delta"):
        assert torch.equal(out[name]["ids"], out["fast-onehot"]["ids"]), name
        torch.testing.assert_close(out[name]["centroids"].float(), out["fast-onehot"]["centroids"].float(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(3, 6, 64), (2, 300, 128), (1, 5000, 3)])
def test_head_absmax(shape, device):
    """head_absmax: max|t| per group (several programs per group, a ragged last block), into a given zeroed buffer
    too."""
    t = (torch.randn(shape, generator=gen(2)) * torch.logspace(-3, 3, shape[0])[:, None, None]).to(torch.bfloat16)
    t[0, 1, 2] = -77.0
    want = t.float().abs().amax((1, 2))
    assert torch.equal(kc.head_absmax(t.to(device)).cpu(), want)
    bits = torch.zeros(shape[0], dtype=torch.int32, device=device)
    got = kc.head_absmax(t.to(device), bits)
    assert torch.equal(got.cpu(), want) and got.data_ptr() == bits.data_ptr()


@pytest.mark.parametrize("variant", ["fast-onehot", "fast", "fast-sort", "current"])
@pytest.mark.parametrize("method,opts", [("qvg", {}), ("qvg-pro", {}), ("qvg", {"bits": 4, "grid": "sym"}),
                                         ("qvg-pro", {"bits": 1, "grid": "midrise", "block_size": 32})])
def test_compress_tscale_is_the_references_bound(variant, method, opts, device):
    """The kernels' compress stores the tscale the torch path would store for its own ids and centroids:
    `residual_tscale` of the last stage's k-means input and centroids (found by the update and `head_absmax`, not
    by a pass over the residual), and the codes and scales of the reference quantizer given that tscale."""
    from qvg.compression import prq
    from qvg.quant import quantize_packed as quantize_packed_ref
    from qvg.compression.registry import token_spec
    x = clustered(1, 2, 150, 64, clusters=6, seed=8)
    x[0, 1, 17, 3] = 40.0  # one outlier: the head's max
    o = qvg.compress(x, method, centroids=6, iters=2, **opts).meta
    with poisoned():
        got = kc.compress_prq(x.to(device), o, None, 2, variant=variant)
    s_count = o["stages"]
    ids = got["ids"].cpu().reshape(s_count, 2, 150)
    cents = got["centroids"].cpu().reshape(s_count, 2, 6, 64)
    r = x.float().reshape(2, 150, 64)
    for s in range(s_count - 1):
        r = r - prq._gather(cents[s], ids[s])
    spec = token_spec(o)
    ts = prq.residual_tscale(r.to(torch.bfloat16), cents[-1], spec, (1, 2))
    assert torch.equal(got["tscale"].cpu(), ts)  # bitwise, on every device (`_div` divides IEEE on CUDA too)
    r_last = r - prq._gather(cents[-1], ids[-1])
    want = quantize_packed_ref(r_last.view(1, 2, 150, 64), spec, tscale=got["tscale"].cpu())
    for t in ("codes", "scale"):
        assert torch.equal(got[t].cpu().view(torch.uint8), want[t].view(torch.uint8)), t


def test_cache_compresses_with_its_preset(monkeypatch):
    """KVCache(compress_preset=...) runs its commits' compressions under that preset where the kernels run (and
    restores the default); where the torch reference runs (CPU tensors here) no preset is entered, since that would
    import the kernels, so triton, which a CPU install does not have; bad values are refused."""
    from qvg.cache import KVCache
    seen = []
    real = qvg.cache.compression.compress

    def spy(*a, **kw):
        seen.append(kc.COMPRESS_VARIANT)
        return real(*a, **kw)
    monkeypatch.setattr(qvg.cache.compression, "compress", spy)
    cases = (("qvg", "fast-sort", "fast-sort"), ("qvg", None, "fast"), ("qvg-pro", None, "auto"),
             ("qvg-pro", "fast", "fast"))  # (None: the method's COMMIT_PRESETS entry, else auto)
    for kernels in (False, True):
        # (the cache's own decision; the compression itself still runs the reference on these CPU tensors)
        monkeypatch.setattr(qvg.cache, "use_kernels", lambda x, k=kernels: k)
        for method, preset, want in cases:
            cache = KVCache(1, method, chunk_frames=1, tokens_per_frame=32, centroids=4, compress_preset=preset)
            for _ in range(2):
                cache.write(0, torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64))
                cache.commit()
            assert seen and set(seen) == {want if kernels else "auto"}, (kernels, method, preset, seen)
            seen.clear()
    assert kc.COMPRESS_VARIANT == "auto"
    with pytest.raises(ValueError, match="unknown compress variant 'nope'"):
        KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=32, compress_preset="nope")
    with pytest.raises(ValueError, match="takes no options"):
        KVCache(1, "bf16", chunk_frames=1, tokens_per_frame=32, compress_preset="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_are_keyed_by_preset():
    """A compression graph captured under one preset is not replayed for another."""
    from qvg.compression.graphed import GraphedCompress
    x = clustered(1, 2, 256, 64, clusters=6, seed=4).cuda()
    prev = qvg.compress(x, "qvg", centroids=6)
    init = prev.tensors["centroids"]
    g = GraphedCompress()
    a = g(x, "qvg", init, preset="fast", centroids=6).tensors["ids"].clone()
    b = g(x, "qvg", init, preset="fast-onehot", centroids=6).tensors["ids"].clone()
    c = g(x, "qvg", init, centroids=6).tensors["ids"].clone()  # the default, "auto": fast-onehot at this shape
    assert len(g._graphs) == 3 and torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_split_chains_compress_alike(method):
    """"split": n chains of heads on side streams give bitwise the unsplit preset's tensors (warm starts), eagerly
    and replayed from a CUDA graph (the capture forks onto the side streams and joins them); a cold start and a
    group count it does not divide run unsplit."""
    from qvg.compression.graphed import GraphedCompress
    x = clustered(1, 4, 700, 64, clusters=6, seed=4).cuda()
    prev = qvg.compress(clustered(1, 4, 700, 64, clusters=6, seed=5).cuda(), method, centroids=6, iters=2)
    o = prev.meta
    init = prev.tensors["centroids"].reshape(o["stages"], 4, 6, 64)
    want = kc.compress_prq(x, o, init, 2, variant="fast")
    for name in ("fast-split2", "fast-split4", "fast-split2-1sm"):
        with poisoned():
            got = kc.compress_prq(x, o, init, 2, variant=name)
        torch.cuda.synchronize()
        for t in want:
            assert torch.equal(got[t], want[t]), (name, t)
    assert torch.equal(kc.compress_prq(x, o, None, 2, variant="fast-split2")["ids"],
                       kc.compress_prq(x, o, None, 2, variant="fast")["ids"])
    g = GraphedCompress()
    for _ in range(2):  # capture, then replay
        got = g(x, method, prev.tensors["centroids"], preset="fast-split2", centroids=6, iters=2).tensors
        torch.cuda.synchronize()
        for t in ("ids", "centroids", "codes", "scale", "tscale"):
            assert torch.equal(got[t].reshape(want[t].shape), want[t]), t


def test_bench_pipeline_compress_flag():
    """`qvg:compress=NAME` builds a cache with that compress_preset; bad method strings are refused by
    parse_method (bench_pipeline's main checks them all before building the model)."""
    from qvg.eval import bench_pipeline as bp
    model = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: 16)
    assert bp.new_cache(model, "qvg:compress=fast-sort", 6, {"centroids": 4}).compress_preset == "fast-sort"
    assert bp.new_cache(model, "qvg:noprefetch", 6, {}).compress_preset == "fast"  # (qvg's commit preset)
    assert bp.new_cache(model, "qvg-pro", 6, {}).compress_preset is None
    assert bp.parse_method("qvg-pro:sync:compress=fast") == ("qvg-pro", ["sync"], "fast")
    assert bp.new_cache(model, "qvg:staged-read", 6, {}).read_mode == "staged"
    assert bp.new_cache(model, "qvg-pro:fused-read", 6, {}).read_mode == "fused"
    assert bp.new_cache(model, "qvg:pre-rope:fused-read", 6, {}).key_storage == "pre-rope"  # (read staged on a GPU)
    assert bp.new_cache(model, "qvg", 6, {}).read_mode == "window"
    assert bp.new_cache(model, "bf16:shift", 6, {}).bf16_rolling == "shift"
    assert bp.new_cache(model, "bf16", 6, {}).bf16_rolling == "ring"
    assert bp.new_cache(model, "qvg:nographs", 6, {})._graphed is None
    assert bp.new_cache(model, "qvg", 6, {})._graphed is not None
    for bad, msg in (("qvg:compress=nope", "unknown compress variant 'nope'"), ("qvg:bogus", "unknown method flag"),
                     ("bf16:compress=fast", "not for bf16"), ("qvg:compress=fast:compress=fast-sort", "at most"),
                     ("nope", "unknown cache method"),
                     ("qvg:staged-read:fused-read", "not both"), ("qvg:default-stream:high-priority", "not both"),
                     ("bf16:staged-read", "supports read='window' only"),
                     ("kivi:fused-read", "supports read='window' only"), ("qvg:shift", "shift is for bf16")):
        with pytest.raises(ValueError, match=msg):
            bp.parse_method(bad)
    assert bp.main(["--methods", "bf16,qvg:bogus"]) == 2
    assert bp.main(["--methods", "bf16:shift,qvg"]) == 2  # (no plain bf16 row to take the overheads against)
