"""Re-export of tests/conftest.py's helper functions into a subfolder's conftest.

pytest imports a conftest.py outside a package as the module `conftest`, so a subfolder's conftest.py (tests/kernels/,
tests/eval/) evicts tests/conftest.py from sys.modules. Test modules of tests/ collected after it do `from conftest
import gen, ...`, so each subfolder conftest calls `reexport(globals())`: tests/conftest.py loaded again under a
private name, its public functions copied in (its hooks and fixtures are left out: pytest already registered them
from the original module)."""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path


def reexport(namespace: dict) -> None:
    path = Path(__file__).resolve().parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("_qvg_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, obj in vars(mod).items():
        if (inspect.isfunction(obj) and obj.__module__ == mod.__name__ and not name.startswith(("pytest_", "_"))
                and name not in namespace):
            namespace[name] = obj
