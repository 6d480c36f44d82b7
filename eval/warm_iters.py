"""What the second warm k-means iteration buys: `python -m qvg.eval.warm_iters [--out DIR] [--seeds 0,1,2]
[--chunks 5]` -> warm_iters.json / .md.

The cache's commits warm-start each chunk's k-means from the previous chunk's stored centroids of the same layer
and head (streaming centroid caching) and run WARM_ITERS = 2 Lloyd iterations per PRQ stage (COLD_ITERS = 8 for
the first chunk). qvg-pro's commits (S = 4) are about half of its per-chunk overhead on H200s
(eval/results/pipeline-h100.md), and most of a commit's time is its iterations; this measures the quality side of
one warm iteration instead of two: streaming chains (chunk 0 cold, each later chunk warm from the centroids the
same chain stored for the chunk before, as the cache does), the torch compress path (`prq.compress_torch`), INT2,
qvg (S = 1, B = 64) and qvg-pro (S = 4, B = 16). Relative MSE = MSE / mean(x^2) of the warm chunks, per k-means
seed (the first chunk's seeding; its spread is the seed floor), and the per-(tensor, chunk, seed) ratio
iters / 2.

Data: consecutive chunks of the synthetic video-like KV (qvg.eval.synthetic_kv: 12 heads x 4,680 tokens, K = 64,
the cache's K for a Self-Forcing chunk) and the K/V the embedded world model writes into its cache in a rollout
(every layer; keys after RoPE; the cache's K for its chunk)."""
from __future__ import annotations

import statistics
import sys
import time

import torch

import qvg
from qvg.compression import resolve_options
from qvg.compression.prq import COLD_ITERS, WARM_ITERS, compress_torch
from qvg.numbers import integer
from qvg.packed import Packed

from .centroid_precision import embedded_kv
from .study_outputs import out_error, parser, save, stamp

METHODS = ("qvg", "qvg-pro")
ITERS = (1, WARM_ITERS)


def chain(xs: list[torch.Tensor], method: str, k: int, seed: int, iters: int) -> list[float]:
    """Rel MSE of chunks 1.. of one streaming chain over xs (chunk 0 cold, COLD_ITERS; each later chunk `iters`
    warm iterations from the centroids stored for the chunk before)."""
    out, warm = [], None
    for i, x in enumerate(xs):
        o = {**resolve_options(method, tuple(x.shape), bits=2, centroids=k), "seed": seed}
        t = compress_torch(x, o, warm, COLD_ITERS if warm is None else iters)
        b, h, _, d = x.shape
        warm = t["centroids"].reshape(o["stages"], b * h, k, d)
        if i:
            y = qvg.decompress(Packed(method, tuple(x.shape), x.dtype, t, o))
            out.append(float((y.float() - x.float()).pow(2).mean()) / float(x.float().pow(2).mean()))
    return out


def measure(xs: list[torch.Tensor], k: int, seeds: list[int]) -> list[dict]:
    """Rows per (method, iters): rel MSE [seed][warm chunk]."""
    return [{"method": m, "iters": it, "rel_mse": [chain(xs, m, k, s, it) for s in seeds]}
            for m in METHODS for it in ITERS]


def run(seeds: list[int], chunks: int) -> dict:
    from .synthetic_kv import synthetic_chunks
    sets = []
    syn = list(synthetic_chunks(chunks))
    for role, i in (("K", 0), ("V", 1)):
        sets.append({"data": "synthetic", "tensor": role, "K": 64, "rows": measure([c[i] for c in syn], 64, seeds)})
    tensors, kk, what = embedded_kv(tuple(range(1, chunks + 1)))  # (generated chunks; 0 is the start frame)
    by_name: dict = {}
    for label, x in tensors:  # "K chunk c layer l" -> per (K / V, layer) the chunks in order
        role, _, c, _, layer = label.split()
        by_name.setdefault(f"{role} layer {layer}", []).append((int(c), x))
    for name, xs in by_name.items():
        sets.append({"data": "embedded", "tensor": name, "K": kk,
                     "rows": measure([x for _, x in sorted(xs, key=lambda p: p[0])], kk, seeds)})
    return {"sets": sets, "embedded": what, "shape_synthetic": list(syn[0][0].shape),
            "shape_embedded": list(tensors[0][1].shape), "chunks": chunks, "seeds": seeds}


