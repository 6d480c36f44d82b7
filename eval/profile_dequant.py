"""Dequant kernel options timed side by side on the GPU: `python -m qvg.eval.profile_dequant [--out DIR]
[--rounds R] [--only NAMES] [--workload] [--baseline FILE]` -> profile-dequant-<gpu>.json.

Shapes: the benchmark's spans (LongCat [1, 32, 29640, 128] and Self-Forcing [1, 12, 37440, 128], qvg S1/B64 and
qvg-pro S4/B16 at their default K) and the Self-Forcing pipeline's read at a 21-frame window (7 chunks of 12 x
4,680 tokens, K = 64, as a PackedSequence). Each option of kernels/dequant.py `dequantize` (token block, warps,
one program per code plane; `persist-s<N>`: N persistent programs per SM over all groups, resolved per shape to
programs per group) is timed with triton's do_bench (L2 flushed before each call), the options interleaved over R
rounds (median of the rounds' medians), and checked bitwise against the default output. The copy bandwidth is
measured in the same run and nvidia-smi's clocks read once at its end (one kernel's time differed by up to 17%
between runs at one copy bandwidth: compare options within one run). `--workload`: one call of each option per
shape, in order, for Nsight Compute (no timing)."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser

VARIANTS = {
    "default": dict(),
    "b16w2": dict(block_n=16, num_warps=2),
    "b16w4": dict(block_n=16, num_warps=4),
    "b64w4": dict(block_n=64, num_warps=4),
    "b64w8": dict(block_n=64, num_warps=8),
    "planes-b32w4": dict(plane_split=True, block_n=32, num_warps=4),
    "planes-b64w4": dict(plane_split=True, block_n=64, num_warps=4),
    # persistent programs, `per_sm` of them per SM over all groups (progs per group resolved per shape by `resolve`)
    "persist-s4": dict(per_sm=4),
    "persist-s6": dict(per_sm=6),
    "persist-s8": dict(per_sm=8),
}


def resolve(opts: dict, groups: int, sms: int | None = None) -> dict:
    """An option's dequantize kwargs at a shape of `groups` (batch x heads) groups on `sms` SMs (None: this GPU's):
    per_sm -> progs per group."""
    if "per_sm" not in opts:
        return dict(opts)
    if sms is None:
        from qvg.kernels.common import sm_count
        sms = sm_count(torch.device("cuda"))
    return {**{k: v for k, v in opts.items() if k != "per_sm"}, "progs": max(1, opts["per_sm"] * sms // groups)}


def _smi() -> str:
    """SM / memory clocks (now and max), power limit and temperature, as nvidia-smi reports them ('' if absent)."""
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.limit,"
                               "temperature.gpu", "--format=csv"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def baseline_info(path: str) -> dict | None:
    """The --baseline file's path and the SHA-256 of its bytes (which version of kernels/dequant.py it was: compare
    with `git show COMMIT:kernels/dequant.py | sha256sum`); None without one."""
    if not path:
        return None
    import hashlib
    with open(path, "rb") as f:
        return {"path": path, "sha256": hashlib.sha256(f.read()).hexdigest()}


def _load_baseline(path: str, name: str = "dequantize"):
    """`name` (default `dequantize`) of another version of a kernels/ file, imported as a module of qvg.kernels (its
    relative imports resolve there)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"qvg.kernels._baseline_{name.strip('_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def shapes(longcat: bool = True):
    """(name, packed, bytes moved) per shape: packed read + BF16 written (longcat=False: without the LongCat span)."""
    import qvg
    from qvg.sequence import PackedSequence
    from .bench_kernels import LONGCAT_SPAN, clustered
    out = []
    for shape in (LONGCAT_SPAN, (1, 12, 37440, 128))[0 if longcat else 1:]:
        x = clustered(shape)
        for method in ("qvg", "qvg-pro"):
            p = qvg.compress(x, method)
            out.append((f"{method} {list(shape)}", p, p.nbytes + x.numel() * 2))
        del x
    for method in ("qvg", "qvg-pro"):
        x = clustered((1, 12, 4680, 128), spread=3.0)
        seq = PackedSequence.from_chunks([qvg.compress(x, method, bits=2, centroids=64)] * 7)
        out.append((f"{method} pipeline read 12 x 7 x 4680 K=64", seq,
                    sum(t.numel() * t.element_size() for t in seq.tensors.values()) + 12 * 7 * 4680 * 128 * 2))
    return out


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated option names (default: all)")
    ap.add_argument("--workload", action="store_true", help="one call per option and shape, for ncu")
    ap.add_argument("--baseline", default="", help="another version of kernels/dequant.py (e.g. from `git show "
                    "COMMIT:kernels/dequant.py`): its default grid is timed as option 'baseline'")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    bad = [n for n in names if n not in VARIANTS]
    if bad or args.rounds < 1:
        print(f"error: unknown option {bad[0]!r} (known: {', '.join(VARIANTS)})" if bad else
              "error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.baseline and not os.path.isfile(args.baseline):
        print(f"error: --baseline {args.baseline!r} is not a file", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: profile_dequant needs a CUDA GPU", file=sys.stderr)
        return 2
    from qvg.kernels.dequant import dequantize
    try:
        base = _load_baseline(args.baseline) if args.baseline else None
    except Exception as e:  # (a file that does not import, or has no dequantize)
        print(f"error: --baseline {args.baseline!r} gives no dequantize: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if base is not None:
        names = ["baseline", *names]
    from .bench_kernels import bench, ceilings, gpu_tag, result_header, write_result
    t0 = time.time()
    rows = []
    for label, p, nbytes in shapes():
        ref = dequantize(p)
        opts = {n: resolve(VARIANTS.get(n, {}), p.shape[0] * p.shape[1]) for n in names}
        fns = {n: (base if n == "baseline" else dequantize) for n in names}
        outs = {n: torch.empty_like(ref) for n in names}
        if args.workload:
            for n in names:
                fns[n](p, out=outs[n], **opts[n])
            torch.cuda.synchronize()
            continue
        times = {n: [] for n in names}
        exact = {}
        for n in names:
            outs[n].fill_(float("nan"))
            fns[n](p, out=outs[n], **opts[n])
            exact[n] = bool(torch.equal(outs[n], ref))
        for _ in range(args.rounds):
            for n in names:
                times[n].append(bench(lambda n=n: fns[n](p, out=outs[n], **opts[n]), warmup=10, rep=40))
        for n in names:
            ms = statistics.median(times[n])
            rows.append({"shape": label, "option": n, "kwargs": opts[n], "ms": ms, "rounds_ms": times[n],
                         "bytes_moved": nbytes, "TBps": nbytes / ms / 1e9, "bitwise_equal_default": exact[n]})
            print(f"  {label:44s} {n:20s} {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s equal {exact[n]}", flush=True)
        outs.clear()  # (frees the buffers before the next shape)
    if args.workload:
        return 0
    ceil = ceilings(False)
    for r in rows:
        r["fraction_of_copy_bw"] = r["TBps"] / ceil["copy_TBps"]
    res = {**result_header("profile_dequant", argv), "baseline_file": baseline_info(args.baseline),
           "nvidia_smi": _smi(), "ceilings": ceil, "rows": rows}
    write_result(res, args.out, f"profile-dequant-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
