"""VBench's frame preprocessing in pure torch (VBench's torchvision transforms, the same operations here, so
nothing imports torchvision). VBench's load_video hands every dimension float32 frames (torch.Tensor of the uint8
array), so its transforms work in float and nothing is rounded back to 8 bits:

- frames: the video's 8-bit frames ([-1, 1] -> uint8 as the mp4 writer rounds);
- `resize_short(x, n, mode)`: torchvision `Resize(n, antialias=False)` on float frames: the short side -> n, the
  long side -> int(n * long / short); `F.interpolate(mode, align_corners=False, antialias=False)`, kept in float
  (bicubic's overshoot past 0 and 255 included, as torchvision keeps it for a float input);
- `center_crop(x, n)`: torchvision's CenterCrop (offsets int(round((H - n) / 2)));
- `normalize(x, mean, std)`: x / 255, then (x - mean) / std per channel.

DINO (subject consistency): resize_short(224, bilinear), /255, ImageNet mean/std, no crop.
CLIP (background consistency, aesthetic quality): resize_short(224, bicubic), center_crop(224), /255, CLIP's
mean/std.
MUSIQ (imaging quality): `vbench_longer(x, 512)`, VBench's default "longer" rule: a frame whose longer side exceeds
512 is resized (bilinear, antialias=False) to (int(s * H), int(s * W)), s = 512 / max(H, W), in float; then /255
(MUSIQ maps [0, 1] to [-1, 1] itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def frames_uint8(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> [F, 3, H, W] uint8."""
    from ..video import to_uint8
    return to_uint8(video)


def resize_short(x: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """Frames [F, 3, H, W] (0..255) -> float, the short side n (see the module docstring)."""
    x = x.float()
    h, w = x.shape[-2:]
    if h <= w:
        size = (n, int(n * w / h))
    else:
        size = (int(n * h / w), n)
    if (h, w) == size:
        return x
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=False)


def center_crop(x: torch.Tensor, n: int) -> torch.Tensor:
    h, w = x.shape[-2:]
    top, left = int(round((h - n) / 2.0)), int(round((w - n) / 2.0))
    return x[..., top:top + n, left:left + n]


def normalize(x: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return (x.float() / 255.0 - m) / s


def dino_input(video: torch.Tensor, n: int = 224) -> torch.Tensor:
    return normalize(resize_short(frames_uint8(video), n, "bilinear"), IMAGENET_MEAN, IMAGENET_STD)


def clip_input(video: torch.Tensor, n: int = 224) -> torch.Tensor:
    return normalize(center_crop(resize_short(frames_uint8(video), n, "bicubic"), n), CLIP_MEAN, CLIP_STD)


def vbench_longer(x: torch.Tensor, n: int = 512) -> torch.Tensor:
    """Frames [F, 3, H, W] (0..255) -> float, the longer side brought down to n when above it (never up)."""
    x = x.float()
    h, w = x.shape[-2:]
    if max(h, w) <= n:
        return x
    s = float(n) / max(h, w)
    return F.interpolate(x, size=(int(s * h), int(s * w)), mode="bilinear", align_corners=False, antialias=False)


def musiq_input(video: torch.Tensor, n: int = 512) -> torch.Tensor:
    return vbench_longer(frames_uint8(video), n) / 255.0
