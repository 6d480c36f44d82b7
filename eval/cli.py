"""`qvg-eval`: what a KV-cache method costs in quality and saves in memory.

    qvg-eval compare REF.mp4 TEST.mp4 [--out PREFIX]    PSNR / SSIM / LPIPS per frame and window -> JSON + PNG
    qvg-eval report OUTDIR [--preset cpu|gpu]           sweep + analyses -> OUTDIR/report.md, PNGs, results.json
    qvg-eval sweep OUTDIR [--inputs ... --methods ...]  the sweep alone (Table 1 with its floors)
    qvg-eval vbench VIDEO... [--dims ...]               VBench dimensions of video files

Pretrained weights (LPIPS, VBench) are read from --weights DIR, else $QVG_WEIGHTS, else ~/.cache/qvg/weights
(file names: `qvg.eval.weights.FILES`, README "qvg-eval"); a missing file leaves its metric out, a file that is
there but not those weights is an error. Bad input: one `qvg-eval: error: ...` line, status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .weights import BadWeights  # (no torch import)

# torch's OpenMP threads spin at barriers by default: on a CPU shared with other processes that makes runs several
# times slower (eval/kv_analysis.py). Only effective when torch is not loaded yet (the qvg-eval entry point).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} must be comma-separated integers, got {text!r}") from None


def _device(text: str | None):
    from qvg.app import generate  # qvg-generate's --device rules (imports no UI)
    try:
        return generate.device_arg(text)
    except generate.UsageError as e:
        raise UsageError(str(e)) from None


def _lpips(net: str, weights, device):
    """(model or None, status line)."""
    if net == "none":
        return None, "not asked for (--lpips none)"
    from .lpips import load_lpips
    from .weights import BadWeights, MissingWeights
    try:
        return load_lpips(net, weights, device), f"computed (LPIPS v0.1, {net})"
    except MissingWeights as e:
        print(f"qvg-eval: LPIPS not computed: {e}", file=sys.stderr)
        return None, f"not computed: {e}"
    except BadWeights as e:
        raise UsageError(f"LPIPS weights: {e}") from None


def _vbench(dims: str, weights, device) -> dict:
    if dims == "none":
        return {}
    from .vbench import DIMENSIONS, load_dimensions
    from .weights import BadWeights
    names = list(DIMENSIONS) if dims == "all" else [d.strip() for d in dims.split(",") if d.strip()]
    try:
        out = load_dimensions(names, weights, device)
    except BadWeights as e:
        raise UsageError(f"VBench weights: {e}") from None
    except ValueError as e:
        raise UsageError(f"--vbench: {e}") from None
    for k, v in out.items():
        if isinstance(v, str):
            print(f"qvg-eval: VBench {k} not computed: {v}", file=sys.stderr)
    return out


def _common(p):
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--weights", default=None, help="folder of pretrained weights (default $QVG_WEIGHTS, else "
                   "~/.cache/qvg/weights)")
    p.add_argument("--lpips", default="alex", choices=["alex", "vgg", "none"], help="LPIPS backbone (default alex)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def build_parser():
    p = _Parser(prog="qvg-eval", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    c = sub.add_parser("compare", help="compare a video with its reference")
    c.add_argument("ref")
    c.add_argument("test")
    c.add_argument("--out", default=None, help="output path without extension (default: TEST's, + '.compare')")
    c.add_argument("--lead", type=int, default=None, help="frames given, not generated (default: from REF's JSON "
                   "or 0)")
    c.add_argument("--first", type=int, default=None, help="frames of the first generated chunk")
    c.add_argument("--chunk", type=int, default=None, help="frames per later chunk")
    c.add_argument("--onset-chunks", type=int, default=1, help="chunks in the onset window (default 1)")
    c.add_argument("--threshold", type=float, default=30.0, help="PSNR dB for 'first frame below' (default 30)")
    _common(c)
    r = sub.add_parser("report", help="run the evaluation and write a markdown report")
    r.add_argument("outdir")
    r.add_argument("--preset", default="cpu", help="cpu or gpu (see qvg.eval.report)")
    r.add_argument("--from-json", action="store_true", help="re-render OUTDIR/results.json, run nothing")
    r.add_argument("--model", default=None, help="world model folder (default: the embedded assets/world)")
    r.add_argument("--vbench", default="all", help="VBench dimensions (comma list), 'all' or 'none' (default all: "
                   "those whose weights are missing are reported as not computed)")
    r.add_argument("--skip", default="", help="parts to skip: sweep,long,block,kv,warm,rope")
    _common(r)
    s = sub.add_parser("sweep", help="inputs x seeds x methods x bits -> Table 1")
    s.add_argument("outdir")
    s.add_argument("--pipeline", default="embedded", help="embedded (default, in memory), or a qvg-generate "
                   "pipeline: tiny, self-forcing (runs qvg-generate's code; mp4s are read back)")
    s.add_argument("--checkpoint", default=None, help="self-forcing checkpoint directory")
    s.add_argument("--inputs", default="coffee,camera", help="start images (embedded / tiny) or prompts "
                   "(self-forcing), separated by '|' for prompts or ',' for images")
    s.add_argument("--seeds", default="0,1")
    s.add_argument("--methods", default="rtn,kivi,quarot,qvg,qvg-pro")
    s.add_argument("--bits", default="2,4")
    s.add_argument("--kmeans-seeds", default="0,1")
    s.add_argument("--chunks", type=int, default=4)
    s.add_argument("--onset-chunks", type=int, default=1)
    s.add_argument("--vbench", default="all")
    _common(s)
    v = sub.add_parser("vbench", help="VBench dimensions of video files")
    v.add_argument("videos", nargs="+")
    v.add_argument("--dims", default="all")
    v.add_argument("--out", default=None, help="JSON output (default: print)")
    _common(v)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = build_parser().parse_args(argv)
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        return {"compare": _compare, "report": _report, "sweep": _sweep, "vbench": _vbench_cmd}[a.cmd](a, argv)
    except (UsageError, BadWeights) as e:  # BadWeights: a broken weights file, wherever it is read
        print(f"qvg-eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qvg-eval: interrupted", file=sys.stderr)
        return 130


def _compare(a, argv) -> int:
    from . import compare
    from .provenance import command_line, meta, weight_files
    from .video import read_video, sidecar
    dev = _device(a.device)
    try:
        ref, test = read_video(a.ref), read_video(a.test)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if ref.shape[0] != test.shape[0] or ref.shape[2:] != test.shape[2:]:
        raise UsageError(f"frame sizes differ: {tuple(ref.shape[2:])} vs {tuple(test.shape[2:])}")
    n = min(ref.shape[1], test.shape[1])
    side = sidecar(a.ref)
    lay = dict(compare.LAYOUTS.get(side.get("pipeline"), {"lead": 0, "first": 3, "chunk": 3}))
    for k in ("lead", "first", "chunk"):
        if getattr(a, k) is not None:
            lay[k] = getattr(a, k)
    if lay["lead"] < 0 or lay["first"] < 1 or lay["chunk"] < 1 or a.onset_chunks < 1:
        raise UsageError("--lead must be >= 0, --first, --chunk and --onset-chunks >= 1")
    model, status = _lpips(a.lpips, a.weights, dev)
    try:
        res = compare.compare(ref[:, :n], test[:, :n], onset_chunks=a.onset_chunks, threshold=a.threshold,
                              lpips_model=model, **lay)
    except ValueError as e:
        raise UsageError(str(e)) from None
    res["meta"] = meta(command_line("qvg-eval", argv), dev, ref=a.ref, test=a.test, lpips=status,
                       weight_files=weight_files(model), frames_compared=n, frames=[ref.shape[1], test.shape[1]],
                       title=f"{Path(a.test).name} vs {Path(a.ref).name}")
    out = a.out or str(Path(a.test).with_suffix("")) + ".compare"
    notes = compare.save(res, out)
    print(compare.summary_line(res))
    for n_ in notes:
        print(n_)
    return 0


def _report(a, argv) -> int:
    from . import report
    from .provenance import command_line
    out = Path(a.outdir)
    if a.from_json:
        try:
            res = json.loads((out / "results.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--from-json: cannot read {out / 'results.json'} ({e})") from None
        for n in report.render(res, out):
            print(n)
        return 0
    if a.preset not in report.PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(report.PRESETS)}, got {a.preset!r}")
    skip = tuple(x.strip() for x in a.skip.split(",") if x.strip())
    bad = [x for x in skip if x not in ("sweep", "long", "block", "kv", "warm", "rope")]
    if bad:
        raise UsageError(f"--skip: unknown part(s) {', '.join(bad)}")
    dev = _device(a.device)
    runner = _embedded(a.model, dev)
    model, status = _lpips(a.lpips, a.weights, dev)
    vb = _vbench(a.vbench, a.weights, dev)
    report.run(out, report.PRESETS[a.preset], runner, command=command_line("qvg-eval", argv), device=dev,
               preset_name=a.preset, lpips_model=model, lpips_status=status, vbench=vb,
               progress=not a.no_progress, skip=skip)
    print(f"wrote {out / 'report.md'}, its plots and {out / 'results.json'}")
    return 0


def _embedded(model_dir, dev):
    from qvg.pipelines.world_model import WorldModelError, load_world

    from .runners import EmbeddedRunner
    try:
        model, cfg = load_world(model_dir, device=dev)
    except WorldModelError as e:
        raise UsageError(f"--model: {e}") from None
    return EmbeddedRunner(model, cfg, dev)


def _sweep(a, argv) -> int:
    from . import sweep
    from .provenance import command_line, meta, weight_files
    from .runners import GenerateRunner
    dev = _device(a.device)
    if a.pipeline == "embedded":
        runner = _embedded(None, dev)
    elif a.pipeline in ("tiny", "self-forcing"):
        runner = GenerateRunner(a.pipeline, a.checkpoint, str(dev), Path(a.outdir) / "videos")
    else:
        raise UsageError(f"--pipeline must be embedded, tiny or self-forcing, got {a.pipeline!r}")
    sep = "|" if a.pipeline == "self-forcing" else ","
    spec = dict(inputs=[x.strip() for x in a.inputs.split(sep) if x.strip()], seeds=_ints(a.seeds, "seeds"),
                methods=[m.strip() for m in a.methods.split(",") if m.strip()], bits=_ints(a.bits, "bits"),
                kmeans_seeds=_ints(a.kmeans_seeds, "kmeans-seeds"), chunks=a.chunks, onset_chunks=a.onset_chunks)
    from qvg.cache import CACHE_METHODS
    bad = [m for m in spec["methods"] if m not in CACHE_METHODS or m == "bf16"]
    if bad or not spec["inputs"] or not spec["seeds"] or not spec["kmeans_seeds"] or a.chunks < 1:
        raise UsageError(f"bad sweep: methods {bad} unknown (bf16 is always the reference)" if bad else
                         "--inputs, --seeds, --kmeans-seeds need one value at least and --chunks >= 1")
    model, status = _lpips(a.lpips, a.weights, dev)
    vb = _vbench(a.vbench, a.weights, dev)
    res = sweep.run(runner, spec, lpips_model=model, vbench=vb, progress=not a.no_progress)
    res["meta"] = meta(command_line("qvg-eval", argv), dev, lpips=status, runner=runner.describe(),
                       weight_files=weight_files(model, *vb.values()))
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "sweep.md").write_text(sweep.table_markdown(res) + "\n")
    print(sweep.table_markdown(res))
    print(f"wrote {out / 'sweep.json'} and {out / 'sweep.md'}")
    return 0


def _vbench_cmd(a, argv) -> int:
    from .provenance import command_line, meta, weight_files
    from .video import read_video
    dev = _device(a.device)
    dims = _vbench(a.dims, a.weights, dev)
    res = {"meta": meta(command_line("qvg-eval", argv), dev, weight_files=weight_files(*dims.values())),
           "videos": {}}
    for path in a.videos:
        try:
            v = read_video(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
        res["videos"][path] = {k: (f if isinstance(f, str) else f(v)) for k, f in dims.items()}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
        print(f"wrote {a.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
