"""Whether the real-size chunk waits for the host (GPU): `python -m qvg.eval.host_slack [--out DIR] [--history 21]
[--methods bf16,qvg,qvg-pro] [--delays 0,50,100,200] [--repeat 3]`.

bench_pipeline's chunk (Wan2.1-1.3B config, random weights, 480x832, 4 steps + the clean re-run + commit, timed
right behind an untimed chunk), with the host spinning `delay` microseconds before each of the cache's `attend`
calls (150 per chunk). If a method's chunk is bound by the GPU, a little more host time per layer is absorbed by the
host's lead over the GPU and the chunk time stays flat; if it already waits for the host somewhere, each added
microsecond shows (up to 150 us of chunk time per us of delay). So the slope of chunk time over delay says how much
of the host's time per layer reaches the wall clock, per method. The chunks run in rounds (every method and delay
once per round, order rotated). Also records `host_ms`: the host's time to queue one chunk on an idle GPU (the
call's wall time; it includes any blocking the launch queue does), without delay and at the largest one (which
shows the spin took effect). Writes host-slack-<gpu>.json.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from .bench_pipeline import (_fill, checked_methods, method_runner, new_cache, pipeline_args, rotated, steady_ms,
                             wan_model)


def spin(us: float) -> None:
    """Busy-wait `us` microseconds on the host (time.sleep is too coarse at this scale)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def delayed(cache, delay: list[float]) -> None:
    """The cache's attend spins delay[0] us first (a list: changed between chunks)."""
    attend = cache.attend

    def slow(*args, **kw):
        spin(delay[0])
        return attend(*args, **kw)
    cache.attend = slow


def host_ms(chunk) -> float:
    """Host milliseconds to queue one chunk on an idle GPU (synchronized before and after)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    chunk()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt * 1e3


def slope(rows: list[dict]) -> float:
    """Least-squares slope of chunk ms over delay us."""
    xs, ys = [r["delay_us"] for r in rows], [r["chunk_ms"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _delays(args) -> list[float]:
    delays = [float(d) for d in args.delays.split(",")]
    if not all(math.isfinite(d) and d >= 0 for d in delays) or args.repeat < 1:
        raise ValueError("delays must be finite and >= 0, and --repeat >= 1")
    return delays


def main(argv=None) -> int:
    ap = pipeline_args(__doc__, "bf16,qvg,qvg-pro")
    ap.add_argument("--delays", default="0,50,100,200", help="host microseconds added before each attend call")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    got = checked_methods(args, "host_slack", _delays)
    if got is None:
        return 2
    methods, options, delays = got
    from .bench_kernels import gpu_tag, result_header, write_result
    t0, header = time.time(), result_header("host_slack", argv)
    model = wan_model()
    runs, knobs = {}, {}
    with torch.no_grad():
        for m in methods:
            cache = new_cache(model, m, args.history, options)
            _fill(cache, args.history, 12)
            knobs[m] = [0.0]
            delayed(cache, knobs[m])
            runs[m] = method_runner(model, cache, m)[0]
            runs[m]()  # warm-up
        cells = [(m, d) for m in methods for d in delays]
        times = {c: [] for c in cells}
        host = {m: host_ms(runs[m]) for m in methods}  # (no delay yet)
        for m in methods:  # (and at the largest delay: the spin took effect)
            knobs[m][0] = max(delays)
        host_max = {m: host_ms(runs[m]) for m in methods}
        for i in range(args.repeat):
            for m, d in rotated(cells, i):
                knobs[m][0] = d
                times[m, d].append(steady_ms(runs[m]))
    rows = [{"method": m, "delay_us": d, "chunk_ms": statistics.median(times[m, d]), "chunk_ms_all": times[m, d]}
            for m, d in cells]
    summary = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        k = slope(mine)
        summary[m] = {"host_ms": host[m], f"host_ms_at_{max(delays):g}us": host_max[m],
                      "chunk_ms_at_0": next((r["chunk_ms"] for r in mine if r["delay_us"] == 0), None),
                      "slope_ms_per_us": k, "slope_fraction_of_150": k / 0.150}
    for m, s in summary.items():
        at0 = "-" if s["chunk_ms_at_0"] is None else f"{s['chunk_ms_at_0']:.1f}"
        print(f"{m}: host {s['host_ms']:.1f} ms to queue a chunk; chunk {at0} ms without delay; "
              f"slope {1e3 * s['slope_ms_per_us']:.1f} us of chunk per us of delay per attend "
              f"({100 * s['slope_fraction_of_150']:.0f}% of the 150 attend calls')", flush=True)
    res = {**header, "history_frames": args.history, "delays_us": delays, "repeat": args.repeat,
           "summary": summary, "rows": rows}
    write_result(res, args.out, f"host-slack-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
