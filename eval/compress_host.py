"""Host time of an eager compress against its GPU time, with Triton's launch path and with the fast one
(kernels/launch.py): `python -m qvg.eval.compress_host [--out DIR] [--profile]`.

For qvg (S1/B64) and qvg-pro (S4/B16) at the LongCat span [1, 32, 29640, 128], warm-started, 2 iterations, as
`bench_kernels`'s compress section runs them (`variant="auto"`), per launch path:
- `host_ms`: enqueue time of one call (the median over rounds of a few back-to-back calls between syncs, few enough
  that CUDA's launch queue never fills and blocks the host);
- `eager_ms`: `bench_kernels`'s eager figure (CUDA events around back-to-back calls: the larger of host and GPU time);
- `graph_ms`: the same call as a CUDA-graph replay (its GPU time);
- `launches`: Triton launches per call.
With --profile, a cProfile of 200 fast-path qvg calls (own time) is added. Writes compress-host-<gpu>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from .bench_kernels import LONGCAT_SPAN, bench, capture_graph, clustered, result_header, warm_start, write_result


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


def run(profile: bool) -> dict:
    from qvg.kernels import launch as L
    from qvg.kernels.compress import compress_prq
    x0 = clustered(LONGCAT_SPAN, seed=1)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    rows, prof = {}, None
    for method in ("qvg", "qvg-pro"):
        _, o, warm = warm_start(x0, method, LONGCAT_SPAN)

        def f():
            return compress_prq(x1, o, warm, 2, variant="auto")
        row = {"launches": count_launches(f)}
        for path, enabled in (("triton", False), ("fast", True)):
            L.ENABLED = enabled
            for _ in range(5):
                f()
            row[path] = {"host_ms": host_ms(f), "eager_ms": bench(f, warmup=5, rep=50)}
        L.ENABLED = True
        graph, _ = capture_graph(f)
        row["graph_ms"] = bench(graph.replay, warmup=5, rep=50)
        print(method, row, flush=True)
        rows[method] = row
        if profile and method == "qvg":
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(200):
                f()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            prof = s.getvalue()
    return {"rows": rows, **({"profile_qvg_fast": prof} if prof else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--profile", action="store_true", help="add a cProfile of 200 fast-path qvg calls")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compress_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    res = result_header("compress_host", argv)
    res["shape"] = list(LONGCAT_SPAN)
    res.update(run(args.profile))
    from .bench_kernels import gpu_tag
    write_result(res, args.out, f"compress-host-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
