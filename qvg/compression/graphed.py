"""`GraphedCompress`: `compress` replayed from a CUDA graph, for the KV cache's commit on the GPU.

An eager qvg compress is ~40 kernel launches and small torch ops: ~1.5-2 ms of host time for ~0.3 ms of GPU work
on one Self-Forcing chunk (4,680 tokens x 12 heads). Committing 30 layers x K and V inside the clean re-run made
the host the bottleneck (eval/results/profile-pipeline-h100.json: the GPU idled ~25 ms per chunk). A graph
replays the same kernels in the same order (bitwise the same result) for one launch.

Graphs exist only where compress has no host-side work to replay: rtn, and qvg / qvg-pro warm-started from the
previous unit's centroids (the cold first unit seeds k-means++ from a CPU generator and runs eagerly). One graph
per (method, options, shape, warm-start shape, kernel preset); the input and the warm start are copied into the
graph's static tensors. The returned Packed holds the graph's static outputs: valid until the next call with the
same key (the cache copies them into its history at once). `nbytes`: the memory the graphs hold: their static
inputs and their private memory pools, outputs and the captured intermediates' blocks alike (reserved for the
replays, usable by no other allocation). `clear()` drops every graph and its memory (the cache's `reset`).
"""
from __future__ import annotations

import torch

from ..packed import Packed

GRAPHED_METHODS = ("rtn", "qvg", "qvg-pro")


class GraphedCompress:
    """capture_on_current: capture each graph on the stream current at its first call (if that is not a device's
    default stream) instead of a fresh side stream: a graph's kernels run in the context they were captured in, so
    one captured on a green context's stream (`qvg.streams.green_stream`) replays on that context's SMs only."""

    def __init__(self, capture_on_current: bool = False):
        self._graphs: dict = {}
        self.nbytes = 0
        self.capture_on_current = capture_on_current

    def clear(self) -> None:
        """Drop every graph. Their static tensors and private pools go back to the caching allocator once no
        output of theirs is referenced (the cache holds copies); `torch.cuda.empty_cache` returns them to the
        device."""
        self._graphs.clear()
        self.nbytes = 0

    @staticmethod
    def supports(x: torch.Tensor, method: str, init, options: dict) -> bool:
        from ..backend import kernel_head_dim, kernels_on
        # (graphs replay the kernels: CUDA only, none where the reference runs)
        if (not kernels_on(x.device) or not kernel_head_dim(x.shape[-1]) or method not in GRAPHED_METHODS
                or "init" in options):
            return False
        return method == "rtn" or options.get("stages") == 0 or init is not None

    def __call__(self, x: torch.Tensor, method: str, init: torch.Tensor | None = None, preset: str | None = None,
                 **options) -> Packed:
        """preset: the compress kernels' preset (kernels/compress.py; None: the current default, COMPRESS_VARIANT),
        captured with the graph and part of its key."""
        from ..kernels import compress as kernels_compress
        preset = preset or kernels_compress.COMPRESS_VARIANT
        key = (method, repr(sorted(options.items())), tuple(x.shape), x.dtype, x.device,
               None if init is None else (tuple(init.shape), init.dtype), preset)
        e = self._graphs.get(key)
        if e is None:
            with kernels_compress.use_variant(preset), torch.cuda.device(x.device):  # (captured on x's device)
                e = self._graphs[key] = self._capture(x, method, init, options)
        e["x"].copy_(x)
        if init is not None:
            e["init"].copy_(init)
        e["graph"].replay()
        return e["out"]

    def _capture(self, x, method, init, options) -> dict:
        from . import compress
        torch.cuda.synchronize(x.device)
        before = torch.cuda.memory_allocated(x.device)
        sx = x.detach().clone()
        si = None if init is None else init.detach().clone()

        def call():
            return compress(sx, method, init=si, check_finite=False, **options)
        current = torch.cuda.current_stream(x.device)
        keep = self.capture_on_current and current != torch.cuda.default_stream(x.device)
        side = current if keep else torch.cuda.Stream(x.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # compile the kernels and settle the allocator before capturing
            for _ in range(2):
                call()
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # captured on x's device's side stream: torch.cuda.graph's default capture stream is made once per process,
        # on the device current at the first capture, and a capture on it for another device recorded the wrong work
        with torch.cuda.graph(graph, stream=side):
            out = call()
        torch.cuda.synchronize(x.device)
        # allocated since `before`: the static inputs and outputs (the outputs live in the graph's pool); plus the
        # pool's free blocks: the intermediates', which memory_allocated no longer counts but the pool keeps
        self.nbytes += torch.cuda.memory_allocated(x.device) - before + pool_free_bytes(x.device, graph.pool())
        return {"graph": graph, "x": sx, "init": si, "out": out}


def pool_free_bytes(device: torch.device, pool=None) -> int:
    """Bytes that a CUDA graph's private memory pool (`pool`, from `graph.pool()`; None: every private pool on the
    device) reserves beyond its live tensors: memory_allocated does not count them, yet nothing else can use them.
    torch exposes a pool's size only through the allocator's snapshot, whose segments name their pool; read once
    per capture (the pool neither grows at replay nor is released by `empty_cache` while the graph lives). 0 where
    the snapshot has no pool ids or the allocator keeps none (the cudaMallocAsync backend)."""
    device = torch.device(device)
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda": the current one
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return 0
    want = None if pool is None else tuple(pool)

    def mine(s) -> bool:
        pid = tuple(s.get("segment_pool_id", (0, 0)))
        return pid == want if want is not None else pid != (0, 0)
    return sum(s["total_size"] - s["allocated_size"] for s in segments
               if s.get("device") == index and mine(s))
