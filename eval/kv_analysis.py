"""KV-cache compression analysis on synthetic video-like KV: MSE per method, QVG's MSE reduction vs RTN, MSE vs PRQ
stages, and the streaming k-means warm start.

    python -m qvg.eval.kv_analysis [--out DIR] [--quick] [--seed S] [--no-progress]

writes <out>/kv_analysis.json, <out>/kv_analysis.md (and <out>/kv_analysis.png when matplotlib is importable) and
prints the tables. CPU, about a minute at full size on 2 cores; `--quick` is a seconds-long smoke test. Run as a
script it sets OMP_WAIT_POLICY=PASSIVE (re-executing itself once) unless the environment sets it: torch's default
spinning OpenMP waits make it several times slower on a CPU shared with other processes.

Sections
  a. MSE and relative MSE (MSE / mean(x^2)) per method at INT2 / INT4, keys and values, with bits per element
     measured (8 * Packed.nbytes / numel) beside the analytic `qvg.bits_per_element`. rtn and qvg are also run with
     grid="sym" (the paper's 3-level INT2) and the other grids beside the default one, to show what the grid
     choice buys.
  b. QVG's MSE reduction vs RTN at the same block size: qvg / rtn at B=64, qvg-pro / rtn at B=16.
  c. MSE vs PRQ stages S = 0..4 (S = 0 is RTN) at B=16 and B=64, INT2.
  d. Streaming warm start: on consecutive chunks, k-means objective per Lloyd iteration cold (k-means++) vs warm
     (the previous chunk's stored centroids, chained as production does), how many cold iterations reach what
     warm reaches after 2 and 6, empty clusters, and qvg's INT2 MSE from either; at the default scene motion and
     at a 4x slower one.

The data are `qvg.eval.synthetic_kv` (a stand-in until KV captured from the real model exists): absolute numbers
describe that generator, not a video model. qvg (S=1) is run at three k-means seeds (mean +- std: the seed noise
floor of every comparison); rtn and kivi have no randomness; quarot's rotation takes the same seeds.

How sections a-c are computed: k-means dominates the cost, and stage s of an S-stage PRQ run is the same
computation for every S >= s (same seed, iterations and input). So one `qvg.compress(x, "qvg-pro")` per tensor
runs the 4-stage chain, and the S-stage `Packed` for any S <= 4, block size, bit width and grid is assembled from
that chain's stored ids and centroids plus the group quantizer on the stage-S residual, exactly as
`qvg.compression.prq.compress` builds it, then decoded with `qvg.decompress`; likewise for the 1-stage qvg runs. The
run checks the assembled Packed against direct `qvg.compress` calls (bitwise-equal tensors) and reports it.
Section d calls `qvg.kmeans.kmeans` directly (float32, all heads as groups) and continues a run by passing its
centroids as `init`, which reproduces an uninterrupted run exactly.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

import qvg
from qvg.help_format import OneLineParser
from qvg.kmeans import kmeans
from qvg.compression import resolve_options
from qvg.compression.prq import COLD_ITERS, WARM_ITERS, _gather, residual_tscale
from qvg.compression.registry import token_spec
from qvg.numbers import integer
from qvg.outputs import atomic, folder_error
from qvg.packed import Packed
from qvg.quant import quantize_packed
from qvg.revision import git_commit

from .synthetic_kv import DESCRIPTION, synthetic_chunks, synthetic_kv

__all__ = ["run", "config", "to_markdown", "save", "main"]

TENSORS = ("K", "V")
BITS = (2, 4)
STAGES = (0, 1, 2, 3, 4)


def default_grid() -> str:
    """The grid the token-group methods use when none is given (the core's preset)."""
    return qvg.methods(details=True)["rtn"]["defaults"]["grid"]


def grids() -> list[str]:
    """The grids compared: the default first, then "midrise" and "sym" (whichever are not the default)."""
    d = default_grid()
    return [d] + [g for g in ("midrise", "sym") if g != d]


def stage_grids() -> list[str]:
    """The grids of section c's stage curves: the default and the paper's (or midrise if sym is the default)."""
    d = default_grid()
    return [d, "sym" if d != "sym" else "midrise"]


def _suffix(grid: str) -> str:
    return "" if grid == default_grid() else f" {grid}"


def config(quick: bool = False, seed: int = 0) -> dict:
    """Sizes and seeds of a run. chain_seeds: k-means seeds of full 4-stage chains (qvg-pro, stage curves);
    stage1_seeds: the seeds of the qvg (S=1) rows, for their seed-variance floor (a seed that also has a chain
    re-uses the chain's stage 1 unless verify_stage1, which runs it directly and checks the two agree)."""
    if quick:
        data = dict(frames=2, height=12, width=16, heads=2, head_dim=128)
        return dict(data=data, centroids=64, chain_seeds=[seed], stage1_seeds=[seed, seed + 1],
                    data_seed=seed, chunks=3, kmeans_iters=12, slow_motion=0.25, slow_chunks=3, verify_stage1=True)
    data = dict(frames=3, height=30, width=52, heads=12, head_dim=128)
    return dict(data=data, centroids=256, chain_seeds=[seed], stage1_seeds=[seed, seed + 1, seed + 2],
                data_seed=seed, chunks=4, kmeans_iters=20, slow_motion=0.25, slow_chunks=2, verify_stage1=False)


# --- helpers ----------------------------------------------------------------------------------------------------

def _mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x.float() - y.float()) ** 2).mean())


