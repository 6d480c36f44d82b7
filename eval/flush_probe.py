"""Is a short decode's slow round the benchmark's L2 flush?
`python -m qvg.eval.flush_probe [--out DIR] [--rounds R] [--reps N]` -> DIR/flush-probe-<gpu>.json.

In placement_probe runs (eval/results/placement-probe-h200.49338d2-r*.json) the one-stage decode at the smaller
shapes (~0.04 ms, DRAM-bound) ran up to 1.9x slow in stretches of consecutive timings, whatever the buffer, while the
four-stage decode (L2- and issue-bound) timed in the same process never did. triton's do_bench flushes L2 before each call by zeroing a
256 MB buffer, which leaves L2 full of dirty lines; if their write-back overlaps the timed call it competes for
DRAM bandwidth. Here each of profile_dequant's shapes is timed with CUDA events around each call, the flush before
every call either `zero` (do_bench's memset alone) or `zero-read` (the same memset, then a 256 MB read of another
buffer, which evicts the dirty lines, written back before the call starts), the modes interleaved over R rounds of
N calls. If the slow rounds are the flush's write-back, `zero` shows them and `zero-read` does not."""
from __future__ import annotations

import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser
from qvg.numbers import integer

MODES = ("zero", "zero-read")
FLUSH_BYTES = 256 * 1024 * 1024


def timed(fn, mode: str, reps: int, flush: torch.Tensor, other: torch.Tensor) -> float:
    """Median ms of `reps` calls of fn, each after the flush of `mode` (flush, other: FLUSH_BYTES buffers)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        if mode == "zero-read":
            other.view(torch.int64).sum()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m qvg.eval.flush_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results", help="folder for flush-probe-<gpu>.json")
    ap.add_argument("--rounds", type=integer, default=20, help="interleaved rounds (default 20)")
    ap.add_argument("--reps", type=integer, default=30, help="timed calls per mode and round (default 30)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.reps < 1:
        ap.error("--rounds and --reps must be >= 1")
    from .bench_kernels import gpu_tag, out_error, result_header, write_result
    why = out_error(a.out)  # (before the work)
    if why or not torch.cuda.is_available():
        print(f"{ap.prog}: error: {why or 'needs a CUDA GPU'}", file=sys.stderr)
        return 2
    from qvg.kernels.dequant import dequantize

    from .profile_dequant import shapes
    t0 = time.time()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    other = torch.ones(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for label, p, nbytes in shapes():
        out = dequantize(p)
        fn = lambda p=p, out=out: dequantize(p, out=out)  # noqa: E731
        for _ in range(3):  # (compiled and warm)
            fn()
        times = {m: [] for m in MODES}
        for _ in range(a.rounds):
            for m in MODES:
                times[m].append(timed(fn, m, a.reps, flush, other))
        row = {"shape": label, "bytes_moved": nbytes}
        for m in MODES:
            t = times[m]
            row[m] = {"rounds_ms": t, "median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                      "slow_rounds": sum(x > 1.15 * min(t) for x in t)}
        rows.append(row)
        print(f"  {label:44s} " + ", ".join(f"{m} {row[m]['median_ms']:.4f} ms ({row[m]['min_ms']:.4f}-"
                                             f"{row[m]['max_ms']:.4f}, {row[m]['slow_rounds']} slow)" for m in MODES),
              flush=True)
    res = {**result_header("flush_probe", argv), "flush_bytes": FLUSH_BYTES,
           "slow_round": "a round whose median is over 1.15x the mode's fastest round", "rows": rows}
    write_result(res, a.out, f"flush-probe-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
