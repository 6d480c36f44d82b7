"""GPU compress path of rtn / qvg / qvg-pro: the Triton k-means steps and the fused residual + quantize + pack
kernel, in the same order of operations as the reference (qvg/compression/prq.py), so the result matches it.

Stage s clusters the BF16 rounding of x - sum_{t<s} C_t[ids_t] (FP32 arithmetic, the reference's order), formed
by one kernel from x and the stored ids / centroids; the last residual is formed again inside the pack kernel,
never written."""
from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from qvg.compression.registry import token_spec
from qvg.kmeans import id_dtype

from .common import INTERPRET, cdiv, check_head_dim, to_bf16
from .launch import launch
from .kmeans import kmeans
from .quantize import _residual, quantize_packed, quantize_packed_outputs

# Which k-means / pack kernels compress runs: options of `kmeans` (assign_kw, update_kw, reseed) and of
# `quantize_packed` (pack_kw). "fast" was chosen at the LongCat span ([1, 32, 29640, 128], K=256) piece by piece in
# `python -m qvg.eval.profile_compress --variants` sweeps (eval/results/profile-compress-variants-h100*.json):
# one-reduction persistent assignment (progs="auto": ~2 programs per SM), counting-sort segmented-sum update, fused
# reseeding, fused pack. The assignment prefetches its token tiles 3 deep (num_stages=3: 0.173 against 0.193 ms
# with 2 at the LongCat span; whole compress 3.4-5.3% faster in two runs, kernels-h100.md; a tie at the Self-Forcing
# chunk, compress-sweep-h100.md).
# Its update sums 16 rows per step (39 registers against 56 for 32 rows under ncu; no slower in one run,
# kernels-h100.headmax-72b904b.json) and orders each block's tokens by counted ranks, 64 at a time on one
# warp, not a sort (whole compress 3.5% / 3.7% faster for qvg / qvg-pro in one run, kernels-h100.compress-6b0c1ca.json).
# "fast-sort" is "fast" with the block sort (tl.sort), as before 6b0c1ca; "fast-onehot" / "fast-onehot-1024" take
# the one-hot tensor-core update instead, on 512- / 1024-token splits. "current" (tiled assignment, one-hot update,
# torch reseeding, two-kernel pack: what kernels-h100.md measured before "fast") stays for those sweeps to time
# against. All of them return the same ids, and centroids up to the order in which the FP32 cluster sums are added
# (the "-delta" presets below: up to the rounding of sums updated by subtraction, so from a third iteration or a
# later stage on an id near a tie may differ).
# The fused pack takes its FP8 tscale from a bound (no pass of its own before it) and, where the shape allows, runs
# with each quantization group on one thread, or on two for a group wider than a code plane (kernels/pack_span.py,
# span="narrow"): at the LongCat span on the H100 the pack went from 0.340 ms (stats pass + pack) to 0.149 ms
# (kernels-h100.md).
_FAST_UPDATE = dict(method="segsum", item=256, rows=16, num_warps=4, num_stages=3, sort_block=1024)
_FAST = dict(assign_kw=dict(mode="min", block_n=64, block_k=256, num_warps=4, num_stages=3, progs="auto"),
             reseed="fused", pack_kw=dict(fused=True, block_n=32, num_warps=4, span="narrow"))