def summary(res: dict) -> list[dict]:
    """Per (data, K or V, method, iters): mean rel MSE over tensors x warm chunks x seeds, the ratio to 2 iterations
    per (tensor, chunk, seed): mean [min, max], and the seed floor (std / mean over seeds of one tensor-chunk's rel
    MSE at 2 iterations, averaged)."""
    groups: dict = {}
    for st in res["sets"]:
        kind = st["tensor"].split()[0]
        base = {r["method"]: r["rel_mse"] for r in st["rows"] if r["iters"] == WARM_ITERS}
        for r in st["rows"]:
            g = groups.setdefault((st["data"], kind, r["method"], r["iters"]), {"rel": [], "ratio": [], "floor": []})
            b = base[r["method"]]
            for per_seed, b_seed in zip(r["rel_mse"], b):
                g["rel"] += per_seed
                g["ratio"] += [a / c for a, c in zip(per_seed, b_seed)]
            if len(b) > 1:
                for chunk_vals in zip(*b):
                    g["floor"].append(statistics.stdev(chunk_vals) / statistics.fmean(chunk_vals))
    return [{"data": d, "tensor": t, "method": m, "iters": it, "rel_mean": statistics.fmean(g["rel"]),
             "ratio_mean": statistics.fmean(g["ratio"]), "ratio_min": min(g["ratio"]), "ratio_max": max(g["ratio"]),
             "seed_floor": statistics.fmean(g["floor"]) if g["floor"] else None}
            for (d, t, m, it), g in groups.items()]


def markdown(res: dict) -> str:
    lines = [f"# {__doc__.splitlines()[0].split(' `')[0].rstrip(':')}", "", f"- command: `{res['command']}`",
             f"- git commit: `{res['commit']}`", f"- date: {res['date']}; {res['platform']}",
             f"- wall time: {res['wall_s']:.0f} s; {res['chunks']} chunks per chain (the first cold), k-means seeds "
             f"{res['seeds']}", "", *__doc__.split("\n\n", 1)[1].splitlines(), "",
             f"seed floor: the std / mean over the seeds of one tensor-chunk's rel MSE at {WARM_ITERS} iterations, "
             f"averaged. iters / {WARM_ITERS}: per (tensor, chunk, seed), mean [min, max].", "",
             f"| data | tensor | method | warm iterations | rel MSE | seed floor | iters / {WARM_ITERS} |",
             "|---|---|---|---|---|---|---|"]
    for r in res["summary"]:
        floor = f"{r['seed_floor']:.2%}" if r["seed_floor"] is not None else "-"
        lines.append(f"| {r['data']} | {r['tensor']} | {r['method']} | {r['iters']} | {r['rel_mean']:.4g} | {floor} | "
                     f"{r['ratio_mean']:.4f} [{r['ratio_min']:.4f}, {r['ratio_max']:.4f}] |")
    return "\n".join(lines) + "\n"


OUTPUTS = ("warm_iters.json", "warm_iters.md")


def main(argv=None) -> int:
    ap = parser("warm_iters", __doc__, OUTPUTS)
    ap.add_argument("--chunks", type=integer, default=5, help="chunks per chain, the first cold (default 5; 2 to 8)")
    a = ap.parse_args(argv)
    if not 2 <= a.chunks <= 8:
        print(f"{ap.prog}: error: --chunks must be in [2, 8], got {a.chunks}", file=sys.stderr)
        return 2
    if out_error(ap.prog, a.out, OUTPUTS):
        return 2
    t0 = time.time()
    res = stamp(run(a.seeds, a.chunks), ap.prog, argv, t0)
    res["summary"] = summary(res)
    return save(ap.prog, a.out, OUTPUTS, res, markdown(res))


if __name__ == "__main__":
    raise SystemExit(main())
