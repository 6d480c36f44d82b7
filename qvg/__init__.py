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
from ._lazy import submodule_getattr

__all__ = ["compress", "decompress", "methods", "bits_per_element", "Packed", "QuantSpec"]
__version__ = "0.1.0"

# The public names are imported when first used, as the submodules are, so that `import qvg` (which every entry
# point runs before its own code: qvg-generate's Ctrl-C in its first seconds was a torch-import traceback) loads
# no torch. `from qvg import compress` works as before.
_EXPORTS = {"compress": "compression", "decompress": "compression", "methods": "compression",
            "bits_per_element": "compression", "Packed": "packed", "QuantSpec": "quant"}
_submodule = submodule_getattr(__name__)  # qvg.cache, qvg.pipelines, ... after a bare `import qvg`


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    return _submodule(name)


def __dir__():
    return sorted({*globals(), *__all__})
