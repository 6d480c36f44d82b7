"""Dequant kernel options timed side by side on the GPU: `python -m qvg.eval.profile_dequant [--out DIR]
[--rounds R] [--only NAMES] [--workload] [--baseline FILE]` -> profile-dequant-<gpu>.json.

Shapes: the benchmark's spans (LongCat [1, 32, 29640, 128] and Self-Forcing [1, 12, 37440, 128], qvg S1/B64 and
qvg-pro S4/B16 at their default K) and the Self-Forcing pipeline's read at a 21-frame window (7 chunks of 12 x
4,680 tokens, K = 64, as a PackedSequence). Each option of kernels/dequant.py `dequantize` (token block, warps,
plane split, cache hints, whole-row tiles) is timed with triton's do_bench (L2 flushed before each call), the
options interleaved over R rounds (median of the rounds' medians), and checked bitwise against the default
output. The copy bandwidth is measured in the same run. `--workload`: one call of each option per shape, in
order, for Nsight Compute (no timing)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

VARIANTS = {
    "default": dict(),
    "b16w2": dict(block_n=16, num_warps=2),
    "hints": dict(hints=True),
    "hints-b16w2": dict(block_n=16, num_warps=2, hints=True),
    "row3d-b32w4": dict(row3d=True, block_n=32, num_warps=4),
    "row3d-hints-b32w4": dict(row3d=True, block_n=32, num_warps=4, hints=True),
    "split2-b32w4": dict(plane_split=2, block_n=32, num_warps=4),
    "split2-b64w4": dict(plane_split=2, block_n=64, num_warps=4),
    "split4-b32w4": dict(plane_split=4, block_n=32, num_warps=4),
    "split4-b64w4": dict(plane_split=4, block_n=64, num_warps=4),
    "split4-b128w8": dict(plane_split=4, block_n=128, num_warps=8),
    "reg48": dict(maxnreg=48),
    "reg56": dict(maxnreg=56),
    "b64w8-reg48": dict(block_n=64, num_warps=8, maxnreg=48),
    "b16w2-reg48": dict(block_n=16, num_warps=2, maxnreg=48),
}
# persistent programs on contiguous runs of blocks: PER_SM programs per SM in all (progs per group = that / groups)
CONTIG = {f"contig{per_sm}-b{bn}w{nw}{'-hints' if h else ''}{'-split2' if sp > 1 else ''}{'-row3d' if r3 else ''}":
          dict(per_sm=per_sm, block_n=bn, num_warps=nw, hints=h, plane_split=sp, row3d=r3)
          for per_sm, bn, nw, h, sp, r3 in (
              (1, 64, 16, True, 1, False), (1, 128, 16, True, 1, False), (1, 64, 8, True, 1, False),
              (2, 64, 8, True, 1, False), (2, 32, 8, True, 1, False), (4, 32, 4, True, 1, False),
              (4, 64, 4, True, 1, False), (8, 32, 4, True, 1, False), (2, 64, 8, False, 1, False),
              (2, 64, 8, True, 2, False), (4, 32, 4, True, 2, False), (2, 64, 8, True, 1, True),
              (4, 32, 4, True, 1, True))}


def _load_baseline(path: str):
    """`dequantize` of another version of kernels/dequant.py, imported as a module of qvg.kernels (its relative
    imports resolve there)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("qvg.kernels._baseline_dequant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dequantize


def kwargs(name: str, groups: int) -> dict:
    """dequantize's keyword arguments for option `name` at `groups` heads (contig options size progs by SMs)."""
    if name in VARIANTS:
        return VARIANTS[name]
    from qvg.kernels.common import sm_count
    o = dict(CONTIG[name])
    planes = o["plane_split"]
    o["progs"] = max(1, o.pop("per_sm") * sm_count(torch.device("cuda")) // (groups * planes))
    return {**o, "contiguous": True}


def shapes():
    """(name, packed, bytes moved) per shape: packed read + BF16 written."""
    import qvg
    from qvg.sequence import PackedSequence
    from .bench_kernels import clustered
    out = []
    for shape in ((1, 32, 29640, 128), (1, 12, 37440, 128)):
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated option names (default: all)")
    ap.add_argument("--workload", action="store_true", help="one call per option and shape, for ncu")
    ap.add_argument("--baseline", default="", help="another version of kernels/dequant.py (e.g. from `git show "
                    "COMMIT:kernels/dequant.py`): its default grid is timed as option 'baseline'")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [*VARIANTS, *CONTIG]
    bad = [n for n in names if n not in VARIANTS and n not in CONTIG]
    if bad or args.rounds < 1:
        print(f"error: unknown option {bad[0]!r} (known: {', '.join([*VARIANTS, *CONTIG])})" if bad else
              "error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.baseline and not os.path.isfile(args.baseline):
        print(f"error: --baseline {args.baseline!r} is not a file", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: profile_dequant needs a CUDA GPU", file=sys.stderr)
        return 2
    from qvg.kernels.dequant import dequantize
    base = _load_baseline(args.baseline) if args.baseline else None
    if base is not None:
        names = ["baseline", *names]
    from .bench_kernels import bench, ceilings, gpu_tag, write_result, _commit
    from .provenance import command_line
    t0 = time.time()
    rows = []
    for label, p, nbytes in shapes():
        ref = dequantize(p)
        opts = {n: kwargs(n, p.shape[0] * p.shape[1]) for n in names if n != "baseline"}
        fns = {n: (base if n == "baseline" else dequantize) for n in names}
        opts.setdefault("baseline", {})
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
        del outs
    if args.workload:
        return 0
    ceil = ceilings(False)
    for r in rows:
        r["fraction_of_copy_bw"] = r["TBps"] / ceil["copy_TBps"]
    import datetime
    import platform
    import triton
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": _commit(), "command": command_line("python -m qvg.eval.profile_dequant", argv), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "ceilings": ceil, "rows": rows}
    write_result(res, args.out, f"profile-dequant-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
