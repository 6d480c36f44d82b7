"""qvg.pipelines: chunk-wise auto-regressive model loops (model + cache + loop)."""
from qvg._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # its modules as attributes, imported when used
