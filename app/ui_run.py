"""The UI's jobs, without gradio: the form -> checked settings (qvg-generate's own checks, plus the server's path
rules), and a run (or a BF16-vs-method comparison) as a stream of `Update`s, one per chunk, reading its job's
controls (app.ui_jobs.Job: cancel, live steering) between chunks.

Paths: a checkpoint directory must resolve (symlinks followed) inside the server's checkpoint root; a start image
is a bundled photo's name or a file gradio saved from an upload (inside its upload folder). Only the directory
is checked: the loader reads the files it finds inside it, following symlinks (the root's owner decides those).
"""
from __future__ import annotations

import decimal
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import generate
from .generate import (DEFAULT_ACTIONS, DEFAULT_IMAGE, DEFAULT_PROMPT, Generation, Loaded, UsageError, chunk_row,
                       close_quietly, load_model, mp4_writer, parse, report)
from .ui_jobs import Job

_LABELS = {"tiny": "embedded world model", "self-forcing": "Self-Forcing (checkpoint)"}
PIPELINES = {p: _LABELS[p] for p in generate.PIPELINES}  # qvg-generate's pipelines, labelled for the UI
# qvg.compression.kmeans_methods(), spelt out: importing it imports torch (tests/test_methods.py keeps them equal)
KMEANS = ("qvg", "qvg-pro")
# qvg-generate's flags, as the UI names them in messages
LABELS = {"--frames": "length (frames)", "--bits": "bits", "--stages": "stages", "--block-size": "block size",
          "--centroids": "centroids", "--history window:N": "window", "--history": "history", "--sink": "sink",
          "--seed": "seed", "--actions": "camera actions", "--image": "start image", "--checkpoint": "checkpoint",
          "--method": "method", "--prompt": "prompt", "--device": "device"}

FRAMES_RANGE = (4, 301)  # the page's length slider: the start frame and one chunk, up to 100 chunks (longer: the CLI)


@dataclass
class Form:
    """What the page sends (one field per control; numbers may be None: the method's default)."""
    pipeline: str = "tiny"
    checkpoint: str = ""
    prompt: str = ""
    photo: str = DEFAULT_IMAGE
    upload: str | None = None  # a file gradio saved from an upload
    actions: str = DEFAULT_ACTIONS
    method: str = "qvg"
    bits: str = "default"
    stages: str | float | None = None
    block_size: str | float | None = None
    centroids: str | float | None = None
    history: str = "full"  # full | window
    window: float | None = 12
    sink: float | None = 0
    seed: str | float | None = 0
    frames: float | None = 31
    compare: bool = False


@dataclass
class Server:
    """The server's rules: checkpoint_root None = only the embedded model; upload_dir: gradio's upload folder."""
    checkpoint_root: Path | None = None
    upload_dir: Path | None = None
    device: str | None = None


def ui_message(e: Exception) -> str:
    """A qvg-generate error in the UI's words (its flags -> the controls' names)."""
    msg = str(e)
    for flag, label in LABELS.items():  # whole flags only: --checkpoint-root is not --checkpoint
        msg = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", label, msg)
    return msg


def checkpoint_dir(text: str, root: Path | None) -> str:
    """The checkpoint directory the form names, resolved inside the root, or UsageError (outside it, missing)."""
    if root is None:
        raise UsageError("this server runs the embedded model only; start it with qvg-app --checkpoint-root DIR "
                         "to run checkpoints from DIR")
    text = (text or "").strip()
    if not text:
        raise UsageError(f"checkpoint: give a directory inside the checkpoint root {str(root)!r}")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / text))  # an absolute `text` stands for itself
    if not real.is_relative_to(real_root):  # checked before anything is read, so nothing leaks from outside
        raise UsageError(f"checkpoint: {text!r} is outside the checkpoint root {str(root)!r}")
    if not real.is_dir():
        raise UsageError(f"checkpoint: no such directory in the checkpoint root: {text!r}")
    return str(real)


