"""QVG (Quant VideoGen): a compressed KV cache for long auto-regressive video generation.

Public API:
    qvg.compress(x, method="qvg", *, bits=None, block_size=None, stages=None, centroids=None, seed=None, init=None,
                 **options)  (None: the method's preset; qvg's: bits=2, block_size=64, stages=1, centroids=256)
    qvg.decompress(packed) -> torch.Tensor
    qvg.methods() -> ["rtn", "kivi", "quarot", "qvg", "qvg-pro"]
    qvg.bits_per_element(method, shape, **options) -> float
    qvg.Packed (the packed container; .nbytes, .components(), .to(device))
Subpackages: qvg.app, qvg.pipelines, qvg.kernels, qvg.eval.
"""
from .compression import bits_per_element, compress, decompress, methods
from .packed import Packed
from .quant import QuantSpec
from ._lazy import submodule_getattr

__all__ = ["compress", "decompress", "methods", "bits_per_element", "Packed", "QuantSpec"]
__version__ = "0.1.0"

__getattr__ = submodule_getattr(__name__)  # qvg.cache, qvg.pipelines, ... after a bare `import qvg`