def _stats(vals: list[float]) -> tuple[float, float]:
    m = sum(vals) / len(vals)
    s = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return m, s


def _eval(x: torch.Tensor, p: Packed) -> dict:
    y = qvg.decompress(p)
    mse = _mse(x, y)
    return {"mse": mse, "bpe_measured": 8.0 * p.nbytes / x.numel(),
            "bpe_analytic": qvg.bits_per_element(p.method, x.shape, **_api_options(p))}


def _api_options(p: Packed) -> dict:
    """The options of a Packed's meta that `qvg.bits_per_element` takes (all of them)."""
    return {k: v for k, v in p.meta.items()}


class _Chain:
    """The k-means chain of one `qvg.compress` call (4 stages: "qvg-pro" at INT2; 1 stage: "qvg" at INT2), re-used
    for every S <= stages, block size, bit width and grid (see the module docstring)."""

    def __init__(self, x: torch.Tensor, seed: int, centroids: int, stages: int = 4):
        self.x, self.seed, self.k, self.stages = x, seed, centroids, stages
        method = "qvg-pro" if stages == 4 else "qvg"
        self.direct = qvg.compress(x, method, bits=2, seed=seed, centroids=centroids, stages=stages)
        b, h, n, d = x.shape
        ids = self.direct.tensors["ids"].reshape(stages, b * h, n)
        cents = self.direct.tensors["centroids"].reshape(stages, b * h, centroids, d)
        r = x.float().reshape(b * h, n, d)
        self.residuals = [r]
        for s in range(stages):  # the same subtraction, in the same order, as prq.compress
            r = r - _gather(cents[s], ids[s])
            self.residuals.append(r)

    def packed(self, stages: int, bits: int, block_size: int, grid: str) -> Packed:
        name = "qvg-pro" if (stages, block_size) == (4, 16) else "qvg"
        b, h, n, d = self.x.shape
        o = resolve_options(name, tuple(self.x.shape), bits=bits, block_size=block_size, stages=stages,
                            centroids=self.k, seed=self.seed, grid=grid)
        spec = token_spec(o)
        tscale = None
        if stages:  # the tscale of the bound qvg.compress stores (its last stage's input and centroids)
            cents = self.direct.tensors["centroids"].reshape(self.stages, b * h, self.k, d)
            tscale = residual_tscale(self.residuals[stages - 1].to(torch.bfloat16), cents[stages - 1], spec, (b, h))
        tensors = quantize_packed(self.residuals[stages].view(b, h, n, d), spec, tscale)
        if stages:
            tensors["ids"] = self.direct.tensors["ids"][:stages].contiguous()
            tensors["centroids"] = self.direct.tensors["centroids"][:stages].contiguous()
        return Packed(name, tuple(self.x.shape), self.x.dtype, tensors, o)


def _same(p: Packed, q: Packed) -> bool:
    return p.tensors.keys() == q.tensors.keys() and all(torch.equal(p.tensors[k], q.tensors[k]) for k in p.tensors)


# --- the run ----------------------------------------------------------------------------------------------------

def _rows() -> list[tuple[str, str, dict]]:
    """(label, method, options) of section a's rows: unsuffixed rows use the default grid, "<label> <grid>" rows
    the other grids. k-means methods are computed from the chains."""
    base = [("rtn", "rtn", {}), ("rtn B=16", "rtn", {"block_size": 16}), ("kivi", "kivi", {}),
            ("quarot", "quarot", {}), ("qvg", "qvg", {}), ("qvg-pro", "qvg-pro", {})]
    out = [(label, m, {**o, "grid": default_grid()} if m != "kivi" else o) for label, m, o in base]
    for g in grids()[1:]:
        out += [(label + _suffix(g), m, {**o, "grid": g}) for label, m, o in base if m in ("rtn", "qvg", "qvg-pro")]
    return out


