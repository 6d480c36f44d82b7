"""Host and GPU time of one attention read of a packed history (GPU): `python -m qvg.eval.bench_read_host [--out
DIR]` -> launch-overhead-<gpu>.json.

At the Self-Forcing span of a 21-frame window (12 heads x 32,760 history tokens, qvg INT2 S1/B64, K = 64, plus the
4,680-token current chunk), 100 calls back to back with no synchronize: host microseconds per call (what the
Python side costs the thread that launches the pipeline) and GPU microseconds per call (CUDA events). Rows: the
decode of K and V (two Triton launches), the whole windowed read, the read with the window
decoded ahead (the cache's prefetch), SDPA on an equal BF16 cache (the bf16 method's read), and the decode replayed
from a CUDA graph (no launch cost at all: its GPU time is the kernels' own)."""
from __future__ import annotations

import os
import time

import torch

from qvg.help_format import OneLineParser
from .provenance import command_line, emit_json, meta


def _time(fn, n: int = 100) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    b.record()
    torch.cuda.synchronize()
    return {"host_us": (t1 - t0) / n * 1e6, "gpu_us": a.elapsed_time(b) / n * 1e3}


def run() -> dict:
    from qvg import compression
    from qvg.attention import sdpa_gqa
    from qvg.kernels.windowed_sdpa import decode_window, windowed_attention
    from qvg.sequence import PackedSequence
    from .bench_kernels import clustered
    t, chunks = 4680, 7
    g = torch.Generator(device="cuda").manual_seed(0)

    def history(seed):
        x = clustered((1, 12, t, 128), seed=seed, spread=3.0)
        return PackedSequence.from_chunks([compression.compress(x, "qvg", bits=2, centroids=64)] * chunks)
    kh, vh = history(0), history(1)
    q, kt, vt = (torch.randn(1, 12, t, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    kb, vb = (torch.randn(1, 12, (chunks + 1) * t, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    out = decode_window(kh, vh, t)
    rows = {}

    def row(name, fn):
        rows[name] = _time(fn)
        print(f"{name:58s} host {rows[name]['host_us']:7.1f} us  GPU {rows[name]['gpu_us']:8.1f} us", flush=True)
    row("decode K + V (two Triton launches)", lambda: decode_window(kh, vh, t, out=out))
    row("windowed read: decode + tail copy + SDPA", lambda: windowed_attention(q, kh, vh, kt, vt))
    row("windowed read, window decoded ahead: tail copy + SDPA",
        lambda: windowed_attention(q, kh, vh, kt, vt, decoded=out))
    row("SDPA on the same tokens in BF16 (the bf16 cache's read)", lambda: sdpa_gqa(q, kb, vb, None))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            decode_window(kh, vh, t, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_window(kh, vh, t, out=out)
    row("decode K + V replayed from a CUDA graph", graph.replay)
    return {"shape": {"heads": 12, "history_tokens": chunks * t, "tail_tokens": t, "head_dim": 128,
                      "method": "qvg INT2 S1/B64 K=64"}, "calls": 100, "rows": rows}


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_read_host: needs a CUDA GPU")
    res = {"meta": meta(command_line("python -m qvg.eval.bench_read_host", argv), "cuda"), **run()}
    os.makedirs(args.out, exist_ok=True)
    gpu = res["meta"]["device"].split()[1].lower()
    emit_json(res, os.path.join(args.out, f"launch-overhead-{gpu}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
