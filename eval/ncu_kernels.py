"""Hardware counters of the kernels behind issue 3's missed targets, read by Nsight Compute (ncu) on the GPU.

`python -m qvg.eval.ncu_kernels [--out DIR] [--calls compress,dequant,attention]` runs ncu on this module's
`--workload` (one warm call each of, by --calls (default compress,dequant): compress S1/B64 and S4/B16 at the LongCat
span [1, 32, 29640, 128], K=256, 2 warm-started iterations; dequant S1/B64 and S4/B16 at that span; attention
(`packed_attention`'s defaults: qvg's stream-K kernel at 32,760 and 327,600 keys, qvg-pro's key splits at 32,760; 12
heads x 4,680 queries, bench_kernels' history), each in an NVTX range naming it), keeps the report
(DIR/ncu-kernels-<gpu>.ncu-rep) and the CSV pages it is parsed from, and writes DIR/ncu-kernels-<gpu>.json: per kernel
launch its call, duration, the speed-of-light, memory, compute, occupancy, launch and warp-state values ncu reports,
the raw counters listed in RAW (warp instructions executed, tensor / ALU / FMA pipe activity, what limits occupancy),
and the stall reasons per issued instruction. Copy the JSON into eval/results; the report and pages are ~12 MB. Only
the Triton kernels are profiled (`--kernel-name regex:^_`), with `--clock-control none` (the clocks left as the
benchmarks see them).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import re
import shutil
import subprocess
import sys

from qvg.help_format import OneLineParser

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats")
# what each launch's summary keeps from ncu's details page (section, metric name)
SUMMARY = {
    "duration": ("GPU Speed Of Light Throughput", "Duration"),
    "sm_throughput_pct": ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    "memory_throughput_pct": ("GPU Speed Of Light Throughput", "Memory Throughput"),
    "dram_throughput_pct": ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    "l1tex_throughput_pct": ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    "l2_throughput_pct": ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    "l1_hit_rate_pct": ("Memory Workload Analysis", "L1/TEX Hit Rate"),
    "l2_hit_rate_pct": ("Memory Workload Analysis", "L2 Hit Rate"),
    "mem_busy_pct": ("Memory Workload Analysis", "Mem Busy"),
    "mem_pipes_busy_pct": ("Memory Workload Analysis", "Mem Pipes Busy"),
    "issue_slots_busy_pct": ("Compute Workload Analysis", "Issue Slots Busy"),
    "ipc_active": ("Compute Workload Analysis", "Executed Ipc Active"),
    "achieved_occupancy_pct": ("Occupancy", "Achieved Occupancy"),
    "theoretical_occupancy_pct": ("Occupancy", "Theoretical Occupancy"),
    "registers_per_thread": ("Launch Statistics", "Registers Per Thread"),
    "grid_size": ("Launch Statistics", "Grid Size"),
    "block_size": ("Launch Statistics", "Block Size"),
    "waves_per_sm": ("Launch Statistics", "Waves Per SM"),
    "warp_cycles_per_issue": ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
# raw-page counters each launch's summary keeps too
RAW = {
    "warp_instructions": "inst_executed",
    "tensor_pipe_pct": "sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg."
                       "pct_of_peak_sustained_elapsed",
    "alu_pipe_pct": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "fma_pipe_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "blocks_per_sm_limit_registers": "launch__occupancy_limit_registers",
    "blocks_per_sm_limit_shared_mem": "launch__occupancy_limit_shared_mem",
    "blocks_per_sm_limit_warps": "launch__occupancy_limit_warps",
    "dynamic_shared_mem_per_block": "launch__shared_mem_per_block_dynamic",
}
NVTX_COLUMN = "Push/Pop_Range"


CALLS = ("compress", "dequant", "attention")


def parse_calls(text: str) -> list[str]:
    """'compress,dequant,...' -> the kinds of call to profile (ValueError names an unknown one)."""
    kinds = [c for c in text.split(",") if c]
    bad = [c for c in kinds if c not in CALLS]
    if bad or not kinds:
        raise ValueError(f"--calls: unknown kind {bad[0] if bad else ''!r} (known: {', '.join(CALLS)})")
    return kinds


def _attention_calls() -> list:
    """(name, call) of packed_attention with its defaults over bench_kernels' packed histories."""
    import torch

    from qvg.kernels.attention import packed_attention

    from .bench_kernels import packed_history
    q = torch.randn(1, 12, 4680, 128, device="cuda", dtype=torch.bfloat16)
    calls = []
    for method, n in (("qvg", 32760), ("qvg", 327600), ("qvg-pro", 32760)):
        k, v = packed_history(12, n, 4680, method)
        calls.append((f"attention {method} {n}", lambda k=k, v=v: packed_attention(q, k, v)))
    return calls