def run(quick: bool = False, seed: int = 0, progress: bool = True, command: str | None = None) -> dict:
    """Run every section; returns the JSON-able result dict: meta, summary, mse (a), reduction and frontier (b),
    stages (c), warm_start (d). `to_markdown` renders it, `save` writes it."""
    t_start = time.perf_counter()
    load0 = _loadavg()
    cfg = config(quick, seed)
    data, k_cent = cfg["data"], cfg["centroids"]
    chain_seeds, s1_seeds = cfg["chain_seeds"], cfg["stage1_seeds"]
    n_steps = len(TENSORS) * (1 + len(chain_seeds) + len(s1_seeds) + cfg["chunks"] - 1 + cfg["slow_chunks"])
    bar = _bar(n_steps, progress)
    chunk0 = synthetic_kv(t0=0, seed=cfg["data_seed"], **data)
    shape = tuple(chunk0[0].shape)

    mse: dict = {}
    stages: dict = {}
    checks: dict = {}
    raw: dict = {}  # per-seed MSEs, for the ratios
    init0: dict = {}  # chunk 0's stored (BF16) stage-1 centroids per tensor, [B, H, K, D]
    for ti, name in enumerate(TENSORS):
        x = chunk0[ti]
        ms = float((x.float() ** 2).mean())
        per: dict = {}  # label -> "intB" -> (method, options, [eval dict per seed])
        bar.set_description(f"{name}: rtn, kivi, quarot")
        for label, method, opts in _rows():
            if method in ("qvg", "qvg-pro"):
                continue
            opts = dict(opts)
            if method == "kivi":
                opts["role"] = "key" if name == "K" else "value"
            for bits in BITS:
                runs = []
                for s in (s1_seeds if method == "quarot" else [None]):
                    extra = {} if s is None else {"seed": s}
                    runs.append(_eval(x, qvg.compress(x, method, bits=bits, **opts, **extra)))
                per.setdefault(label, {})[f"int{bits}"] = (method, opts, runs)
        bar.update(1)
        st_runs: dict = {}  # (B, grid) -> [[MSE per S] per chain seed]
        checks[name] = {}
        chains = {}
        for s in chain_seeds:  # full 4-stage chains: qvg-pro rows and the stage curves
            bar.set_description(f"{name}: qvg-pro (4-stage k-means), seed {s}")
            ch = chains[s] = _Chain(x, s, k_cent, 4)
            checks[name][f"seed {s}: derived S=4, B=16 == qvg.compress(qvg-pro)"] = _same(
                ch.packed(4, 2, 16, default_grid()), ch.direct)
            for label, method, opts in _rows():
                if method == "qvg-pro":
                    for bits in BITS:
                        entry = per.setdefault(label, {}).setdefault(f"int{bits}", (method, dict(opts), []))
                        entry[2].append(_eval(x, ch.packed(4, bits, 16, opts["grid"])))
            for bs in (16, 64):
                for grid in stage_grids():
                    st_runs.setdefault((bs, grid), []).append(
                        [_mse(x, qvg.decompress(ch.packed(S, 2, bs, grid))) for S in STAGES])
            bar.update(1)
            if s == chain_seeds[0]:
                init0[name] = ch.direct.tensors["centroids"][0]  # chunk 0's stored centroids: section d's chain
        for s in s1_seeds:  # qvg (S=1) rows: a direct qvg.compress per seed, or the chain's stage 1
            bar.set_description(f"{name}: qvg (1-stage k-means), seed {s}")
            if s in chains and not cfg["verify_stage1"]:
                ch = chains[s]  # stage 1 of a 4-stage chain is the same computation as a 1-stage run
            else:
                ch = _Chain(x, s, k_cent, 1)
                checks[name][f"seed {s}: derived S=1, B=64 == qvg.compress(qvg)"] = _same(
                    ch.packed(1, 2, 64, default_grid()), ch.direct)
                if s in chains:
                    checks[name][f"seed {s}: stage 1 of the 4-stage chain == qvg.compress(qvg)"] = _same(
                        chains[s].packed(1, 2, 64, default_grid()), ch.direct)
            for label, method, opts in _rows():
                if method == "qvg":
                    for bits in BITS:
                        entry = per.setdefault(label, {}).setdefault(f"int{bits}", (method, dict(opts), []))
                        entry[2].append(_eval(x, ch.packed(1, bits, 64, opts["grid"])))
            bar.update(1)
        mse[name], raw[name] = _summarize_a(per, ms)
        stages[name] = _summarize_c(st_runs, ms)

    reduction = _reductions(raw)
    warm: dict = {"main": {}, "slow": {}}
    chunks = list(synthetic_chunks(cfg["chunks"], t0=0, seed=cfg["data_seed"], **data))
    slow = list(synthetic_chunks(cfg["slow_chunks"], t0=0, seed=cfg["data_seed"], motion=cfg["slow_motion"], **data))
    for ti, name in enumerate(TENSORS):
        warm["main"][name] = _warm_start([c[ti] for c in chunks], k_cent, chain_seeds[0], cfg["kmeans_iters"], bar,
                                         name, init0=init0[name], checks=checks[name])
        warm["slow"][name] = _warm_start([c[ti] for c in slow], k_cent, chain_seeds[0], None, bar,
                                         f"{name} motion={cfg['slow_motion']}")
    warm["main"]["motion"], warm["slow"]["motion"] = 1.0, cfg["slow_motion"]
    bar.close()

    commit, dirty = git_commit()
    n_tok = data["frames"] * data["height"] * data["width"]
    meta = {
        "command": command or f"qvg.eval.kv_analysis.run(quick={quick}, seed={seed})",
        "git_commit": commit, "git_dirty": dirty,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{torch.get_num_threads()} torch threads)",
        "data": {"description": DESCRIPTION, **data, "tokens_per_chunk": n_tok, "shape": list(shape),
                 "dtype": "float32", "data_seed": cfg["data_seed"],
                 "chunk_for_a_b_c": f"chunk 0 (frames 0..{data['frames'] - 1})",
                 "chunks_for_d": cfg["chunks"], "slow_motion": cfg["slow_motion"], "slow_chunks": cfg["slow_chunks"],
                 "max_abs": {n: float(chunk0[i].abs().max()) for i, n in enumerate(TENSORS)},
                 "rms": {n: math.sqrt(mse[n]["_mean_square"]) for n in TENSORS}},
        "kmeans": {"centroids": k_cent, "chain_seeds": chain_seeds, "stage1_seeds": s1_seeds,
                   "cold_iters": COLD_ITERS, "warm_iters": WARM_ITERS, "seeding": "k-means++",
                   "warm_start_trace_iters": cfg["kmeans_iters"]},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "loadavg_start": load0,
        "default_grid": default_grid(), "grids": grids(),
        "quick": quick, "seed": seed, "checks": checks,
    }
    res = {"meta": meta, "mse": mse, "reduction": reduction, "stages": stages, "warm_start": warm,
           "frontier": _frontier(mse)}
    res["summary"] = _summary(res)
    meta["loadavg_end"] = _loadavg()
    meta["wall_s"] = round(time.perf_counter() - t_start, 2)
    return res


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _summarize_a(per: dict, ms: float) -> tuple[dict, dict]:
    out: dict = {"_mean_square": ms}
    raw: dict = {}
    for label in [r[0] for r in _rows() if r[0] in per]:  # the table's order
        by_bits = per[label]
        out[label], raw[label] = {}, {}
        for bkey, (method, opts, runs) in by_bits.items():
            vals = [r["mse"] for r in runs]
            m, sd = _stats(vals)
            raw[label][bkey] = vals
            out[label][bkey] = {
                "method": method, "options": {"bits": int(bkey[3:]), **opts}, "mse": m, "mse_std": sd,
                "rel_mse": m / ms, "rel_mse_std": sd / ms, "n_seeds": len(vals),
                "bpe_measured": runs[0]["bpe_measured"], "bpe_analytic": runs[0]["bpe_analytic"]}
    return out, raw


