"""Does the fused dequant's time depend on where its buffers sit? `python -m qvg.eval.placement_probe [--out DIR]
[--buffers N] [--rounds R]` -> DIR/placement-probe-<gpu>.json.

profile_dequant's smaller shapes gave one kernel medians of 0.038-0.040 or 0.049-0.067 ms from one process to the
next, and rounds that switched between such levels within a run (eval/results/profile-dequant-h100.md, 2026-12-01).
Here, in one process, for profile_dequant's shapes other than the LongCat span: the decode into N output buffers allocated one after another,
and from N copies of the packed input into the first of them, each timed with do_bench (L2 flushed before each
call), interleaved over R rounds (median of the rounds' medians). Each row records its buffer's device address and
each round's start time (to line slow rounds up with a clock log, e.g. `nvidia-smi ... -lms 100`). A spread between
buffers well above one buffer's spread over rounds means placement matters; rounds slow for every buffer at once
mean the machine's state over time does."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser
from qvg.numbers import integer

MAX_BUFFERS = 64  # (each output buffer of the largest shape is 115 MB)


def _copy(p):
    """The packed data p (Packed or PackedSequence) with every tensor cloned: the same bits at new addresses."""
    return dataclasses.replace(p, tensors={k: v.clone() for k, v in p.tensors.items()})


def _summary(times: list[list[float]]) -> dict:
    med = [statistics.median(t) for t in times]
    spread = [(max(t) - min(t)) / statistics.median(t) for t in times]
    return {"median_ms": med, "min_over_buffers": min(med), "max_over_buffers": max(med),
            "max_over_min": max(med) / min(med), "largest_spread_over_rounds": max(spread)}


def probe(p, buffers: int, rounds: int) -> dict:
    """Times of decoding p into `buffers` outputs, and of `buffers` copies of p into the first output."""
    from qvg.kernels.dequant import dequantize

    from .bench_kernels import bench
    ref = dequantize(p)
    outs = [torch.empty_like(ref) for _ in range(buffers)]
    copies = [_copy(p) for _ in range(buffers)]
    t_out = [[] for _ in outs]
    t_in = [[] for _ in copies]
    starts = []  # (unix time at each round's start: to line slow rounds up with a clock log)
    for _ in range(rounds):
        starts.append(time.time())
        for i, o in enumerate(outs):
            t_out[i].append(bench(lambda o=o: dequantize(p, out=o), warmup=10, rep=40))
        for i, q in enumerate(copies):
            t_in[i].append(bench(lambda q=q: dequantize(q, out=outs[0]), warmup=10, rep=40))
    exact = all(torch.equal(o, ref) for o in outs)
    return {"outputs": {"address": [hex(o.data_ptr()) for o in outs], "rounds_ms": t_out, **_summary(t_out)},
            "inputs": {"codes_address": [hex(q.tensors["codes"].data_ptr()) for q in copies], "rounds_ms": t_in,
                       **_summary(t_in)}, "round_start_unix": starts, "round_end_unix": time.time(),
            "bitwise_equal": exact}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m qvg.eval.placement_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results", help="folder for placement-probe-<gpu>.json")
    ap.add_argument("--buffers", type=integer, default=8,
                    help=f"output buffers and input copies per shape, 1-{MAX_BUFFERS} (default 8)")
    ap.add_argument("--rounds", type=integer, default=5, help="interleaved rounds (default 5)")
    a = ap.parse_args(argv)
    if not 1 <= a.buffers <= MAX_BUFFERS or a.rounds < 1:
        ap.error(f"--buffers must be in [1, {MAX_BUFFERS}] and --rounds >= 1")
    from .bench_kernels import gpu_tag, out_error, result_header, write_result
    why = out_error(a.out)  # (before the work)
    if why or not torch.cuda.is_available():
        print(f"{ap.prog}: error: {why or 'needs a CUDA GPU'}", file=sys.stderr)
        return 2
    from .profile_dequant import shapes
    t0 = time.time()
    rows = []
    for label, p, _ in shapes(longcat=False):  # (the LongCat span's times were stable)
        rows.append({"shape": label, **probe(p, a.buffers, a.rounds)})
        o, i = rows[-1]["outputs"], rows[-1]["inputs"]
        print(f"  {label:44s} outputs {o['min_over_buffers']:.4f}-{o['max_over_buffers']:.4f} ms, inputs "
              f"{i['min_over_buffers']:.4f}-{i['max_over_buffers']:.4f} ms", flush=True)
    res = {**result_header("placement_probe", argv), "rows": rows}
    write_result(res, a.out, f"placement-probe-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
