"""Where the cache's side-stream kernels run against the forward (GPU): `python -m qvg.eval.trace_overlap
[--out DIR] [--history 21] [--methods qvg,qvg-pro]`.

Same set-up as bench_pipeline. Two chunks per method, back to back as in generation (the first one's queued
commits run into the second's forward), are traced with torch.profiler (CUDA kernels only). The main stream is the
one the SDPA kernels run on. For the decode kernels (`_dequant_kernel`) and the commits' kernels (every other
kernel on a side stream) it reports their GPU time split by what the main stream ran meanwhile: SDPA (self- or
cross-attention), another kernel, or nothing (the main stream idle: waiting for them, or for the host);
side-stream work left after the main stream's last kernel (the second chunk's own commits) is counted apart.
`gaps` places the main stream's idle time: by gap length, by what the side streams ran during it (a decode, a
commit's kernel, nothing: the host or an event wait), and by the forward and layer it fell in (counted from the
attention kernels before it: self- and cross-attention per layer, 30 layers, 5 forwards per chunk), and splits it
into the host's part (the call that queued the next operation had not begun yet) and the GPU's own.
Writes trace-overlap-<gpu>.json (after each method).
"""
from __future__ import annotations

import bisect
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from .bench_pipeline import _fill, checked_methods, method_runner, new_cache, pipeline_args, wan_model

ATTENTION = ("fmha", "flash", "sdpa", "attention")  # substrings of the SDPA kernels' names (cuDNN, flash)


