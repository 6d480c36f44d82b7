"""Public compression API: `compress`, `decompress`, `methods`, `bits_per_element`.

Options not given take the method's preset (`qvg.methods(details=True)` lists them), so `compress(x, "qvg-pro")`
means S=4, B=16, K=256 and `compress(x, "qvg-pro", block_size=64)` overrides one of them.
"""
from __future__ import annotations

import torch

from ..kmeans import MAX_K, SEEDINGS
from ..numbers import is_int
from ..packed import Packed
from . import rtn, kivi, quarot, prq  # noqa: F401,I001  (registers the methods, in this order)
from .registry import REGISTRY, Method


def methods(details: bool = False):
    """Names of the registered methods; with details=True, {name: {"summary", "defaults", "formula"}}."""
    if not details:
        return list(REGISTRY)
    return {n: {"summary": m.summary, "defaults": dict(m.defaults), "formula": m.formula} for n, m in REGISTRY.items()}


def seeded(method: str, seed: int) -> dict:
    """{"seed": seed} for a method with a random part (k-means seeding, QuaRot's signs), else {}: rtn and kivi refuse
    a seed. For callers that run every method with one seed."""
    return {"seed": seed} if "seed" in get_method(method).defaults else {}


def kmeans_methods() -> tuple[str, ...]:
    """The methods that cluster with k-means (warm-started from the previous chunk's centroids): the ones a k-means
    seed (qvg-generate's --kmeans-seed) and a seed-variance floor over k-means seeds apply to."""
    return tuple(n for n, m in REGISTRY.items() if m.warm_start)


def get_method(name: str) -> Method:
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def resolve_options(method: str, shape, **given) -> dict:
    """The method's presets overridden by the given (non-None) options, checked against a [B, H, N, D] shape."""
    m = get_method(method)
    unknown = sorted(k for k, v in given.items() if k not in m.defaults and (v is not None or k not in _SIGNATURE))
    given = {k: v for k, v in given.items() if v is not None}
    if unknown:
        raise ValueError(f"method {method!r} takes no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(m.defaults)}")
    o = {**m.defaults, **given}
    for name in ("bits", "block_size", "seed", "stages", "centroids", "iters", "residual"):
        if name in o and o[name] is not None and not is_int(o[name]):
            raise ValueError(f"{name} must be an integer, got {o[name]!r}")
    if "seed" in o and not 0 <= o["seed"] < 2 ** 63:  # (torch's generators take a 64-bit seed)
        raise ValueError(f"seed must be in [0, 2**63 - 1], got {o['seed']}")
    if "signs" in o and not isinstance(o["signs"], bool):  # ("no" would be true)
        raise ValueError(f"signs must be True or False, got {o['signs']!r}")
    _check_options(m, o, shape)
    return o


_SIGNATURE = ("bits", "block_size", "stages", "centroids", "seed")  # compress's named options (None = preset)


def _check_options(m: Method, o: dict, shape) -> None:
    from .registry import token_spec
    if m.name == "quarot" and shape[3] & (shape[3] - 1):
        raise ValueError(f"quarot needs a power-of-two head dim D for its Hadamard rotation, got D={shape[3]}")
    if m.name == "kivi":  # options are checked even when every token falls in the full-precision window
        nq = kivi.quantized_tokens(shape[2], o)
        kivi.spec(o).check((*shape[:2], nq or o["block_size"], shape[3]))
    else:
        token_spec(o).check(shape)
    if "stages" in o:
        if not isinstance(o["stages"], int) or not 0 <= o["stages"] <= 16:
            raise ValueError(f"stages must be an integer in [0, 16], got {o['stages']!r}")
        k = o["centroids"]
        if not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ValueError(f"centroids must be an integer in [1, {MAX_K}], got {k!r}")
        if o["stages"] and k > shape[2]:
            raise ValueError(f"centroids ({k}) > tokens N ({shape[2]}): k-means needs at least K tokens per head")
        if o["iters"] is not None and (not isinstance(o["iters"], int) or o["iters"] < 0):
            raise ValueError(f"iters must be a non-negative integer, got {o['iters']!r}")
        if o["seeding"] not in SEEDINGS:
            raise ValueError(f"unknown seeding {o['seeding']!r}; choose one of {SEEDINGS}")


# beyond it the methods' float32 arithmetic overflows: qvg / qvg-pro decode NaN from about 6e36
# (eval/results/float-range-cpu.json), rtn's and kivi's scales near float32's maximum
MAX_ABS = 1e36
NON_FINITE = "x holds non-finite values (NaN or inf) or magnitudes above 1e36 (every method computes in float32, " \
             "which overflows there)"


