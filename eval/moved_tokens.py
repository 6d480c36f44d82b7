"""How many tokens the second k-means assignment moves, per PRQ stage: `python -m qvg.eval.moved_tokens [--heads H]
[--tokens N] [--out DIR]` -> moved-tokens.json. The torch reference (qvg.kmeans, FP32) on the kernel benchmark's
stand-in (default: the LongCat span length, 29,640 tokens x 128, H heads), warm-started from the previous chunk's compress as the
cache does: the fraction of tokens whose id differs between the first and the second assignment of each stage.
The incremental update (kernels/kmeans_delta.py) reads only those tokens. Runs on the CPU (a few minutes at 4
heads) or on CUDA."""
from __future__ import annotations

import time

import torch

from qvg.help_format import OneLineParser


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=29640)
    ap.add_argument("--out", default="eval/results")
    args = ap.parse_args(argv)
    from qvg.compression.prq import _gather
    from qvg.kmeans import assign, reseed_empty, update_with_counts
    from qvg.revision import code_commit

    from .bench_kernels import clustered, warm_start, write_result
    from .provenance import command_line
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (1, args.heads, args.tokens, 128)
    x0 = clustered(shape, seed=1, device=dev)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()  # the next chunk (as bench_kernels)
    rows = []
    for method in ("qvg", "qvg-pro"):
        _, o, warm = warm_start(x0, method, shape)
        r = x1.float().view(-1, shape[2], shape[3])
        for s in range(o["stages"]):
            rb = r.bfloat16().float()  # each stage clusters the BF16 rounding of its residual
            i1, d1 = assign(rb, warm[s].float().to(dev))
            c, n = update_with_counts(rb, i1, warm[s].float().to(dev))
            c = reseed_empty(rb, c, n, d1)
            i2, _ = assign(rb, c)
            c2, _ = update_with_counts(rb, i2, c)
            rows.append({"method": method, "stage": s, "moved": float((i1 != i2).float().mean())})
            print(f"  {method} stage {s}: {rows[-1]['moved']:.4f} of the tokens moved", flush=True)
            r = r - _gather(c2.bfloat16().float(), i2)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": code_commit(),
           "command": command_line("python -m qvg.eval.moved_tokens", argv), "shape": list(shape),
           "centroids": o["centroids"], "rows": rows}
    write_result(res, args.out, "moved-tokens.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
