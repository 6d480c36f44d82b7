"""Rebuild assets/photos/ from the photos scikit-image ships (`python -m qvg.assets.build_photos`; needs
scikit-image, which nothing else in the project does). Each is stored as an RGB PNG at most 384 px on its longer
side. HELD_OUT are never shown to the embedded model in training: its evaluation runs on them."""
from __future__ import annotations

from pathlib import Path

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "camera", "brick", "grass", "gravel", "moon", "coins", "clock", "page", "text", "cell")
HELD_OUT = ("coffee", "camera")
MAX_SIDE = 384


def main(argv: list[str] | None = None) -> int:
    from qvg.help_format import OneLineParser
    import importlib.util
    import sys
    ap = OneLineParser(prog="python -m qvg.assets.build_photos", description="Rebuild the bundled photos "
                                 "from scikit-image's (pip install scikit-image).")
    ap.add_argument("--out", default=None, help="output folder (default: the package's assets/photos, which the "
                    "embedded model and qvg-generate read)")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("skimage") is None:
        print("build_photos: error: needs scikit-image (pip install scikit-image)", file=sys.stderr)
        return 2
    import imageio.v2 as imageio
    import numpy as np
    import skimage.data
    import torch
    import torch.nn.functional as F
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "photos"
    out.mkdir(parents=True, exist_ok=True)
    for name in PHOTOS:
        a = np.asarray(getattr(skimage.data, name)())
        if a.ndim == 2:
            a = np.repeat(a[..., None], 3, -1)
        x = torch.from_numpy(a[..., :3].astype(np.float32)).permute(2, 0, 1)[None]
        s = MAX_SIDE / max(x.shape[-2:])
        if s < 1:
            x = F.interpolate(x, scale_factor=s, mode="area")
        img = x[0].permute(1, 2, 0).round().clamp(0, 255).byte().numpy()
        imageio.imwrite(out / f"{name}.png", img)
        print(name, img.shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
