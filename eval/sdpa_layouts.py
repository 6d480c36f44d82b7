"""Does the K/V memory layout change torch SDPA's speed at Self-Forcing's shapes? (GPU):
`python -m qvg.eval.sdpa_layouts [--out DIR] [--keys 37440,98280] [--rounds 7]`.

The BF16 cache attends a view of its buffer, [B, H, cap, D] cut to the tokens held (the head stride is cap * D,
not n * D), while the packed caches attend a window their decode wrote contiguously. A BF16 baseline held back by
its layout would flatter the packed caches' overhead (eval/results/pipeline-h100.md). This times one self-attention
call of the Wan-1.3B model (q [1, 12, 4680, 128] as its processor makes it: a transposed [B, N, H, D] projection)
with torch's default SDPA backend over K / V in four layouts: contiguous [B, H, n, D]; the BF16 cache's view (cap
as `qvg.cache._grown` sizes it, filling the allocator's 2 MiB granule); a view of a buffer with one more chunk of
room (a cache sized for growth); [B, n, H, D] transposed (upstream Self-Forcing's layout). Median of `rounds`
rounds of 20 calls each, layouts interleaved. Writes sdpa-layouts-<gpu>.json.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser
from .bench_kernels import gpu_tag, result_header, write_result


def layouts(n: int, h: int = 12, d: int = 128, chunk: int = 4680) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """K / V pairs of n tokens [1, h, n, d] (BF16, CUDA) in each layout, same values."""
    from qvg.cache import _grown
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cache_cap = _grown(None, 0, n, k).shape[2]  # (what the BF16 cache allocates for n tokens)
    return {"contiguous": (k, v),
            "cache view": tuple(_in_buffer(t, cache_cap) for t in (k, v)),
            "view, one chunk of room": tuple(_in_buffer(t, n + chunk) for t in (k, v)),
            "[B, n, H, D] transposed": tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))}


def _in_buffer(t: torch.Tensor, cap: int) -> torch.Tensor:
    """t [B, H, n, D] copied into the first n tokens of a [B, H, cap, D] buffer, as a view."""
    buf = torch.empty(*t.shape[:2], cap, t.shape[3], device=t.device, dtype=t.dtype)
    buf[:, :, :t.shape[2]] = t
    return buf[:, :, :t.shape[2]]


def run(keys: list[int], rounds: int = 7, calls: int = 20) -> list[dict]:
    from .bench_pipeline import cuda_ms
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for n in keys:
        q = torch.randn(1, 4680, 12, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        pairs = layouts(n)
        ref = sdpa(q, *pairs["contiguous"])
        times = {name: [] for name in pairs}
        for _ in range(rounds):
            for name, (k, v) in pairs.items():
                sdpa(q, k, v)
                times[name].append(cuda_ms(lambda: [sdpa(q, k, v) for _ in range(calls)]) / calls)
        for name, (k, v) in pairs.items():
            ms = statistics.median(times[name])
            row = {"keys": n, "layout": name, "stride": list(k.stride()), "ms": ms, "ms_rounds": times[name],
                   "vs_contiguous": ms / statistics.median(times["contiguous"]) - 1,
                   "max_abs_diff_vs_contiguous": (sdpa(q, k, v) - ref).abs().max().item()}
            print(f"keys {n} {name}: {ms:.4f} ms ({row['vs_contiguous']:+.2%}), stride {row['stride']}", flush=True)
            rows.append(row)
        del pairs
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m qvg.eval.sdpa_layouts", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--keys", default="37440,98280", help="key counts (21 frames of history + a chunk: 37440)")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sdpa_layouts: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        keys = [int(x) for x in a.keys.split(",")]
    except ValueError:
        print(f"sdpa_layouts: --keys must be integers separated by commas, got {a.keys!r}", file=sys.stderr)
        return 2
    t0 = time.time()
    res = {**result_header("sdpa_layouts", argv), "backend": "torch default (cuDNN on Hopper)",
           "query": "[1, 12, 4680, 128] transposed from [1, 4680, 12, 128]", "rows": run(keys, a.rounds)}
    write_result(res, a.out, f"sdpa-layouts-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