def _start_image(form: Form, server: Server) -> str:
    from qvg.pipelines.world_data import photo_names
    if form.upload:
        up = Path(os.path.realpath(form.upload))
        if server.upload_dir is None or not up.is_relative_to(os.path.realpath(server.upload_dir)):
            raise UsageError("start image: only uploaded files are read")
        from .start_image import image_array, size_problem, unreadable_reason
        try:  # (here, in the page's words: qvg-generate's would name the server's copy of the upload)
            small = size_problem(image_array(up))
        except Exception as e:
            why = unreadable_reason(e).replace(str(up), up.name).replace(str(form.upload), up.name)
            raise UsageError(f"start image: the upload {up.name!r} is not a readable image ({why})") from None
        if small:
            raise UsageError(f"start image: the upload {up.name!r} {small}")
        return str(up)
    if form.photo not in photo_names("all"):
        raise UsageError(f"start image: no bundled photo {form.photo!r}")
    return form.photo


def _num(value, name: str) -> str | None:
    if value is None or str(value).strip() == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):  # (exactly: a float would round 2**53 + 1)
        return str(value)
    text = str(value).strip()
    if not text.isascii() or "_" in text:  # (Decimal, like int, reads other scripts' digits and underscores)
        raise UsageError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, (float, bool)):  # text ("9007199254740993", "...993.0", "9.007199254740993e15") and
        try:  # other integers exactly, not through a float (the range is qvg-generate's check)
            d = decimal.Decimal(text)
        except decimal.InvalidOperation:
            raise UsageError(f"{name} must be a number, got {value!r}") from None
        if not d.is_finite():
            raise UsageError(f"{name} must be a number, got {value!r}")
        if d != d.to_integral_value():
            raise UsageError(f"{name} must be a whole number, got {value}")
        if d.adjusted() >= 4000:
            raise UsageError(f"{name} is too large, got {text[:20]}{'...' * (len(text) > 20)}")
        return str(int(d))
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not f.is_integer():
        raise UsageError(f"{name} must be a whole number, got {value}")
    return str(int(f))


def settings(form: Form, server: Server, out: Path) -> list[dict]:
    """Checked settings, one per video: [method] or, to compare, [bf16, method] (same seed and inputs). Raises
    UsageError with the UI's words."""
    if form.pipeline not in PIPELINES:
        raise UsageError(f"unknown pipeline {form.pipeline!r}")
    argv = ["--pipeline", form.pipeline, "--quiet"]
    for flag, value in (("--frames", form.frames), ("--seed", form.seed), ("--sink", form.sink)):
        v = _num(value, LABELS[flag])
        if v is None:
            raise UsageError(f"{LABELS[flag]}: give a number")
        if flag == "--frames" and not FRAMES_RANGE[0] <= int(v) <= FRAMES_RANGE[1]:  # (the slider's; an API call's
            # value outside it was gradio's own error and a traceback on the server)
            raise UsageError(f"{LABELS[flag]} must be in [{FRAMES_RANGE[0]}, {FRAMES_RANGE[1]}] here (longer "
                             f"videos: the qvg-generate command), got {v}")
        argv += [flag, v]
    if form.history == "window":
        w = _num(form.window, "window")
        if w is None:
            raise UsageError("window: give the number of past latent frames to keep")
        argv += ["--history", f"window:{w}"]
    elif form.history != "full":
        raise UsageError(f"history must be full or window, got {form.history!r}")
    if server.device:
        argv += ["--device", server.device]
    if form.pipeline == "tiny":
        argv += ["--image", _start_image(form, server), "--actions", (form.actions or "").strip() or DEFAULT_ACTIONS]
    else:
        argv += ["--checkpoint", checkpoint_dir(form.checkpoint, server.checkpoint_root),
                 "--prompt", (form.prompt or "").strip() or DEFAULT_PROMPT]
    opts = []
    if form.method != "bf16":  # the options of the chosen method (the page hides those it has not)
        if form.bits not in (None, "", "default"):
            opts += ["--bits", _num(form.bits, "bits")]
        for flag, value in (("--block-size", form.block_size), *((("--stages", form.stages),
                            ("--centroids", form.centroids)) if form.method in KMEANS else ())):
            v = _num(value, LABELS[flag])
            if v is not None:
                opts += [flag, v]
    if form.compare and form.method == "bf16":
        raise UsageError("compare: choose a compressed method to compare with BF16")
    runs = [("bf16", [])] if form.compare else []
    runs.append((form.method, opts))
    if form.pipeline != "tiny":
        subject = "self-forcing"
    else:
        subject = Path(form.upload).stem if form.upload else form.photo
    out_list = []
    try:
        for method, o in runs:
            s = parse(argv + ["--method", method, *o, "--out", str(out / f"{method}.mp4")])
            s["label"], s["subject"] = method, subject
            out_list.append(s)
    except UsageError as e:
        raise UsageError(ui_message(e)) from None
    out_list[-1]["unused_fields"] = unused_fields(form)
    return out_list


