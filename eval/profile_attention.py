"""The on-chip packed-cache attention kernel's tile configs timed side by side on the GPU:
`python -m qvg.eval.profile_attention [--out DIR] [--rounds R] [--keys N[,N...]] [--formats ...]
[--only BM,BN,W,S[,SPLITS];...] [--centroids K] [--baseline FILE]` -> profile-attention-<gpu>.json.

The issue-3 shape: 12 heads x 128, 4,680 queries (one 3-frame Self-Forcing chunk) over a packed history of N keys (7
chunks of 4,680 tokens at N = 32,760, made as eval/bench_kernels.py makes it: `qvg.compress` defaults, K = 256, or
--centroids K: the KV cache picks K = 64 for a 4,680-token chunk, `qvg.cache.default_centroids`). Each
tile config (with a 5th value SPLITS: the grid schedule with that many key splits; without: packed_attention's default,
the stream-K schedule) of `kernels/attention.py` `packed_attention` is timed
with triton's do_bench, the configs interleaved over R rounds (median of the rounds' medians), against torch's SDPA
flash backend on the materialized BF16 cache in the same run; each output's relative error against SDPA on the
dequantized cache is recorded, and on 512 queries against FP32 attention over the exactly (unrounded) decoded history.
Formats: qvg (INT2 S1/B64), qvg-pro (INT2 S4/B16), bf16 (no history: the whole sequence as the BF16 tail, the kernels'
flash part alone). --baseline: another version of kernels/attention_planes.py (e.g. from `git show
COMMIT:kernels/attention_planes.py`), whose kernels are timed through the same `packed_attention` beside each config
(runs named "base:<config>"), interleaved with it. A baseline from before the stream-K kernel (f9adb0c) has only
the grid kernel: its "base:" runs of configs without SPLITS then run this tree's stream-K kernel, so they are no
baseline. One from before d45552c (no whole waves, e.g. 147e7ab, the reference for the stream-K loop's code-generation
gain) is launched without the FULL argument."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser

DEFAULT = "256,64,8,2;256,64,8,2,1;128,64,8,2;128,64,8,3;256,32,8,2"


FORMATS = ("qvg", "qvg-pro", "bf16")


def parse_only(text: str) -> list[dict]:
    """'BM,BN,W,S[,SPLITS];...' -> packed_attention keyword dicts (ValueError names a bad item)."""
    out = []
    for item in filter(None, text.split(";")):
        try:
            vals = [int(x) for x in item.split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (4, 5) or min(vals) < 1:
            raise ValueError(f"--only item {item!r} is not BLOCK_M,BLOCK_N,WARPS,STAGES[,SPLITS] of positive integers")
        bm, bn, w, s, *sp = vals
        out.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, **({"splits": sp[0]} if sp else {})))
    if not out:
        raise ValueError("--only names no tile config")
    return out


class Adapted:
    """A baseline file's kernel launched with the arguments packed_attention gives the current one (`current`): every
    argument goes by name, and those the baseline does not take are dropped: FULL before d45552c, the RoPE tables'
    before 79551df (in "base:" runs, which ask for neither waves nor rope, they hold their no-op values). Baselines
    from 79551df to e957e25 take the rotation as frame0_ptr, H_OFF and W_OFF (since d66b78f: rpos_ptr): they get
    the no-rope values (these runs ask for no rope). Launch options (num_warps, ...) pass through."""

    def __init__(self, kernel, current):
        self.kernel, self.takes, self.current = kernel, set(kernel.arg_names), list(current.arg_names)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            named = {**dict(zip(self.current, args)), **kw}
            if "frame0_ptr" in self.takes and "rpos_ptr" in named:  # (the rotation's arguments before d66b78f)
                named.update(frame0_ptr=named["rpos_ptr"], H_OFF=0, W_OFF=0)
            return launch(**{k: v for k, v in named.items() if k in self.takes or k not in self.current})
        return run


def check_args(args) -> str | None:
    """The first problem with the command line, or None (all checked before any GPU work)."""
    try:
        parse_only(args.only)
    except ValueError as e:
        return str(e)
    if args.rounds < 1:
        return "--rounds must be >= 1"
    if args.centroids is not None and not 1 <= args.centroids <= 4680:
        return f"--centroids must be in 1..4680 (tokens per chunk), got {args.centroids}"
    bad = [f for f in args.formats.split(",") if f not in FORMATS]
    if bad or not args.formats:
        return f"unknown format {bad[0] if bad else ''!r} (known: {', '.join(FORMATS)})"
    keys = args.keys.split(",")
    if not all(k.isdigit() and int(k) >= 4680 and int(k) % 4680 == 0 for k in keys):
        return f"--keys must be multiples of the 4,680-token chunk, got {args.keys!r}"
    return None


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default="32760")
    ap.add_argument("--formats", default="qvg,qvg-pro,bf16")
    ap.add_argument("--only", default=DEFAULT, help="BLOCK_M,BLOCK_N,WARPS,STAGES[,SPLITS] items, ';'-separated")
    ap.add_argument("--centroids", type=int, default=None, help="k-means centroids per chunk (default: 256)")
    ap.add_argument("--tag", default="", help="file name tag: profile-attention-<gpu>[.<tag>].json")
    ap.add_argument("--baseline", default="", help="another version of kernels/attention_planes.py, timed beside")
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem is None and args.baseline and not os.path.isfile(args.baseline):
        problem = f"--baseline {args.baseline!r} is not a file"
    if problem is None and not torch.cuda.is_available():
        problem = "profile_attention needs a CUDA GPU"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import qvg.kernels.attention as attention_module
    from qvg.attention import attend_reference
    from qvg.kernels.dequant import dequantize
    from .bench_kernels import packed_history
    from .profile_dequant import _load_baseline, baseline_info
    from .provenance import command_line, meta

    base_kernels = {}  # the baseline file's kernels, swapped in for "base:" runs
    try:
        if args.baseline:
            planes = _load_baseline(args.baseline, "_attn_planes_kernel")
            module = planes.fn.__globals__  # (the file, loaded once)
            names = ["_attn_planes_kernel"]
            if "_attn_stream_kernel" in module:  # (else before stream-K: "base:" runs without SPLITS run ours)
                names += ["_attn_stream_kernel", "_merge_stream"]
            base_kernels = {n: Adapted(module[n], getattr(attention_module, n)) for n in names}
    except Exception as e:  # (a file that does not import, or has no kernel)
        print(f"error: --baseline {args.baseline!r} gives no _attn_planes_kernel: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    t0 = time.time()
    items = parse_only(args.only)
    if base_kernels:
        items = [x for cfg in items for x in (cfg, {**cfg, "base": True})]
    h, m, chunk = 12, 4680, 4680
    q = torch.randn(1, h, m, 128, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    res = {"meta": meta(command_line("python -m qvg.eval.profile_attention", argv), "cuda",
                        triton=__import__("triton").__version__), "baseline_file": baseline_info(args.baseline),
           "rows": []}

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    for n_keys in (int(x) for x in args.keys.split(",")):
        flops = 4 * m * n_keys * 128 * h
        for fmt in args.formats.split(","):
            if fmt == "bf16":
                kd = torch.randn(1, h, n_keys, 128, device="cuda", dtype=torch.bfloat16)
                vd = torch.randn_like(kd)
                run = lambda cfg: attention_module.packed_attention(q, None, None, kd, vd, **cfg)  # noqa: E731
            else:
                K, V = packed_history(h, n_keys, chunk, fmt, args.centroids)
                kd, vd = dequantize(K), dequantize(V)
                run = lambda cfg: attention_module.packed_attention(q, K, V, **cfg)  # noqa: E731

            def call(cfg, run=run):  # (a "base" config runs the --baseline file's kernel)
                cfg = dict(cfg)
                if not cfg.pop("base", False):
                    return run(cfg)
                own = {name: getattr(attention_module, name) for name in base_kernels}
                try:
                    for name, kernel in base_kernels.items():
                        setattr(attention_module, name, kernel)
                    return run(cfg)
                finally:
                    for name, kernel in own.items():
                        setattr(attention_module, name, kernel)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = sdpa(q, kd, vd)
                t_sdpa = [bench(lambda: sdpa(q, kd, vd))]
            exact = None  # FP32 attention over the history decoded exactly (unrounded), on 512 queries
            if fmt != "bf16":
                exact = attend_reference(q[:, :, :512], K, V, exact=True).float()
            runs = {}
            for cfg in items:
                key = ("base:" if cfg.get("base") else "") + \
                    f"{cfg['block_m']},{cfg['block_n']},{cfg['num_warps']},{cfg['num_stages']}" + (
                    f",{cfg['splits']}" if "splits" in cfg else "")
                try:
                    out = call(cfg)
                    torch.cuda.synchronize()
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    runs[key] = {"config": cfg, "rel_err_vs_sdpa": err, "ms_rounds": []}
                    if exact is not None:
                        o = out[:, :, :512].float()
                        runs[key]["rel_err_vs_exact_decode_512_queries"] = float((o - exact).norm() / exact.norm())
                except Exception as e:  # a config that does not compile (e.g. out of shared memory)
                    print(f"  {fmt} {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            for _ in range(args.rounds):
                for key, r in runs.items():
                    r["ms_rounds"].append(bench(lambda: call(r["config"])))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_sdpa.append(bench(lambda: sdpa(q, kd, vd)))
            sdpa_ms = statistics.median(t_sdpa)
            for key, r in runs.items():
                r["ms"] = statistics.median(r["ms_rounds"])
                r["TFLOPs"] = flops / r["ms"] / 1e9
                r["vs_sdpa_flash_throughput"] = sdpa_ms / r["ms"]
            best = min(runs, key=lambda k: runs[k]["ms"]) if runs else None
            row = {"keys": n_keys, "queries": m, "heads": h, "format": fmt, "flops": flops,
                   "centroids": None if fmt == "bf16" else K.tensors["centroids"].shape[-2],
                   "sdpa_flash_ms": sdpa_ms, "sdpa_flash_TFLOPs": flops / sdpa_ms / 1e9, "runs": runs, "best": best}
            res["rows"].append(row)
            print(f"{fmt} {n_keys} keys: SDPA-flash {sdpa_ms:.3f} ms", flush=True)
            for key, r in sorted(runs.items(), key=lambda kv: kv[1]["ms"]):
                ex = r.get("rel_err_vs_exact_decode_512_queries")
                print(f"  {key:16s} {r['ms']:.3f} ms  {r['TFLOPs']:.0f} TFLOP/s  {r['vs_sdpa_flash_throughput']:.0%} "
                      f"of SDPA  err {r['rel_err_vs_sdpa']:.1e}" + (f" (vs exact decode {ex:.1e})" if ex else ""),
                      flush=True)
            del kd, vd
            torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    gpu = torch.cuda.get_device_name().split()[1].lower() if len(torch.cuda.get_device_name().split()) > 1 else "gpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile-attention-{gpu}{'.' + args.tag if args.tag else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
