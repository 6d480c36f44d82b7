"""What the UI shows of a run (an app.ui_run.Update): the newest frames as an image file (a chunk's frames as an
animated PNG that plays once at the video's frame rate, scaled to a preview size), and the memory panel: a summary
line, a figure (KV bytes by component against the BF16 equivalent, compression ratio, per-chunk latency, PSNR vs
BF16 when comparing) and a per-chunk table. matplotlib only (Agg, no display), no gradio."""
from __future__ import annotations

from pathlib import Path

COMPONENTS = ("codes", "scales", "ids", "centroids", "bf16_sink", "bf16_pending", "bf16_current", "bf16_residual",
              "workspace")
# the live frames' preview (the page shows it 300 pixels high): scaled by a whole factor, up (nearest) or down (box
# average), to a shortest side of at most DISPLAY and a longest of at most MAX_SIDE
DISPLAY, MAX_SIDE = 256, 512
# zlib level 1 (PIL's default is 6): with full-size frames at level 6, a 480 x 832 chunk took 1.2 s to encode on 2
# CPU cores (0.1 s now), more than an H100 chunk (eval/results/ui-preview-encode-cpu.json)
PREVIEW_LEVEL = 1


def preview_factor(h: int, w: int) -> tuple[int, int]:
    """(up, down): a frame's preview is about h * up / down high. The largest up that keeps the shortest side at
    most DISPLAY and the longest at most MAX_SIDE (64 x 64 -> 256 x 256); where none does, the smallest down that
    does (480 x 832 -> 240 x 416)."""
    up = min(DISPLAY // min(h, w), MAX_SIDE // max(h, w))
    if up >= 1:
        return up, 1
    return 1, max(-(-min(h, w) // DISPLAY), -(-max(h, w) // MAX_SIDE))


def preview(frames):
    """uint8 frames [F, H, W, 3] -> PIL images scaled by preview_factor."""
    from PIL import Image
    up, down = preview_factor(*frames.shape[1:3])
    if up > 1:
        frames = frames.repeat(up, 1).repeat(up, 2)
    return [Image.fromarray(f).reduce(down) if down > 1 else Image.fromarray(f) for f in frames]


def save_apng(imgs, path: Path, fps: int, level: int) -> str:
    """PIL images -> a PNG at `path` (zlib level `level`); several: an APNG played once, whose last frame stays
    until the next chunk arrives."""
    if len(imgs) == 1:
        imgs[0].save(path, compress_level=level)
    else:
        imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=round(1000 / fps), loop=1,
                     compress_level=level)
    return str(path)


def frames_image(frames, path: Path, fps: int) -> str:
    """uint8 frames [F, H, W, 3] -> the live preview at `path`: an (animated) PNG, scaled by preview_factor (the
    mp4 keeps the full size)."""
    return save_apng(preview(frames), path, fps, PREVIEW_LEVEL)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary(up) -> str:
    """The memory panel's headline: KV bytes now vs BF16, ratio, latency (and PSNR when comparing)."""
    if not up.rows:
        return "Memory: waiting for the first chunk."
    r = up.rows[-1]
    lines = [f"**Chunk {r.index + 1} of {up.total_chunks}** (KV cache after it)"]
    for lb in up.labels:
        m = r.memory[lb]
        secs = [row.seconds[lb] for row in up.rows]
        lines.append(f"- **{lb}**: KV cache **{human(m['total'])}** now vs **{human(m['bf16_equivalent'])}** in BF16 "
                     f"→ **{m['compression_ratio']:.2f}×** smaller · chunk {secs[-1]:.2f} s (mean "
                     f"{sum(secs) / len(secs):.2f} s)")
    ps = [row.psnr for row in up.rows if row.psnr is not None]
    if ps:
        lines.append(f"- **PSNR {up.labels[-1]} vs bf16**: {ps[-1]:.2f} dB this chunk, {sum(ps) / len(ps):.2f} dB "
                     "mean (same seed and actions)")
    return "\n".join(lines)


def table(up) -> tuple[list[str], list[list]]:
    """(headers, rows): per chunk, per video its seconds, KV KiB and ratio; the last video's bytes by component."""
    lbs = up.labels
    head = ["chunk", "action", "frames"]
    for lb in lbs:
        head += [f"{lb} s", f"{lb} KV KiB", f"{lb} ratio"]
    head += ["BF16 equiv. KiB", *(f"{c} KiB" for c in COMPONENTS[:4]), "bf16 KiB"]
    if len(lbs) == 2:
        head.append("PSNR dB")
    rows = []
    for r in up.rows:
        row = [r.index + 1, r.action or "", r.frames]
        for lb in lbs:
            m = r.memory[lb]
            row += [round(r.seconds[lb], 3), round(m["total"] / 1024, 1), round(m["compression_ratio"], 3)]
        m = r.memory[lbs[-1]]
        row += [round(m["bf16_equivalent"] / 1024, 1), *(round(m[c] / 1024, 2) for c in COMPONENTS[:4]),
                round(m["bf16"] / 1024, 2)]
        if len(lbs) == 2:
            row.append(None if r.psnr is None else round(r.psnr, 2))
        rows.append(row)
    return head, rows


def figure(up):
    """The memory panel's figure (a matplotlib Figure, no pyplot state)."""
    from matplotlib.figure import Figure
    compare = len(up.labels) == 2
    fig = Figure(figsize=(10, 6.4) if compare else (12, 3.6), dpi=80, layout="constrained")
    axes = fig.subplots(2, 2).ravel() if compare else fig.subplots(1, 3)
    x = [r.index + 1 for r in up.rows]
    lb = up.labels[-1]
    ax = axes[0]
    scale, unit = _unit(max([r.memory[lb]["bf16_equivalent"] for r in up.rows] + [1]))
    bottom = [0.0] * len(x)
    colors = {"codes": "#1f77b4", "scales": "#ff7f0e", "ids": "#2ca02c", "centroids": "#d62728",
              "bf16_sink": "#9467bd", "bf16_pending": "#8c564b", "bf16_current": "#c7c7c7", "bf16_residual": "#e377c2",
              "workspace": "#bcbd22"}
    for c in COMPONENTS:
        vals = [r.memory[lb].get(c, 0) / scale for r in up.rows]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=c, color=colors[c], width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
    equiv = [r.memory[lb]["bf16_equivalent"] / scale for r in up.rows]
    ax.plot(x, equiv, "k--o", ms=3, label="BF16 equivalent")
    ax.set_title(f"{lb}: KV cache bytes by component")
    ax.set_ylabel(unit)
    ax.set_ylim(0, max(equiv + bottom + [1e-9]) * 1.5)  # room for the legend
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax = axes[1]
    for name in up.labels:
        ax.plot(x, [r.memory[name]["compression_ratio"] for r in up.rows], "-o", ms=3, label=name)
    ax.set_title("compression ratio (BF16 bytes / bytes held)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax = axes[2]
    w = 0.8 / len(up.labels)
    for i, name in enumerate(up.labels):
        ax.bar([v + (i - (len(up.labels) - 1) / 2) * w for v in x], [r.seconds[name] for r in up.rows], width=w,
               label=name)
    ax.set_title("latency per chunk")
    ax.set_ylabel("s")
    ax.legend(fontsize=7)
    if compare:
        ax = axes[3]
        ax.plot(x, [r.psnr for r in up.rows], "-o", ms=3, color="#d62728")
        ax.set_title(f"PSNR {lb} vs bf16 per chunk")
        ax.set_ylabel("dB")
    for ax in axes:
        ax.set_xlabel("chunk")
        if x:
            ax.set_xticks(x if len(x) <= 16 else x[::max(1, len(x) // 8)])
    return fig


def _unit(top: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1, "bytes"