def unused_fields(form: Form) -> list[str]:
    """The option fields given a value that the chosen method has not ("stages 2" for rtn): the page hides them and
    keeps their values for when the method is chosen again, so they are not used, and the click's notice says so
    (an API call sends every field)."""
    given = {"bits": None if form.bits in (None, "", "default") else form.bits, "block size": form.block_size,
             "stages": form.stages, "centroids": form.centroids}
    has = () if form.method == "bf16" else ("bits", "block size", *(("stages", "centroids") if form.method in KMEANS
                                                                   else ()))
    return [f"{name} {_shown(v)}" for name, v in given.items()
            if name not in has and v is not None and str(v).strip() != ""]


def _shown(value) -> str:
    """A field's value as the notice shows it: a whole number as one (an API's 2.0 is "2"), anything else as typed."""
    try:
        return _num(value, "") or ""
    except UsageError:
        return str(value).strip()


def file_stem(s: dict) -> str:
    """The name (without suffix) of a video's downloads, mp4 and JSON: what made it, e.g.
    qvg-int4-astronaut-seed0-3f9a1c or bf16-self-forcing-seed3-0b72e4 (an upload's own name stands for its photo),
    ending in a digest of every setting that makes the video (`settings_digest`), so two runs' downloads collide
    only if made with the same settings (keys pressed during a run are not known when it starts)."""
    bits = s.get("resolved_options", {}).get("bits")
    parts = [s["label"], *([f"int{bits}"] if bits else []), s.get("subject") or s["pipeline"], f"seed{s['seed']}"]
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", "-".join(parts)).strip("._") or s["label"]
    return f"{name}-{settings_digest(s)}"


def settings_digest(s: dict) -> str:
    """6 hex digits over what makes a run's video: pipeline, method and its resolved options, frames, seed,
    history (window, sink, packing), key storage, the start image's pixels and the actions (the world model), or
    the checkpoint and prompt (Self-Forcing). Steering during the run is not known yet, so not in it."""
    import hashlib
    import json
    keys = ("pipeline", "method", "frames", "seed", "window", "sink", "commit_every", "key_storage", "checkpoint",
            "generator", "weights", "prompt", "actions")
    what = {k: s.get(k) for k in keys}
    what["options"] = s.get("resolved_options", s.get("options"))
    h = hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode())
    image = s.get("image")
    if image is not None:
        h.update(image.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:6]


class Plan:
    """Each chunk's action, asked when the chunk starts: the form's list (repeated), or the key last pressed while
    the job runs; one answer per chunk, so both videos of a comparison get the same actions."""

    def __init__(self, s: dict, controls: Job):
        self.base, self.controls, self.memo = s["actions"], controls, {}

    def __call__(self, c: int) -> int:
        if c not in self.memo:
            from qvg.pipelines.world_model import ACTIONS
            steer = self.controls.steer
            self.memo[c] = ACTIONS.index(steer) if steer in ACTIONS else self.base[c % len(self.base)]
        return self.memo[c]


class Models:
    """One loaded model kept between jobs (the checkpoint's is costly to load); a different one replaces it."""

    def __init__(self):
        self.key, self.model = None, None

    @staticmethod
    def _key(s: dict) -> tuple:
        return s["pipeline"], s.get("checkpoint"), str(s["device"])

    def has(self, s: dict) -> bool:
        return self.key == self._key(s)

    def get(self, s: dict) -> Loaded:
        key = self._key(s)
        if key != self.key:
            self.key, self.model = None, None  # free the old one first
            self.model, self.key = load_model(s), key
        return self.model


