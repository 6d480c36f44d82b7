"""The sweep: inputs (start images or prompts) x sampling seeds x methods x bits on a pipeline (default: the
embedded world model), each video compared with the BF16-cache video of the same input and seed, laid out as the
paper's Table 1 (compression ratio, PSNR, SSIM, LPIPS, VBench dimensions where their weights exist), mean ± std
over inputs x seeds, with two seed-variance floors:

- sampling floor: the BF16 video of seed s against the BF16 video of the next seed (same input): how far two
  equally valid samples are apart. A method's distance to its reference is only worth reading against it.
- k-means floor: for the k-means methods (qvg, qvg-pro), the same method at another k-means seed against the first
  (same input and sampling seed), and the spread (std over k-means seeds) of its score against the reference.

Every run records its input, sampling seed, method, options, k-means seed, the cache's bytes by component at its
largest (`qvg.cache.KVCache.memory`), seconds and its comparison; `table` is computed from those records only, so a
saved JSON re-renders without re-running (`rows(res)`).
"""
from __future__ import annotations

import statistics

from .compare import compare
from .progress import bar as progress_bar

METRICS = ("psnr", "ssim", "lpips")


def has_kmeans(method: str) -> bool:
    """Whether the method's runs differ by k-means seed (the sweep's second seed axis)."""
    from qvg.compression import kmeans_methods
    return method in kmeans_methods()


def _brief(c: dict) -> dict:
    """The parts of a `compare` result a sweep keeps (per-frame PSNR for the curves, windows)."""
    w = c["windows"]
    keep = lambda d: {k: d[k] for k in ("frames", "psnr", "psnr_frame_mean", "ssim", "lpips")}  # noqa: E731
    return {"onset": keep(w["onset"]), "video": keep(w["video"]), "first_below": c["first_below"],
            "frame_psnr": c["frames"]["psnr"], "frame_ssim": c["frames"]["ssim"], "frame_lpips": c["frames"]["lpips"]}


def run(runner, spec: dict, *, lpips_model=None, vbench: dict | None = None, progress: bool = True) -> dict:
    """spec: inputs, seeds, methods, bits, kmeans_seeds (the first for the main runs, the rest for the floor),
    floor_bits (bits of the extra k-means-seed runs; default all), chunks, onset_chunks, threshold. vbench:
    {dimension: scorer} (strings = unavailable, skipped)."""
    inputs, seeds, methods, bits = spec["inputs"], spec["seeds"], spec["methods"], spec["bits"]
    kseeds = spec.get("kmeans_seeds", [0])
    floor_bits = spec.get("floor_bits", bits)
    cmp = dict(lead=runner.lead, first=runner.first, chunk=runner.chunk, onset_chunks=spec.get("onset_chunks", 1),
               threshold=spec.get("threshold", 30.0), lpips_model=lpips_model)
    scorers = {k: v for k, v in (vbench or {}).items() if not isinstance(v, str)}
    jobs = []
    for m in methods:
        for b in bits:
            jobs.append((m, b, kseeds[0]))
            if has_kmeans(m) and b in floor_bits:
                jobs += [(m, b, k) for k in kseeds[1:]]
    bar = progress_bar(len(inputs) * len(seeds) * (1 + len(jobs)), "sweep", progress, unit="video")
    runs, sampling_floor, kmeans_floor = [], [], []
    for inp in inputs:
        refs = {}
        for s in seeds:
            bar.set_postfix_str(f"{inp} seed {s} bf16")
            ref = runner.run(inp, s, "bf16", {}, spec["chunks"])
            refs[s] = ref.video
            rec = {"input": inp, "seed": s, "method": "bf16", "bits": 16, "kmeans_seed": None, "options": {},
                   "memory": ref.memory, "seconds": round(ref.seconds, 2), "vs_ref": None,
                   "vbench": {k: f(ref.video) for k, f in scorers.items()}, **_path(ref)}
            runs.append(rec)
            bar.update(1)
            first_k = {}
            for m, b, k in jobs:
                bar.set_postfix_str(f"{inp} seed {s} {m} int{b}" + (f" k-means seed {k}" if has_kmeans(m) else ""))
                opts = {"bits": b, **({"seed": k} if has_kmeans(m) else {})}
                out = runner.run(inp, s, m, opts, spec["chunks"])
                runs.append({"input": inp, "seed": s, "method": m, "bits": b,
                             "kmeans_seed": k if has_kmeans(m) else None, "options": opts, "memory": out.memory,
                             "seconds": round(out.seconds, 2), "vs_ref": _brief(compare(ref.video, out.video, **cmp)),
                             "vbench": {n: f(out.video) for n, f in scorers.items()}, **_path(out)})
                if has_kmeans(m):
                    if (m, b) in first_k:
                        kmeans_floor.append({"input": inp, "seed": s, "method": m, "bits": b,
                                             "kmeans_seeds": [kseeds[0], k],
                                             **_brief(compare(first_k[(m, b)], out.video, **cmp))})
                    else:
                        first_k[(m, b)] = out.video
                bar.update(1)
        for a, b in zip(seeds, seeds[1:]):
            sampling_floor.append({"input": inp, "seeds": [a, b], **_brief(compare(refs[a], refs[b], **cmp))})
    bar.close()
    res = {"spec": spec, "runs": runs, "sampling_floor": sampling_floor, "kmeans_floor": kmeans_floor,
           "layout": {"lead": runner.lead, "first": runner.first, "chunk": runner.chunk},
           "vbench_unavailable": {k: v for k, v in (vbench or {}).items() if isinstance(v, str)},
           "lpips": lpips_model is not None}
    res["table"] = rows(res)
    return res


