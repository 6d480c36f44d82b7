"""Host time of an eager compress against its GPU time, with Triton's launch path and with the fast one
(kernels/launch.py): `python -m qvg.eval.compress_host [--out DIR] [--profile]`.

For qvg (S1/B64) and qvg-pro (S4/B16) at the LongCat span [1, 32, 29640, 128], warm-started, 2 iterations, as
`bench_kernels`'s compress section runs them (`variant="auto"`), per launch path:
- `host_ms`: enqueue time of one call (the median over rounds of a few back-to-back calls between syncs, few enough
  that CUDA's launch queue never fills and blocks the host);
- `eager_ms`: `bench_kernels`'s eager figure (CUDA events around back-to-back calls: the larger of host and GPU time);
  both as the median of 7 rounds in which the two paths alternate (each round's figures are kept: the lent hosts'
  speed drifts within minutes);
- `host_probe_ms`: before each round, a fixed pure-Python loop's time (`bench_kernels.host_probe_ms`: the host's
  speed then);
- `graph_ms`: the same call as a CUDA-graph replay (its GPU time);
- `launches`: Triton launches per call;
- `host_ms_200_calls` / `wall_ms_200_calls` (fast path): 200 calls without a sync between them.
With --profile, a cProfile of 200 fast-path qvg calls (own time) is added; with --trace, a torch.profiler trace of
10 back-to-back fast-path calls of each method: the GPU's kernel time against the span it was spread over, the
largest idle gaps (with the kernels around them) and the CUDA runtime calls per compress call, syncs and copies
included. Writes compress-host-<gpu>.json.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser
from .bench_kernels import (LONGCAT_SPAN, bench, capture_graph, clustered, host_probe_ms, result_header, warm_start,
                            write_result)


def host_ms(fn, calls: int = 8, rounds: int = 30) -> float:
    """Median over `rounds` of the host time per call of `calls` back-to-back calls, starting from an idle GPU."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def count_launches(fn) -> int:
    from qvg.kernels import launch as L
    n = [0]
    real = L.launch

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)
    mods = [m for m in list(sys.modules.values()) if getattr(m, "launch", None) is real and m is not L]
    for m in mods:
        m.launch = counting
    try:
        fn()
    finally:
        for m in mods:
            m.launch = real
    torch.cuda.synchronize()
    return n[0]


def trace(fn, calls: int = 10) -> dict:
    """torch.profiler over `calls` back-to-back calls of fn (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    from .trace_overlap import trace_events
    events = trace_events(prof)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime: dict = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            r = runtime.setdefault(e["name"], [0, 0.0])
            r[0] += 1
            r[1] += e.get("dur", 0)
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:60], b["name"][:60]) for a, b in zip(kernels, kernels[1:])]
    gaps.sort(reverse=True)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"] if kernels else 0
    return {"calls": calls, "kernels_per_call": len(kernels) / calls,
            "gpu_span_us_per_call": span / calls, "gpu_kernel_us_per_call": sum(k["dur"] for k in kernels) / calls,
            "largest_gaps_us": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:8]],
            "runtime_calls_per_call": {k: {"n": v[0] / calls, "us": v[1] / calls}
                                       for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])}}


PATHS = (("triton", False), ("fast", True))


def compare_paths(fn, rounds: int = 7) -> dict:
    """Per launch path: medians of `host_ms` and of the eager figure over `rounds` rounds in which the paths
    alternate (so that a drift of the host's speed hits both), and each round's figures."""
    from qvg.kernels import launch as L
    for _, enabled in PATHS:  # compile and warm both paths
        L.ENABLED = enabled
        for _ in range(5):
            fn()
    samples = {path: {"host_ms": [], "eager_ms": [], "host_probe_ms": []} for path, _ in PATHS}
    for _ in range(rounds):
        for path, enabled in PATHS:
            L.ENABLED = enabled
            samples[path]["host_probe_ms"].append(host_probe_ms())
            samples[path]["host_ms"].append(host_ms(fn, rounds=5))
            samples[path]["eager_ms"].append(bench(fn, warmup=3, rep=15))
    L.ENABLED = True
    return {path: {**{k: statistics.median(v) for k, v in samples[path].items()}, "rounds": samples[path]}
            for path, _ in PATHS}


def back_to_back(fn, calls: int = 200) -> dict:
    """Host time per call of `calls` calls with no sync between them, and the wall time per call once the GPU is
    done (here the launch queue may fill and hold the host back)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return {"host_ms_200_calls": host, "wall_ms_200_calls": (time.perf_counter() - t) / calls * 1e3}


def cprofile(fn, calls: int = 200) -> str:
    """cProfile of `calls` calls, by own time (the top 30 rows)."""
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


def run(profile: bool, traced: bool = False) -> dict:
    from qvg.kernels.compress import compress_prq
    x0 = clustered(LONGCAT_SPAN, seed=1)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    out: dict = {"rows": {}}
    for method in ("qvg", "qvg-pro"):
        _, o, warm = warm_start(x0, method, LONGCAT_SPAN)

        def f():
            return compress_prq(x1, o, warm, 2, variant="auto")
        row = {"launches": count_launches(f), **compare_paths(f)}  # (ends on the fast path)
        graph, _ = capture_graph(f)
        row["graph_ms"] = bench(graph.replay, warmup=5, rep=50)
        row["fast"].update(back_to_back(f))
        if traced:
            row["trace_fast"] = trace(f)
        out["rows"][method] = row
        print(f"{method}: host / eager ms, Triton's path {row['triton']['host_ms']:.3f} / "
              f"{row['triton']['eager_ms']:.3f}, fast {row['fast']['host_ms']:.3f} / {row['fast']['eager_ms']:.3f}; "
              f"graph {row['graph_ms']:.3f}; {row['launches']} launches", flush=True)
        if profile and method == "qvg":
            out["profile_qvg_fast"] = cprofile(f)
    return out


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--profile", action="store_true", help="add a cProfile of 200 fast-path qvg calls")
    ap.add_argument("--trace", action="store_true", help="add a torch.profiler trace of 10 fast-path calls")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compress_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    res = result_header("compress_host", argv)
    res["shape"] = list(LONGCAT_SPAN)
    res.update(run(args.profile, args.trace))
    from .bench_kernels import gpu_tag
    write_result(res, args.out, f"compress-host-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