def _summarize_c(st_runs: dict, ms: float) -> dict:
    out = {}
    for (bs, grid), runs in st_runs.items():
        ms_s = [_stats(list(c)) for c in zip(*runs)]  # per S, over seeds
        ratios = [_stats([r[i - 1] / r[i] for r in runs]) for i in range(1, len(STAGES))]
        means = [m for m, _ in ms_s]
        out[f"B{bs} {grid}"] = {
            "block_size": bs, "grid": grid, "bits": 2, "stages": list(STAGES), "n_seeds": len(runs),
            "mse": means, "mse_std": [s for _, s in ms_s], "rel_mse": [m / ms for m in means],
            "stage_ratio": [m for m, _ in ratios], "stage_ratio_std": [s for _, s in ratios],
            "monotone": all(means[i] < means[i - 1] for i in range(1, len(means)))}
    return out


def _reductions(raw: dict) -> dict:
    """MSE(rtn) / MSE(qvg) at the same block size, mean +- std over k-means seeds."""
    pairs = {g: (("qvg / rtn @ B=64", "qvg" + _suffix(g), "rtn" + _suffix(g)),
                 ("qvg-pro / rtn @ B=16", "qvg-pro" + _suffix(g), "rtn B=16" + _suffix(g))) for g in grids()}
    out: dict = {}
    for name, by_label in raw.items():
        for grid, prs in pairs.items():
            for key, q, r in prs:
                for bits in BITS:
                    b = f"int{bits}"
                    base = by_label[r][b][0]
                    m, s = _stats([base / v for v in by_label[q][b]])
                    out.setdefault(name, {}).setdefault(grid, {}).setdefault(key, {})[b] = {
                        "ratio": m, "std": s, "n_seeds": len(by_label[q][b])}
    return out


def _frontier(mse: dict) -> dict:
    """Rate-distortion view of section a: per tensor, every (method row, bits) sorted by measured bits/element,
    flagged Pareto-optimal when no row with at most its bits has a lower MSE."""
    out = {}
    for t, by_label in mse.items():
        pts = [{"label": label, "bits": int(b[3:]), "bpe": e["bpe_measured"], "rel_mse": e["rel_mse"]}
               for label, by_bits in by_label.items() if not label.startswith("_") for b, e in by_bits.items()]
        pts.sort(key=lambda p: (p["bpe"], p["rel_mse"]))
        best = math.inf
        for p in pts:
            p["pareto"] = p["rel_mse"] < best
            best = min(best, p["rel_mse"])
        out[t] = pts
    return out


def _summary(res: dict) -> dict:
    """The headline checks: does QVG beat RTN, do stages help monotonically, does the warm start pay off."""
    mse, red = res["mse"], res["reduction"]
    qvg_beats_rtn = all(v["ratio"] > 1 for t in red for g in red[t].values() for p in g.values() for v in p.values())
    monotone = all(e["monotone"] for t in res["stages"] for e in res["stages"][t].values())
    later = [r for t in res["stages"] for e in res["stages"][t].values() for r in e["stage_ratio"][1:]]
    warm = [c for t in TENSORS for c in res["warm_start"]["main"][t]["chunks"]]
    return {
        "qvg_beats_rtn_everywhere": qvg_beats_rtn,
        "stages_monotone_everywhere": monotone,
        "min_later_stage_ratio": min(later),
        "cold_iters_to_reach_warm2": [c["cold_iters_to_warm2"] for c in warm],
        "cold_iters_to_reach_warm6": [c["cold_iters_to_warm6"] for c in warm],
        "warm2_over_cold8_stored_objective": [c["stored_objective"]["warm2"] / c["stored_objective"]["cold8"]
                                              for c in warm],
        "warm2_over_cold8_qvg_int2_mse": [c["qvg_int2_mse"]["warm2"] / c["qvg_int2_mse"]["cold8"] for c in warm],
        "empty_clusters_per_head_warm2": [c["empty_clusters_per_head"]["warm2"] for c in warm],
        "int2_mse_over_sym_grid": {t: {lab: {g: mse[t][lab + _suffix(g)]["int2"]["mse"]
                                               / mse[t][lab + _suffix("sym")]["int2"]["mse"]
                                               for g in grids() if g != "sym"}
                                         for lab in ("rtn", "rtn B=16", "qvg", "qvg-pro")} for t in TENSORS},
    }


