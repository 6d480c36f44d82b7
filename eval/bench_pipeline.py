"""Real-size pipeline benchmark (issue 4, part 4; GPU): `python -m qvg.eval.bench_pipeline [--out DIR]
[--history 21,60] [--methods bf16,qvg,qvg-pro]`.

The full Wan2.1-T2V-1.3B transformer config with random weights, 480x832 (1560 tokens per latent frame), batch 1,
bf16. For each history length and method: the cache is filled with synthetic committed chunks (clustered K/V,
compressed by the method as the pipeline would), then one chunk runs (4 denoising steps + the clean re-run at
t = 0 + commit) with a rolling window of that history, timed with CUDA events right behind an untimed chunk
(`steady_ms`: the steady state of generation, where a chunk's queued commits run into the next one; text encoder
and VAE excluded: the cache does not change them). The methods' chunks are timed in rounds, one chunk of each per
round, after one untimed round, in an order rotated from round to round (with --repeat a multiple of the number of
methods, each method runs in each place of a round equally often). KV bytes: `torch.cuda.memory_allocated` delta
across the fill, plus the free blocks of the compression graphs' private pools (held for the replays;
memory_allocated omits them), vs the cache's own accounting. Writes pipeline-<gpu>.json.

Each chunk runs on the generation stream, as in the pipelines (qvg.streams; flag `default-stream`: the device's
default stream). On the default stream the first cache in a process that prefetches its decodes started each
default-stream kernel ~1.1-1.4 us later, so the packed cache built first there ran 1.5-2.1 points slower than the
same cache built second (eval/results/pipeline-h100.md, section of the 18:09-18:45 UTC runs); on the generation
stream one run showed no order effect. A real run holds one cache: the figures of record time each packed method
alone with bf16 (`--methods bf16,qvg`, then `--methods bf16,qvg-pro`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from qvg.compression.graphed import pool_free_bytes
from qvg.help_format import OneLineParser, Parser

from .bench_kernels import gpu_tag, out_error, result_header, write_result

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
LATENT_HW = (60, 104)  # 480 x 832 / 8


def wan_model(**config):
    """The Wan2.1-1.3B causal transformer (config overrides allowed), seeded random weights, bf16 on CUDA."""
    from qvg.pipelines.causal_wan import CausalWanTransformer
    torch.manual_seed(0)
    return CausalWanTransformer(**{**WAN_1_3B, **config}).to("cuda", torch.bfloat16).eval()


def new_cache(model, method: str, window: int, options: dict):
    """A 30-layer cache of 3-frame chunks with a rolling window (options apply to the compressed methods).
    method "NAME[:pre-rope][:sync][:eager-commit][:noprefetch|:prefetch-after|:prefetch-split][:plain-writes]
    [:high-priority|:default-stream][:staged-read|:fused-read][:compress=PRESET][:every=N][:shift][:nographs]
    [:commit-sms=N][:prefetch-sms=N]" (`parse_method`):
    keys packed before RoPE (KVCache key_storage); commits in line with the forward instead of on the cache's side
    stream (KVCache async_commit=False); side-stream commits queued by each layer's commit_layer (KVCache
    defer_commits=False); every history decoded in line before its attention (KVCache prefetch_bytes=0), or its
    prefetch queued after each SDPA call instead of just before it (prefetch_at="after", the default before
    525b5c6), or queued between the two halves of an SDPA call split by query rows, whole waves first
    (prefetch_at="split"); plain-writes: the chunk's denoising steps write as the re-run does, not transient;
    high-priority: the chunk runs on a high-priority CUDA stream, so the cache's side streams (prefetched decodes,
    queued commits) get only the SMs its kernels leave idle; default-stream: the chunk runs on the device's default
    (legacy) stream, as before 2026-11-29, instead of the generation stream the pipelines use (qvg.streams; these
    three flags are read by `method_runner`; the cache ignores them); staged-read / fused-read: the history read
    through the packed-cache attention kernels (KVCache read="staged" / "fused", rtn / qvg / qvg-pro only; with
    pre-rope both rotate the keys as they decode them) instead of decode + cuDNN;
    compress=PRESET: the cache compresses with kernels/compress.py's preset PRESET instead of the default "auto"
    (KVCache compress_preset); every=N: the cache packs every N chunks (KVCache commit_every; `method_runner`
    then times N chunks per call, one whole commit cycle); shift (bf16 only): the full window makes room by
    copying the history one chunk back, as upstream Self-Forcing's cache does, instead of the ring (KVCache
    bf16_rolling="shift"); nographs: the commits compress eagerly instead of replaying CUDA graphs (KVCache
    cuda_graphs=False); commit-sms=N / prefetch-sms=N: the queued commits / the prefetched decodes run on N SMs only,
    a CUDA green context's stream (KVCache commit_sms / prefetch_sms)."""
    from qvg.cache import KVCache
    name, flags, preset = parse_method(method)
    return KVCache(30, name, chunk_frames=3, tokens_per_frame=model.tokens_per_latent_frame(*LATENT_HW),
                   window_frames=window, key_storage=_key_storage(flags),
                   async_commit="sync" not in flags, defer_commits="eager-commit" not in flags,
                   prefetch_at=_prefetch_at(flags),
                   read=_read(flags), bf16_rolling="shift" if "shift" in flags else "ring",
                   cuda_graphs="nographs" not in flags, commit_every=commit_every(method),
                   commit_sms=_numbered(method, "commit-sms"), prefetch_sms=_numbered(method, "prefetch-sms"),
                   **({"prefetch_bytes": 0} if "noprefetch" in flags else {}),
                   **({} if name == "bf16" else dict(options, compress_preset=preset)))


