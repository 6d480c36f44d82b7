"""kernels/launch.py: the fast launch path binds arguments as Triton does (order, defaults, constexprs, options),
keys every specialization Triton makes, and falls back to Triton's own path where it cannot key. On the CPU with a
stand-in kernel object; on CUDA with real kernels, where a fast launch must give bitwise Triton's result."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl

from qvg.kernels import launch as L


class _Compiled:
    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = "fn-handle", "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("md", grid, stream)

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """A stand-in for a JITFunction with parameters (x, n, D: constexpr, FLAG: constexpr = 7)."""

    def __init__(self):
        P = inspect.Parameter
        self.params = [SimpleNamespace(name="x", default=P.empty, is_constexpr=False),
                       SimpleNamespace(name="n", default=P.empty, is_constexpr=False),
                       SimpleNamespace(name="D", default=P.empty, is_constexpr=True),
                       SimpleNamespace(name="FLAG", default=7, is_constexpr=True)]
        self.slow, self.compiled = [], []

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.slow.append((grid, args, kw))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(L, "ENABLED", True)
    monkeypatch.setattr(L, "_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda dev: 1234)
    monkeypatch.setattr(L, "_PLANS", {})
    monkeypatch.setattr(L, "_BROKEN", set())


def test_bind_fills_defaults_and_separates_options():
    plan = L.Plan(_FakeJit())
    t = torch.zeros(4)
    vals, options = plan.bind((t, 5), dict(D=16, num_warps=4, num_stages=2))
    assert vals == [t, 5, 16, 7] and options == (("num_stages", 2), ("num_warps", 4))
    with pytest.raises(TypeError):
        plan.bind((t,), dict(D=16))  # n missing


def test_key_follows_triton_specialization():
    plan = L.Plan(_FakeJit())
    base = torch.zeros(64)

    def key(x, n, D=16, **opt):
        return plan.key(*plan.bind((x, n), dict(D=D, **opt)))
    assert key(base, 5) == key(torch.ones(64), 7)  # same dtype and alignment, ints of one class
    assert key(base, 5) != key(base.double(), 5)  # dtype
    assert key(base, 5) != key(base[1:], 5)  # data pointer 16-byte aligned or not
    assert key(base, 5) != key(base, 32)  # divisible by 16
    assert key(base, 5) != key(base, 1)  # == 1
    assert key(base, 5) != key(base, 2 ** 40)  # int64
    assert key(base, 5) != key(base, 5, D=32)  # a constexpr's value
    assert key(base, 5) != key(base, 5, num_warps=8)  # a launch option
    assert key(base, 0.5) == key(base, 2.5) != key(base, 5)  # floats by type
    with pytest.raises(TypeError):
        key(base, __import__("numpy").int64(5))  # an int Triton specializes but this key does not know


def test_constexprs_equal_in_python_but_not_to_triton_get_their_own_keys():
    plan = L.Plan(_FakeJit())
    x = torch.zeros(64)
    keys = {plan.key(*plan.bind((x, 5), dict(D=d))) for d in (1, True, 1.0)}
    assert len(keys) == 3


def test_key_is_no_coarser_than_this_tritons_specialization():
    """For one runtime parameter: wherever two values get the same key, Triton's own specialization of them (the
    installed Triton's, which runs on the CPU) is the same too."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    P = inspect.Parameter
    plan = L.Plan(SimpleNamespace(params=[SimpleNamespace(name="a", default=P.empty, is_constexpr=False)]))
    f32, bf16, i32 = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.int32)
    values = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 40, 2 ** 40 + 1, 2 ** 63 - 16, 2 ** 63,
              True, False, 0.5, 16.0, None, f32, f32[1:], f32[4:], bf16, bf16[8:], bf16[1:], i32, i32[2:]]
    spec = [native_specialize_impl(BaseBackend, v, False, True, True) for v in values]
    keys = [plan.key([v], ()) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            if keys[i] == keys[j]:
                assert spec[i] == spec[j], (values[i], values[j])


def _probe(x_ptr, n, D: tl.constexpr, FLAG: tl.constexpr = 7):  # a kernel's signature, for Plan
    pass


def test_plan_reads_a_real_jit_functions_parameters():
    from triton.runtime.jit import JITFunction
    plan = L.Plan(JITFunction(_probe))
    assert plan.names == ["x_ptr", "n", "D", "FLAG"] and plan.constexpr == [False, False, True, True]
    assert plan.defaults[:3] == [L._EMPTY] * 3 and plan.defaults[3] == 7


def test_first_call_goes_through_triton_later_calls_launch_directly(fast):
    fn = _FakeJit()
    x = torch.zeros(64)
    k1 = L.launch(fn, (3, 2), x, 5, D=16, num_warps=4)
    assert len(fn.slow) == 1 and k1 is fn.compiled[0]
    k2 = L.launch(fn, (3, 2), x, 9, D=16, num_warps=4)
    assert k2 is k1 and len(fn.slow) == 1
    (call,) = k1.calls
    assert call[:6] == (3, 2, 1, 1234, "fn-handle", "meta")  # grid padded to 3-D, the stream, handle, metadata
    assert call[6:9] == (None, None, None)  # no launch hook registered: no launch metadata, no hook calls
    assert call[9:] == (x, 9, 16, 7)  # every parameter in order, the constexpr and its default included
    L.launch(fn, (3, 2), x[1:], 9, D=16, num_warps=4)  # another specialization: through Triton again
    assert len(fn.slow) == 2


def test_launch_hooks_get_their_metadata(fast, monkeypatch):
    """With a launch hook registered (a profiler, say), the launcher gets the hooks and the launch metadata, as
    Triton's own path gives them."""
    from triton import knobs
    seen = []
    hook = seen.append
    if hasattr(knobs.runtime.launch_enter_hook, "add"):
        knobs.runtime.launch_enter_hook.add(hook)
        undo = lambda: knobs.runtime.launch_enter_hook.remove(hook)  # noqa: E731
    else:
        old = knobs.runtime.launch_enter_hook
        knobs.runtime.launch_enter_hook = hook
        undo = lambda: setattr(knobs.runtime, "launch_enter_hook", old)  # noqa: E731
    try:
        fn = _FakeJit()
        x = torch.zeros(64)
        L.launch(fn, (2,), x, 5, D=16)
        k = L.launch(fn, (2,), x, 5, D=16)
    finally:
        undo()
    (call,) = k.calls
    assert call[6] == ("md", (2,), 1234) and call[7] is knobs.runtime.launch_enter_hook


def test_fallbacks(fast, monkeypatch):
    fn = _FakeJit()
    x = torch.zeros(64)
    L.launch(fn, (1,), x, 5, D=16)
    L.launch(fn, (1,), x, 5, D=16, n=6)  # n given twice: Triton's path (which refuses it)
    assert len(fn.slow) == 2
    fn.pre_run_hooks = [lambda *a, **k: None]  # hooks added after the key was cached: Triton's path runs them
    L.launch(fn, (1,), x, 5, D=16)
    assert len(fn.slow) == 3
    fn = _FakeJit()
    L.launch(fn, lambda meta: (1,), x, 5, D=16)  # a grid function
    L.launch(fn, (1,), x, 5, D=[16])  # an unhashable constexpr
    L.launch(fn, (1,), x, 5, D=[16])
    assert len(fn.slow) == 3 and not L._PLANS[id(fn)].compiled
    monkeypatch.setattr(L, "ENABLED", False)
    L.launch(fn, (1,), x, 5, D=16)
    L.launch(fn, (1,), x, 5, D=16)
    assert len(fn.slow) == 5


def test_debug_knob_is_part_of_the_key(fast, monkeypatch):
    """Triton compiles another kernel when its debug knob is on; so does the key."""
    from triton import knobs
    fn = _FakeJit()
    x = torch.zeros(64)
    L.launch(fn, (1,), x, 5, D=16)
    L.launch(fn, (1,), x, 5, D=16)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    L.launch(fn, (1,), x, 5, D=16)
    assert len(fn.slow) == 2


def test_kernel_without_the_expected_attributes_is_left_to_triton(fast):
    class Uncompiled(_FakeJit):  # its launch returns nothing this module could launch directly
        def __getitem__(self, grid):
            return lambda *a, **k: self.slow.append(grid)
    fn = Uncompiled()
    for _ in range(3):
        L.launch(fn, (1,), torch.zeros(64), 5, D=16)
    assert len(fn.slow) == 3 and id(fn) in L._BROKEN and id(fn) not in L._PLANS


def test_every_kernel_launch_goes_through_launch():
    """No `kernel[grid](...)` call is left in kernels/ (each would pay Triton's binding on every call)."""
    import ast
    import pathlib
    folder = pathlib.Path(L.__file__).parent
    left = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "launch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                left.append(f"{path.name}:{node.lineno}")
    assert not left, f"launch these through kernels.launch.launch: {left}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled launch path needs a GPU")
def test_fast_launch_equals_triton_on_cuda(monkeypatch):
    """compress + dequant at two specializations (aligned and not): with the fast path on, the second and later
    calls launch directly and give bitwise what Triton's own path gives."""
    import qvg
    from kernel_helpers import clustered
    x = clustered(1, 4, 320, 128, spread=1.0, noise=0.5, seed=3).bfloat16().cuda()
    warm = qvg.compress(x, "qvg-pro", centroids=16, seed=1).tensors["centroids"]

    def run():
        p = qvg.compress(x, "qvg-pro", centroids=16, init=warm, check_finite=False)
        return p, qvg.decompress(p)
    monkeypatch.setattr(L, "ENABLED", False)
    want_p, want = run()
    monkeypatch.setattr(L, "ENABLED", True)
    monkeypatch.setattr(L, "_PLANS", {})
    for _ in range(3):
        got_p, got = run()
        assert torch.equal(got, want)
        for name, t in want_p.tensors.items():
            assert torch.equal(got_p.tensors[name], t), name
    assert L._PLANS and all(p.compiled for p in L._PLANS.values())
