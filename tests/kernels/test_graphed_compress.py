"""GraphedCompress (CUDA only): a graph replay gives bitwise the eager compress result, per input, and the cache
with graphs holds bitwise the same history as without."""
import pytest
import torch

import qvg
from kernel_helpers import clustered
from qvg.cache import KVCache
from qvg.compression.graphed import GraphedCompress

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("method,opts", [("qvg", {"centroids": 16}), ("qvg-pro", {"centroids": 16}),
                                         ("rtn", {"bits": 4})])
def test_replay_equals_eager(method, opts):
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


def _same_history(caches, rounds: int, seed: int, pre_rope: bool = False) -> None:
    """Commit the same chunks (one frame of 96 tokens, 2 layers) to every cache; their histories are bitwise equal."""
    for i in range(rounds):
        x = clustered(2, 2, 96, 64, spread=1.0, noise=0.5, seed=seed + i).bfloat16().cuda()
        for c in caches:
            if pre_rope:
                c.set_positions(torch.tensor([[[i, 0, 0]]], dtype=torch.int32), 8, 12)
            for layer in range(2):
                c.write(layer, x[:1], x[1:])
            c.commit()
    for layer in range(2):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)


def test_cache_with_graphs_equals_without():
    caches = [KVCache(2, "qvg", chunk_frames=1, tokens_per_frame=96, window_frames=2, cuda_graphs=flag,
                      centroids=8) for flag in (True, False)]
    _same_history(caches, 4, 10)
    assert caches[0].memory()["workspace"] > 0 == caches[1].memory()["workspace"]


@pytest.mark.parametrize("method,opts", [("qvg", {"centroids": 16}), ("qvg-pro", {"centroids": 16}),
                                         ("rtn", {"bits": 4})])
def test_pair_equals_own_replays(method, opts):
    """K and V in one replay of their heads side by side: each half bitwise its own replay, round after round."""
    g, own = GraphedCompress(), GraphedCompress()
    warm = [None, None]
    for i in range(3):
        xs = [clustered(1, 4, 192, 128, spread=1.0, noise=0.5, seed=20 + 2 * i + j).bfloat16().cuda() for j in (0, 1)]
        if method != "rtn" and warm[0] is None:
            warm = [qvg.compress(x, method, seed=7, **opts).tensors["centroids"] for x in xs]
        want = []
        for x, w in zip(xs, warm):  # (each copied out before the next replay of the shared graph)
            want.append({n: t.clone() for n, t in own(x, method, w, preset="fast-onehot", **opts).tensors.items()})
        got = g.pair(*xs, method, *warm, preset="fast-onehot", **opts)
        for p, w in zip(got, want):
            assert p.shape == (1, 4, 192, 128) and set(p.tensors) == set(w)
            for name, t in w.items():
                assert torch.equal(p.tensors[name], t), (method, i, name)
        if method != "rtn":
            warm = [w["centroids"] + 0.01 * i for w in want]
    assert len(g._graphs) == 1
    with pytest.raises(ValueError, match="warm starts for both or neither"):
        g.pair(*xs, method, warm[0], None, **opts)


@pytest.mark.parametrize("method,storage", [("qvg", "post-rope"), ("qvg-pro", "post-rope"), ("qvg", "pre-rope"),
                                            ("rtn", "post-rope")])
def test_cache_paired_commits_equal_unpaired(method, storage):
    """The default paired commits hold bitwise the history of one replay per tensor, through the ring's wrap."""
    opts = {} if method == "rtn" else {"centroids": 8}
    caches = [KVCache(2, method, chunk_frames=1, tokens_per_frame=96, window_frames=2, key_storage=storage,
                      pair_commits=flag, **opts) for flag in (True, False)]
    _same_history(caches, 5, 40, pre_rope=storage == "pre-rope")
    shapes = [[key[2] for key in c._graphed._graphs] for c in caches]
    assert all(s[1] == 4 for s in shapes[0]) and all(s[1] == 2 for s in shapes[1])  # 2 heads each of K and V
