"""Packed.split_heads: a pack of two tensors' heads side by side, split again, is exactly what each tensor's own
compression gives (warm-started qvg / qvg-pro and rtn compress every head on its own). The cache's paired commits
(`GraphedCompress.pair`, CUDA) rely on it; tests/kernels/test_graphed_compress.py checks them on the GPU."""
import pytest
import torch

import qvg
from conftest import clustered_kv

CASES = [("qvg", dict(centroids=16)), ("qvg-pro", dict(centroids=16, block_size=16)), ("rtn", dict(bits=4))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("method,kw", CASES)
def test_split_of_joined_heads_equals_own_compression(method, kw):
    xk = clustered_kv(1, 3, 256, 64, clusters=16, seed=1).bfloat16()
    xv = clustered_kv(1, 3, 256, 64, clusters=16, seed=2).bfloat16()
    warm = [None, None]
    if method != "rtn":  # the previous chunk's centroids
        warm = [qvg.compress(x + 0.1, method, **kw).centroids for x in (xk, xv)]
    own = [qvg.compress(x, method, init=w, **kw) for x, w in zip((xk, xv), warm)]
    joined = qvg.compress(torch.cat([xk, xv], 1), method, init=None if warm[0] is None else torch.cat(warm, 2), **kw)
    for got, want in zip(joined.split_heads(3), own):
        assert got.shape == want.shape and got.meta == want.meta and set(got.tensors) == set(want.tensors)
        for name, t in want.tensors.items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(_bytes(got.tensors[name]), _bytes(t)), name
        assert got.nbytes == want.nbytes and torch.equal(qvg.decompress(got), qvg.decompress(want))
    assert sum(h.nbytes for h in joined.split_heads(3)) == joined.nbytes


def test_split_heads_views_and_errors():
    p = qvg.compress(clustered_kv(2, 4, 64, 64, clusters=8, seed=3), "qvg", centroids=8)
    a, b = p.split_heads(1)
    assert a.shape == (2, 1, 64, 64) and b.shape == (2, 3, 64, 64)
    assert a.codes.data_ptr() == p.codes.data_ptr() and b.ids.shape[2] == 3  # views, ids' head dim after the stage
    for bad in (0, 4, 5):
        with pytest.raises(ValueError, match="split_heads"):
            p.split_heads(bad)
    with pytest.raises(ValueError, match="split_heads"):
        qvg.compress(clustered_kv(1, 2, 64, 64, seed=4), "kivi").split_heads(1)
