"""Setup of the Triton kernel tests (tests/kernels/).

Without CUDA the kernels run under Triton's CPU interpreter: TRITON_INTERPRET=1 must be in the environment before
`qvg.kernels.common` is imported (it reads the variable at import time into `INTERPRET`, which makes the kernels
round to BF16 by hand like the GPU) and before any `@triton.jit` function is defined (triton then builds
interpreted functions). pytest imports this file before it imports any test module of this folder, so setting it
here is early enough. An explicit TRITON_INTERPRET in the environment wins. With CUDA the same tests run on CUDA
tensors, compiled.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_common = sys.modules.get("qvg.kernels.common")
if _common is not None and _common.INTERPRET != (os.environ.get("TRITON_INTERPRET", "0") == "1"):
    raise RuntimeError("qvg.kernels was imported before tests/kernels/conftest.py set TRITON_INTERPRET; the "
                       "kernels would run in the wrong mode. Import qvg.kernels only inside tests/kernels/.")

import pytest  # noqa: E402


# pytest imports a conftest.py outside a package as the module `conftest`, evicting tests/conftest.py from
# sys.modules. Test modules of tests/ collected after this file do `from conftest import gen, ...`, so this module
# re-exports the helper functions of tests/conftest.py (loaded under a private name; its hooks and fixtures are
# left out: pytest already registered them from the original module).
def _reexport_parent_helpers() -> None:
    path = Path(__file__).resolve().parent.parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("_qvg_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, obj in vars(mod).items():
        if (inspect.isfunction(obj) and obj.__module__ == mod.__name__ and not name.startswith(("pytest_", "_"))
                and name not in globals()):
            globals()[name] = obj


_reexport_parent_helpers()


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests run: CUDA when available, else the CPU (Triton interpreter)."""
    return "cuda" if CUDA else "cpu"
