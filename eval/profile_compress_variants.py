"""Kernel variants of the compress path timed against the current kernels, in one run:
`python -m qvg.eval.profile_compress --variants [--quick] [--out DIR]` -> profile-compress-variants-<gpu>.json.

At [1, 32, 29640, 128] (the LongCat span), K = 256, warm-started from the previous chunk's centroids:
- pieces, on stage 1's input (qvg's warm start): assign (the current tiles vs mode="min": one reduction, one
  tile, persistent programs), update (one-hot products vs counting sort + segmented sum, tilings), empty-cluster
  reseeding (torch vs one launch, also with half the clusters emptied) and, per method, the pack (current vs
  fused); each checked against the current kernel: ids and distances bitwise, counts equal and the centroid
  difference, reseeded centroids bitwise, packed tensors bitwise;
- per method (qvg S1/B64, qvg-pro S4/B16): compress_prq eager and replayed from a CUDA graph for "current",
  kernels/compress.py's "fast" preset and "best" (each piece's fastest verified variant), with ids agreement,
  centroid difference and reconstruction MSE against "current", replay == eager bitwise, and the kernel profile
  of "best".
The printed `recommended` dict is the COMPRESS_VARIANTS entry to paste into kernels/compress.py.
--quick: a small shape; without CUDA it runs on the CPU under TRITON_INTERPRET=1 (one call per variant, no
graphs, no profiler): a smoke test of the same code paths.
"""
from __future__ import annotations

import time

import torch

from .bench_kernels import bench, capture_graph, clustered

CUDA = torch.cuda.is_available()

ASSIGN = [("current: tiles 64x64 w4 s2", {}),
          ("min tiles 64x64 w4 s2", dict(mode="min")),
          ("min one-tile 64x256 w4", dict(mode="min", block_n=64, block_k=256, num_warps=4)),
          ("min one-tile 64x256 w8", dict(mode="min", block_n=64, block_k=256, num_warps=8)),
          ("min one-tile 128x256 w8", dict(mode="min", block_n=128, block_k=256, num_warps=8)),
          ("min one-tile 128x256 w8 s3", dict(mode="min", block_n=128, block_k=256, num_warps=8, num_stages=3))] + [
    (f"min persistent {bn}x256 w{nw} p{p}/group", dict(mode="min", block_n=bn, block_k=256, num_warps=nw, progs=p))
    for bn, nw, p in ((64, 4, 8), (64, 8, 4), (64, 8, 8), (128, 8, 4), (128, 8, 8))] + [
    # small spans (a Self-Forcing chunk: 12 groups x 4,680 tokens): more programs per group, smaller blocks
    ("min one-tile 32x256 w4", dict(mode="min", block_n=32, block_k=256, num_warps=4)),
    ("min one-tile 32x256 w2", dict(mode="min", block_n=32, block_k=256, num_warps=2)),
    ("min one-tile 16x256 w2", dict(mode="min", block_n=16, block_k=256, num_warps=2)),
    ("min persistent 64x256 w4 auto", dict(mode="min", block_n=64, block_k=256, num_warps=4, progs="auto")),
    ("min persistent 32x256 w4 auto", dict(mode="min", block_n=32, block_k=256, num_warps=4, progs="auto"))]