def _ms(vals: list) -> dict | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals)}


def rows(res: dict) -> list[dict]:
    """Table 1 from the run records: one row per (method, bits) (BF16 first), then the floors."""
    spec, runs = res["spec"], res["runs"]
    k0 = spec.get("kmeans_seeds", [0])[0]
    dims = sorted({d for r in runs for d in r["vbench"]})
    out = []
    for m in ["bf16"] + list(spec["methods"]):
        for b in ([16] if m == "bf16" else spec["bits"]):
            main = [r for r in runs if r["method"] == m and r["bits"] == b and r["kmeans_seed"] in (None, k0)]
            if not main:
                continue
            mem = main[0]["memory"]
            row = {"method": m, "bits": b, "n": len(main), "kind": "method",
                   "compression_ratio": statistics.fmean(r["memory"]["compression_ratio"] for r in main),
                   "kv_bytes": mem["total"], "bf16_equivalent": mem["bf16_equivalent"],
                   "vbench": {d: _ms([r["vbench"].get(d) for r in main]) for d in dims}}
            for win in ("onset", "video"):
                row[win] = {k: (_ms([r["vs_ref"][win][k] for r in main]) if m != "bf16" else None) for k in METRICS}
            if has_kmeans(m):  # spread over k-means seeds of the onset PSNR, per (input, seed), averaged
                groups = {}
                for r in runs:
                    if r["method"] == m and r["bits"] == b:
                        groups.setdefault((r["input"], r["seed"]), []).append(r["vs_ref"]["onset"]["psnr"])
                sds = [statistics.stdev(v) for v in groups.values() if len(v) > 1]
                row["kmeans_seed_std_onset_psnr"] = statistics.fmean(sds) if sds else None
                row["kmeans_seeds"] = max(len(v) for v in groups.values())
            out.append(row)
    if res["sampling_floor"]:
        f = res["sampling_floor"]
        out.append({"method": "bf16: another sampling seed", "bits": 16, "kind": "floor", "n": len(f),
                    **{w: {k: _ms([r[w][k] for r in f]) for k in METRICS} for w in ("onset", "video")}})
    groups = {}
    for r in res["kmeans_floor"]:
        groups.setdefault((r["method"], r["bits"]), []).append(r)
    for (m, b), f in groups.items():
        out.append({"method": f"{m}: another k-means seed", "bits": b, "kind": "floor", "n": len(f),
                    **{w: {k: _ms([r[w][k] for r in f]) for k in METRICS} for w in ("onset", "video")}})
    return out


