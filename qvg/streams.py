"""`generation_stream(device)`: run a block on a CUDA stream of its own instead of the device's default stream.

Why: with the forward on the default (legacy) stream, the first cache in a process that decodes its history ahead on
a side stream started each default-stream kernel about 1.1-1.4 us later on the GPU (traces on two machines; not the
host: the launches were queued tens of ms ahead), about 12 ms per Self-Forcing chunk at 480x832. On one H200 a qvg
chunk cost +2.68% over the BF16 ring with both on the default stream, +0.74% with both on streams of their own
(eval/results/pipeline-h100.md, section of the 18:09-18:45 UTC runs of 2026-11-29). The mechanism is not known; the
pipelines run each chunk inside this block, and bench_pipeline times them the same way.

The stream is made once per device (normal priority, from torch's pool) and handed over both ways: it waits for
the caller's stream on entry, and the caller's stream waits for it on exit (exception or not). So work queued
before, inside and after the block runs in that order, and memory freed outside the block is reused inside it
only after the caller's stream has finished with it. A caller already on a stream other than the default keeps
it. Either way the block runs with the device current (torch.cuda.stream switches to its stream's device), so
kernels and graph captures of a tensor on a non-current device go to that device. On a CPU device the block changes
nothing.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}
_MAKING = threading.Lock()  # (threads entering at once make one stream per device)


def _index(device) -> int:
    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def reserved(device) -> torch.cuda.Stream | None:
    """The device's generation stream if one was made (side streams must not be it)."""
    return _STREAMS.get(_index(device))


@contextlib.contextmanager
def generation_stream(device):
    """The block on the device's generation stream (yields the stream it runs on; None on a CPU device)."""
    if torch.device(device).type != "cuda":
        yield None
        return
    index = _index(device)
    caller = torch.cuda.current_stream(index)
    if caller != torch.cuda.default_stream(index):
        with torch.cuda.stream(caller):  # (its own stream, kept; entering it makes the device current)
            yield caller
        return
    with _MAKING:
        if index not in _STREAMS:
            _STREAMS[index] = torch.cuda.Stream(index)
        stream = _STREAMS[index]
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        caller.wait_stream(stream)


_GREEN: dict[tuple[int, int], tuple[object, torch.cuda.Stream]] = {}


def green_stream(device, sms: int) -> torch.cuda.Stream:
    """A CUDA stream whose kernels run on `sms` SMs of the device only (a CUDA green context, kept for the process;
    experimental, for confining side-stream work: `KVCache(commit_sms=..., prefetch_sms=...)`). RuntimeError where
    torch or the driver has no green contexts with streams (torch built without them, a driver before CUDA 12.8)."""
    from torch.cuda import green_contexts
    index = _index(device)
    key = (index, sms)
    with _MAKING:
        if key not in _GREEN:
            if not green_contexts.SUPPORTED or not hasattr(green_contexts.GreenContext, "Stream"):
                raise RuntimeError(f"green contexts with streams are not available in torch {torch.__version__}")
            ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
            _GREEN[key] = (ctx, ctx.Stream())
    return _GREEN[key][1]