UPDATE = [("current: onehot k64 n32 c4096 w4 s3", {})] + [
    (f"segsum item{i} rows{r} w{w} s{st} sort{sb}",
     dict(method="segsum", item=i, rows=r, num_warps=w, num_stages=st, sort_block=sb))
    for i, r, w, st, sb in ((256, 16, 4, 3, 1024),  # the default since 8238f7a
                            (256, 32, 4, 2, 1024), (128, 32, 4, 2, 1024), (512, 32, 4, 2, 1024),
                            (256, 64, 4, 2, 1024), (256, 64, 8, 2, 1024), (512, 64, 8, 2, 1024),
                            (256, 32, 4, 3, 1024), (256, 64, 4, 3, 1024), (256, 16, 2, 2, 1024),
                            (256, 32, 4, 2, 256), (256, 32, 4, 2, 4096),
                            # small spans: shorter work items and sort blocks (more programs per group)
                            (64, 16, 2, 2, 256), (64, 32, 4, 2, 256), (128, 16, 2, 2, 256), (128, 32, 4, 2, 256),
                            (64, 16, 2, 2, 512), (128, 32, 4, 2, 512), (32, 16, 2, 2, 128))] + [
    # counted ranks instead of the block sort (kernels/kmeans_segsum.py block="rank"), on the default's tiling
    (f"segsum item256 rows16 w4 s3 sort1024 rank r{r} w{rw}",
     dict(method="segsum", item=256, rows=16, num_warps=4, num_stages=3, sort_block=1024, block="rank", rank_rows=r,
          rank_warps=rw)) for r, rw in ((32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (16, 1))] + [
    (f"onehot k64 n{bn} c{ch} w{w}", dict(method="onehot", block_k=64, block_n=bn, chunk=ch, num_warps=w))
    for bn, ch, w in ((32, 256, 4), (32, 512, 4), (64, 512, 4), (32, 1024, 4), (64, 1024, 8), (16, 256, 2))]

PACK = [("current: bn16 w2", {}), ("current bn8 w2", dict(block_n=8))] + [
    (f"fused bn{bn} w{nw}", dict(fused=True, block_n=bn, num_warps=nw))
    for bn, nw in ((16, 2), (8, 2), (16, 4), (32, 4), (8, 1), (32, 8))]


def _smoke(cfgs, keep):
    """Without CUDA (the interpreter), only some configurations, one of each code path."""
    return cfgs if CUDA else [cfgs[i] for i in keep]


def _ms(fn) -> float:
    """Median ms on the GPU; on the CPU one timed call (the interpreter: a smoke test, not a measurement)."""
    if CUDA:
        return bench(fn, warmup=5, rep=40)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _sweep(label: str, cfgs, call, check) -> list[dict]:
    """Each (name, kw): out = call(kw) (compiles), check(out) -> dict with "ok", then its time. Failures (a tile that
    does not fit) are recorded, not fatal."""
    rows = []
    for name, kw in cfgs:
        row = {"name": name, "kw": kw}
        try:
            out = call(kw)
            _sync()
            row.update(check(out))
            row["ms"] = _ms(lambda: call(kw))
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("name", "kw")}
        print(f"  {label:7s} {name:42s} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in shown.items()), flush=True)
    return rows


def _best(rows: list[dict]) -> dict:
    good = [r for r in rows if r.get("ok") and "ms" in r]
    return min(good, key=lambda r: r["ms"]) if good else rows[0]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(_raw(a), _raw(b)))