def _pm(d: dict | None, digits: int) -> str:
    if d is None:
        return "-"
    m = f"{d['mean']:.{digits}f}"  # (a PSNR of identical videos is the metric's 100 dB cap, as the JSON and report
    # have it: it was printed "inf" here)
    return m if d["std"] is None else f"{m} ± {d['std']:.{digits}f}"


def table_markdown(res: dict) -> str:
    """The Table 1 layout in markdown."""
    rs = res["table"]
    dims = sorted({d for r in rs for d in r.get("vbench", {})})
    head = ["method", "bits", "compression", "onset PSNR dB", "onset SSIM", "onset LPIPS", "video PSNR dB",
            "video SSIM", "video LPIPS", "k-means seed std (onset PSNR)"] + dims + ["n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        on, vi = r.get("onset") or {}, r.get("video") or {}
        ratio = f"{r['compression_ratio']:.2f}x" if "compression_ratio" in r else "-"
        name = r["method"] if r["kind"] == "method" else f"*floor: {r['method']}*"
        ks = r.get("kmeans_seed_std_onset_psnr")
        cells = [name, "BF16" if r["bits"] == 16 else f"INT{r['bits']}", ratio]
        if r["method"] == "bf16":
            cells += ["ref"] * 6
        else:
            cells += [_pm(on.get("psnr"), 2), _pm(on.get("ssim"), 4), _pm(on.get("lpips"), 4),
                      _pm(vi.get("psnr"), 2), _pm(vi.get("ssim"), 4), _pm(vi.get("lpips"), 4)]
        cells.append("-" if ks is None else f"{ks:.2f} ({r['kmeans_seeds']} seeds)")
        cells += [_pm(r.get("vbench", {}).get(d), 4) for d in dims] + [str(r["n"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _path(v) -> dict:
    """{"video": the mp4 a run wrote} where the runner wrote one (qvg-generate's), else nothing."""
    return {"video": v.path} if getattr(v, "path", None) else {}


def file_markdown(res: dict) -> str:
    """sweep.md: what ran (inputs, seeds, chunks, command, commit, device), the table, and the notes (a floor one
    seed could not give, a metric left out)."""
    m, sp = res.get("meta", {}), res.get("spec", {})
    what = "; ".join(f"{k.replace('_', ' ')} {', '.join(map(str, v)) if isinstance(v, list) else v}"
                     for k, v in sp.items() if k in ("inputs", "seeds", "kmeans_seeds", "chunks", "onset_chunks"))
    dirty = " (with uncommitted changes)" if m.get("git_dirty") else ""
    lines = ["# qvg-eval sweep", "", f"`{m.get('command', '')}`, at {m.get('git_commit', '?')}{dirty} on "
             f"{m.get('device', '?')}, {m.get('date', '')}" + (f"; {what}" if what else ""), "", table_markdown(res)]
    lines += ["", *(f"- note: {n}" for n in res.get("notes", []))] if res.get("notes") else []
    return "\n".join(lines)


def memory_rows(res: dict) -> list[dict]:
    """Bytes by component of the cache at its largest, per (method, bits) (the first run of each)."""
    from qvg.cache import MEMORY_COMPONENTS
    seen, out = set(), []
    for r in res["runs"]:
        key = (r["method"], r["bits"])
        if key in seen:
            continue
        seen.add(key)
        m = r["memory"]
        out.append({"method": r["method"], "bits": r["bits"],
                    **{c: m.get(c, 0) for c in (*MEMORY_COMPONENTS,
                                                "bf16_sink", "bf16_pending", "bf16_current", "bf16_residual",
                                                "total", "bf16_equivalent")}})
    return out


if __name__ == "__main__":  # (python -m qvg.eval.sweep runs `qvg-eval sweep`, with its checks)
    import sys

    from .cli import main
    raise SystemExit(main(["sweep", *sys.argv[1:]]))