def _first_at_or_below(trace: list[float], target: float) -> int | None:
    for i, v in enumerate(trace):
        if v <= target:
            return i
    return None


def _empty(ids: torch.Tensor, k: int) -> float:
    """Mean number of empty clusters per (batch, head) of a [G, N] assignment."""
    g = ids.shape[0]
    counts = torch.zeros(g, k).scatter_add_(1, ids.long(), torch.ones(ids.shape))
    return float((counts == 0).sum()) / g


def _continue(x: torch.Tensor, first, k: int, more: int):
    """Continue a tracked k-means run `first` for `more` iterations: (result, trace of the whole run), identical
    to one uninterrupted run. trace[i] (i < total iterations) is the mean squared distance of the tokens to their
    nearest centroid after i iterations (0: the seeds / init); the last entry is that of the returned pair."""
    if more <= 0:
        return first, first.trace
    nxt = kmeans(x, k, iters=more, init=first.centroids, track=True)
    return nxt, torch.cat([first.trace[:-1], nxt.trace])


def _qvg_packed(x: torch.Tensor, res, k: int) -> Packed:
    """The qvg (S=1, B=64, INT2) Packed production stores from a finished k-means run `res` on x [B, H, N, D]:
    BF16 centroids, ids, and the group-quantized residual, built as `qvg.compression.prq.compress` builds it."""
    b, h, n, d = x.shape
    o = resolve_options("qvg", tuple(x.shape), bits=2, centroids=k)
    c16 = res.centroids.to(torch.bfloat16)
    xf = x.float().reshape(b * h, n, d)
    r = xf - _gather(c16, res.ids)
    spec = token_spec(o)
    tscale = residual_tscale(xf.to(torch.bfloat16), c16, spec, (b, h))
    tensors = quantize_packed(r.view(b, h, n, d), spec, tscale)
    tensors["ids"] = res.ids.reshape(1, b, h, n)
    tensors["centroids"] = c16.reshape(1, b, h, k, d)
    return Packed("qvg", tuple(x.shape), x.dtype, tensors, o)


def _warm_start(xs: list[torch.Tensor], k: int, seed: int, iters: int | None, bar, name: str,
                init0: torch.Tensor | None = None, checks: dict | None = None) -> dict:
    """Streaming chain as production runs it: chunk 0 cold (COLD_ITERS; or `init0`, chunk 0's stored centroids
    [B, H, K, D] when already computed); chunk t >= 1 warm from the previous chunk's stored (BF16) centroids,
    WARM_ITERS iterations; beside it a cold k-means++ start on the same tokens. Both are traced for `iters`
    iterations (None: just the production counts, COLD_ITERS cold and WARM_ITERS warm)."""
    b, h, n, d = xs[0].shape
    g = lambda x: x.to(torch.bfloat16).float().reshape(b * h, n, d)  # noqa: E731  (k-means reads BF16, as compress)
    stored = lambda c: c.to(torch.bfloat16).float().reshape(b * h, k, d)  # noqa: E731  (what a Packed holds)
    if init0 is None:
        bar.set_description(f"{name}: warm start, chunk 0 (cold)")
        prev = stored(kmeans(g(xs[0]), k, iters=COLD_ITERS, seed=seed).centroids)
        bar.update(1)
    else:
        prev = stored(init0)
    per_chunk = []
    for t in range(1, len(xs)):
        bar.set_description(f"{name}: warm start, chunk {t}")
        x, xt = g(xs[t]), xs[t]
        c8 = kmeans(x, k, iters=COLD_ITERS, seed=seed, track=True)  # what production stores for a cold chunk
        w2 = kmeans(x, k, iters=WARM_ITERS, init=prev, track=True)  # ... for a warm one
        _, cold = _continue(x, c8, k, (iters or 0) - COLD_ITERS)
        _, warm = _continue(x, w2, k, (iters or 0) - WARM_ITERS)
        if iters is None:  # short traces: only the iterations both runs share with production
            cold, warm = c8.trace[:-1], w2.trace[:-1]
        cold, warm = cold.tolist(), warm.tolist()
        p_cold, p_warm = _qvg_packed(xt, c8, k), _qvg_packed(xt, w2, k)
        if checks is not None and t == 1:  # the warm Packed is what qvg.compress makes from the previous chunk's
            direct = qvg.compress(xt, "qvg", bits=2, centroids=k, init=prev.view(1, b, h, k, d))
            checks[f"{name}: chunk 1 warm Packed == qvg.compress(qvg, init=previous)"] = _same(p_warm, direct)
        rec = {
            "chunk": t, "cold": cold, "warm": warm,
            "stored_objective": {"cold8": float(c8.trace[-1]), "warm2": float(w2.trace[-1])},
            "empty_clusters_per_head": {"cold8": _empty(c8.ids, k), "warm2": _empty(w2.ids, k)},
            "qvg_int2_mse": {"cold8": _mse(xt, qvg.decompress(p_cold)), "warm2": _mse(xt, qvg.decompress(p_warm))},
        }
        if iters is not None:
            rec.update({
                "cold_iters_to_warm2": _first_at_or_below(cold, warm[WARM_ITERS]),
                "cold_iters_to_warm6": _first_at_or_below(cold, warm[6]) if len(warm) > 6 else None,
                "warm2_over_cold8": warm[WARM_ITERS] / cold[COLD_ITERS],
                "warm2_over_cold_final": warm[WARM_ITERS] / cold[-1],
                "warm6_over_cold_final": warm[6] / cold[-1] if len(warm) > 6 else None,
            })
        per_chunk.append(rec)
        prev = stored(w2.centroids)  # the streaming chain: production's stored warm centroids seed the next chunk
        bar.update(1)
    return {"iters": iters, "chunks": per_chunk}


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, s):
        pass

    def close(self):
        pass