def _raw(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def _pack_check(got: dict, want: dict) -> dict:
    eq = {k: float((_raw(got[k]) == _raw(want[k])).float().mean()) for k in want}
    out = {"ok": set(got) == set(want) and all(v == 1.0 for v in eq.values()), "equal_fraction": eq}
    if "tscale" in want:  # torch's CUDA tscale may be 1 ulp off the correctly rounded one the fused pack computes
        out["tscale_max_ulp"] = int((_raw(got["tscale"]).long() - _raw(want["tscale"]).long()).abs().max())
        out["ok"] = out["ok"] or (out["tscale_max_ulp"] <= 1 and eq["codes"] >= 0.999)
    return out


def pieces(xg: torch.Tensor, c0: torch.Tensor) -> dict:
    """assign / update / reseed variants on one stage's input xg [G, N, D] bf16, warm centroids c0 [G, K, D]."""
    from qvg.kernels import kmeans as kk
    from qvg.kernels.kmeans_reseed import reseed_empty_fused
    from qvg.kernels.kmeans_segsum import sort_by_cluster
    from qvg.kmeans import reseed_empty
    out = {}
    c0 = c0.float().contiguous()
    ids_ref, dist_ref = kk.assign(xg, c0, True)
    out["assign"] = _sweep("assign", _smoke(ASSIGN, (0, 1, 3, 7)), lambda kw: kk.assign(xg, c0, True, **kw),
                           lambda o: {"ok": _bitwise(o[0], ids_ref) and _bitwise(o[1], dist_ref)})
    new_ref, cnt_ref = kk.update_with_counts(xg, ids_ref, c0)
    scale = float(xg.float().abs().amax())

    def upd_check(o):
        diff = float((o[0] - new_ref).abs().amax())
        return {"ok": bool(torch.equal(o[1], cnt_ref)) and diff <= 1e-5 * scale, "max_abs_diff": diff,
                "bitwise_fraction": float((_raw(o[0]) == _raw(new_ref)).float().mean())}
    out["update"] = _sweep("update", _smoke(UPDATE, (0, 1, 10)),
                           lambda kw: kk.update_with_counts(xg, ids_ref, c0, **kw), upd_check)
    k = c0.shape[1]
    out["sort_by_cluster_ms"] = _ms(lambda: sort_by_cluster(ids_ref, k))
    out["sort_by_cluster_rank_ms"] = _ms(lambda: sort_by_cluster(ids_ref, k, block="rank"))  # counted ranks
    out["x_read_floor_ms"] = _x_read_ms(xg)
    print(f"  update  counting sort alone {out['sort_by_cluster_ms']:.4f} ms (with counted ranks "
          f"{out['sort_by_cluster_rank_ms']:.4f} ms); one read of x (half a copy) "
          f"{out['x_read_floor_ms']:.4f} ms", flush=True)
    out["empty_clusters"] = int((cnt_ref == 0).sum())
    rows = []
    for case, counts in (("real counts", cnt_ref), ("half emptied", cnt_ref * (torch.arange(k, device=xg.device)
                                                                                % 2 == 1))):
        want = reseed_empty(xg, new_ref.clone(), counts, dist_ref)
        rows += _sweep("reseed", [(f"torch ({case})", "torch"), (f"fused ({case})", "fused")],
                       lambda v: (reseed_empty if v == "torch" else reseed_empty_fused)(xg, new_ref.clone(), counts,
                                                                                         dist_ref),
                       lambda o: {"ok": _bitwise(o, want)})
    out["reseed"] = rows
    return out


def _x_read_ms(xg: torch.Tensor) -> float:
    buf = torch.empty_like(xg)
    return _ms(lambda: buf.copy_(xg)) / 2


def pack_sweep(x1, o, ref_tensors) -> list[dict]:
    from qvg.compression.registry import token_spec
    from qvg.kernels.quantize import quantize_packed
    ids, cents = ref_tensors["ids"], ref_tensors["centroids"]
    want = {k: v for k, v in ref_tensors.items() if k not in ("ids", "centroids")}
    return _sweep("pack", _smoke(PACK, (0, 2)), lambda kw: quantize_packed(x1, token_spec(o), ids, cents, **kw),
                  lambda got: _pack_check(got, want))


def recommended(p: dict, packs: list[list[dict]]) -> dict:
    """The fastest verified variant of each piece (packs: one sweep per method, summed)."""
    a, u = _best(p["assign"])["kw"], _best(p["update"])["kw"]
    rs = {r["name"]: r for r in p["reseed"]}
    fused_ok = all(r.get("ok") for r in p["reseed"])
    reseed = "fused" if fused_ok and rs["fused (real counts)"]["ms"] < rs["torch (real counts)"]["ms"] else "torch"
    totals = {}
    for rows in packs:
        for r in rows:
            if r.get("ok") and "ms" in r:
                totals.setdefault(r["name"], [0.0, 0, r["kw"]])
                totals[r["name"]][0] += r["ms"]
                totals[r["name"]][1] += 1
    full = {n: v for n, v in totals.items() if v[1] == len(packs)}
    pack = min(full.values(), key=lambda v: v[0])[2] if full else {}
    return dict(assign_kw=dict(a), update_kw=dict(u), reseed=reseed, pack_kw=dict(pack))


def _graph_ms(fn):
    """(ms of a CUDA-graph replay of fn, the graph's output, the graph) or an error string."""
    graph, out = capture_graph(fn)
    return bench(graph.replay, warmup=5, rep=40), out, graph


def compress_rows(method, x1, o, warm, variants: dict, ref: dict) -> list[dict]:
    import qvg
    from qvg.kernels.compress import compress_prq
    from .profile_compress import _profile
    rows = []
    xf = x1.float()
    for name, v in variants.items():
        row = {"method": method, "variant": name, "config": v}
        try:
            fn = lambda: compress_prq(x1, o, warm, 2, variant=v)  # noqa: E731
            got = fn()
            if CUDA:  # (the interpreter: one call)
                again = fn()
                row["deterministic"] = all(_bitwise(got[k], again[k]) for k in got)
                row["ms"] = _ms(fn)
            row["ids_equal_current"] = float((got["ids"] == ref["ids"]).float().mean())
            row["centroid_max_abs_diff_current"] = float((got["centroids"].float() - ref["centroids"].float()).abs()
                                                         .amax())
            packed = qvg.Packed(method, tuple(x1.shape), x1.dtype, got, o)
            row["mse"] = float((qvg.decompress(packed).float() - xf).pow(2).mean())
            if CUDA:
                try:
                    row["cuda_graph_ms"], gout, _ = _graph_ms(fn)
                    row["graph_equals_eager"] = all(_bitwise(gout[k], got[k]) for k in got)
                except Exception as e:
                    row["cuda_graph_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
                if name == "best":
                    row["kernels"] = _profile(fn)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("method", "variant", "config", "kernels")}
        print(f"  compress {method} {name:8s} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in shown.items()), flush=True)
        for kr in row.get("kernels", [])[:12]:
            print(f"      {kr['us_per_call']:8.1f} us  x{kr['launches_per_call']:.0f}  {kr['kernel']}", flush=True)
    return rows


def run_variants(quick: bool, shape: tuple | None = None, centroids: int | None = None) -> dict:
    import qvg
    from qvg.compression import resolve_options
    from qvg.compression.prq import init_centroids
    from qvg.kernels.compress import COMPRESS_VARIANTS, compress_prq
    dev = "cuda" if CUDA else "cpu"
    shape = shape or ((1, 32, 29640, 128) if not quick else ((1, 4, 4680, 128) if CUDA else (1, 1, 300, 128)))
    extra = {} if centroids is None else {"centroids": centroids}
    x0 = clustered(shape, seed=1, device=dev)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    setups = {}
    for method in ("qvg", "qvg-pro"):
        prev = qvg.compress(x0, method, **extra)  # cold start (not timed): its centroids warm-start the next chunk
        o = resolve_options(method, shape, **extra)
        warm = init_centroids(prev, o, shape)
        setups[method] = (o, warm, compress_prq(x1, o, warm, 2, variant="current"))
    t0 = time.perf_counter()
    o, warm, _ = setups["qvg"]
    print(f"pieces at {list(shape)}, K={o['centroids']}, stage 1, qvg's warm start", flush=True)
    res = {"shape": list(shape), "pieces": pieces(x1.view(-1, shape[2], shape[3]), warm[0])}
    res["pack"] = {}
    for method, (o, warm, ref) in setups.items():
        print(f"pack {method}", flush=True)
        res["pack"][method] = pack_sweep(x1, o, ref)
    rec = recommended(res["pieces"], list(res["pack"].values()))
    res["recommended"] = rec
    print(f"recommended COMPRESS_VARIANTS entry: {rec}", flush=True)
    res["compress"] = []
    for method, (o, warm, ref) in setups.items():
        res["compress"] += compress_rows(method, x1, o, warm, {"current": "current", "fast": COMPRESS_VARIANTS["fast"],
                                                               "best": rec}, ref)
    res["sweep_seconds"] = time.perf_counter() - t0
    return res
