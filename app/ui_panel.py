"""What the UI shows of a run (an app.ui_run.Update): the newest frames as an image file (a chunk's frames as an
animated PNG that plays once at the video's frame rate, scaled to a preview size), and the memory panel: a summary
line, the plots' data (KV bytes by component, KV bytes against the BF16 equivalent, compression ratio, per-chunk
latency and the UI's own time between chunks, PSNR vs BF16 when comparing) as pandas DataFrames, which the page
draws in the browser (gradio's native plots: nothing is rendered on the generation's thread), and a per-chunk table
of the same numbers. No gradio."""
from __future__ import annotations

from pathlib import Path

from .generate import ratio_words

# the KV cache's bytes by component (qvg.cache.KVCache.memory; the BF16 buffers split by zone), as the plot stacks
# them; the BF16 reference of a comparison holds only the zones
COMPONENTS = ("codes", "scales", "ids", "centroids", "positions", "bf16_sink", "bf16_pending", "bf16_current",
              "bf16_residual", "workspace")
BF16_ZONES = ("bf16_sink", "bf16_pending", "bf16_current")
COLORS = {"codes": "#1f77b4", "scales": "#ff7f0e", "ids": "#2ca02c", "centroids": "#d62728", "positions": "#17becf",
          "bf16_sink": "#9467bd", "bf16_pending": "#8c564b", "bf16_current": "#c7c7c7", "bf16_residual": "#e377c2",
          "workspace": "#bcbd22"}
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
    """The memory panel's headline: KV bytes now vs BF16, ratio, latency, the UI's time between chunks (and PSNR
    when comparing)."""
    if not up.rows:
        return "Memory: waiting for the first chunk."
    r = up.rows[-1]
    lines = [f"**Chunk {r.index + 1} of {up.total_chunks}** (KV cache after it)"]
    for lb in up.labels:
        m = r.memory[lb]
        secs = [row.seconds[lb] for row in up.rows]
        lines.append(f"- **{lb}**: KV cache **{human(m['total'])}** now vs **{human(m['bf16_equivalent'])}** in BF16 "
                     f"→ **{ratio_words(m['compression_ratio'])}** · chunk {secs[-1]:.2f} s (mean "
                     f"{sum(secs) / len(secs):.2f} s)")
    ui = [row.ui_seconds for row in up.rows if row.ui_seconds is not None]
    if ui:
        lines.append(f"- **UI** between chunks (preview, panel, mp4, streaming): {ui[-1]:.3f} s last, "
                     f"{sum(ui) / len(ui):.3f} s mean")
    ps = [row.psnr for row in up.rows if row.psnr is not None]
    if ps:
        differ = [p for p in ps if not identical(p)]
        now = "identical to bf16 this chunk" if identical(ps[-1]) else f"{ps[-1]:.2f} dB this chunk"
        same = len(ps) - len(differ)
        mean = (f"{sum(differ) / len(differ):.2f} dB mean over the {len(differ)} chunk{'s' * (len(differ) > 1)} that "
                f"differ" if differ else "no chunk differs yet")
        lines.append(f"- **PSNR {up.labels[-1]} vs bf16**: {now}, {mean}" +
                     (f" ({same} identical, left out)" if same and differ else "") + " (same seed and actions)")
    return "\n".join(lines)


def identical(psnr: float) -> bool:
    """A chunk's PSNR at the metric's cap: the frames equal bf16's (e.g. while the sink holds everything in BF16).
    Left out of the mean and the plot, where the cap would read as a quality figure."""
    from qvg.eval.metrics import PSNR_CAP
    return psnr >= PSNR_CAP


def components(label: str) -> tuple[str, ...]:
    """The components a video's cache can hold: the BF16 reference only its zones."""
    return BF16_ZONES if label == "bf16" else COMPONENTS


def table(up) -> tuple[list[str], list[list]]:
    """(headers, rows): per chunk its action and frames, PSNR (comparing), the UI's seconds, then per video its
    seconds, KV KiB and ratio, the BF16 equivalent, and per video its KiB by component (BF16 zones apart)."""
    lbs = up.labels
    head = ["chunk", "action", "frames", *(["PSNR dB"] if len(lbs) == 2 else []), "UI s"]
    for lb in lbs:
        head += [f"{lb} s", f"{lb} KV KiB", f"{lb} ratio"]
    head.append("BF16 equiv. KiB")
    for lb in lbs:
        head += [f"{lb} {c} KiB" for c in components(lb)]
    rows = []
    for r in up.rows:
        row = [r.index + 1, r.action or "", r.frames]
        if len(lbs) == 2:
            row.append(None if r.psnr is None else round(r.psnr, 2))
        row.append(None if r.ui_seconds is None else round(r.ui_seconds, 3))
        for lb in lbs:
            m = r.memory[lb]
            row += [round(r.seconds[lb], 3), round(m["total"] / 1024, 1), round(m["compression_ratio"], 3)]
        row.append(round(r.memory[lbs[-1]]["bf16_equivalent"] / 1024, 1))
        for lb in lbs:
            row += [round(r.memory[lb].get(c, 0) / 1024, 2) for c in components(lb)]
        rows.append(row)
    return head, rows