def _bar(total: int, progress: bool):
    if not progress:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


# --- report -----------------------------------------------------------------------------------------------------

def _f(v: float | None, sig: int = 3) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.{sig}g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.{max(sig - 1, 1)}e}"


def _pm(m: float, s: float, n: int) -> str:
    return _f(m) if n < 2 else f"{_f(m)} ± {_f(s, 2)}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def to_markdown(res: dict) -> str:
    m = res["meta"]
    d = m["data"]
    km = m["kmeans"]
    L = ["# KV compression analysis (synthetic KV)", ""]
    L += [f"- command: `{m['command']}`",
          f"- git commit: `{m['git_commit']}`" + (" (working tree has uncommitted changes)" if m["git_dirty"] else ""),
          f"- date: {m['date']}; torch {m['torch']}; python {m['python']}; device: {m['device']}",
          f"- data: {d['description']}",
          f"- sizes: {d['frames']} frames x {d['height']} x {d['width']} = {d['tokens_per_chunk']} tokens per chunk, "
          f"{d['heads']} heads, D={d['head_dim']}, shape {d['shape']} float32; data seed {d['data_seed']}; "
          f"max|K| = {_f(d['max_abs']['K'])}, max|V| = {_f(d['max_abs']['V'])}, "
          f"rms K = {_f(d['rms']['K'])}, rms V = {_f(d['rms']['V'])}",
          f"- sections a-c on {d['chunk_for_a_b_c']}; d on {d['chunks_for_d']} consecutive chunks",
          f"- k-means: K={km['centroids']} centroids, {km['seeding']} seeding, {km['cold_iters']} cold / "
          f"{km['warm_iters']} warm iterations; qvg (S=1) at k-means seeds {km['stage1_seeds']} (mean ± std: the "
          f"seed noise floor), the 4-stage chain (qvg-pro, section c) at {km['chain_seeds']}; quarot's rotation "
          f"at seeds {km['stage1_seeds']}; rtn and kivi are deterministic",
          _checks_line(m["checks"]),
          f"- wall time: {m['wall_s']} s (load average at start {m['loadavg_start']}, at end {m['loadavg_end']}; "
          f"OMP_WAIT_POLICY {m['omp_wait_policy']})", ""]
    sm = res["summary"]
    L += ["## Summary", "",
          f"- QVG below RTN at the same block size in every (tensor, bits, grid, pair): "
          f"{'yes' if sm['qvg_beats_rtn_everywhere'] else 'NO'} (section b)",
          f"- MSE decreasing with every added stage: {'yes' if sm['stages_monotone_everywhere'] else 'NO'}; "
          f"smallest gain of stages 2-4: {_f(sm['min_later_stage_ratio'])}x (section c)",
          f"- warm start (default motion): cold iterations to reach warm@2: {sm['cold_iters_to_reach_warm2']}, "
          f"warm@6: {sm['cold_iters_to_reach_warm6']}; stored objective warm@2 / cold@8 "
          f"{', '.join(_f(v) for v in sm['warm2_over_cold8_stored_objective'])}; qvg INT2 MSE warm@2 / cold@8 "
          f"{', '.join(_f(v) for v in sm['warm2_over_cold8_qvg_int2_mse'])}; empty clusters per head after "
          f"warm@2 {', '.join(f'{v:.1f}' for v in sm['empty_clusters_per_head_warm2'])} (K chunks 1.., then V; "
          f"section d)",
          "- INT2 MSE relative to the sym grid: " + "; ".join(
              f"{t} " + ", ".join(f"{lab} {g} {_f(v)}" for lab, by_g in d.items() for g, v in by_g.items())
              for t, d in sm["int2_mse_over_sym_grid"].items()), ""]
    # a
    L += ["## a. MSE per method", "",
          "rel = MSE / mean(x^2). bits/elem: measured = 8 * Packed.nbytes / numel, analytic = "
          "qvg.bits_per_element. kivi: role=key for K, role=value for V (its preset B=32, asym, BF16 scale+zero). "
          f"Unsuffixed rows use the default grid (`{m['default_grid']}`); `sym` = the paper's 3-level INT2 grid "
          f"(an exact zero), `midrise` = all 4 INT2 levels, no zero (a 1.5x finer step).", ""]
    for t in TENSORS:
        rows = []
        for label, by_bits in res["mse"][t].items():
            if label.startswith("_"):
                continue
            cells = [label]
            for b in BITS:
                e = by_bits[f"int{b}"]
                cells += [_pm(e["mse"], e["mse_std"], e["n_seeds"]), _pm(e["rel_mse"], e["rel_mse_std"], e["n_seeds"]),
                          f"{e['bpe_measured']:.3f} / {e['bpe_analytic']:.3f}"]
            rows.append(cells)
        L += [f"### {t} (mean x^2 = {_f(res['mse'][t]['_mean_square'])})", "",
              _table(["method", "INT2 MSE", "INT2 rel", "INT2 bits meas/analytic", "INT4 MSE", "INT4 rel",
                      "INT4 bits meas/analytic"], rows), ""]
    # b
    L += ["## b. MSE reduction vs RTN at the same block size", "",
          "MSE(rtn) / MSE(qvg), mean ± std over k-means seeds. Paper reference (real KV, INT2): ~6.9x keys, "
          "~2.6x values.", ""]
    rows = []
    for t in TENSORS:
        for grid, prs in res["reduction"][t].items():
            for key, by_bits in prs.items():
                rows.append([t, grid, key] + [_pm(by_bits[f"int{b}"]["ratio"], by_bits[f"int{b}"]["std"],
                                                  by_bits[f"int{b}"]["n_seeds"]) + "x" for b in BITS])
    L += [_table(["tensor", "grid", "pair", "INT2", "INT4"], rows), ""]
    L += ["### bits vs MSE", "",
          "Every row of section a sorted by measured bits/element; * = Pareto-optimal (no row with at most as "
          f"many bits has a lower MSE). The centroids cost 16*S*K/N bits/element: "
          f"{16 * km['centroids'] / d['tokens_per_chunk']:.3f} per stage at K={km['centroids']}, "
          f"N={d['tokens_per_chunk']}; the ids 8*S/D.", ""]
    fr = res["frontier"]
    n = max(len(v) for v in fr.values())
    rows = []
    for i in range(n):
        row = []
        for t in TENSORS:
            p = fr[t][i] if i < len(fr[t]) else None
            row += ["", "", ""] if p is None else [
                f"{p['label']} INT{p['bits']}" + (" *" if p["pareto"] else ""), f"{p['bpe']:.3f}", _f(p["rel_mse"])]
        rows.append(row)
    L += [_table([h for t in TENSORS for h in (f"{t}: method", "bits/elem", "rel MSE")], rows), ""]
    # c
    L += ["## c. MSE vs PRQ stages (INT2)", "",
          "S = 0 is RTN. ratio = MSE(S-1) / MSE(S) (paper: a large first-stage drop, then >= 1.10x per stage).", ""]
    rows = []
    for t in TENSORS:
        for key, e in res["stages"][t].items():
            rows.append([t, key] + [_f(v) for v in e["rel_mse"]]
                        + [" / ".join(f"{_f(r)}" for r in e["stage_ratio"]), "yes" if e["monotone"] else "NO"])
    L += [_table(["tensor", "B, grid"] + [f"rel MSE S={s}" for s in STAGES] + ["ratio per stage 1..4", "monotone"],
                 rows), ""]
    # d
    ws = res["warm_start"]
    L += ["## d. Streaming k-means warm start", "",
          f"obj@i = mean squared token-to-centroid distance (sum over D) of the centroids after i Lloyd iterations, "
          f"tokens assigned to their nearest centroid (i = 0: the k-means++ seeds / the init). Warm = init from the "
          f"previous chunk's stored (BF16) centroids, {km['warm_iters']} iterations (the production chain; chunk 0 "
          f"cold, {km['cold_iters']} iterations); cold = k-means++ on the same tokens. 'cold iters to reach "
          f"warm@k' = first i with cold obj@i <= warm obj@k (paper: warm@6 ~ cold@20). stored obj = objective of "
          f"the (ids, centroids) pair production stores after {km['warm_iters']} warm / {km['cold_iters']} cold "
          f"iterations. empty = clusters with no token in that pair, per head (an empty cluster keeps its old "
          f"centroid). qvg MSE = INT2 MSE of the qvg (S=1, B=64) Packed built from that pair.", ""]
    for key in ("main", "slow"):
        w = ws[key]
        it = w["K"]["iters"]
        L += [f"### scene motion {w['motion']}" + (" (default)" if key == "main" else " (a 4x slower scene)"), ""]
        rows = []
        for t in TENSORS:
            for c in w[t]["chunks"]:
                q, e, so = c["qvg_int2_mse"], c["empty_clusters_per_head"], c["stored_objective"]
                row = [t, str(c["chunk"]), _f(c["cold"][0]), _f(c["cold"][1])]
                if it:
                    row += [_f(c["cold"][COLD_ITERS]), _f(c["cold"][-1])]
                row += [_f(c["warm"][0]), _f(c["warm"][1])]
                if it:
                    row += [_f(c["warm"][WARM_ITERS]), _f(c["warm"][6]), _f(c["warm"][-1]),
                            _reach(c["cold_iters_to_warm2"], it), _reach(c["cold_iters_to_warm6"], it)]
                row += [f"{_f(so['warm2'])} / {_f(so['cold8'])}", f"{e['warm2']:.1f} / {e['cold8']:.1f}",
                        f"{_f(q['warm2'])} / {_f(q['cold8'])}"]
                rows.append(row)
        head = ["tensor", "chunk", "cold obj@0", "cold obj@1"] + \
            ([f"cold obj@{COLD_ITERS}", f"cold obj@{it}"] if it else []) + ["warm obj@0", "warm obj@1"] + \
            ([f"warm obj@{WARM_ITERS}", "warm obj@6", f"warm obj@{it}", f"cold iters to reach warm@{WARM_ITERS}",
              "cold iters to reach warm@6"] if it else []) + \
            ["stored obj warm / cold", "empty warm / cold", "qvg MSE warm / cold"]
        L += [_table(head, rows), ""]
    L += ["Per-iteration objectives are in kv_analysis.json (warm_start.<main|slow>.<K|V>.chunks[].cold / .warm).", ""]
    return "\n".join(L)


