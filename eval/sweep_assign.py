"""The persistent k-means assignment's tilings timed on the GPU: `python -m qvg.eval.sweep_assign [--out DIR]` ->
sweep-assign-<gpu>.json. At the LongCat span ([1, 32, 29640, 128], K = 256, the benchmark's warm start: the
centroids a previous chunk's compress gives), each (token block, warps, num_stages, programs per group) of
kernels/kmeans.py `assign(mode="min", block_k=256)` is timed with triton's do_bench (best of 3) and its ids
compared with those of `assign`'s own defaults there (64 tokens, 4 warps, 2 stages, progs="auto": about two programs
per SM; the compress presets prefetch 3 deep since 3d1d3ad)."""
from __future__ import annotations

import sys
import time

import torch

from qvg.help_format import OneLineParser

TILINGS = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 8, 3), (128, 8, 4))


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: sweep_assign needs a CUDA GPU", file=sys.stderr)
        return 2
    from qvg.kernels.common import sm_count
    from qvg.kernels.kmeans import assign
    from .bench_kernels import LONGCAT_SPAN, bench, gpu_tag, longcat_stage1, result_header, write_result
    t0 = time.time()
    xg, c0 = longcat_stage1()
    ref, _ = assign(xg, c0, True, mode="min", block_n=64, block_k=256, num_warps=4, progs="auto")
    sms = sm_count(torch.device("cuda"))
    rows = []
    for bn, nw, ns in TILINGS:
        for progs in ("auto", sms // 32, 3 * sms // 32, 4 * sms // 32):  # ~1, 3, 4 programs per SM over 32 groups
            kw = dict(mode="min", block_n=bn, block_k=256, num_warps=nw, num_stages=ns, progs=progs)
            ids, _ = assign(xg, c0, True, **kw)
            ms = min(bench(lambda: assign(xg, c0, True, **kw)) for _ in range(3))  # noqa: B023
            rows.append({**kw, "ms": ms, "ids_equal_default": float((ids == ref).float().mean())})
            print(f"  {bn} tokens x {nw} warps, {ns} stages, progs {progs}: {ms:.4f} ms, ids equal "
                  f"{rows[-1]['ids_equal_default']:.4f}", flush=True)
    res = {**result_header("sweep_assign", argv), "shape": list(LONGCAT_SPAN), "centroids": 256, "rows": rows}
    write_result(res, args.out, f"sweep-assign-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
