"""The paper's analyses on K/V captured from a real run (the embedded world model by default; `kv_capture`), and
on videos made by a runner (`runners`):

- `kv_sections` (Fig. 6, Fig. 5c, the KV side of Fig. 7): per layer, on captured chunks, keys as the cache stores
  them (after RoPE) and values: MSE per method at INT2 / INT4; QVG's MSE reduction vs RTN at the same block size
  (qvg / rtn at B=64, qvg-pro / rtn at B=16); MSE vs PRQ stages S = 0..4 (S = 0 is RTN) at B=16 and B=64; MSE vs
  block size B with the bits per element each costs (measured from the stored bytes). k-means runs at the cache's
  K (`default_centroids` of a chunk) and at several k-means seeds (mean ± std: the seed floor). Computed as
  `kv_analysis` computes its synthetic sections (one 4-stage k-means chain per tensor and seed, every S <= 4 and B
  assembled from it; `kv_analysis._Chain`).
- `warm_cold`: the streaming k-means warm start on consecutive captured chunks of a layer, warm (the previous
  chunk's stored centroids, 2 iterations) vs cold (k-means++, 8 iterations), traced per Lloyd iteration
  (`kv_analysis._warm_start`).
- `rope_sections`: keys stored before RoPE (rotated on read) vs after it, on the captured pre-RoPE keys with the
  chunk's real RoPE (`rope_storage.storage_rows`).
- `long_video` (Fig. 5a): quality along a long video every N frames, each method against the BF16 video of the
  same seed, beside the sampling floor (BF16 at the next seed).
- `block_sizes` (Fig. 7, end to end): qvg at several block sizes in real runs: compression ratio, the cache's
  bytes by component and onset quality.
"""
from __future__ import annotations

import statistics

import torch

import qvg

from .compare import compare
from .metrics import psnr
from .progress import bar as progress_bar
from .kv_analysis import _Chain, _mse, _warm_start, default_grid
from .rope_storage import storage_rows

TENSORS = ("K", "V")


def _bar(total: int, progress: bool, desc: str):
    return progress_bar(total, desc, progress, leave=False)


def _ms(vals: list[float]) -> dict:
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals)}


def _tensor(cap, name: str, chunk: int, layer: int) -> torch.Tensor:
    return cap.key(chunk, layer) if name == "K" else cap.value(chunk, layer)


def _eval(x: torch.Tensor, p) -> dict:
    return {"mse": _mse(x, qvg.decompress(p)), "bpe": 8.0 * p.nbytes / x.numel()}


