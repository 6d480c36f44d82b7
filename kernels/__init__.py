"""qvg.kernels: Triton kernels; each mirrors a pure-torch reference in qvg/ and is tested against it."""
from qvg._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # its modules as attributes, imported when used
