"""The k-means centroid update's forms timed on the GPU: `python -m qvg.eval.sweep_update [--out DIR]` ->
sweep-update-<gpu>.json. At the LongCat span ([1, 32, 29640, 128], K = 256, the benchmark's warm start and its
first assignment's ids), kernels/kmeans.py `update_with_counts` is timed (triton's do_bench, best of 3) as the
"fast" preset runs it (counting sort + segmented sum) and as one-hot products on tensor cores in several tilings:
the centroid block (64: the default, or all 256 clusters in one program so x is read once), tokens per step,
warps, prefetch depth and token split. Each row holds its largest centroid difference from the segmented sum's
(the FP32 sums are added in another order) and whether the cluster sizes agree."""
from __future__ import annotations

import sys
import time

import torch

from qvg.help_format import OneLineParser

ONEHOT = [dict(block_k=64, block_n=32, num_warps=4, num_stages=3, chunk=4096)]  # the one-hot default
ONEHOT += [dict(block_k=256, block_n=bn, num_warps=8, num_stages=ns, chunk=ch)
           for bn in (32, 64) for ns in (2, 3) for ch in (2048, 4096, 8192)]
ONEHOT += [dict(block_k=128, block_n=32, num_warps=nw, num_stages=3, chunk=4096) for nw in (4, 8)]


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: sweep_update needs a CUDA GPU", file=sys.stderr)
        return 2
    from qvg.kernels.compress import COMPRESS_VARIANTS
    from qvg.kernels.kmeans import assign, update_with_counts
    from .bench_kernels import LONGCAT_SPAN, bench, gpu_tag, longcat_stage1, result_header, write_result
    t0 = time.time()
    xg, c0 = longcat_stage1()
    ids, _ = assign(xg, c0, True, **COMPRESS_VARIANTS["fast"]["assign_kw"])
    seg_kw = COMPRESS_VARIANTS["fast"]["update_kw"]
    ref_c, ref_n = update_with_counts(xg, ids, c0, **seg_kw)
    rows = []
    for kw in [dict(seg_kw)] + [dict(method="onehot", **o) for o in ONEHOT]:
        try:
            c, n = update_with_counts(xg, ids, c0, **kw)
            ms = min(bench(lambda: update_with_counts(xg, ids, c0, **kw)) for _ in range(3))  # noqa: B023
            row = {**kw, "ms": ms, "max_abs_diff": float((c - ref_c).abs().max()),
                   "counts_equal": bool(torch.equal(n, ref_n))}
        except Exception as e:  # a tiling that does not compile or fit is reported, the rest still run
            row = {**kw, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        print(f"  {row}", flush=True)
    res = {**result_header("sweep_update", argv), "shape": list(LONGCAT_SPAN), "centroids": 256, "rows": rows}
    write_result(res, args.out, f"sweep-update-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
