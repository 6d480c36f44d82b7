"""Pool the per-run overheads of several bench_pipeline runs of one code and test them against a target.

    python -m qvg.eval.overhead_stats eval/results/pipeline-h100.r*.json --method qvg-pro --history 21 \
        --target 0.015 [--out FILE.json]

Each run's overhead is its own `overhead_vs_bf16` (the method's median chunk over the same run's bf16 median, less
one): the same chunk code has differed by up to ~0.9 points between runs, so the run, not the round, is the unit.
Runs against different BF16 caches are refused (the file's `bf16_baseline`; files without it: "ring" from
BASELINE_RING on, "shift" before, by git). Runs on one machine are not independent: with `--machine-sizes 3,1,2`
(consecutive files: the first three on one machine, the next on another, ...) or, when every file records its GPU's
`gpu_uuid` (bench_pipeline since 29328c7), by that, each machine's mean run overhead is one sample, and the
verdict is taken over the machines: the JSON's top-level summary (n, mean, upper95_of_mean, met) is then the
machines', the runs' is under `over_runs`.
The criterion (fixed before the runs it judges, eval/results/pipeline-h100.md): the target is met when the one-sided
95% upper confidence bound of the mean, mean + t(0.95, n - 1) * sd / sqrt(n), is at most the target. The median, the
range and how many runs are over the target are printed beside it. Exit 0 either way; 2 on bad input (one line).

    python -m qvg.eval.overhead_stats FILES --machine-sizes 3,1,2,... [--out FILE.json]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from qvg.help_format import OneLineParser
from qvg.numbers import finite
from qvg.outputs import target_error
from qvg.revision import REPO

BASELINE_RING = "ffe3555"  # since this commit bench_pipeline's `bf16` row is the BF16 cache as a ring (before: shift)

# one-sided 95% quantiles of Student's t by degrees of freedom (1..30); beyond: the Cornish-Fisher expansion
_T95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697]


def t95(df: int) -> float:
    """One-sided 95% quantile of Student's t with df degrees of freedom."""
    if df < 1:
        raise ValueError("needs at least two runs")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6448536269514722
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def run_overheads(paths: list[str], method: str, history: int) -> list[dict]:
    """One entry per file: its commit, date and the method's overhead at that history."""
    out, seen = [], set()
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            raise ValueError(f"{p}: given twice (each run counts once)")
        seen.add(key)
        try:
            d = json.loads(Path(p).read_text())
            rows = [r for r in d["rows"] if r.get("method") == method and r.get("history_frames") == history]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{p}: not a bench_pipeline results file ({e})") from None
        o = rows[0].get("overhead_vs_bf16") if len(rows) == 1 else None
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o):
            raise ValueError(f"{p}: no single {method!r} row at history {history} with a numeric overhead")
        out.append({"file": Path(p).name, "commit": d.get("commit"), "date": d.get("date"),
                    "device": d.get("device"), "gpu_uuid": d.get("gpu_uuid") or None, "overhead": float(o),
                    "bf16_baseline": d.get("bf16_baseline") or _baseline_of(d.get("commit"))})
    kinds = sorted({r["bf16_baseline"] for r in out})
    if len(kinds) > 1:
        raise ValueError("these runs' overheads are against different BF16 caches (" + ", ".join(
            f"{r['file']}: {r['bf16_baseline']}" for r in out) + "): pool runs of one baseline")
    return out


def _baseline_of(commit) -> str:
    """The `bf16` row's cache in a file that does not say: "ring" from commit BASELINE_RING on, "shift" before;
    "unknown" when git cannot tell (no such commit here)."""
    if not isinstance(commit, str) or not commit:
        return "unknown"
    try:
        rc = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", BASELINE_RING,
                             commit.split("-")[0]], capture_output=True, timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return {0: "ring", 1: "shift"}.get(rc, "unknown")


def machines(runs: list[dict], sizes: str | None) -> list[list[int]] | None:
    """Indexes of the runs of each machine: from `sizes` ("3,1,2": consecutive runs; it must not contradict the GPU
    UUIDs the files record), else from every run's gpu_uuid (in order of first appearance); None when neither is
    known. Fewer than two machines is an error (no spread to bound)."""
    if sizes:
        try:
            counts = [int(c) for c in sizes.split(",")]
        except ValueError:
            raise ValueError(f"--machine-sizes {sizes!r}: not a comma-separated list of run counts") from None
        if any(c < 1 for c in counts) or sum(counts) != len(runs):
            raise ValueError(f"--machine-sizes {sizes!r}: counts >= 1 adding up to the {len(runs)} runs")
        ends = list(itertools.accumulate(counts))
        groups = [list(range(e - c, e)) for e, c in zip(ends, counts)]
        owner: dict[str, int] = {}
        for m, g in enumerate(groups):
            ids = {runs[i]["gpu_uuid"] for i in g if runs[i]["gpu_uuid"]}
            if len(ids) > 1:
                raise ValueError(f"--machine-sizes: machine {m} holds runs of {len(ids)} GPUs (by their recorded "
                                 "UUIDs)")
            for u in ids:
                if owner.setdefault(u, m) != m:
                    raise ValueError(f"--machine-sizes: GPU {u} is split over machines {owner[u]} and {m}")
    elif runs and all(r["gpu_uuid"] for r in runs):
        by_uuid: dict[str, list[int]] = {}
        for i, r in enumerate(runs):
            by_uuid.setdefault(r["gpu_uuid"], []).append(i)
        groups = list(by_uuid.values())
    else:
        return None
    if len(groups) < 2:
        raise ValueError(f"all {len(runs)} runs are on one machine: the verdict needs at least two machines")
    return groups