@dataclass
class Row:
    """One chunk of the memory panel: per video (label -> value)."""
    index: int
    action: str | None
    frames: int
    seconds: dict
    memory: dict
    psnr: float | None = None
    ui_seconds: float | None = None  # the UI's time after the chunk (known when the next chunk starts): app.ui_run.run


@dataclass
class Update:
    status: str
    labels: list[str]  # the videos: [method] or [bf16, method]
    frames: dict = field(default_factory=dict)  # label -> uint8 [F, H, W, 3], the newest frames
    rows: list[Row] = field(default_factory=list)
    total_chunks: int = 0
    done: bool = False
    videos: dict = field(default_factory=dict)  # label -> mp4 path (when done)
    reports: list[str] = field(default_factory=list)  # JSON report paths (when done)
    fps: int = 8


def prepare(runs: list[dict], controls: Job, models: Models) -> list[Generation]:
    """The videos of `settings(...)` (the form, checked first) ready to run: the model loaded (or kept) and each
    video's cache built, which checks the options that depend on the model (block size against its head dim, ...):
    UsageError before anything is generated. A comparison's videos share the model and the action plan."""
    model = models.get(runs[0])
    plan = Plan(runs[0], controls) if runs[0]["pipeline"] == "tiny" else None  # shared: the same actions
    return [Generation(s, loaded=model, plan=plan) for s in runs]


