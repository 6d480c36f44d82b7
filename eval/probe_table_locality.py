"""Probe (GPU): does the four-stage decode's speed depend on how many centroid tables the resident blocks touch?
`python -m qvg.eval.probe_table_locality` prints each timing, then all of them as one JSON line. It decodes a 12 x 32,760-token history at K = 64
three ways: as 7 chunks of 4,680 tokens (the pipeline's 21-frame read: 7 table sets per head) whose chunks are
one pack repeated or 7 packs of their own, and as one pack of the whole span (one table set per head), with the
default grid and 64-token blocks; best of 5 do_bench medians each. Result: eval/results/probe-table-locality-h100.json."""
import json
import sys

import torch


def main() -> int:
    import qvg
    from qvg.eval.bench_kernels import bench, ceilings, clustered
    from qvg.kernels.dequant import dequantize
    from qvg.sequence import PackedSequence
    if not torch.cuda.is_available():
        print("error: probe_table_locality needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    for method in ("qvg-pro", "qvg"):
        x = clustered((1, 12, 4680, 128), spread=3.0)
        seq = PackedSequence.from_chunks([qvg.compress(x, method, bits=2, centroids=64)] * 7)
        xs = [clustered((1, 12, 4680, 128), spread=3.0, seed=i) for i in range(7)]
        seq2 = PackedSequence.from_chunks([qvg.compress(xx, method, bits=2, centroids=64) for xx in xs])
        xl = clustered((1, 12, 32760, 128), spread=3.0)
        one = qvg.compress(xl, method, bits=2, centroids=64)
        cases = (("7 chunks (same tables copied)", seq), ("7 chunks (own tables)", seq2),
                 ("1 chunk K=64 (one table set per head)", one))
        for name, p in cases:
            out = dequantize(p)
            for kw in ({}, {"block_n": 64, "num_warps": 4}):
                ms = min(bench(lambda: dequantize(p, out=out, **kw), warmup=10, rep=50) for _ in range(5))  # noqa: B023
                row = {"method": method, "case": name, "kwargs": kw, "ms": ms}
                res["rows"].append(row)
                print(row, flush=True)
    res["ceilings"] = ceilings(False)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
