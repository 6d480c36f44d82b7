"""qvg.kernels.kmeans_reseed.reseed_empty_fused (one launch) against qvg.kmeans.reseed_empty (torch): bitwise the
same centroids, ties in the distances and more empty clusters than distinct maxima included."""
import pytest
import torch

import qvg.kmeans as ref
from kernel_helpers import assert_bitwise_equal, gen
from qvg.kernels.kmeans_reseed import reseed_empty_fused


@pytest.mark.parametrize("g,n,d,k,p_empty,ties", [
    (2, 300, 32, 20, 0.3, False),  # N not a multiple of K: the last tokens are never candidates
    (2, 301, 32, 20, 0.0, False),  # nothing empty: c unchanged
    (3, 64, 16, 64, 0.9, True),  # slices of width 1, most clusters empty
    (1, 1000, 32, 256, 0.5, True),
    (2, 40, 16, 40, 1.0, False),  # every cluster empty
    (1, 900, 16, 300, 0.4, True),  # K not a power of two, several slice blocks
])
def test_reseed_fused_equals_torch(g, n, d, k, p_empty, ties, device):
    gn = gen(k + n)
    x = torch.randn(g, n, d, generator=gn).bfloat16()
    c = torch.randn(g, k, d, generator=gn)
    counts = torch.randint(1, 5, (g, k), generator=gn).int()
    counts[torch.rand(g, k, generator=gn) < p_empty] = 0
    dist = torch.rand(g, n, generator=gn)
    if ties:  # a few distinct values: equal slice maxima and repeated maxima inside a slice
        dist = (dist * 4).floor()
    want = ref.reseed_empty(x, c.clone(), counts, dist)
    got = reseed_empty_fused(x.to(device), c.clone().to(device), counts.to(device), dist.to(device))
    assert_bitwise_equal(got.cpu(), want, "reseeded centroids")
    if p_empty == 0:
        assert_bitwise_equal(got.cpu(), c, "no empty cluster: unchanged")


def test_reseed_fused_rejects_large_k():
    with pytest.raises(ValueError):
        reseed_empty_fused(torch.zeros(1, 600, 16), torch.zeros(1, 513, 16), torch.zeros(1, 513), torch.zeros(1, 600))