def trace_events(prof) -> list[dict]:
    """A finished torch.profiler run's events, as its Chrome trace holds them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of what runs on a stream


def _kernels(events: list[dict]) -> list[dict]:
    """The GPU operations: kernels, and copies and fills named by their category (`[gpu_memcpy] ...`), which also
    occupy a stream."""
    return [dict(name=e["name"] if e["cat"] == "kernel" else f"[{e['cat']}] {e['name']}",
                 stream=e["args"].get("stream"), t0=e["ts"], t1=e["ts"] + e["dur"])
            for e in events if e.get("cat") in GPU_OPS]


LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # trace categories of the host calls that queue GPU operations


def with_launches(events: list[dict]) -> list[dict]:
    """`_kernels`, each with `launch`: (start, duration) of the runtime or driver call that queued it (a launch, a
    graph launch, an async copy or fill), matched by the trace's correlation id; None where the trace holds none."""
    calls = {e["args"]["correlation"]: (e["ts"], e["dur"]) for e in events
             if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") in GPU_OPS]
    return [{**k, "launch": calls.get(e["args"].get("correlation"))} for k, e in zip(_kernels(ops), ops)]


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def _is_attention(k: dict) -> bool:
    return any(s in k["name"].lower() for s in ATTENTION)


def _main_stream(kernels: list[dict]):
    """The stream most attention kernels ran on."""
    attn = [k["stream"] for k in kernels if _is_attention(k)]
    if not attn:
        raise RuntimeError("no attention kernel in the trace")
    return max(set(attn), key=attn.count)


# side-stream work by kind: the decodes, and everything else (the commits' kernels, copies and fills)
SIDE_KINDS = (("decode", lambda k: "_dequant_kernel" in k["name"]),
              ("commit", lambda k: "_dequant_kernel" not in k["name"]))


def split(kernels: list[dict]) -> dict:
    """The side-stream kernels' time (us) by what the main stream ran meanwhile (or after its last kernel), and the
    main stream's idle time."""
    main = _main_stream(kernels)
    on_main = [k for k in kernels if k["stream"] == main]
    attn_spans = [(k["t0"], k["t1"]) for k in on_main if _is_attention(k)]
    other_spans = [(k["t0"], k["t1"]) for k in on_main if not _is_attention(k)]
    end = max(k["t1"] for k in on_main)
    out = {}
    for what, pick in SIDE_KINDS:
        side = [k for k in kernels if k["stream"] != main and pick(k)]
        total = sum(k["t1"] - k["t0"] for k in side)
        during_attn = sum(_overlap(k["t0"], k["t1"], attn_spans) for k in side)
        during_other = sum(_overlap(k["t0"], k["t1"], other_spans) for k in side)
        after = sum(max(0.0, k["t1"] - max(k["t0"], end)) for k in side)
        out[what] = {"kernels": len(side), "gpu_us": total, "during_attention_us": during_attn,
                     "during_other_main_kernels_us": during_other, "after_main_us": after,
                     "main_idle_us": total - during_attn - during_other - after}
    t0, t1 = min(k["t0"] for k in on_main), max(k["t1"] for k in on_main)
    busy = sum(k["t1"] - k["t0"] for k in on_main)
    out["main"] = {"span_us": t1 - t0, "kernel_us": busy, "idle_us": t1 - t0 - busy,
                   "attention_us": sum(b - a for a, b in attn_spans), "attention_kernels": len(attn_spans)}
    return out


def _union(spans: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The union of spans as disjoint sorted intervals: (starts, ends)."""
    starts, ends = [], []
    for b0, b1 in sorted(spans):
        if ends and b0 <= ends[-1]:
            ends[-1] = max(ends[-1], b1)
        else:
            starts.append(b0)
            ends.append(b1)
    return starts, ends


def _covered(a0: float, a1: float, union: tuple[list[float], list[float]]) -> float:
    """Length of [a0, a1] covered by a `_union`."""
    starts, ends = union
    got, i = 0.0, bisect.bisect_right(ends, a0)
    while i < len(starts) and starts[i] < a1:
        got += min(a1, ends[i]) - max(a0, starts[i])
        i += 1
    return got


def gaps(kernels: list[dict], layers: int = 30, forwards: int = 5, attn_per_layer: int = 2, top: int = 12) -> dict:
    """The main stream's idle gaps (us): total by length (< 20, 20-200, >= 200 us), by what ran on the side streams
    meanwhile (decode kernels, commit kernels, nothing), by forward slot of the chunk (0..forwards-1) and by layer,
    by the main-stream operation that ends the gap (its name's first 80 characters: the `top` largest totals, with
    their counts), and the `top` longest with their place.
    Where the operations carry their `launch` call (`with_launches`), `host` splits each gap: the part before the
    host began the call that queued the operation ending it (the host's: it had not queued it yet when the stream
    became free) and the rest (the GPU's own: from queued and free to started); also how far ahead of its start the
    median operation was queued, and the mean call time; by_next_op gets each op's host part and mean call time."""
    main = _main_stream(kernels)
    on_main = sorted((k for k in kernels if k["stream"] == main), key=lambda k: k["t0"])
    side = {w: _union([(k["t0"], k["t1"]) for k in kernels if k["stream"] != main and pick(k)])
            for w, pick in SIDE_KINDS}
    both = _union([(a, b) for w in side.values() for a, b in zip(*w)])
    by_len = {"lt20": 0.0, "20to200": 0.0, "ge200": 0.0}
    by_side = {"decode": 0.0, "commit": 0.0, "nothing": 0.0}
    by_forward, by_layer, listed = [0.0] * forwards, [0.0] * layers, []
    by_next: dict[str, dict] = {}  # per operation ending gaps: their total, count, host part, launch calls' time
    host = {"matched_gaps": 0, "gaps": 0, "host_us": 0.0, "gpu_us": 0.0, "lt20_host_us": 0.0}
    is_attn = [_is_attention(k) for k in on_main]
    n_attn, edge = int(is_attn[0]), on_main[0]["t1"]
    for k, k_attn in zip(on_main[1:], is_attn[1:]):
        g0, g1 = edge, k["t0"]
        if g1 > g0:
            d = g1 - g0
            by_len["lt20" if d < 20 else "20to200" if d < 200 else "ge200"] += d
            dec, com = _covered(g0, g1, side["decode"]), _covered(g0, g1, side["commit"])
            by_side["decode"] += dec
            by_side["commit"] += com
            by_side["nothing"] += d - _covered(g0, g1, both)
            lf = n_attn // attn_per_layer  # layer-forwards started before the gap
            by_forward[(lf // layers) % forwards] += d
            by_layer[lf % layers] += d
            nxt = by_next.setdefault(k["name"][:80], {"us": 0.0, "gaps": 0, "host_us": 0.0, "call_us": 0.0,
                                                      "calls": 0})
            nxt["us"] += d
            nxt["gaps"] += 1
            host["gaps"] += 1
            if k.get("launch") is not None:
                late = min(d, max(0.0, k["launch"][0] - g0))
                host["matched_gaps"] += 1
                host["host_us"] += late
                host["gpu_us"] += d - late
                host["lt20_host_us"] += late if d < 20 else 0.0
                nxt["host_us"] += late
                nxt["call_us"] += k["launch"][1]
                nxt["calls"] += 1
            listed.append({"us": d, "layer_forwards_before": lf, "decode_us": dec, "commit_us": com,
                           "next_op": k["name"][:80]})
        n_attn += k_attn
        edge = max(edge, k["t1"])
    listed.sort(key=lambda g: -g["us"])
    ends = sorted(by_next.items(), key=lambda kv: -kv[1]["us"])[:top]
    out = {"by_length_us": by_len, "by_side_us": by_side, "by_forward_us": by_forward, "by_layer_us": by_layer,
           "by_next_op": [{"op": name, "us": e["us"], "gaps": e["gaps"]} for name, e in ends],
           "longest": listed[:top]}
    if host["matched_gaps"]:
        queued = [k for k in on_main if k.get("launch") is not None]
        out["host"] = {**host, "median_lead_us": statistics.median(k["t0"] - k["launch"][0] for k in queued),
                       "mean_call_us": statistics.fmean(k["launch"][1] for k in queued)}
        for row, (_, e) in zip(out["by_next_op"], ends):
            row.update(host_us=e["host_us"], mean_call_us=e["call_us"] / e["calls"] if e["calls"] else None)
    return out


def trace_chunk(chunk) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    chunk()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chunk()
        chunk()
        torch.cuda.synchronize()
    return with_launches(trace_events(prof))


def main(argv=None) -> int:
    ap = pipeline_args(__doc__, "qvg,qvg-pro")
    ap.add_argument("--keep", action="store_true",
                    help="keep every method's cache alive to the end (as bench_pipeline does) instead of deleting each "
                         "before the next is built")
    ap.add_argument("--burn-streams", type=int, default=0, metavar="N",
                    help="take N streams from torch's stream pool (and hold them) before any cache makes its own")
    args = ap.parse_args(argv)
    got = checked_methods(args, "trace_overlap")
    if got is None:
        return 2
    methods, options, _ = got
    from .bench_kernels import gpu_tag, result_header, write_result
    t0, header = time.time(), result_header("trace_overlap", argv)  # (the date is the run's start)
    model = wan_model()
    burnt = [torch.cuda.Stream() for _ in range(args.burn_streams)]  # (held: the pool hands out others)
    rows, kept = [], []
    with torch.no_grad():
        for method in methods:
            cache = new_cache(model, method, args.history, options)
            _fill(cache, args.history, 12)
            chunk = method_runner(model, cache, method)[0]
            chunk()
            row = {"method": method, "history_frames": args.history, **split(kernels := trace_chunk(chunk)),
                   "gaps": gaps(kernels), "side_stream_ids": {name: [s.stream_id for s in streams.values()]
                                                              for name, streams in (("commit", cache._side),
                                                                                    ("decode", cache._ahead))}}
            rows.append(row)
            print(method, json.dumps({k: v for k, v in row.items() if isinstance(v, dict)}), flush=True)
            if args.keep:
                kept.append((cache, chunk))
            else:
                del cache, chunk
                torch.cuda.empty_cache()
            res = {**header, "burnt_stream_ids": [b.stream_id for b in burnt], "rows": rows}
            write_result(res, args.out, f"trace-overlap-{gpu_tag(res['device'])}.json", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
