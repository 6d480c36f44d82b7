"""`launch(kernel, grid, *args, **kw)`: `kernel[grid](*args, **kw)` without Triton's per-call binding once a
specialization has been launched.

Why: Triton 3.6's `JITFunction.run` spends tens of microseconds of host time on every launch (binding the
arguments, specializing them, hashing a cache key, building launch metadata) before it calls the compiled kernel's
launcher. An eager qvg compress is 15 launches (57 for qvg-pro), so on a slow host the call is bound by that, not by
the GPU (eval/results/compress-host-h200.249597f.json: 1.03 ms of host time for 0.65 ms of GPU work).

How: the first call with a given key goes through Triton (which compiles when needed) and keeps the compiled
kernel `JITFunction.run` returns; later calls with the same key hand the launcher the argument list Triton would
build (every parameter in order, defaults filled in, constexprs included), with the same stream, grid and launch
hooks. The key holds everything Triton specializes a kernel on, or finer: the device; each tensor's dtype and
whether its data pointer is 16-byte aligned; each int's width class, whether it equals 1 and whether 16 divides it;
the type of every other runtime argument; the value and type of every constexpr; the launch options (num_warps,
...); Triton's debug and instrumentation knobs. A finer key than Triton's only means two entries for one compiled
kernel.

Triton's own path runs instead: under TRITON_INTERPRET=1, with QVG_FAST_LAUNCH=0, for a grid given as a function,
for an argument the key cannot hash or given twice, for a kernel with pre-run hooks, and for one this Triton does
not expose as expected (then for good). Not repeated per call, unlike Triton's own path: the check that a kernel's
global constants have not changed since it was compiled (this package's kernels read none that change).
"""
from __future__ import annotations

import inspect
import operator
import os

import torch
from triton import knobs

from .common import INTERPRET

ENABLED = not INTERPRET and os.environ.get("QVG_FAST_LAUNCH", "1") != "0"
_I32 = (-2 ** 31, 2 ** 31 - 1)
_EMPTY = object()  # a parameter without a default


