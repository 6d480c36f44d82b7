"""What qvg-app adds to every chunk: a video generated through the page's API (gradio_client against `python -m
qvg.app.ui` in its own process, the embedded model on the CPU), timed end to end from the click to the last update,
minus the generation's own chunk time (the table's seconds column: the model and cache only). The difference is the
UI's work between chunks (live preview encode, memory panel, mp4 append, gradio's postprocessing and streaming), which
runs on the generation's thread and so delays every chunk. The model is loaded by a warm-up run first.

    python -m qvg.eval.bench_ui_overhead --label after --out eval/results/ui-overhead-cpu.json
    git archive OLD | tar -x -C /tmp/old && (cd /tmp/old && for d in app pipelines kernels eval assets; do
        ln -sfn ../$d qvg/$d; done)
    python -m qvg.eval.bench_ui_overhead --label before --tree /tmp/old --tree-commit OLD --out ...

--tree runs the server from another copy of the repository (its qvg/ with the folders linked in, as DEVELOPERS.md
does on the GPU machine) instead of this install; the client side is this one's. --out adds the run, under its
label, to the file's "runs".
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from qvg.help_format import OneLineParser


# `python -m qvg.app.ui` from a given tree: an editable install's import hook would find this one first
FROM_TREE = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in type(f).__name__]; "
             "sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'qvg-app'; "
             "runpy.run_module('qvg.app.ui', run_name='__main__')")


def start_server(tree: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = ["-c", FROM_TREE, str(Path(tree).resolve())] if tree else ["-m", "qvg.app.ui"]
    proc = subprocess.Popen([sys.executable, *start, "--port", str(port), "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, t0 = f"http://127.0.0.1:{port}/", time.time()
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() - t0 > 120:
                proc.kill()
                raise SystemExit("qvg-app did not start")
            time.sleep(0.3)


def inputs(client, frames: int, method: str) -> list:
    """/generate's inputs (the page's defaults, this length and method), read from the API's own description."""
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]
    values = {p["parameter_name"]: p["parameter_default"] for p in params}
    values.update(frames=frames, method=method, compare=False, job=None)
    return [values[p["parameter_name"]] for p in params]


def timed_run(client, frames: int, method: str) -> dict:
    t0 = time.perf_counter()
    outs = client.predict(*inputs(client, frames, method), api_name="/generate")
    total = time.perf_counter() - t0
    status, table = outs[0], outs[[i for i, o in enumerate(outs) if isinstance(o, dict) and "headers" in o][0]]
    head, rows = table["headers"], table["data"]
    col = head.index(f"{method} s")
    chunk = sum(r[col] for r in rows)
    res = {"status": status, "chunks": len(rows), "end_to_end_seconds": round(total, 2),
           "chunk_seconds_sum": round(chunk, 2), "overhead_seconds": round(total - chunk, 2),
           "overhead_per_chunk_seconds": round((total - chunk) / len(rows), 3),
           "chunk_seconds_mean": round(chunk / len(rows), 3)}
    if "UI s" in head:  # the UI's own measure of its work between chunks (the page's table)
        ui = [r[head.index("UI s")] for r in rows if r[head.index("UI s")] is not None]
        res["ui_seconds_per_chunk_mean_in_table"] = round(sum(ui) / len(ui), 3) if ui else None
    return res


def summarize(out: dict) -> dict:
    """The file's summary: per label, the UI's seconds per chunk (median of its videos) and the chunks' own mean
    (the load of the shared CPU shows there), and the load averages around it."""
    out["summary"] = {label: {"overhead_per_chunk_seconds": [v["overhead_per_chunk_seconds"] for v in r["runs"]],
                              "chunk_seconds_mean": [v["chunk_seconds_mean"] for v in r["runs"]],
                              "load_average_1min": [r["load_average_1min_before"], r["load_average_1min_after"]],
                              "app_commit": r["app_commit"]}
                      for label, r in out["runs"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    from gradio_client import Client

    from qvg.eval.provenance import command_line, meta
    p = OneLineParser(prog="python -m qvg.eval.bench_ui_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=91)
    p.add_argument("--method", default="qvg")
    p.add_argument("--repeats", type=int, default=2, help="timed videos after the warm-up (default 2)")
    p.add_argument("--label", default="this checkout", help="what is measured (e.g. before / after)")
    p.add_argument("--tree", default=None, help="run the server from this copy of the repository")
    p.add_argument("--tree-commit", default=None, help="the commit --tree was made from (recorded)")
    p.add_argument("--out", default=None, help="add the run to this JSON file (default: print it only)")
    a = p.parse_args(argv)
    load = os.getloadavg()[0]
    proc, url = start_server(a.tree)
    try:
        client = Client(url, verbose=False, download_files=False)
        warm = timed_run(client, 4, a.method)  # loads the model (kept between jobs)
        runs = [timed_run(client, a.frames, a.method) for _ in range(a.repeats)]
    finally:
        proc.terminate()
        proc.wait(30)
    m = meta(command_line("python -m qvg.eval.bench_ui_overhead", argv), "cpu")
    per_chunk = sorted(r["overhead_per_chunk_seconds"] for r in runs)
    run = {"app_commit": a.tree_commit or m["git_commit"], "app_tree": a.tree or "this checkout",
           "date": m["date"], "command": m["command"], "frames": a.frames, "method": a.method,
           "load_average_1min_before": round(load, 2), "load_average_1min_after": round(os.getloadavg()[0], 2),
           "overhead_per_chunk_seconds_median": per_chunk[len(per_chunk) // 2], "warm_up": warm, "runs": runs,
           "meta": m}
    out = {"what": "qvg-app: end-to-end time of a video through the page's API minus its summed chunk time, per "
                   "chunk (the UI's work between chunks, on the generation's thread)",
           "device": f"CPU ({os.cpu_count()} cores)", "runs": {}}
    if a.out and Path(a.out).exists():
        out = json.loads(Path(a.out).read_text())
    out["runs"][a.label] = run
    text = json.dumps(summarize(out), indent=1)
    print(json.dumps(run, indent=1))
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
