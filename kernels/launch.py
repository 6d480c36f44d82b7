"""Cached Triton launches for kernels launched every attention call (the history's decode: 300 launches per
Self-Forcing chunk). `kernel[grid](...)` binds and specializes every argument in Python before it launches: ~55 us
of host time per launch for the dequant kernel's 40 arguments on the H100 machine, more than the 46 us its
launch runs on the GPU (eval/results/launch-overhead-h100.json), and the pipeline's GPU then waits on the host.
`FastLaunch(kernel)(grid, *args, **kw)` does the first launch of each specialization through Triton (which compiles
and returns the compiled kernel), then launches that compiled kernel directly with the same arguments.

The cache key holds what Triton specializes on: every constexpr's value, each tensor's dtype and 16-byte
alignment, each integer's type range, value 1 and divisibility by 16 (Triton's integer specializations), and the
compile options (num_warps, ...). Under TRITON_INTERPRET=1, on a Triton without the compiled-kernel `run` this was
written for (3.3 and later), or while a launch hook is set (profilers), every call takes Triton's own path.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .common import INTERPRET

try:
    from triton import knobs as _knobs
except ImportError:  # (Triton < 3.3: no direct path)
    _knobs = None


def _hooks_set() -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps an empty HookChain there when none is)."""
    rt = _knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _spec(value, constexpr: bool):
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return type(value), value if isinstance(value, bool) else None
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, 0 <= value < 2 ** 64
    return type(value), value


class FastLaunch:
    """A Triton kernel's launches, each specialization's compiled kernel reused without re-binding (see module)."""

    def __init__(self, kernel):
        self.kernel = kernel
        if hasattr(kernel, "params"):  # a JITFunction
            self.names = [p.name for p in kernel.params]
            self.constexpr = [p.is_constexpr for p in kernel.params]
        else:  # the interpreter's wrapper: the same from the signature
            sig = inspect.signature(kernel.fn).parameters.values()
            self.names = [p.name for p in sig]
            self.constexpr = [p.annotation in (tl.constexpr, "tl.constexpr", "constexpr") for p in sig]
        self.direct = (_knobs is not None and not INTERPRET
                       and tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 3))
        self.compiled: dict = {}
        self.direct_launches = 0  # (tests: the direct path was taken)

    def key(self, args: tuple, kw: dict) -> tuple[tuple, list]:
        """(the specialization key, every parameter's value in order) of a call."""
        missing = [n for n in self.names[len(args):] if n not in kw]
        if missing:
            raise TypeError(f"{self.names}: FastLaunch needs every parameter, missing {missing}")
        params = list(args) + [kw[n] for n in self.names[len(args):]]
        options = tuple(sorted((k, v) for k, v in kw.items() if k not in self.names))
        return (options, tuple(_spec(v, c) for v, c in zip(params, self.constexpr))), params

    def __call__(self, grid: tuple, *args, **kw):
        if not self.direct or _hooks_set():
            return self.kernel[grid](*args, **kw)
        key, params = self.key(args, kw)
        key = (torch.cuda.current_device(), key)
        compiled = self.compiled.get(key)
        if compiled is None:  # Triton binds, compiles (once) and launches
            self.compiled[key] = self.kernel[grid](*args, **kw)
            return
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *params)
        self.direct_launches += 1
