"""Whole-compress kernel presets timed as the cache runs them: `python -m qvg.eval.sweep_compress [--shape B,H,N,D]
[--centroids K] [--methods qvg,qvg-pro] [--only NAMES] [--rounds R] [--reps N] [--out DIR]`
-> compress-sweep-<gpu>-<B>x<H>x<N>x<D>-k<K>.json.

Every candidate is a kernels/compress.py preset (assign tiling x update method and tiling x pack tiling; `--only`:
a comma list of candidate names, or of COMPRESS_VARIANTS names). Each one is captured into a CUDA graph (the cache
replays compress from one: qvg.compression.graphed) and timed by replays, interleaved with the others in `rounds`
rounds, so that a clock or thermal drift moves every candidate alike; the time is the median over rounds of the
mean replay. Per-kernel eager timings at a Self-Forcing chunk (12 heads x 4,680 tokens) are ~10-60 us, host-bound
and noisy (eval/results/kernels-h100.md); replays are not (two graphs of one preset, captured apart, can still differ
by a few percent: eval/results/compress-sweep-h100.md). Each candidate's output is checked against the "fast" preset
(the LongCat span's): ids equal, centroid difference, reconstruction MSE, and replay == eager bitwise.
Defaults: the Self-Forcing chunk with the cache's K for it (64), qvg and qvg-pro, warm-started.
"""
from __future__ import annotations

import itertools
import sys
import time

import torch

from qvg.help_format import OneLineParser

ASSIGN = {
    "a64w4auto": dict(mode="min", block_n=64, block_k=256, num_warps=4, progs="auto"),  # "fast" before 3d1d3ad
    "a64w4s3auto": dict(mode="min", block_n=64, block_k=256, num_warps=4, num_stages=3, progs="auto"),  # "fast"
    "a64w8": dict(mode="min", block_n=64, block_k=256, num_warps=8),
    "a128w8s3": dict(mode="min", block_n=128, block_k=256, num_warps=8, num_stages=3),
    "a32w4auto": dict(mode="min", block_n=32, block_k=256, num_warps=4, progs="auto"),
    "a64w4": dict(mode="min", block_n=64, block_k=256, num_warps=4),
}
_SEG = dict(method="segsum", item=256, rows=16, num_warps=4, num_stages=3, sort_block=1024)
UPDATE = {
    "useg": dict(_SEG, block="rank", rank_rows=64, rank_warps=1),  # "fast"
    "useg-i64s256": dict(_SEG, item=64, sort_block=256, block="rank", rank_rows=64, rank_warps=1),
    "uoh16c256w2": dict(method="onehot", block_k=64, block_n=16, chunk=256, num_warps=2),
    "uoh32c512w4": dict(method="onehot", block_k=64, block_n=32, chunk=512, num_warps=4),
    "uoh64c512w4": dict(method="onehot", block_k=64, block_n=64, chunk=512, num_warps=4),
    "uoh32c1024w4": dict(method="onehot", block_k=64, block_n=32, chunk=1024, num_warps=4),
    "uoh64c1024w8": dict(method="onehot", block_k=64, block_n=64, chunk=1024, num_warps=8),
}
PACK = {
    "p32w4": dict(fused=True, block_n=32, num_warps=4),  # "fast"
    "p8w2": dict(fused=True, block_n=8, num_warps=2),
    "p16w2": dict(fused=True, block_n=16, num_warps=2),
    "p16w4": dict(fused=True, block_n=16, num_warps=4),
    "p32w8": dict(fused=True, block_n=32, num_warps=8),
}


def candidates() -> dict[str, dict]:
    """Every assign x update x pack combination (named a.u.p), plus the COMPRESS_VARIANTS entries."""
    from qvg.kernels.compress import COMPRESS_VARIANTS
    out = {name: v for name, v in COMPRESS_VARIANTS.items() if name != "current"}
    for (an, a), (un, u), (pn, p) in itertools.product(ASSIGN.items(), UPDATE.items(), PACK.items()):
        out[f"{an}.{un}.{pn}"] = dict(assign_kw=a, update_kw=u, reseed="fused", pack_kw=p)
    return out


