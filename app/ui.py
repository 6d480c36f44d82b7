"""`qvg-app`: the live-generation UI (gradio). Frames appear chunk by chunk while the video is generated, next to a
memory panel (KV bytes now vs the BF16 equivalent, bytes by component, compression ratio, per-chunk latency) and,
in compare mode, the BF16 video with the same seed and PSNR per chunk; the mp4s and JSON reports are downloadable.

One generation runs at a time (a queue; waiting users see their position). Each Generate click is a job with its
own id (app/ui_jobs.py); Cancel cancels the session's jobs of that moment: a queued one never runs, a running one
stops between chunks and keeps the video so far. Camera buttons and the arrow keys (+ / - zoom, . stay) build the
action list, or steer the running video from its next chunk on. Binds 127.0.0.1 unless --host says otherwise.
Paths: app/ui_run.py. The memory panel's plots are gradio's native plots: the server sends their data and the
browser draws them, so nothing is rendered on the generation's thread between chunks. Bad input is one message
that stays: the form's, checked when Generate is clicked (nothing queued), under the buttons; what needs the model,
checked when the run starts, in the status line (before anything loads or the page is cleared).
"""

import logging
import math
import os
import re
import signal
import sys
import warnings
from pathlib import Path

from qvg.outputs import Terminated, sigterm_raises

from .generate import DEFAULT_ACTIONS, DEFAULT_IMAGE, DEFAULT_PROMPT, UsageError
from .ui_jobs import Jobs, cancel_message
from .ui_run import (FRAMES_RANGE, KMEANS, PIPELINES, Form, Models, Server, Update, Workdirs, append_action, prepare,
                     run, settings, ui_message)

log = logging.getLogger("qvg.app")
ACTION_KEYS = {"left": ("←", "ArrowLeft"), "up": ("↑", "ArrowUp"), "down": ("↓", "ArrowDown"),
               "right": ("→", "ArrowRight"), "zoom_in": ("zoom +", "+"), "zoom_out": ("zoom −", "-"),
               "stay": ("stay", ".")}
# keyboard shortcuts: a key clicks its camera button (not while typing in a field)
KEYS_JS = """() => {
  const keys = %s;
  document.addEventListener('keydown', (e) => {
    const t = e.target, tag = (t && t.tagName || '').toLowerCase();
    if (tag === 'input' || tag === 'textarea' || tag === 'select' || (t && t.isContentEditable)) return;
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const name = keys[e.key === '=' ? '+' : e.key];
    const b = name && document.getElementById('qvg-act-' + name);
    if (b) { e.preventDefault(); b.click(); }
  });
}""" % {v[1]: k for k, v in ACTION_KEYS.items()}
CSS = """#qvg-live img {image-rendering: pixelated;} #qvg-ref img {image-rendering: pixelated;}
#qvg-status {font-size: 1.05em;} .qvg-keys button {min-width: 4em;}"""
FORM_FIELDS = list(Form.__dataclass_fields__)
REFUSED = "refused"  # the job id of a click whose form failed the unqueued checks (its queued run does nothing)
FRAMES = {"tiny": 31, "self-forcing": 49}  # the length slider's value per pipeline: qvg-generate's defaults
# the memory panel's plots (app.ui_panel.plots: name -> x, y, colour column, title), drawn in the browser
# (short titles: a plot is at least PLOT_WIDTH pixels wide, two or three to a row only on wide pages)
PLOTS = {"components": ("size", "component", "{lb}: KV bytes by component"),
         "kv": ("size", "series", "KV bytes vs the BF16 equivalent"),
         "ratio": ("ratio", "video", "compression ratio"),
         "latency": ("seconds", "series", "seconds per chunk"),
         "psnr": ("PSNR dB", None, "PSNR {lb} vs bf16")}
PLOT_WIDTH = 420


