"""`qvg-eval compare REF TEST`: how far a video made with a compressed KV cache is from the reference (the same
pipeline, inputs and sampling seed with a BF16 cache): PSNR, SSIM and LPIPS per frame and per window.

Windows (over the generated frames; the `lead` frames the pipeline was given, e.g. the embedded model's start
image, are excluded from every window but kept in the per-frame lists):
  - onset: the first `onset_chunks` generated chunks. An auto-regressive video conditions every chunk on the ones
    before, so a small error in the cache grows into a different, equally valid continuation; far from the start
    PSNR measures that divergence, not the cache's error (a third-party reproduction found whole-video PSNR of
    12-19 dB). The onset window is where the cache's error shows before the drift amplifies it.
  - chunk c: the frames of generated chunk c (per-chunk curve; `partial`: cut short by the end of the video);
  - video: all generated frames.
Per window: `psnr` = PSNR of the window's pooled MSE (the window as one signal, as `metrics.psnr` on a slab),
`psnr_frame_mean` = the mean of the per-frame PSNRs (an identical frame counts at the metric's 100 dB cap: 3 identical
frames and 3 at 46 dB give 73 dB, where `psnr` gives 49), `ssim` and `lpips` = means over the window's frames.
`first_below` = the first generated frame whose PSNR falls below `threshold` dB (None: never): where divergence
starts.

Chunk layout: the embedded model (qvg-generate --pipeline tiny) gives 1 lead frame then 3 frames per chunk;
Self-Forcing on Wan (VAE: 4x in time, the first latent frame -> 1 frame) gives chunks of 9, then 12 frames. Read
from the qvg-generate JSON beside REF when present, else from the options.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from qvg.outputs import atomic, stem_path

from .metrics import psnr, ssim

LAYOUTS = {"tiny": dict(lead=1, first=3, chunk=3), "self-forcing": dict(lead=0, first=9, chunk=12)}


def chunk_bounds(frames: int, lead: int = 0, first: int = 3, chunk: int = 3) -> list[tuple[int, int]]:
    """[(start, end)] frame ranges of the generated chunks of a `frames`-frame video (the last one cut)."""
    out, s = [], lead
    size = first
    while s < frames:
        out.append((s, min(frames, s + size)))
        s += size
        size = chunk
    return out


def per_frame(ref: torch.Tensor, test: torch.Tensor, lpips_model=None) -> dict:
    """{"psnr": [...], "ssim": [...], "lpips": [...] or None} per frame of two videos [3, F, H, W] in [-1, 1]."""
    if ref.shape != test.shape:
        raise ValueError(f"videos differ in shape: {tuple(ref.shape)} vs {tuple(test.shape)}")
    n = ref.shape[1]
    out = {"psnr": [psnr(ref[:, f], test[:, f]) for f in range(n)],
           "ssim": [ssim(ref[:, f], test[:, f]) for f in range(n)], "lpips": None}
    if lpips_model is not None:
        from .lpips import lpips_frames
        out["lpips"] = lpips_frames(lpips_model, ref, test)
    return out


def _window(ref, test, frames: dict, a: int, b: int) -> dict:
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    w = {"frames": [a, b], "psnr": psnr(ref[:, a:b], test[:, a:b]),
         "psnr_frame_mean": mean(frames["psnr"][a:b]), "ssim": mean(frames["ssim"][a:b])}
    w["lpips"] = mean(frames["lpips"][a:b]) if frames["lpips"] is not None else None
    return w


def compare(ref: torch.Tensor, test: torch.Tensor, *, lead: int = 0, first: int = 3, chunk: int = 3,
            onset_chunks: int = 1, threshold: float = 30.0, lpips_model=None) -> dict:
    """Metrics of `test` against `ref` (both [3, F, H, W] in [-1, 1]): per frame, onset window, per chunk and whole
    video (see the module docstring)."""
    if ref.shape != test.shape:
        raise ValueError(f"videos differ in shape: {tuple(ref.shape)} vs {tuple(test.shape)}")
    if ref.shape[1] <= lead:
        raise ValueError(f"the video has {ref.shape[1]} frames: none after the {lead} lead frame(s)")
    chunks = chunk_bounds(ref.shape[1], lead, first, chunk)
    if not 1 <= onset_chunks <= len(chunks):  # (it was clamped to the video, with the asked-for count recorded)
        raise ValueError(f"--onset-chunks must be in [1, {len(chunks)}] (the videos' chunks), got {onset_chunks}")
    frames = per_frame(ref, test, lpips_model)
    onset_end = chunks[onset_chunks - 1][1]
    below = next((f for f in range(lead, ref.shape[1]) if frames["psnr"][f] < threshold), None)
    return {"frames": frames, "layout": {"lead": lead, "first": first, "chunk": chunk, "frames": ref.shape[1]},
            "onset_chunks": onset_chunks, "threshold_db": threshold, "first_below": below,
            "windows": {"onset": _window(ref, test, frames, lead, onset_end),
                        "video": _window(ref, test, frames, lead, ref.shape[1]),
                        "chunks": [dict(_window(ref, test, frames, a, b),
                                        partial=b - a < (first if i == 0 else chunk))
                                   for i, (a, b) in enumerate(chunks)]}}


def plot(res: dict, path: str | Path, title: str = "") -> str:
    """Per-frame PSNR / SSIM / LPIPS with the chunks shaded and the onset window marked -> PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot"
    fr = res["frames"]
    names = [k for k in ("psnr", "ssim", "lpips") if fr.get(k) is not None]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.2), squeeze=False)
    on = res["windows"]["onset"]["frames"]
    for ax, k in zip(axes[0], names):
        vals = [min(v, 60.0) if k == "psnr" else v for v in fr[k]]
        ax.plot(range(len(vals)), vals, marker=".", lw=1)
        for i, c in enumerate(res["windows"]["chunks"]):
            if i % 2:
                ax.axvspan(c["frames"][0] - 0.5, c["frames"][1] - 0.5, color="0.92", lw=0)
        ax.axvspan(on[0] - 0.5, on[1] - 0.5, color="tab:orange", alpha=0.15, lw=0, label="onset window")
        ax.set(xlabel="frame", ylabel=k.upper() + (" dB (capped at 60)" if k == "psnr" else ""))
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with atomic(path) as tmp:  # (the whole PNG or none)
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return f"wrote {path}"