def _replay_ms(graph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def sweep_method(method: str, shape, k: int, cands: dict, rounds: int, reps: int) -> list[dict]:
    import qvg
    from qvg.compression import resolve_options
    from qvg.compression.prq import init_centroids
    from qvg.kernels.compress import compress_prq
    from .bench_kernels import capture_graph, clustered
    from .profile_compress_variants import _bitwise
    x0 = clustered(shape, seed=1)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    prev = qvg.compress(x0, method, centroids=k)  # the previous chunk (cold, not timed): its centroids warm-start
    o = resolve_options(method, shape, centroids=k)
    warm = init_centroids(prev, o, shape)
    ref = compress_prq(x1, o, warm, 2, variant="fast")
    xf = x1.float()
    rows, graphs = [], {}
    for name, v in cands.items():
        row = {"method": method, "candidate": name, "config": v}
        try:
            eager = compress_prq(x1, o, warm, 2, variant=v)
            graph, out = capture_graph(lambda: compress_prq(x1, o, warm, 2, variant=v))  # noqa: B023
            row["graph_equals_eager"] = all(_bitwise(out[t], eager[t]) for t in eager)
            row["ids_equal_fast"] = float((eager["ids"] == ref["ids"]).float().mean())
            row["centroid_max_abs_diff_fast"] = float((eager["centroids"].float() - ref["centroids"].float()).abs()
                                                      .amax())
            pk = qvg.Packed(method, tuple(x1.shape), x1.dtype, eager, o)
            row["mse"] = float((qvg.decompress(pk).float() - xf).pow(2).mean())
            row["round_ms"] = []
            graphs[name] = graph
        except Exception as e:  # reported; the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    by_name = {r["candidate"]: r for r in rows}
    for _ in range(rounds):
        for name, graph in graphs.items():
            by_name[name]["round_ms"].append(_replay_ms(graph, reps))
    for r in rows:
        if r.get("round_ms"):
            r["cuda_graph_ms"] = float(torch.tensor(r["round_ms"]).median())
    del graphs
    torch.cuda.empty_cache()
    fast = by_name.get("fast", {}).get("cuda_graph_ms")
    timed = sorted((r for r in rows if "cuda_graph_ms" in r), key=lambda r: r["cuda_graph_ms"])
    for r in timed:
        if fast:
            r["vs_fast"] = r["cuda_graph_ms"] / fast - 1
    for r in timed[:12] + [r for r in timed[12:] if r["candidate"] == "fast"]:
        vs = f" ({100 * r['vs_fast']:+.1f}% vs fast)" if "vs_fast" in r else ""
        print(f"  {method} {r['candidate']:32s} {r['cuda_graph_ms']:.4f} ms{vs} ids={r['ids_equal_fast']:.4f} "
              f"mse={r['mse']:.4g} graph=eager:{r['graph_equals_eager']}", flush=True)
    return rows


def _checked(args) -> tuple[tuple, list[str], dict]:
    """(shape, methods, candidates) from the arguments, or ValueError naming what is wrong."""
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"--shape must be four positive integers B,H,N,D, got {args.shape!r}")
    methods = args.methods.split(",")
    if not methods or any(m not in ("qvg", "qvg-pro") for m in methods):
        raise ValueError(f"--methods must be a comma list of qvg, qvg-pro, got {args.methods!r}")
    for name in ("centroids", "rounds", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    cands = candidates()
    if args.only:
        want = [s for s in args.only.split(",") if s]
        unknown = [s for s in want if s not in cands]
        if not want or unknown:
            raise ValueError(f"--only: unknown candidates {unknown}" if unknown else "--only names no candidate")
        cands = {s: cands[s] for s in want}
    return shape, methods, cands


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,12,4680,128", help="B,H,N,D (default: a Self-Forcing chunk)")
    ap.add_argument("--centroids", type=int, default=64, help="K (default 64: the cache's K for 4,680 tokens)")
    ap.add_argument("--methods", default="qvg,qvg-pro")
    ap.add_argument("--only", default="", help="comma list of candidate names (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20, help="replays per round")
    ap.add_argument("--out", default="/tmp/qvg-sweep")
    args = ap.parse_args(argv)
    try:
        shape, methods, cands = _checked(args)
    except ValueError as e:
        print(f"sweep_compress: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sweep_compress: needs a CUDA GPU", file=sys.stderr)
        return 2
    from .bench_kernels import gpu_tag, result_header, write_result
    t0 = time.time()
    res = {**result_header("sweep_compress", argv), "shape": list(shape), "centroids": args.centroids,
           "rounds": args.rounds, "reps": args.reps, "rows": []}
    for method in methods:
        print(f"[{method}] {len(cands)} candidates at {list(shape)}, K={args.centroids}", flush=True)
        res["rows"] += sweep_method(method, shape, args.centroids, cands, args.rounds, args.reps)
    write_result(res, args.out, f"compress-sweep-{gpu_tag(res['device'])}-{'x'.join(map(str, shape))}"
                 f"-k{args.centroids}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
