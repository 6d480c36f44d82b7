"""GraphedCompress's memory (CUDA only): `nbytes` (the cache's "workspace") counts the graphs' static inputs and
their whole private pools, the captured intermediates' free blocks included; `clear()`, and so the cache's
`reset()`, gives all of it back to the allocator."""
import gc

import pytest
import torch

import qvg
from kernel_helpers import clustered
from qvg.cache import KVCache
from qvg.compression.graphed import GraphedCompress

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _pool_segments(graph):
    pool = tuple(graph.pool())
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]


@pytest.mark.parametrize("method,opts", [("qvg", {"centroids": 16}), ("rtn", {"bits": 2})])
def test_nbytes_counts_the_static_inputs_and_the_whole_private_pool(method, opts):
    x = clustered(1, 4, 1536, 128, spread=1.0, noise=0.5, seed=3).bfloat16().cuda()
    warm = None if method == "rtn" else qvg.compress(x, method, seed=7, **opts).tensors["centroids"]
    g = GraphedCompress()
    out = g(x, method, warm, **opts)
    (e,) = g._graphs.values()
    segments = _pool_segments(e["graph"])
    pool = sum(s["total_size"] for s in segments)
    assert sum(s["allocated_size"] for s in segments) >= sum(t.nbytes for t in out.tensors.values())
    static = e["x"].nbytes + (0 if warm is None else e["init"].nbytes)
    # the allocator rounds each of the (at most two) static inputs up to 512 bytes
    assert pool + static <= g.nbytes <= pool + static + 2 * 512, (g.nbytes, pool, static)


def test_reset_gives_the_graphs_memory_back():
    """After a warm-up video (kernels compiled, library workspaces made), a cache that captured its compression
    graphs and was reset leaves the allocator where it was: nothing allocated, and after empty_cache nothing
    reserved beyond the start."""
    def video():
        cache = KVCache(2, "qvg", chunk_frames=1, tokens_per_frame=768, window_frames=2, centroids=16)
        for i in range(4):
            x = clustered(2, 4, 768, 128, spread=1.0, noise=0.5, seed=20 + i).bfloat16().cuda()
            for layer in range(2):
                cache.write(layer, x[:1], x[1:])
            cache.commit()
        assert cache._graphed._graphs and cache.memory()["workspace"] > 0
        return cache

    video().reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    cache = video()
    cache.reset()
    mem = cache.memory()
    assert mem["total"] == 0 and mem["workspace"] == 0 and not cache._graphed._graphs
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved


def test_bf16_zones_sum_to_bf16_with_the_allocator_granule_room():
    """On CUDA the BF16 buffers fill the allocator's 2 MiB granule: the room past the chunk's slot is counted in
    bf16_current, and the zones still sum to bf16, which is what the allocator handed out."""
    t = 4680  # one Self-Forcing chunk (3 frames x 1560 tokens), 12 heads: 14 MB per K / V buffer
    x = torch.randn(2, 1, 12, t, 128, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # fresh segments for the buffers (a cached larger block may not be split)
    before = torch.cuda.memory_allocated()
    cache = KVCache(1, "qvg", chunk_frames=3, tokens_per_frame=1560, sink_frames=3, centroids=16)
    cache.write(0, x[0], x[1])
    cache.commit()  # the sink
    cache.write(0, x[0], x[1])
    mem = cache.memory()
    per_token = 2 * 12 * 128 * 2
    assert mem["bf16_sink"] == t * per_token and mem["bf16_pending"] == 0
    assert mem["bf16_current"] > t * per_token and mem["bf16_current"] % per_token == 0  # the granule's room
    assert mem["bf16_sink"] + mem["bf16_pending"] + mem["bf16_current"] + mem["bf16_residual"] == mem["bf16"]
    torch.cuda.synchronize()
    # the allocator's blocks: each buffer's granule less the remainder that holds no whole token
    assert mem["total"] == mem["bf16"] <= torch.cuda.memory_allocated() - before < mem["bf16"] + 2 * per_token