def kv_sections(cap, chunks: list[int], layers: list[int], centroids: int, kmeans_seeds: list[int],
                bits=(2, 4), block_sizes=(16, 32, 64), progress: bool = True) -> dict:
    """Per tensor and layer, over `chunks` x `kmeans_seeds`: see the module docstring. rel = MSE / mean(x^2)."""
    grid = default_grid()
    d = cap.value(chunks[0], layers[0]).shape[-1]
    block_sizes = [b for b in block_sizes if d % b == 0]
    bar = _bar(len(TENSORS) * len(layers) * len(chunks) * len(kmeans_seeds), progress, "KV sections")
    recs: dict = {}  # (tensor, layer, label, bits) -> [ {mse, rel, bpe} ]

    def add(key, x, ms, p):
        e = _eval(x, p)
        recs.setdefault(key, []).append({**e, "rel": e["mse"] / ms})

    for t in TENSORS:
        for layer in layers:
            for c in chunks:
                x = _tensor(cap, t, c, layer)
                ms = float(x.pow(2).mean())
                for b in bits:  # deterministic baselines: once per chunk
                    for bs in block_sizes:
                        add((t, layer, f"rtn B={bs}", b), x, ms, qvg.compress(x, "rtn", bits=b, block_size=bs))
                    add((t, layer, "kivi", b), x, ms,
                        qvg.compress(x, "kivi", bits=b, role="key" if t == "K" else "value"))
                for s in kmeans_seeds:
                    bar.set_postfix_str(f"{t} layer {layer} chunk {c} seed {s}")
                    for b in bits:
                        add((t, layer, "quarot", b), x, ms, qvg.compress(x, "quarot", bits=b, seed=s))
                    ch = _Chain(x, s, centroids, 4)
                    for b in bits:
                        for bs in block_sizes:
                            add((t, layer, f"qvg B={bs}", b), x, ms, ch.packed(1, b, bs, grid))
                        if 16 in block_sizes:
                            add((t, layer, "qvg-pro", b), x, ms, ch.packed(4, b, 16, grid))
                    for bs in (16, 64):
                        if bs in block_sizes:
                            for S in range(5):
                                add((t, layer, f"S={S} B={bs}", 2), x, ms, ch.packed(S, 2, bs, grid))
                    bar.update(1)
    bar.close()
    summ = lambda key: {k: _ms([r[k] for r in recs[key]]) for k in ("mse", "rel", "bpe")}  # noqa: E731
    labels = sorted({k[2] for k in recs}, key=lambda s: (s.split()[0], s))
    out = {"chunks": chunks, "layers": layers, "centroids": centroids, "kmeans_seeds": kmeans_seeds, "grid": grid,
           "block_sizes": block_sizes, "bits": list(bits),
           "per_layer": {t: {str(layer): {f"{lab} int{b}": summ((t, layer, lab, b)) for lab in labels for b in bits
                                          if (t, layer, lab, b) in recs} for layer in layers} for t in TENSORS}}

    def over_layers(lab: str, b: int, key: str = "rel") -> dict:
        return _ms([r[key] for layer in layers for r in recs.get((t, layer, lab, b), [])])

    def ratio(num: str, den: str, b: int, layer) -> dict:
        """MSE(num) / MSE(den) per (chunk, seed) pairing: den runs are per chunk x seed, num per chunk (or same)."""
        n, dd = recs[(t, layer, num, b)], recs[(t, layer, den, b)]
        reps = len(dd) // len(n)
        return _ms([n[i // reps]["mse"] / dd[i]["mse"] for i in range(len(dd))])

    out["methods"], out["reduction"], out["stages"], out["block_size"] = {}, {}, {}, {}
    for t in TENSORS:
        out["methods"][t] = {f"{lab} int{b}": {"rel": over_layers(lab, b), "bpe": over_layers(lab, b, "bpe")}
                             for lab in labels if not lab.startswith("S=") for b in bits}
        red = {}
        for b in bits:
            pairs = [("qvg / rtn @ B=64", "rtn B=64", "qvg B=64"), ("qvg-pro / rtn @ B=16", "rtn B=16", "qvg-pro")]
            for name, num, den in pairs:
                if (t, layers[0], den, b) in recs and (t, layers[0], num, b) in recs:
                    per = {str(layer): ratio(num, den, b, layer) for layer in layers}
                    red[f"{name} int{b}"] = {"per_layer": per, "mean_over_layers": statistics.fmean(
                        v["mean"] for v in per.values())}
        out["reduction"][t] = red
        out["stages"][t] = {f"B={bs}": [over_layers(f"S={S} B={bs}", 2)["mean"] for S in range(5)]
                            for bs in (16, 64) if bs in block_sizes}
        out["block_size"][t] = {f"{m} int{b}": [{"B": bs, "bpe": over_layers(f"{m} B={bs}", b, "bpe")["mean"],
                                                 "rel": over_layers(f"{m} B={bs}", b)["mean"]} for bs in block_sizes]
                                for m in ("rtn", "qvg") for b in bits}
    return out


def warm_cold(cap, chunks: list[int], layers: list[int], centroids: int, seed: int = 0, iters: int = 20,
              progress: bool = True) -> dict:
    """Warm vs cold k-means along captured chunks `chunks` (stream order) of each layer, keys and values."""
    bar = _bar(len(TENSORS) * len(layers) * len(chunks), progress, "warm vs cold k-means")
    out = {}
    for t in TENSORS:
        for layer in layers:
            xs = [_tensor(cap, t, c, layer) for c in chunks]
            out[f"{t} layer {layer}"] = _warm_start(xs, centroids, seed, iters, bar, f"{t} layer {layer}")
    bar.close()
    recs = [c for v in out.values() for c in v["chunks"]]
    return {"chunks": chunks, "layers": layers, "centroids": centroids, "seed": seed, "iters": iters, "runs": out,
            "summary": {
                "qvg_int2_mse_warm2_over_cold8": _ms([c["qvg_int2_mse"]["warm2"] / c["qvg_int2_mse"]["cold8"]
                                                      for c in recs]),
                "objective_warm2_over_cold8": _ms([c["warm2_over_cold8"] for c in recs]),
                "cold_iters_to_reach_warm2": [c["cold_iters_to_warm2"] for c in recs]}}


def rope_sections(cap, chunks: list[int], layers: list[int], centroids: int, bits=(2, 4)) -> dict:
    """Pre- vs post-RoPE key storage on captured keys (stream order along `chunks`), per layer."""
    methods = [("rtn", {}), ("quarot", {}), ("qvg", {"centroids": centroids}), ("qvg-pro", {"centroids": centroids})]
    per = {}
    for layer in layers:
        data = [(cap.key(c, layer, post_rope=False), lambda x, c=c: cap.rotate(c, x)) for c in chunks]
        per[str(layer)] = storage_rows(data, bits, methods)
    summary = {}
    for rows in per.values():
        for r in rows:
            e = summary.setdefault(f"{r['method']} int{r['bits']}", {"pre": [], "post": []})
            e["pre"].append(r["mse_pre"])
            e["post"].append(r["mse_post"])
    return {"chunks": chunks, "layers": layers, "centroids": centroids, "per_layer": per,
            "summary": {k: {"mse_pre": statistics.fmean(e["pre"]), "mse_post": statistics.fmean(e["post"]),
                            "post_over_pre": statistics.fmean(e["post"]) / statistics.fmean(e["pre"]),
                            "n": len(e["pre"])} for k, e in summary.items()}}


def long_video(runner, image: str, seed: int, chunks: int, methods: list[tuple[str, dict]], every: int,
               capture=None, progress: bool = True) -> dict:
    """Fig. 5a: PSNR / SSIM every `every` frames along a `chunks`-chunk video, each (label, method, options) vs the
    BF16 video of `seed`; `floor`: BF16 at seed + 1 vs seed. `capture`: a KVCapture that records the BF16 run."""
    bar = _bar(2 + len(methods), progress, "long video")
    ref = runner.run(image, seed, "bf16", {}, chunks, capture=capture)
    bar.update(1)
    videos = {"bf16: another sampling seed (floor)": runner.run(image, seed + 1, "bf16", {}, chunks)}
    bar.update(1)
    mem = {}
    for label, method, opts in methods:
        bar.set_postfix_str(label)
        v = runner.run(image, seed, method, opts, chunks)
        videos[label], mem[label] = v, v.memory
        bar.update(1)
    bar.close()
    n = ref.video.shape[1]
    edges = list(range(runner.lead, n, every))
    curves = {}
    for label, v in videos.items():
        c = compare(ref.video, v.video, lead=runner.lead, first=runner.first, chunk=runner.chunk)
        fp, fs = c["frames"]["psnr"], c["frames"]["ssim"]
        curves[label] = {"psnr": [psnr(ref.video[:, a:a + every], v.video[:, a:a + every]) for a in edges],
                         "ssim": [statistics.fmean(fs[a:a + every]) for a in edges],
                         "first_below": c["first_below"], "frame_psnr": fp}
    return {"image": image, "seed": seed, "chunks": chunks, "every": every, "window_starts": edges,
            "frames": n, "curves": curves,
            "compression_ratio": {k: m["compression_ratio"] for k, m in mem.items()}}


def block_sizes(runner, image: str, seed: int, chunks: int, bits: int, sizes: list[int], method: str = "qvg",
                progress: bool = True, onset_chunks: int = 1) -> dict:
    """Fig. 7 end to end: `method` at INT`bits` with each block size: ratio, bytes by component, onset and
    whole-video PSNR vs the BF16 video."""
    bar = _bar(1 + len(sizes), progress, "block sizes")
    ref = runner.run(image, seed, "bf16", {}, chunks)
    bar.update(1)
    rows = []
    for bs in sizes:
        v = runner.run(image, seed, method, {"bits": bits, "block_size": bs}, chunks)
        c = compare(ref.video, v.video, lead=runner.lead, first=runner.first, chunk=runner.chunk,
                    onset_chunks=onset_chunks)
        rows.append({"block_size": bs, "compression_ratio": v.memory["compression_ratio"], "memory": v.memory,
                     "onset_psnr": c["windows"]["onset"]["psnr"], "video_psnr": c["windows"]["video"]["psnr"]})
        bar.update(1)
    bar.close()
    return {"image": image, "seed": seed, "chunks": chunks, "method": method, "bits": bits, "rows": rows}