_ONEHOT_UPDATE = dict(method="onehot", block_k=64, block_n=32, num_warps=4)
COMPRESS_VARIANTS = {
    "current": dict(assign_kw={}, update_kw={}, reseed="torch", pack_kw={}),
    "fast": dict(_FAST, update_kw=dict(_FAST_UPDATE, block="rank", rank_rows=64, rank_warps=1)),
    "fast-sort": dict(_FAST, update_kw=dict(_FAST_UPDATE, block="sort")),
    "fast-onehot": dict(_FAST, update_kw=dict(_ONEHOT_UPDATE, chunk=512)),
    "fast-onehot-1024": dict(_FAST, update_kw=dict(_ONEHOT_UPDATE, chunk=1024)),
}
# "fast" with the assignment's token tiles prefetched 2 deep (as before the 3-deep default), for same-run timing
COMPRESS_VARIANTS["fast-s2"] = dict(COMPRESS_VARIANTS["fast"], assign_kw=dict(_FAST["assign_kw"], num_stages=2))
# "fast" with the pack before kernels/pack_span.py (8 columns of a group per thread; the same bits), and that pack
# with its tscale from its own pass over the residual, as before the bound (other tscale bits, so other stored
# scales, than every preset above): for same-run timing
COMPRESS_VARIANTS["fast-nospan"] = dict(COMPRESS_VARIANTS["fast"], pack_kw=dict(_FAST["pack_kw"], span=False))
COMPRESS_VARIANTS["fast-stats"] = dict(COMPRESS_VARIANTS["fast-nospan"], tscale="pass")
# ... and that pack with its code planes ORed byte by byte (as before the 32-bit words)
COMPRESS_VARIANTS["fast-bytes"] = dict(COMPRESS_VARIANTS["fast"], pack_kw=dict(_FAST["pack_kw"], span=False,
                                                                                words=False))
for _s, _name in ((True, "span"), ("recode", "recode"), ("narrow-recode", "narrow-recode")):  # the span pack's
    COMPRESS_VARIANTS[f"fast-{_name}"] = dict(COMPRESS_VARIANTS["fast"],  # other forms (same bits)
                                              pack_kw=dict(_FAST["pack_kw"], span=_s))
# "fast" as two, four or eight chains of heads on side streams (warm starts; the same bits), for timing; -1sm: each
# chain's assignment on one program per SM.
# Tried at 7d8cd7e and removed, all slower at the LongCat span on the H100 (kernels-h100.assign-7d8cd7e.json): the
# assignment's argmin index found on tensor cores (fewer ALU operations, but a second MMA on the critical path and
# spills: assignment 0.197 against 0.160 ms), on 8 warps (0.238 ms), and the later stages' inputs formed by their
# first assignment instead of a residual pass (1.25 ms: the centroid gathers in the assignment's loop).
for _n in (2, 4, 8):
    COMPRESS_VARIANTS[f"fast-split{_n}"] = dict(COMPRESS_VARIANTS["fast"], split=_n)
    COMPRESS_VARIANTS[f"fast-split{_n}-1sm"] = dict(COMPRESS_VARIANTS["fast"], split=_n,
                                                    assign_kw=dict(_FAST["assign_kw"], per_sm=1))
# (The one-hot update over all 256 clusters per program, x read once, was 0.34-0.60 ms against the segmented sum's
# 0.24 ms in eval/sweep_update.py's run, and qvg-pro's compress 4.86 against 3.30 ms: sweep-update-h100.d27eb1e.json,
# kernels-h100.onehot256-d27eb1e.json.)
# "fast" / "fast-sort" with every update after a stage's first incremental: only the tokens the assignment moved are
# read (kernels/kmeans_delta.py). At all six shapes where `pick_variant` used the segmented sum they were 12-20%
# faster in whole-compress graph replays (warm starts, 2 iterations; compress-sweep-h100-*.delta-*.json), and at the
# LongCat span qvg-pro went from 3.26-3.29 to 2.84-2.87 ms (kernels-h100.delta-028db8b-r1/-r2.json): `pick_variant`
# takes them there. Cold starts and K > 512 run full updates (`kmeans`). (Those sweeps ran the delta on sm_count // G
# programs per group; since 488c462 it runs one per 8,192 tokens: the same 4 at the LongCat span, 2-5 at the 12-head
# shapes, where qvg-pro re-timed 2-5% slower than with sm_count // G and still 10-17% faster than without the delta:
# compress-sweep-h100-1x12x*.progs-ee1f79c.json.)
COMPRESS_VARIANTS["fast-delta"] = dict(COMPRESS_VARIANTS["fast"],
                                       update_kw=dict(COMPRESS_VARIANTS["fast"]["update_kw"], incremental=True))
COMPRESS_VARIANTS["fast-sort-delta"] = dict(COMPRESS_VARIANTS["fast-sort"],
                                            update_kw=dict(COMPRESS_VARIANTS["fast-sort"]["update_kw"],
                                                           incremental=True))