def _checks_line(checks: dict) -> str:
    items = [(f"{t} {k}", v) for t, c in checks.items() for k, v in c.items()]
    bad = [k for k, v in items if not v]
    line = (f"- consistency checks (Packed derived from the k-means chain bitwise == direct qvg.compress): "
            f"{len(items) - len(bad)}/{len(items)} passed")
    return line + ("; FAILED: " + "; ".join(bad) if bad else "")


def _reach(v: int | None, it: int) -> str:
    return f"> {it}" if v is None else str(v)


def _plot(res: dict, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: skipped kv_analysis.png"
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    # a: rel MSE per method, INT2
    labels = [k for k in res["mse"]["K"] if not k.startswith("_")]
    xs = range(len(labels))
    for i, t in enumerate(TENSORS):
        vals = [res["mse"][t][lab]["int2"]["rel_mse"] for lab in labels]
        ax[0].bar([x + 0.4 * i for x in xs], vals, width=0.4, label=t)
    ax[0].set_xticks([x + 0.2 for x in xs], labels, rotation=45, ha="right")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("relative MSE (INT2)")
    ax[0].set_title("a. INT2 relative MSE per method")
    ax[0].legend()
    # c: stages
    for t in TENSORS:
        for key, e in res["stages"][t].items():
            ax[1].plot(e["stages"], e["rel_mse"], marker="o", label=f"{t} {key}")
    ax[1].set_yscale("log")
    ax[1].set_xlabel("stages S")
    ax[1].set_ylabel("relative MSE (INT2)")
    ax[1].set_title("c. MSE vs PRQ stages")
    ax[1].legend(fontsize=7)
    # d: warm vs cold, normalized by cold's final objective
    i = 0
    for t in TENSORS:
        for c in res["warm_start"]["main"][t]["chunks"]:
            ref, col = c["cold"][-1], f"C{i % 10}"
            ax[2].plot([v / ref for v in c["cold"]], ls="--", color=col, label=f"{t} chunk {c['chunk']} cold")
            ax[2].plot([v / ref for v in c["warm"]], color=col, label=f"{t} chunk {c['chunk']} warm")
            i += 1
    ax[2].set_yscale("log")
    ax[2].set_xlabel("Lloyd iteration")
    ax[2].set_ylabel("objective / cold final")
    ax[2].set_title("d. k-means warm vs cold start")
    ax[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    with atomic(path) as tmp:  # (the whole PNG or none)
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return f"wrote {path}"


OUTPUTS = ("kv_analysis.json", "kv_analysis.md", "kv_analysis.png")


def save(res: dict, out: str | Path) -> list[str]:
    """The JSON, the markdown and the PNG in folder `out` (made if missing), all or none: each is put in place only
    once the others are written. An OSError names the file it was writing."""
    out = Path(out)
    js, md, png = (out / name for name in OUTPUTS)
    path = out
    try:
        out.mkdir(parents=True, exist_ok=True)
        with atomic(js) as tmp_js, atomic(md) as tmp_md:
            path = js
            tmp_js.write_text(json.dumps(res, indent=1) + "\n")
            path = md
            tmp_md.write_text(to_markdown(res))
            path = png
            note = _plot(res, png)
            path = md
    except OSError as e:
        raise OSError(e.errno, f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return [f"wrote {js}", f"wrote {md}", note]


MAX_SEED = 2**63 - 8  # (the k-means seeds go up to seed + 2, and a chain's stage s uses its seed + s)


def _seed(text: str) -> int:
    """--seed: an integer in [0, MAX_SEED] (a negative one was a traceback from the k-means after the parse)."""
    try:
        v = integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {v}")
    return v


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m qvg.eval.kv_analysis", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".", help="output folder (default: the current one; the committed copies are "
                    "in eval/results)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a seconds-long smoke test")
    ap.add_argument("--seed", type=_seed, default=0, help=f"data seed and first k-means seed, in [0, {MAX_SEED}] "
                    "(default 0)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    bad = folder_error(args.out, OUTPUTS)  # (before the work: not a traceback after it)
    if bad:
        print(f"{ap.prog}: error: --out: {bad}", file=sys.stderr)
        raise SystemExit(2)
    cmd = " ".join(["python -m qvg.eval.kv_analysis", *(sys.argv[1:] if argv is None else argv)])
    res = run(quick=args.quick, seed=args.seed, progress=not args.no_progress, command=cmd)
    print(to_markdown(res))
    try:
        notes = save(res, args.out)
    except OSError as e:  # (a full disk, a folder removed meanwhile: nothing written)
        print(f"{ap.prog}: error: {e.strerror or e}; nothing written", file=sys.stderr)
        raise SystemExit(1)
    for note in notes:
        print(note)
    return res


if __name__ == "__main__":
    # torch's OpenMP threads spin at barriers by default; on a CPU shared with other processes that makes this run
    # several times slower (see tests/conftest.py). The policy must be set before torch loads, so re-exec once.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "qvg.eval.kv_analysis", *sys.argv[1:]])
    main()
