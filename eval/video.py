"""Videos as tensors [3, F, H, W] in [-1, 1] (the pipelines' layout): read from a file, or converted to 8-bit."""
from __future__ import annotations

import json
from pathlib import Path

import torch


FFMPEG_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")  # read by ffmpeg itself (others: imageio)


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> [F, 3, H, W] uint8, rounded as the mp4 writer rounds."""
    return ((video.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).transpose(0, 1)


def read_video(path: str | Path) -> torch.Tensor:
    """An mp4 (or anything imageio reads: gif, a folder is not) or a .npy/.pt array [F, H, W, 3] uint8 ->
    [3, F, H, W] float in [-1, 1]. Raises ValueError with one line on a file that is not a video."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{str(p)!r} is a folder, not a video file")
    if not p.is_file():
        raise ValueError(f"no such file: {str(p)!r}")
    try:
        if p.suffix == ".pt":
            a = torch.load(p, map_location="cpu", weights_only=True)
        elif p.suffix == ".npy":
            import numpy as np
            a = torch.from_numpy(np.load(p))
        elif p.suffix.lower() in FFMPEG_SUFFIXES:  # (ffmpeg started without imageio's pre-exec step: app/mp4.py)
            from qvg.app.mp4 import read_frames
            a = torch.from_numpy(read_frames(p).copy())
        else:
            import imageio.v2 as imageio
            import numpy as np
            with imageio.get_reader(str(p)) as r:
                a = torch.from_numpy(np.stack([np.asarray(f) for f in r]))
    except Exception as e:  # imageio / ffmpeg / numpy errors: one line
        if "Could not find a backend" in str(e):  # (imageio's wording, with a stray backtick)
            if p.suffix.lower() in (*FFMPEG_SUFFIXES, ".gif", ".npy", ".pt"):  # (a type it reads: a broken file)
                raise ValueError(f"cannot read {str(p)!r} as a video (corrupt, or not a {p.suffix} file?)") from None
            raise ValueError(f"cannot read {str(p)!r} as a video (no reader for {p.suffix or 'files without a suffix'}"
                             f": give an {', '.join(FFMPEG_SUFFIXES)}, .gif, .npy or .pt file)") from None
        raise ValueError(f"cannot read {str(p)!r} as a video ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    if not isinstance(a, torch.Tensor):  # (a .pt file of a dict, a list, a number)
        raise ValueError(f"{str(p)!r}: expected frames [F, H, W, 3] uint8, got a {type(a).__name__}")
    if a.dim() == 3 and a.shape[-1] in (3, 4):  # (read as grey it was H frames of W x 3 pixels)
        raise ValueError(f"{str(p)!r}: frames of shape {tuple(a.shape)} read like one RGB frame: give frames "
                         f"[F, H, W, 3] (one frame: [1, H, W, 3]), or grey frames [F, H, W]")
    if a.dim() == 3:  # grey
        a = a[..., None].expand(*a.shape, 3)
    if a.dim() != 4 or a.shape[-1] < 3 or a.dtype != torch.uint8:
        raise ValueError(f"{str(p)!r}: expected frames [F, H, W, 3] uint8, got {tuple(a.shape)} {a.dtype}")
    return a[..., :3].permute(3, 0, 1, 2).float() / 127.5 - 1


def sidecar(path: str | Path) -> dict:
    """The qvg-generate JSON report beside a video (same name, .json), or {} (none, unreadable, or not an object)."""
    j = Path(path).with_suffix(".json")
    try:
        report = json.loads(j.read_text()) if j.is_file() else {}
    except (OSError, ValueError):  # (not JSON, or not UTF-8)
        return {}
    return report if isinstance(report, dict) else {}
