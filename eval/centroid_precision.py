"""How coarse can the stored centroids be? `python -m qvg.eval.centroid_precision [--out DIR] [--seeds 0,1,2]`
-> centroid_precision.json / .md.

qvg / qvg-pro store each PRQ stage's centroid table in BF16. At qvg-pro's S = 4 the fused decode gathers four
256-byte BF16 rows per token, mostly from L2 (36% L1 hits on an H200, eval/results/ncu-kernels-h200.cd50645.json),
and the tables cost 16 S K / N bits per element. This measures what FP8 E4M3 tables (one power-of-two FP32 scale per
table, i.e. per stage and head, as the group scales' tscale) would cost in quality: the torch compress path
(`prq.compress_torch`) with each table of stage >= `fp8_from` rounded to nearest FP8 before it is subtracted, so
later stages and the quantized residual absorb the rounding (decode replays it exactly). Variants: bf16 (the
format), fp8 from stage 1 (stage 0's semantic centroids stay BF16), fp8 for every stage.

Data: the synthetic video-like KV of one Self-Forcing chunk (qvg.eval.synthetic_kv, 12 heads x 4,680 tokens) at the
cache's K = 64 and the paper's K = 256; and the K/V the embedded world model writes into its cache in a rollout
(every layer, chunks 1-3; keys after RoPE) at the cache's K for its chunk. INT2, qvg (S = 1, B = 64) and qvg-pro
(S = 4, B = 16); relative MSE = MSE / mean(x^2), mean +- std over k-means seeds (the seed floor) and the per-seed
ratio fp8 / bf16. Bits per element: analytic, with 8-bit entries and one 32-bit scale per FP8 table."""
from __future__ import annotations

import statistics
import time

import torch

import qvg
from qvg.compression.prq import COLD_ITERS, bf16_centroids, compress_torch
from qvg.compression import resolve_options
from qvg.packed import Packed
from qvg.quant import FP8_MAX, tensor_scale

from .study_outputs import out_error, parser, save, stamp

VARIANTS = {"bf16": None, "fp8 from stage 1": 1, "fp8 every stage": 0}
METHODS = (("qvg", 1, 64), ("qvg-pro", 4, 16))  # (name, stages, block size)


def fp8_table(c: torch.Tensor) -> torch.Tensor:
    """Centroid tables c [G, K, D] (FP32) -> their values as FP8 E4M3 x one power-of-two scale per table (the
    largest |entry| maps into (224, 448]), in BF16 (exact: 4 significant bits times a power of two)."""
    ts = tensor_scale(c.abs()[None])[0][:, None, None]  # [G, 1, 1]
    q = (c / ts).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * ts
    return q.to(torch.bfloat16)


def store_for(fp8_from: int | None):
    """The `compress_torch` store of a variant: BF16 tables, FP8 ones from stage fp8_from on."""
    if fp8_from is None:
        return bf16_centroids
    return lambda c, s: fp8_table(c) if s >= fp8_from else bf16_centroids(c, s)


def table_bits(stages: int, k: int, n: int, d: int, fp8_from: int | None) -> float:
    """Centroid bits per element of the tables: 16 per BF16 entry, 8 per FP8 entry plus 32 per FP8 table."""
    fp8 = 0 if fp8_from is None else stages - fp8_from
    return ((stages - fp8) * 16 * k * d + fp8 * (8 * k * d + 32)) / (n * d)


def measure(x: torch.Tensor, k: int, seeds: list[int]) -> list[dict]:
    """Rows (method, variant): rel MSE per seed for x [B, H, N, D] at K = k, INT2."""
    ms = float(x.float().pow(2).mean())
    rows = []
    for name, stages, bs in METHODS:
        o = resolve_options(name, tuple(x.shape), bits=2, centroids=k)
        base_bits = qvg.bits_per_element(name, tuple(x.shape), bits=2, centroids=k)
        bf16_rel = None
        for label, f in VARIANTS.items():
            if f is not None and f >= stages:
                f = None  # (no FP8 stage at this S: the BF16 format, measured once)
            if f is None and bf16_rel is not None:
                rel = list(bf16_rel)
            else:
                rel = []
                for s in seeds:
                    oo = {**o, "seed": s}
                    t = compress_torch(x, oo, None, COLD_ITERS, store=store_for(f))
                    y = qvg.decompress(Packed(name, tuple(x.shape), x.dtype, t, oo))
                    rel.append(float((y.float() - x.float()).pow(2).mean()) / ms)
                if f is None:
                    bf16_rel = rel
            n, d = x.shape[2], x.shape[3]
            bits = base_bits - table_bits(stages, k, n, d, None) + table_bits(stages, k, n, d, f)
            rows.append({"method": name, "variant": label, "rel_mse": rel, "bits_per_element": bits})
    for r in rows:
        base = next(b for b in rows if b["method"] == r["method"] and b["variant"] == "bf16")
        r["ratio_to_bf16"] = [a / b for a, b in zip(r["rel_mse"], base["rel_mse"])]
    return rows