def summarize(overheads: list[float], target: float) -> dict:
    n = len(overheads)
    if n < 2:
        raise ValueError("needs at least two runs")
    mean, sd = statistics.fmean(overheads), statistics.stdev(overheads)
    upper = mean + t95(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "median": statistics.median(overheads), "min": min(overheads),
            "max": max(overheads), "runs_over_target": sum(o > target for o in overheads),
            "upper95_of_mean": upper, "target": target, "met": upper <= target}


def _positive(text: str) -> float:
    """--target: a finite fraction > 0 (nan gave "not met" on data the default target met, and status 0)."""
    v = finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a fraction > 0 (0.015: 1.5%), got {text!r}")
    return v


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m qvg.eval.overhead_stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench_pipeline JSON files, one per run")
    ap.add_argument("--method", default="qvg-pro")
    ap.add_argument("--history", type=int, default=21)
    ap.add_argument("--target", type=_positive, default=0.015, help="as a fraction (default 0.015: 1.5%%)")
    ap.add_argument("--machine-sizes", default=None, help="runs per machine, in file order (e.g. 3,1,2)")
    ap.add_argument("--out", default=None, help="write the summary and the runs as JSON here")
    a = ap.parse_args(argv)
    bad = a.out is not None and target_error(a.out)  # (before the work: a missing folder was a traceback after it)
    if bad:
        ap.error(f"--out: {bad}")
    try:
        runs = run_overheads(a.files, a.method, a.history)
        s = summarize([r["overhead"] for r in runs], a.target)
        groups = machines(runs, a.machine_sizes)
        sm = None
        if groups is not None:
            means = [statistics.fmean(runs[i]["overhead"] for i in g) for g in groups]
            sm = {**summarize(means, a.target), "runs_per_machine": [len(g) for g in groups], "machine_means": means}
            for m, g in enumerate(groups):
                for i in g:
                    runs[i]["machine"] = m
        elif any(r["gpu_uuid"] for r in runs):
            print("overhead_stats: some files record no gpu_uuid: runs are the unit (give --machine-sizes)")
    except ValueError as e:
        print(f"overhead_stats: {e}", file=sys.stderr)
        return 2
    for r in runs:
        print(f"  {r['file']:45s} {r['commit'] or '?':>10s} {r['overhead']:+.2%}"
              + (f"  machine {r['machine']}" if "machine" in r else ""))
    print(f"{a.method} at {a.history} frames over {s['n']} runs: mean {s['mean']:+.3%} (sd {s['sd']:.3%}), median "
          f"{s['median']:+.3%}, range {s['min']:+.2%} to {s['max']:+.2%}, {s['runs_over_target']} over "
          f"{a.target:.2%}; one-sided 95% upper bound of the mean {s['upper95_of_mean']:+.3%}"
          + ("" if sm else f": {'met' if s['met'] else 'not met'}"))
    if sm:
        print(f"over {sm['n']} machines (each machine's mean run): mean {sm['mean']:+.3%} (sd {sm['sd']:.3%}), "
              f"range {sm['min']:+.2%} to {sm['max']:+.2%}; one-sided 95% upper bound of the mean "
              f"{sm['upper95_of_mean']:+.3%}: {'met' if sm['met'] else 'not met'} (the verdict: machines are the unit)")
        s = {**sm, "verdict_over": "machines", "over_runs": s}
    else:
        s = {**s, "verdict_over": "runs"}
    if a.out:
        from .provenance import git_commit
        commit, dirty = git_commit()
        meta = {"devices": sorted({str(r["device"]) for r in runs}), "commit": commit, "git_dirty": dirty,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        Path(a.out).write_text(json.dumps({**meta, "method": a.method, "history_frames": a.history, **s, "runs": runs,
                                           "command": "python -m qvg.eval.overhead_stats " + " ".join(
                                               argv if argv is not None else sys.argv[1:])}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