# The default, "auto", picks one of them by shape (`pick_variant`); COMPRESS_VARIANT is the switch, and
# `compress_prq(..., variant=)` overrides it per call.
COMPRESS_VARIANT = "auto"


def pick_variant(groups: int, tokens: int, k: int) -> str:
    """The preset for `groups` (batch x heads) groups of `tokens` tokens and K = k: the fastest at 24 of 32 measured
    (shape, method) rows and within 7% of it at the others (16 shapes: Self-Forcing units of 1-8 chunks, batches of 4
    and 8 chunks, LongCat spans; never more than 0.2% slower than "fast") in whole-compress CUDA graph replays on
    an H100 (`python -m qvg.eval.sweep_compress`; eval/results/compress-sweep-h100.md; two graphs of one preset
    can differ by up to ~3%, so the choices within that are ties):
    - short units (tokens <= 8192, K <= 256; a Self-Forcing chunk, 4,680 tokens, K = 64): the one-hot update on
      512-token splits, 18-30% faster than "fast" (24% at the chunk): the counting sort's few blocks leave the GPU
      idle there (17% / 7% faster with batches of 4 / 8 chunks);
    - longer units with K <= 64: the one-hot update on 1024-token splits (3-11% faster);
    - else the counting sort + segmented sum: with the block sort while groups x tokens <= 480k (5-10% faster with 12
      heads; a tie at 32 x 14,820), with counted ranks above (the LongCat span); in both, on warm starts with
      K <= 512, every update after a stage's first reads only the tokens the assignment moved ("-delta": 12-20%
      faster (warm, 2 iterations) than the same preset
      without it at all six such shapes measured, compress-sweep-h100-*.delta-*.json)."""
    if tokens <= 8192 and k <= 256:
        return "fast-onehot"
    if k <= 64:
        return "fast-onehot-1024"
    return "fast-sort-delta" if groups * tokens <= 480_000 else "fast-delta"


def resolve_variant(variant: str | dict | None, groups: int, tokens: int, k: int) -> dict:
    """A COMPRESS_VARIANTS entry (or "auto": `pick_variant`'s, or a variant dict as it is)."""
    if isinstance(variant, dict):
        return variant
    name = check_variant(variant or COMPRESS_VARIANT)
    return COMPRESS_VARIANTS[pick_variant(groups, tokens, k) if name == "auto" else name]


def check_variant(name) -> str:
    """`name` if it is "auto" or a COMPRESS_VARIANTS name, else ValueError."""
    if name != "auto" and (not isinstance(name, str) or name not in COMPRESS_VARIANTS):
        raise ValueError(f"unknown compress variant {name!r}; choose auto or one of {sorted(COMPRESS_VARIANTS)}")
    return name


@contextlib.contextmanager
def use_variant(name: str):
    """COMPRESS_VARIANT set to `name` inside the block. (A KVCache's `compress_preset` runs its compressions in such a
    block; its compression graphs are keyed by the preset they were captured with.)"""
    global COMPRESS_VARIANT
    old, COMPRESS_VARIANT = COMPRESS_VARIANT, check_variant(name)
    try:
        yield
    finally:
        COMPRESS_VARIANT = old


