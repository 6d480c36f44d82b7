"""Quantize + pack (Triton), per-token groups along D, every grid of the core, FP8 E4M3 scales with the core's
clamp (per-head FP32 tscale, [2^-9, 448], rounded to nearest or up by the core's rule) or BF16 scales. Optionally
fused with PRQ's last step: the residual x - sum_s C_s[ids_s] is formed in registers, never written. Reference:
qvg.quant.quantize_packed (and the residual loop of qvg.compression.prq.compress)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qvg.quant import FP8_MAX, TSCALE_MIN, QuantSpec, _div, bound_tscale, scale_bound, scale_divisor, tensor_scale

from .common import INTERPRET, bf16_bits_to_f32, cdiv, check_head_dim, check_out, grid_constants, raw_view, to_bf16
from .launch import launch
from .encode import _encode, _rne, auto_scales, head_tscale
from .pack_span import _pack_span_kernel, span_width


@triton.jit
def _residual(x_ptr, ids_ptr, cent_ptr, tok, rmask, col, N, K, GH, gh, D: tl.constexpr, STAGES: tl.constexpr):
    """fp32 x[tok, col] - sum over stages of the assigned BF16 centroid (same order as the reference)."""
    m2 = rmask[:, None]
    r = tl.load(x_ptr + tok[:, None] * D + col[None, :], mask=m2, other=0.0).to(tl.float32)
    for st in tl.static_range(STAGES):
        cid = tl.load(ids_ptr + st * GH * N + tok, mask=rmask, other=0).to(tl.int64)
        crow = (st * GH + gh).to(tl.int64) * K + cid
        r -= tl.load(cent_ptr + crow[:, None] * D + col[None, :], mask=m2, other=0.0).to(tl.float32)
    return r


@triton.jit
def _group_stats(rg, BITS: tl.constexpr, GRID: tl.constexpr, OFFSET: tl.constexpr, INTERP: tl.constexpr):
    """rg [BLOCK_N, NG, GROUP] fp32 -> (raw fp32 group scale [BLOCK_N, NG], BF16 bits of the asym zero point
    rounded toward -inf; zeros for the other grids)."""
    if GRID == 2:
        mn = tl.min(rg, 2)
        zb = to_bf16(mn, INTERP).to(tl.int16, bitcast=True)  # then step toward -inf if it rounded up
        zb = tl.where(bf16_bits_to_f32(zb) > mn, tl.where(zb >= 0, zb - 1, zb + 1), zb)
        raw = tl.math.div_rn(tl.max(rg, 2) - bf16_bits_to_f32(zb), 2.0 ** BITS - 1.0)
    elif GRID == 3:  # auto: keep max|x| itself; the pack pass derives both candidate scales from it
        raw = tl.max(tl.abs(rg), 2)
        zb = tl.zeros_like(raw).to(tl.int16)
    else:  # sym: max|x| / (2^(b-1) - 1); midrise: max|x| / (2^(b-1) - 1/2) -- both are OFFSET
        raw = tl.math.div_rn(tl.max(tl.abs(rg), 2), OFFSET)
        zb = tl.zeros_like(raw).to(tl.int16)
    return raw, zb


@triton.jit
def _stats_kernel(x_ptr, ids_ptr, cent_ptr, raw_ptr, zero_ptr, N, K, GH,
                  D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr,
                  OFFSET: tl.constexpr, STAGES: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
                  HEADMAX: tl.constexpr):
    """Pass 1: raw fp32 group scale (and, for asym, the BF16 zero point rounded toward -inf); with HEADMAX only
    the head's largest raw scale, as an integer max of its (non-negative) fp32 bits into raw_ptr[head] (an
    order-independent, deterministic atomic; raw_ptr starts at 0)."""
    pid_n = tl.program_id(0)
    gh = tl.program_id(1)
    NG: tl.constexpr = D // GROUP
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tok = gh.to(tl.int64) * N + rows
    r = _residual(x_ptr, ids_ptr, cent_ptr, tok, rmask, tl.arange(0, D), N, K, GH, gh, D, STAGES)
    raw, zb = _group_stats(tl.reshape(r, (BLOCK_N, NG, GROUP)), BITS, GRID, OFFSET, INTERP)
    if HEADMAX:  # masked rows are zeros: raw 0, neutral
        tl.atomic_max(raw_ptr + gh, tl.max(tl.max(raw, 1), 0).to(tl.int32, bitcast=True))
    else:
        goff = tok[:, None] * NG + tl.arange(0, NG)[None, :]
        m2 = rmask[:, None]
        if GRID == 2:
            tl.store(zero_ptr + goff, zb, mask=m2)
        tl.store(raw_ptr + goff, raw, mask=m2)


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, cent_ptr, raw_ptr, zero_ptr, tscale_ptr, codes_ptr, scale_ptr, mc_ptr, N, K, GH,
                 D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GRID: tl.constexpr,
                 OFFSET: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, STAGES: tl.constexpr,
                 BLOCK_N: tl.constexpr, RECOMPUTE: tl.constexpr = False, RINT: tl.constexpr = False,
                 TS_DIV: tl.constexpr = 1.0, TSCALE_MIN: tl.constexpr = 0.0, INTERP: tl.constexpr = False,
                 WORDS: tl.constexpr = True, TS_BOUND: tl.constexpr = False):
    """Pass 2: stored scales and packed codes (planar layout of qvg/bitpack.py). RECOMPUTE: the group stats are
    formed here (`_group_stats`, as pass 1 would), the zero point stored here, and with FP8 the tscale computed
    from the head's largest raw scale (raw_ptr[head], fp32 bits; TS_DIV: auto's divisor) as `qvg.quant.
    tensor_scale` does, and stored by each head's first program: no [N, NG] raw array, no torch reductions.
    TS_BOUND (with RECOMPUTE and FP8): the tscale from a bound instead, as `qvg.quant.bound_tscale(scale_bound(
    m_in, m_c))` computes it: m_in = raw_ptr[head] (FP32 bits of the k-means input's max|.|), m_c = mc_ptr[head],
    TS_DIV = `scale_divisor`; then no pass 1 at all.
    WORDS: the planes are ORed as 32-bit words of 4 bytes (rows of a whole number of words), else byte by byte."""
    pid_n = tl.program_id(0)
    gh = tl.program_id(1)
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    NG: tl.constexpr = D // GROUP
    LEVELS: tl.constexpr = 2 ** BITS - 1
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    m2 = rmask[:, None]
    tok = gh.to(tl.int64) * N + rows
    goff = tok[:, None] * NG + tl.arange(0, NG)[None, :]
    # work in the group layout [BLOCK_N, NG, GROUP]: per-group values broadcast along the last axis for free
    r = tl.reshape(_residual(x_ptr, ids_ptr, cent_ptr, tok, rmask, tl.arange(0, D), N, K, GH, gh, D, STAGES),
                   (BLOCK_N, NG, GROUP))
    ts = 1.0
    if RECOMPUTE:
        raw, zb = _group_stats(r, BITS, GRID, OFFSET, INTERP)
        if GRID == 2:
            tl.store(zero_ptr + goff, zb, mask=m2)
        if FP8:
            ts = head_tscale(raw_ptr, mc_ptr, tscale_ptr, gh, pid_n == 0, TS_BOUND, TS_DIV, FP8_MAX, TSCALE_MIN)
    else:
        if FP8:
            ts = tl.load(tscale_ptr + gh)
        raw = tl.load(raw_ptr + goff, mask=m2, other=1.0)
    if GRID == 3:  # auto: both candidates, then per group the one with the smaller squared error (ties: sym)
        mbits, ms, sbits, s = auto_scales(raw, ts, OFFSET, BITS, FP8, FP8_MAX)  # (raw is max|x| here)
        cm = tl.minimum(tl.maximum(tl.floor(r * tl.math.div_rn(1.0, ms)[:, :, None]) + (OFFSET + 1.0), 0.0), LEVELS)
        if BITS == 1:  # 1-bit auto is midrise, flagged
            sbits = mbits
            c = cm
        else:
            cs = tl.minimum(tl.maximum(_rne(r * tl.math.div_rn(1.0, s)[:, :, None], RINT), -OFFSET), OFFSET)
            es = cs * s[:, :, None] - r
            em = (cm - (OFFSET + 0.5)) * ms[:, :, None] - r
            use_mid = tl.sum(em * em, 2) < tl.sum(es * es, 2)
            sbits = tl.where(use_mid, mbits, sbits)
            c = tl.where(use_mid[:, :, None], cm, cs + OFFSET)
        tl.store(scale_ptr + goff, sbits, mask=m2)
    else:
        sbits, s = _encode(raw, ts, FP8, FP8_MAX, LEVELS if GRID == 2 else OFFSET)
        tl.store(scale_ptr + goff, sbits, mask=m2)
        inv = tl.math.div_rn(1.0, s)[:, :, None]
    if GRID == 0:
        c = tl.minimum(tl.maximum(_rne(r * inv, RINT), -OFFSET), OFFSET) + OFFSET
    elif GRID == 1:
        c = tl.minimum(tl.maximum(tl.floor(r * inv) + (OFFSET + 0.5), 0.0), LEVELS)
    elif GRID == 2:
        if not RECOMPUTE:
            zb = tl.load(zero_ptr + goff, mask=m2, other=0)
        c = tl.minimum(tl.maximum(_rne((r - bf16_bits_to_f32(zb)[:, :, None]) * inv, RINT), 0.0), LEVELS)
    # planar packing: [BLOCK_N, P, W] -> shift plane p by p * BITS and OR the planes together (disjoint bit fields:
    # sum == OR). The planes sit in different threads, so the OR crosses threads: 4 neighbouring bytes of a plane
    # are first joined into one 32-bit word (within a thread), so one shuffle moves 4 bytes
    shifts = tl.arange(0, P) * BITS
    if WORDS and W % 4 == 0:
        c4 = tl.reshape(c.to(tl.uint32), (BLOCK_N, P, W // 4, 4))
        word = tl.sum(c4 << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, None, :], 3)
        word = tl.sum(word << shifts.to(tl.uint32)[None, :, None], 1)
        wptr = codes_ptr.to(tl.pointer_type(tl.uint32))
        tl.store(wptr + tok[:, None] * (W // 4) + tl.arange(0, W // 4)[None, :], word, mask=m2)
    else:
        c3 = tl.reshape(c.to(tl.uint8), (BLOCK_N, P, W))
        byte = tl.sum(c3 << shifts.to(tl.uint8)[None, :, None], 1).to(tl.uint8)
        tl.store(codes_ptr + tok[:, None] * W + tl.arange(0, W)[None, :], byte, mask=m2)


def quantize_packed(x: torch.Tensor, spec: QuantSpec, ids: torch.Tensor | None = None,
                    centroids: torch.Tensor | None = None, block_n: int = 16, num_warps: int = 2,
                    fused: bool = False, words: bool = True,
                    bound: tuple[torch.Tensor, torch.Tensor] | None = None, span: bool | str = False,
                    span_warps: int = 4, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Triton version of `qvg.quant.quantize_packed` for per-token specs. With `ids` [S, B, H, N] and `centroids`
    [S, B, H, K, D] (BF16) it quantizes the PRQ residual x - sum_s centroids_s[ids_s] without materializing it.
    fused (same stored tensors): no [B, H, N, D/group] raw-scale array and no torch reductions; FP8 scales: pass 1
    only finds each head's largest raw scale (an integer atomic max), pass 2 forms the group stats itself and the
    tscale from that maximum; BF16 scales: pass 2 alone (one read of x). words: the code planes are ORed 4 bytes
    at a time (32-bit words, so each value exchanged between threads holds 4 bytes); False: byte by byte (the same
    bits). bound = (m_in, m_c), int32 [B*H] FP32 bits and FP32 [B*H] (FP8 scales, not asym): the tscale is
    `qvg.quant.bound_tscale(scale_bound(m_in, m_c), spec)`, as qvg's torch path stores it
    (`qvg.compression.prq.residual_tscale`); fused, no pass 1 then. span (fused; grids sym / midrise / auto): the
    pack pass with each group in one thread (kernels/pack_span.py, the same bits; "recode": the auto grid's codes
    formed again after its choice; "narrow" / "narrow-recode": a group wider than a code plane on several threads)
    on span_warps warps; block_n / num_warps then apply to pass
    1 alone. out (fused): `quantize_packed_outputs`-shaped tensors (or views) to write into."""
    check_head_dim(x.shape[-1])
    b, h, n, d = x.shape
    spec.check(tuple(x.shape))
    c = grid_constants(spec)
    x = x.contiguous()
    stages = 0 if ids is None else ids.shape[0]
    k = centroids.shape[-2] if stages else 1
    dev = x.device
    ng = d // spec.group
    grid = (cdiv(n, block_n), b * h)
    ids_ = ids.contiguous() if stages else x
    cent_ = centroids.contiguous() if stages else x
    if bound is not None and (not c["FP8"] or spec.grid == "asym"):
        raise ValueError("a tscale bound needs FP8 scales and a grid other than asym")
    if fused:
        sw = span_width(d, spec.bits, spec.group, narrow="narrow" in str(span)) if span and spec.grid != "asym" else 0
        span_kw = dict(SPAN=sw, RECODE="recode" in str(span), num_warps=span_warps) if sw else None
        out = quantize_packed_outputs(b, h, n, d, spec, dev) if out is None else \
            _check_outputs(out, b, h, n, d, spec, dev)
        return _quantize_fused(x, spec, c, ids_, cent_, stages, k, grid, block_n, num_warps, words, bound,
                               span_kw, out)
    if out is not None:
        raise ValueError("out= needs the fused pack")
    out = quantize_packed_outputs(b, h, n, d, spec, dev)
    zero = out.get("zero")
    raw = torch.empty(b, h, n, ng, device=dev, dtype=torch.float32)
    launch(_stats_kernel, grid, x, ids_, cent_, raw, raw_view(zero) if zero is not None else raw, n, k, b * h, D=d,
           BITS=c["BITS"], GROUP=c["GROUP"], GRID=c["GRID"], OFFSET=c["OFFSET"], STAGES=stages, BLOCK_N=block_n,
           INTERP=INTERPRET, HEADMAX=False, num_warps=num_warps, enable_fp_fusion=False)
    if bound is not None:
        out["tscale"] = bound_tscale(scale_bound(bound[0].view(torch.float32), bound[1]), spec).view(b, h)
    elif c["FP8"]:  # auto's stats pass keeps max|x|: the tscale follows its sym candidate (midrise for 1 bit)
        out["tscale"] = tensor_scale(raw if spec.grid != "auto" else _div(raw, c["OFFSET"] if spec.bits > 1 else 0.5))
    launch(_pack_kernel, grid, x, ids_, cent_, raw, raw_view(zero) if zero is not None else raw, out.get("tscale", raw),
           out["codes"], raw_view(out["scale"]), raw, n, k, b * h, D=d, FP8_MAX=FP8_MAX, STAGES=stages, BLOCK_N=block_n,
           WORDS=words, num_warps=num_warps, enable_fp_fusion=False, **c)
    return out


def quantize_packed_layout(b: int, h: int, n: int, d: int, spec: QuantSpec) -> dict[str, tuple]:
    """name -> (shape, dtype) of `quantize_packed`'s stored tensors for x [B, H, N, D] (per-token spec)."""
    fp8 = spec.scale_dtype == "fp8"
    out = {"codes": ((b, h, n, d * spec.bits // 8), torch.uint8),
           "scale": ((b, h, n, d // spec.group), torch.float8_e4m3fn if fp8 else torch.bfloat16)}
    if fp8:
        out["tscale"] = ((b, h), torch.float32)
    if spec.grid == "asym":
        out["zero"] = ((b, h, n, d // spec.group), torch.bfloat16)
    return out


def quantize_packed_outputs(b: int, h: int, n: int, d: int, spec: QuantSpec, device) -> dict[str, torch.Tensor]:
    """Empty stored tensors of `quantize_packed` for x [B, H, N, D] (per-token spec)."""
    return {k: torch.empty(shape, device=device, dtype=dt)
            for k, (shape, dt) in quantize_packed_layout(b, h, n, d, spec).items()}


def _check_outputs(out: dict, b: int, h: int, n: int, d: int, spec: QuantSpec, device) -> dict[str, torch.Tensor]:
    """`out` if it holds exactly the stored tensors' names, each contiguous with its shape and dtype on `device`
    (a missing tscale was written to scratch and lost; a strided view was written past its own elements)."""
    layout = quantize_packed_layout(b, h, n, d, spec)
    if set(out) != set(layout):
        raise ValueError(f"quantize_packed: out must hold {sorted(layout)}, got {sorted(out)}")
    for k, (shape, dt) in layout.items():
        check_out(out[k], shape, dt, device, f"quantize_packed: out[{k!r}]")
    return out


def _quantize_fused(x, spec, c, ids_, cent_, stages, k, grid, block_n, num_warps, words, bound,
                    span_kw, out) -> dict[str, torch.Tensor]:
    b, h, n, d = x.shape
    dev = x.device
    codes, scale, zero = out["codes"], out["scale"], out.get("zero")
    hmax = mc = x  # unused without FP8 scales
    if bound is not None:  # the head's bound is known: no pass 1
        hmax, mc = bound[0].contiguous(), bound[1].float().contiguous()
    elif c["FP8"]:
        hmax = torch.zeros(b * h, device=dev, dtype=torch.int32)
        launch(_stats_kernel, grid, x, ids_, cent_, hmax, hmax, n, k, b * h, D=d, BITS=c["BITS"], GROUP=c["GROUP"],
               GRID=c["GRID"], OFFSET=c["OFFSET"], STAGES=stages, BLOCK_N=block_n, INTERP=INTERPRET, HEADMAX=True,
               num_warps=num_warps, enable_fp_fusion=False)
    if bound is not None:
        ts_div = scale_divisor(spec)
    else:  # see tensor_scale's use above
        ts_div = (c["OFFSET"] if spec.bits > 1 else 0.5) if spec.grid == "auto" else 1.0
    if span_kw:  # one thread per (token, span): BLOCK_N tokens fill the program's threads
        bn = 32 * span_kw["num_warps"] * span_kw["SPAN"] // d
        launch(_pack_span_kernel, (cdiv(n, bn), b * h), x, ids_, cent_, hmax, mc, out.get("tscale", hmax), codes,
               raw_view(scale), n, k, b * h, D=d, BITS=c["BITS"], GROUP=c["GROUP"], GRID=c["GRID"], OFFSET=c["OFFSET"],
               FP8=c["FP8"], FP8_MAX=FP8_MAX, STAGES=stages, BLOCK_N=bn, TS_DIV=float(ts_div), TSCALE_MIN=TSCALE_MIN,
               TS_BOUND=bound is not None, INTERP=INTERPRET, enable_fp_fusion=False, **span_kw)
    else:
        launch(_pack_kernel, grid, x, ids_, cent_, hmax, raw_view(zero) if zero is not None else hmax,
               out.get("tscale", hmax), codes, raw_view(scale), mc, n, k, b * h, D=d, FP8_MAX=FP8_MAX, STAGES=stages,
               BLOCK_N=block_n, RECOMPUTE=True, RINT=not INTERPRET, TS_DIV=float(ts_div), TSCALE_MIN=TSCALE_MIN,
               INTERP=INTERPRET, WORDS=words, TS_BOUND=bound is not None, num_warps=num_warps, enable_fp_fusion=False,
               **c)
    return out
