"""Evaluate the embedded world model on held-out photos (issue 5's evidence), with seed-variance floors.

1. quality: start image + actions on held-out trajectories -> PSNR / SSIM per chunk against the true camera views,
   next to a copy-the-last-frame baseline (the start image, the last true frame the model is given);
2. memory: revisit trajectories (go m chunks one way, come straight back): PSNR on the returning views with the full
   history in BF16 vs a short rolling window that has forgotten the region;
3. QVG: at equal KV bytes, QVG INT2 with a ~6x longer window vs BF16 with the short window; at equal (full) history,
   QVG INT2 vs BF16, with RTN / KIVI / QuaRot INT2 beside it.
Every number is a mean over trajectories and sampling seeds; `floor` is the spread of the same configuration over
seeds (the std over seeds of the per-seed mean), the smallest difference worth reading.

    python -m qvg.eval.world_eval --out eval/results/world-eval            # .json, .md and .png
"""
from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from qvg.help_format import OneLineParser
from qvg.outputs import stem_path, targets_error
from qvg.revision import code_commit

from ..pipelines.world_data import REVERSE, Camera, _valid, cameras_for, load_photo, photo_names, random_trajectory, render
from ..pipelines.world_model import DEFAULT_CONFIG, action_ids, load_world, rollout
from .metrics import psnr, ssim

SHORT = 3  # the short window (latent frames): one chunk of history
REGION_OVERLAP = 0.5  # a returning view is back in the region when it shows at least half of the start view


def configs(cfg) -> dict:
    """name -> (method, window frames or None, options)."""
    long = 6 * SHORT
    return {
        "bf16 full": ("bf16", None, {}),
        f"bf16 window:{SHORT}": ("bf16", SHORT, {}),
        f"qvg int2 window:{long}": ("qvg", long, {"bits": 2}),
        "qvg int2 full": ("qvg", None, {"bits": 2}),
        "qvg int4 full": ("qvg", None, {"bits": 4}),
        "qvg-pro int2 full": ("qvg-pro", None, {"bits": 2}),
        "rtn int2 full": ("rtn", None, {"bits": 2}),
        "kivi int2 full": ("kivi", None, {"bits": 2}),
        "quarot int2 full": ("quarot", None, {"bits": 2}),
    }


def revisit_trajectory(rng: random.Random, hw, m: int, cfg) -> tuple[Camera, list[str]]:
    """Start, then m chunks one way and m straight back (the last m chunks return over views already seen)."""
    size, cf = cfg["frame_size"], cfg["chunk_frames"]
    for _ in range(1000):
        z = rng.uniform(0.8, 1.3)
        half = z * size / 2
        start = Camera(rng.uniform(half, hw[1] - half), rng.uniform(half, hw[0] - half), z)
        dirs = list(REVERSE)  # pans and zooms: zooming in loses the periphery, zooming back out needs it
        rng.shuffle(dirs)
        for d in dirs:
            if _valid(start, d, m * cf, hw, cfg):
                return start, ["stay"] + [d] * m + [REVERSE[d]] * m
    raise RuntimeError("no revisit trajectory fits the canvas")


TRAJECTORY_SEED = 1234  # the held-out trajectories of every committed world-eval run before world-confirm-*


def cases(kind: str, n: int, chunks: int, m: int, cfg, seed: int = TRAJECTORY_SEED):
    """[(name, ground-truth views [3, F, S, S], actions)] on the held-out photos."""
    out = []
    for photo in photo_names("eval"):
        canvas = load_photo(photo)
        rng = random.Random(f"{seed}-{kind}-{photo}")
        for i in range(n):
            if kind == "revisit":
                start, acts = revisit_trajectory(rng, tuple(canvas.shape[-2:]), m, cfg)
            else:  # the camera always moves (while it stays, copying the last frame is exact: nothing to measure)
                start, acts = random_trajectory(rng, tuple(canvas.shape[-2:]), chunks, cfg, revisit=False)
                while "stay" in acts[1:]:
                    start, acts = random_trajectory(rng, tuple(canvas.shape[-2:]), chunks, cfg, revisit=False)
            out.append((f"{photo}-{i}", render(canvas, cameras_for(start, acts, cfg["chunk_frames"], cfg),
                                               cfg["frame_size"]), acts))
    return out


