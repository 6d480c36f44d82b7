"""qvg-generate: the mp4 + JSON it writes, and bad input (one error line, exit 2, nothing left behind)."""
import json
import os
import warnings

import pytest

from optional_deps import need
from qvg.app.generate import main

KEYS = {"method", "options", "frames", "seconds", "kv_bytes", "bf16_equivalent_bytes", "compression_ratio", "device",
        "commit"}


@pytest.mark.parametrize("method", ["qvg", "bf16"])
def test_writes_mp4_and_report(tmp_path, method, capsys):
    out = tmp_path / "v.mp4"
    assert main(["--frames", "13", "--method", method, "--out", str(out), "--quiet"]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert KEYS <= set(rep) and rep["frames"] == 13 and rep["method"] == method
    assert rep["load_seconds"] > 0 and rep["seconds"] >= sum(c["seconds"] for c in rep["chunks"])
    assert set(rep["kv_bytes"]) == {"codes", "scales", "ids", "centroids", "positions", "bf16", "workspace",
                                 "total"}
    assert rep["kv_bytes"]["total"] == sum(v for k, v in rep["kv_bytes"].items() if k != "total")
    assert sum(rep["bf16_zones"].values()) == rep["kv_bytes"]["bf16"]
    assert rep["image"].startswith("bundled photo 'astronaut'") and len(rep["actions"]) == 4
    # per chunk: its frames, seconds and the cache right after it; the last (full history) is the cache's largest
    chunks = rep["chunks"]
    assert [c["chunk"] for c in chunks] == [1, 2, 3, 4] and sum(c["frames"] for c in chunks) == 12
    assert [c["action"] for c in chunks] == rep["actions"] and all(c["seconds"] > 0 for c in chunks)
    assert chunks[-1]["kv_bytes"] == rep["kv_bytes"]["total"]
    assert chunks[-1]["bf16_equivalent_bytes"] == rep["bf16_equivalent_bytes"]
    assert [c["kv_bytes"] for c in chunks] == sorted(c["kv_bytes"] for c in chunks)
    import imageio.v3 as iio
    frames = iio.imread(out)
    assert frames.shape == (13, 64, 64, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.json", "v.mp4"]
    # the reads that ran, as the cache counted them (one per layer and forward that read a compressed history): the
    # torch path on CPU (whatever --read says); on a GPU the window read, the panning camera's spatial offsets
    # included (the kernels' RoPE tables hold them); bf16 reads no compressed history, and its report names the path
    # it would take
    on_gpu = not rep["device"].startswith("cpu")
    from qvg.app.generate import _reads_label
    reads = rep["reads"]
    if method == "bf16":
        assert reads == {} and rep["read"] == "reference"
    else:
        assert sum(reads.values()) > 0 and set(reads) == ({"window"} if on_gpu else {"reference"})
        assert rep["read"] == _reads_label(reads)
    if method == "bf16":
        assert rep["compression_ratio"] == 1.0 and rep["options"] == {}
        assert rep["key_storage"] == "post-rope" and rep["kv_bytes"]["positions"] == 0
    else:
        assert {"bits", "block_size", "stages", "centroids"} <= set(rep["options"])
        # keys packed before RoPE by default: each packed chunk keeps its frames' (t, dy, dx) in each layer (5 packed
        # chunks of 3 frames, int32)
        assert rep["key_storage"] == "pre-rope" and rep["kv_bytes"]["positions"] == 6 * 5 * 3 * 3 * 4


def test_output_through_symlinks(tmp_path):
    """An --out (and its JSON) that are symlinks are written through: the files they name are replaced."""
    (tmp_path / "store").mkdir()
    for name in ("v.mp4", "v.json"):
        (tmp_path / "store" / name).write_text("old")
        (tmp_path / name).symlink_to(tmp_path / "store" / name)
    assert main(["--frames", "4", "--method", "bf16", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 0
    assert (tmp_path / "v.mp4").is_symlink() and (tmp_path / "v.json").is_symlink()
    assert json.loads((tmp_path / "store" / "v.json").read_text())["frames"] == 4
    assert (tmp_path / "store" / "v.mp4").read_bytes()[4:8] == b"ftyp"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["v.json", "v.mp4"]


@pytest.mark.parametrize("case", ["json-link-to-missing-folder", "json-link-elsewhere", "loop"])
def test_symlinked_outputs_checked_where_they_point(tmp_path, capsys, case):
    """A JSON link into a missing folder, or a symlink loop, is refused before any work (exit 2, the old video kept);
    a JSON link into another folder gets its temporary file there (no cross-folder rename)."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "v.mp4").write_text("old")
    (tmp_path / "v.mp4").symlink_to(tmp_path / "store" / "v.mp4")
    if case == "loop":
        (tmp_path / "v.json").symlink_to(tmp_path / "w.json")
        (tmp_path / "w.json").symlink_to(tmp_path / "v.json")
    else:
        where = tmp_path / ("gone" if case == "json-link-to-missing-folder" else "other")
        if case == "json-link-elsewhere":
            where.mkdir()
        (tmp_path / "v.json").symlink_to(where / "v.json")
    code = main(["--frames", "4", "--method", "bf16", "--out", str(tmp_path / "v.mp4"), "--quiet"])
    if case == "json-link-elsewhere":
        assert code == 0 and json.loads((tmp_path / "other" / "v.json").read_text())["frames"] == 4
        assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["v.json"]
        return
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("qvg-generate: error: --out: "), err
    assert ("no such directory" if case == "json-link-to-missing-folder" else "loop") in err.lower(), err
    assert (tmp_path / "store" / "v.mp4").read_text() == "old"


def test_bf16_with_a_window_is_still_1x(tmp_path):
    out = tmp_path / "w.mp4"
    assert main(["--method", "bf16", "--history", "window:3", "--frames", "29", "--out", str(out), "--quiet"]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["compression_ratio"] == 1.0


@pytest.mark.parametrize("history", [["--history", "window:3", "--sink", "3"], ["--history", "window:6"]])
def test_window_report_compares_with_what_the_bf16_run_holds(tmp_path, history):
    """The report's BF16 equivalent is what the BF16 run of the same settings holds (a QVG window run whose cache
    held fewer bytes reported itself larger: its equivalent was taken before the window wrapped). On the CPU: on
    CUDA the BF16 cache's buffers are rounded up to 2 MiB blocks, which its own total counts (24 MiB here for
    13.5 MiB of tokens) and a compressed cache's equivalent does not (KVCache.memory)."""
    reps = {}
    for method in ("bf16", "qvg"):
        out = tmp_path / f"{method}.mp4"
        assert main(["--method", method, *history, "--frames", "28", "--out", str(out), "--quiet",
                     "--device", "cpu"]) == 0
        reps[method] = json.loads(out.with_suffix(".json").read_text())
    bf, q = reps["bf16"], reps["qvg"]
    assert q["bf16_equivalent_bytes"] == bf["kv_bytes"]["total"] == bf["bf16_equivalent_bytes"]
    assert q["kv_bytes"]["total"] < bf["kv_bytes"]["total"] and q["compression_ratio"] > 1


BAD = [
    (["--bits", "3"], "--bits must be 2, 4 or 8"),
    (["--read", "flash"], "--read must be one of window, staged, fused, got 'flash'"),
    (["--read", "staged", "--method", "kivi"], "--read staged: method 'kivi' supports read='window' only"),
    (["--read", "fused", "--method", "bf16"], "--read fused: method 'bf16' supports read='window' only"),
    (["--read", "staged", "--method", "quarot"], "--read staged: method 'quarot' supports read='window' only"),
    (["--key-storage", "pre"], "--key-storage must be auto, post-rope or pre-rope"),
    (["--method", "kivi", "--key-storage", "pre-rope"], "--key-storage pre-rope is for rtn, qvg, qvg-pro"),
    (["--frames", "0"], "--frames must be in [2, 100000], got 0"),
    (["--frames", "100001"], "--frames must be in [2, 100000], got 100001"),
    (["--pipeline", "self-forcing", "--checkpoint", ".", "--frames", "0"], "--frames must be in [1, 100000], got 0"),
    (["--frames", "1", "--prompt", "a fox"], "not text-conditioned"),  # (the flags' applicability first)
    (["--frames", "x"], "--frames must be an integer"),
    # other scripts' digits and underscores are not taken as numbers (int() reads '٣' as 3)
    (["--stages", "\u0661"], "--stages must be an integer, got '\u0661'"),
    (["--frames", "1_000"], "--frames must be an integer, got '1_000'"),
    (["--history", "window:\u0663"], "--history window:N must be an integer"),
    (["--actions", "left*\u0663"], "bad repeat count in action"),
    # (the embedded model's first frame is its start image: one frame generated a chunk only to drop it)
    (["--frames", "1"], "--frames must be in [2, 100000] for the embedded model (its frame 1 is the start image), got 1"),
    (["--method", "fp4"], "unknown method"),
    (["--pipeline", "ltx"], "unknown pipeline"),
    (["--block-size", "48"], "not divisible by block_size"),
    (["--stages", "17"], "--stages must be in"),
    (["--centroids", "0"], "--centroids must be in"),
    (["--centroids", "5000"], "centroids (5000) > tokens"),
    (["--history", "last"], "--history must be"),
    (["--sink", "2"], "multiple of the chunk size"),
    # Self-Forcing's chunk size is fixed: said before its gigabytes load (and before a broken checkpoint's error)
    (["--pipeline", "self-forcing", "--checkpoint", "/no/such/dir", "--sink", "2"],
     "--sink must be a multiple of the chunk size (3 latent frames), got 2"),
    (["--pipeline", "self-forcing", "--checkpoint", "/no/such/dir", "--history", "window:4"],
     "--history window:N must be a multiple of the chunk size (3 latent frames), got 4"),
    (["--sink", "1" + "0" * 300], "--sink must be in [0, 100000]"),  # (was taken, and written into the report)
    (["--pipeline", "self-forcing"], "needs --checkpoint"),
    (["--pipeline", "self-forcing", "--checkpoint", "/no/such/dir"], "no such directory"),
    (["--method", "bf16", "--bits", "2"], "--method bf16 stores BF16: --bits does not apply"),
    (["--method", "bf16", "--bits", "2", "--block-size", "16"], "--bits, --block-size do not apply"),
    (["--device", "tpu"], "--device"),
    (["--device", "cpu:5"], "--device must be cpu or cuda[:N], got 'cpu:5'"),
    (["--device", ""], "--device is empty"),  # (it took the default silently)
    (["--unknown-flag"], "unrecognized arguments"),
    (["--method", "kivi", "--block-size", "128"], "not divisible by block_size"),
    # flags named as flags (the message listed the method's internal options: grid, scale_dtype, ...)
    (["--method", "rtn", "--centroids", "8"], "--centroids does not apply to --method rtn (its options: --bits, "
                                              "--block-size)"),
    (["--method", "kivi", "--stages", "2", "--centroids", "8"], "--stages, --centroids do not apply to --method kivi"),
    (["--stages", "0", "--centroids", "4"], "--centroids: --stages 0 runs no k-means"),
    (["--stages", "0", "--kmeans-seed", "3"], "--kmeans-seed: --stages 0 runs no k-means"),
    (["--seed", "99999999999999999999999"], "--seed must be in"),
    (["--actions", "fly*2"], "unknown action"),
    (["--actions", "left*x"], "bad repeat count"),
    (["--actions", "left*"], "bad repeat count in action 'left*'"),
    (["--actions", "left*0"], "repeat count must be in [1, 100,000] in action 'left*0'"),
    (["--actions", "left*999999999999"], "repeat count must be in [1, 100,000]"),  # (was a MemoryError)
    (["--image", "/no/such/photo.png"], "neither a bundled photo"),
    (["--prompt", "a fox"], "not text-conditioned"),
    (["--pipeline", "self-forcing", "--checkpoint", ".", "--actions", "left"], "applies to --pipeline tiny"),
    (["--method", "bf16", "--key-storage", "pre-rope"], "--key-storage pre-rope does not apply"),
    (["--actions", ""], "--actions: empty"),
    (["--actions", " "], "--actions: empty"),
    (["--image", ""], "--image: empty"),
    (["--pipeline", "self-forcing", "--checkpoint", ".", "--prompt", " "], "--prompt: empty"),
    (["--method", "rtn", "--kmeans-seed", "1"], "--kmeans-seed is for qvg and qvg-pro"),
    (["--kmeans-seed", "-1"], "--kmeans-seed must be in"),
]


@pytest.mark.parametrize("args,msg", BAD)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, args, msg):
    out = tmp_path / "v.mp4"
    assert main(args + ["--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-generate: error:") and msg in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["v.mp4", "v.json"])
def test_output_linked_to_a_device_is_refused(tmp_path, capsys, name):
    """--out (or its JSON) a symlink to /dev/null: refused before any work, not replaced by a regular file (as root
    the rename would have removed the device)."""
    (tmp_path / name).symlink_to("/dev/null")
    assert main(["--out", str(tmp_path / "v.mp4"), "--quiet", "--frames", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a character device (through a symlink to '/dev/null'), not a regular file" in err[0]
    assert (tmp_path / name).is_symlink() and [p.name for p in tmp_path.iterdir()] == [name]
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


@pytest.mark.parametrize("case", ["missing-dir", "avi", "json-is-a-dir", "no-name"])
def test_unwritable_output(tmp_path, capsys, case):
    out = {"missing-dir": tmp_path / "missing" / "v.mp4", "avi": tmp_path / "v.avi", "no-name": tmp_path / ".mp4",
           "json-is-a-dir": tmp_path / "v.mp4"}[case]
    if case == "json-is-a-dir":
        (tmp_path / "v.json").mkdir()
    assert main(["--out", str(out), "--quiet", "--frames", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-generate: error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["v.json"] if case == "json-is-a-dir" else [])


def test_output_folder_that_refuses_files(tmp_path, capsys, monkeypatch):
    """A folder where no file can be made (root in /proc: os.access says yes, creating fails) is bad input: one
    line naming the folder and why, status 2, before anything is generated."""
    import errno
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main(["--out", str(tmp_path / "v.mp4"), "--quiet", "--frames", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    folder = str(tmp_path.resolve())
    assert err == [f"qvg-generate: error: --out: cannot create files in {folder!r} (Permission denied)"]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_leaves_nothing(tmp_path, capsys, monkeypatch):
    """SIGTERM (timeout, Slurm, docker stop) mid-run: like Ctrl-C, one line, status 143, no partial mp4 or JSON."""
    import os
    import signal

    import qvg.app.generate as g
    calls = []
    real = g.to_uint8

    def kill_on_second(video):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(video)
    monkeypatch.setattr(g, "to_uint8", kill_on_second)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["--out", str(tmp_path / "v.mp4"), "--quiet", "--frames", "7", "--method", "bf16"]) == 143
    assert capsys.readouterr().err.strip().splitlines() == ["qvg-generate: terminated; nothing written"]
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # restored


@pytest.mark.usefixtures("sigint_default")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_a_library_swallowed_is_still_one_line_and_its_status(tmp_path, capsys, monkeypatch, sig):
    """A Ctrl-C raised inside diffusers' lazy import came out as "error: RuntimeError: Failed to import ...
    maximum recursion depth exceeded", exit 1: the signal is recorded, and the run says it was stopped."""
    import signal

    import qvg.app.generate as g
    num = getattr(signal, sig)

    def swallowing_library(video):
        try:
            signal.raise_signal(num)
        except BaseException:  # (as the library did: the KeyboardInterrupt / Terminated is gone)
            pass
        raise RuntimeError("Failed to import diffusers.loaders.peft: maximum recursion depth exceeded")
    monkeypatch.setattr(g, "to_uint8", swallowing_library)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["--out", str(tmp_path / "v.mp4"), "--quiet", "--frames", "4", "--method", "bf16"]) == 128 + num
    word = "interrupted" if sig == "SIGINT" else "terminated"
    assert capsys.readouterr().err.strip().splitlines() == [f"qvg-generate: {word}; nothing written"]
    assert list(tmp_path.iterdir()) == []
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # restored


@pytest.mark.usefixtures("sigint_default")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_swallowed_signal_after_which_the_run_finished_is_still_its_status(tmp_path, capsys, monkeypatch, sig):
    """The library swallows the signal and the run goes on to write the video: the outputs stay (complete), and the
    run says it was stopped, with the signal's status, not 0 (a script's `timeout` or Ctrl-C saw the stop)."""
    import signal

    import qvg.app.generate as g
    num, real = getattr(signal, sig), g.to_uint8

    def swallowing_library(video):
        try:
            signal.raise_signal(num)
        except BaseException:
            pass
        return real(video)
    monkeypatch.setattr(g, "to_uint8", swallowing_library)
    out = tmp_path / "v.mp4"
    assert main(["--out", str(out), "--quiet", "--frames", "4", "--method", "bf16"]) == 128 + num
    word = "interrupted" if sig == "SIGINT" else "terminated"
    assert capsys.readouterr().err.strip().splitlines() == [f"qvg-generate: {word}; after writing {out}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.json", "v.mp4"]


def test_checkpoint_that_is_a_file(tmp_path, capsys):
    (tmp_path / "self_forcing_dmd.pt").write_bytes(b"x")
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(tmp_path / "self_forcing_dmd.pt"),
                 "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file; give the directory" in err[0]


def test_summary_line_words():
    from qvg.app.generate import ratio_words
    assert ratio_words(3.1) == "3.10x smaller than BF16"
    assert ratio_words(1.0) == ratio_words(0.999) == "the size of BF16"
    assert ratio_words(0.88) == "1.14x larger than BF16"


def test_help_describes_the_tool_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "write an mp4 and a JSON report" in " ".join(out.split())


def test_failure_after_the_temporary_files_exist_leaves_nothing(tmp_path, capsys, monkeypatch):
    import qvg.pipelines.self_forcing as sf

    def boom(*a, **k):
        raise RuntimeError("simulated failure mid-run")
        yield
    monkeypatch.setattr(sf.SelfForcingPipeline, "generate", boom)
    assert main(["--out", str(tmp_path / "v.mp4"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "simulated failure" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_an_error_mid_run_is_the_last_line_not_glued_to_the_bar(tmp_path, capsys, monkeypatch):
    """With the progress bar on, a failure after a chunk: the bar ends its line first, so the error is a line of its
    own and the last thing printed (the bar is not drawn again after it)."""
    import qvg.pipelines.self_forcing as sf
    real = sf.SelfForcingPipeline.generate

    def one_then_boom(self, *a, **k):
        for i, chunk in enumerate(real(self, *a, **k)):
            if i == 1:
                raise RuntimeError("simulated failure mid-run")
            yield chunk
    monkeypatch.setattr(sf.SelfForcingPipeline, "generate", one_then_boom)
    assert main(["--out", str(tmp_path / "v.mp4"), "--frames", "10"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("\n") and "chunks" in err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("qvg-generate: error: RuntimeError: simulated failure mid-run") and "\r" not in last, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_failed_json_rename_puts_the_old_video_back(tmp_path, capsys, monkeypatch, hard_links):
    """Both or neither: when the JSON's rename fails after the video's, the video that was there before is back
    (and no temporary or backup file is left); on a file system without hard links the old video is kept as a
    copy."""
    import os
    (tmp_path / "v.mp4").write_text("old video")
    real = os.replace
    if not hard_links:
        monkeypatch.setattr(os, "link", lambda a, b: (_ for _ in ()).throw(OSError(1, "Operation not permitted")))

    def replace(a, b):
        if str(b).endswith(".json"):
            raise OSError(5, "Input/output error")
        return real(a, b)
    monkeypatch.setattr(os, "replace", replace)
    assert main(["--frames", "4", "--method", "bf16", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 1
    assert "Input/output error" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"] and (tmp_path / "v.mp4").read_text() == "old video"


def test_video_and_json_that_are_one_file_are_refused(tmp_path, capsys):
    (tmp_path / "v.mp4").write_text("old")
    (tmp_path / "v.json").symlink_to(tmp_path / "v.mp4")
    assert main(["--frames", "4", "--method", "bf16", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    assert "are the same file" in capsys.readouterr().err and (tmp_path / "v.mp4").read_text() == "old"


def test_missing_mp4_backend_is_named(tmp_path, capsys, monkeypatch):
    """Without imageio-ffmpeg imageio would fall back to another plugin and fail on the first frame with that
    plugin's error: one line names the missing package instead, and nothing is left behind."""
    import sys
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # (import raises ImportError)
    assert main(["--frames", "4", "--method", "bf16", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the imageio-ffmpeg package" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_self_forcing_checkpoint_dir_without_checkpoints(tmp_path, capsys):
    """An existing but empty --checkpoint directory: one line saying what was looked for (the loader's own cases
    are in tests/pipelines/test_checkpoints.py)."""
    need("ftfy", "pip install -e '.[wan]'")  # (without it the loader asks for it first)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(ckpt), "--device", "cpu", "--out",
                 str(out / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Self-Forcing generator checkpoint" in err[0] and "self_forcing_dmd.pt" in err[0]
    assert list(out.iterdir()) == []


def test_default_centroids_keep_the_centroid_cost_low():
    from qvg.cache import default_centroids
    assert default_centroids(4680) == 64  # Self-Forcing's chunk: 16 * 64 / 4680 = 0.22 bit per element
    assert default_centroids(768) == 8  # the embedded model's chunk
    assert default_centroids(48) == 4 and default_centroids(8) == 2 and default_centroids(1) == 1  # tiny tests' units
    assert default_centroids(10 ** 6) == 256
    for n in (256, 300, 4680, 20000):
        assert 16 * default_centroids(n) / n <= 0.25
    ks = [default_centroids(n) for n in range(1, 5000)]  # no jump down (255 tokens once took 63, 256 took 4)
    assert ks == sorted(ks)


def test_start_image_from_a_file(tmp_path, monkeypatch):
    """--image FILE: its centre view, at the bundled photos' scale (world_data.photo_view), is the video's first
    frame: here the view straddles the red / blue boundary at the photo's centre."""
    import imageio.v3 as iio
    import numpy as np
    img = np.zeros((90, 120, 3), np.uint8)
    img[:, :60] = (200, 30, 30)
    img[:, 60:] = (20, 40, 220)
    iio.imwrite(tmp_path / "start.png", img)
    out = tmp_path / "v.mp4"
    monkeypatch.chdir(tmp_path)  # (given relative: the report names it absolute)
    assert main(["--image", "start.png", "--actions", "stay", "--frames", "4", "--method", "bf16",
                 "--out", str(out), "--quiet"]) == 0
    first = iio.imread(out)[0].astype(float)
    assert abs(first[32, 8] - (200, 30, 30)).max() < 40 and abs(first[32, 56] - (20, 40, 220)).max() < 40
    rep = json.loads(out.with_suffix(".json").read_text())
    assert rep["image"] == str(tmp_path / "start.png") and rep["actions"] == ["stay"]


@pytest.mark.parametrize("kind", ["grey16", "grey-alpha", "rgba", "float"])
def test_start_images_of_other_pixel_formats(tmp_path, monkeypatch, kind):
    """16-bit, greyscale (+ alpha), RGBA and float images are taken as the 8-bit RGB image they show."""
    import numpy as np

    from qvg.app.start_image import image_array
    base = np.linspace(0, 1, 40 * 30).reshape(30, 40)
    arr = {"grey16": (base * 65535).astype(np.uint16), "grey-alpha": np.stack([(base * 255).astype(np.uint8)] * 2, -1),
           "rgba": np.stack([(base * 255).astype(np.uint8)] * 4, -1), "float": base.astype(np.float32)}[kind]
    import imageio.v2 as imageio
    path = tmp_path / "x.png"
    if kind == "float":  # (no common format stores it: the reader's result stands in)
        monkeypatch.setattr(imageio, "imread", lambda p: arr)
    else:
        imageio.imwrite(path, arr)
    a = image_array(path)
    assert a.shape == (30, 40, 3) and a.dtype == np.uint8
    assert abs(a[..., 0].astype(int) - (base * 255).round().astype(int)).max() <= 1


def test_too_small_start_image(tmp_path, capsys):
    import imageio.v3 as iio
    import numpy as np
    iio.imwrite(tmp_path / "tiny.png", np.zeros((5, 7, 3), np.uint8))
    assert main(["--image", str(tmp_path / "tiny.png"), "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qvg-generate: error: --image: {str(tmp_path / 'tiny.png')!r} is 7 x 5 pixels; give one at "
                   "least 16 pixels on each side (it is scaled to the model's view)"]


def test_unreadable_start_image(tmp_path, capsys):
    (tmp_path / "x.png").write_text("not an image")
    out = tmp_path / "o"
    out.mkdir()
    assert main(["--image", str(tmp_path / "x.png"), "--out", str(out / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read" in err[0]
    assert list(out.iterdir()) == []


def test_steerable_chunks_match_the_world_rollout():
    """Generation asks for each chunk's action when the chunk starts (live steering); with a fixed list it gives the
    frames of qvg.pipelines.world_model.rollout exactly."""
    import torch

    from qvg.app.generate import Generation, parse
    s = parse(["--frames", "10", "--method", "bf16", "--actions", "right,zoom_in,left", "--quiet"])
    gen = Generation(s)
    ours = torch.cat([gen.lead] + [c.video for c in gen], 1)
    assert s["chunk_actions"] == ["right", "zoom_in", "left"]
    from qvg.cache import KVCache
    cfg = s["world_config"]
    cache = KVCache(len(gen.model.transformer.blocks), "bf16", chunk_frames=3,
                    tokens_per_frame=gen.cache.tokens_per_frame)
    ref = _rollout_video(gen.model.transformer, cfg, s, cache)
    assert torch.equal(ours.cpu(), ref)

    steered = parse(["--frames", "10", "--method", "bf16", "--quiet"])
    gen = Generation(steered, loaded=gen.model, plan=lambda c: [2, 5, 1][c])
    assert torch.equal(torch.cat([gen.lead] + [c.video for c in gen], 1), ours)


def test_steerable_chunks_match_the_world_rollout_with_world_rope():
    """With world-coordinate RoPE (config world_rope) the live path passes each chunk the pan offsets of all the
    actions so far, as rollout does: same frames (the shipped weights with the flag turned on, for the plumbing)."""
    import dataclasses

    import torch

    from qvg.app.generate import Generation, load_model, parse
    from qvg.cache import KVCache
    s = parse(["--frames", "7", "--method", "bf16", "--actions", "right,down", "--quiet"])
    loaded = load_model(s)
    cfg = dict(loaded.info["world_config"], world_rope=True)
    loaded = dataclasses.replace(loaded, info={"world_config": cfg})
    loaded.transformer.world_rope = True
    gen = Generation(s, loaded=loaded)
    ours = torch.cat([gen.lead] + [c.video for c in gen], 1)
    cache = KVCache(len(loaded.transformer.blocks), "bf16", chunk_frames=3, tokens_per_frame=gen.cache.tokens_per_frame)
    assert torch.equal(ours.cpu(), _rollout_video(loaded.transformer, cfg, s, cache))


def _rollout_video(transformer, cfg, s, cache):
    """qvg.pipelines.world_model.rollout's frames for parsed settings s, start frame first, on the CPU (the model
    may run on a GPU)."""
    import torch

    from qvg.pipelines.world_model import image_frame, rollout
    start = image_frame(s["image"], cfg["frame_size"])
    chunks = rollout(transformer, cfg, start, s["actions"], cache, seed=s["seed"])
    return torch.cat([start[:, None].cpu()] + [r.video[0].cpu() for r in chunks], 1)


def test_key_storage_auto_is_pre_rope_on_the_embedded_model_only(tmp_path):
    """auto packs keys before RoPE where it was measured to pay (the embedded model); Self-Forcing keeps post-RoPE
    keys (pre-RoPE costs ~6% per chunk there); an explicit choice wins."""
    from qvg.app.generate import parse
    out = ["--out", str(tmp_path / "v.mp4")]
    assert parse(out)["key_storage"] == "pre-rope"
    assert parse(out + ["--method", "kivi"])["key_storage"] == "post-rope"
    sf = ["--pipeline", "self-forcing", "--checkpoint", str(tmp_path)] + out
    assert parse(sf)["key_storage"] == "post-rope"
    assert parse(sf + ["--key-storage", "pre-rope"])["key_storage"] == "pre-rope"
    assert parse(out)["read"] == "window" and parse(out + ["--read", "staged"])["read"] == "staged"
    assert parse(out + ["--read", "fused"])["read"] == "fused"  # (pre-RoPE keys: read staged on a GPU)
    assert parse(out + ["--read", "fused", "--key-storage", "post-rope"])["read"] == "fused"


@pytest.mark.parametrize("method,read,key_storage", [("kivi", "staged", "auto"), ("bf16", "fused", "auto"),
                                                     ("quarot", "fused", "post-rope"), ("qvg", "flash", "auto")])
def test_read_errors_are_the_caches(tmp_path, capsys, method, read, key_storage):
    """--read is checked by the cache's own read_error: the line names the flag and the mode, then says what
    KVCache would raise (one line, exit 2, nothing written); an unknown mode reads "--read must be one of ..."."""
    from qvg.cache import read_error
    out = tmp_path / "v.mp4"
    args = ["--method", method, "--read", read, "--key-storage", key_storage, "--out", str(out), "--quiet"]
    msg = read_error(method, read)
    assert msg and main(args) == 2
    line = f"--{msg}" if msg.startswith("read must") else f"--read {read}: {msg}"  # (an unknown mode: named once)
    assert capsys.readouterr().err.strip().splitlines() == [f"qvg-generate: error: {line}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["bf16", "rtn", "kivi", "quarot", "qvg", "qvg-pro"])
def test_read_modes_each_method_takes(tmp_path, method):
    """The default read (window) for every method; the packed reads for rtn / qvg / qvg-pro, with keys stored before
    or after RoPE."""
    from qvg.app.generate import parse
    out = ["--method", method, "--out", str(tmp_path / "v.mp4")]
    assert parse(out)["read"] == "window" and parse(out + ["--read", "window"])["read"] == "window"
    if method in ("rtn", "qvg", "qvg-pro"):
        for storage in ("auto", "pre-rope", "post-rope"):
            assert parse(out + ["--read", "staged", "--key-storage", storage])["read"] == "staged"
            assert parse(out + ["--read", "fused", "--key-storage", storage])["read"] == "fused"


def test_reads_label_names_the_paths_by_use():
    from qvg.app.generate import _reads_label
    assert _reads_label({}) == ""
    assert _reads_label({"window": 4}) == "window"
    assert _reads_label({"window": 4, "reference": 6}) == "reference + window"
    assert _reads_label({"staged": 2, "fused": 2}) == "fused + staged"  # (ties by name: a stable label)


def test_report_names_the_read_that_ran(monkeypatch):
    """The report's `read` when no compressed history was read (`read_ran`, what would run): the torch reference on
    CPU, for methods without a packed read and at head dims no kernel takes; on a GPU the read asked for, except fused
    with pre-RoPE keys or at head dim 256, which the cache reads staged there (`gpu_read`). Otherwise the report names the paths the cache counted."""
    import torch
    from qvg.app.generate import read_ran
    monkeypatch.delenv("QVG_BACKEND", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert read_ran("fused", "qvg", "pre-rope", cpu, 128) == "reference"
    assert read_ran("window", "kivi", "post-rope", cuda, 128) == "reference"
    assert read_ran("fused", "qvg-pro", "pre-rope", cuda, 128) == "staged"
    assert read_ran("fused", "qvg", "post-rope", cuda, 128) == "fused"
    assert read_ran("staged", "rtn", "pre-rope", cuda, 128) == "staged"
    assert read_ran("window", "qvg", "pre-rope", cuda, 128) == "window"
    assert read_ran("fused", "qvg", "post-rope", cuda, 256) == "staged"  # (the on-chip kernel: up to 128 on a GPU)
    assert read_ran("window", "qvg", "post-rope", cuda, 96) == "reference"  # (no kernel takes it: `kernel_head_dim`)
    monkeypatch.setenv("QVG_BACKEND", "torch")  # the kernels do not run: the reference reads (nothing imports triton)
    assert read_ran("window", "qvg", "post-rope", cuda, 128) == "reference"


def test_kmeans_seed_is_the_compressions(tmp_path):
    """--kmeans-seed sets the compression's k-means seed (options.seed), not the sampling seed."""
    from qvg.app.generate import parse
    out = ["--out", str(tmp_path / "v.mp4")]
    s = parse(["--kmeans-seed", "3", "--seed", "5"] + out)
    assert s["options"]["seed"] == 3 and s["seed"] == 5
    assert "seed" not in parse(out)["options"]


def test_keep_old_leaves_nothing_when_the_copy_fails(tmp_path, monkeypatch):
    """_keep_old without hard links: a copy that fails (disk full) or is interrupted (Ctrl-C) leaves no partial
    backup; the failure is None (no backup), the interrupt goes on."""
    import os
    import shutil

    from qvg.app.generate import _keep_old
    video = tmp_path / "v.mp4"
    video.write_text("old video")
    monkeypatch.setattr(os, "link", lambda a, b: (_ for _ in ()).throw(OSError(1, "Operation not permitted")))
    for exc, expect in ((OSError(28, "No space left on device"), None), (KeyboardInterrupt(), KeyboardInterrupt)):
        def copy(a, b, exc=exc):
            open(b, "w").write("partial")
            raise exc
        monkeypatch.setattr(shutil, "copy2", copy)
        if expect is None:
            assert _keep_old(video) is None
        else:
            with pytest.raises(expect):
                _keep_old(video)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]


def test_a_large_start_image_reads_without_a_warning_and_a_huge_one_is_one_error(tmp_path, capsys, monkeypatch):
    """Past PIL's pixel limit PIL warns (two lines on stderr): a big photo is fine, it is scaled down; past twice
    the limit PIL refuses it, which is one error line."""
    import numpy as np
    from PIL import Image
    from qvg.app.start_image import image_array
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(tmp_path / "big.png")
    Image.fromarray(np.zeros((50, 50, 3), np.uint8)).save(tmp_path / "huge.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert image_array(tmp_path / "big.png").shape == (40, 40, 3)
    assert main(["--image", str(tmp_path / "huge.png"), "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image: cannot read" in err[0] and "exceeds limit" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.png", "huge.png"]


def test_a_cache_that_compressed_nothing_says_why(tmp_path, capsys):
    """A sink that covers the whole video leaves nothing to compress: the summary's "the size of BF16" for a qvg
    cache gets a note saying why (it reads like a bug otherwise); a cache that compressed says nothing more."""
    assert main(["--frames", "4", "--sink", "6", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "the size of BF16" in cap.out
    assert cap.err.strip() == ("qvg-generate: note: qvg compressed nothing: every frame stayed in the BF16 zones (a "
                               "sink of --sink 6 latent frames covering the video's 3)")
    # the other cause, alone (the note named both, the one that did not apply with its value)
    assert main(["--frames", "7", "--commit-every", "100", "--out", str(tmp_path / "c.mp4"), "--quiet"]) == 0
    assert capsys.readouterr().err.strip() == ("qvg-generate: note: qvg compressed nothing: every frame stayed in the "
                                               "BF16 zones (chunks waiting for --commit-every 100, which the video "
                                               "never filled)")
    assert main(["--frames", "7", "--out", str(tmp_path / "w.mp4"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_window_that_evicts_every_unit_before_it_fills_is_one_error_line(tmp_path, capsys):
    """--history window:3 with --commit-every 3: the waiting chunks were evicted before three were there, so the qvg
    cache never compressed (said only after the run); now refused before it, in one line."""
    assert main(["--frames", "7", "--history", "window:3", "--commit-every", "3", "--out", str(tmp_path / "v.mp4"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["qvg-generate: error: a window of 3 frames evicts the chunks waiting to be packed before there are "
                   "commit_every = 3 of them: qvg would never pack a unit (give a window of at least 6 frames, or a "
                   "smaller commit_every)"], err
    assert list(tmp_path.iterdir()) == []


def test_a_cache_whose_units_outweigh_bf16_says_so_before_the_run(tmp_path, capsys):
    """Centroid tables too large for the unit (every packed unit above BF16's 16 bits per value): one note before
    the run, in qvg-generate's words and not as KVCache's Python warning, and no claim that a longer history repays
    it (the note said "the ratio grows with the history", and it levels off below 1)."""
    from qvg.cache import UnitCostWarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (main's filter goes before this one: the warning must not be seen)
        before = list(warnings.filters)
        assert main(["--frames", "7", "--method", "qvg-pro", "--centroids", "256", "--out", str(tmp_path / "v.mp4"),
                     "--quiet"]) == 0
        assert list(warnings.filters) == before  # (main's filter ends with it: a caller's own are not changed)
    assert not [w for w in seen if issubclass(w.category, UnitCostWarning)], [str(w.message) for w in seen]
    cap = capsys.readouterr()
    assert "larger than BF16" in cap.out
    err = cap.err.strip().splitlines()
    assert err == ["qvg-generate: note: qvg-pro packs each committed unit (768 tokens x 64 channels) into 24.33 bits "
                   "per value, more than BF16's 16 (its centroid tables and scales outweigh a unit this small), so "
                   "its cache stays larger than BF16 however long the history; fewer --centroids or --stages, or a "
                   "larger --commit-every, lower it"], err


def test_the_unit_cost_note_advises_what_the_method_has():
    """k-means methods: centroids, stages, the unit's size; the others (whose bits per value do not depend on the
    unit): block size and bits. The page's words name no flag (it has no commit-every control)."""
    from qvg.app.generate import unit_cost_note
    assert unit_cost_note({"method": "qvg", "unit_bits": (4.2, 768, 64)}) is None
    kivi = unit_cost_note({"method": "kivi", "unit_bits": (18.0, 768, 64)})
    assert kivi.endswith("(its codes and scales), so its cache stays larger than BF16 however long the history; a "
                         "larger --block-size or fewer --bits lower it"), kivi
    page = unit_cost_note({"method": "qvg-pro", "unit_bits": (24.3, 768, 64)}, page=True)
    assert page.endswith("fewer centroids or stages lower it") and "--" not in page, page
    assert "--" not in unit_cost_note({"method": "rtn", "unit_bits": (16.0007, 768, 64)}, page=True)


def test_a_cache_larger_than_bf16_says_why(tmp_path, capsys):
    """A history too short to repay the cache's BF16 room for the chunk being generated (and its sink): the line
    "larger than BF16" gets a note saying why (it read like a bug)."""
    assert main(["--frames", "4", "--history", "window:3", "--sink", "3", "--out", str(tmp_path / "v.mp4"),
                 "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "larger than BF16" in cap.out and "qvg-generate: note: qvg holds more than BF16 here" in cap.err, cap


def test_out_ending_in_a_slash_is_refused(tmp_path, capsys):
    """--out v.mp4/ names a folder: one line, nothing written (it wrote the file v.mp4)."""
    assert main(["--out", str(tmp_path / "v.mp4") + "/", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out names a folder (it ends in '/')" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_stages_0_reports_no_kmeans_settings(tmp_path):
    """--stages 0 runs no k-means: its report's options hold no centroids, seeding, iterations or seed (the CLI
    refuses those flags with --stages 0; the report listed them)."""
    assert main(["--stages", "0", "--frames", "4", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 0
    opts = json.loads((tmp_path / "v.json").read_text())["options"]
    assert opts["stages"] == 0 and not {"centroids", "seeding", "iters", "seed"} & set(opts), opts


def test_a_long_valid_file_name_is_written(tmp_path):
    """A 250-character name (valid: 255 is the limit) is written: the temporary files beside it take a shortened
    stem (they were named after the whole stem, so the name grew past the limit after the model had run)."""
    for stem in ("a" * 246, "\U0001F600" * 61):  # 250 bytes; 248 bytes in 61 characters
        out = tmp_path / (stem + ".mp4")
        assert main(["--frames", "4", "--method", "bf16", "--out", str(out), "--quiet"]) == 0
        assert out.is_file() and out.with_suffix(".json").is_file()
    assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.filterwarnings("error:The CUDA Graph is empty")  # (what the graphs captured for the wrong device were)
@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_runs_on_the_second_gpu(tmp_path, method):
    """--device cuda:1: the whole run on that GPU (the Triton kernels and the cache's graphs ran on the current
    device, cuda:0; then, as the second device of the process, its compression graphs were captured empty on a
    stream of cuda:0: 0.5 against 2.5 MB of graph workspace, and another video), and the same video and stored bytes
    as on cuda:0. (The workspace is only required to be there: the free blocks of the graphs' pools were not
    compared across devices after the fix.)"""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    import imageio.v3 as iio
    reps, videos = [], []
    for dev in ("cuda:0", "cuda:1"):
        out = tmp_path / f"{dev[-1]}.mp4"
        assert main(["--device", dev, "--method", method, "--frames", "10", "--out", str(out), "--quiet"]) == 0
        reps.append(json.loads(out.with_suffix(".json").read_text()))
        videos.append(iio.imread(out))
    stored = [{k: v for k, v in r["kv_bytes"].items() if k not in ("workspace", "total")} for r in reps]
    assert reps[1]["peak_gpu_bytes"] > 0 and stored[0] == stored[1] and reps[1]["device"] == reps[0]["device"]
    assert all(r["kv_bytes"]["workspace"] > 0 for r in reps)
    assert (videos[0] == videos[1]).all()


def test_a_start_image_no_reader_knows_is_one_plain_line(tmp_path, capsys):
    """A file imageio has no format for (text named .jpg): the line says so, not imageio's "Could not find a backend
    to open ... with iomode `ri`"."""
    (tmp_path / "notimg.jpg").write_text("not an image")
    assert main(["--image", str(tmp_path / "notimg.jpg"), "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qvg-generate: error: --image: cannot read {str(tmp_path / 'notimg.jpg')!r} as an image (not an "
                   "image format imageio reads)"], err
