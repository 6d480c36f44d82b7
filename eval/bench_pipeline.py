"""Real-size pipeline benchmark (issue 4, part 4; GPU): `python -m qvg.eval.bench_pipeline [--out DIR]
[--history 21,60] [--methods bf16,qvg,qvg-pro]`.

The full Wan2.1-T2V-1.3B transformer config with random weights, 480x832 (1560 tokens per latent frame), batch 1,
bf16. For each history length and method: the cache is filled with synthetic committed chunks (clustered K/V,
compressed by the method as the pipeline would), then one chunk runs (4 denoising steps + the clean re-run at
t = 0 + commit) with a rolling window of that history, timed with CUDA events (text encoder and VAE excluded:
the cache does not change them). KV bytes: `torch.cuda.memory_allocated` delta across the fill vs the cache's own
accounting. Writes pipeline-<gpu>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
LATENT_HW = (60, 104)  # 480 x 832 / 8


def _fill(cache, frames: int, heads: int, seed: int = 0):
    """Commit synthetic chunks until `frames` past frames are held (clustered, like real K/V)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = cache.chunk_tokens
    for _ in range(frames // cache.chunk_frames):
        for layer in range(cache.num_layers):
            centres = torch.randn(2, 1, heads, 64, 128, device="cuda", generator=g) * 3
            ids = torch.randint(0, 64, (t,), device="cuda", generator=g)
            kv = (centres[:, :, :, ids] + torch.randn(2, 1, heads, t, 128, device="cuda", generator=g)).bfloat16()
            cache.write(layer, kv[0], kv[1])
        cache.commit()


def chunk_runner(model, cache):
    """(forwards, commit): the 4 denoising steps + the clean re-run at t = 0 of one chunk at the cache's next
    frame, and its commit (fixed inputs: the cache's time and memory do not depend on the values)."""
    from qvg.pipelines.causal_wan import CrossKV
    from qvg.pipelines.self_forcing import flow_sigmas
    g = torch.Generator(device="cuda").manual_seed(1)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(1, 16, 3, *LATENT_HW, device="cuda", dtype=torch.bfloat16, generator=g)
    cross = CrossKV()

    def forwards():
        f0 = cache.frames
        for sigma in (*flow_sigmas(), 0.0):
            model(x, torch.full((1,), sigma * 1000, device="cuda"), text, frame_offset=f0, cache=cache, cross=cross)
    return forwards, cache.commit


def run(histories, methods) -> list[dict]:
    from qvg.cache import KVCache
    from qvg.pipelines.causal_wan import CausalWanTransformer
    torch.manual_seed(0)
    model = CausalWanTransformer(**WAN_1_3B).to("cuda", torch.bfloat16).eval()
    tpf = model.tokens_per_latent_frame(*LATENT_HW)
    rows = []
    for hist in histories:
        for method in methods:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            cache = KVCache(30, method, chunk_frames=3, tokens_per_frame=tpf, window_frames=hist)
            _fill(cache, hist, 12)
            torch.cuda.synchronize()
            delta = torch.cuda.memory_allocated() - before
            acc = cache.memory()
            forwards, commit = chunk_runner(model, cache)

            def chunk():
                forwards()
                commit()
            with torch.no_grad():
                chunk()  # warm-up (compiles kernels, fills the text K/V)
                times = []
                for _ in range(3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.reset_peak_memory_stats()
                    a.record()
                    chunk()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b))
            row = {"history_frames": hist, "method": method, "chunk_ms": sorted(times)[1], "chunk_ms_all": times,
                   "kv_bytes_allocator_delta": delta, "kv_bytes_accounted": acc["total"],
                   "accounting_error": (acc["total"] - delta) / delta, "kv_components": acc,
                   "peak_bytes_during_chunk": torch.cuda.max_memory_allocated()}
            print(f"history {hist} {method}: chunk {row['chunk_ms']:.1f} ms; KV {delta / 2**20:.1f} MiB allocator vs "
                  f"{acc['total'] / 2**20:.1f} accounted ({100 * row['accounting_error']:+.2f}%), "
                  f"ratio {acc['compression_ratio']:.2f}x", flush=True)
            rows.append(row)
            cache = forwards = commit = chunk = None  # (the closures hold the cache)
            torch.cuda.empty_cache()
        base = next(r for r in rows if r["history_frames"] == hist and r["method"] == "bf16")
        for r in rows:
            if r["history_frames"] == hist:
                r["overhead_vs_bf16"] = r["chunk_ms"] / base["chunk_ms"] - 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--history", default="21,60")
    ap.add_argument("--methods", default="bf16,qvg,qvg-pro")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_pipeline: needs a CUDA GPU")
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": os.environ.get("QVG_COMMIT", "unknown"), "torch": torch.__version__,
        "command": "python -m qvg.eval.bench_pipeline " + " ".join(argv or []),
        "rows": run([int(h) for h in args.history.split(",")], args.methods.split(","))}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pipeline-" + res["device"].split()[1].lower() + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