def error_status(message: str) -> str:
    """The status line for an error: one line (Markdown's emphasis, link and HTML characters escaped), kept until
    the next Generate."""
    return "**Error:** " + re.sub(r"([\\`*_\[\]<>])", r"\\\1", " ".join(message.split()))


def start_preview(photo: str, upload: str | None = None):
    """The start frame the model will get, at the live preview's size: an uploaded image's (its centre view at the
    bundled photos' scale, as qvg-generate --image makes it; the caller checks the path is an upload), else the
    bundled photo's centre view; None for what is not an image (the Generate click then says why)."""
    import numpy as np

    from qvg.pipelines.world_data import centre_view, load_photo, photo_names

    from .generate import UsageError, start_frame, to_uint8
    from .ui_panel import preview
    if upload:
        try:
            frame = start_frame(upload)[0]
        except UsageError:
            return None
    elif photo in photo_names("all"):
        frame = centre_view(load_photo(photo))
    else:
        return None
    return np.asarray(preview(to_uint8(frame[:, None]))[0])


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _lenient_preprocess(image, gr) -> None:
    """An upload PIL cannot open: with an image's suffix it is passed on as its path, so that the app's own reader
    says why in the status line (start_frame: "cannot read ... as an image"); any other file is gradio's error with
    that reason (a video or the like is never handed to the readers behind imageio). gradio's preprocessing raised
    PIL's error before any handler ran: a traceback in the log, a bare "Error" on the page, the old preview kept.
    (Wrapped on the instance: a gr.Image subclass makes gradio write a .pyi stub beside this file.)"""
    strict = image.preprocess

    def preprocess(payload):
        try:
            return strict(payload)
        except Exception:  # (PIL's UnidentifiedImageError, a truncated file, ...)
            if payload is None or payload.path is None:  # (no file: gradio's own error stands)
                raise
            name = payload.orig_name or Path(payload.path).name
            if Path(name).suffix.lower() in IMAGE_SUFFIXES:
                return str(payload.path)
            raise gr.Error(f"start image: {name!r} is not an image file ({', '.join(IMAGE_SUFFIXES)})",
                           print_exception=False) from None
    image.preprocess = preprocess


