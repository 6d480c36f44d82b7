"""Pre- vs post-RoPE key storage: `python -m qvg.eval.rope_storage [--out DIR] [--chunks 4]`.

Self-Forcing caches keys after RoPE; LongCat caches them before (and the QVG paper reports that pre-RoPE keys
quantize better). Here: synthetic video-like keys (qvg.eval.synthetic_kv, which has no RoPE of its own) over
consecutive chunks, each rotated by Wan's 3D RoPE at its absolute frame position, compressed by each method
either before RoPE (the rotation is applied on read) or after it, with the streaming warm start across chunks.
RoPE is orthogonal per channel pair, so the error is compared in the same (post-RoPE) space either way.
Writes rope_storage.json and rope_storage.md.
"""
from __future__ import annotations

import datetime
import platform
import sys
import time

import torch

import qvg
from qvg.help_format import OneLineParser
from qvg.eval.synthetic_kv import DESCRIPTION, synthetic_kv
from qvg.numbers import integer
from qvg.eval.study_outputs import save
from qvg.outputs import folder_error
from qvg.rope import apply_rope, grid_angles
from qvg.revision import code_commit

METHODS = [("rtn", {}), ("quarot", {}), ("qvg", {}), ("qvg-pro", {})]


def storage_rows(chunks, bits=(2, 4), methods=METHODS) -> list[dict]:
    """MSE (in post-RoPE space) of keys stored before RoPE (rotated on read) vs after it. chunks: [(pre-RoPE keys
    [B, H, N, D], rope: keys -> keys rotated at that chunk's positions)] in stream order (qvg / qvg-pro warm-start
    along it, as the cache does)."""
    rows = []
    for b in bits:
        for method, kw in methods:
            prev = {"pre": None, "post": None}
            for c, (k, rope) in enumerate(chunks):
                k_post = rope(k)
                row = {"bits": b, "method": method, "chunk": c}
                for where, x in (("pre", k), ("post", k_post)):
                    init = prev[where] if qvg.compression.get_method(method).warm_start else None
                    p = qvg.compress(x, method, bits=b, init=init, **kw)
                    y = qvg.decompress(p)
                    if where == "pre":
                        y = rope(y)  # RoPE on read
                    row[f"mse_{where}"] = float((y - k_post).pow(2).mean())
                    prev[where] = p
                row["ratio_post_over_pre"] = row["mse_post"] / row["mse_pre"]
                rows.append(row)
    return rows


def run(chunks: int = 4, frames: int = 3, height: int = 30, width: int = 52, heads: int = 12, bits=(2, 4),
        seed: int = 0) -> dict:
    data = []
    for c in range(chunks):
        k, _ = synthetic_kv(frames=frames, height=height, width=width, heads=heads, t0=c * frames, seed=seed)
        ang = grid_angles(frames, height, width, k.shape[-1], t0=c * frames)
        data.append((k, lambda x, ang=ang: apply_rope(x, ang)))
    return {"rows": storage_rows(data, bits), "rms_k": float(k.pow(2).mean().sqrt())}


OUTPUTS = ("rope_storage.json", "rope_storage.md")


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m qvg.eval.rope_storage",
                                 description="pre- vs post-RoPE key storage on synthetic video-like KV")
    ap.add_argument("--out", default=".", help="output folder for rope_storage.json / .md (default: the current "
                    "one; the committed copies are in eval/results)")
    ap.add_argument("--chunks", type=integer, default=4, help="consecutive chunks compressed, warm-started (default 4)")
    ap.add_argument("--seed", type=integer, default=0, help="data seed (default 0)")
    args = ap.parse_args(argv)
    bad = "--chunks must be >= 1" if args.chunks < 1 else None
    bad = bad or (f"--out: {why}" if (why := folder_error(args.out, OUTPUTS)) else None)  # (before the work)
    if bad:
        print(f"{ap.prog}: error: {bad}", file=sys.stderr)
        return 2
    t0 = time.time()
    res = run(chunks=args.chunks, seed=args.seed)
    cmd = " ".join(["python -m qvg.eval.rope_storage", *(sys.argv[1:] if argv is None else argv)])
    res.update({"command": cmd, "commit": code_commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": f"cpu ({platform.machine()})", "torch": torch.__version__, "data": DESCRIPTION,
                "shape": [1, 12, 3 * 30 * 52, 128], "wall_s": time.time() - t0})
    lines = ["# Pre- vs post-RoPE key storage (synthetic KV)", "",
             f"- command: `{res['command']}`; commit `{res['commit']}`; {res['date']}; {res['device']}; "
             f"torch {res['torch']}; {res['wall_s']:.0f} s",
             f"- data: {res['data']}; keys [1, 12, 4680, 128] per chunk, chunk c at frames 3c..3c+2, Wan 3D RoPE "
             "(44/42/42 channels for t/h/w); warm start across chunks for qvg/qvg-pro", "",
             "MSE in post-RoPE space; `pre` = stored before RoPE, rotated on read. ratio = MSE(post) / MSE(pre).", "",
             "| bits | method | chunk | MSE pre | MSE post | post / pre |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['bits']} | {r['method']} | {r['chunk']} | {r['mse_pre']:.4g} | {r['mse_post']:.4g} | "
                     f"{r['ratio_post_over_pre']:.2f}x |")
    return save(ap.prog, args.out, OUTPUTS, res, "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
