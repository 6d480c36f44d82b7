"""GPU benchmark of the Triton kernels (issue 3): `python -m qvg.eval.bench_kernels [--out DIR] [--quick]`.

In one run: the device's own ceilings (device-to-device copy bandwidth counting read + write bytes, a large bf16
matmul); fused dequant at the LongCat and Self-Forcing spans for S1/B64 and S4/B16 (time, fraction of copy
bandwidth); compress (2 warm-started k-means iterations + PRQ + pack; eager as the median of 5 rounds, each after a
host-speed probe, and as a CUDA-graph replay); attention over the packed cache vs SDPA
(flash) on the materialized BF16 cache and vs the "dequant then SDPA" read path (time, TFLOP/s, peak memory);
and GPU correctness checks of every kernel against its torch reference. Writes kernels-<gpu>.json and .md.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

from qvg.outputs import writable_error, write_text
from qvg.revision import code_commit


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_probe_ms(loops: int = 200_000) -> float:
    """Milliseconds of a fixed pure-Python loop: the host's speed at that moment, recorded beside host-bound figures
    (the lent hosts' speed drifts within minutes; an eager compress round that slows with it is the host's doing)."""
    t = time.perf_counter()
    s = 0
    for i in range(loops):
        s += i & 7
    return (time.perf_counter() - t) * 1e3


def capture_graph(fn):
    """(CUDA graph of fn, its output): fn run twice on a side stream first (compiles the kernels, settles the
    allocator), then captured and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def gpu_tag(device_name: str) -> str:
    """Short name of a GPU for result file names (h100, h200, else the device name)."""
    if "H100" in device_name:
        return "h100"
    return "h200" if "H200" in device_name else device_name.replace(" ", "-").lower()


# settings of the environment outside QVG_* that change how a GPU run behaves (recorded in its command)
RUN_SETTINGS = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where it cannot be read: lent machines differ in it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.split("\n")[0].strip() or None


def result_header(module: str, argv: list[str] | None) -> dict:
    """The provenance every GPU result file opens with: device (and its UUID: lent machines differ), UTC date,
    commit, the command (`python -m qvg.eval.<module> ARGS`, after the QVG_* settings of the environment that change
    what runs, such as QVG_FAST_LAUNCH=0, and those of `RUN_SETTINGS`), torch, triton and python versions, and the
    NVIDIA driver's."""
    import triton
    from .provenance import command_line
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if (k.startswith("QVG_") and k != "QVG_COMMIT") or k in RUN_SETTINGS)
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return {"device": torch.cuda.get_device_name(), "gpu_uuid": None if uuid is None else str(uuid),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": code_commit(),
            "command": (env + " " if env else "") + command_line(f"python -m qvg.eval.{module}", argv),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "driver": driver_version()}


def out_error(out_dir: str) -> str | None:
    """Why `write_result` could not write its file into out_dir (made with its parents where missing), or None: for
    the tools to check --out before any work, so that a long GPU run does not end unable to write. Makes nothing."""
    if not out_dir:
        return "--out is empty: give a folder"
    folder = os.path.abspath(out_dir)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"--out {out_dir!r}: a file is there, not a folder"
    while not os.path.exists(folder):  # the nearest folder there: the missing ones are made in it
        if os.path.islink(folder):
            return f"--out {out_dir!r}: {folder!r} is a dangling symlink"
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"--out {out_dir!r}: {folder!r} is a file, not a folder"
    err = writable_error(folder)
    return f"--out {out_dir!r}: cannot write to {folder!r} ({err})" if err else None


def write_result(res: dict, out_dir: str, name: str, t0: float) -> str:
    """res (with its wall time since t0) as JSON at out_dir/name, the whole file or none; the path."""
    res["wall_s"] = time.time() - t0
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    write_text(path, json.dumps(res, indent=1))  # (the whole file or none)
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
    return path


def clustered(shape, k=64, seed=0, spread=8.0, dtype=torch.bfloat16, device="cuda", token_seed=None):
    """Video-like KV stand-in (on the GPU by default): per-head cluster centres + noise + a few large outlier
    channels. token_seed: the tokens (their clusters and noise) drawn from this seed, the centres from `seed`."""
    b, h, n, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    centers = torch.randn(b * h, k, d, device=device, generator=g) * spread
    if token_seed is not None:
        g = torch.Generator(device=device).manual_seed(token_seed)
    ids = torch.randint(0, k, (b * h, n), device=device, generator=g)
    x = torch.gather(centers, 1, ids[..., None].expand(-1, -1, d)) + torch.randn(b * h, n, d, device=device,
                                                                                  generator=g)
    x[..., :4] *= 10
    return x.view(b, h, n, d).to(dtype)


