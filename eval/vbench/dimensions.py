"""VBench dimensions (definitions after Vchitect/VBench; every frame of the video is used, as VBench's
`load_video` returns them all):

- subject_consistency (DINO ViT-B/16) and background_consistency (CLIP ViT-B/32): per frame i a unit-normalised
  feature f_i; for i = 1 .. F-1, s_i = (max(0, cos(f_{i-1}, f_i)) + max(0, cos(f_0, f_i))) / 2; the video's score
  is the mean of s_i. Over a set of videos VBench divides the sum of every s_i by their count (a frame-weighted
  mean; equal to the mean of the videos' scores when they have the same length). Range [0, 1], higher = steadier.
- aesthetic_quality: per frame the LAION head on the unit-normalised CLIP ViT-L/14 image embedding, divided by
  10; the video's score is the mean over frames; over a set, the mean over videos. Roughly [0, 1].
- imaging_quality: per frame pyiqa's MUSIQ trained on SPAQ (`musiq.py`), after VBench's "longer" resize
  (`preprocess.musiq_input`), a score on SPAQ's 0..100 scale; the video's score is the mean over frames / 100; over
  a set, the mean over videos. Roughly [0, 1], higher = fewer distortions (noise, blur, over-exposure).

Preprocessing: `preprocess.py`. Backbones: `backbones.py`, `musiq.py`. A scorer's `weight_files` are the files its
backbones were read from (none for random ones).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights import MissingWeights, available, used_files, weight_paths
from . import backbones, musiq, preprocess

DIMENSIONS = ("subject_consistency", "background_consistency", "aesthetic_quality", "imaging_quality")


def consistency(features: torch.Tensor) -> float:
    """VBench's consistency score of per-frame features [F, C] (F >= 2)."""
    if features.shape[0] < 2:
        raise ValueError("a consistency score needs at least 2 frames")
    f = F.normalize(features.float(), dim=-1)
    prev = (f[1:] * f[:-1]).sum(-1).clamp(min=0)
    first = (f[1:] * f[:1]).sum(-1).clamp(min=0)
    return float(((prev + first) / 2).mean())


def _batched(fn, x: torch.Tensor, batch: int, device) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([fn(x[i:i + batch].to(device)).float().cpu() for i in range(0, x.shape[0], batch)])


class _Scorer:
    @property
    def weight_files(self) -> list:
        return used_files(self.model, getattr(self, "head", None))


class SubjectConsistency(_Scorer):
    name = "subject_consistency"

    def __init__(self, weights=None, device="cpu", config=None, batch: int = 16):
        self.model = backbones.load_dino(weights, device, config)
        self.device, self.batch = device, batch

    def features(self, video: torch.Tensor) -> torch.Tensor:
        x = preprocess.dino_input(video)
        return _batched(lambda b: backbones.dino_features(self.model, b), x, self.batch, self.device)

    def __call__(self, video: torch.Tensor) -> float:
        return consistency(self.features(video))


class BackgroundConsistency(_Scorer):
    name = "background_consistency"
    clip_key = "clip-b32"

    def __init__(self, weights=None, device="cpu", config=None, batch: int = 16):
        self.model = backbones.load_clip(self.clip_key, weights, device, config)
        self.device, self.batch = device, batch

    def features(self, video: torch.Tensor) -> torch.Tensor:
        size = self.model.config.image_size
        x = preprocess.clip_input(video, size)
        return _batched(lambda b: backbones.clip_features(self.model, b), x, self.batch, self.device)

    def __call__(self, video: torch.Tensor) -> float:
        return consistency(self.features(video))


class AestheticQuality(BackgroundConsistency):
    name = "aesthetic_quality"
    clip_key = "clip-l14"

    def __init__(self, weights=None, device="cpu", config=None, batch: int = 16):
        if config is None:  # both files, or one error naming every missing one
            try:
                weight_paths([self.clip_key, "laion-aesthetic"], weights)
            except MissingWeights:
                if available(self.clip_key, weights):  # a CLIP folder that is there but broken: that error first
                    backbones.load_clip(self.clip_key, weights, device)
                raise
        super().__init__(weights, device, config, batch)
        dim = self.model.config.projection_dim if config is not None else None
        self.head = backbones.load_aesthetic_head(weights, device, dim)

    def frame_scores(self, video: torch.Tensor) -> torch.Tensor:
        f = F.normalize(self.features(video), dim=-1)
        with torch.no_grad():
            return self.head(f.to(self.device)).float().cpu()[:, 0] / 10

    def __call__(self, video: torch.Tensor) -> float:
        return float(self.frame_scores(video).mean())


class ImagingQuality(_Scorer):
    name = "imaging_quality"

    def __init__(self, weights=None, device="cpu", config=None, batch: int = 8):
        self.model = musiq.load_musiq(weights, device, config)
        self.device, self.batch = device, batch

    def frame_scores(self, video: torch.Tensor) -> torch.Tensor:
        """MUSIQ's score of each frame (0..100 for SPAQ; not yet divided by 100)."""
        return _batched(self.model, preprocess.musiq_input(video), self.batch, self.device)

    def __call__(self, video: torch.Tensor) -> float:
        scores = self.frame_scores(video).tolist()
        return sum(scores) / len(scores) / 100  # VBench: the frames' mean (a float sum), then / 100


CLASSES = {c.name: c for c in (SubjectConsistency, BackgroundConsistency, AestheticQuality, ImagingQuality)}


def load_dimensions(names=DIMENSIONS, weights=None, device="cpu", configs: dict | None = None) -> dict:
    """{name: scorer or the one-line reason it is unavailable (str: weights or transformers missing)} for the
    dimensions asked for; a weights file that is there but broken raises BadWeights (one line naming it). configs:
    {name: backbone config} builds randomly initialised backbones (tests)."""
    from ..weights import MissingWeights
    out = {}
    for n in names:
        if n not in CLASSES:
            raise ValueError(f"unknown VBench dimension {n!r}; choose from: {', '.join(DIMENSIONS)}")
        try:
            out[n] = CLASSES[n](weights, device, (configs or {}).get(n))
        except MissingWeights as e:
            out[n] = str(e)
        except ImportError as e:  # transformers missing
            out[n] = f"not computed: {e}"
    return out