class Plan:
    """One kernel's parameters (names, defaults, which are constexprs) and its compiled kernels by key."""

    def __init__(self, fn):
        params = fn.params
        self.fn = fn
        self.names = [p.name for p in params]
        self._known = frozenset(self.names)
        self.defaults = [_EMPTY if p.default is inspect.Parameter.empty else p.default for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        cidx = [i for i, c in enumerate(self.constexpr) if c]
        ridx = [i for i, c in enumerate(self.constexpr) if not c]
        self._consts = operator.itemgetter(*cidx) if len(cidx) > 1 else (lambda v: tuple(v[i] for i in cidx))
        self._runtime = operator.itemgetter(*ridx) if len(ridx) > 1 else (lambda v: tuple(v[i] for i in ridx))
        self.compiled: dict = {}
        self._rests: dict = {}  # positional arguments given -> the (name, default) of the others

    def bind(self, args: tuple, kw: dict) -> tuple[list, tuple]:
        """(every parameter's value in order, the launch options as sorted items); TypeError where a parameter
        has no value (Triton's own path then reports it)."""
        if kw and not kw.keys().isdisjoint(self.names[:len(args)]):
            raise TypeError("an argument given by position and by name")
        vals = list(args)
        for n, d in self._rest(len(args)):
            v = kw.get(n, d)
            if v is _EMPTY:
                raise TypeError(f"missing argument {n!r}")
            vals.append(v)
        extra = kw.keys() - self._known
        return vals, tuple(sorted((k, kw[k]) for k in extra)) if extra else ()

    def _rest(self, given: int) -> list:
        r = self._rests.get(given)
        if r is None:
            r = self._rests[given] = list(zip(self.names[given:], self.defaults[given:]))
        return r

    def key(self, vals: list, options: tuple) -> tuple:
        """The specialization key of `vals` (see the module docstring); TypeError for an unhashable constexpr or a
        runtime argument of another type than tensor, int, float, bool or None (a numpy integer, say)."""
        parts = []
        for a in self._runtime(vals):
            t = type(a)
            if t is torch.Tensor or isinstance(a, torch.Tensor):
                parts.append((a.dtype, a.data_ptr() & 15 == 0))
            elif t is int:  # Triton: == 1 (a constant), 16 | a, i32 / i64 / u64
                parts.append(-1 if a == 1 else (a & 15 == 0) + (0 if _I32[0] <= a <= _I32[1] else 2 if a < 2 ** 63
                                                                  else 4))
            elif t is float or a is None or t is bool:
                parts.append(t if t is float else (t, a))
            else:
                raise TypeError(f"no fast-launch key for a {t.__name__}")
        consts = self._consts(vals)
        hash(consts)  # (1, True and 1.0 are equal keys but different constexprs to Triton: their types join them)
        return tuple(parts), consts, tuple(map(type, consts)), options, knobs.runtime.debug, _instrumentation()


_PLANS: dict = {}  # id(kernel) -> Plan (module-level kernels: never freed)
_BROKEN: set = set()  # ids of kernels left to Triton


def _plan(fn) -> Plan | None:
    """fn's Plan, made on first use; None for a kernel this module leaves to Triton. (Looked up by id: a
    JITFunction's own hash recomputes its cache key.)"""
    p = _PLANS.get(id(fn))
    if p is not None and p.fn is fn:
        return p
    if id(fn) in _BROKEN:
        return None
    try:
        p = _PLANS[id(fn)] = Plan(fn)
    except (AttributeError, TypeError):
        _BROKEN.add(id(fn))
        return None
    return p


def _launchable(kernel) -> bool:
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


def launch(fn, grid, *args, **kw):
    """`fn[grid](*args, **kw)` (a Triton JITFunction), by its compiled kernel's launcher when this key has been
    launched before (see the module docstring). On the device of the first CUDA tensor among the positional args
    (Triton, and the launcher, launch on the current device: tensors on another one were refused). During a CUDA
    graph capture on another device that is an error: the kernel would run outside the graph."""
    dev = _tensor_device(args)
    if dev >= 0 and dev != torch.cuda.current_device():
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a CUDA graph is being captured on cuda:{torch.cuda.current_device()}, but this "
                               f"kernel's tensors are on cuda:{dev}: capture on their device")
        with torch.cuda.device(dev):
            return _launch(fn, grid, args, kw)
    return _launch(fn, grid, args, kw)


def _tensor_device(args) -> int:
    """The device index of the first CUDA tensor among args, or -1 (none)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return a.get_device()
    return -1


def _launch(fn, grid, args, kw):
    if not ENABLED or type(grid) is not tuple or getattr(fn, "pre_run_hooks", None):  # (hooks: Triton runs them)
        return fn[grid](*args, **kw)
    plan = _plan(fn)
    if plan is None:
        return fn[grid](*args, **kw)
    try:
        vals, options = plan.bind(args, kw)
        dev = _device()
        key = (dev, plan.key(vals, options))
        kernel = plan.compiled.get(key)
    except TypeError:
        return fn[grid](*args, **kw)
    if kernel is None:
        kernel = fn[grid](*args, **kw)
        if _launchable(kernel):
            plan.compiled[key] = kernel
        else:
            _BROKEN.add(id(fn))
            _PLANS.pop(id(fn), None)
        return kernel
    run_compiled(kernel, grid, _stream(dev), vals)
    return kernel


def _instrumentation():
    return getattr(knobs.compilation, "instrumentation_mode", None)


def _device() -> int:
    return torch.cuda.current_device()


def _stream(dev: int) -> int:
    """The current stream's handle, as Triton's CUDA driver reads it."""
    return torch._C._cuda_getCurrentRawStream(dev)


def run_compiled(kernel, grid: tuple, stream: int, vals: list) -> None:
    """What `JITFunction.run` does once it holds the compiled kernel (Triton 3.6: grid padded to three dims, launch
    metadata for the launch hooks, then the launcher); with no hook registered (no profiler), no metadata and no
    hook calls."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *vals), enter, leave, *vals)
    else:
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals)
