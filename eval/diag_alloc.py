"""Diagnostic (not a benchmark): the allocator's view of a filled Self-Forcing-size cache, per method, in the
order given (allocator state carries over between them, as in bench_pipeline). For each cache: the
memory_allocated delta across the fill (and again after one more allocation, which releases frees that waited on
another stream), the bytes of the live blocks the fill added against the bytes their tensors requested (the
difference is the caching allocator's rounding: a free block up to 1 MiB larger than the request is handed out
whole), the graph pools' free bytes and the cache's accounting.

    python -m qvg.eval.diag_alloc qvg:sync,qvg 60    (methods as bench_pipeline's; history in latent frames)
"""
import json
import sys

import torch

from qvg.compression.graphed import pool_free_bytes
from qvg.eval.bench_pipeline import _fill, new_cache, wan_model


def slack():
    tot = req = 0
    for s in torch.cuda.memory_snapshot():
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                tot += b["size"]
                req += b.get("requested_size", b["size"])
    return tot, req


def main():
    from qvg.eval.bench_pipeline import parse_methods
    try:
        parse_methods(sys.argv[1])
    except ValueError as e:
        raise SystemExit(f"diag_alloc: {e}") from None
    model = wan_model()
    out = []
    for method in sys.argv[1].split(","):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        fb = pool_free_bytes(torch.device("cuda"))
        t0, r0 = slack()
        cache = new_cache(model, method, int(sys.argv[2]), {"centroids": 64})
        _fill(cache, int(sys.argv[2]), 12)
        torch.cuda.synchronize()
        d1 = torch.cuda.memory_allocated() - before
        torch.empty(1, device="cuda")
        d2 = torch.cuda.memory_allocated() - before
        t1, r1 = slack()
        pf = pool_free_bytes(torch.device("cuda")) - fb
        acc = cache.memory()["total"]
        row = dict(method=method, delta=d1, delta_after_malloc=d2, block_bytes=t1 - t0, requested=r1 - r0,
                   pool_free=pf, accounted=acc, err=(acc - d1 - pf) / (d1 + pf))
        print(json.dumps(row), flush=True)
        out.append((cache, row))  # each cache stays alive: the next one is built beside it, as in bench_pipeline


if __name__ == "__main__":
    main()
