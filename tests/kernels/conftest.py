"""Setup of the Triton kernel tests (tests/kernels/).

Without CUDA the kernels run under Triton's CPU interpreter: TRITON_INTERPRET=1 must be in the environment before
`qvg.kernels.common` is imported (it reads the variable at import time into `INTERPRET`, which makes the kernels
round to BF16 by hand like the GPU) and before any `@triton.jit` function is defined (triton then builds
interpreted functions), triton.language's own included. tests/conftest.py sets it (test modules elsewhere may
import triton while pytest collects them, before this file runs); this file sets it again for a run rooted here and
checks that neither qvg.kernels nor triton was loaded in the other mode. An explicit TRITON_INTERPRET in the
environment wins. With CUDA the same tests run on CUDA tensors, compiled.
"""
from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_common = sys.modules.get("qvg.kernels.common")
if _common is not None and _common.INTERPRET != (os.environ.get("TRITON_INTERPRET", "0") == "1"):
    raise RuntimeError("qvg.kernels was imported before tests/kernels/conftest.py set TRITON_INTERPRET; the "
                       "kernels would run in the wrong mode. Import qvg.kernels only inside tests/kernels/.")
_helper = getattr(sys.modules.get("triton.language.standard"), "max", None)  # (one of triton's own @jit helpers,
if _helper is not None and not CUDA and type(_helper).__name__ != "InterpretedFunction":  # built when triton loads)
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it): its own "
                       "@jit helpers were built compiled, and the interpreted kernels that call them would fail.")

import pytest  # noqa: E402
from parent_helpers import reexport  # noqa: E402

reexport(globals())  # (tests/conftest.py's helpers for the top-level test modules collected after this file)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests run: CUDA when available, else the CPU (Triton interpreter)."""
    return "cuda" if CUDA else "cpu"