def run_case(model, cfg, gt, acts, method, window, opts, seed, device):
    from qvg.cache import KVCache, cache_options
    cf, size = cfg["chunk_frames"], cfg["frame_size"]
    tpf = model.tokens_per_latent_frame(size, size)
    opts = cache_options(method, opts, cf * tpf)  # (the cache's own default K, named in the results' options)
    cache = KVCache(len(model.blocks), method, chunk_frames=cf, tokens_per_frame=tpf, window_frames=window, **opts)
    start = gt[:, 0].to(device)
    vids, mem = [], None
    for r in rollout(model, cfg, start, action_ids(acts[1:], cfg), cache, seed=seed):
        vids.append(r.video[0].float().cpu())
        m = cache.memory()
        mem = m if mem is None or m["total"] > mem["total"] else mem
    return torch.cat(vids, 1), mem


def per_chunk(video, gt, cf):
    """PSNR / SSIM per generated chunk (gt holds the start chunk first)."""
    n = video.shape[1] // cf
    return ([psnr(video[:, c * cf:(c + 1) * cf], gt[:, (c + 1) * cf:(c + 2) * cf]) for c in range(n)],
            [ssim(video[:, c * cf:(c + 1) * cf], gt[:, (c + 1) * cf:(c + 2) * cf]) for c in range(n)])


def summarize(values_by_seed: list[list[float]]) -> dict:
    """values_by_seed[s] = the values of seed s (over trajectories / chunks) -> mean and the seed floor."""
    per_seed = [statistics.fmean(v) for v in values_by_seed]
    return {"mean": round(statistics.fmean(per_seed), 3),
            "floor": round(statistics.stdev(per_seed), 3) if len(per_seed) > 1 else None}


