"""Where one real-size Self-Forcing chunk makes the host wait for the GPU (GPU): `python -m qvg.eval.find_host_syncs
[--history 6] [--methods bf16,qvg] [--out DIR]`.

A synchronizing call (a blocking host <-> device copy, `.item()`, `int(tensor)` of a CUDA tensor, ...) empties the
GPU's queue: the GPU then idles while the host launches the next kernels. The chunk-wise forward is partly
host-bound, so each one costs wall time, and it also hides whatever side-stream work would have filled that idle
time. This runs bench_pipeline's chunk (the Wan2.1-1.3B config, random weights, 480x832, 4 steps + the clean
re-run + commit) once as warm-up, then once under `torch.cuda.set_sync_debug_mode("warn")`, and counts each
synchronizing call by its innermost call site in this project or diffusers. Writes host-syncs-<gpu>.json (empty
`sites`: no host sync in a chunk).
"""
from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings

import torch

from qvg.help_format import OneLineParser
from qvg.revision import REPO

from .provenance import command_line, emit_json, meta

_OURS = (str(REPO) + os.sep, f"{os.sep}diffusers{os.sep}")  # this checkout (any folder name), diffusers


def _where(fr) -> str:
    name = fr.filename.removeprefix(_OURS[0]).split("site-packages" + os.sep)[-1]
    return f"{name}:{fr.lineno} {fr.line}"


def _site(stack) -> str:
    """The innermost frame of this project or diffusers (torch's own frames skipped); else the innermost frame
    outside torch and the warnings machinery, marked as such."""
    for fr in reversed(stack):
        if (fr.filename.startswith(_OURS[0]) or _OURS[1] in fr.filename) and "find_host_syncs" not in fr.filename:
            return _where(fr)
    for fr in reversed(stack):
        if f"{os.sep}torch{os.sep}" not in fr.filename and not fr.filename.endswith("warnings.py"):
            return "(outside the project) " + _where(fr)
    return "(no Python frame)"


def count_syncs(fn) -> dict[str, int]:
    """{call site: synchronizing calls} made by fn() (CUDA), most first."""
    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings():  # (restores showwarning and the filters on exit)
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                sites[_site(traceback.extract_stack()[:-1])] += 1
            else:
                show(message, category, filename, lineno, file, line)
        warnings.showwarning = record
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return dict(sites.most_common())


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=6, help="past latent frames (a multiple of 3)")
    ap.add_argument("--methods", default="bf16,qvg")
    ap.add_argument("--options", default='{"centroids": 64}')
    ap.add_argument("--out", default="eval/results")
    args = ap.parse_args(argv)
    from .bench_pipeline import parse_methods
    try:
        parse_methods(args.methods, args.options)
    except ValueError as e:
        print(f"find_host_syncs: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        raise SystemExit("find_host_syncs: needs a CUDA GPU")
    import json
    from .bench_pipeline import _fill, method_runner, new_cache, wan_model
    model = wan_model()
    rows = []
    for method in args.methods.split(","):
        cache = new_cache(model, method, args.history, {} if method.split(":")[0] == "bf16" else
                          json.loads(args.options))
        _fill(cache, args.history, 12)
        chunk, _ = method_runner(model, cache, method)
        with torch.no_grad():
            chunk()  # warm-up: kernel compiles, graph captures and the text K/V (first-time work is not counted)
            chunk()
            torch.cuda.synchronize()
            sites = count_syncs(chunk)
        torch.cuda.synchronize()
        rows.append({"method": method, "history_frames": args.history, "syncs": sum(sites.values()), "sites": sites})
        print(f"{method}: {sum(sites.values())} host syncs per chunk", flush=True)
        cache = chunk = None
    res = {"meta": meta(command_line("python -m qvg.eval.find_host_syncs", argv), "cuda"), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    emit_json(res, os.path.join(args.out, f"host-syncs-{torch.cuda.get_device_name().split()[1].lower()}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
