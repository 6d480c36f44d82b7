"""`need(module, how)`: a test's optional dependency, or the test skipped. Under CI (CI=true), where .ci/run installs
the test extra, a missing one fails instead, so CI never skips a test silently."""
from __future__ import annotations

import importlib
import os

import pytest


def need(module: str, how: str):
    """The imported module, or skip (fail under CI) saying `how` to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"{module} is not installed", how)


def missing(what: str, how: str):
    """Skip the test because `what` (fail under CI, which installs everything the tests use), saying `how` to get it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} under CI ({how})")
    pytest.skip(f"{what} ({how})", allow_module_level=True)  # (also called at a test module's top)
