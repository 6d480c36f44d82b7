"""Loading a reference package's own source files without importing the package (the parity checks of
eval/musiq_parity.py and eval/lpips_parity.py): find its folder, stand in for the modules it imports, load single
files or single functions, and leave sys.modules as it was."""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Callable


def source_folder(package: str, env: str, explicit, ok: Callable[[Path], bool]) -> Path | None:
    """The folder holding `package`/ (ok(folder / package) true): `explicit`, else $env, else an installed copy."""
    for cand in (explicit, os.environ.get(env)):
        if cand and ok(Path(cand) / package):
            return Path(cand)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or []) if spec else []
    return Path(locs[0]).parent if locs and ok(Path(locs[0])) else None


def stand_in(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    """An empty module registered as `name` (a package when `path` is given), holding `attrs`."""
    m = types.ModuleType(name)
    if path is not None:
        m.__path__ = [str(path)]
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def load(name: str, path: Path) -> types.ModuleType:
    """One source file executed as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def exec_function(path: Path, name: str, namespace: dict) -> None:
    """Define only the top-level function `name` of the file at `path` in `namespace`."""
    fn = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)


@contextlib.contextmanager
def isolated_modules(*roots: str):
    """Modules under `roots` are taken out of sys.modules for the block, and those present before come back after
    (whatever the block registered under them is dropped)."""
    def mine(k):
        return k.split(".")[0] in roots
    saved = {k: v for k, v in sys.modules.items() if mine(k)}
    for k in saved:
        del sys.modules[k]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if mine(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