def run(runs: list[dict], gens: list[Generation], controls: Job, workdir: Path):
    """Generate the prepared videos, yielding an Update after the start frame and after every chunk; stops between
    chunks when controls.cancel is set (the video so far is kept). A row's ui_seconds: the wall time from the start of its chunk to the start of the
    next minus the chunks' own seconds, i.e. what the UI does in between (mp4 append, PSNR, and whatever the consumer
    of the Update does before asking for the next: preview encode, panel, gradio's streaming)."""
    import json

    from qvg.eval.metrics import psnr
    from .generate import to_uint8
    labels = [s["label"] for s in runs]
    if runs[0]["device"].type == "cuda":  # peak_gpu_bytes covers this job's generation, as in qvg-generate
        import torch
        torch.cuda.reset_peak_memory_stats(runs[0]["device"])
    up = Update("starting", labels, total_chunks=gens[0].total_chunks, fps=gens[0].fps)
    writers = {}
    chunk_seconds = {lb: 0.0 for lb in labels}
    peaks = {lb: None for lb in labels}
    chunk_rows = {lb: [] for lb in labels}  # the reports' per-chunk lines
    t0 = time.perf_counter()
    try:
        stems = {lb: file_stem(s) for lb, s in zip(labels, runs)}
        for lb, g in zip(labels, gens):
            writers[lb] = mp4_writer(str(workdir / f"{stems[lb]}.mp4"), g.fps)
            if g.lead is not None:
                up.frames[lb] = to_uint8(g.lead)
                for f in up.frames[lb]:
                    writers[lb].append_data(f)
        if up.frames:
            up.status = "start frame"
            yield up
        iters = [iter(g) for g in gens]
        t_chunk = None
        for c in range(up.total_chunks):
            _ui_seconds(up, t_chunk)
            t_chunk = time.perf_counter()
            if controls.cancel.is_set():
                up.status = f"cancelled after {c} of {up.total_chunks} chunks"
                cancelled = c
                break
            chunks = [next(it) for it in iters]
            for lb, ch in zip(labels, chunks):
                if len(ch.frames):  # (the last chunk may be cut to nothing: the video is `frames` long)
                    up.frames[lb] = ch.frames
                for f in ch.frames:
                    writers[lb].append_data(f)
                chunk_seconds[lb] += ch.seconds
                if peaks[lb] is None or ch.memory["total"] >= peaks[lb]["total"]:  # (ties: the latest)
                    peaks[lb] = ch.memory
            up.rows.append(Row(c, chunks[-1].action, int(chunks[-1].frames.shape[0]),
                               {lb: ch.seconds for lb, ch in zip(labels, chunks)},
                               {lb: ch.memory for lb, ch in zip(labels, chunks)},
                               psnr(chunks[0].video, chunks[-1].video) if len(chunks) == 2 and
                               chunks[0].video.numel() else None))
            for lb, ch in zip(labels, chunks):
                chunk_rows[lb].append(chunk_row(ch))
            if up.rows[-1].psnr is not None:  # the compared method's report: its PSNR against bf16 per chunk
                chunk_rows[labels[-1]][-1]["psnr_vs_bf16"] = round(up.rows[-1].psnr, 3)
            steer = f" · steering: {controls.steer}" if controls.steer and runs[0]["pipeline"] == "tiny" else ""
            up.status = f"chunk {c + 1} of {up.total_chunks}{steer}"
            yield up
        else:
            n = up.total_chunks
            up.status = f"done: {n} chunk{'' if n == 1 else 's'} in {time.perf_counter() - t0:.1f} s"
            cancelled = None
        _ui_seconds(up, t_chunk)
        for lb in labels:
            writers[lb].close()
        for lb, s, g in zip(labels, runs, gens):
            if g.written:  # frames produced = frames in the mp4; none (cancelled early): the writer wrote no file
                up.videos[lb] = str(workdir / f"{stems[lb]}.mp4")
            if peaks[lb] is not None:  # seconds: this run's chunks (not the UI's streaming, not the other run)
                path = workdir / f"{stems[lb]}.json"
                rep = report(s, g, g.written, chunk_seconds[lb], peaks[lb], chunk_rows[lb])
                if cancelled is not None:  # what was generated, not what was planned
                    cf = generate.chunk_frames(s)
                    rep.update(latent_frames=min(g.latent_frames, cancelled * cf),
                               cancelled={"after_chunks": cancelled, "of_chunks": up.total_chunks})
                path.write_text(json.dumps(rep, indent=1))
                up.reports.append(str(path))
        lb, s = labels[-1], runs[-1]
        if lb != "bf16" and up.rows and cancelled is None and not up.rows[-1].memory[lb].get("codes"):  # (as
            # qvg-generate's note says; a video cancelled early may just not have reached its first commit)
            up.status += (f" · note: {lb} compressed nothing: every frame stayed in BF16 (a sink of {s['sink']} "
                          "latent frames covering the video)")
        note = generate.unit_cost_note(s, page=True) if lb != "bf16" else None  # (qvg-generate: before its run)
        if note:
            up.status += f" · note: {note}"
        up.done = True
        yield up
    finally:
        for w in writers.values():
            close_quietly(w)


def _ui_seconds(up: Update, t_chunk: float | None) -> None:
    """The last row's ui_seconds: the time since its chunk started (t_chunk) less the chunks' own seconds."""
    if t_chunk is not None and up.rows and up.rows[-1].ui_seconds is None:
        r = up.rows[-1]
        r.ui_seconds = max(0.0, time.perf_counter() - t_chunk - sum(r.seconds.values()))


class Workdirs:
    """One temporary folder per job for its frames, mp4s and reports (gradio copies what it shows into its own
    cache); the previous job's folder goes when the next starts, the last one at exit."""

    def __init__(self):
        self.current: Path | None = None

    def new(self) -> Path:
        self.clear()
        self.current = Path(tempfile.mkdtemp(prefix="qvg-app-"))
        return self.current

    def clear(self) -> None:
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
            self.current = None


def append_action(text: str, name: str) -> str:
    """'right*2' + right -> 'right*3'; 'right*2' + left -> 'right*2,left'."""
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    if parts:
        m = re.fullmatch(r"(\w+)(?:\*([0-9]+))?", parts[-1])  # (\d would take other scripts' digits)
        if m and m.group(1) == name:
            parts[-1] = f"{name}*{int(m.group(2) or 1) + 1}"
            return ",".join(parts)
    return ",".join(parts + [name])