def warm_start(x0, method, shape):
    """The warm start a cache gives a chunk's compress: the previous chunk x0's pack (cold, not timed), the
    method's resolved options at `shape` and the centroids [S, B*H, K, D] taken from that pack."""
    import qvg
    from qvg.compression import resolve_options
    from qvg.compression.prq import init_centroids
    prev = qvg.compress(x0, method)
    o = resolve_options(method, shape)
    return prev, o, init_centroids(prev, o, shape)


LONGCAT_SPAN = (1, 32, 29640, 128)


def longcat_stage1(method: str = "qvg"):
    """The LongCat span's first k-means input as the compress benchmark builds it: (x [32, 29640, 128] BF16 on the
    GPU, the warm-start centroids [32, K, 128] of its first stage), for the piece sweeps."""
    shape = LONGCAT_SPAN
    x1 = clustered(shape, seed=1)
    _, _, warm = warm_start(x1, method, shape)
    return x1.view(-1, shape[2], shape[3]), warm[0]


def ceilings(quick):
    n = (1 << 28) if not quick else (1 << 24)
    a = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    s = 8192 if not quick else 2048
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    tm = bench(lambda: x @ y)
    return {"copy_bytes": 2 * a.numel() * 4, "copy_ms": t, "copy_TBps": 2 * a.numel() * 4 / t / 1e9,
            "matmul_shape": [s, s, s], "matmul_ms": tm, "matmul_TFLOPs": 2 * s ** 3 / tm / 1e9}


def with_torch_backend(fn):
    old = os.environ.get("QVG_BACKEND")
    os.environ["QVG_BACKEND"] = "torch"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("QVG_BACKEND")
        else:
            os.environ["QVG_BACKEND"] = old