def workload(variant: str | None = None, kinds=("compress", "dequant")) -> None:
    """The profiled calls, between cudaProfilerStart/Stop, each after an unprofiled warm-up (Triton compiles, the
    caches fill). An NVTX range names each call (ncu's raw page carries it per launch)."""
    import torch

    import qvg
    from qvg.kernels.compress import compress_prq
    from qvg.kernels.dequant import dequantize

    from .bench_kernels import clustered, warm_start
    shape = (1, 32, 29640, 128)
    calls = []
    if "compress" in kinds or "dequant" in kinds:
        x0, x1 = clustered(shape, seed=1), clustered(shape, seed=1)
        x1 = (x1.float() + 0.1 * torch.randn_like(x1.float())).bfloat16()
    for method in ("qvg", "qvg-pro"):
        if "compress" in kinds:
            _, o, warm = warm_start(x0, method, shape)
            calls.append((f"compress {method}", lambda o=o, warm=warm: compress_prq(x1, o, warm, 2,
                                                                                   variant=variant)))
        if "dequant" in kinds:
            p = qvg.compress(x1, method)
            out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
            calls.append((f"dequant {method}", lambda p=p, out=out: dequantize(p, out=out)))
    if "attention" in kinds:
        calls += _attention_calls()
    for _, fn in calls:
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in calls:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


def _rows(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # ncu's own messages are not CSV rows
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def _num(v: str):
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return v


def summarize(details_csv: str, raw_csv: str) -> list[dict]:
    """ncu's details and raw pages (CSV) -> one dict per kernel launch, in launch order."""
    launches: dict[str, dict] = {}
    for r in _rows(details_csv):
        k = launches.setdefault(r["ID"], {"id": int(r["ID"]), "kernel": r["Kernel Name"], "details": {}})
        k["details"][f'{r["Section Name"]} / {r["Metric Name"]}'] = {"value": _num(r["Metric Value"]),
                                                                      "unit": r["Metric Unit"]}
    for r in _rows(raw_csv):  # (its units row has no ID)
        k = launches.get(r.get("ID", ""))
        if k is None:
            continue
        rng = next((v for m, v in r.items() if NVTX_COLUMN in m and v), "")
        found = re.search(r"<[^>]*>:([^:\"]+)", rng)  # '1250  "<default domain>:compress qvg:none:..."'
        k["call"] = found.group(1) if found else ""
        k["raw"] = {key: _num(r[m]) for key, m in RAW.items() if r.get(m, "") != ""}
        stalls = {m[len(STALL_PREFIX):-len(STALL_SUFFIX)]: _num(v) for m, v in r.items()
                  if m.startswith(STALL_PREFIX) and m.endswith(STALL_SUFFIX) and isinstance(_num(v), float)}
        k["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    out = []
    for k in sorted(launches.values(), key=lambda k: k["id"]):
        s = {}
        for key, (sec, name) in SUMMARY.items():
            v = k["details"].get(f"{sec} / {name}")
            if v is not None:
                s[key] = v["value"] if key != "duration" else {"value": v["value"], "unit": v["unit"]}
        k["summary"] = s
        out.append(k)
    return out


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/qvg-ncu", help="where the report, its CSV pages and the JSON go")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--variant", default=None, help="the compress preset to profile (kernels/compress.py; default: "
                    "the default, auto)")
    ap.add_argument("--calls", default="compress,dequant", help=f"what to profile, of {', '.join(CALLS)}")
    args = ap.parse_args(argv)
    try:
        kinds = parse_calls(args.calls)
    except ValueError as e:
        print(f"ncu_kernels: {e}", file=sys.stderr)
        return 2
    if args.workload:
        workload(args.variant, kinds)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("ncu_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    from .bench_kernels import gpu_tag
    os.makedirs(args.out, exist_ok=True)
    rep = os.path.join(args.out, f"ncu-kernels-{gpu_tag(dev)}")
    cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--kernel-name",
           "regex:^_", "-f", "-o", rep]  # the Triton kernels (torch's own launches are named void at::...)
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, "-m", "qvg.eval.ncu_kernels", "--workload", "--calls", args.calls] + (
        ["--variant", args.variant] if args.variant else [])
    print(" ".join(cmd), flush=True)
    try:
        version = subprocess.run([args.ncu, "--version"], check=True, capture_output=True, text=True).stdout
        subprocess.run(cmd, check=True)
        pages = {}
        for p in ("details", "raw"):
            pages[p] = subprocess.run([args.ncu, "--import", rep + ".ncu-rep", "--csv", "--page", p,
                                       "--print-units", "base"], check=True, capture_output=True, text=True).stdout
            with open(f"{rep}.{p}.csv", "w") as f:  # kept: the JSON is parsed from these
                f.write(pages[p])
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"ncu_kernels: ncu failed ({args.ncu}): {e}", file=sys.stderr)
        return 1
    import triton
    from qvg.revision import code_commit
    res = {"device": dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": code_commit(), "command": "python -m qvg.eval.ncu_kernels " + " ".join(argv or sys.argv[1:]),
           "ncu_command": " ".join(cmd), "ncu_version": version.strip().splitlines()[-1:],
           "torch": torch.__version__, "triton": triton.__version__,
           "launches": summarize(pages["details"], pages["raw"])}
    path = rep + ".json"
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for k in res["launches"]:
        s = k["summary"]
        top = list(k.get("stalls_per_issue", {}).items())[:3]
        print(f'{k["id"]:3d} {k["kernel"][:40]:40s} {s.get("duration")} SM {s.get("sm_throughput_pct")}% mem '
              f'{s.get("memory_throughput_pct")}% dram {s.get("dram_throughput_pct")}% L2 '
              f'{s.get("l2_throughput_pct")}% L1 {s.get("l1tex_throughput_pct")}% occ '
              f'{s.get("achieved_occupancy_pct")}% issue {s.get("issue_slots_busy_pct")}% regs '
              f'{s.get("registers_per_thread")} stalls {top}', flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