def commit_every(method: str) -> int:
    """N of a method string's every=N flag (KVCache commit_every), 1 without it."""
    return _numbered(method, "every") or 1


def _numbered(method: str, flag: str) -> int | None:
    """N of a method string's FLAG=N, None without it."""
    return next((int(f.split("=", 1)[1]) for f in method.split(":")[1:] if f.startswith(flag + "=")), None)


def _prefetch_at(flags: list[str]) -> str:
    return "after" if "prefetch-after" in flags else "split" if "prefetch-split" in flags else "before"


def _key_storage(flags: list[str]) -> str:
    return "pre-rope" if "pre-rope" in flags else "post-rope"


def _read(flags: list[str]) -> str:
    return "staged" if "staged-read" in flags else "fused" if "fused-read" in flags else "window"


FLAGS = ("pre-rope", "sync", "eager-commit", "noprefetch", "prefetch-after", "prefetch-split", "plain-writes",
         "high-priority", "default-stream", "staged-read", "fused-read", "shift", "nographs")


def parse_method(method: str) -> tuple[str, list[str], str | None]:
    """(cache method, flags, compress preset or None) of a `new_cache` method string; ValueError names what is
    wrong (checked before anything runs)."""
    from qvg.cache import CACHE_METHODS
    from qvg.kernels.compress import check_variant
    name, *flags = method.split(":")
    presets = [f.split("=", 1)[1] for f in flags if f.startswith("compress=")]
    everies = [f.split("=", 1)[1] for f in flags if f.startswith("every=")]
    sms = {k: [f.split("=", 1)[1] for f in flags if f.startswith(k + "=")] for k in ("commit-sms", "prefetch-sms")}
    flags = [f for f in flags if not f.startswith(("compress=", "every=", "commit-sms=", "prefetch-sms="))]
    if name not in CACHE_METHODS:
        raise ValueError(f"unknown cache method {name!r} in {method!r}; choose one of: {', '.join(CACHE_METHODS)}")
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise ValueError(f"unknown method flag(s) {', '.join(sorted(unknown))} in {method!r} "
                         f"({', '.join(FLAGS)}, compress=PRESET, every=N, commit-sms=N, prefetch-sms=N)")
    if "shift" in flags and name != "bf16":
        raise ValueError(f"{method!r}: shift is for bf16 (the packed methods' rolling window is a ring)")
    if "staged-read" in flags and "fused-read" in flags:
        raise ValueError(f"{method!r}: staged-read or fused-read, not both")
    if sum(f in flags for f in ("noprefetch", "prefetch-after", "prefetch-split")) > 1:
        raise ValueError(f"{method!r}: one of noprefetch, prefetch-after, prefetch-split at most")
    if "high-priority" in flags and "default-stream" in flags:
        raise ValueError(f"{method!r}: high-priority or default-stream, not both")
    if len(presets) > 1 or (presets and name == "bf16"):
        raise ValueError(f"{method!r}: one compress=PRESET at most, and not for bf16 (it compresses nothing)")
    for p in presets:
        check_variant(p)
    if len(everies) > 1 or (everies and name == "bf16") or any(not e.isdigit() or int(e) < 1 for e in everies):
        raise ValueError(f"{method!r}: one every=N at most (N >= 1), and not for bf16 (it packs nothing)")
    for k, ns in sms.items():
        if len(ns) > 1 or any(not n.isdigit() or int(n) < 1 for n in ns):
            raise ValueError(f"{method!r}: one {k}=N at most (N >= 1)")
    from qvg.cache import read_error
    bad_read = read_error(name, _read(flags))
    if bad_read:
        raise ValueError(f"{method!r}: {bad_read}")
    return name, flags, (presets[0] if presets else None)


