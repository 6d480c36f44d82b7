"""Where a real-size chunk's time goes, per cache method (GPU): `python -m qvg.eval.profile_pipeline [--out DIR]
[--history 21,60] [--methods bf16,qvg]`.

Same set-up as bench_pipeline (Wan2.1-1.3B config, random weights, 480x832, the cache filled with synthetic
committed chunks, a rolling window of that history). For one chunk: wall time (right behind another chunk, as
bench_pipeline's steady_ms; layers committed inside the clean re-run, as the pipeline does), GPU busy time (sum of
kernel times; wall - busy: the time the GPU waited for the host, a lower bound once side streams overlap the
main one), the forwards and the whole commit timed apart (the commit then runs after the forwards, its side-stream
work included), the CUDA kernels by total time, and the host functions by cumulative time (cProfile). Writes
profile-pipeline-<gpu>.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from qvg.help_format import OneLineParser
from .bench_kernels import gpu_tag, result_header
from .bench_pipeline import _fill, cuda_ms, method_runner, new_cache, parse_methods, steady_ms, wan_model
from .profile_compress import _host_profile, _profile


def sdpa_backends(keys_list=(37440, 98280)) -> list[dict]:
    """ms of one self-attention call (12 heads x 128, 4680 queries) per torch SDPA backend: which one the BF16
    cache gets by default, and what the packed path must match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    out = []
    for keys in keys_list:
        q = torch.randn(1, 12, 4680, 128, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, 1, 12, keys, 128, device="cuda", dtype=torch.bfloat16)
        row = {"keys": keys, "default": sorted(cuda_ms(lambda: sdpa(q, k, v)) for _ in range(5))[2]}
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    sdpa(q, k, v)
                    row[name] = sorted(cuda_ms(lambda: sdpa(q, k, v)) for _ in range(5))[2]
            except RuntimeError as e:
                row[name] = f"unavailable: {str(e).splitlines()[0][:80]}"
        print("sdpa", row, flush=True)
        out.append(row)
    return out


def run(histories, methods, options) -> list[dict]:
    model = wan_model()
    rows = []
    for hist in histories:
        for method in methods:
            cache = new_cache(model, method, hist, options)
            _fill(cache, hist, 12)
            chunk, _ = method_runner(model, cache, method)
            _, plain = method_runner(model, cache, method, commit_layers=False)  # the forwards apart from the commit
            with torch.no_grad():
                chunk()
                wall = sorted(steady_ms(chunk) for _ in range(3))[1]
                fwd = sorted(cuda_ms(plain) for _ in range(3))[1]  # (re-writes the current chunk: same work)
                commit_ms = cuda_ms(lambda: (cache.commit(), cache.wait_side_streams()))
                kernels = _profile(chunk, calls=2)
                host = _host_profile(chunk, calls=2)
            busy = sum(r["us_per_call"] for r in kernels) / 1e3
            row = {"history_frames": hist, "method": method, "options": dict(cache.options), "chunk_ms": wall,
                   "forwards_ms": fwd, "commit_ms": commit_ms, "gpu_busy_ms": busy, "gpu_idle_ms": wall - busy,
                   "kernels": kernels[:25], "host": host}
            print(f"history {hist} {method}: chunk {wall:.1f} ms (forwards {fwd:.1f}, commit {commit_ms:.1f}); GPU "
                  f"busy {busy:.1f} ms", flush=True)
            for r in kernels[:12]:
                print(f"   {r['us_per_call'] / 1e3:8.2f} ms  x{r['launches_per_call']:6.0f}  {r['kernel']}")
            for r in host[:12]:
                print(f"   host {r['cum_ms_per_call']:8.2f} ms cum {r['self_ms_per_call']:8.2f} self "
                      f"x{r['calls']:6.0f}  {r['function']}")
            rows.append(row)
            cache = plain = chunk = None  # (the closures hold the cache)
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--history", default="21,60")
    ap.add_argument("--methods", default="bf16,qvg")
    ap.add_argument("--options", default='{"centroids": 256}', help="JSON cache options for the compressed methods "
                    "(default K=256, which the profiles committed before 2026-11-30 ran with '{}'; bench_pipeline "
                    "and qvg-generate use 64 at this chunk size)")
    args = ap.parse_args(argv)
    try:
        parse_methods(args.methods, args.options)
    except ValueError as e:
        print(f"profile_pipeline: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        raise SystemExit("profile_pipeline: needs a CUDA GPU")
    res = {**result_header("profile_pipeline", argv), "sdpa_ms": sdpa_backends(),
        "rows": run([int(h) for h in args.history.split(",")], args.methods.split(","), json.loads(args.options))}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile-pipeline-{gpu_tag(res['device'])}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
