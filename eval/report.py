"""`qvg-eval report OUTDIR`: the whole evaluation at a size preset, one command: the sweep (Table 1 with its
seed-variance floors), quality along a long video (Fig. 5a), the analyses on K/V captured from that long video's
BF16 run (Fig. 6 MSE reduction vs RTN, Fig. 5c MSE vs PRQ stages, Fig. 7 block size and memory by component,
warm vs cold k-means, pre- vs post-RoPE keys), written as OUTDIR/report.md + PNG plots + OUTDIR/results.json.

results.json holds everything the markdown and plots are drawn from, plus how to make it again: the exact command,
git commit, date, device, preset and every seed; `qvg-eval report OUTDIR --from-json` re-renders from it.

Presets (the embedded world model; time for the whole report):
- cpu: 2 held-out photos x 2 sampling seeds x {rtn, kivi, quarot, qvg, qvg-pro} x INT2/INT4, 4 chunks, k-means
  floor at INT2 over 2 k-means seeds; long video 12 chunks (37 frames); ~9-25 min on 2 shared CPU cores (the
  committed eval/results/report-embedded-cpu/: 14 min, 1 thread, beside other work (11 min alone at 699f03c); its
  predecessor with the earlier model, -postrope: 21 min).
- gpu: 4 photos x 3 sampling seeds, 8 chunks, k-means floor at INT2 and INT4 over 3 seeds; long video 60 chunks
  (181 frames), KV analyses over more chunks and seeds (on the CPU, from the captured K/V); the committed
  eval/results/report-embedded-h200/ took 388 s on an H200 (report-embedded-h100/, the earlier model with every
  key after RoPE: 322 s on an H100).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from . import analyses, sweep
from .provenance import meta, weight_files

from qvg.cache import MEMORY_COMPONENTS  # the cache's bytes by component: they sum to its total
from qvg.outputs import atomic, write_text

METHODS = ["rtn", "kivi", "quarot", "qvg", "qvg-pro"]
PRESETS = {
    "cpu": dict(
        sweep=dict(inputs=["coffee", "camera"], seeds=[0, 1], methods=METHODS, bits=[2, 4], kmeans_seeds=[0, 1],
                   floor_bits=[2], chunks=4, onset_chunks=1, threshold=30.0),
        long=dict(image="coffee", seed=0, chunks=12, every=3,
                  methods=[["qvg int2", "qvg", {"bits": 2}], ["qvg int4", "qvg", {"bits": 4}],
                           ["qvg-pro int2", "qvg-pro", {"bits": 2}], ["rtn int2", "rtn", {"bits": 2}]]),
        block=dict(image="coffee", seed=0, chunks=4, bits=2, sizes=[16, 32, 64]),
        kv=dict(chunks=[1, 2, 3], kmeans_seeds=[0, 1, 2]),
        warm=dict(chunks=list(range(0, 7)), layers=[0, 3, 5], iters=20),
        rope=dict(chunks=list(range(0, 6)))),
    "gpu": dict(
        sweep=dict(inputs=["coffee", "camera", "astronaut", "chelsea"], seeds=[0, 1, 2], methods=METHODS,
                   bits=[2, 4], kmeans_seeds=[0, 1, 2], floor_bits=[2, 4], chunks=8, onset_chunks=1,
                   threshold=30.0),
        long=dict(image="coffee", seed=0, chunks=60, every=6,
                  methods=[["qvg int2", "qvg", {"bits": 2}], ["qvg int4", "qvg", {"bits": 4}],
                           ["qvg-pro int2", "qvg-pro", {"bits": 2}], ["rtn int2", "rtn", {"bits": 2}],
                           ["kivi int2", "kivi", {"bits": 2}], ["quarot int2", "quarot", {"bits": 2}]]),
        block=dict(image="coffee", seed=0, chunks=8, bits=2, sizes=[16, 32, 64]),
        kv=dict(chunks=[1, 5, 10, 20, 40], kmeans_seeds=[0, 1, 2, 3, 4]),
        warm=dict(chunks=list(range(0, 21)), layers=None, iters=30),
        rope=dict(chunks=list(range(0, 21)))),
}


def run(outdir, preset: dict, runner, *, command: str, device="cpu", preset_name: str = "custom",
        lpips_model=None, lpips_status: str = "", vbench: dict | None = None, progress: bool = True,
        skip: tuple = ()) -> dict:
    """Run the preset's parts (skip: names among sweep, long, block, kv, warm, rope) and write the report."""
    from qvg.cache import default_centroids

    from .kv_capture import KVCapture
    t0 = time.perf_counter()
    if not lpips_status:
        lpips_status = "computed" if lpips_model is not None else "not computed (no LPIPS model given)"
    res = {"meta": meta(command, device, preset=preset_name, spec=preset,
                        lpips=lpips_status, vbench={k: (v if isinstance(v, str) else "computed")
                                                    for k, v in (vbench or {}).items()},
                        weight_files=weight_files(lpips_model, *(vbench or {}).values())),
           "model": runner.describe()}
    layers = list(range(runner.describe().get("layers", 1)))
    k = default_centroids(runner.unit_tokens)
    res["meta"]["centroids"] = k
    if "sweep" not in skip:
        res["sweep"] = sweep.run(runner, preset["sweep"], lpips_model=lpips_model, vbench=vbench, progress=progress)
    need_capture = not {"kv", "warm", "rope"} <= set(skip)
    lg = preset["long"]
    if "long" not in skip or need_capture:
        cap = KVCapture(runner.model)
        if "long" not in skip:
            res["long_video"] = analyses.long_video(
                runner, lg["image"], lg["seed"], lg["chunks"], [tuple(m) for m in lg["methods"]], lg["every"],
                capture=cap, progress=progress)
        else:  # (only the K/V analyses' input: the long video's BF16 run, not its other five runs and figure)
            runner.run(lg["image"], lg["seed"], "bf16", {}, lg["chunks"], capture=cap)
        res["capture"] = {"image": lg["image"], "seed": lg["seed"], "chunks": len(cap.chunks),
                          "note": "K/V of the BF16 run of the long video; chunk 0 is the start image's context chunk"}
        n = len(cap.chunks)
        if "kv" not in skip:
            res["kv"] = analyses.kv_sections(cap, [c for c in preset["kv"]["chunks"] if c < n], layers, k,
                                             preset["kv"]["kmeans_seeds"], progress=progress)
        if "warm" not in skip:
            w = preset["warm"]
            res["warm_cold"] = analyses.warm_cold(cap, [c for c in w["chunks"] if c < n], w["layers"] or layers,
                                                  k, iters=w["iters"], progress=progress)
        if "rope" not in skip:
            res["rope"] = analyses.rope_sections(cap, [c for c in preset["rope"]["chunks"] if c < n], layers, k)
        del cap
    if "block" not in skip:
        b = preset["block"]
        res["block_sizes"] = analyses.block_sizes(runner, b["image"], b["seed"], b["chunks"], b["bits"], b["sizes"],
                                                  progress=progress)
    res["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    save(res, outdir)
    return res


def save(res: dict, outdir) -> list[str]:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.json", json.dumps(res, indent=1, default=_json) + "\n")
    return [f"wrote {out / 'results.json'}"] + render(res, out)


def _json(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(f"not JSON-able: {type(o).__name__}")


# --- rendering (from the results dict only) ---------------------------------------------------------------------

def _f(v, d=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return _f(v["mean"], d) + ("" if v.get("std") is None else f" ± {v['std']:.{d}g}")
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v:.{d}g}"


def _table(head, rows) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                         for r in rows]


def render(res: dict, out: Path) -> list[str]:
    """report.md and the plots of `res` (a results.json's content) in `out`; the lines to print. All or nothing:
    an error while rendering (results of another shape: a part missing, a value of the wrong type) is raised before
    any file is written, and leaves the folder as it was."""
    writes = []  # (plt, figure, path): saved only once every section has rendered
    try:
        L, notes = _render(res, out, writes)
    except BaseException:
        for plt, fig, _ in writes:
            plt.close(fig)
        raise
    notes += [_save(*w) for w in writes]
    write_text(out / "report.md", "\n".join(L) + "\n")
    return [f"wrote {out / 'report.md'}"] + [n for n in notes if n]


def _render(res: dict, out: Path, writes: list) -> tuple[list[str], list[str]]:
    """render's markdown lines and notes; its figures queued in `writes`."""
    m, model = res["meta"], res["model"]
    L = [f"# QVG evaluation report: {model.get('pipeline')} ({m['preset']} preset)", "",
         f"- command: `{m['command']}`",
         f"- git commit `{m['git_commit']}`" + (" (uncommitted changes in the tree)" if m.get("git_dirty") else "")
         + f"; date {m['date']}; device: {m['device']}; torch {m['torch']}; wall time {m.get('wall_s')} s",
         f"- model: {', '.join(f'{k} {v}' for k, v in model.items())}",
         "- KV cache: the history compressed chunk by chunk "
         + ("as `qvg-generate` runs it (keys packed before RoPE for rtn / qvg / qvg-pro)"
            if model.get("key_storage") == "auto" else "with every method's keys after RoPE (`qvg-generate` packs "
            "rtn / qvg / qvg-pro keys before RoPE on this model)")
         + f"; k-means methods at K = {m['centroids']} centroids per chunk (`default_centroids`), streaming warm start",
         f"- LPIPS: {m['lpips'] or 'computed'}",
         "- VBench: " + ("; ".join(f"{k}: {v}" for k, v in m["vbench"].items()) or "not asked for"),
         *_weights_md(m),
         f"- everything below is drawn from [results.json](results.json) (`qvg-eval report {out} --from-json` "
         "re-renders it)", ""]
    notes = []
    if "sweep" in res:
        L += _sweep_md(res["sweep"])
        notes.append(_plot_sweep(writes, res["sweep"], out / "sweep_quality.png"))
        notes.append(_plot_memory(writes, res["sweep"], out / "memory_breakdown.png"))
    if "long_video" in res:
        L += _long_md(res["long_video"])
        notes.append(_plot_long(writes, res["long_video"], out / "long_video.png"))
    if "kv" in res:
        L += _kv_md(res["kv"], res.get("capture", {}))
        notes.append(_plot_kv(writes, res["kv"], out / "kv_analyses.png"))
    if "block_sizes" in res:
        L += _block_md(res["block_sizes"])
    if "warm_cold" in res:
        L += _warm_md(res["warm_cold"])
    if "rope" in res:
        L += _rope_md(res["rope"])
    return L, notes


def _weights_md(m: dict) -> list[str]:
    if "weight_files" not in m:  # a results.json from before weight files were recorded
        return []
    return ["- pretrained weight files read: " + ("; ".join(
        f"`{w['path']}` ({w['bytes']:,} bytes, sha256 {w['sha256']})"
        for w in m["weight_files"]) or "none")]


def _sweep_md(sw: dict) -> list[str]:
    s = sw["spec"]
    L = ["## Table 1: quality vs the BF16 cache, and memory", "",
         f"Inputs {s['inputs']} x sampling seeds {s['seeds']}, {s['chunks']} generated chunks; every video against "
         f"the BF16-cache video of the same input and seed. **onset** = the first {s.get('onset_chunks', 1)} "
         "generated chunk(s) (before auto-regressive drift compounds the cache's error), **video** = all generated "
         "frames. Mean ± std over inputs x seeds (k-means seed "
         f"{s['kmeans_seeds'][0]}). compression = BF16-equivalent bytes / bytes held by the cache at its largest. "
         "*floor* rows: the BF16 video at the next sampling seed, and the same k-means method at another k-means "
         f"seed ({s['kmeans_seeds'][1:]}) — differences smaller than these are noise.", "",
         sweep.table_markdown(sw), "", "![quality along the sweep videos](sweep_quality.png)", "",
         "### Cache bytes by component (first run of each, at the cache's largest)", ""]
    rows = []
    for r in sweep.memory_rows(sw):
        rows.append([r["method"], "BF16" if r["bits"] == 16 else f"INT{r['bits']}"]
                    + [f"{r[c]:,}" for c in (*MEMORY_COMPONENTS, "total", "bf16_equivalent")]
                    + [f"{r['bf16_equivalent'] / r['total']:.2f}x"])
    L += _table(["method", "bits", "codes", "scales", "ids", "centroids", "positions", "bf16 (current chunk + room)",
                 "workspace", "total", "BF16 equivalent", "ratio"], rows)
    L += ["", "The components add up to `total`; `workspace` is the compression's CUDA graphs (their static tensors "
          "and private memory pools: rtn, qvg, qvg-pro on CUDA; 0 on the CPU)."]
    L += ["", "![memory by component](memory_breakdown.png)", ""]
    if sw.get("vbench_unavailable"):
        L += ["VBench dimensions not computed: " + "; ".join(f"{k}: {v}" for k, v in
                                                            sw["vbench_unavailable"].items()), ""]
    return L


def _long_md(lv: dict) -> list[str]:
    L = [f"## Fig. 5a: quality along a long video ({lv['frames']} frames, every {lv['every']} frames)", "",
         f"Start image {lv['image']!r}, sampling seed {lv['seed']}; each cache vs the BF16 video of the same seed; "
         "the floor is the BF16 video at the next seed. PSNR dB per window of frames:", ""]
    head = ["cache", "ratio"] + [f"{a}-{a + lv['every'] - 1}" for a in lv["window_starts"]] + ["first < 30 dB"]
    rows = [[k, _f(lv["compression_ratio"].get(k), 3) + ("x" if k in lv["compression_ratio"] else "")]
            + [_f(v, 3) for v in c["psnr"]] + ["none" if c["first_below"] is None else str(c["first_below"])]
            for k, c in lv["curves"].items()]
    return L + _table(head, rows) + ["", "![long video](long_video.png)", ""]


def _kv_md(kv: dict, capture: dict) -> list[str]:
    L = ["## Analyses on K/V captured from the real run", "",
         f"K/V of the BF16 long-video run (start image {capture.get('image')!r}, seed {capture.get('seed')}, "
         f"{capture.get('chunks')} chunks incl. the start image's); keys after RoPE, as the attention sees them (the "
         "cache packs rtn / qvg / qvg-pro keys before RoPE on this model by default: the pre- vs post-RoPE section "
         "below measures that choice). "
         f"Chunks {kv['chunks']}, layers {kv['layers']}, K = {kv['centroids']}, k-means seeds {kv['kmeans_seeds']} "
         f"(± = std over chunks x seeds), grid `{kv['grid']}`. rel = MSE / mean(x^2).", "",
         "### Fig. 6: MSE reduction vs RTN (MSE(rtn) / MSE(qvg), same block size)", ""]
    rows = []
    for t, red in kv["reduction"].items():
        for name, e in red.items():
            rows.append([t, name, f"{e['mean_over_layers']:.3g}x"]
                        + [_f(e["per_layer"][str(layer)], 3) for layer in kv["layers"]])
    L += _table(["tensor", "pair", "mean over layers"] + [f"layer {x}" for x in kv["layers"]], rows)
    L += ["", "### MSE per method (mean over layers)", ""]
    rows = []
    for t, ms in kv["methods"].items():
        for lab, e in ms.items():
            rows.append([t, lab, _f(e["rel"]), f"{e['bpe']['mean']:.3f}"])
    L += _table(["tensor", "method", "rel MSE", "bits / element (measured)"], rows)
    L += ["", "### Fig. 5c: MSE vs PRQ stages (INT2; S = 0 is RTN)", ""]
    rows = [[t, b] + [_f(v) for v in vals] for t, st in kv["stages"].items() for b, vals in st.items()]
    L += _table(["tensor", "block"] + [f"S={s}" for s in range(5)], rows)
    L += ["", "### Fig. 7 (KV side): block size vs bits and MSE", ""]
    rows = [[t, name] + [f"B={e['B']}: {e['bpe']:.3f} b, {_f(e['rel'])}" for e in es]
            for t, bs in kv["block_size"].items() for name, es in bs.items()]
    L += _table(["tensor", "method"] + [f"B, bits/elem, rel MSE ({i + 1})" for i in range(len(kv["block_sizes"]))],
                rows)
    return L + ["", "![KV analyses](kv_analyses.png)", ""]


def _block_md(bl: dict) -> list[str]:
    L = [f"### Fig. 7 (end to end): {bl['method']} INT{bl['bits']} by block size", "",
         f"Start image {bl['image']!r}, seed {bl['seed']}, {bl['chunks']} chunks; vs the BF16 video.", ""]
    rows = [[r["block_size"], f"{r['compression_ratio']:.2f}x"]
            + [f"{r['memory'].get(c, 0):,}" for c in (*MEMORY_COMPONENTS, "total")]
            + [_f(r["onset_psnr"], 4), _f(r["video_psnr"], 4)] for r in bl["rows"]]
    return L + _table(["B", "ratio", *MEMORY_COMPONENTS, "total", "onset PSNR", "video PSNR"], rows) + [""]


def _warm_md(w: dict) -> list[str]:
    s = w["summary"]
    L = ["## Warm vs cold k-means (streaming centroid cache)", "",
         f"Consecutive captured chunks {w['chunks']}, layers {w['layers']}, K = {w['centroids']}, seed {w['seed']}: "
         "warm = the previous chunk's stored centroids + 2 Lloyd iterations (production), cold = k-means++ + 8.", "",
         f"- qvg INT2 MSE warm@2 / cold@8: {_f(s['qvg_int2_mse_warm2_over_cold8'])} (mean ± std over "
         f"{s['qvg_int2_mse_warm2_over_cold8']['n']} (tensor, layer, chunk))",
         f"- k-means objective warm@2 / cold@8: {_f(s['objective_warm2_over_cold8'])}",
         f"- cold iterations to reach warm@2 (None: not within {w['iters']}): {s['cold_iters_to_reach_warm2']}", ""]
    return L


def _rope_md(r: dict) -> list[str]:
    L = ["## Pre- vs post-RoPE key storage", "",
         f"Captured pre-RoPE keys of chunks {r['chunks']} (stream order, warm start), layers {r['layers']}, K = "
         f"{r['centroids']}; MSE in post-RoPE space (the attention's), mean over layers x chunks; post / pre = "
         "MSE(stored after RoPE) / MSE(stored before RoPE, rotated on read): > 1 favours storing keys before RoPE.",
         ""]
    rows = [[k, _f(v["mse_pre"]), _f(v["mse_post"]), f"{v['post_over_pre']:.3g}x"] for k, v in r["summary"].items()]
    return L + _table(["method", "MSE stored pre-RoPE", "MSE stored post-RoPE", "post / pre"], rows) + [""]


# --- plots --------------------------------------------------------------------------------------------------------

def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    with atomic(path) as tmp:  # (the whole PNG or none)
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return f"wrote {path}"


def _plot_sweep(writes: list, sw: dict, path: Path) -> str:
    plt = _plt()
    if plt is None:
        return "matplotlib not importable: no plots"
    bits = sw["spec"]["bits"]
    lead = sw.get("layout", {}).get("lead", 0)  # (the given start frame(s): equal by construction, not plotted)
    fig, axes = plt.subplots(1, len(bits), figsize=(7 * len(bits), 3.8), squeeze=False)
    k0 = sw["spec"]["kmeans_seeds"][0]
    for ax, b in zip(axes[0], bits):
        for m in sw["spec"]["methods"]:
            rs = [r for r in sw["runs"] if r["method"] == m and r["bits"] == b and r["kmeans_seed"] in (None, k0)]
            if rs:
                xs, mean, std = _frame_stats([r["vs_ref"]["frame_psnr"] for r in rs], lead)
                line, = ax.plot(xs, mean, marker=".", label=m)
                ax.fill_between(xs, [a - d for a, d in zip(mean, std)], [a + d for a, d in zip(mean, std)],
                                color=line.get_color(), alpha=0.12, lw=0)
        if sw["sampling_floor"]:
            xs, mean, _ = _frame_stats([r["frame_psnr"] for r in sw["sampling_floor"]], lead)
            ax.plot(xs, mean, "k--", label="floor: BF16, next seed")
        ax.set(title=f"INT{b}: PSNR vs the BF16 video (mean ± std over inputs x seeds)", xlabel="frame",
               ylabel="PSNR dB (capped at 60)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    writes.append((plt, fig, path))
    return ""


def _frame_stats(curves: list[list[float]], lead: int) -> tuple[list[int], list[float], list[float]]:
    """(frames from `lead` on, mean, sample std over the curves, as the tables' "mean ± std") of per-frame PSNR,
    each value capped at 60 dB."""
    import statistics
    xs = list(range(lead, len(curves[0])))
    cols = [[min(c[f], 60) for c in curves] for f in xs]
    return xs, [statistics.fmean(v) for v in cols], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in cols]


def _plot_memory(writes: list, sw: dict, path: Path) -> str:
    plt = _plt()
    if plt is None:
        return ""
    rows = sweep.memory_rows(sw)
    comps = MEMORY_COMPONENTS
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = [f"{r['method']} {'BF16' if r['bits'] == 16 else 'INT%d' % r['bits']}" for r in rows]
    bottom = [0.0] * len(rows)
    for c in comps:
        vals = [r[c] / 2**20 for r in rows]
        ax.bar(names, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="MiB held", title="KV cache bytes by component (at its largest)")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # (beside the bars: it hid the tallest)
    writes.append((plt, fig, path))
    return ""


def _plot_long(writes: list, lv: dict, path: Path) -> str:
    plt = _plt()
    if plt is None:
        return ""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for k, c in lv["curves"].items():
        ax.plot(lv["window_starts"], [min(v, 60) for v in c["psnr"]], "k--" if "floor" in k else "-", marker=".",
                label=k)
    ax.set(xlabel="first frame of the window", ylabel="PSNR dB vs BF16 (capped at 60)",
           title=f"Fig. 5a: quality every {lv['every']} frames")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # (beside the curves: it hid their ends)
    writes.append((plt, fig, path))
    return ""


def _plot_kv(writes: list, kv: dict, path: Path) -> str:
    plt = _plt()
    if plt is None:
        return ""
    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    w = 0.8 / max(1, sum(len(r) for r in kv["reduction"].values()))
    i = 0
    for t, red in kv["reduction"].items():
        for name, e in red.items():
            xs = [x + i * w for x in range(len(kv["layers"]))]
            ax[0].bar(xs, [e["per_layer"][str(layer)]["mean"] for layer in kv["layers"]], width=w,
                      label=f"{t} {name}")
            i += 1
    ax[0].set_xticks(range(len(kv["layers"])), [f"layer {x}" for x in kv["layers"]])
    ax[0].axhline(1, color="k", lw=0.5)
    ax[0].set(ylabel="MSE(rtn) / MSE(qvg)", title="Fig. 6: MSE reduction vs RTN")
    ax[0].legend(fontsize=6)
    for t, st in kv["stages"].items():
        for b, vals in st.items():
            ax[1].plot(range(5), vals, marker="o", label=f"{t} {b}")
    ax[1].set(yscale="log", xlabel="PRQ stages S", ylabel="rel MSE (INT2)", title="Fig. 5c: MSE vs stages")
    ax[1].legend(fontsize=7)
    labelled = set()  # (each block size once, beside its first point: every series' labels overlapped)
    for t, bs in kv["block_size"].items():
        for name, es in bs.items():
            ax[2].plot([e["bpe"] for e in es], [e["rel"] for e in es], marker="o", label=f"{t} {name}")
            for e in es:
                if e["B"] not in labelled:
                    labelled.add(e["B"])
                    ax[2].annotate(f"B={e['B']}", (e["bpe"], e["rel"]), xytext=(4, 4), textcoords="offset points",
                                   fontsize=7)
    ax[2].set(yscale="log", xlabel="bits / element (measured)", ylabel="rel MSE",
              title="Fig. 7: block size trade-off")
    ax[2].legend(fontsize=6)
    writes.append((plt, fig, path))
    return ""


if __name__ == "__main__":  # (python -m qvg.eval.report runs `qvg-eval report`, with its checks)
    import sys

    from .cli import main
    raise SystemExit(main(["report", *sys.argv[1:]]))