def build(server: Server):
    """The page (gr.Blocks) for a server's rules."""
    import gradio as gr

    from qvg.cache import CACHE_METHODS
    from qvg.pipelines.world_data import photo_names

    from gradio.utils import get_upload_folder

    from . import ui_panel
    if server.upload_dir is None:
        server.upload_dir = Path(get_upload_folder())
    jobs, models, workdirs = Jobs(), Models(), Workdirs()
    root = server.checkpoint_root
    with gr.Blocks(title="QVG live", delete_cache=(1800, 3600), analytics_enabled=False, fill_width=True) as app:
        gr.Markdown("# QVG — live video generation with a compressed KV cache\nFrames appear chunk by chunk; the "
                    "memory panel shows what the KV cache holds after each chunk against BF16.")
        status = gr.Markdown("Ready.", elem_id="qvg-status")
        with gr.Row():
            with gr.Column(scale=1, min_width=340):
                with gr.Group():
                    pipeline = gr.Radio([(v, k) for k, v in PIPELINES.items()], value="tiny", label="pipeline")
                    checkpoint = gr.Textbox(label="checkpoint directory", visible=False, info=(
                        f"a folder inside {root}" if root else "this server runs the embedded model only "
                        "(start it with --checkpoint-root DIR)"))
                    prompt = gr.Textbox(label="prompt", value=DEFAULT_PROMPT, visible=False)
                with gr.Group() as world_box:
                    with gr.Row():
                        photo = gr.Dropdown(photo_names("all"), value=DEFAULT_IMAGE, label="start image: bundled")
                        upload = gr.Image(type="filepath", sources=["upload"], label="or upload one", height=140)
                        _lenient_preprocess(upload, gr)
                    with gr.Row(elem_classes="qvg-keys"):
                        buttons = {name: gr.Button(label, size="sm", elem_id=f"qvg-act-{name}")
                                   for name, (label, _) in ACTION_KEYS.items()}
                        # (the list starts as the default one: clear it to build a path of one's own)
                        clear = gr.Button("clear", size="sm", variant="secondary", elem_id="qvg-act-clear")
                    actions = gr.Textbox(DEFAULT_ACTIONS, label="camera actions, one per chunk (repeated)",
                                         elem_id="qvg-actions",
                                         info="buttons or keys ← ↑ ↓ → + − . add to it (clear empties it; "
                                              "left empty, the default list runs); while generating they "
                                              "steer the next chunks")
                    steer_note = gr.Markdown("")
                with gr.Group():
                    method = gr.Dropdown(list(CACHE_METHODS), value="qvg", label="KV cache method")
                    with gr.Row():
                        bits = gr.Dropdown(["default", "2", "4", "8"], value="default", label="bits")
                        # blank = the method's default (a browser sends an empty gr.Number as 0)
                        stages, block_size, centroids = (gr.Textbox("", label=lb, placeholder="default",
                                                                    elem_id=f"qvg-{lb.split()[0]}")
                                                         for lb in ("stages", "block size", "centroids"))
                    with gr.Row():
                        history = gr.Radio([("full", "full"), ("window + sink", "window")], value="full",
                                           label="history")
                        # (no minimum= on the numbers: gradio would refuse a value below it in a pop-up, before the
                        # app's own check can say so in the status line)
                        window = gr.Number(12, label="window (latent frames)", precision=0, visible=False)
                        sink = gr.Number(0, label="sink (latent frames)", precision=0)
                        window.preprocess = sink.preprocess = _as_given  # (precision=0 would round an API's 1.5)
                    with gr.Row():
                        # (4 frames: the start frame and one chunk; a longer video than 301: qvg-generate --frames)
                        frames = gr.Slider(*FRAMES_RANGE, value=31, step=3, label="length (frames)",
                                           elem_id="qvg-frames")
                        frames.preprocess = _as_given
                        # a Textbox: a browser's number field holds a double, so seeds past 2**53 would be rounded
                        seed = gr.Textbox("0", label="seed", elem_id="qvg-seed")
                    compare = gr.Checkbox(False, label="compare with BF16 (same seed, side by side, PSNR per chunk)",
                                          elem_id="qvg-compare")
                with gr.Row():
                    go = gr.Button("Generate", variant="primary", elem_id="qvg-generate")
                    stop = gr.Button("Cancel", variant="stop", elem_id="qvg-cancel")
                # what the last Generate click got (a form refused, or queued behind another video): kept until
                # the next click (the status line is the running video's, which rewrites it after every chunk)
                notice = gr.Markdown("", elem_id="qvg-notice")
                # the id of the job a Generate click submits: sent with its queued request (a gr.State would be
                # read when the request leaves the queue, by then perhaps the next click's)
                job_id = gr.Textbox("", visible="hidden", elem_id="qvg-job")
            with gr.Column(scale=2):
                with gr.Row():
                    live = gr.Image(start_preview(DEFAULT_IMAGE), label="live: qvg", elem_id="qvg-live",
                                    interactive=False, height=300, format="png")
                    ref = gr.Image(None, label="live: bf16 (reference)", elem_id="qvg-ref", interactive=False,
                                   height=300, visible=False, format="png")
                summary = gr.Markdown("Memory: waiting for the first chunk.", elem_id="qvg-memory")
                plots = {}
                with gr.Row():  # (a row wraps: as many plots to a line as PLOT_WIDTH lets, their legends unclipped)
                    for name, (y, color, title) in PLOTS.items():
                        kind = gr.BarPlot if name == "components" else gr.LinePlot
                        plots[name] = kind(None, x="chunk", y=y, color=color, title=title.format(lb="qvg"),
                                           color_map=ui_panel.COLORS if name == "components" else None,
                                           y_lim=None if name == "psnr" else [0, None], min_width=PLOT_WIDTH,
                                           height=260, elem_id=f"qvg-plot-{name}", visible=name != "psnr",
                                           show_label=False)
                table = gr.Dataframe({"headers": ui_panel.table(Update("", ["qvg"]))[0], "data": []},
                                     label="per chunk", interactive=False, elem_id="qvg-table", max_height=420)
                with gr.Row():
                    video = gr.Video(label="video (mp4)", interactive=False, elem_id="qvg-video", height=300)
                    ref_video = gr.Video(label="bf16 video (mp4)", interactive=False, visible=False, height=300)
                reports = gr.File(label="JSON reports", file_count="multiple", interactive=False)

        form = [pipeline, checkpoint, prompt, photo, upload, actions, method, bits, stages, block_size, centroids,
                history, window, sink, seed, frames, compare]
        assert len(form) == len(FORM_FIELDS)
        outputs = [status, live, ref, summary, *plots.values(), table, video, ref_video, reports, steer_note]
        skip_all = [gr.skip()] * (len(outputs) - 1)

        def plot_updates(up):  # the lines span the whole video from its start; the bars are one per chunk so far
            data, unit = ui_panel.plots(up)
            lb, n = up.labels[-1], len(up.rows)
            out = []
            for name, (_, color, title) in PLOTS.items():
                if name == "components":  # labelled bars (chunk numbers as text, in order) or a number axis
                    kw = {"sort": [str(i) for i in range(1, n + 1)] if n <= ui_panel.BAR_LABELS else None}
                elif ui_panel.lines_labelled(up):  # the video's chunks as labels, in order
                    kw = {"sort": [str(i) for i in range(1, up.total_chunks + 1)], "x_lim": None,
                          "x_axis_format": None}
                else:  # whole chunks on a number axis from 1 to the video's last
                    kw = {"sort": None, "x_lim": [0.5, max(up.total_chunks, 1) + 0.5], "x_axis_format": "d"}
                if color and n:  # the page draws a series' colour only if it is in the legend's list (which, when
                    # it changes, redraws the plot): a component or the UI's time may appear after the first chunk
                    kw["colors_in_legend"] = list(dict.fromkeys(data[name][color]))
                if name in ("components", "kv"):
                    kw["y_title"] = f"KV cache ({unit})"
                if name == "psnr":
                    kw["visible"] = name in data
                value = data.get(name) if n else None
                if value is not None and name in ("kv", "ratio", "latency"):  # the top above the largest value
                    kw["y_lim"] = [0, ui_panel.y_top(value, PLOTS[name][0])]
                elif value is not None and name == "psnr" and value["PSNR dB"].notna().any():  # whole dB around
                    kw["y_lim"] = [math.floor(value["PSNR dB"].min() - 0.5), math.ceil(value["PSNR dB"].max() + 0.5)]
                if value is not None and name != "components" and ui_panel.one_point(value, PLOTS[name][0], color):
                    value = plots[name].postprocess(value).model_dump()  # drawn as points: a line through one
                    value["mark"] = "point"  # point draws nothing (gradio passes a dict value on as it is)
                out.append(gr.update(value=value, title=title.format(lb=lb), **kw))
            return out

        def submit(pipeline, checkpoint, prompt, photo, upload, actions, method, bits, stages, block_size,
                   centroids, history, window, sink, seed, frames, compare, request: gr.Request):
            """Unqueued: the form's checks (bad input said at once, not after every run queued before it), then a
            job id for the queued run, and the click's notice; REFUSED if the form fails them (nothing is queued
            then: `gate`)."""
            import tempfile
            values = locals()
            try:
                with tempfile.TemporaryDirectory(prefix="qvg-check-") as tmp:
                    unused = settings(Form(**{k: values[k] for k in FORM_FIELDS}), server, Path(tmp))[-1][
                        "unused_fields"]
            except UsageError as e:
                return REFUSED, error_status(ui_message(e))
            except Exception as e:  # (an unreadable folder, ...: one line here too; the traceback to the log)
                log.exception("checking the form failed")
                from qvg.pipelines.state_dicts import first_line
                return REFUSED, error_status(first_line(e))
            wait = "Queued: another video is being generated; this one starts when it ends." if jobs.busy() else ""
            if unused:  # (hidden fields keep their values for when their method is chosen again; an API call sends all)
                wait = f"Not used by {method}, which has no such option: {', '.join(unused)}. {wait}".strip()
            return jobs.submit(request.session_hash).id, wait  # (gradio's queue line: its time per update, not a wait)

        def gate(job):  # a refused click queues no run (its notice says why)
            if job == REFUSED:
                raise gr.Error("the form was refused", visible=False, print_exception=False)

        def generate(pipeline, checkpoint, prompt, photo, upload, actions, method, bits, stages, block_size,
                     centroids, history, window, sink, seed, frames, compare, job, request: gr.Request):
            values = locals()
            if job == REFUSED:  # (an API call with /job's refusal: the click's notice said why; the page never
                # queues one)
                yield (gr.skip(), *skip_all)
                return
            f = Form(**{k: values[k] for k in FORM_FIELDS})
            c = jobs.start(job, request.session_hash, steerable=f.pipeline == "tiny")
            up = None
            try:
                if c.cancel.is_set():  # the page says nothing more: Cancel said this job will not run, and the
                    yield (gr.skip(), *skip_all)  # status may now be an earlier job's end, which should stay
                    return
                workdir = workdirs.new()
                # bad input is one message in the status line, and the page keeps its last video until the input
                # passes: the form's checks first, then (the model loaded) the cache's
                runs = settings(f, server, workdir)
                yield ("Starting..." if models.has(runs[0]) else "Loading the model...", *skip_all)
                gens = prepare(runs, c, models)
                empty = Update("", [s["label"] for s in runs])
                yield ("Starting...", gr.skip(), gr.update(visible=f.compare), "Memory: waiting for the first chunk.",
                       *plot_updates(empty), {"headers": ui_panel.table(empty)[0], "data": []}, None,
                       gr.update(value=None, visible=f.compare), None, gr.skip())
                for n, up in enumerate(run(runs, gens, c, workdir)):
                    main_lb = up.labels[-1]
                    images = [ui_panel.frames_image(up.frames[lb], workdir / f"{lb}-{n}.png", up.fps)
                              if lb in up.frames else gr.skip() for lb in up.labels]
                    head, rows = ui_panel.table(up)
                    yield (f"**{up.status}**", gr.update(value=images[-1], label=f"live: {main_lb}"),
                           images[0] if len(images) == 2 else gr.skip(), ui_panel.summary(up),
                           *(plot_updates(up) if up.rows else [gr.skip()] * len(PLOTS)),
                           {"headers": head, "data": rows}, up.videos.get(main_lb) if up.done else gr.skip(),
                           up.videos.get("bf16") if up.done and len(up.labels) == 2 else gr.skip(),
                           up.reports or gr.skip(), "" if up.done else gr.skip())  # (a run's end: no steering)
            except UsageError as e:  # bad input (or checkpoint files): the status line says it and stays
                yield (error_status(ui_message(e)), *skip_all)
            except Exception as e:  # one line in the UI; the traceback goes to the server's log only
                log.exception("generation failed")
                from qvg.pipelines.state_dicts import first_line
                yield (error_status(first_line(e)), *skip_all)
            finally:
                jobs.finish(c)

        def cancel(request: gr.Request):
            return cancel_message(*jobs.cancel(request.session_hash))

        def press(name: str, text: str, request: gr.Request):
            c = jobs.running(request.session_hash)
            if c is not None and not c.steerable:  # (the form is the world model's again: the next run's list)
                return append_action(text, name), ("the running video is Self-Forcing's (text to video): it takes no "
                                                   "camera actions; added to the list for the next run")
            if c is not None:
                c.steer = name
                return gr.skip(), f"steering: **{name}** from the next chunk that starts"
            return append_action(text, name), ""

        # each click is a job: its id first (unqueued, so Cancel reaches it while it waits), then the queued run
        go.click(lambda: "", None, steer_note, queue=False, api_visibility="private")  # a new job: the note goes
        go.click(submit, form, [job_id, notice], queue=False, api_name="job", trigger_mode="multiple").then(
            gate, job_id, None, queue=False, api_visibility="private", trigger_mode="multiple").success(
            generate, [*form, job_id], outputs, api_name="generate", concurrency_limit=1,
            concurrency_id="generation", show_progress="minimal", show_progress_on=[status], trigger_mode="multiple")
        stop.click(cancel, None, status, queue=False, api_name="cancel")

        def closed(request: gr.Request):  # the page closed: its jobs will not be watched
            jobs.drop(request.session_hash)
        app.unload(closed)
        for name, b in buttons.items():
            b.click(press, [gr.State(name), actions], [actions, steer_note], queue=False, api_name=f"press_{name}")
        clear.click(lambda: "", None, actions, queue=False, api_name="clear_actions")
        def preview_start(photo, upload):  # (an upload is read only from gradio's upload folder)
            up = upload and os.path.realpath(upload)
            inside = up and Path(up).is_relative_to(os.path.realpath(server.upload_dir))
            return start_preview(photo, up if inside else None)
        photo.change(preview_start, [photo, upload], live, queue=False, api_visibility="private")
        upload.change(preview_start, [photo, upload], live, queue=False, api_visibility="private")

        def on_method(m):
            return (gr.update(visible=m != "bf16"), gr.update(visible=m in KMEANS), gr.update(visible=m != "bf16"),
                    gr.update(visible=m in KMEANS), gr.update(label=f"live: {m}"))
        method.change(on_method, method, [bits, stages, block_size, centroids, live], queue=False,
                      api_visibility="private")

        def on_pipeline(p, name):  # the length is the pipeline's default; the live image its start (Self-Forcing: none)
            sf = p == "self-forcing"
            return (gr.update(visible=sf), gr.update(visible=sf), gr.update(visible=not sf), FRAMES.get(p, 31),
                    None if sf else start_preview(name))
        pipeline.change(on_pipeline, [pipeline, photo], [checkpoint, prompt, world_box, frames, live], queue=False,
                        api_name="pipeline_defaults").then(  # (back to the embedded model: an upload's frame wins)
            lambda p, ph, up: None if p == "self-forcing" else preview_start(ph, up), [pipeline, photo, upload], live,
            queue=False, api_visibility="private")
        history.change(lambda h: gr.update(visible=h == "window"), history, window, queue=False,
                       api_visibility="private")
        compare.change(lambda v: (gr.update(visible=v), gr.update(visible=v)), compare, [ref, ref_video],
                       queue=False, api_visibility="private")
    app.queue(default_concurrency_limit=1)
    app.qvg_workdirs, app.qvg_jobs = workdirs, jobs
    return app