def dequant_configs(groups: int, planes: int) -> list[dict]:
    """The dequant grids tried (best kept): token blocks x warps; persistent programs (~1, 2, 4 per SM); one
    program per code plane (each gathers 1/planes of a centroid row, so its centroid tables stay in L1)."""
    from qvg.kernels.common import sm_count
    sms = sm_count(torch.device("cuda"))
    out = [dict(block_n=bn, num_warps=nw) for bn, nw in ((32, 4), (64, 4), (64, 8), (128, 8))]
    out += [dict(block_n=bn, num_warps=nw, plane_split=True) for bn, nw in ((32, 4), (64, 4), (128, 8))]
    for split in (False, True):
        for waves in (1, 2, 4):
            progs = max(1, waves * sms // (groups * (planes if split else 1)))
            out += [dict(block_n=bn, num_warps=nw, progs=progs, plane_split=split) for bn, nw in ((64, 4), (128, 8))]
    return out


def dequant_section(copy_tbps, quick):
    import qvg
    from qvg.kernels.dequant import dequantize
    rows = []
    shapes = [(1, 32, 29640, 128), (1, 12, 37440, 128)] if not quick else [(1, 4, 4680, 128)]
    for shape in shapes:
        x = clustered(shape)
        for method in ("qvg", "qvg-pro"):
            p = qvg.compress(x, method)
            ref = with_torch_backend(lambda: qvg.decompress(p))
            best, tried = None, []
            for kw in dequant_configs(shape[0] * shape[1], 8 // p.meta["bits"]):
                out = torch.full_like(ref, float("nan"))
                dequantize(p, out=out, **kw)
                exact = float((out == ref).float().mean())
                ms = bench(lambda: dequantize(p, out=out, **kw))
                tried.append({**kw, "ms": ms, "bitwise_equal_fraction": exact})
                if best is None or ms < best["ms"]:
                    best = tried[-1]
            t_ref = with_torch_backend(lambda: bench(lambda: qvg.decompress(p), warmup=3, rep=10))
            nbytes = p.nbytes + x.numel() * 2
            rows.append({"shape": list(shape), "method": method, "stages": p.meta["stages"],
                         "block_size": p.meta["block_size"], "packed_bytes": p.nbytes, "bytes_moved": nbytes,
                         **best, "TBps": nbytes / best["ms"] / 1e9,
                         "fraction_of_copy_bw": nbytes / best["ms"] / 1e9 / copy_tbps, "torch_reference_ms": t_ref,
                         "configs": tried})
            print(f"  dequant {shape} {method}: {best['ms']:.4f} ms ({ {k: v for k, v in best.items() if k not in ('ms', 'bitwise_equal_fraction')} }), {rows[-1]['fraction_of_copy_bw']:.0%} of copy "
                  f"bw, bitwise equal {best['bitwise_equal_fraction']:.4f} (torch ref {t_ref:.3f} ms)", flush=True)
    return rows


NEXT_CHUNKS = ("noisy", "new-tokens")


def next_chunk(x0, shape, kind: str):
    """The chunk compressed warm-started from x0's pack (`clustered(shape, seed=1)`): "noisy" x0 itself + 0.1
    noise (the benchmark's stand-in since its start: few tokens change cluster), "new-tokens" new tokens of the same
    cluster centres (more do; `moved_shares` says how many)."""
    if kind == "noisy":
        return (x0.float() + 0.1 * torch.randn_like(x0.float())).bfloat16()
    return clustered(shape, seed=1, device=x0.device, token_seed=2)


def moved_shares(x0, x1, method, shape) -> list[float]:
    """Per PRQ stage, the share of x1's tokens whose id the second k-means assignment changes, warm-started from
    x0's pack as the cache does (the torch reference in FP32): the tokens the incremental update reads."""
    from qvg.compression.prq import _gather
    from qvg.kmeans import assign, reseed_empty, update_with_counts
    _, o, warm = warm_start(x0, method, shape)
    r, out = x1.float().view(-1, shape[2], shape[3]), []
    for s in range(o["stages"]):
        rb = r.bfloat16().float()  # each stage clusters the BF16 rounding of its residual
        i1, d1 = assign(rb, warm[s].float().to(rb.device))
        c, n = update_with_counts(rb, i1, warm[s].float().to(rb.device))
        c = reseed_empty(rb, c, n, d1)
        i2, _ = assign(rb, c)
        c2, _ = update_with_counts(rb, i2, c)
        out.append(float((i1 != i2).float().mean()))
        r = r - _gather(c2.bfloat16().float(), i2)
    return out


def compress_section(quick, variants=(), kind="noisy"):
    """Compress at the LongCat span for each of `variants` (kernels/compress.py's COMPRESS_VARIANTS names; default:
    the default variant), warm-started from the previous chunk as a cache does, the next chunk of `kind`
    (`next_chunk`). The API time, the torch reference and the parity with it are of the default variant."""
    import qvg
    from qvg.kernels.compress import COMPRESS_VARIANT, compress_prq
    shape = (1, 32, 29640, 128) if not quick else (1, 4, 4680, 128)
    x0 = clustered(shape, seed=1)
    x1 = next_chunk(x0, shape, kind)
    rows = []
    for method in ("qvg", "qvg-pro"):
        moved = moved_shares(x0, x1, method, shape)
        print(f"  {method}, next chunk {kind}: moved by the second assignment {[round(m, 4) for m in moved]} "
              "(per stage)", flush=True)
        prev, o, warm = warm_start(x0, method, shape)  # cold start (not timed): it warm-starts the next chunk
        api_ms = bench(lambda: qvg.compress(x1, method, init=prev, iters=2), warmup=3, rep=20)
        ref_ms = with_torch_backend(lambda: bench(lambda: qvg.compress(x1, method, init=prev, iters=2), 1, 5))
        # parity with the torch reference on the same warm start
        pr = with_torch_backend(lambda: qvg.compress(x1, method, init=prev, iters=2))
        mse_r = float((with_torch_backend(lambda: qvg.decompress(pr)).float() - x1.float()).pow(2).mean())
        for name in variants or (COMPRESS_VARIANT,):
            tensors = compress_prq(x1, o, warm, 2, variant=name)  # (its pieces and its parity both use it)
            rows.append({"shape": list(shape), "method": method, "iters": 2, "warm_start": True,
                         "next_chunk": kind, "moved_share_per_stage": moved,
                         **_compress_row(x1, o, warm, name, tensors, shape),
                         **_parity(tensors, pr, x1, method, o, mse_r),
                         **({"api_ms": api_ms, "torch_reference_ms": ref_ms} if name == COMPRESS_VARIANT else {})})
            r = rows[-1]
            print(f"  compress {shape} {method} [{name}]: {r['ms']:.3f} ms (CUDA graph replay {r['cuda_graph_ms']} "
                  f"ms; API incl. input checks {api_ms:.3f} ms; torch ref {ref_ms:.2f} ms); ids agree "
                  f"{r['ids_agree_with_reference']:.4f}; mse {r['mse_kernels']:.4g} vs ref {mse_r:.4g}", flush=True)
    return rows


def _parity(tensors, pr, x1, method, o, mse_r) -> dict:
    import qvg
    pk = qvg.Packed(method, tuple(x1.shape), x1.dtype, tensors, o)
    return {"ids_agree_with_reference": float((pk.tensors["ids"] == pr.tensors["ids"]).float().mean()),
            "mse_kernels": float((qvg.decompress(pk).float() - x1.float()).pow(2).mean()), "mse_reference": mse_r}


def _compress_row(x1, o, warm, name, pk, shape) -> dict:
    """One variant's compress time (eager and replayed from a CUDA graph) and its pieces; pk: its output."""
    from qvg.kernels.compress import compress_prq, resolve_variant
    v = resolve_variant(name, shape[0] * shape[1], shape[2], o["centroids"])  # ("auto": the preset it picks)
    # eager: the median of 5 rounds, each round's figure kept (the eager call is host-bound on slow hosts, whose
    # speed drifts within seconds: one round per run read 0.669 and 0.844 ms for qvg in two runs, kernels-h100.md)
    eager, probes = [], []
    for _ in range(5):
        probes.append(host_probe_ms())
        eager.append(bench(lambda: compress_prq(x1, o, warm, 2, variant=name), warmup=3, rep=15))
    ms = statistics.median(eager)
    # the same pipeline replayed from a CUDA graph (chunks have a fixed shape, so a cache can capture it once):
    # GPU time without Python/launch overhead
    try:
        graph, _ = capture_graph(lambda: compress_prq(x1, o, warm, 2, variant=name))
        graph_ms = bench(graph.replay, warmup=5, rep=30)
    except Exception as e:  # reported, the rest of the section still runs
        graph_ms = f"{type(e).__name__}: {str(e)[:120]}"
    from qvg.kernels.kmeans import assign, update
    from qvg.kernels.quantize import quantize_packed
    from qvg.compression.registry import token_spec
    xg = x1.view(-1, shape[2], shape[3])
    c0 = warm[0]
    ids0, _ = assign(xg, c0)
    # the variant's pieces, and the one-hot update the segmented sum replaced (variant sweeps: python -m
    # qvg.eval.profile_compress --variants)
    from qvg.kernels.compress import pick_variant
    picked = pick_variant(shape[0] * shape[1], shape[2], o["centroids"]) if name == "auto" else name
    bound = _pack_bound(xg, pk, o) if v.get("tscale", "bound") == "bound" else None
    ukw = {key: val for key, val in v["update_kw"].items() if key != "incremental"}  # (the first update's form)
    parts = {"variant": name, "preset": picked, "config": v, "ms": ms, "eager_rounds_ms": eager,
             "host_probe_rounds_ms": probes,
             "cuda_graph_ms": graph_ms,
             "assign_ms": bench(lambda: assign(xg, c0, True, **v["assign_kw"])),
             "update_ms": bench(lambda: update(xg, ids0, c0, **ukw)),
             "update_onehot_ms": bench(lambda: update(xg, ids0, c0, method="onehot")),
             "pack_ms": bench(lambda: quantize_packed(x1, token_spec(o), pk.get("ids"), pk.get("centroids"),
                                                      bound=bound, **v["pack_kw"])),
             "pack_tscale": "bound" if bound else "pass"}
    if o["stages"] > 1:
        from qvg.kernels.compress import residual_bf16
        ids_t = pk["ids"].view(o["stages"], -1, shape[2])
        cents_t = pk["centroids"].view(o["stages"], -1, o["centroids"], shape[3])
        parts["residual_ms"] = bench(lambda: residual_bf16(xg, ids_t, cents_t, o["stages"] - 1))
    print(f"    parts: {parts}", flush=True)
    return parts


def _pack_bound(xg, pk, o):
    """The (m_in, m_c) the compress hands its pack (FP8 scales, not asym): max|last k-means input| as FP32 bits
    and max|last centroids|; None otherwise."""
    from qvg.compression.registry import token_spec
    from qvg.kernels.compress import head_absmax, residual_bf16
    from qvg.kernels.kmeans import amax_bits
    spec = token_spec(o)
    if spec.scale_dtype != "fp8" or spec.grid == "asym" or not o["stages"]:
        return None
    s, (g, n, d) = o["stages"], xg.shape
    ids_t = pk["ids"].view(s, g, n)
    cents_t = pk["centroids"].view(s, g, -1, d)
    r = xg.to(torch.bfloat16) if s == 1 else residual_bf16(xg, ids_t, cents_t, s - 1)
    return amax_bits(r), head_absmax(cents_t[s - 1])


def _history(h, n_hist, chunk, method="qvg", centroids=None):
    """Packed K and V chunks of a history of n_hist tokens (4 distinct chunks of content, repeated); centroids: K per
    chunk (None: the method's preset, 256)."""
    import qvg
    from qvg.compression import seeded
    distinct = [clustered((1, h, chunk, 128), seed=10 + i) for i in range(min(4, n_hist // chunk))]
    pk = [qvg.compress(x, method, centroids=centroids) for x in distinct]
    pv = [qvg.compress(x, method, centroids=centroids, **seeded(method, 1)) for x in distinct[1:] + distinct[:1]]
    reps = n_hist // chunk
    return [pk[i % len(pk)] for i in range(reps)], [pv[i % len(pv)] for i in range(reps)]


def packed_history(h, n_hist, chunk, method="qvg", centroids=None):
    """`_history`'s K and V chunks as two PackedSequences (what the attention calls read)."""
    from qvg.sequence import PackedSequence
    kch, vch = _history(h, n_hist, chunk, method, centroids)
    return PackedSequence.from_chunks(kch), PackedSequence.from_chunks(vch)


def _rel_err(out, ref) -> float:
    """Relative Frobenius error of out against ref, in FP32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def _best(fn, configs, flops):
    """Fastest of fn(**config) over configs (configs that fail to compile are skipped and reported)."""
    times = {}
    for cfg in configs:
        try:
            times[tuple(sorted(cfg.items()))] = bench(lambda: fn(**cfg))
        except Exception as e:
            print(f"    {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
    key = min(times, key=times.get)
    return {"ms": times[key], "TFLOPs": flops / times[key] / 1e9, "config": dict(key),
            "all": {str(dict(k)): v for k, v in times.items()}}


FUSED_CONFIGS = [dict(block_m=256, block_n=64, num_warps=8, num_stages=3),  # (packed_attention's default schedule,
                 dict(block_m=256, block_n=64, num_warps=8, num_stages=2),  # stream-K, except splits=0: the grid of
                 dict(block_m=128, block_n=64, num_warps=8, num_stages=2),  # key splits that fills the waves best;
                 dict(block_m=256, block_n=64, num_warps=8, num_stages=3, splits=0),  # 3 stages: one-stage formats;
                 dict(block_m=256, block_n=64, num_warps=8, num_stages=3, waves=True)]  # stream-K after whole waves)
FUSED_ROPE_CONFIGS = [dict(),  # (packed_attention's default with rope: 128 x 32, 8 warps, 2 stages, key splits;
                      dict(block_m=64, num_warps=4)]  # 64-key tiles are refused on a GPU: wrong scores on the H200,
# rope-on-chip-h200.json; + stream-K, below. First size only: 7-10x the staged read's time)
STAGED_CONFIGS = [dict(block_m=128, block_n=64, num_warps=4, num_stages=2),
                  dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
                  dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
                  dict(block_m=128, block_n=64, num_warps=8, num_stages=2)]


def attention_section(quick):
    """Packed attention (staged: windowed decode + carried flash; fused: decode on chip per query block) vs SDPA
    flash on the materialized BF16 cache and vs the official read path (dequantize all, then SDPA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from qvg.attention import attend_reference
    from qvg.kernels.attention import _slots, packed_attention, staged_attention
    from qvg.kernels.dequant import dequantize
    from qvg.sequence import PackedSequence
    h, m, chunk = 12, 4680, 4680
    sizes = [32760, 327600] if not quick else [9360]
    rows = []
    q = torch.randn(1, h, m, 128, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for n_keys in sizes:
        kch, vch = _history(h, n_keys, chunk)
        K, V = PackedSequence.from_chunks(kch), PackedSequence.from_chunks(vch)
        flops = 4 * m * n_keys * 128 * h
        kd, vd = dequantize(K), dequantize(V)  # the materialized BF16 cache, for SDPA only
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = bench(lambda: sdpa(q, kd, vd))
            ref, peak_sdpa = _peak(lambda: sdpa(q, kd, vd))
        t_sdpa_default = bench(lambda: sdpa(q, kd, vd))  # torch's pick (cuDNN on Hopper): what a BF16 cache gets
        del kd, vd
        torch.cuda.empty_cache()
        staged = _best(lambda **c: staged_attention(q, K, V, **c), STAGED_CONFIGS, flops)
        cfg = staged["config"]
        out, peak_staged = _peak(lambda: staged_attention(q, K, V, **cfg))
        err_staged = _rel_err(out, ref)
        windows = {}
        for wdw in (2048, 8192, 16384):
            windows[wdw] = bench(lambda: staged_attention(q, K, V, window=wdw, **cfg))
        # keys stored before RoPE, rotated as they are decoded (3 latent frames of 30 x 52 per chunk)
        from qvg.rope import RopeTables
        n_chunks = n_keys // chunk
        rope = RopeTables(30, 52, 128, torch.arange(n_chunks, device="cuda") * 3, max_frames=3 * n_chunks)
        t_rope = bench(lambda: staged_attention(q, K, V, rope=rope, **cfg))
        _, peak_rope = _peak(lambda: staged_attention(q, K, V, rope=rope, **cfg))
        o_rope = staged_attention(q[:, :, :512], K, V, rope=rope, **cfg)
        r_rope = attend_reference(q[:, :, :512], K, V, rope=rope)
        err_rope = _rel_err(o_rope, r_rope)
        # the same pre-RoPE keys rotated on chip by the fused kernel (first size only)
        fused_rope, err_fused_rope = None, None
        if n_keys == sizes[0]:
            rope_configs = FUSED_ROPE_CONFIGS + [dict(programs=_slots(q, 8))]
            fused_rope = _best(lambda **c: packed_attention(q, K, V, rope=rope, **c), rope_configs, flops)
            peaks = [_peak(lambda: packed_attention(q, K, V, rope=rope, **c))[1] for c in rope_configs]
            fused_rope["peak_transient_bytes_by_config"] = {  # key splits' partial outputs vs stream-K's pieces
                str(c): b for c, b in zip(rope_configs, peaks)}
            fused_rope["peak_transient_bytes"] = peaks[rope_configs.index(fused_rope["config"])]
            o_rope = packed_attention(q[:, :, :512], K, V, rope=rope, **fused_rope["config"])
            err_fused_rope = _rel_err(o_rope, r_rope)
        fused = _best(lambda **c: packed_attention(q, K, V, **c), FUSED_CONFIGS if n_keys == sizes[0] else
                      FUSED_CONFIGS[:1], flops)
        out, peak_fused = _peak(lambda: packed_attention(q, K, V, **fused["config"]))
        err_fused = _rel_err(out, ref)
        # realistic split: the history packed, the current chunk (4680 tokens) BF16 in the tail
        Kh, Vh = PackedSequence.from_chunks(kch[:-1]), PackedSequence.from_chunks(vch[:-1])
        tk, tv = dequantize(kch[-1]), dequantize(vch[-1])
        t_tail = bench(lambda: staged_attention(q, Kh, Vh, tk, tv, **cfg))
        from qvg.kernels.windowed_sdpa import windowed_attention
        t_win = bench(lambda: windowed_attention(q, K, V))
        t_win_tail = bench(lambda: windowed_attention(q, Kh, Vh, tk, tv))
        out, peak_win = _peak(lambda: windowed_attention(q, K, V))
        err_win = _rel_err(out, ref)

        def read_path():  # the official code's read: dequantize the whole history to BF16, then SDPA
            return sdpa(q, dequantize(K), dequantize(V))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_read = bench(read_path)
            _, peak_read = _peak(read_path)
        small = exact = None
        if n_keys == sizes[0]:  # against the fp32 references on a slice of queries
            qs = q[:, :, :512]
            outs = {"staged": staged_attention(qs, K, V, **cfg).float(),
                    "fused": packed_attention(qs, K, V, **fused["config"]).float()}
            o2 = attend_reference(qs, K, V).float()  # the history decoded as the reference rounds it to BF16
            small = {k: _rel_err(o, o2) for k, o in outs.items()}
            o3 = attend_reference(qs, K, V, exact=True).float()  # decoded exactly (FP32): the accuracy measure
            outs["bf16_rounded_decode"] = o2
            exact = {k: _rel_err(o, o3) for k, o in outs.items()}
        rows.append({"heads": h, "queries": m, "keys": n_keys, "flops": flops,
                     "sdpa_flash_ms": t_sdpa, "sdpa_TFLOPs": flops / t_sdpa / 1e9,
                     "sdpa_default_ms": t_sdpa_default, "windowed_sdpa_ms": t_win,
                     "windowed_vs_sdpa_default_throughput": t_sdpa_default / t_win,
                     "windowed_history_plus_bf16_tail_ms": t_win_tail, "windowed_peak_transient_bytes": peak_win,
                     "windowed_rel_err_vs_sdpa": err_win,
                     "staged": staged, "staged_vs_sdpa_throughput": t_sdpa / staged["ms"],
                     "staged_window_ms": windows, "staged_rope_on_read_ms": t_rope,
                     "staged_rope_rel_err_vs_fp32_reference_512_queries": err_rope, "fused_rope_on_chip": fused_rope,
                     "fused_rope_rel_err_vs_fp32_reference_512_queries": err_fused_rope, "fused": fused,
                     "fused_vs_sdpa_throughput": t_sdpa / fused["ms"],
                     "staged_history_plus_bf16_tail_ms": t_tail, "dequant_then_sdpa_ms": t_read,
                     "rel_err_vs_sdpa_on_dequantized": {"staged": err_staged, "fused": err_fused},
                     "rel_err_vs_fp32_reference_512_queries": small,
                     "rel_err_vs_exact_decode_512_queries": exact,
                     "packed_bytes_kv": K.nbytes + V.nbytes, "bf16_history_bytes_kv": 2 * h * n_keys * 128 * 2,
                     "peak_transient_bytes": {"sdpa_on_materialized": peak_sdpa, "staged": peak_staged,
                                              "fused": peak_fused, "dequant_then_sdpa": peak_read,
                                              "staged_rope_on_read": peak_rope}})
        r = rows[-1]
        rope_ms = f"{fused_rope['ms']:.3f}" if fused_rope else "-"
        print(f"  attention {m}x{n_keys}x{h}: staged {staged['ms']:.3f} ms ({staged['TFLOPs']:.0f} TFLOP/s, "
              f"{r['staged_vs_sdpa_throughput']:.0%} of SDPA), fused {fused['ms']:.3f} ms, SDPA {t_sdpa:.3f} ms "
              f"({r['sdpa_TFLOPs']:.0f}), dequant+SDPA {t_read:.3f} ms; +tail {t_tail:.3f} ms; rope on read {t_rope:.3f} ms, "
              f"fused {rope_ms} ms; windows {windows}; "
              f"peak transient MB: staged {peak_staged / 1e6:.0f}, fused {peak_fused / 1e6:.0f}, read path "
              f"{peak_read / 1e6:.0f}, sdpa {peak_sdpa / 1e6:.0f}", flush=True)
    return rows


def attention_ablation_section():
    """Where the packed attention's time goes: the same kernel over storage formats of growing decode cost."""
    import qvg
    from qvg.kernels.attention import packed_attention
    from qvg.sequence import PackedSequence
    h, m, chunk, n_keys = 12, 4680, 4680, 32760
    q = torch.randn(1, h, m, 128, device="cuda", dtype=torch.bfloat16)
    flops = 4 * m * n_keys * 128 * h
    xs = [clustered((1, h, chunk, 128), seed=20 + i) for i in range(7)]
    formats = {"rtn int8 B128": dict(method="rtn", bits=8, block_size=128),
               "rtn int4 B128": dict(method="rtn", bits=4, block_size=128),
               "rtn int2 B64": dict(method="rtn", bits=2, block_size=64),
               "qvg int2 S1 B64": dict(method="qvg"), "qvg int4 S1 B64": dict(method="qvg", bits=4),
               "qvg-pro int2 S4 B16": dict(method="qvg-pro")}
    cfgs = [(256, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (256, 32, 8, 2)]
    out = {}

    def best(fn):
        times = {}
        for a, b, w, s in cfgs:
            try:
                times[(a, b, w, s)] = bench(lambda: fn(block_m=a, block_n=b, num_warps=w, num_stages=s))
            except Exception as e:
                print(f"    {(a, b, w, s)}: {type(e).__name__}", flush=True)
        cfg = min(times, key=times.get)
        return {"ms": times[cfg], "TFLOPs": flops / times[cfg] / 1e9, "config": list(cfg)}

    kd = torch.cat(xs, 2)
    out["bf16 (tail path)"] = best(lambda **c: packed_attention(q, None, None, kd, kd, **c))
    print(f"  bf16: {out['bf16 (tail path)']}", flush=True)
    for name, kw in formats.items():
        seq = PackedSequence.from_chunks([qvg.compress(x, **kw) for x in xs])
        out[name] = best(lambda **c: packed_attention(q, seq, seq, **c))
        print(f"  {name}: {out[name]}", flush=True)
    return out


def kmeans_parity_section():
    from qvg.kmeans import kmeans as ref_kmeans
    from qvg.kernels.kmeans import kmeans
    x = clustered((1, 8, 4680, 128)).view(8, 4680, 128)
    a = kmeans(x, 256, iters=4, seed=0, track=True)
    b = ref_kmeans(x, 256, iters=4, seed=0, track=True)
    a2 = kmeans(x, 256, iters=4, seed=0)
    return {"ids_agree": float((a.ids == b.ids).float().mean()), "objective_kernels": a.trace.tolist(),
            "objective_reference": b.trace.tolist(), "deterministic": bool(torch.equal(a.ids, a2.ids) and
                                                                            torch.equal(a.centroids, a2.centroids))}


SECTIONS = ("ceilings", "kmeans", "dequant", "compress", "attention", "ablation")  # (main's, in their order)


def check_args(args) -> tuple[set[str], tuple[str, ...]]:
    """(--only's sections, empty for all; --compress-variants' names) of `main`'s command line; ValueError naming the
    option at fault, with the valid choices (checked on any machine, before the GPU check)."""
    only = {n.strip() for n in args.only.split(",")} - {""}
    bad = sorted(only - set(SECTIONS))
    if bad or (args.only.strip() and not only):
        what = f"unknown section {', '.join(map(repr, bad))}" if bad else "no section given"
        raise ValueError(f"--only: {what}; choose among {', '.join(SECTIONS)} (comma-separated; the ceilings always "
                         "run)")
    variants = tuple(n.strip() for n in args.compress_variants.split(",") if n.strip())
    if variants or args.compress_variants.strip():
        from qvg.kernels.compress import COMPRESS_VARIANTS
        known = ("auto", *sorted(COMPRESS_VARIANTS))
        bad = [n for n in variants if n not in known]
        if bad or not variants:
            what = f"unknown variant {', '.join(map(repr, bad))}" if bad else "no variant given"
            raise ValueError(f"--compress-variants: {what}; choose among {', '.join(known)} (comma-separated)")
    err = out_error(args.out)
    if err:
        raise ValueError(err)
    return only, variants


def main(argv=None) -> int:
    from qvg.app.generate import UsageError, _Parser  # (the project's parser: a usage error is one line)
    ap = _Parser(prog="python -m qvg.eval.bench_kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--only", default="", help=f"comma list of sections: {','.join(SECTIONS)} (default: all; the "
                    "ceilings always run)")
    ap.add_argument("--compress-variants", default="",
                    help="comma list of kernels/compress.py COMPRESS_VARIANTS (or auto) to time (default: the "
                         "default one)")
    ap.add_argument("--next-chunk", default="noisy", choices=NEXT_CHUNKS,
                    help="compress: the chunk compressed warm-started from the previous one (default noisy: the "
                         "previous one + 0.1 noise; new-tokens: new tokens of the same clusters, which move more "
                         "tokens between clusters)")
    try:  # every argument checked before the GPU check: bad input is said on any machine
        args = ap.parse_args(argv)
        only, variants = check_args(args)
    except (UsageError, ValueError) as e:
        print(f"bench_kernels: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    res = result_header("bench_kernels", argv)
    dev = res["device"]
    sections = [("ceilings", lambda: ceilings(args.quick)),
                ("kmeans", kmeans_parity_section),
                ("dequant", lambda: dequant_section(res["ceilings"]["copy_TBps"], args.quick)),
                ("compress", lambda: compress_section(args.quick, variants, args.next_chunk)),
                ("attention", lambda: attention_section(args.quick)),
                ("ablation", attention_ablation_section)]
    assert tuple(name for name, _ in sections) == SECTIONS
    for name, fn in sections:
        if only and name not in only and name != "ceilings":
            continue
        print(f"[{name}]", flush=True)
        try:
            res[name] = fn()
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
    write_result(res, args.out, f"kernels-{gpu_tag(dev)}.json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