def embedded_kv(chunks=(1, 2, 3)) -> tuple[list[tuple[str, torch.Tensor]], int, dict]:
    """(label, tensor) of every layer's K (after RoPE) and V at `chunks` of the embedded model's BF16 rollout, the
    cache's K for its chunk, and what was run."""
    from qvg.cache import default_centroids
    from .kv_capture import KVCapture
    from .runners import EmbeddedRunner
    runner = EmbeddedRunner()
    cap = KVCapture(runner.model)
    runner.run("coffee", 0, "bf16", {}, max(chunks), capture=cap)
    out = []
    for c in chunks:
        for layer in range(cap.num_layers):
            out += [(f"K chunk {c} layer {layer}", cap.key(c, layer)), (f"V chunk {c} layer {layer}",
                                                                         cap.value(c, layer))]
    return out, default_centroids(runner.unit_tokens), {"image": "coffee", "seed": 0, "chunks": list(chunks),
                                                         **runner.describe()}


def run(seeds: list[int]) -> dict:
    from .synthetic_kv import synthetic_kv
    sets = []
    k, v = synthetic_kv()
    for kk in (64, 256):
        sets.append({"data": "synthetic", "tensor": "K", "K": kk, "rows": measure(k, kk, seeds)})
        sets.append({"data": "synthetic", "tensor": "V", "K": kk, "rows": measure(v, kk, seeds)})
    tensors, kk, what = embedded_kv()
    for label, x in tensors:
        sets.append({"data": "embedded", "tensor": label, "K": kk, "rows": measure(x, kk, seeds)})
    return {"sets": sets, "embedded": what, "shape_synthetic": list(k.shape),
            "shape_embedded": list(tensors[0][1].shape)}


def summary(res: dict) -> list[dict]:
    """Per (data, tensor kind, K, method, variant): mean / std of the rel MSE over sets x seeds, and of the ratio."""
    groups: dict = {}
    for st in res["sets"]:
        kind = st["tensor"].split()[0]
        for r in st["rows"]:
            g = groups.setdefault((st["data"], kind, st["K"], r["method"], r["variant"]),
                                  {"rel": [], "ratio": [], "bits": r["bits_per_element"], "seed_std": []})
            g["rel"] += r["rel_mse"]
            g["ratio"] += r["ratio_to_bf16"]
            if len(r["rel_mse"]) > 1:
                g["seed_std"].append(statistics.stdev(r["rel_mse"]) / statistics.fmean(r["rel_mse"]))
    out = []
    for (data, kind, k, m, var), g in groups.items():
        out.append({"data": data, "tensor": kind, "K": k, "method": m, "variant": var, "bits": g["bits"],
                    "rel_mean": statistics.fmean(g["rel"]), "ratio_mean": statistics.fmean(g["ratio"]),
                    "ratio_min": min(g["ratio"]), "ratio_max": max(g["ratio"]),
                    "seed_floor": statistics.fmean(g["seed_std"]) if g["seed_std"] else None})
    return out


def markdown(res: dict) -> str:
    lines = [f"# {__doc__.splitlines()[0].split(' `')[0]}", "", f"- command: `{res['command']}`",
             f"- git commit: `{res['commit']}`", f"- date: {res['date']}; {res['platform']}",
             f"- wall time: {res['wall_s']:.0f} s", "", *__doc__.split("\n\n", 1)[1].splitlines(), "",
             "seed floor: the std / mean of one tensor's rel MSE over the k-means seeds, averaged over tensors. "
             "fp8 / bf16: per (tensor, seed) pairing, mean [min, max].", "",
             "| data | tensor | K | method | centroids | bits / element | rel MSE | seed floor | fp8 / bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["summary"]:
        floor = f"{r['seed_floor']:.2%}" if r["seed_floor"] is not None else "-"
        lines.append(f"| {r['data']} | {r['tensor']} | {r['K']} | {r['method']} | {r['variant']} | {r['bits']:.3f} | "
                     f"{r['rel_mean']:.4g} | {floor} | {r['ratio_mean']:.4f} [{r['ratio_min']:.4f}, "
                     f"{r['ratio_max']:.4f}] |")
    return "\n".join(lines) + "\n"


OUTPUTS = ("centroid_precision.json", "centroid_precision.md")


def main(argv=None) -> int:
    ap = parser("centroid_precision", __doc__, OUTPUTS)
    a = ap.parse_args(argv)
    if out_error(ap.prog, a.out, OUTPUTS):
        return 2
    t0 = time.time()
    res = stamp(run(a.seeds), ap.prog, argv, t0)
    res["summary"] = summary(res)
    return save(ap.prog, a.out, OUTPUTS, res, markdown(res))


if __name__ == "__main__":
    raise SystemExit(main())
