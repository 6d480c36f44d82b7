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
import signal
import sys
from pathlib import Path

from qvg.app.generate import MAX_FRAMES
from qvg.help_format import Parser
from qvg.numbers import finite, integer, is_int, parse_int
from qvg.outputs import Terminated, sigterm_raises, targets_error, writable_error, write_text

from .weights import BadWeights

# (torch's OpenMP threads spin at barriers by default, which slows runs on a CPU shared with other processes: set
# OMP_WAIT_POLICY=PASSIVE in the environment where that matters, as tests/conftest.py does; qvg-eval leaves the
# default as it is.)


class UsageError(Exception):
    pass


class _Parser(Parser):
    usage_error = UsageError


def _threshold(text: str) -> float:
    """A PSNR threshold: a finite number of dB > 0 (no frame is ever below one <= 0)."""
    v = finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 dB, got {text!r}")
    return v


def _ints(text: str, name: str) -> list[int]:
    try:
        return [parse_int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} must be comma-separated integers, got {text!r}") from None


def _device(text: str | None):
    from qvg.app import generate  # qvg-generate's --device rules (imports no UI)
    try:
        return generate.device_arg(text)
    except generate.UsageError as e:
        raise UsageError(str(e)) from None


def _lpips(net: str, weights, device, notes: list[str]):
    """(model or None, status line); a missing weights file is added to `notes` (said after the run)."""
    if net == "none":
        return None, "not asked for (--lpips none)"
    from .lpips import load_lpips
    from .weights import BadWeights, MissingWeights
    try:
        return load_lpips(net, weights, device), f"computed (LPIPS v0.1, {net})"
    except MissingWeights as e:
        notes.append(f"LPIPS not computed: {e}")
        return None, f"not computed: {e}"
    except BadWeights as e:
        raise UsageError(f"LPIPS weights: {e}") from None


def _dims(dims: str, flag: str, allow_none: bool = True) -> list[str]:
    """The VBench dimensions asked for ([] for 'none', where allowed), checked by name before anything loads."""
    from .vbench import DIMENSIONS
    if dims == "none" and allow_none:
        return []
    if dims == "none":  # (an empty result and status 0 would read as success)
        raise UsageError(f"{flag} none: no dimension to compute; name one or more, or 'all'")
    names = list(DIMENSIONS) if dims == "all" else [d.strip() for d in dims.split(",") if d.strip()]
    bad = [n for n in names if n not in DIMENSIONS]
    if not names or bad:
        also = "'all' or 'none'" if allow_none else "or 'all'"
        raise UsageError(f"{flag}: {'unknown ' + ', '.join(bad) if bad else 'none given'}; choose among "
                         f"{', '.join(DIMENSIONS)}, {also}")
    return names


def _vbench(names: list[str], weights, device, notes: list[str]) -> dict:
    """{dimension: scorer, or the reason it is not computed (a missing weights file: added to `notes`)}."""
    if not names:
        return {}
    from .vbench import load_dimensions
    from .weights import BadWeights
    try:
        out = load_dimensions(names, weights, device)
    except BadWeights as e:
        raise UsageError(f"VBench weights: {e}") from None
    notes += [f"VBench {k} not computed: {v}" for k, v in out.items() if isinstance(v, str)]
    return out


