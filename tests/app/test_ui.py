"""qvg-app end to end through gradio_client on the embedded model (CPU): live chunks and the memory panel,
compare mode, the queue (positions, one job at a time), cancel (per job), live steering, errors as messages, the
path rules (checkpoint root, uploads only) and the live preview's size. Videos are short (1-4 chunks of 3 frames)."""
import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from hang_report import hang_report
from optional_deps import need

gradio_client = need("gradio_client", "the UI tests need the test extra: pip install -e '.[test]'")
from gradio_client import Client, handle_file  # noqa: E402

from qvg.app.generate import UsageError  # noqa: E402
from qvg.app.ui_jobs import Jobs, cancel_message  # noqa: E402
from qvg.app.ui_run import Form, Server, append_action, checkpoint_dir, settings  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword).*")  # gradio's pandas use

# the /generate endpoint's inputs, in the page's order (app.ui_run.Form), and its outputs
FIELDS = list(Form.__dataclass_fields__)
STATUS, LIVE, REF, SUMMARY, COMPONENTS, KV, RATIO, LATENCY, PSNR, TABLE, VIDEO, REF_VIDEO, REPORTS, STEER = range(14)


def form(**kw):
    f = Form(**{"frames": 7, **kw})
    return [getattr(f, k) for k in FIELDS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckroot")
    (root / "empty").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def sf_checkpoint(ckpt_root):
    """A tiny Self-Forcing checkpoint in the original layout at ROOT/sf (tests/pipelines/test_checkpoints.py's)."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "pipelines" / "test_checkpoints.py"
    spec = importlib.util.spec_from_file_location("_sf_checkpoint_files", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # (skips where the wan packages are missing)
    (ckpt_root / "sf").mkdir()
    return mod.write_checkpoint(ckpt_root / "sf", mod.source_models())


@pytest.fixture(scope="module")
def url(ckpt_root):
    from qvg.app.ui import build, launch
    app = build(Server(ckpt_root, None, "cpu"))
    port = _free_port()
    launch(app, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
    SERVER["app"] = app
    yield f"http://127.0.0.1:{port}/"
    SERVER.clear()
    app.close()
    app.qvg_workdirs.clear()


@pytest.fixture
def client(url):
    return Client(url, verbose=False)


def submit(client, **kw):
    """A Generate click as the page makes it: a job id (/job, unqueued), then the queued run with that id."""
    job, _ = client.predict(*form(**kw), api_name="/job")
    return client.submit(*form(**kw), job, api_name="/generate")


SERVER = {}  # the running app (url's), for the report a timed-out wait prints


def _timed_out(what: str, timeout: float, job=None):
    seen = "" if job is None else f"; its status lines so far: {[o[0] for o in job.outputs()]}"
    pytest.fail(f"{what}: not within {timeout} s{seen}; the server:\n{hang_report(SERVER.get('app'))}")


def _until(cond, timeout=120, what="condition"):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            _timed_out(what, timeout)
        time.sleep(0.1)


def _wait(job, timeout=240, what="the job"):
    t0 = time.time()
    while not job.done():
        if time.time() - t0 > timeout:
            _timed_out(f"{what} did not finish", timeout, job)
        time.sleep(0.2)
    if job.exception() is not None:
        raise job.exception()
    return job.outputs()


def test_live_chunks_memory_panel_mp4_and_report(client):
    """Every chunk is an update (its frames as an animated PNG, the memory panel's numbers, its plots as data drawn
    by the browser); the last one holds the mp4 and the JSON report."""
    from PIL import Image
    job = client.submit(*form(actions="right,left"), api_name="/generate")
    outs = _wait(job)
    status = [o[0] for o in outs]
    assert any("start frame" in s for s in status)
    assert [s for s in status if "chunk" in s and "of 2" in s] == ["**chunk 1 of 2**", "**chunk 2 of 2**"]
    assert status[-1].startswith("**done: 2 chunks")
    chunk_updates = [o for o in outs if "chunk " in o[0] and " of 2" in o[0]]
    for o in chunk_updates:  # the chunk's 3 frames, 4x nearest-upscaled, as an APNG that plays once
        img = Image.open(o[LIVE]["value"])
        assert img.size == (256, 256) and getattr(img, "n_frames", 1) == 3
        assert "KV cache" in o[SUMMARY] and "in BF16" in o[SUMMARY] and "smaller" in o[SUMMARY]
    assert "UI** between chunks" in chunk_updates[-1][SUMMARY]  # the first chunk's UI time, known at the second
    last = outs[-1]
    table = last[TABLE]
    assert [r[:2] for r in table["data"]] == [[1, "right"], [2, "left"]]
    head = table["headers"]
    comps = [h for h in head if h.startswith("qvg ") and h.endswith(" KiB") and h != "qvg KV KiB"]
    assert comps == [f"qvg {c} KiB" for c in ("codes", "scales", "ids", "centroids", "positions", "bf16_sink",
                                               "bf16_pending", "bf16_current", "bf16_residual", "workspace")]
    for r in table["data"]:
        row = dict(zip(head, r))
        assert row["qvg ratio"] > 1 and row["qvg KV KiB"] < row["BF16 equiv. KiB"] and row["qvg s"] > 0
        assert row["qvg codes KiB"] > 0 and row["qvg centroids KiB"] > 0 and row["qvg bf16_current KiB"] > 0
        assert abs(sum(row[h] for h in comps) - row["qvg KV KiB"]) < 0.1  # the components are the whole cache
        assert 0 <= row["UI s"] < row["qvg s"] * 10
    plot = last[COMPONENTS]["value"]  # native plots: the data, drawn in the browser (nothing rendered here)
    assert plot["mark"] == "bar" and plot["columns"] == ["chunk", "component", "size"]
    assert {c for _, c, _ in plot["data"]} >= {"codes", "scales", "centroids", "bf16_current"}
    assert last[COMPONENTS]["y_title"] == "KV cache (MiB)" and last[COMPONENTS]["sort"] == ["1", "2"]
    # the lines span the whole video (2 chunks, labelled) from the start
    assert last[KV]["sort"] == ["1", "2"] and last[KV].get("x_lim") is None and last[KV]["value"]["mark"] == "line"
    assert {s for _, s, _ in last[KV]["value"]["data"]} == {"qvg KV cache", "BF16 equivalent"}
    assert {s for _, s, _ in last[LATENCY]["value"]["data"]} == {"qvg", "UI"}
    assert last[LATENCY]["colors_in_legend"] == ["qvg", "UI"]  # (a series not listed is not drawn)
    assert last[PSNR]["visible"] is False
    import imageio.v3 as iio
    v = iio.imread(last[VIDEO])
    assert v.shape == (7, 64, 64, 3)
    rep = json.loads(open(last[REPORTS][0]).read())
    assert rep["method"] == "qvg" and rep["frames"] == 7 and rep["actions"] == ["right", "left"]
    assert rep["kv_bytes"]["total"] < rep["bf16_equivalent_bytes"]


def test_compare_runs_bf16_and_the_method_side_by_side(client):
    outs = _wait(client.submit(*form(method="rtn", bits="4", compare=True, frames=4), api_name="/generate"))
    last = outs[-1]
    head, rows = last[TABLE]["headers"], last[TABLE]["data"]
    assert head[3] == "PSNR dB" and "bf16 KV KiB" in head and "rtn KV KiB" in head
    row = dict(zip(head, rows[0]))
    assert 20 < row["PSNR dB"] < 100 and row["bf16 ratio"] == 1.0 and row["rtn ratio"] > 1
    # both runs' bytes by component: the BF16 reference's zones, the method's components
    assert [h for h in head if h.startswith("bf16 bf16_")] == ["bf16 bf16_sink KiB", "bf16 bf16_pending KiB",
                                                              "bf16 bf16_current KiB"]
    assert row["bf16 bf16_pending KiB"] > 0 and row["rtn codes KiB"] > 0 and row["rtn scales KiB"] > 0
    for lb in ("bf16", "rtn"):
        parts = [h for h in head if h.startswith(f"{lb} ") and h.endswith(" KiB") and h != f"{lb} KV KiB"]
        assert abs(sum(row[h] for h in parts) - row[f"{lb} KV KiB"]) < 0.1
    assert "PSNR rtn vs bf16" in last[SUMMARY]
    assert last[PSNR]["visible"] is True and len(last[PSNR]["value"]["data"]) == len(rows)
    # one chunk: each series is one point, drawn as a point (a line through one point draws nothing)
    assert last[PSNR]["value"]["mark"] == last[KV]["value"]["mark"] == "point"
    # (the bf16 run's cache is the BF16 equivalent: one line each, not two over each other)
    assert {s for _, s, _ in last[KV]["value"]["data"]} == {"bf16 KV cache", "rtn KV cache"}
    assert last[LIVE]["label"] == "live: rtn" and last[REF] and last[REF_VIDEO]  # both live frames, both videos
    # the downloads are named for what made them; the method's report has its PSNR against BF16 per chunk
    names = [os.path.basename(p) for p in last[REPORTS]]
    assert [re.fullmatch(r"(.+)-[0-9a-f]{6}\.json", n)[1] for n in names] == ["bf16-astronaut-seed0",
                                                                             "rtn-int4-astronaut-seed0"], names
    chunks = json.loads(open(last[REPORTS][1]).read())["chunks"]
    assert len(chunks) == 1 and abs(chunks[0]["psnr_vs_bf16"] - row["PSNR dB"]) < 0.01
    assert "psnr_vs_bf16" not in json.loads(open(last[REPORTS][0]).read())["chunks"][0]
    # the two runs share one model, interleaved chunk by chunk: the BF16 side is exactly a BF16 run on its own
    alone = _wait(client.submit(*form(method="bf16", frames=4), api_name="/generate"))
    from PIL import Image, ImageSequence
    import numpy as np

    def frames(path):
        return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(path))]
    ref_side, own = frames(last[REF]), frames(alone[-1][LIVE]["value"])
    assert len(ref_side) == len(own) == 3 and all(np.array_equal(a, b) for a, b in zip(ref_side, own))


def test_self_forcing_from_a_checkpoint_directory_in_the_root(client, sf_checkpoint):
    """A checkpoint directory named relative to the server's root runs the real Self-Forcing loader and loop."""
    outs = _wait(client.submit(*form(pipeline="self-forcing", checkpoint="sf", prompt="a red fox", frames=4),
                               api_name="/generate"))
    assert outs[-1][STATUS].startswith("**done: 1 chunk in"), outs[-1][STATUS]
    import imageio.v3 as iio
    assert iio.imread(outs[-1][VIDEO]).shape == (4, 480, 832, 3)  # the mp4 at full size, the live preview halved
    from PIL import Image
    assert Image.open(outs[-1][LIVE]["value"]).size == (416, 240)
    rep = json.loads(open(outs[-1][REPORTS][0]).read())
    assert rep["pipeline"] == "self-forcing" and rep["prompt"] == "a red fox"
    assert rep["checkpoint"]["generator"].startswith(str(sf_checkpoint.resolve()))


BAD = [
    (dict(method="qvg", block_size=48), "not divisible by block_size"),
    (dict(actions="fly*2"), "unknown action"),
    (dict(stages=17), "stages must be in [0, 16]"),
    # the length slider's range, from an API call (gradio's own error and a server traceback before)
    (dict(frames=2), "length (frames) must be in [4, 301] here (longer videos: the qvg-generate command), got 2"),
    (dict(frames=400), "length (frames) must be in [4, 301] here"),
    (dict(method="bf16", compare=True), "choose a compressed method"),
    (dict(history="window", window=4), "window must be a multiple of the chunk size"),
    (dict(sink=None), "sink: give a number"),
    (dict(sink=-3), "sink must be in [0, 100000], got -3"),  # (the app's check, not a gradio pop-up: no minimum= there)
    (dict(sink=1.5), "sink must be a whole number, got 1.5"),  # (an API call's: precision=0 rounded it to 2)
    (dict(history="window", window=13.5), "window must be a whole number, got 13.5"),
    (dict(seed=-5), "seed must be in [0, "),
    (dict(history="window", window=1), "window must be a multiple of the chunk size"),
    (dict(pipeline="self-forcing", checkpoint="../"), "outside the checkpoint root"),
    (dict(pipeline="self-forcing", checkpoint="escape"), "outside the checkpoint root"),
    (dict(pipeline="self-forcing", checkpoint="/etc"), "outside the checkpoint root"),
    (dict(pipeline="self-forcing", checkpoint="nope"), "no such directory in the checkpoint root"),
    (dict(pipeline="self-forcing", checkpoint="empty"), "no Self-Forcing generator checkpoint"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_message_not_a_traceback(client, kw, msg):
    """The status line says what is wrong and keeps saying it (the run ends normally: no pop-up, no error state);
    nothing else on the page changes (its last video and panel stay): the form is checked first, then, with the
    model loaded, the cache's options and the checkpoint's files, all before the page is cleared for a new video."""
    outs = _wait(client.submit(*form(**kw), api_name="/generate"))
    text = outs[-1][STATUS]
    assert text.startswith("**Error:** ") and msg in re.sub(r"\\(.)", r"\1", text), text
    assert "Traceback" not in text and "\n" not in text.strip(), text
    assert [o[STATUS] for o in outs[:-1]] in ([], ["Starting..."], ["Loading the model..."]), outs
    assert all(v == {"__type__": "update"} for o in outs for v in o[1:]), outs  # gr.skip(): left as they were
    # a Generate click: the form's checks run unqueued (at once, not after the runs queued before it), their
    # refusal the click's notice (`status` below); what needs the model (the head dim's block sizes, the
    # checkpoint's files) is said by the queued run, as above
    job, status = client.predict(*form(**kw), api_name="/job")
    if msg in ("not divisible by block_size", "no Self-Forcing generator checkpoint",
               "window must be a multiple of the chunk size"):
        assert job != "refused" and status == "", status  # (accepted: the click's notice is empty)
        client.predict(api_name="/cancel")
    else:  # and its queued run, when its turn comes, changes nothing (the status line keeps the error)
        assert job == "refused" and status == text, status
        outs = _wait(client.submit(*form(**kw), job, api_name="/generate"))
        assert len(outs) == 1 and all(v == {"__type__": "update"} for v in outs[0]), outs


def test_fields_the_method_has_not_are_said_unused(client):
    """An API call sends every field: values in those the page hides for the chosen method (stages for rtn, bits
    for bf16) are not used, and the click's notice says so (the run went on without a word); an empty or default
    field says nothing."""
    for kw, said in ((dict(method="rtn", stages=2.0, centroids=" 8 "), "Not used by rtn, which has no such option: "
                      "stages 2, centroids 8."),
                     (dict(method="bf16", bits="2", block_size="16"), "Not used by bf16, which has no such option: "
                      "bits 2, block size 16."),
                     (dict(method="rtn", stages="", bits="default"), "")):
        job, status = client.predict(*form(frames=4, **kw), api_name="/job")
        assert job != "refused" and status == said, (kw, status)
        client.predict(api_name="/cancel")


def test_queue_positions_one_job_at_a_time_and_cancel(url):
    """A second user waits in the queue and sees a position while the first runs; Cancel stops the first between
    chunks (its video so far is kept) and the second then runs."""
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    ja = a.submit(*form(frames=301), api_name="/generate")
    _until(lambda: any("chunk 1 of" in o[0] for o in ja.outputs()), what="a's first chunk")
    t0 = time.time()
    job, said = b.predict(*form(frames=4), api_name="/job")  # (the Generate click's unqueued step)
    assert said == "Queued: another video is being generated; this one starts when it ends.", said
    jb = b.submit(*form(frames=4), job, api_name="/generate")
    seen = None
    while seen is None and time.time() - t0 < 60:
        st = jb.status()
        if st.code.name == "IN_QUEUE" and st.rank is not None:
            seen = st
        time.sleep(0.1)
    assert seen is not None and seen.rank == 0 and seen.queue_size >= 1, seen
    assert not jb.outputs()  # not started: one generation at a time
    assert "Cancelling" in a.predict(api_name="/cancel")
    outs = _wait(ja, what="a (cancelled)")
    assert "cancelled after" in outs[-1][STATUS] and "of 100 chunks" in outs[-1][STATUS]
    import imageio.v3 as iio
    n = iio.imread(outs[-1][VIDEO]).shape[0]
    assert 4 <= n < 301 and (n - 1) % 3 == 0
    rep = json.loads(open(outs[-1][REPORTS][0]).read())  # what was generated, and that it was cancelled
    done = rep["cancelled"]["after_chunks"]
    assert rep["cancelled"]["of_chunks"] == 100 and rep["frames"] == n == 1 + 3 * done == 1 + rep["latent_frames"]
    assert _wait(jb, what="b (queued behind a)")[-1][STATUS].startswith("**done: 1 chunk in")
    assert a.predict(api_name="/cancel") == "Nothing is running."


def _status(outs):
    return [o[0] for o in outs]


def test_cancel_is_per_job(url):
    """Cancel reaches the session's jobs that exist when it is pressed: two queued jobs of one session never run, its
    Generate after the Cancel runs; another session's running and queued jobs go on; a running job stops after a
    chunk (video so far kept) and its session's next Generate runs in full."""
    a, b, c = (Client(url, verbose=False) for _ in range(3))
    ja = submit(a, frames=301)
    _until(lambda: any("chunk 1 of" in s for s in _status(ja.outputs())), what="a's first chunk")
    queued = [submit(b, frames=4), submit(b, frames=4), submit(c, frames=4)]
    for rank, j in enumerate(queued):  # in line behind a, each sees its position
        _until(lambda: j.status().code.name == "IN_QUEUE" and j.status().rank == rank, 60, f"rank {rank}")
    jb1, jb2, jc = queued
    assert b.predict(api_name="/cancel") == "**Cancelled**: your 2 queued jobs will not run."
    jb3 = submit(b, frames=4)  # b's Generate after its Cancel
    n = len(ja.outputs())
    _until(lambda: len(ja.outputs()) > n, what="a goes on after b's cancel")
    assert not ja.done()
    assert a.predict(api_name="/cancel") == "**Cancelling**: the video stops after the current chunk."
    outs = _wait(ja, what="a (cancelled)")
    assert "cancelled after" in outs[-1][STATUS] and "of 100 chunks" in outs[-1][STATUS]
    import imageio.v3 as iio
    assert 4 <= iio.imread(outs[-1][VIDEO]).shape[0] < 301
    for j in (jb1, jb2):  # ended at their turn without loading or generating anything, nor changing the page
        outs = _wait(j)
        assert len(outs) == 1 and all(v == {"__type__": "update"} for v in outs[0]), outs
    for j in (jc, jb3, submit(a, frames=4)):
        assert _wait(j)[-1][STATUS].startswith("**done: 1 chunk in")
    assert {x.predict(api_name="/cancel") for x in (a, b, c)} == {"Nothing is running."}


def test_jobs_unit():
    jobs = Jobs()
    j1, j2, k = jobs.submit("s"), jobs.submit("s"), jobs.submit("t")
    run = jobs.start(j1.id, "s")
    assert run is j1 and jobs.running("s") is j1 and jobs.running("t") is None
    assert jobs.cancel("s") == (1, 1) and j1.cancel.is_set() and j2.cancel.is_set() and not k.cancel.is_set()
    assert jobs.start(k.id, "s") is not k  # another session's id: a new job of this one
    later = jobs.submit("s")
    assert not later.cancel.is_set()  # submitted after the Cancel
    assert jobs.start(None, "u").running and jobs.start(j1.id, "s") is not j1  # no id / an id in use: new jobs
    jobs.finish(j1)
    jobs.drop("t")
    assert k.cancel.is_set() and jobs.start(k.id, "t") is not k  # a closed page's queued job is forgotten
    assert cancel_message(0, 0) == "Nothing is running." and "2 queued jobs" in cancel_message(0, 2)
    assert cancel_message(1, 1).startswith("**Cancelling**") and "queued job will not run" in cancel_message(1, 1)
    # a job whose run never began (gradio refused its input) is stale once a later job of its session starts:
    # Cancel no longer counts it as queued (it counted every such job for the page's life), but still reaches it
    # if it does start after all (two clicks queued in the other order)
    lost, nxt, _ = jobs.submit("v"), jobs.submit("v"), jobs.submit("w")
    jobs.start(nxt.id, "v")
    assert jobs.cancel("v") == (1, 0) and jobs.cancel("w") == (0, 1)
    assert jobs.start(lost.id, "v") is lost and lost.cancel.is_set()
    # a second Cancel does not count the queued jobs the first one reached again (API clients whose /job calls
    # were never followed by /generate heard "your 3 queued jobs will not run" at every Cancel)
    q = [jobs.submit("x") for _ in range(3)]
    assert jobs.cancel("x") == (0, 3) and jobs.cancel("x") == (0, 0)
    assert all(jobs.start(j.id, "x") is j and j.cancel.is_set() for j in q)  # (their runs still end at once)


def test_keys_build_the_action_list_and_steer_a_running_video(client):
    assert client.predict("right*2", api_name="/press_right")[0] == "right*3"
    assert client.predict("right*2", api_name="/press_zoom_in")[0] == "right*2,zoom_in"
    assert client.predict(api_name="/clear_actions") == ""  # (then the keys build a list from nothing)
    assert client.predict("", api_name="/press_left")[0] == "left"
    job = client.submit(*form(actions="stay", frames=13), api_name="/generate")
    _until(lambda: any("chunk 1 of" in o[0] for o in job.outputs()), what="the first chunk")
    text, note = client.predict("stay", api_name="/press_up")
    assert "steering: **up**" in note
    last = _wait(job)[-1]
    assert last[STEER] == "", last[STEER]  # (the run's end clears the steering note: it stayed)
    acts = [r[1] for r in last[TABLE]["data"]]
    assert acts[0] == "stay" and acts[-1] == "up" and acts == sorted(acts, key=lambda a: a == "up"), acts


def test_keys_say_a_self_forcing_run_takes_no_steering(client, sf_checkpoint):
    """A key pressed while a Self-Forcing video runs (text to video) says it takes no camera actions (it said
    'steering: **up** from the next chunk', which that pipeline ignores)."""
    job = client.submit(*form(pipeline="self-forcing", checkpoint="sf", prompt="a fox", frames=13),
                        api_name="/generate")
    _until(lambda: any("chunk 1 of" in o[0] for o in job.outputs()), what="the first chunk")
    text, note = client.predict("stay", api_name="/press_up")
    assert "takes no camera actions" in note and text == "stay,up"  # (the list is the next run's)
    assert _wait(job)[-1][STATUS].startswith("**done:")


def test_uploaded_start_image(client, tmp_path):
    import imageio.v3 as iio
    import numpy as np
    img = np.zeros((80, 80, 3), np.uint8)
    img[:, :40] = (220, 20, 20)
    iio.imwrite(tmp_path / "red-left.png", img)
    outs = _wait(client.submit(*form(upload=handle_file(str(tmp_path / "red-left.png")), frames=4, method="bf16"),
                               api_name="/generate"))
    first = iio.imread(outs[-1][VIDEO])[0].astype(float)
    assert abs(first[32, 8] - (220, 20, 20)).max() < 40 and first[32, 56].max() < 40


def test_an_upload_that_is_no_image_is_the_apps_message(client, tmp_path):
    """A file PIL cannot open, uploaded as the start image, reaches the app's own check (its message in the status
    line), not gradio's preprocessing (a traceback in the log and a bare 'Error' on the page)."""
    (tmp_path / "bad.png").write_text("not an image")
    outs = _wait(client.submit(*form(upload=handle_file(str(tmp_path / "bad.png")), frames=4, method="bf16"),
                               api_name="/generate"))
    text = outs[-1][STATUS]  # (in the page's words: the upload's name, not the server's path to its copy)
    assert text.startswith("**Error:** start image: the upload 'bad.png' is not a readable image (") and \
        "/tmp" not in text and "gradio" not in text, text
    (tmp_path / "clip.mp4").write_text("not an image either")  # (never handed to imageio's readers)
    from gradio_client.exceptions import AppError
    with pytest.raises(AppError, match="'clip.mp4' is not an image file"):
        client.predict(*form(upload=handle_file(str(tmp_path / "clip.mp4")), frames=4, method="bf16"),
                       api_name="/generate")


def test_pipeline_choice_sets_length_and_live_image(client):
    """Self-Forcing: qvg-generate's default length (49 frames) and no start frame in the live image; back to the
    world model: 31 frames and the bundled photo's start frame."""
    from PIL import Image
    *_, frames, live = client.predict("self-forcing", "astronaut", api_name="/pipeline_defaults")
    assert frames == 49 and live is None
    *_, frames, live = client.predict("tiny", "astronaut", api_name="/pipeline_defaults")
    assert frames == 31 and Image.open(live).size == (256, 256)


def test_empty_table_has_the_runs_headers(url):
    """Before any run the per-chunk table shows its real headers (not gradio's 1 2 3)."""
    import urllib.request
    cfg = json.loads(urllib.request.urlopen(f"{url}config", timeout=10).read())
    table = next(c for c in cfg["components"] if c.get("props", {}).get("elem_id") == "qvg-table")
    head = table["props"]["value"]["headers"]
    assert head[:4] == ["chunk", "action", "frames", "UI s"] and "qvg codes KiB" in head and "qvg s" in head
    assert table["props"]["value"]["data"] == []


def test_panel_unit():
    """The panel without gradio: the table's columns, the plots' data (bars labelled up to BAR_LABELS chunks, then a
    number axis), the UI's seconds once known, and an error as one escaped line."""
    from qvg.app.ui import error_status
    from qvg.app.ui_panel import BAR_LABELS, plots, summary, table
    from qvg.app.ui_run import Row, Update
    mem = {c: 0 for c in ("codes", "scales", "ids", "centroids", "bf16_sink", "bf16_pending", "bf16_residual",
                          "workspace")}
    up = Update("", ["rtn"], total_chunks=40)
    for i in range(BAR_LABELS + 1):
        m = {**mem, "codes": 1024 * (i + 1), "bf16_current": 2048, "total": 1024 * (i + 3),
             "bf16_equivalent": 8192 * (i + 1), "compression_ratio": 8 * (i + 1) / (i + 3)}
        up.rows.append(Row(i, "left", 3, {"rtn": 0.5}, {"rtn": m}, ui_seconds=0.01 if i < BAR_LABELS else None))
        data, unit = plots(up)
        assert data["components"]["chunk"].map(type).eq(str if i < BAR_LABELS else int).all()
    assert unit == "KiB" and set(data["components"]["component"]) == {"codes", "bf16_current"}
    assert len(data["latency"]) == 2 * BAR_LABELS + 1 and "psnr" not in data
    head, rows = table(up)
    assert head[:4] == ["chunk", "action", "frames", "UI s"] and rows[-1][3] is None and rows[0][3] == 0.01
    assert "UI** between chunks" in summary(up) and "0.010 s last" in summary(up)
    short = Update("", ["rtn"], total_chunks=3, rows=up.rows[:1])  # a short video: its chunks as labels, all shown
    kv = plots(short)[0]["kv"]
    assert list(kv["chunk"]) == ["1", "1", "2", "2", "3", "3"] and kv["size"].isna().sum() == 4
    from qvg.app.ui_panel import one_point
    assert one_point(kv, "size", "series") and not one_point(data["kv"], "size", "series")
    assert error_status("block_size <b>\n x") == "**Error:** block\\_size \\<b\\> x"
    from qvg.app.ui_panel import y_top
    assert y_top(data["ratio"], "ratio") > data["ratio"]["ratio"].max() and y_top(kv.iloc[:0], "size") is None


def test_panel_psnr_of_identical_chunks():
    """Comparing, a chunk equal to bf16's (PSNR at the metric's cap, e.g. while the sink holds it) is said to be
    identical and left out of the mean and the plot (it read as '51.30 dB mean' beside chunks of 32-39 dB)."""
    from qvg.app.ui_panel import plots, summary
    from qvg.app.ui_run import Row, Update
    m = {"codes": 10, "total": 10, "bf16_equivalent": 40, "compression_ratio": 4.0}
    up = Update("", ["bf16", "qvg"], total_chunks=3)
    for i, p in enumerate((100.0, 38.0, 34.0)):
        up.rows.append(Row(i, "left", 3, {"bf16": 0.5, "qvg": 0.5}, {"bf16": m, "qvg": m}, psnr=p))
        line = summary(up).splitlines()[-1]
        if i == 0:
            assert "identical to bf16 this chunk, no chunk differs yet" in line, line
    assert "34.00 dB this chunk, 36.00 dB mean over the 2 chunks that differ (1 identical, left out)" in line, line
    ps = plots(up)[0]["psnr"]["PSNR dB"]
    assert ps.isna().iloc[0] and list(ps.iloc[1:]) == [38.0, 34.0]


def test_no_file_outside_gradio_cache_is_served(url):
    import urllib.error
    import urllib.request
    import qvg
    for path in ("/etc/passwd", qvg.__file__):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}gradio_api/file={path}", timeout=10)
        assert e.value.code in (403, 404)


def test_path_rules_unit(tmp_path):
    (tmp_path / "root" / "ck").mkdir(parents=True)
    root = tmp_path / "root"
    assert checkpoint_dir("ck", root) == str((root / "ck").resolve())
    assert checkpoint_dir(str(root / "ck"), root) == str((root / "ck").resolve())
    for bad, msg in (("..", "outside"), ("", "give a directory"), ("ck/../..", "outside")):
        with pytest.raises(UsageError, match=msg):
            checkpoint_dir(bad, root)
    with pytest.raises(UsageError, match="embedded model only"):
        checkpoint_dir("ck", None)
    (tmp_path / "up").mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    with pytest.raises(UsageError, match="only uploaded files"):
        settings(Form(upload=str(tmp_path / "secret.png")), Server(None, tmp_path / "up"), tmp_path)
    with pytest.raises(UsageError, match="no bundled photo"):
        settings(Form(photo="../../etc/passwd"), Server(None, tmp_path / "up"), tmp_path)
    # an upload too small, or no image, in the page's words (the small one named the server's copy by its path;
    # the other gave imageio's raw "Could not find a backend")
    import numpy as np
    from PIL import Image
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "up" / "small.png")
    (tmp_path / "up" / "fake.png").write_text("not an image")
    for name, msg in (("small.png", "start image: the upload 'small.png' is 8 x 8 pixels; give one at least 16"),
                      ("fake.png", "start image: the upload 'fake.png' is not a readable image (not an image format "
                                   "imageio reads)")):
        with pytest.raises(UsageError) as e:
            settings(Form(upload=str(tmp_path / "up" / name)), Server(None, tmp_path / "up"), tmp_path)
        assert str(e.value).startswith(msg) and str(tmp_path) not in str(e.value), str(e.value)
    assert append_action("", "left") == "left" and append_action("left", "left") == "left*2"
    assert append_action("right*\u0663", "right") == "right*\u0663,right"  # (not read as right*3: left as typed)


def test_whole_numbers_are_read_exactly(tmp_path):
    """Seeds past 2**53 are kept exactly (they went through float: 2**53 + 1 ran as 2**53, 2**63 - 1 was refused
    as 2**63), a huge one is one message (it was an OverflowError), and a missing prompt is the default one."""
    from qvg.app.generate import DEFAULT_PROMPT
    srv = Server(None, None)
    for seed, want in ((2 ** 53 + 1, 2 ** 53 + 1), (2 ** 63 - 1, 2 ** 63 - 1), ("9007199254740993", 2 ** 53 + 1),
                       ("9007199254740993.0", 2 ** 53 + 1), ("9.007199254740993e15", 2 ** 53 + 1)):  # (text: exactly)
        assert settings(Form(seed=seed), srv, tmp_path)[0]["seed"] == want, seed
    for seed, msg in ((10 ** 400, "seed must be in [0, "), (1e400, "seed must be a "), ("1.5", "whole number"),
                      ("--5", "seed must be a number"), ("+-5", "seed must be a number"),
                      ("1e400", "seed must be in [0, "), ("1e5000", "seed is too large, got 1e5000"),
                      ("nan", "seed must be a number"), ("0x10", "seed must be a number"),
                      ("\u0663", "seed must be a number"), ("1_000", "seed must be a number")):
        with pytest.raises(UsageError, match=re.escape(msg)):
            settings(Form(seed=seed), srv, tmp_path)
    root = tmp_path / "root"
    (root / "ck").mkdir(parents=True)
    sf = settings(Form(pipeline="self-forcing", checkpoint="ck", prompt=None), Server(root, None), tmp_path)[0]
    assert sf["prompt"] == DEFAULT_PROMPT  # (None was an AttributeError)


def test_the_pages_seed_is_text_so_big_seeds_stay_exact(client):
    """The page's seed field is text: a browser's number field holds a double, so 2**53 + 1 typed there was sent
    as 2**53. The text reaches the run's report exactly."""
    import gradio as gr
    seed = [c for c in SERVER["app"].blocks.values() if getattr(c, "elem_id", None) == "qvg-seed"]
    assert len(seed) == 1 and isinstance(seed[0], gr.Textbox) and seed[0].value == "0"
    last = _wait(client.submit(*form(seed=" 9007199254740993 ", frames=4), api_name="/generate"))[-1]
    assert last[STATUS].startswith("**done"), last[STATUS]
    assert json.loads(open(last[REPORTS][0]).read())["seed"] == 2 ** 53 + 1


def test_cli_binds_localhost_by_default(monkeypatch, tmp_path, capsys):
    import qvg.app.ui as ui
    seen = {}
    monkeypatch.setattr(ui, "serve", lambda app, host, port: seen.update(host=host, port=port))
    assert ui.main([]) == 0 and seen == {"host": "127.0.0.1", "port": None}
    assert ui.main(["--host", "0.0.0.0", "--port", "9999"]) == 0 and seen == {"host": "0.0.0.0", "port": 9999}
    assert ui.main(["--checkpoint-root", str(tmp_path / "nope")]) == 2
    assert ui.main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("qvg-app: error:") for e in err)
    # bad flags, ports and hosts: one line each too (were a usage dump, a traceback, or a server retrying forever)
    def no_such_host(host, *a, **kw):
        if host == "no-such-host":
            raise socket.gaierror(-2, "Name or service not known")
        ip = "192.0.2.1" if host == "elsewhere" else "127.0.0.1"  # (192.0.2.1: TEST-NET-1, no address of this host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0))]
    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    for args, msg in ((["--nope"], "unrecognized arguments: --nope"), (["--port", "0"], "must be in [1, 65535], got 0"),
                      (["--port", "99999"], "got 99999"), (["--port", "x"], "must be an integer, got 'x'"),
                      (["--host", "no-such-host"], "--host: cannot resolve 'no-such-host' (Name or service not known)"),
                      (["--host", "elsewhere"], "--host: cannot bind 'elsewhere' at 192.0.2.1 (Cannot assign requested "
                                                "address)"),
                      (["--checkpoint-root", __file__], "--checkpoint-root: not a directory")):
        assert ui.main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qvg-app: error:") and msg in err[0], (args, err)

    for empty in ("", " "):  # (gradio would take "" for its default address, or $GRADIO_SERVER_NAME's)
        assert ui.main(["--host", empty]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qvg-app: error: --host: empty: give an address"), err
    e = ui._host_error("[::1]")  # (gradio's bracketed form: resolved as ::1, here through the fake resolver)
    assert e is None or "cannot bind '[::1]'" in e


def test_cli_port_in_use_is_one_line(capsys):
    """A --port another process listens on: the error is one line naming the port, the last on stderr (gradio's own
    message advises its Python API; the server's INFO log lines come before it)."""
    import qvg.app.ui as ui
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert ui.main(["--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"qvg-app: error: cannot serve on 127.0.0.1: port {port} is in use or cannot be bound here; " \
                      "give another --port", err
    assert [e for e in err[:-1] if not e.startswith("INFO:")] == [], err  # (no traceback, no other message)


def test_sigterm_stops_the_server_in_one_line_and_removes_the_job_folder(tmp_path):
    """kill / docker stop / systemd send SIGTERM: the server closes, its last job's temp folder goes (it was left
    behind: only Ctrl-C cleaned up), one line, status 143. A job's folder is made by hand here (Workdirs' prefix in
    the server's TMPDIR): no job needs to run."""
    import signal
    import subprocess
    import sys
    code = ("import sys, tempfile\nfrom qvg.app import ui, ui_run\n"
            "real = ui_run.Workdirs.__init__\n"
            "def made(self):\n    real(self)\n    self.new()\n    print('workdir', self.current, flush=True)\n"
            "ui_run.Workdirs.__init__ = made\n"
            "sys.exit(ui.main(sys.argv[1:]))\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code, "--port", str(_free_port()), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        lines = []
        while not any("serving on" in x for x in lines):
            line = proc.stdout.readline()
            assert line, f"qvg-app stopped: {proc.stderr.read()[-2000:]}"
            lines.append(line)
        assert list(tmp.glob("qvg-app-*")), lines
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "qvg-app: terminated", err[-2000:]
    assert not list(tmp.glob("qvg-app-*"))


def test_gradio_stays_out_of_the_library_and_the_cli():
    import subprocess
    import sys
    code = "import sys, qvg, qvg.app.generate, qvg.app.ui_run, qvg.app.ui_panel; print('gradio' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_the_ui_keeps_torchvision_out():
    """gradio must not pull torchvision in (it cannot be imported with the CPU torch here)."""
    import subprocess
    import sys
    code = "import sys, qvg.app.ui; print('torchvision' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_live_preview_is_bounded_at_self_forcing_size(tmp_path):
    """A Self-Forcing chunk (12 frames of 480 x 832) is previewed at 240 x 416, box-averaged, at zlib level 1: at
    least 3x less encode time than the full-size level-6 APNG (eval/results/ui-preview-encode-cpu.json: 1.2 s -> 0.1 s
    on 2 CPU cores; an H100 chunk takes 0.56-1.1 s)."""
    import numpy as np
    from PIL import Image, ImageSequence

    from qvg.app.ui_panel import DISPLAY, MAX_SIDE
    from qvg.eval.bench_ui_preview import after, before, pan_frames
    frames = pan_frames()
    assert frames.shape == (12, 480, 832, 3)
    secs = {}
    for name, encode in (("before", before), ("after", after)):
        path = tmp_path / f"{name}.png"
        secs[name] = min(_timed(encode, frames, path) for _ in range(2))
    img = Image.open(tmp_path / "after.png")
    assert img.size == (416, 240) and img.n_frames == 12 and max(img.size) <= MAX_SIDE and min(img.size) <= DISPLAY
    assert (tmp_path / "after.png").stat().st_size < 0.5 * (tmp_path / "before.png").stat().st_size
    first = np.asarray(next(ImageSequence.Iterator(img)).convert("RGB")).astype(float)
    box = frames[0].reshape(240, 2, 416, 2, 3).mean((1, 3))
    assert abs(first - box).max() <= 1  # the same picture, averaged 2 x 2
    assert secs["after"] < secs["before"] / 3, secs


def _timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def test_hang_report_shows_the_queue_children_and_threads(url):
    """What a timed-out wait prints: the queue's counts, the child processes and the busy threads (here a sleeping
    child, and a thread waiting for it inside subprocess, as a run waits for its ffmpeg writer)."""
    import subprocess
    import sys
    import threading
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    t = threading.Thread(target=child.wait, name="qvg-test-thread")
    t.start()
    time.sleep(0.2)
    try:
        text = hang_report(SERVER["app"])
    finally:
        child.kill()
        t.join()
    assert text.startswith("queue: stopped=False active_jobs=0 ["), text
    assert "AnyIO worker thread" not in text, text  # idle workers are left out
    assert f"child {child.pid} state=" in text and "time.sleep(30)" in text, text
    assert "thread qvg-test-thread:" in text and "subprocess.py" in text and " wait:" in text, text
    assert hang_report(None).startswith("queue: none")

    class Job:  # a timed-out wait names the job's status lines so far, then the report
        def outputs(self):
            return [("**chunk 1 of 2**", None)]
    with pytest.raises(pytest.fail.Exception, match=r"b did not finish: not within 1 s; its status lines so far: "
                                                    r"\['\*\*chunk 1 of 2\*\*'\]; the server:\nqueue: "):
        _timed_out("b did not finish", 1, Job())


def test_ui_message_replaces_whole_flags_only():
    from qvg.app.ui_run import checkpoint_dir, ui_message
    from qvg.app.generate import UsageError
    with pytest.raises(UsageError) as e:
        checkpoint_dir("x", None)
    msg = ui_message(e.value)
    assert "qvg-app --checkpoint-root DIR" in msg and "`" not in msg
    assert ui_message(UsageError("--seed must be in [0, 9], got -5")) == "seed must be in [0, 9], got -5"


def test_start_preview_shows_an_uploads_start_frame(tmp_path):
    """An uploaded image's preview is the start frame the model will get (its centre view at the bundled photos'
    scale), not the bundled photo's; a file that is not an image gives none."""
    import imageio.v3 as iio
    import numpy as np

    from qvg.app.ui import start_preview
    img = np.zeros((90, 160, 3), np.uint8)
    img[:, :80] = (250, 0, 0)
    img[:, 80:] = (0, 0, 250)
    iio.imwrite(tmp_path / "up.png", img)
    a, b = start_preview("astronaut"), start_preview("astronaut", str(tmp_path / "up.png"))
    assert a.shape == b.shape and not np.array_equal(a, b)
    assert b[..., 0].max() > 200 and b[..., 2].max() > 200 and b[..., 1].max() < 60  # the red / blue boundary
    (tmp_path / "x.png").write_text("not an image")
    assert start_preview("astronaut", str(tmp_path / "x.png")) is None


def test_download_names_differ_with_every_setting(tmp_path):
    """A download's name ends in a digest of what makes the video: runs that differ only in block size, window,
    sink, length, actions or start image get different names (they collided), the same settings the same name."""
    from qvg.app.ui_run import Form, Server, file_stem, settings
    from qvg.pipelines.world_data import photo_names

    def stem(**kw):
        return file_stem(settings(Form(**kw), Server(), tmp_path)[-1])
    base = stem(method="kivi")
    assert re.fullmatch(r"kivi-astronaut-seed0-[0-9a-f]{6}", base) and stem(method="kivi") == base
    other = next(p for p in photo_names("all") if p != "astronaut")
    variants = [dict(block_size="16"), dict(history="window", window=6), dict(sink=3), dict(frames=13),
                dict(actions="left"), dict(photo=other), dict(seed="1")]
    stems = [stem(method="kivi", **kw) for kw in variants]
    assert len({base, *stems}) == len(variants) + 1, stems


def test_a_sink_covering_the_video_is_said(client):
    """Nothing compressed (the sink holds the whole video in BF16): the done line says so, as qvg-generate's note
    does (a ratio of 1x read like a bug)."""
    last = _wait(client.submit(*form(frames=4, sink=6), api_name="/generate"))[-1]
    assert last[STATUS].startswith("**done: 1 chunk in") and "qvg compressed nothing" in last[STATUS], last[STATUS]
    last = _wait(client.submit(*form(frames=7, sink=3), api_name="/generate"))[-1]
    assert "compressed nothing" not in last[STATUS], last[STATUS]


def test_an_unexpected_error_is_one_short_line(client, monkeypatch):
    """An exception that is no usage error (a library's, with its advice after the first sentence) is one line,
    both from the click's unqueued check and from the queued run: `first_line`'s `Type: first sentence`."""
    import qvg.app.ui as ui

    def boom(*a, **k):
        raise RuntimeError("the disk went away. Please report this to the library's authors.\nsecond line")
    monkeypatch.setattr(ui, "settings", boom)
    want = "**Error:** RuntimeError: the disk went away."
    job, status = client.predict(*form(), api_name="/job")
    assert re.sub(r"\\(.)", r"\1", status) == want, status
    outs = _wait(client.submit(*form(), "any-job", api_name="/generate"))
    assert re.sub(r"\\(.)", r"\1", outs[-1][STATUS]) == want, outs[-1][STATUS]


def test_building_the_page_writes_nothing_beside_the_package(url):
    """The page (built by the `url` fixture) leaves no file in the package: a subclass of a gradio component makes
    gradio write a .pyi stub beside its module (the length slider's range check is set on its instance instead)."""
    import qvg.app.ui as ui
    assert not Path(ui.__file__).with_suffix(".pyi").exists()