def pipeline_args(doc: str, methods: str, history: int = 21) -> argparse.ArgumentParser:
    """An argument parser with the options every one-history pipeline tool shares (--out, --history, --methods,
    --options; check them with `parse_methods`), described by the first paragraph of `doc`."""
    ap = OneLineParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--history", type=int, default=history)
    ap.add_argument("--methods", default=methods)
    ap.add_argument("--options", default='{"centroids": 64}', help="JSON options of the compressed methods")
    return ap


def checked_methods(args, tool: str, check=None):
    """(methods, options, check(args)) from `pipeline_args`' --methods / --options, `check` (None, or the tool's
    other checks, raising ValueError) run on args; None after one error line on stderr ("error: ..."): bad input, or
    no CUDA GPU."""
    try:
        methods, options = parse_methods(args.methods, args.options)
        extra = check(args) if check is not None else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print(f"error: {tool} needs a CUDA GPU", file=sys.stderr)
        return None
    return methods, options, extra


def parse_methods(text: str, options: str | None = None, cycles: bool = False) -> tuple[list[str], dict | None]:
    """(method strings, compressed methods' options) of comma-separated `new_cache` methods and a JSON options
    string (None: none given); ValueError names what is wrong (checked before anything runs). every=N only where
    the tool times whole commit cycles (`cycles`: bench_pipeline's chunk rounds)."""
    methods = text.split(",")
    for m in methods:
        parse_method(m)
        if commit_every(m) > 1 and not cycles:
            raise ValueError(f"{m!r}: every=N is timed per commit cycle by bench_pipeline's chunk rounds only "
                             "(not by --max-history, --split or the other pipeline tools, which time one chunk)")
    if options is None:
        return methods, None
    try:
        opts = json.loads(options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ValueError(f"--options must be a JSON object of option names and values, got {options!r}")
    return methods, opts


def cuda_ms(fn) -> float:
    """Milliseconds of fn() between two CUDA events on the current stream (synchronized)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def on_stream(fn, stream):
    """fn run on `stream` (None: fn itself), ordered after the current stream's work so far and before its later
    work."""
    if stream is None:
        return fn

    def run():
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            fn()
        cur.wait_stream(stream)
    return run


def steady_ms(chunk) -> float:
    """Milliseconds of one chunk right behind another, as in generation: the chunk before (not timed) leaves its
    queued side-stream commits running into this one, whose writes and reads wait for them; this chunk's own are
    left to the next (a cache's `commit()` does not join them). Timing a chunk alone after a synchronize would
    drop every queued commit from the measurement."""
    chunk()
    return cuda_ms(chunk)


def _fill(cache, frames: int, heads: int, seed: int = 0):
    """Commit synthetic chunks until `frames` past frames are held (clustered, like real K/V)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = cache.chunk_tokens
    for _ in range(frames // cache.chunk_frames):
        if cache.key_storage == "pre-rope":  # (the model passes them itself when it runs)
            pos = torch.zeros(1, cache.chunk_frames, 3, dtype=torch.int32)
            pos[..., 0] = torch.arange(cache.frames, cache.frames + cache.chunk_frames)
            cache.set_positions(pos, LATENT_HW[0] // 2, LATENT_HW[1] // 2)
        for layer in range(cache.num_layers):
            centres = torch.randn(2, 1, heads, 64, 128, device="cuda", generator=g) * 3
            ids = torch.randint(0, 64, (t,), device="cuda", generator=g)
            kv = (centres[:, :, :, ids] + torch.randn(2, 1, heads, t, 128, device="cuda", generator=g)).bfloat16()
            cache.write(layer, kv[0], kv[1])
        cache.commit()


def chunk_runner(model, cache, commit_layers: bool = True, transient: bool = True):
    """(chunk, forwards): one whole chunk at the cache's next frame (forwards + the final commit), and its
    forwards alone: the 4 denoising steps + the clean re-run at t = 0, each layer committed right after its
    re-run attention as the pipeline does unless not commit_layers; the denoising steps' writes transient as in the
    pipeline unless not transient (fixed inputs: the cache's time and memory do not depend on the values)."""
    from qvg.pipelines.causal_wan import CrossKV
    from qvg.pipelines.self_forcing import flow_sigmas
    g = torch.Generator(device="cuda").manual_seed(1)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(1, 16, 3, *LATENT_HW, device="cuda", dtype=torch.bfloat16, generator=g)
    cross = CrossKV()

    def forwards():
        f0 = cache.frames
        for sigma in flow_sigmas():
            model(x, torch.full((1,), sigma * 1000, device="cuda"), text, frame_offset=f0, cache=cache, cross=cross,
                  transient=transient)
        model(x, torch.zeros(1, device="cuda"), text, frame_offset=f0, cache=cache, cross=cross, commit=commit_layers)

    def chunk():
        forwards()
        cache.commit()
    return chunk, forwards


def on_generation_stream(fn):
    """fn run on the generation stream, as the pipelines run each chunk (qvg.streams)."""
    from qvg.streams import generation_stream

    def run():
        with generation_stream("cuda"):
            fn()
    return run


def method_runner(model, cache, method: str, commit_layers: bool = True):
    """`chunk_runner` for a `new_cache` method name, on the generation stream as in the pipelines, or on a
    high-priority stream / the default stream with those flags; plain-writes applied. With every=N the chunk is N
    chunks in a row (one commit cycle: time it and divide by N)."""
    flags = method.split(":")[1:]
    one, forwards = chunk_runner(model, cache, commit_layers, transient="plain-writes" not in flags)
    n = commit_every(method)

    def chunk():
        for _ in range(n):
            one()
    if "high-priority" in flags:
        high = torch.cuda.Stream(priority=-1)
        return on_stream(chunk, high), on_stream(forwards, high)
    if "default-stream" in flags:
        return chunk, forwards
    return on_generation_stream(chunk), on_generation_stream(forwards)


def rotated(items: list, i: int) -> list:
    """Round i's order: items rotated left by i (so over len(items) rounds each item runs in each place once)."""
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


def run(histories, methods, options, repeat: int = 7, split: bool = False) -> list[dict]:
    """split: also time the chunk's forwards without any commit (`forwards_ms`: the reads' cost alone; the chunk
    time less it is what the commits add)."""
    model = wan_model()
    rows = []
    for hist in histories:
        runs, caches = {}, {}
        for method in methods:  # every method's cache is built first, then the chunks are timed in rounds
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            free_before = pool_free_bytes(torch.device("cuda"))  # (the caches built before this one keep theirs)
            cache = new_cache(model, method, hist, options)
            _fill(cache, hist, 12)
            torch.cuda.synchronize()
            # graph pools: memory_allocated omits their free blocks
            pool_free = pool_free_bytes(torch.device("cuda")) - free_before
            delta = torch.cuda.memory_allocated() - before + pool_free
            acc = cache.memory()
            chunk = method_runner(model, cache, method)[0]
            with torch.no_grad():
                chunk()  # warm-up (compiles kernels, fills the text K/V)
            runs[method] = chunk
            if split:
                runs[method, "forwards"] = method_runner(model, cache, method, commit_layers=False)[1]
            caches[method] = cache
            row = {"history_frames": hist, "method": method, "chunk_ms_all": [],
                   "chunks_per_timing": commit_every(method),
                   "kv_bytes_allocator_delta": delta, "graph_pool_free_bytes": pool_free,
                   "kv_bytes_accounted": acc["total"],
                   "accounting_error": (acc["total"] - delta) / delta, "kv_components": acc}
            print(f"history {hist} {method}: KV {delta / 2**20:.1f} MiB allocator vs "
                  f"(workspace {acc['workspace'] / 2**20:.1f} MiB) "
                  f"{acc['total'] / 2**20:.1f} accounted ({100 * row['accounting_error']:+.2f}%), "
                  f"ratio {acc['compression_ratio']:.2f}x", flush=True)
            rows.append(row)
            cache = chunk = None  # (the closure holds the cache)
        mine = [r for r in rows if r["history_frames"] == hist]
        with torch.no_grad():  # rounds: each method's chunk once per round, so clock drift hits all alike
            for r in mine:  # one untimed round first: a run's first chunks ran up to ~2% faster than its later ones
                steady_ms(runs[r["method"]])
            for i in range(repeat):
                for r in rotated(mine, i):  # each method takes each place in the round equally often
                    r["chunk_ms_all"].append(steady_ms(runs[r["method"]]) / r["chunks_per_timing"])
                    if split:  # (its own untimed call first; the chunk after it overwrites its writes)
                        r.setdefault("forwards_ms_all", []).append(steady_ms(runs[r["method"], "forwards"]))
        for r in mine:
            r["chunk_ms"] = statistics.median(r["chunk_ms_all"])
            if split:
                r["forwards_ms"] = statistics.median(r["forwards_ms_all"])
            r["prefetch_stats"] = dict(caches[r["method"]].prefetch_stats)  # (the warm-up and timed chunks)
            r["reads"] = dict(caches[r["method"]].reads)  # the read paths that ran over the whole run (KVCache.reads)
            r["attended_frames"] = _attended(caches[r["method"]])  # (each timed call's chunks, in order)
            print(f"history {hist} {r['method']}: chunk {r['chunk_ms']:.1f} ms (median of {repeat}; "
                  f"min {min(r['chunk_ms_all']):.1f})"
                  + (f", forwards without commits {r['forwards_ms']:.1f} ms" if split else ""), flush=True)
        for r in mine:  # peak while one whole chunk (every=N: commit cycle) runs (other caches resident: subtracted)
            with torch.no_grad():  # (first a whole chunk: a forwards-only run leaves layer 0's prefetch held)
                runs[r["method"]]()
            torch.cuda.synchronize()
            base_alloc = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                runs[r["method"]]()
            torch.cuda.synchronize()
            r["peak_bytes_during_chunk_above_resident"] = torch.cuda.max_memory_allocated() - base_alloc
        runs = caches = None
        torch.cuda.empty_cache()
        base = next(r for r in rows if r["history_frames"] == hist and r["method"] == "bf16")
        shift = next((r for r in rows if r["history_frames"] == hist and r["method"] == "bf16:shift"), None)
        for r in rows:
            if r["history_frames"] == hist:
                r["overhead_vs_bf16"] = r["chunk_ms"] / base["chunk_ms"] - 1
                if shift is not None:  # (against upstream's rolling cache, the anchors' baseline)
                    r["overhead_vs_bf16_shift"] = r["chunk_ms"] / shift["chunk_ms"] - 1
                if split:
                    r["forwards_overhead_vs_bf16"] = r["forwards_ms"] / base["forwards_ms"] - 1
    return rows


def _attended(cache) -> list[float]:
    """The past frames (sink, history and pending zones) the next commit_every chunks attend, from layer 0: with
    units of several chunks a rolling window can hold more than window_frames (KVCache._evict)."""
    held = cache.tokens(0) - cache.layers[0].n_cur  # (sink + history + pending)
    return [(held + i * cache.chunk_tokens) / cache.tokens_per_frame for i in range(cache.commit_every)]


def _install(cache, frames: int, heads: int, seed: int = 0) -> None:
    """Give every layer `frames` committed frames at once (for the max-history search: thousands of frames would
    take minutes through commit()). Compressed methods: one synthetic chunk compressed per layer, repeated into
    a PackedSequence of the right length (the layout and bytes of a real history; values do not change the
    time or memory). bf16: the BF16 buffer sized as commit() would leave it (history + one chunk of room)."""
    from qvg import compression
    from qvg.sequence import PackedSequence
    t, n_chunks = cache.chunk_tokens, frames // cache.chunk_frames
    g = torch.Generator(device="cuda").manual_seed(seed)
    for L in cache.layers:
        if cache.method == "bf16":
            L.buf = [torch.empty(1, heads, (n_chunks + 1) * t, 128, device="cuda", dtype=torch.bfloat16).normal_(
                generator=g) for _ in range(2)]
            L.n_pending = n_chunks * t
            continue
        hist = []
        for _ in range(2):
            centres = torch.randn(1, heads, 64, 128, device="cuda", generator=g) * 3
            ids = torch.randint(0, 64, (t,), device="cuda", generator=g)
            x = (centres[:, :, ids] + torch.randn(1, heads, t, 128, device="cuda", generator=g)).bfloat16()
            p = compression.compress(x, cache.method, **cache.options)
            hist.append(PackedSequence.from_chunks([p] * n_chunks))
            del p
        L.hist = hist
    cache.frames = frames
    cache.commits = n_chunks


def _fits(model, method: str, frames: int, options: dict) -> dict | None:
    """Peak memory of one chunk (4 steps + clean re-run + commit, window = frames) over `frames` past frames, or
    None if it ran out of memory."""
    cache = chunk = None
    torch.cuda.empty_cache()
    try:
        cache = new_cache(model, method, frames, options)
        _install(cache, frames, 12)
        chunk, _ = method_runner(model, cache, method)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            ms = cuda_ms(chunk)
        kv = cache.memory()  # after the chunk: the history, the BF16 zone and the compression graph
        return {"frames": frames, "peak_bytes": torch.cuda.max_memory_allocated(), "chunk_ms": ms,
                "kv_bytes_accounted": kv["total"], "compression_ratio": kv["compression_ratio"], "kv": kv}
    except torch.OutOfMemoryError:
        return None
    except RuntimeError as e:  # cuDNN / cuBLAS report an allocation failure as their own error
        if "out of memory" in str(e).lower() or "alloc" in str(e).lower():
            return None
        raise
    finally:
        cache = chunk = None
        torch.cuda.empty_cache()


def max_history(model, method: str, options: dict, guess: int) -> dict:
    """The largest history (a multiple of 3 latent frames) for which one more chunk still runs: gallop from
    `guess` in 2.5% steps to a fitting / failing pair, then bisect until they are 3 frames or 1% apart (`lo`
    fits, `hi` does not)."""
    lo, hi, trials = None, None, []
    n = max(3, guess // 3 * 3)
    while hi is None or lo is None or hi - lo > max(3, lo // 300 * 3):
        r = _fits(model, method, n, options)
        trials.append({"frames": n, "fits": r is not None, **(r or {})})
        print(f"  max-history {method}: {n} frames -> {'fits' if r else 'out of memory'}"
              + (f" (peak {r['peak_bytes'] / 2**30:.2f} GiB, chunk {r['chunk_ms'] / 1e3:.1f} s)" if r else ""),
              flush=True)
        if r is not None:
            lo, best = n, r
        else:
            hi = n
        if lo is not None and hi is not None:
            n = (lo + hi) // 6 * 3
            if n <= lo:
                n = lo + 3
            if n >= hi:
                break
        elif lo is None:
            n = max(3, (n * 39 // 40) // 3 * 3)
        else:
            n = (n * 41 // 40 + 3) // 3 * 3
    if lo is None:
        return {"method": method, "options": options, "max_history_frames": 0, "trials": trials}
    return {"method": method, "options": options, "max_history_frames": lo, "fails_at_frames": hi, "at_max": best,
            "trials": trials}


def run_max_history(methods_opts: list[tuple[str, dict]]) -> list[dict]:
    """max_history for each (method, options), the first guess from the bytes per frame and the free memory."""
    # histories past 1024 frames put the chunk's RoPE index past Wan's 1024-frame table: a longer table (8 MB)
    # for the memory search only (it holds the same for every method)
    model = wan_model(rope_max_seq_len=8192)
    total = torch.cuda.get_device_properties(0).total_memory
    out = []
    for method, opts in methods_opts:
        small = _fits(model, method, 21, opts)  # bytes per frame and the fixed part, from a small history
        kv = small["kv"]  # bf16: 21 past + 3 current frames in BF16; else 21 packed frames + the BF16 zone
        per_frame = kv["total"] / 24 if method == "bf16" else (kv["total"] - kv["bf16"] - kv["workspace"]) / 21
        from qvg.kernels.windowed_sdpa import WINDOW_BYTES  # the staging window grows to its cap on long histories
        guess = int((total * 0.97 - small["peak_bytes"] - (WINDOW_BYTES if method != "bf16" else 0)) / per_frame) + 21
        print(f"max-history {method} {opts}: {per_frame / 2**20:.1f} MiB per frame, first guess {guess}", flush=True)
        out.append({**max_history(model, method, opts, guess), "bytes_per_frame_estimate": per_frame,
                    "gpu_total_bytes": total})
    return out


DEFAULT_OPTIONS = '{"centroids": 64}'  # main's --options


def parse_histories(text: str) -> list[int]:
    """--history's comma-separated history lengths: each a positive multiple of the chunk's 3 latent frames (the
    rolling window of `new_cache`: KVCache's window_frames is a multiple of chunk_frames; `_fill` commits whole
    chunks), none twice (run() groups its rows by history); ValueError naming --history otherwise."""
    items = [h.strip() for h in text.split(",")]
    if not all(h.isascii() and h.isdigit() and int(h) > 0 and int(h) % 3 == 0 for h in items):
        raise ValueError(f"--history must be comma-separated positive multiples of 3 (latent frames: whole "
                         f"3-frame chunks), e.g. 21,60; got {text!r}")
    hist = [int(h) for h in items]
    twice = next((h for h in hist if hist.count(h) > 1), None)
    if twice is not None:
        raise ValueError(f"--history lists {twice} twice")
    return hist


def check_args(args) -> tuple[list[int], list[str], dict]:
    """(histories, methods, compressed methods' options) of `main`'s command line; ValueError naming the option at
    fault. Everything is checked here, on any machine, before the GPU check and before anything runs."""
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1 (timed chunks per method), got {args.repeat}")
    histories = [21] if args.max_history else parse_histories(args.history)  # (--max-history searches its own)
    flag, listed = ("--max-history", args.max_history) if args.max_history else ("--methods", args.methods)
    cycles = not (args.max_history or args.split)
    try:
        parse_methods(listed, cycles=cycles)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    methods, opts = parse_methods(listed, args.options, cycles=cycles)  # (the methods passed: this is --options')
    twice = next((m for m in methods if methods.count(m) > 1), None)
    if twice is not None:
        raise ValueError(f"{flag} lists {twice!r} twice")
    if not args.max_history and "bf16" not in methods:
        raise ValueError("--methods must include bf16: every overhead is against it")
    # the options as each method's cache takes them (unknown names, bad values): a cache of the real chunk size,
    # built on the CPU for a stand-in model (it allocates nothing until written to)
    import types
    _, ph, pw = WAN_1_3B["patch_size"]
    stand_in = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: (h // ph) * (w // pw))
    from qvg.cache import check_options
    for m in methods:
        try:
            cache = new_cache(stand_in, m, histories[0], opts)
            if cache.method != "bf16":  # (and at Wan's head dim, as the first write checks them)
                check_options(cache.method, cache.options, cache.commit_every * cache.chunk_frames *
                              cache.tokens_per_frame, head_dim=WAN_1_3B["attention_head_dim"])
        except (ValueError, TypeError, ArithmeticError) as e:
            given = "(the default)" if args.options == DEFAULT_OPTIONS else repr(args.options)
            raise ValueError(f"--options {given}: {m}: {e}") from None
    err = out_error(args.out)
    if err:
        raise ValueError(err)
    return histories, methods, opts


def main(argv=None) -> int:
    ap = Parser(prog="python -m qvg.eval.bench_pipeline", description=__doc__.splitlines()[0])  # (errors: ValueError)
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--history", default="21,60", help="past latent frames held, multiples of 3 (default 21,60)")
    ap.add_argument("--methods", default="bf16,qvg,qvg-pro")
    ap.add_argument("--options", default=DEFAULT_OPTIONS,
                    help=f"JSON options of the compressed methods (default {DEFAULT_OPTIONS})")
    ap.add_argument("--repeat", type=int, default=7, help="timed chunks per method (rounds over the methods)")
    ap.add_argument("--split", action="store_true",
                    help="also time each chunk's forwards without commits (what the reads cost alone)")
    ap.add_argument("--max-history", default=None, metavar="M1,M2",
                    help="instead: the largest history that still runs one chunk, for these methods (e.g. bf16,qvg)")
    try:  # every argument checked before anything runs (and before the GPU check: bad input is said on any machine)
        args = ap.parse_args(argv)
        histories, methods, opts = check_args(args)
    except ValueError as e:
        print(f"bench_pipeline: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        raise SystemExit("bench_pipeline: needs a CUDA GPU")
    t0 = time.time()
    # (the header every GPU result file opens with: device and its UUID, date, commit, command with its QVG_*
    # settings, torch / triton / python versions; bf16_baseline: the `bf16` row's cache, which every
    # overhead_vs_bf16 is against: a ring since ffe3555, before it shifted its history)
    res = {**result_header("bench_pipeline", argv), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "bf16_baseline": "ring"}
    if args.max_history:
        res["max_history"] = run_max_history([(m, {} if m == "bf16" else opts) for m in methods])
        name = "max-history-"
    else:
        res["options"] = opts
        res["rows"] = run(histories, methods, opts, args.repeat, args.split)
        name = "pipeline-"
    write_result(res, args.out, name + gpu_tag(res["device"]) + ".json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