@triton.jit
def _residual_bf16_kernel(x_ptr, ids_ptr, cent_ptr, out_ptr, N, K, GH, D: tl.constexpr, STAGES: tl.constexpr,
                          BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    gh = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tok = gh.to(tl.int64) * N + rows
    col = tl.arange(0, D)
    r = _residual(x_ptr, ids_ptr, cent_ptr, tok, rmask, col, N, K, GH, gh, D, STAGES)
    tl.store(out_ptr + tok[:, None] * D + col[None, :], to_bf16(r, INTERP), mask=rmask[:, None])


def residual_bf16(x: torch.Tensor, ids: torch.Tensor, cents: torch.Tensor, stages: int,
                  block_n: int = 32) -> torch.Tensor:
    """x [G, N, D]; ids [S', G, N]; cents [S', G, K, D] BF16 -> BF16(x - sum_{s<stages} cents_s[ids_s]) [G, N, D]."""
    g, n, d = x.shape
    out = torch.empty(g, n, d, device=x.device, dtype=torch.bfloat16)
    launch(_residual_bf16_kernel, (cdiv(n, block_n), g), x, ids, cents, out, n, cents.shape[-2], g, D=d,
           STAGES=stages, BLOCK_N=block_n, INTERP=INTERPRET, num_warps=4)
    return out


@triton.jit
def _head_absmax_kernel(t_ptr, out_ptr, M, PER, BLOCK: tl.constexpr):
    """Program (g, j): max|t| over elements [j * PER, (j + 1) * PER) of group g, as an integer max of its FP32 bits
    into out_ptr[g] (zeros before; order-independent, deterministic)."""
    g = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * PER
    big = tl.zeros((BLOCK,), tl.float32)
    for i0 in range(lo, tl.minimum(lo + PER, M), BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        big = tl.maximum(big, tl.abs(tl.load(t_ptr + g * M + i, mask=i < M, other=0.0).to(tl.float32)))
    tl.atomic_max(out_ptr + g, tl.max(big, 0).to(tl.int32, bitcast=True))


def head_absmax(t: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
    """max|t| over each group of t [G, ...] (FP32 [G]), one launch of G x 8 programs. bits: an int32 [G] tensor of
    zeros to hold the result's FP32 bits (the result is its float view)."""
    g = t.shape[0]
    t = t.contiguous()
    if bits is None:
        bits = torch.zeros(g, device=t.device, dtype=torch.int32)
    m = t.numel() // max(g, 1)
    per = cdiv(cdiv(m, 8), 1024) * 1024
    launch(_head_absmax_kernel, (g, cdiv(m, per)), t, bits, m, per, BLOCK=1024, num_warps=4)
    return bits.view(torch.float32)


def compress_prq(x: torch.Tensor, o: dict, warm: torch.Tensor | None, iters: int,
                 variant: str | dict | None = None) -> dict[str, torch.Tensor]:
    """x [B, H, N, D]; o: resolved options; warm: [S, B*H, K, D] centroids or None -> the tensors to store.
    variant: a COMPRESS_VARIANTS name, "auto" (`pick_variant` by shape) or such a dict (default: COMPRESS_VARIANT).
    With FP8 scales (not asym) the pack takes its tscale from a bound, as the torch path does
    (`qvg.compression.prq.residual_tscale`): the last stage's first k-means update finds max|input| while it reads
    the tokens, and one small launch max|centroid|; so the pack makes one pass over x, not two.
    A variant's "split": n (CUDA, warm-started, n dividing B*H) runs the groups as n independent chains (k-means
    stages and pack of B*H / n heads each) on n side streams, so that one chain's compute-bound kernels (the
    assignment, the pack) can run beside another's memory-bound ones (the update); the same bits (every step is per
    group; only the cold start's seeding draws depend on the group count, hence warm starts only)."""
    check_head_dim(x.shape[-1])
    b, h, n, d = x.shape
    s_count, k = o.get("stages", 0), o.get("centroids", 1)
    v = resolve_variant(variant, b * h, n, k)
    pack_kw = v.get("pack_kw", {})
    if not s_count:
        return quantize_packed(x, token_spec(o), **pack_kw)
    x = x.contiguous()
    g = b * h
    spec = token_spec(o)
    use_bound = spec.scale_dtype == "fp8" and spec.grid != "asym" and v.get("tscale", "bound") == "bound"
    split = v.get("split", 1)
    if split > 1 and x.is_cuda and warm is not None and g % split == 0 and pack_kw.get("fused"):
        return _compress_split(x, o, v, warm, iters, split, use_bound)
    ids_t = torch.empty(s_count, g, n, device=x.device, dtype=id_dtype(k))
    cents_t = torch.empty(s_count, g, k, d, device=x.device, dtype=torch.bfloat16)
    maxes = torch.zeros(2, g, device=x.device, dtype=torch.int32) if use_bound else None  # max|input|, max|c|
    m_in = None if maxes is None else maxes[0]
    _stages(x.view(g, n, d), o, v, warm, iters, m_in, ids_t, cents_t)
    bound = None if m_in is None else (m_in, head_absmax(cents_t[s_count - 1], maxes[1]))
    ids_t = ids_t.view(s_count, b, h, n)
    cents_t = cents_t.view(s_count, b, h, k, d)
    tensors = quantize_packed(x, spec, ids_t, cents_t, bound=bound, **pack_kw)
    tensors["ids"] = ids_t
    tensors["centroids"] = cents_t
    return tensors


def _stages(xg, o, v, warm, iters, m_in, ids_t, cents_t) -> None:
    """PRQ's k-means stages over xg [G, N, D] into ids_t [S, G, N] and cents_t [S, G, K, D] (BF16); m_in: int32 [G]
    zeros for the last stage's max|input| (FP32 bits), or None."""
    s_count, k = ids_t.shape[0], cents_t.shape[2]
    for s in range(s_count):
        r = xg.to(torch.bfloat16) if s == 0 else residual_bf16(xg, ids_t, cents_t, s)
        kmeans(r, k, iters=iters, init=None if warm is None else warm[s], seed=o["seed"] + s, seeding=o["seeding"],
               assign_kw=v.get("assign_kw"), update_kw=v.get("update_kw"), reseed=v.get("reseed", "torch"),
               amax=m_in if s == s_count - 1 else None, ids_out=ids_t[s], cents_out=cents_t[s])  # (no copies)


_SIDE_STREAMS: dict = {}


def _side_streams(device, count: int) -> list:
    """`count` side streams of `device` for the calling thread, made once (a CUDA graph capture may fork onto them;
    two threads compressing at once, or capturing at once, never share one)."""
    key = (device, count, threading.get_ident())
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = [torch.cuda.Stream(device) for _ in range(count)]
    return _SIDE_STREAMS[key]


def _compress_split(x, o, v, warm, iters, split, use_bound) -> dict[str, torch.Tensor]:
    """`compress_prq` as `split` chains of G / split groups on side streams (see there). Every output is allocated
    on the calling stream before the fork and each chain writes its slice of it; the chains' own temporaries live
    on their streams; the calling stream waits for all of them."""
    b, h, n, d = x.shape
    g = b * h
    gs = g // split
    s_count, k = o["stages"], o["centroids"]
    spec = token_spec(o)
    dev = x.device
    xg = x.view(g, n, d)
    ids_t = torch.empty(s_count, g, n, device=dev, dtype=id_dtype(k))
    cents_t = torch.empty(s_count, g, k, d, device=dev, dtype=torch.bfloat16)
    ids_h = torch.empty(split, s_count, gs, n, device=dev, dtype=id_dtype(k))  # each chain's stages, contiguous
    cents_h = torch.empty(split, s_count, gs, k, d, device=dev, dtype=torch.bfloat16)
    maxes = torch.zeros(2, g, device=dev, dtype=torch.int32) if use_bound else None  # max|input|, max|c|
    out = quantize_packed_outputs(b, h, n, d, spec, dev)
    main = torch.cuda.current_stream(dev)
    streams = _side_streams(dev, split)
    for i, st in enumerate(streams):
        st.wait_stream(main)
        with torch.cuda.stream(st):
            sl = slice(i * gs, (i + 1) * gs)
            mi = None if maxes is None else maxes[0, sl]
            _stages(xg[sl], o, v, warm[:, sl], iters, mi, ids_h[i], cents_h[i])
            bound = None if mi is None else (mi, head_absmax(cents_h[i, s_count - 1], maxes[1, sl]))
            quantize_packed(xg[sl].view(1, gs, n, d), spec, ids_h[i].view(s_count, 1, gs, n),
                            cents_h[i].view(s_count, 1, gs, k, d), bound=bound,
                            out={name: t.view(g, *t.shape[2:])[sl].unsqueeze(0) for name, t in out.items()},
                            **v["pack_kw"])
            ids_t[:, sl] = ids_h[i]
            cents_t[:, sl] = cents_h[i]
    for st in streams:
        main.wait_stream(st)
    return {**out, "ids": ids_t.view(s_count, b, h, n), "centroids": cents_t.view(s_count, b, h, k, d)}