def summary_line(res: dict) -> str:
    w = res["windows"]
    f = lambda v, d=2: "-" if v is None else ("inf" if math.isinf(v) else f"{v:.{d}f}")  # noqa: E731
    return (f"onset ({w['onset']['frames'][0]}-{w['onset']['frames'][1] - 1}): PSNR {f(w['onset']['psnr'])} dB, "
            f"SSIM {f(w['onset']['ssim'], 4)}, LPIPS {f(w['onset']['lpips'], 4)}; whole video: PSNR "
            f"{f(w['video']['psnr'])} dB, SSIM {f(w['video']['ssim'], 4)}, LPIPS {f(w['video']['lpips'], 4)}; "
            f"first frame below {res['threshold_db']:g} dB: "
            f"{'none' if res['first_below'] is None else res['first_below']}")


def output_paths(out: str | Path) -> tuple[Path, Path]:
    """The JSON and PNG paths of output stem `out` (qvg.outputs.stem_path: "qvg.compare" -> qvg.compare.json, not
    qvg.json, the generation's own report; a stem given with either extension loses it first)."""
    return tuple(stem_path(out, ext, (".json", ".png")) for ext in (".json", ".png"))


def save(res: dict, out: str | Path) -> list[str]:
    """The JSON and the PNG, both or neither (the JSON is put in place only once the PNG is: a full disk leaves
    neither); an OSError names the file it was writing (a missing folder is not made)."""
    js, png = output_paths(out)
    path = js
    try:
        with atomic(js) as tmp:
            tmp.write_text(json.dumps(res, indent=1) + "\n")
            path = png
            line = plot(res, png, res.get("meta", {}).get("title", ""))
            path = js
    except OSError as e:
        raise OSError(e.errno, f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return [f"wrote {js}", line]


if __name__ == "__main__":  # (python -m qvg.eval.compare runs `qvg-eval compare`, with its checks)
    import sys

    from .cli import main
    raise SystemExit(main(["compare", *sys.argv[1:]]))
