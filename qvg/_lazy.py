"""Submodules as attributes: after a bare `import qvg`, `qvg.cache.KVCache` or `qvg.pipelines.world_model` import
the module when first used (Python imports a package's submodules only when asked), so `import qvg` stays light."""
from __future__ import annotations

import importlib
import importlib.util


def submodule_getattr(package: str):
    """A package's module-level __getattr__ (PEP 562): its submodule `name`, imported, or AttributeError."""
    def __getattr__(name: str):
        if name.isidentifier() and not name.startswith("_"):
            try:
                found = importlib.util.find_spec(f"{package}.{name}") is not None
            except (ImportError, ValueError):
                found = False
            if found:
                return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
