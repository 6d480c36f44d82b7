"""KVCache's asynchronous commits (CUDA only): queued on a side stream, they leave bitwise the same history, the
same attention outputs and the same accounting as commits in line with the forward, through sinks, ring
evictions, pre-RoPE keys, the graphed compression and reads that come before `commit()`. (Only commits that
allocate nothing go to the side stream: a full window's; the rest commit in line, compared all the same.)"""
import pytest
import torch

from kernel_helpers import clustered
from qvg.cache import KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")

TPF, CF, LAYERS = 48, 2, 3
CASES = [("qvg", {"centroids": 8}, "post-rope"), ("qvg", {"centroids": 8}, "pre-rope"),
         ("qvg-pro", {"centroids": 8}, "post-rope"), ("rtn", {"bits": 4}, "post-rope"), ("kivi", {}, "post-rope"),
         ("bf16", {}, "post-rope")]


def _positions(frame):
    pos = torch.zeros(1, CF, 3, dtype=torch.int32)
    pos[..., 0] = torch.arange(frame, frame + CF)
    return pos


@pytest.mark.parametrize("method,opts,storage", CASES)
def test_async_commit_equals_sync(method, opts, storage):
    caches = [KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, sink_frames=CF, window_frames=2 * CF,
                      key_storage=storage, async_commit=flag, defer_commits=defer, **opts)
              for flag, defer in ((True, True), (False, True), (True, False))]
    q = torch.randn(1, 4, CF * TPF, 64, device="cuda").bfloat16()  # 4 query heads over 2 kv heads (GQA)
    for i in range(6):  # sink, then the ring fills and wraps
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, spread=1.0, noise=0.5, seed=40 + i).bfloat16().cuda()
        outs = []
        for c in caches:
            if storage == "pre-rope":
                c.set_positions(_positions(c.frames), 6, 8)
            got = []
            for layer in range(LAYERS):  # the pipeline's clean re-run: write, attend, commit the layer
                c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2])
                got.append(c.attend(layer, q))
                c.commit_layer(layer)
            got += list(c.read(0))  # read before commit(): waits for the layer's queued commit
            c.commit()
            outs.append(got)
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b), (method, storage, i)
    for layer in range(LAYERS):
        for c in caches[1:]:
            for a, b in zip(caches[0].read(layer), c.read(layer)):
                assert torch.equal(a, b)
    skip = ("workspace", "total", "compression_ratio")  # (graph pools are sized by the allocator: may differ)
    ma = {k: v for k, v in caches[0].memory().items() if k not in skip}
    assert all(ma == {k: v for k, v in c.memory().items() if k not in skip} for c in caches[1:])
    # the async caches used their side stream once the window was full (kivi's units are not packed in place)
    assert bool(caches[0]._side) == bool(caches[2]._side) == (method != "kivi") and not caches[1]._side


@pytest.mark.parametrize("defer", [True, False])
def test_chunks_back_to_back(defer):
    """No synchronize between chunks: the next chunk's writes overwrite the zones that the queued commits still
    read, and its reads need their history: every use waits for its layer's commit (outputs equal the in-line
    cache's, computed with a synchronize after every call)."""
    caches = [KVCache(LAYERS, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, centroids=8,
                      async_commit=flag, defer_commits=defer) for flag in (True, False)]
    q = torch.randn(1, 2, CF * TPF, 64, device="cuda").bfloat16()
    xs = [clustered(2 * LAYERS, 2, CF * TPF, 64, seed=300 + i).bfloat16().cuda() for i in range(8)]
    outs = [[], []]
    for j, c in enumerate(caches):
        for x in xs:
            for layer in range(LAYERS):
                c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2])
                outs[j].append(c.attend(layer, q))
                c.commit_layer(layer)
                if j:
                    torch.cuda.synchronize()
            c.commit()
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("defer", [True, False])
def test_reset_waits_for_queued_commits(defer):
    c = KVCache(1, "qvg", chunk_frames=CF, tokens_per_frame=TPF, window_frames=CF, centroids=8,
                defer_commits=defer)
    for i in range(3):
        x = clustered(2, 2, CF * TPF, 64, seed=i).bfloat16().cuda()
        c.write(0, x[:1], x[1:])
        c.commit_layer(0)
        if i < 2:
            c.commit()
    # (the full one-unit window commits on the side stream: queued now, or at commit() when deferred)
    assert c.layers[0].done is not None and c.layers[0].deferred == defer  # (the last chunk's, and this one's
    # deferred until commit(), or already queued)
    c.reset()  # with a commit still queued (or deferred)
    assert c.memory()["total"] == 0 and all(L.done is None for L in c.layers)


@pytest.mark.parametrize("method,opts", [("qvg", {"centroids": 8}), ("qvg-pro", {"centroids": 8})])
def test_side_streams_on_green_contexts_equal_the_plain_ones(method, opts):
    """commit_sms / prefetch_sms (side streams of a green context, a few SMs): the same history and outputs
    (skipped where torch has no green contexts with streams)."""
    from qvg.streams import green_stream
    try:
        green_stream("cuda", 8)
    except RuntimeError as e:
        pytest.skip(str(e))
    caches = [KVCache(LAYERS, method, chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, **kw, **opts)
              for kw in ({}, {"commit_sms": 8, "prefetch_sms": 8})]
    q = torch.randn(1, 2, CF * TPF, 64, device="cuda").bfloat16()
    outs = [[], []]
    for i in range(6):
        x = clustered(2 * LAYERS, 2, CF * TPF, 64, seed=500 + i).bfloat16().cuda()
        for j, c in enumerate(caches):
            for layer in range(LAYERS):
                c.write(layer, x[2 * layer:2 * layer + 1], x[2 * layer + 1:2 * layer + 2])
                outs[j].append(c.attend(layer, q))
                c.commit_layer(layer)
            c.commit()
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert caches[1]._side and all(s is green_stream("cuda", 8) for s in caches[1]._side.values())
