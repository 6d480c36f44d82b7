"""Can the history decode hide behind a layer's compute? (GPU): `python -m qvg.eval.bench_overlap [--out DIR]`.

The packed cache's read path decodes each layer's history into a BF16 window (the dequant kernel, memory-bound)
before cuDNN's SDPA; at 21 latent frames of Self-Forcing history that decode is ~2.5% of a chunk
(eval/results/pipeline-h100.md). This measures, at Self-Forcing's shapes (12 heads x 128, 4680 queries, 21 frames
= 32,760 history tokens, qvg INT2 S1/B64 K=64), a stand-in for one layer's compute on the main stream (QKV and
output projections, SDPA over history + chunk, the two FFN matmuls) against the next layer's K + V decode on a
side stream: each alone, both one after the other on one stream, and both concurrently. hidden = the fraction of
the decode's own time that running it concurrently saves. Writes overlap-<gpu>.json.
"""
from __future__ import annotations

import os
import sys

import torch

from qvg.help_format import OneLineParser
from .bench_kernels import bench, clustered
from .bench_pipeline import on_stream
from .provenance import command_line, emit_json, meta


VARIANTS = [  # (programs per head, 0 = one per block; token block; warps; layer on a high-priority stream)
    (0, 32, 4, False), (0, 32, 4, True), (1, 32, 4, False), (2, 32, 4, False), (4, 32, 4, False),
    (8, 32, 4, False), (2, 64, 8, False), (4, 64, 8, False), (8, 64, 8, False), (2, 32, 4, True),
    (4, 32, 4, True), (4, 64, 8, True)]


def run(frames: int = 21, reps: int = 20, variants: bool = False) -> dict:
    import qvg
    from qvg.kernels.dequant import dequantize
    from qvg.sequence import PackedSequence
    h, d, m, tpf, dim, ffn = 12, 128, 4680, 1560, 1536, 8960
    n = frames * tpf
    chunks = [clustered((1, h, m, d), seed=10 + i) for i in range(frames // 3)]
    kh = PackedSequence.from_chunks([qvg.compress(x, "qvg", centroids=64) for x in chunks])
    vh = PackedSequence.from_chunks([qvg.compress(x, "qvg", centroids=64, seed=1) for x in chunks])
    ks, vs = (torch.empty(1, h, n + m, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
    w_qkv, w_o = torch.randn(dim, 3 * dim, device="cuda", dtype=torch.bfloat16), torch.randn(dim, dim, device="cuda",
                                                                                          dtype=torch.bfloat16)
    w1, w2 = (torch.randn(dim, ffn, device="cuda", dtype=torch.bfloat16) * 0.02,
              torch.randn(ffn, dim, device="cuda", dtype=torch.bfloat16) * 0.02)
    k_all, v_all = (torch.randn(1, h, n + m, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    side = torch.cuda.Stream()

    def layer():
        q = (x @ w_qkv)[:, :dim].view(m, h, d).transpose(0, 1)[None]
        a = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all)
        y = a[0].transpose(0, 1).reshape(m, dim) @ w_o
        return torch.nn.functional.gelu(y @ w1) @ w2

    def decode(progs=0, block_n=32, warps=4):
        dequantize(kh, out=ks, rows=(0, n), progs=progs, block_n=block_n, num_warps=warps)
        dequantize(vh, out=vs, rows=(0, n), progs=progs, block_n=block_n, num_warps=warps)

    def serial():
        for _ in range(reps):
            decode()
            layer()

    def concurrent(progs=0, block_n=32, warps=4):
        for _ in range(reps):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                decode(progs, block_n, warps)
            layer()
            torch.cuda.current_stream().wait_stream(side)

    def variant(progs, block_n, warps, high):
        return on_stream(lambda: concurrent(progs, block_n, warps), torch.cuda.Stream(priority=-1) if high else None)

    t_layer = bench(lambda: [layer() for _ in range(reps)], warmup=2, rep=10) / reps
    t_decode = bench(lambda: [decode() for _ in range(reps)], warmup=2, rep=10) / reps
    t_serial = bench(serial, warmup=2, rep=10) / reps
    t_conc = bench(concurrent, warmup=2, rep=10) / reps
    res = {"frames": frames, "history_tokens": n, "layer_ms": t_layer, "decode_k_and_v_ms": t_decode,
           "serial_ms": t_serial, "concurrent_ms": t_conc,
           "hidden_fraction_of_decode": (t_serial - t_conc) / t_decode}
    if variants:
        res["variants"] = []
        for progs, block_n, warps, high in VARIANTS:
            t_alone = bench(lambda: [decode(progs, block_n, warps) for _ in range(reps)], warmup=2, rep=10) / reps
            t = bench(variant(progs, block_n, warps, high), warmup=2, rep=10) / reps
            row = {"progs_per_head": progs, "block_n": block_n, "num_warps": warps, "layer_high_priority": high,
                   "decode_alone_ms": t_alone, "concurrent_ms": t, "added_ms": t - t_layer,
                   "hidden_fraction_of_decode": (t_alone + t_layer - t) / t_alone}
            print(row, flush=True)
            res["variants"].append(row)
    print(res, flush=True)
    return res


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--frames", default="21,60")
    ap.add_argument("--variants", action="store_true", help="also the small-grid / priority decode variants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overlap: needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"meta": meta(command_line("python -m qvg.eval.bench_overlap", argv), "cuda"),
           "rows": [run(int(f), variants=args.variants) for f in args.frames.split(",")]}
    os.makedirs(args.out, exist_ok=True)
    emit_json(res, os.path.join(args.out, "overlap-" + torch.cuda.get_device_name().split()[1].lower() + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