# the bytes-by-component bars are drawn one per chunk, labelled, up to this many chunks; beyond, on a number axis
BAR_LABELS = 24
# the lines' x axis is labelled chunk by chunk for videos of up to this many chunks (a number axis would put ticks
# between chunks), a number axis for longer ones (a labelled axis does not thin its labels: three plots share a row)
LINE_LABELS = 12


def lines_labelled(up) -> bool:
    """Whether the line plots' x axis is the video's chunks as labels (a short video) rather than a number axis."""
    return up.total_chunks <= LINE_LABELS


def plots(up) -> tuple[dict, str]:
    """The plots' data, long form (one row per chunk and series), and the unit of the byte plots:
    - components: chunk, component, size (the method's video, stacked; components it never holds left out; the
      chunk as text up to BAR_LABELS chunks: a bar per label);
    - kv: chunk, series (each video's KV cache, the BF16 equivalent), size;
    - ratio: chunk, video, ratio; latency: chunk, series (each video's chunk seconds, the UI's), seconds;
    - psnr (comparing): chunk, PSNR dB.
    For a short video (lines_labelled) the lines' chunks are text and each series has a row (value NaN) for every
    chunk still to come, so the axis is the whole video's chunks from the start."""
    import pandas as pd
    lb = up.labels[-1]
    scale, unit = _unit(max([r.memory[lb]["bf16_equivalent"] for r in up.rows] + [1]))
    held = [c for c in COMPONENTS if any(r.memory[lb].get(c, 0) for r in up.rows)]
    x = str if len(up.rows) <= BAR_LABELS else int
    comp = [(x(r.index + 1), c, r.memory[lb].get(c, 0) / scale) for r in up.rows for c in held]
    kv = [(r.index + 1, f"{name} KV cache", r.memory[name]["total"] / scale) for r in up.rows for name in up.labels]
    if "bf16" not in up.labels:  # (comparing, the bf16 run's cache is the BF16 equivalent: one line over the other)
        kv += [(r.index + 1, "BF16 equivalent", r.memory[lb]["bf16_equivalent"] / scale) for r in up.rows]
    ratio = [(r.index + 1, name, r.memory[name]["compression_ratio"]) for r in up.rows for name in up.labels]
    lat = [(r.index + 1, name, r.seconds[name]) for r in up.rows for name in up.labels]
    lat += [(r.index + 1, "UI", r.ui_seconds) for r in up.rows if r.ui_seconds is not None]
    out = {"components": pd.DataFrame(comp, columns=["chunk", "component", "size"])}
    lines = {"kv": (kv, ["chunk", "series", "size"]), "ratio": (ratio, ["chunk", "video", "ratio"]),
             "latency": (lat, ["chunk", "series", "seconds"])}
    if len(up.labels) == 2:
        lines["psnr"] = ([(r.index + 1, float("nan") if identical(r.psnr) else r.psnr) for r in up.rows
                          if r.psnr is not None], ["chunk", "PSNR dB"])
    for name, (rows, cols) in lines.items():
        if lines_labelled(up):
            series = list(dict.fromkeys(r[1] for r in rows)) if len(cols) == 3 else [None]
            rows = [(str(r[0]), *r[1:]) for r in rows]
            rows += [(str(c), *([s] if s is not None else []), float("nan"))
                     for c in range(len(up.rows) + 1, up.total_chunks + 1) for s in series]
        out[name] = pd.DataFrame(rows, columns=cols).astype({cols[-1]: float})
    return out, unit


def y_top(df, y: str) -> float | None:
    """The top of a plot's y axis: 8% above its largest value (not on the frame, where the newest point of a flat
    line hid in it), None with no value."""
    top = df[y].max() if len(df) else float("nan")
    return None if top != top else float(top) * 1.08 or 1.0


def one_point(df, y: str, color: str | None) -> bool:
    """Whether a line plot's data has at most one point (a value that is not NaN) in each series."""
    shown = df[y].notna()
    return int(shown.groupby(df[color]).sum().max() if color and len(df) else shown.sum()) <= 1


def _unit(top: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1, "bytes"
