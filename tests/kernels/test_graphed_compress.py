"""GraphedCompress (CUDA only): a graph replay gives bitwise the eager compress result, per input, and the cache
with graphs holds bitwise the same history as without."""
import pytest
import torch

import qvg
from kernel_helpers import clustered
from qvg.cache import KVCache
from qvg.compression.graphed import GraphedCompress

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("method,opts,preset", [("qvg", {"centroids": 16}, "auto"),
                                                ("qvg-pro", {"centroids": 16}, "auto"),
                                                ("qvg-pro", {"centroids": 16}, "fast-delta"),
                                                ("rtn", {"bits": 4}, "auto")])
def test_replay_equals_eager(method, opts, preset):
    from qvg.kernels.compress import use_variant
    with use_variant(preset):
        _replay_equals_eager(method, opts)


def _replay_equals_eager(method, opts):
    g = GraphedCompress()
    warm = None
    for i in range(3):  # the same graph replayed on new inputs and warm starts
        x = clustered(1, 4, 192, 128, spread=1.0, noise=0.5, seed=i).bfloat16().cuda()
        if method != "rtn" and warm is None:
            warm = qvg.compress(x, method, seed=7, **opts).tensors["centroids"]
        want = qvg.compress(x, method, init=warm, check_finite=False, **opts)
        assert g.supports(x, method, warm, opts)
        got = g(x, method, warm, **opts)
        assert set(got.tensors) == set(want.tensors)
        for name, t in want.tensors.items():
            assert torch.equal(got.tensors[name], t), (method, i, name)
        if method != "rtn":
            warm = want.tensors["centroids"] + 0.01 * i
    assert len(g._graphs) == 1 and g.nbytes > 0


def test_cold_start_is_not_graphed():
    x = torch.zeros(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    assert not GraphedCompress.supports(x, "qvg", None, {})
    assert not GraphedCompress.supports(x.cpu(), "rtn", None, {})
    assert not GraphedCompress.supports(x, "kivi", None, {})


def test_cache_with_graphs_equals_without():
    caches = [KVCache(2, "qvg", chunk_frames=1, tokens_per_frame=96, window_frames=2, cuda_graphs=flag,
                      centroids=8) for flag in (True, False)]
    for i in range(4):
        x = clustered(2, 2, 96, 64, spread=1.0, noise=0.5, seed=10 + i).bfloat16().cuda()
        for c in caches:
            for layer in range(2):
                c.write(layer, x[:1], x[1:])
            c.commit()
    for layer in range(2):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)
    assert caches[0].memory()["workspace"] > 0 == caches[1].memory()["workspace"]
