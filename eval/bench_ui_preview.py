"""What the live preview of qvg-app costs per chunk at Self-Forcing's size: 12 video frames of 480 x 832 (one chunk
at 16 fps after the VAE) encoded as the page's animated PNG, before (full size at PIL's default zlib level 6, what
app.ui_panel did until the preview was bounded) and after (app.ui_panel.frames_image: halved to 240 x 416, level 1).
The encode runs between chunks on the generation's thread, so it adds to every chunk (twice in compare mode).

    python -m qvg.eval.bench_ui_preview --out eval/results/ui-preview-encode-cpu.json
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from qvg.help_format import OneLineParser

FRAMES, HEIGHT, WIDTH, FPS = 12, 480, 832, 16


def pan_frames(n: int = FRAMES, h: int = HEIGHT, w: int = WIDTH) -> np.ndarray:
    """n frames [n, h, w, 3] uint8 of a camera pan over a bundled photo (photo-like content, moving), the photo
    upscaled (bicubic) to cover the frame."""
    from PIL import Image

    from qvg.pipelines.world_data import PHOTO_DIR
    side = max(h, w) + 16 * n
    photo = np.asarray(Image.open(PHOTO_DIR / "astronaut.png").convert("RGB").resize((side, side), Image.BICUBIC))
    return np.stack([photo[4 * i:4 * i + h, 16 * i:16 * i + w] for i in range(n)])


def noise_frames(n: int = FRAMES, h: int = HEIGHT, w: int = WIDTH) -> np.ndarray:
    """Uniform noise: the worst case for zlib."""
    return np.random.default_rng(0).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def before(frames: np.ndarray, path: Path) -> str:
    """The preview as it was: every frame at full size (480 x 832 was not scaled), PIL's default level 6."""
    from PIL import Image

    from qvg.app.ui_panel import save_apng
    return save_apng([Image.fromarray(f) for f in frames], path, FPS, level=6)


def after(frames: np.ndarray, path: Path) -> str:
    from qvg.app.ui_panel import frames_image
    return frames_image(frames, path, FPS)


def measure(encode, frames: np.ndarray, path: Path, repeats: int) -> dict:
    from PIL import Image
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        encode(frames, path)
        times.append(time.perf_counter() - t)
    img = Image.open(path)
    return {"seconds_median": round(statistics.median(times), 4), "seconds_min": round(min(times), 4),
            "seconds_all": [round(t, 4) for t in times], "bytes": path.stat().st_size,
            "preview_size_wh": list(img.size), "preview_frames": getattr(img, "n_frames", 1)}


def main(argv: list[str] | None = None) -> int:
    from qvg.eval.provenance import command_line, meta
    p = OneLineParser(prog="python -m qvg.eval.bench_ui_preview", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the JSON here (default: print it only)")
    a = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for content, frames in (("photo pan", pan_frames()), ("noise (worst case)", noise_frames())):
            b = measure(before, frames, Path(d) / "before.png", a.repeats)
            f = measure(after, frames, Path(d) / "after.png", a.repeats)
            rows[content] = {"before": b, "after": f, "speedup": round(b["seconds_median"] / f["seconds_median"], 1)}
    m = meta(command_line("python -m qvg.eval.bench_ui_preview", argv), "cpu")
    out = {"what": "qvg-app live preview: encode time of one chunk's animated PNG at Self-Forcing's frame size, "
                   "before (full size, zlib level 6) and after (app.ui_panel.frames_image)",
           "device": f"CPU ({os.cpu_count()} cores)", "date": m["date"], "git_commit": m["git_commit"],
           "git_dirty": m["git_dirty"], "command": m["command"], "load_average_1min_before": round(load, 2),
           "chunk": {"frames": FRAMES, "height": HEIGHT, "width": WIDTH, "fps": FPS}, "repeats": a.repeats,
           "results": rows,
           "context": "an H100 chunk of Self-Forcing (transformer only, VAE excluded) takes 556-1106 ms at 21-60 "
                      "latent frames of history (eval/results/pipeline-h100.md); compare mode encodes two previews "
                      "per chunk. The mp4 is written at full size either way.",
           "meta": m}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