def _common(p, lpips: bool = True):
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--weights", default=None, help="folder of pretrained weights (default $QVG_WEIGHTS, else "
                   "~/.cache/qvg/weights)")
    if lpips:
        p.add_argument("--lpips", default="alex", choices=["alex", "vgg", "none"],
                       help="LPIPS backbone (default alex)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=integer, default=None, help="torch CPU threads (default: torch's)")


def build_parser():
    p = _Parser(prog="qvg-eval", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    c = sub.add_parser("compare", help="compare a video with its reference")
    c.add_argument("ref", metavar="REF", help="the reference video (a BF16-cache run's mp4; its JSON report beside it "
                   "gives the chunk layout)")
    c.add_argument("test", metavar="TEST", help="the video to score against REF (same frame size; if the lengths "
                   "differ, the frames both hold are compared, with a note)")
    c.add_argument("--out", default=None, help="output path without extension (default: TEST's, + '.compare')")
    c.add_argument("--lead", type=integer, default=None, help="frames given, not generated (default: from REF's JSON "
                   "or 0)")
    c.add_argument("--first", type=integer, default=None, help="frames of the first generated chunk (default: from "
                   "REF's JSON or 3)")
    c.add_argument("--chunk", type=integer, default=None, help="frames per later chunk (default: from REF's JSON or 3)")
    c.add_argument("--onset-chunks", type=integer, default=1, help="chunks in the onset window (default 1)")
    c.add_argument("--threshold", type=_threshold, default=30.0, help="PSNR dB (> 0) for 'first frame below' "
                   "(default 30)")
    _common(c)
    r = sub.add_parser("report", help="run the evaluation and write a markdown report")
    r.add_argument("outdir", metavar="OUTDIR", help="the report's folder: report.md, PNG plots, results.json")
    r.add_argument("--preset", default="cpu", help="cpu (default; ~10-25 min on a CPU: 2 photos x 2 seeds, 4 "
                   "chunks, a 12-chunk long video) or gpu (4 photos x 3 seeds, 8 chunks, a 60-chunk long video)")
    r.add_argument("--from-json", action="store_true", help="re-render OUTDIR/results.json, run nothing")
    r.add_argument("--model", default=None, help="world model folder (default: the embedded assets/world)")
    r.add_argument("--vbench", default="all", help="VBench dimensions (comma list), 'all' or 'none' (default all: "
                   "those whose weights are missing are reported as not computed)")
    r.add_argument("--skip", default="", help="parts to skip: sweep,long,block,kv,warm,rope")
    _key_storage_arg(r)
    _common(r)
    s = sub.add_parser("sweep", help="inputs x seeds x methods x bits -> Table 1")
    s.add_argument("outdir", metavar="OUTDIR", help="the sweep's folder: sweep.json, sweep.md (and the videos of a "
                   "qvg-generate pipeline)")
    s.add_argument("--pipeline", default="embedded", help="embedded (default, in memory), or a qvg-generate "
                   "pipeline: tiny, self-forcing (runs qvg-generate's code; mp4s are read back)")
    s.add_argument("--checkpoint", default=None, help="self-forcing checkpoint directory")
    s.add_argument("--inputs", default=None, help="start images (embedded / tiny) or prompts "
                   "(self-forcing), separated by '|' for prompts or ',' for images (default coffee,camera; "
                   "self-forcing: qvg-generate's default prompt)")
    s.add_argument("--seeds", default="0,1", help="sampling seeds (default 0,1; two or more give the sampling floor: "
                   "BF16 at the next seed)")
    s.add_argument("--methods", default="rtn,kivi,quarot,qvg,qvg-pro", help="cache methods against the BF16 cache "
                   "(default rtn,kivi,quarot,qvg,qvg-pro)")
    s.add_argument("--bits", default="2,4", help="2, 4 and/or 8 (default 2,4)")
    s.add_argument("--kmeans-seeds", default="0,1", help="k-means seeds of qvg / qvg-pro (default 0,1; two or more "
                   "give the k-means floor)")
    s.add_argument("--chunks", type=integer, default=4, help="generated chunks per video (default 4)")
    s.add_argument("--onset-chunks", type=integer, default=1, help="chunks in the onset window (default 1)")
    s.add_argument("--vbench", default="all", help="VBench dimensions (comma list), 'all' or 'none' (default all: "
                   "those whose weights are missing are reported as not computed)")
    _key_storage_arg(s)
    _common(s)
    v = sub.add_parser("vbench", help="VBench dimensions of video files")
    v.add_argument("videos", nargs="+", metavar="VIDEO", help="mp4 (or other) video files to score")
    v.add_argument("--dims", default="all", help="dimensions (comma list) or 'all' (default); those whose weights are "
                   "missing are reported as not computed, and none computable is an error")
    v.add_argument("--out", default=None, help="JSON output (default: print)")
    _common(v, lpips=False)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # (a missing command was "required: cmd")
    return p


def _key_storage_arg(p):
    from .runners import KEY_STORAGES
    p.add_argument("--key-storage", default="auto", choices=KEY_STORAGES, help="auto (default: as qvg-generate "
                   "runs the cache, keys packed before RoPE for rtn / qvg / qvg-pro on the embedded model) or "
                   "post-rope (every method's keys after RoPE, as the reports before 2026-11-30)")


def _out_dir(path: str | Path, *files: str, make: bool = True) -> Path:
    """An output folder, made (with its parents) and checked writable, and that `files` in it can be written, before
    any work: UsageError otherwise. (Call it after every other input check: it makes the folder.) make=False (the
    folder of an --out file, as qvg-generate's --out): a missing folder is refused, not made (a typo made folders)."""
    out = Path(path)
    for name in files:
        if (out / name).is_dir():
            raise UsageError(f"cannot write {str(out / name)!r}: a folder is there")
    if out.exists() and not out.is_dir():
        raise UsageError(f"cannot write to {str(out)!r}: a file is there, not a folder")
    if not make and not out.is_dir():
        raise UsageError(f"--out: cannot write to {str(out)!r} (no such directory)")
    # the folders mkdir will make, each where it really is (through "..", a/../b makes a/ and b/, not a/..) and
    # recorded before it runs (it may make only some)
    _MADE.extend(f for f in (Path(os.path.abspath(g)) for g in (out, *out.parents)) if not f.exists())
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write to {str(out)!r} ({e.strerror or type(e).__name__})") from None
    err = writable_error(out)
    if err:
        raise UsageError(f"cannot write to {str(out)!r} ({err})")
    bad = targets_error(out / name for name in files)  # where each will be written: symlinks followed
    if bad:
        raise UsageError(f"cannot write {str(bad[0])!r}: {bad[1]}")
    return out


_MADE: list[Path] = []  # the folders this command made (`_out_dir`): removed again if it fails and leaves them empty


def _write(path: Path, text: str) -> str:
    write_text(path, text)
    return f"wrote {path}"


MAX_THREADS = 1024  # --threads' bound: more than any CPU here, far below what the OpenMP runtime fails to create


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _MADE.clear()
    from qvg.app.generate import UsageError as GenerateUsageError  # (a sweep through qvg-generate's own checks)
    try:
        with sigterm_raises():
            a = build_parser().parse_args(argv)
            if a.threads is not None:
                if not 1 <= a.threads <= MAX_THREADS:  # (20,000 made libgomp fail, 100,000 crashed)
                    raise UsageError(f"--threads must be in [1, {MAX_THREADS}], got {a.threads}")
                import torch
                torch.set_num_threads(a.threads)
            _check_weights(a.weights)
            if getattr(a, "outdir", None) is not None and not a.outdir.strip():  # (Path("") is the current folder)
                raise UsageError("OUTDIR is empty: give the output folder (e.g. eval/results/run1)")
            return {"compare": _compare, "report": _report, "sweep": _sweep, "vbench": _vbench_cmd}[a.cmd](a, argv)
    except (UsageError, BadWeights, GenerateUsageError) as e:  # BadWeights: a broken weights file, wherever read
        return _fail(f"qvg-eval: error: {e}", 2)
    except KeyboardInterrupt:
        return _fail("qvg-eval: interrupted", 130)
    except Terminated:
        return _fail("qvg-eval: terminated", 128 + signal.SIGTERM)
    except OSError as e:  # a write that failed after the checks (disk full, a folder removed meanwhile): one line
        return _fail(f"qvg-eval: error: {e}", 1)
    except BaseException:  # anything else (a bug, out of memory) as it is, after the same clean-up
        _clean_up()
        raise


def _check_weights(given: str | None) -> None:
    """--weights (or $QVG_WEIGHTS) naming no folder is bad input (a typo would only leave notes and status 0); the
    default folder may be missing (then each metric that needs it is a note)."""
    from .weights import ENV
    for value, name in ((given, "--weights"), (None if given is not None else os.environ.get(ENV), f"${ENV}")):
        if value is None:
            continue
        if not value.strip():
            raise UsageError(f"{name} is empty: give the folder of the pretrained weights")
        if not Path(value).is_dir():
            what = "not a folder" if Path(value).exists() else "no such folder"
            raise UsageError(f"{name}: {what}: {value!r}")


def _fail(line: str, code: int) -> int:
    """`line` on stderr as the last line (after `_clean_up`); `code`."""
    _clean_up()
    print(line, file=sys.stderr)
    return code


def _clean_up() -> None:
    """After a failed or stopped command: the progress bars still open end their line (what is printed next is a
    line of its own), and the folders the command made and left empty are removed (no empty output folder stays)."""
    from .progress import end_all
    end_all()
    for f in sorted(set(_MADE), key=lambda f: len(f.parts), reverse=True):  # (innermost first)
        try:
            f.rmdir()  # (only an empty folder)
        except OSError:
            pass
    _MADE.clear()


def _compare(a, argv) -> int:
    from . import compare
    from .metrics import SSIM_WINDOW
    from .provenance import command_line, file_record, meta, weight_files
    from .video import read_video, sidecar
    dev = _device(a.device)
    # (X with a folder X there writes X.json, X.png beside it; "X/" names the folder: its outputs were put beside it)
    if a.out is not None and (Path(a.out).name in ("", ".", "..") or a.out.endswith(("/", os.sep))):
        what = "no name" if Path(a.out).name in ("", ".", "..") else "a folder"
        raise UsageError(f"--out {a.out!r}: {what}; give the outputs' path without extension, e.g. "
                         f"{os.path.join(a.out or '.', 'name')}")
    videos = []
    for name, path in (("REF", a.ref), ("TEST", a.test)):  # (first: a folder or a missing file given as a video
        try:  # is refused before its name is used)
            videos.append(read_video(path))
        except ValueError as e:
            raise UsageError(f"{name}: {e}") from None
    ref, test = videos
    out = a.out or str(Path(a.test).with_suffix("")) + ".compare"
    js, png = compare.output_paths(out)
    for video in (a.ref, a.test):  # never over a video's own qvg-generate report (REF's is read for the layout)
        if js.resolve() == Path(video).with_suffix(".json").resolve():
            raise UsageError(f"--out {out}: would overwrite {str(js)!r}, the report of {video!r}; choose another name")
    if ref.shape[0] != test.shape[0] or ref.shape[2:] != test.shape[2:]:
        raise UsageError(f"frame sizes differ: {tuple(ref.shape[2:])} vs {tuple(test.shape[2:])}")
    if min(ref.shape[2:]) < SSIM_WINDOW:
        raise UsageError(f"frames of {ref.shape[3]} x {ref.shape[2]} pixels: SSIM needs at least {SSIM_WINDOW} on "
                         "each side (its Gaussian window)")
    n = min(ref.shape[1], test.shape[1])
    notes = []  # (said once the comparison is written: an error stays the only line)
    if ref.shape[1] != test.shape[1]:
        notes.append(f"REF has {ref.shape[1]} frames, TEST {test.shape[1]}: the first {n} were compared")
    side = sidecar(a.ref)
    pipeline = side.get("pipeline") if isinstance(side.get("pipeline"), str) else None  # (a report's, or none)
    lay = dict(compare.LAYOUTS.get(pipeline, {"lead": 0, "first": 3, "chunk": 3}))
    if pipeline not in compare.LAYOUTS and any(getattr(a, k) is None for k in ("lead", "first", "chunk")):
        beside = Path(a.ref).with_suffix(".json")
        why = (f"{str(beside)!r}, beside REF, is not a qvg-generate report" if beside.is_file() and not side
               else f"no qvg-generate report beside {a.ref!r} names its pipeline")
        notes.append(f"{why}: chunk layout lead {lay['lead']}, first {lay['first']}, chunk {lay['chunk']} where "
                     "--lead / --first / --chunk did not say")
    said, taken = side.get("frames"), [k for k in ("lead", "first", "chunk") if getattr(a, k) is None]
    if pipeline in compare.LAYOUTS and taken and is_int(said) and said != ref.shape[1]:
        notes.append(f"REF's report says {said} frames, REF holds {ref.shape[1]}: the chunk layout taken from it ("
                     + ", ".join(f"{k} {lay[k]}" for k in taken) + ") may not be this video's")
    for k in ("lead", "first", "chunk"):
        if getattr(a, k) is not None:
            lay[k] = getattr(a, k)
    if lay["lead"] < 0 or lay["first"] < 1 or lay["chunk"] < 1 or a.onset_chunks < 1:
        raise UsageError("--lead must be >= 0, --first, --chunk and --onset-chunks >= 1")
    if lay["lead"] >= n:
        raise UsageError(f"the videos have {n} frames in common: none after the {lay['lead']} lead frame(s)")
    chunks = len(compare.chunk_bounds(n, lay["lead"], lay["first"], lay["chunk"]))
    if a.onset_chunks > chunks:
        raise UsageError(f"--onset-chunks must be in [1, {chunks}] (the chunks of the {n} frames compared), got "
                         f"{a.onset_chunks}")
    _out_dir(js.parent, js.name, png.name, make=False)
    model, status = _lpips(a.lpips, a.weights, dev, notes)
    try:
        res = compare.compare(ref[:, :n], test[:, :n], onset_chunks=a.onset_chunks, threshold=a.threshold,
                              lpips_model=model, **lay)
    except ValueError as e:
        raise UsageError(str(e)) from None
    res["meta"] = meta(command_line("qvg-eval", argv), dev, ref=a.ref, test=a.test, lpips=status,
                       inputs={"ref": file_record(a.ref), "test": file_record(a.test)},  # (where, and which bytes)
                       weight_files=weight_files(model), frames_compared=n, frames=[ref.shape[1], test.shape[1]],
                       title=f"{Path(a.test).name} vs {Path(a.ref).name}")
    written = compare.save(res, out)
    print(compare.summary_line(res))
    for n_ in written:
        print(n_)
    _notes(notes)
    return 0


def _notes(notes: list[str]) -> None:
    for n in notes:
        print(f"qvg-eval: note: {n}", file=sys.stderr)


REPORT_PARTS = ("sweep", "long", "block", "kv", "warm", "rope")  # what --skip names


def _report(a, argv) -> int:
    from . import report
    from .provenance import command_line
    out = Path(a.outdir)
    if a.preset not in report.PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(report.PRESETS)}, got {a.preset!r}")
    skip = tuple(x.strip() for x in a.skip.split(",") if x.strip())
    bad = [x for x in skip if x not in REPORT_PARTS]
    if bad:
        raise UsageError(f"--skip: unknown part(s) {', '.join(bad)}")
    if not a.from_json and set(REPORT_PARTS) <= set(skip):  # (an empty report and status 0 read as success)
        raise UsageError(f"--skip {a.skip}: every part skipped; nothing to report")
    if a.from_json:
        try:
            res = json.loads((out / "results.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--from-json: cannot read {out / 'results.json'} ({e})") from None
        _out_dir(out, "report.md")
        try:
            lines = report.render(res, out)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, ArithmeticError) as e:  # (none written)
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise UsageError(f"--from-json: {out / 'results.json'} is not the results of a qvg-eval report "
                             f"({type(e).__name__}: {what})") from None
        for n in lines:
            print(n)
        return 0
    names = _dims(a.vbench, "--vbench")
    dev = _device(a.device)
    runner = _embedded(a.model, dev, a.key_storage)
    _out_dir(out, "results.json", "report.md")
    notes = []
    model, status = _lpips(a.lpips, a.weights, dev, notes)
    vb = _vbench(names, a.weights, dev, notes)
    report.run(out, report.PRESETS[a.preset], runner, command=command_line("qvg-eval", argv), device=dev,
               preset_name=a.preset, lpips_model=model, lpips_status=status, vbench=vb,
               progress=not a.no_progress, skip=skip)
    plots = "its plots, " if {"sweep", "long", "kv"} - set(skip) else ""  # (the parts with a figure)
    print(f"wrote {out / 'report.md'}, {plots}{out / 'results.json'}")
    _notes(notes)
    return 0


def _embedded(model_dir, dev, key_storage: str = "auto"):
    from qvg.pipelines.world_model import WorldModelError, load_world

    from .runners import EmbeddedRunner
    try:
        model, cfg = load_world(model_dir, device=dev)
    except WorldModelError as e:
        raise UsageError(f"--model: {e}") from None
    return EmbeddedRunner(model, cfg, dev, key_storage=key_storage)


def _sweep(a, argv) -> int:
    from . import sweep
    from .provenance import command_line, meta, weight_files
    from .runners import GenerateRunner
    if a.pipeline not in ("embedded", "tiny", "self-forcing"):
        raise UsageError(f"--pipeline must be embedded, tiny or self-forcing, got {a.pipeline!r}")
    if a.pipeline == "embedded" and a.checkpoint is not None:  # (tiny: qvg-generate's own check refuses it)
        raise UsageError("--checkpoint applies to --pipeline self-forcing, not the embedded model")
    sep = "|" if a.pipeline == "self-forcing" else ","
    if a.inputs is None:  # (the images' default read as one prompt, "coffee,camera", for Self-Forcing)
        from qvg.app.generate import DEFAULT_PROMPT
        a.inputs = DEFAULT_PROMPT if a.pipeline == "self-forcing" else "coffee,camera"
    spec = dict(inputs=[x.strip() for x in a.inputs.split(sep) if x.strip()], seeds=_ints(a.seeds, "seeds"),
                methods=[m.strip() for m in a.methods.split(",") if m.strip()], bits=_ints(a.bits, "bits"),
                kmeans_seeds=_ints(a.kmeans_seeds, "kmeans-seeds"), chunks=a.chunks, onset_chunks=a.onset_chunks)
    notes = _check_sweep(spec, a.pipeline)
    names = _dims(a.vbench, "--vbench")
    dev = _device(a.device)
    if a.pipeline == "embedded":
        runner = _embedded(None, dev, a.key_storage)
    else:
        runner = GenerateRunner(a.pipeline, a.checkpoint, str(dev), Path(a.outdir) / "videos",
                                key_storage=a.key_storage)
        runner.check(spec)  # every run's qvg-generate arguments, by its own checks (one line, before any work)
    out = _out_dir(a.outdir, "sweep.json", "sweep.md")
    if not (out / "videos").exists():  # (the qvg-generate runners' folder: made by the first run)
        _MADE.append(Path(os.path.abspath(out / "videos")))  # (absolute, as _out_dir records: innermost removed first)
    model, status = _lpips(a.lpips, a.weights, dev, notes)
    vb = _vbench(names, a.weights, dev, notes)
    res = sweep.run(runner, spec, lpips_model=model, vbench=vb, progress=not a.no_progress)
    res["meta"] = meta(command_line("qvg-eval", argv), dev, lpips=status, runner=runner.describe(),
                       weight_files=weight_files(model, *vb.values()))
    res["notes"] = list(notes)  # (a missing floor or metric: in the files, not only on the terminal)
    print(sweep.table_markdown(res))
    print(_write(out / "sweep.json", json.dumps(res, indent=1) + "\n"))
    print(_write(out / "sweep.md", sweep.file_markdown(res) + "\n"))
    _notes(notes)
    return 0


MAX_CHUNKS = MAX_FRAMES // 3  # a sweep video's chunks: qvg-generate's --frames limit at 3 frames per chunk (embedded)


def _check_sweep(spec: dict, pipeline: str) -> list[str]:
    """Every sweep value checked before anything loads or runs (UsageError naming the first bad one) -> notes for
    after the run (a floor that one seed can't give)."""
    from qvg.cache import CACHE_METHODS
    bad = [m for m in spec["methods"] if m not in CACHE_METHODS or m == "bf16"]
    if bad:
        raise UsageError(f"--methods: unknown {', '.join(bad)} (choose among {', '.join(CACHE_METHODS[1:])}; bf16 is "
                         "always the reference)")
    for name in ("inputs", "seeds", "methods", "bits", "kmeans_seeds"):
        if not spec[name]:
            raise UsageError(f"--{name.replace('_', '-')}: give one value at least")
        twice = [v for i, v in enumerate(spec[name]) if v in spec[name][:i]]
        if twice:  # (a repeated seed would be its own floor; a repeated method or input counted twice)
            raise UsageError(f"--{name.replace('_', '-')}: {twice[0]!r} given twice")
    wrong = [b for b in spec["bits"] if b not in (2, 4, 8)]
    if wrong:
        raise UsageError(f"--bits must be 2, 4 or 8, got {', '.join(map(str, wrong))}")
    for name, top in (("seeds", 2**63 - 1), ("kmeans_seeds", 2**31 - 1)):  # (qvg-generate's ranges)
        bad = [v for v in spec[name] if not 0 <= v <= top]
        if bad:
            raise UsageError(f"--{name.replace('_', '-')} must be in [0, {top}], got {bad[0]}")
    if not 1 <= spec["chunks"] <= MAX_CHUNKS or not 1 <= spec["onset_chunks"] <= spec["chunks"]:
        raise UsageError(f"--chunks must be in [1, {MAX_CHUNKS}] and --onset-chunks in [1, chunks], got "
                         f"{spec['chunks']} and {spec['onset_chunks']}")
    if pipeline in ("embedded", "tiny"):
        from qvg.app.generate import start_frame
        from qvg.pipelines.world_data import photo_names
        names = photo_names("all")
        missing = [x for x in spec["inputs"] if x not in names and not Path(x).is_file()]
        if missing:
            raise UsageError(f"--inputs: {', '.join(map(repr, missing))} neither a bundled photo "
                             f"({', '.join(names)}) nor a file")
        for x in spec["inputs"]:  # each file read as qvg-generate reads it (an image, large enough), before any run
            if x not in names:
                start_frame(x, "--inputs")  # (its UsageError is one line, as main() says qvg-generate's)
    notes = ["one sampling seed: no sampling floor (give --seeds 0,1)"] if len(spec["seeds"]) == 1 else []
    if len(spec["kmeans_seeds"]) == 1 and {"qvg", "qvg-pro"} & set(spec["methods"]):
        notes.append("one k-means seed: no k-means floor (give --kmeans-seeds 0,1)")
    return notes


def _check_out_file(out: str, videos) -> None:
    """--out names a file that is none of the input videos nor their qvg-generate reports: UsageError otherwise."""
    if Path(out).name in ("", ".", "..") or Path(out).is_dir():
        raise UsageError(f"--out {out!r}: a folder or no name; give the output file's path")
    target = Path(out).resolve()
    for video in videos:
        for f in (Path(video), Path(video).with_suffix(".json")):
            if target == f.resolve():
                raise UsageError(f"--out {out}: would overwrite {str(f)!r}, "
                                 f"{'an input video' if f == Path(video) else 'the report of ' + repr(video)}")


def _vbench_cmd(a, argv) -> int:
    from .provenance import command_line, meta, weight_files
    from .video import read_video
    names = _dims(a.dims, "--dims", allow_none=False)
    dev = _device(a.device)

    def read(path):
        try:
            return read_video(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    pairs = [n for n in names if n.endswith("_consistency")]  # (frame-to-frame scores)
    for path in a.videos:  # every input readable and long enough before any weights load (read again to score)
        frames = read(path).shape[1]
        if frames == 0 or (frames == 1 and pairs):
            raise UsageError(f"{path}: no frames" if not frames else
                             f"{path}: 1 frame; {pairs[0]} compares frames: give videos of at least 2")
    if a.out is not None:
        _check_out_file(a.out, a.videos)
        _out_dir(Path(a.out).resolve().parent, Path(a.out).name, make=False)
    notes = []
    dims = _vbench(names, a.weights, dev, notes)
    missing = {k: f for k, f in dims.items() if isinstance(f, str)}
    if dims and len(missing) == len(dims):  # (nothing to compute: an error, not an all-null result and status 0)
        first = next(iter(missing))
        raise UsageError(f"no VBench dimension can be computed: {first} {missing[first]}"
                         + (f" (and {len(missing) - 1} more not computed)" if len(missing) > 1 else ""))
    res = {"meta": meta(command_line("qvg-eval", argv), dev, weight_files=weight_files(*dims.values())),
           "not_computed": missing,
           "videos": {}}
    for path in a.videos:
        v = read(path)
        res["videos"][path] = {k: (None if isinstance(f, str) else f(v)) for k, f in dims.items()}
    text = json.dumps(res, indent=1)
    print(_write(Path(a.out), text + "\n") if a.out else text)
    _notes(notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
