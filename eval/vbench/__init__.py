"""VBench dimensions re-implemented after VBench's definitions (Huang et al. 2024, Vchitect/VBench), on local
weights (`qvg.eval.weights`), without torchvision:

- subject_consistency: DINO ViT-B/16 CLS features;
- background_consistency: CLIP ViT-B/32 image embeddings;
- aesthetic_quality: CLIP ViT-L/14 image embeddings -> the LAION aesthetic linear head, / 10;
- imaging_quality: pyiqa's MUSIQ trained on SPAQ (`musiq.py`, a port checked against pyiqa's) / 100.

    from qvg.eval.vbench import load_dimensions
    dims = load_dimensions(["subject_consistency", "aesthetic_quality"], weights="~/qvg-weights")
    dims["subject_consistency"](video)   # video [3, F, H, W] in [-1, 1] -> float

Definitions and preprocessing are in `dimensions.py` and `preprocess.py`; MUSIQ in `musiq.py`.
"""
from .dimensions import (DIMENSIONS, AestheticQuality, BackgroundConsistency, ImagingQuality, SubjectConsistency,
                         consistency, load_dimensions)

__all__ = ["DIMENSIONS", "SubjectConsistency", "BackgroundConsistency", "AestheticQuality", "ImagingQuality",
           "consistency", "load_dimensions"]
