"""Start images from files (qvg-generate --image, the UI's upload): any image PIL or imageio reads, as 8-bit RGB."""
from __future__ import annotations

from pathlib import Path

MIN_IMAGE_SIDE = 16  # pixels: a start image is scaled to the model's view; below this it holds next to nothing


def image_array(path: Path):
    """An image file -> uint8 [H, W, 3]. PIL converts what it opens to RGB (palette, 1-bit, greyscale with or
    without alpha, CMYK: alpha dropped); 16-bit and float images are scaled to 8 bits (floats up to 1 as [0, 1],
    else as [0, 255]); files PIL can't open are read by imageio. ValueError naming what is unusable."""
    import warnings

    import numpy as np
    try:
        from PIL import Image
        # a large photo is fine (it is scaled down); past twice PIL's pixel limit Image.open refuses it. A filter for
        # the process: catch_warnings is not thread-safe, and the UI reads uploads on gradio's worker threads
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        with Image.open(path) as im:
            if im.mode not in ("I", "I;16", "I;16B", "I;16L", "F"):
                return np.asarray(im.convert("RGB"))
            a = np.asarray(im)
    except (ImportError, OSError):  # (PIL.UnidentifiedImageError is an OSError)
        import imageio.v2 as imageio
        a = np.asarray(imageio.imread(path))
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 2, 3, 4):
        raise ValueError(f"not a single image with 1-4 channels (array of shape {a.shape})")
    a = a[..., :1].repeat(3, -1) if a.shape[-1] <= 2 else a[..., :3]
    if a.dtype == np.uint8:
        return a
    kind = a.dtype.kind
    if kind not in "uif":
        raise ValueError(f"pixels of type {a.dtype}")
    a = np.nan_to_num(a.astype(np.float64))
    if kind == "f":
        a = a * 255 if a.max() <= 1 else a
    else:  # 16-bit samples (PIL's "I" mode holds 16-bit PNGs too)
        a = a / 65535 * 255
    return np.clip(a, 0, 255).round().astype(np.uint8)


def unreadable_reason(e: Exception) -> str:
    """Why image_array failed, in one line (imageio's "Could not find a backend to open ... with iomode `ri`": the
    file is in no format it knows)."""
    from qvg.pipelines.state_dicts import first_line
    why = first_line(e)
    return "not an image format imageio reads" if "could not find a backend" in why.lower() else why


def size_problem(a) -> str | None:
    """What is wrong with an image array's size as a start image (after its name in a message), or None."""
    if min(a.shape[:2]) < MIN_IMAGE_SIDE:
        return (f"is {a.shape[1]} x {a.shape[0]} pixels; give one at least {MIN_IMAGE_SIDE} pixels on each side "
                "(it is scaled to the model's view)")
    return None
