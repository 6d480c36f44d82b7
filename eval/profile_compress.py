"""Where compress's time goes, on the GPU: `python -m qvg.eval.profile_compress [--out DIR] [--sweep]`.

For qvg (S1/B64) and qvg-pro (S4/B16) at the LongCat span [1, 32, 29640, 128], warm-started, 2 iterations:
end-to-end time, a torch.profiler table of every CUDA kernel (time per compress call, launches), and with --sweep
the tile configurations of each kernel (assign, update, residual, pack). Writes profile-compress-<gpu>.json.
--variants instead times the kernel variants against the current ones (eval/profile_compress_variants.py) and
writes profile-compress-variants-<gpu>.json; with --quick and no GPU it runs under TRITON_INTERPRET=1 on the CPU.
"""
from __future__ import annotations

import datetime
import json
import os
import platform

import torch

from qvg.help_format import OneLineParser
from qvg.revision import code_commit

from .bench_kernels import bench, clustered, warm_start


def _profile(fn, calls: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            rows.append({"kernel": e.key[:90], "us_per_call": t / calls, "launches_per_call": e.count / calls})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows


def _host_profile(fn, calls: int = 3) -> list[dict]:
    """Host (Python) time of fn: the functions with the largest cumulative time (cProfile), per call."""
    import cProfile
    import pstats
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = [{"function": f"{f[0].split('/')[-1]}:{f[1]}:{f[2]}", "cum_ms_per_call": v[3] * 1e3 / calls,
             "self_ms_per_call": v[2] * 1e3 / calls, "calls": v[1] / calls} for f, v in st.stats.items()]
    rows.sort(key=lambda r: -r["cum_ms_per_call"])
    return rows[:25]


def _sweep(fn_of_cfg, cfgs) -> dict:
    out = {}
    for name, kw in cfgs:
        try:
            out[name] = bench(lambda: fn_of_cfg(**kw), warmup=5, rep=40)
        except Exception as e:  # a tile config that does not fit (shared memory, registers) is reported, not fatal
            out[name] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def run(shape, sweep: bool) -> list[dict]:
    from qvg.compression.registry import token_spec
    from qvg.kernels import kmeans as kk
    from qvg.kernels.compress import compress_prq, residual_bf16
    from qvg.kernels.quantize import quantize_packed
    x0 = clustered(shape, seed=1)
    x1 = (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    out = []
    for method in ("qvg", "qvg-pro"):
        prev, o, warm = warm_start(x0, method, shape)
        fn = lambda: compress_prq(x1, o, warm, 2)  # noqa: E731
        row = {"method": method, "shape": list(shape), "ms": bench(fn, warmup=5, rep=30), "kernels": _profile(fn),
               "host": _host_profile(fn)}
        print(f"{method}: {row['ms']:.3f} ms; kernels {sum(k['us_per_call'] for k in row['kernels']) / 1e3:.3f} ms",
              flush=True)
        for h in row["host"][:12]:
            print(f"   host {h['cum_ms_per_call']:8.3f} ms cum {h['self_ms_per_call']:8.3f} self x{h['calls']:.0f} "
                  f"{h['function']}", flush=True)
        for k in row["kernels"][:14]:
            print(f"   {k['us_per_call']:8.1f} us  x{k['launches_per_call']:.0f}  {k['kernel']}", flush=True)
        if sweep:
            xg = x1.view(-1, shape[2], shape[3])
            c0 = warm[0]
            ids0, _ = kk.assign(xg, c0)
            row["assign"] = _sweep(lambda **kw: kk.assign(xg, c0, True, **kw), [
                (f"{'packed' if p else 'argmin'} {bn}x{bk}w{nw}s{ns}",
                 dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, packed=p))
                for p in (True, False) for bn, bk, nw, ns in ((128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 2),
                                                              (64, 64, 4, 2), (128, 128, 4, 2), (64, 128, 4, 2))])
            row["update"] = _sweep(lambda **kw: kk.update_with_counts(xg, ids0, c0, **kw), [
                ("sort", dict(method="sort"))] + [
                (f"onehot k{bk} n{bn} c{ch} w{nw} s{ns}",
                 dict(method="onehot", block_k=bk, block_n=bn, chunk=ch, num_warps=nw, num_stages=ns))
                for bk, bn, ch, nw, ns in ((128, 32, 4096, 4, 3), (128, 16, 4096, 4, 3), (128, 32, 4096, 2, 3),
                                           (128, 32, 2048, 4, 3), (128, 32, 8192, 4, 3), (64, 32, 4096, 4, 3),
                                           (64, 32, 4096, 2, 3), (256, 16, 4096, 8, 3), (128, 32, 4096, 4, 4),
                                           (128, 16, 4096, 2, 4))])
            ids_t = prev.tensors["ids"].view(o["stages"], -1, shape[2])
            cents_t = prev.tensors["centroids"].view(o["stages"], -1, o["centroids"], shape[3])
            if o["stages"] > 1:
                row["residual"] = _sweep(lambda **kw: residual_bf16(xg, ids_t, cents_t, o["stages"] - 1, **kw),
                                         [(f"bn{bn}", dict(block_n=bn)) for bn in (32, 64, 128)])
            row["pack"] = _sweep(lambda **kw: quantize_packed(x1, token_spec(o), prev.tensors["ids"],
                                                              prev.tensors["centroids"], **kw),
                                 [(f"bn{bn}w{nw}", dict(block_n=bn, num_warps=nw))
                                  for bn, nw in ((16, 2), (8, 2), (16, 4), (8, 1), (32, 4))])
            for part in ("assign", "update", "residual", "pack"):
                if part in row:
                    print(f"  {part}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in row[part].items()), flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--sweep", action="store_true", help="also time the tile configurations of each kernel")
    ap.add_argument("--quick", action="store_true", help="a small shape (smoke test)")
    ap.add_argument("--variants", action="store_true",
                    help="time the kernel variants (assign, update, reseed, pack, whole compress) against the current")
    ap.add_argument("--shape", help="with --variants: B,H,N,D instead of the LongCat span (e.g. 1,12,4680,128: a "
                    "Self-Forcing chunk as the cache commits it)")
    ap.add_argument("--centroids", type=int, help="with --variants: K instead of the method's default")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not (args.variants and args.quick):
        raise SystemExit("profile_compress: needs a CUDA GPU (without one: --variants --quick, interpreted)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before qvg.kernels is imported
        from qvg.kernels.common import INTERPRET
        if not INTERPRET:
            raise SystemExit("profile_compress: qvg.kernels was imported without TRITON_INTERPRET=1")
    import triton
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": code_commit(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "command": "python -m qvg.eval.profile_compress " + " ".join(argv if argv is not None else
                                                                      __import__("sys").argv[1:])}
    if args.variants:
        from .profile_compress_variants import run_variants
        shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else None
        res.update(run_variants(args.quick, shape, args.centroids))
    else:
        res["rows"] = run((1, 32, 29640, 128) if not args.quick else (1, 4, 4680, 128), args.sweep)
    os.makedirs(args.out, exist_ok=True)
    gpu = res["device"].split()[1].lower() if cuda else "cpu"
    tag = ("variants-" if args.variants else "") + gpu + ("-quick" if args.quick and args.variants else "")
    if args.variants and args.shape:
        tag += "-" + args.shape.replace(",", "x") + (f"-k{args.centroids}" if args.centroids else "")
    name = f"profile-compress-{tag}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
