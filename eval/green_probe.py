"""Whether side-stream work confined to a few SMs (a CUDA green context, `qvg.streams.green_stream`) disturbs a
busy forward less: `python -m qvg.eval.green_probe [--out DIR] [--sms 8,16,32]`.

On one GPU, for each SM count N:
- `api`: torch's green-context API as found (supported, `Stream()` present);
- `copy_ms`: a 1 GiB device-to-device copy on the green stream (confinement shows as a slower copy) against the
  same copy on a normal stream;
- `same_bits`: a qvg-pro compress (warm-started, a Self-Forcing chunk: 12 heads x 4,680 tokens x 128) run eagerly
  and replayed from a CUDA graph on the green stream equals the same on a normal stream, bit for bit;
- `interference`: a stand-in for the forward (a loop of 8192^3 BF16 matmuls on the current stream) timed alone,
  with 60 graphed qvg-pro compress calls queued beside it on a normal side stream, and on the green stream
  (the commits of one Self-Forcing chunk: 30 layers x K and V), on the green stream replaying graphs captured on a
  normal stream, and replaying graphs captured on the green stream (`GraphedCompress(capture_on_current=True)`).
  Each: the matmul loop's time (CUDA events on its stream) and when the side work ended, as medians of `--rounds`
  rounds in which the set-ups alternate.
Writes green-probe-<gpu>.json.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from qvg.help_format import OneLineParser
from .bench_kernels import gpu_tag, result_header, write_result

SHAPE = (1, 12, 4680, 128)
OPTS = dict(bits=2, stages=4, block_size=16, centroids=64)


def _timed(stream, fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record()
        fn()
        b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _copy(p) -> dict:
    """A Packed's tensors, copied (a graph's outputs are overwritten by its next replay)."""
    return {k: v.clone() for k, v in p.tensors.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="eval/results")
    ap.add_argument("--sms", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("green_probe: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.cuda import green_contexts

    import qvg
    from qvg.compression.graphed import GraphedCompress
    from qvg.streams import green_stream
    t0 = time.time()
    res = {**result_header("green_probe", argv), "sms_total": torch.cuda.get_device_properties(0).multi_processor_count,
           "api": {"supported": bool(green_contexts.SUPPORTED),
                   "stream_method": hasattr(green_contexts.GreenContext, "Stream")}, "rows": []}
    normal = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
    init = qvg.compress(x, "qvg-pro", **OPTS).tensors["centroids"]  # cold: the warm start of every call below
    big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    graphed = GraphedCompress()

    def commits(g=graphed):
        for _ in range(60):
            g(x, "qvg-pro", init=init, **OPTS)

    def forward():
        for _ in range(12):
            a @ a

    def together(side, g=graphed):
        """(matmul loop ms, ms until the side work ended) with `commits` (graphs of `g`) queued on `side` first."""
        cur = torch.cuda.current_stream()
        s0, m1, s1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        s0.record(cur)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            commits(g)
            s1.record(side)
        forward()
        m1.record(cur)
        torch.cuda.synchronize()
        return s0.elapsed_time(m1), s0.elapsed_time(s1)

    with torch.cuda.stream(normal):
        ref_eager = _copy(qvg.compress(x, "qvg-pro", init=init, **OPTS))
        ref_graph = _copy(graphed(x, "qvg-pro", init=init, **OPTS))
    torch.cuda.synchronize()
    copy_normal = statistics.median(_timed(normal, lambda: dst.copy_(big)) for _ in range(5))
    forward()
    torch.cuda.synchronize()
    for sms in [int(s) for s in args.sms.split(",")]:
        row = {"sms": sms}
        res["rows"].append(row)
        try:
            gs = green_stream("cuda", sms)
        except Exception as e:  # (reported, not raised: the API differs across torch builds)
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{sms} SMs: {row['error']}")
            continue
        try:
            row["copy_ms"] = statistics.median(_timed(gs, lambda: dst.copy_(big)) for _ in range(5))
            row["copy_ms_normal_stream"] = copy_normal
            green_graphs = GraphedCompress(capture_on_current=True)  # (captured on the green stream)
            with torch.cuda.stream(gs):
                eager = _copy(qvg.compress(x, "qvg-pro", init=init, **OPTS))
                rep = _copy(graphed(x, "qvg-pro", init=init, **OPTS))
                rep_green = _copy(green_graphs(x, "qvg-pro", init=init, **OPTS))
            torch.cuda.synchronize()
            row["same_bits_eager"], row["same_bits_graph"] = _equal(eager, ref_eager), _equal(rep, ref_graph)
            row["same_bits_graph_captured_green"] = _equal(rep_green, ref_graph)
            setups = {"alone": None, "normal": normal, "green": gs, "green_captured": gs}
            times = {k: [] for k in setups}
            for r in range(args.rounds):
                for name in list(setups)[r % 4:] + list(setups)[:r % 4]:
                    s = setups[name]
                    if s is None:
                        times[name].append((_timed(torch.cuda.current_stream(), forward), 0.0))
                    else:
                        times[name].append(together(s, green_graphs if name == "green_captured" else graphed))
            row["interference"] = {k: {"forward_ms": statistics.median(t[0] for t in v),
                                       "side_done_ms": statistics.median(t[1] for t in v),
                                       "forward_ms_all": [round(t[0], 3) for t in v]} for k, v in times.items()}
            commits_alone = {}
            for name, s, g in (("normal", normal, graphed), ("green", gs, graphed),
                               ("green_captured", gs, green_graphs)):
                commits_alone[name] = statistics.median(_timed(s, lambda: commits(g)) for _ in range(3))
            row["commits_alone_ms"] = commits_alone
            f = row["interference"]
            print(f"{sms} SMs: copy {row['copy_ms']:.3f} ms (normal {copy_normal:.3f}); same bits eager "
                  f"{row['same_bits_eager']} graph {row['same_bits_graph']}; forward alone {f['alone']['forward_ms']:.2f}"
                  f" ms, with commits on a normal stream {f['normal']['forward_ms']:.2f} (done at "
                  f"{f['normal']['side_done_ms']:.2f}), on {sms} SMs {f['green']['forward_ms']:.2f} (done at "
                  f"{f['green']['side_done_ms']:.2f}), graphs captured there {f['green_captured']['forward_ms']:.2f} "
                  f"(done at {f['green_captured']['side_done_ms']:.2f}); same bits {row['same_bits_graph_captured_green']}"
                  f"; 60 commits alone {commits_alone['normal']:.2f} / {commits_alone['green']:.2f} / "
                  f"{commits_alone['green_captured']:.2f} ms")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{sms} SMs: {row['error']}")
    write_result(res, args.out, "green-probe-" + gpu_tag(res["device"]) + ".json", t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
