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
    from .bench_kernels import NEXT_CHUNKS
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=29640)
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--next-chunk", default="noisy", choices=NEXT_CHUNKS,
                    help="the chunk warm-started from the previous one (as bench_kernels --next-chunk)")
    args = ap.parse_args(argv)
    from qvg.compression import resolve_options
    from qvg.revision import code_commit

    from .bench_kernels import clustered, moved_shares, next_chunk, write_result
    from .provenance import command_line
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (1, args.heads, args.tokens, 128)
    x0 = clustered(shape, seed=1, device=dev)
    x1 = next_chunk(x0, shape, args.next_chunk)
    rows = []
    for method in ("qvg", "qvg-pro"):
        for s, m in enumerate(moved_shares(x0, x1, method, shape)):
            rows.append({"method": method, "stage": s, "moved": m})
            print(f"  {method} stage {s}: {m:.4f} of the tokens moved", flush=True)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": code_commit(),
           "command": command_line("python -m qvg.eval.moved_tokens", argv), "shape": list(shape),
           "next_chunk": args.next_chunk, "centroids": resolve_options("qvg-pro", shape)["centroids"], "rows": rows}
    write_result(res, args.out, "moved-tokens.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