def report(res: dict, out: Path) -> None:
    """Markdown (out.md) and a plot (out.png, needs matplotlib) from the results dict."""
    stem_path(out, ".md").write_text(_markdown(res))
    q, rv, st = res.get("quality"), res["revisit"], res["settings"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    if q:
        for k, vs in res["quality_per_chunk_psnr"].items():
            ax[0].plot(range(1, len(vs) + 1), vs, marker="o", label=k)
        ax[0].set(xlabel="generated chunk", ylabel="PSNR vs true views (dB)", title="held-out trajectories")
    else:
        for k, d in rv.items():
            if "returning_psnr_per_chunk" in d:
                ax[0].plot(range(1, st["m"] + 1), d["returning_psnr_per_chunk"], marker="o", label=k)
        ax[0].set(xlabel="returning chunk", ylabel="PSNR vs true views (dB)", title="revisits, per returning chunk")
    ax[0].legend(fontsize=7)
    names = list(rv)
    ax[1].barh(names, [rv[k]["returning_psnr"]["mean"] for k in names],
               xerr=[rv[k]["returning_psnr"]["floor"] or 0 for k in names])
    ax[1].set(xlabel="PSNR on returning views (dB)", title="revisits")
    ax[1].invert_yaxis()
    fig.tight_layout()
    fig.savefig(stem_path(out, ".png"), dpi=110)


def _markdown(res: dict) -> str:
    """The report's markdown."""
    q, rv = res.get("quality"), res["revisit"]
    st = res["settings"]
    lines = [f"# Embedded world model: evaluation on held-out photos ({res['device']})", "",
             f"- date {res['date']}; commit `{res['commit']}`; model trained {res['model']} steps; "
             f"{res['seconds']} s",
             *([f"- command: `python -m qvg.eval.world_eval {' '.join(res['argv'])}`"] if "argv" in res else
               [f"- {len(res['argv_runs'])} processes at once (seconds: the longest), merged with `--merge`:"]
               + [f"  - `python -m qvg.eval.world_eval {' '.join(argv)}`" for argv in res["argv_runs"]]),
             f"- trajectory seed {st.get('trajectory_seed', TRAJECTORY_SEED)}; sampling seeds "
             f"{st.get('seed_offset', 0)}..{st.get('seed_offset', 0) + st['seeds'] - 1}",
             f"- {st['trajectories']} trajectories per held-out photo ({', '.join(photo_names('eval'))}) and kind, "
             f"{st['seeds']} sampling seeds; `floor` = std over seeds of the per-seed mean (same configuration)", ""]
    if q:
        lines += [f"## 1. Quality vs the true views (first {st['first']} chunks of {st['chunks']})", "",
                  "| | PSNR dB | floor | SSIM | floor |", "|---|---|---|---|---|"]
        for k, d in q.items():
            lines.append(f"| {k} | {d['psnr']['mean']:.2f} | {_fl(d['psnr']['floor'])} | {d['ssim']['mean']:.3f} | "
                         f"{_fl(d['ssim']['floor'])} |")
        lines += ["", "PSNR per generated chunk (mean over trajectories and seeds): " + "; ".join(
            f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in res["quality_per_chunk_psnr"].items()), ""]
    lines += [f"## 2-3. Revisits (go {st['m']} chunks, come back {st['m']}): PSNR on the returning views", "",
              "`returning` compares the returning views with the true views; `consistency` compares them with the "
              "model's own views at the same camera on the way out (the start image for the last frame).", "",
              f"`back in region` keeps the returning frames whose view shows at least {REGION_OVERLAP:.0%} of the start "
              "view (the region left); the earlier returning frames look at the far side of the excursion, which "
              "the model made up on the way out.", "",
              "| cache | returning PSNR dB | floor | back in region PSNR dB | floor | consistency PSNR dB | floor | "
              "all chunks PSNR | KV bytes at the end (history + current) | ratio |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for k, d in rv.items():
        nan = {"mean": float("nan"), "floor": None}
        c, r = d.get("consistency_psnr", nan), d.get("region_psnr", nan)
        lines.append(f"| {k} | {d['returning_psnr']['mean']:.2f} | {_fl(d['returning_psnr']['floor'])} | "
                     f"{r['mean']:.2f} | {_fl(r['floor'])} | {c['mean']:.2f} | {_fl(c['floor'])} | "
                     f"{d['all_chunks_psnr']['mean']:.2f} | "
                     f"{d['kv_bytes_at_end']['total']:,} | {d['compression_ratio']:.2f}x |")
    if any("returning_psnr_per_chunk" in d for d in rv.values()):
        lines += ["", "Per returning chunk (first to last; the last is back at the start view), returning / "
                  "consistency PSNR:", ""]
        for k, d in rv.items():
            if "returning_psnr_per_chunk" in d:
                lines.append(f"- {k}: " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(
                    d["returning_psnr_per_chunk"], d["consistency_psnr_per_chunk"])))
    if res.get("differences"):
        lines += ["", "Paired differences (same trajectories and sampling seeds; floor = std over seeds of the per-seed "
                  "difference):", "", "| difference | dB | floor |", "|---|---|---|"]
        lines += [f"| {k} | {d['mean']:+.2f} | {_fl(d['floor'])} |" for k, d in res["differences"].items()]
    if any("region_psnr_by_overlap" in d for d in rv.values()):
        cuts = next(d["region_psnr_by_overlap"] for d in rv.values() if "region_psnr_by_overlap" in d)
        lines += ["", "Back-in-region PSNR at other cuts (share of the start view the returning frame must show):", "",
                  "| cache | " + " | ".join(f">= {float(c):.0%}" for c in cuts) + " |",
                  "|---|" + "---|" * len(cuts)]
        lines += [f"| {k} | " + " | ".join(f"{v['mean']:.2f} ± {_fl(v['floor'])}" for v in d["region_psnr_by_overlap"]
                                           .values()) + " |" for k, d in rv.items() if "region_psnr_by_overlap" in d]
    return "\n".join(lines) + "\n"


def start_overlap(action: str, offset: int, cfg) -> float:
    """The share of a view `offset` frames of `action` away and the start view in common, relative to the larger
    of the two (a pan slides the view off the start view; a zoom scales one inside the other)."""
    if action in ("zoom_in", "zoom_out"):
        return cfg["zoom_factor"] ** (-2 * offset)
    return max(0.0, 1 - offset * cfg["pan_pixels"] / cfg["frame_size"])


OVERLAPS = (0.25, REGION_OVERLAP, 0.75)  # region cuts reported beside the primary one (sensitivity to the cut)


def region_frames(acts, m, cfg, least: float = REGION_OVERLAP) -> list[int]:
    """Indices (in the generated video) of the returning frames that are back in the region left: their view shows
    at least `least` of the start view. The other returning frames still look at the far side of the excursion,
    which neither cache can know the truth of (the model made it up on the way out)."""
    cf = cfg["chunk_frames"]
    out = []
    for i in range(m * cf, 2 * m * cf):
        offset = 2 * m * cf - (i + 1)
        if start_overlap(acts[1], offset, cfg) >= least:
            out.append(i)
    return out


def consistency(video, start, m, cf) -> list[float]:
    """Revisit self-consistency per returning chunk: PSNR of each returning frame against the model's own frame at
    the same camera on the way out (the start image for the last one). It measures what the model remembers of
    its own past, hallucinated parts included, which PSNR against the true views cannot see."""
    out = []
    for c in range(m):
        got, ref = [], []
        for j in range(cf):
            o = m * cf - (c * cf + j + 1)  # the camera's offset (in frames of motion) from the start
            got.append(video[:, (m + c) * cf + j])
            ref.append(video[:, o - 1] if o > 0 else start)
        out.append(psnr(torch.stack(got, 1), torch.stack(ref, 1)))
    return out


def _seed_means(values_by_seed):
    return [round(statistics.fmean(v), 4) for v in values_by_seed]


def differences(rv: dict, short: str = f"bf16 window:{SHORT}", full: str = "bf16 full") -> dict:
    """Paired differences of every configuration against BF16 with the short window and against full BF16 (same
    trajectories and sampling seeds): the mean of the per-seed differences and their std over seeds (the floor of
    a difference, tighter than either configuration's own floor because the pairs share their noise)."""
    out = {}
    for name, d in rv.items():
        for ref in (short, full):
            if ref == name or ref not in rv or (name, ref) == (short, full):  # full - short already says it
                continue
            for metric in ("returning_psnr", "region_psnr"):
                diff = [x - y for x, y in zip(d["per_seed"][metric], rv[ref]["per_seed"][metric])]
                out[f"{name} - {ref}: {metric}"] = {
                    "mean": round(statistics.fmean(diff), 3),
                    "floor": round(statistics.stdev(diff), 3) if len(diff) > 1 else None}
    return out


def quality_part(model, cfg, a) -> dict:
    """1. Held-out trajectories: PSNR / SSIM of the first chunks vs the true views, beside copy-the-last-frame."""
    cf = cfg["chunk_frames"]
    quality = cases("quality", a.trajectories, a.chunks + 1, a.m, cfg, seed=a.trajectory_seed)
    q = {"bf16 full": {"psnr": [], "ssim": []}, "copy last frame": {"psnr": [], "ssim": []}}
    curves = {"bf16 full": [], "copy last frame": []}
    for s in range(a.seeds):
        ps, ss, bp, bs, cur = [], [], [], [], []
        for name, gt, acts in quality:
            vid, _ = run_case(model, cfg, gt, acts, "bf16", None, {}, s + a.seed_offset, a.device)
            cp, cs = per_chunk(vid, gt, cf)
            copy = gt[:, :1].expand(-1, vid.shape[1], -1, -1)
            kp, ks = per_chunk(copy, gt, cf)
            ps += cp[:a.first]
            ss += cs[:a.first]
            bp += kp[:a.first]
            bs += ks[:a.first]
            cur.append((cp, kp))
        q["bf16 full"]["psnr"].append(ps)
        q["bf16 full"]["ssim"].append(ss)
        q["copy last frame"]["psnr"].append(bp)
        q["copy last frame"]["ssim"].append(bs)
        curves["bf16 full"].append([statistics.fmean(c[0][i] for c in cur) for i in range(a.chunks)])
        curves["copy last frame"].append([statistics.fmean(c[1][i] for c in cur) for i in range(a.chunks)])
    return {"quality": {k: {m: summarize(v) for m, v in d.items()} for k, d in q.items()},
            "quality_per_chunk_psnr": {k: [round(statistics.fmean(c[i] for c in v), 3) for i in range(a.chunks)]
                                       for k, v in curves.items()}}


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m qvg.eval.world_eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="world model directory (default: the shipped assets/world)")
    p.add_argument("--out", default="eval/results/world-eval",
                   help="output path without extension: .json, .md and .png are written; its folder must exist "
                        "(default eval/results/world-eval, from the repository's root)")
    p.add_argument("--seeds", type=int, default=3, help="sampling seeds per trajectory (default 3)")
    p.add_argument("--trajectories", type=int, default=4, help="per held-out photo and kind")
    p.add_argument("--chunks", type=int, default=8, help="generated chunks of the quality trajectories")
    p.add_argument("--m", type=int, default=4, help="revisit: chunks away before coming back")
    p.add_argument("--first", type=int, default=4, help="quality: chunks averaged (the first ones)")
    p.add_argument("--configs", default=None,
                   help="revisit cache configurations to run, comma-separated names (default: all): "
                        + "; ".join(configs(DEFAULT_CONFIG)))
    p.add_argument("--skip-quality", action="store_true", help="only the revisit part (2-3)")
    p.add_argument("--add-configs", default=None, metavar="JSON",
                   help='more revisit configurations: {"name": [method, window frames or null, {options}]}, '
                        'or @FILE holding that JSON')
    p.add_argument("--trajectory-seed", type=int, default=TRAJECTORY_SEED,
                   help="draws the held-out trajectories (another value = fresh trajectories on the same photos)")
    p.add_argument("--seed-offset", type=int, default=0, help="sampling seeds are offset, offset+1, ...")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:N] (default cuda when available, else cpu)")
    p.add_argument("--report", default=None, help="only render .md / .png from this results JSON")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge results JSONs of one set (same photos, trajectories, seeds, m; e.g. configurations "
                        "run in parallel processes) into --out (.json, .md, .png), differences recomputed")
    a = p.parse_args(argv)
    from ..app.generate import parser_device  # (qvg-generate's check: cpu or an existing cuda[:N])
    a.device = parser_device(p, a.device)
    for name in ("seeds", "trajectories", "chunks", "m", "first"):  # (counts: --seeds 3 = 3 sampling seeds)
        if getattr(a, name) < 1:
            p.error(f"--{name} is a count and must be >= 1, got {getattr(a, name)}")
    if not a.report:  # (checked before the work: a missing folder was made, an unwritable one a traceback after it)
        bad = targets_error(stem_path(Path(a.out), ext) for ext in (".json", ".json.tmp", ".md", ".png"))
        if bad:
            p.error(f"--out: {bad[1]}")
    if a.report:  # (a JSON that is not a results dict: one line, nothing written; the .md is rendered first)
        try:
            report(read_results(a.report), Path(a.report))
        except ValueError as e:
            p.error(f"--report: {e}")
        return 0
    if a.merge:
        try:
            res = merge([read_results(f) for f in a.merge])
        except (KeyError, ValueError) as e:
            p.error(f"--merge: {e}")
        _write(res, Path(a.out))
        return 0
    table = configs(DEFAULT_CONFIG)
    if a.add_configs:
        try:
            text = Path(a.add_configs[1:]).read_text() if a.add_configs.startswith("@") else a.add_configs
            table.update({k: tuple(v) for k, v in json.loads(text).items()})
        except (json.JSONDecodeError, AttributeError, TypeError, OSError) as e:
            p.error(f"--add-configs: not a JSON object of [method, window, options] ({e})")
    names = list(table) if a.configs is None else [c.strip() for c in a.configs.split(",")]
    unknown = [c for c in names if c not in table]
    if unknown:
        p.error(f"unknown --configs {unknown}; choose from: {'; '.join(table)}")
    t0 = time.time()
    try:
        model, cfg = load_world(a.model, device=a.device)
    except (OSError, ValueError) as e:  # (WorldModelError is a ValueError)
        p.error(f"--model: {e}")
    cf = cfg["chunk_frames"]
    import sys
    res = {"settings": vars(a), "argv": sys.argv[1:] if argv is None else argv,
           "device": torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu",  # (that GPU's)
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": cfg.get("training", {}).get("steps")}
    res["commit"] = code_commit()

    # 1. quality vs ground truth, next to copy-the-last-frame
    if not a.skip_quality:
        res.update(quality_part(model, cfg, a))

    # 2 + 3. revisits: PSNR on the returning views (the last m chunks), per cache configuration
    revisit = cases("revisit", a.trajectories, 2 * a.m + 1, a.m, cfg, seed=a.trajectory_seed)
    rv = {}
    for cname in names:
        method, window, opts = table[cname]
        by_seed, all_seed, cons_seed, reg_seed, curve, cons_curve, mem = [], [], [], [], [], [], None
        cut_seed = {c: [] for c in OVERLAPS}
        for s in range(a.seeds):
            ret, every, cons = [], [], []
            cuts = {c: [] for c in OVERLAPS}
            for name, gt, acts in revisit:
                vid, m = run_case(model, cfg, gt, acts, method, window, opts, s + a.seed_offset, a.device)
                cp, _ = per_chunk(vid, gt, cf)
                cc = consistency(vid, gt[:, 0], a.m, cf)
                ret += cp[a.m:]
                every += cp
                cons += cc
                for c in OVERLAPS:  # (REGION_OVERLAP, the primary cut, is one of them)
                    cuts[c] += [psnr(vid[:, i], gt[:, i + cf]) for i in region_frames(acts, a.m, cfg, c)]
                curve.append(cp[a.m:])
                cons_curve.append(cc)
                mem = m
            by_seed.append(ret)
            all_seed.append(every)
            cons_seed.append(cons)
            reg_seed.append(cuts[REGION_OVERLAP])
            for c in OVERLAPS:
                cut_seed[c].append(cuts[c] or [float("nan")])
        hist = {k: v for k, v in mem.items() if k not in ("compression_ratio",)}
        rv[cname] = {"returning_psnr": summarize(by_seed), "all_chunks_psnr": summarize(all_seed),
                     "consistency_psnr": summarize(cons_seed), "region_psnr": summarize(reg_seed),
                     "region_psnr_by_overlap": {str(c): summarize(v) for c, v in cut_seed.items()},
                     "per_seed": {"returning_psnr": _seed_means(by_seed), "region_psnr": _seed_means(reg_seed)},
                     "returning_psnr_per_chunk": [round(statistics.fmean(c[i] for c in curve), 3)
                                                  for i in range(a.m)],
                     "consistency_psnr_per_chunk": [round(statistics.fmean(c[i] for c in cons_curve), 3)
                                                    for i in range(a.m)],
                     "method": method, "window": window, "options": opts,
                     "kv_bytes_at_end": hist, "compression_ratio": round(mem["compression_ratio"], 3)}
        print(cname, rv[cname]["returning_psnr"], rv[cname]["consistency_psnr"], flush=True)
        res.update(revisit=rv, differences=differences(rv), seconds=round(time.time() - t0, 1))
        _write(res, Path(a.out), markdown=False)  # after every configuration: a time limit keeps what is done
    _write(res, Path(a.out))
    if res.get("quality") is not None:  # (a revisit-only run has none)
        print(json.dumps(res["quality"]), flush=True)
    return 0


def _fl(floor) -> str:
    """A floor in the tables: None (one seed gives no spread) as 'n/a'."""
    return "n/a" if floor is None else str(floor)


def _write(res: dict, out: Path, markdown: bool = True) -> None:
    tmp = stem_path(out, ".json.tmp")  # (its folder was checked before the work, not made: a typo made folders)
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(stem_path(out, ".json"))
    if markdown:
        report(res, out)


SAME_SET = ("m", "seeds", "trajectories", "trajectory_seed", "seed_offset", "chunks", "first", "model")


def read_results(path) -> dict:
    """A results JSON written by this module, checked enough to render and merge (ValueError naming the file: cannot
    be read, not JSON, or missing what a results dict holds)."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} ({e})") from None
    st, rv = (res.get("settings"), res.get("revisit")) if isinstance(res, dict) else (None, None)
    if not (isinstance(st, dict) and isinstance(rv, dict) and all(isinstance(d, dict) for d in rv.values())):
        raise ValueError(f"{path} is not a world_eval results JSON (no settings / revisit results)")
    try:
        _markdown(res)  # (every number the report shows, each where it is looked for)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        what = f"no {e.args[0]!r} entry" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path} is not a complete world_eval results JSON ({what})") from None
    return res


def merge(parts: list[dict]) -> dict:
    """One results dict from runs of the same set (SAME_SET settings, device, commit): revisit configurations in
    the order given (a name in two runs must hold the same numbers: the runs are deterministic), the quality part
    of the run that has one, differences recomputed over all configurations; `argv_runs` lists every run's argv."""
    first = parts[0]
    for r in parts[1:]:
        for k in SAME_SET:
            if r["settings"].get(k) != first["settings"].get(k):
                raise ValueError(f"setting {k} differs: {first['settings'].get(k)!r} vs {r['settings'].get(k)!r}")
        for k in ("device", "commit", "model"):
            if r.get(k) != first.get(k):
                raise ValueError(f"{k} differs: {first.get(k)!r} vs {r.get(k)!r}")
    res = {k: v for k, v in first.items() if k not in ("revisit", "differences", "quality", "quality_per_chunk_psnr")}
    rv = {}
    for r in parts:
        for name, d in r["revisit"].items():
            if name in rv and rv[name]["per_seed"] != d["per_seed"]:
                raise ValueError(f"configuration {name!r} has different numbers in two runs")
            rv.setdefault(name, d)
        for k in ("quality", "quality_per_chunk_psnr"):
            if k in r:
                res[k] = r[k]
    res["revisit"], res["differences"] = rv, differences(rv)
    res["argv_runs"] = [r.get("argv", []) for r in parts]
    res.pop("argv", None)
    res["seconds"] = max(r["seconds"] for r in parts)
    return res


if __name__ == "__main__":
    raise SystemExit(main())