def _as_given(payload):
    """The length slider's and the window / sink numbers' preprocess: the value reaches the form's check as it is, so
    a length outside the range (an API call) is refused in the page's words (ui_run.settings), where gradio's range
    check answered with its own error and a server traceback, and a window or sink of 1.5 is refused, not rounded
    (their precision=0). (Set on the instance: a subclass of a gradio component makes gradio write a .pyi
    stub beside this file.)"""
    return payload


def serve(app, host: str, port: int | None) -> None:
    """qvg-app's server until Ctrl-C: gradio quiet (its lines advise its Python API, e.g. `share=True`, which
    qvg-app has no flag for), one line of ours with the address."""
    launch(app, host, port, quiet=True, prevent_thread_lock=True)
    print(f"qvg-app: serving on {app.local_url} (Ctrl-C to stop)", flush=True)
    app.block_thread()


def launch(app, host: str = "127.0.0.1", port: int | None = None, **kw):
    """Start the server (kw: gradio's launch options, e.g. prevent_thread_lock=True in tests)."""
    return app.launch(server_name=host, server_port=port, js=KEYS_JS, css=CSS, show_error=False,
                      footer_links=["api"], **kw)


def _host_error(host: str) -> str | None:
    """Why `host` cannot be served on, or None: it does not resolve, or one of its addresses is no address of this
    machine (the server binds every address a name resolves to, as asyncio's create_server does, and fails if one
    fails). "" is refused (gradio would take it for its default, or $GRADIO_SERVER_NAME); [::1] is ::1."""
    import socket
    if not host.strip():
        return "--host: empty: give an address (127.0.0.1: this machine only; 0.0.0.0: every interface)"
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        found = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return f"--host: cannot resolve {host!r} ({getattr(e, 'strerror', None) or e})"
    for family, kind, proto, _, address in dict.fromkeys(found):  # (any free port: the port is gradio's to check)
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # (a family this machine has no sockets for: create_server skips it too)
            continue
        try:
            with probe:
                probe.bind(address)
        except OSError as e:
            return f"--host: cannot bind {host!r} at {address[0]} ({e.strerror or e}): give an address of this machine"
    return None