def _check_input(x, finite: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor of shape [B, H, N, D], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must have shape [B, H, N, D] (rank 4), got rank {x.dim()} with shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"x must be a floating-point tensor (float32, bfloat16, float16 or float64), got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)})")
    if finite and not bool(_finite(x)):
        raise ValueError(NON_FINITE)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Whether every value of x is finite and at most MAX_ABS in magnitude: a 0-dim bool tensor, on x's device. One
    reduction (the inf-norm; NaN propagates through it), no temporary the size of x."""
    return torch.linalg.vector_norm(x, float("inf")) <= MAX_ABS


def _finite_later(x: torch.Tensor):
    """On CUDA: queue the NaN/inf scan of x and a copy of its verdict to pinned host memory, and return the check
    that raises on it (called after the compression is queued: the scan's wait for the GPU then overlaps the
    compression's launches instead of stalling them)."""
    bad, why = _finite(x).logical_not(), NON_FINITE
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(bad, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(x.device))  # (x's device: the current device may be another)

    def check() -> None:
        done.synchronize()
        if bool(host):
            raise ValueError(why)
    return check


def compress(x: torch.Tensor, method: str = "qvg", *, bits: int | None = None, block_size: int | None = None,
             stages: int | None = None, centroids: int | None = None, seed: int | None = None, init=None,
             check_finite: bool = True, **options) -> Packed:
    """Compress x [B, H, N, D] with `method` -> a `Packed` (real packed storage; `.nbytes` is what it holds).

    None means the method's preset (qvg: bits=2, block_size=64, stages=1, centroids=256; qvg-pro: block_size=16,
    stages=4; stages=0 clusters nothing: RTN in qvg's format, an ablation). `init` warm-starts k-means (qvg,
    qvg-pro) with a previous chunk's centroids: pass its Packed or a [S, B, H, K, D] tensor. Further options: grid
    ("auto", the default but kivi's | "midrise" | "sym" | "asym"), scale_dtype ("fp8" | "bf16"), iters, seeding
    (qvg*), signs (quarot), role ("key" | "value") and residual (kivi). Raises ValueError naming
    the problem for bad input. check_finite=False skips the NaN/inf scan (a full pass over x and a wait for it):
    for callers whose inputs are model activations on the hot path, such as the KV cache's commit. On CUDA the scan
    is queued before the compression and its verdict is waited for after the compression is queued, so the wait
    does not hold back the compression's launches (the compression then ran on the bad input and is dropped); any
    other error is raised after that verdict, as on the CPU, where the scan comes first. Inside a CUDA graph capture
    pass check_finite=False (the verdict cannot be waited for there).
    """
    m = get_method(method)
    if not isinstance(check_finite, bool):  # ("no" would be true)
        raise ValueError(f"check_finite must be True or False, got {check_finite!r}")
    later = check_finite and isinstance(x, torch.Tensor) and x.is_cuda
    _check_input(x, check_finite and not later)
    finite = _finite_later(x) if later else None
    try:
        x = x.detach()  # stored tensors never keep an autograd graph (and what it holds) alive
        o = resolve_options(method, tuple(x.shape), bits=bits, block_size=block_size, stages=stages,
                            centroids=centroids, seed=seed, **options)
        if init is not None and not m.warm_start:
            raise ValueError(f"method {method!r} takes no init (only k-means methods warm-start)")
        tensors = m.compress(x, o, init) if m.warm_start else m.compress(x, o)
    except Exception:  # (not KeyboardInterrupt and the like: they are not held up by the wait, nor replaced)
        if finite is not None:
            finite()  # (non-finite input is named first, whatever else failed, as on the CPU)
        raise
    if finite is not None:
        finite()
    return Packed(method, tuple(x.shape), x.dtype, tensors, o)


def decompress(packed: Packed) -> torch.Tensor:
    """The tensor a `Packed` holds, with the original shape and dtype."""
    if not isinstance(packed, Packed):
        raise ValueError(f"decompress takes a qvg Packed, got {type(packed).__name__}")
    return get_method(packed.method).decompress(packed)


def bits_per_element(method: str, shape, **options) -> float:
    """Analytic storage bits per element of `method` on a [B, H, N, D] tensor (its memory formula)."""
    if isinstance(shape, torch.Tensor):
        raise ValueError(f"bits_per_element takes the shape, not the tensor: pass x.shape ({tuple(shape.shape)})")
    if len(shape) != 4:
        raise ValueError(f"shape must be [B, H, N, D] (rank 4), got {tuple(shape)}")
    o = resolve_options(method, tuple(shape), **options)
    return get_method(method).bits(tuple(shape), o)