def main(argv: list[str] | None = None) -> int:
    from .generate import _int, _Parser
    p = _Parser(prog="qvg-app", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", default=None, help="port (default: gradio's, 7860, or the next free one)")
    p.add_argument("--checkpoint-root", default=None, help="the folder checkpoint directories must be inside "
                   "(default: none, only the embedded model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    try:
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
        a.port = _int("port", a.port, 1, 65535, allow_none=True)
        root = None
        if a.checkpoint_root is not None:
            root = Path(a.checkpoint_root).resolve()
            if not root.is_dir():
                what = "not a directory" if root.exists() else "no such directory"
                raise UsageError(f"--checkpoint-root: {what}: {a.checkpoint_root!r}")
        if a.device is not None:
            from .generate import device_arg
            device_arg(a.device)
        err = _host_error(a.host)
        if err:
            raise UsageError(err)
        import importlib.util
        if importlib.util.find_spec("gradio") is None:
            raise UsageError("the UI needs gradio: pip install -e '.[ui]'")
    except UsageError as e:
        print(f"qvg-app: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)  # (INFO printed a line per HTTP request the server made)
    app = None
    try:
        with sigterm_raises():  # (kill, docker stop, systemd: the last job's folder was left in the temp dir)
            from qvg.cache import UnitCostWarning  # (torch and gradio load here and below: a signal is one line)
            warnings.filterwarnings("ignore", category=UnitCostWarning)  # (the run's notice says it: unit_cost_note)
            app = build(Server(root, None, a.device))
            try:
                serve(app, a.host, a.port)
            except OSError as e:  # the port taken (or not ours to bind): before anything was served
                text = str(e).splitlines()[0] if str(e) else type(e).__name__
                if "Cannot find empty port" in text:  # (gradio's words, whose advice is for its Python API)
                    text = (f"port {a.port} is in use or cannot be bound here; give another --port" if a.port else
                            "no free port from 7860 on; give --port")
                print(f"qvg-app: error: cannot serve on {a.host}: {text}", file=sys.stderr)
                return 2
    except Terminated:
        if app is not None:
            app.close()
        print("qvg-app: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # (Ctrl-C while the page is built; once served, gradio takes it and returns)
        print("qvg-app: interrupted", file=sys.stderr)
        return 130
    finally:
        if app is not None:
            app.qvg_workdirs.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
