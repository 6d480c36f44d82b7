"""app/mp4.py: the mp4 writer and reader that start imageio-ffmpeg's ffmpeg themselves (no preexec_fn fork),
against imageio's reader; bounded close, ffmpeg's own error, abort, no file without frames."""
import subprocess
import sys

import numpy as np
import pytest

from qvg.app.mp4 import CRF, Mp4Writer


def _frames(n=5, h=48, w=64):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (h // 8, w // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)  # smooth blocks
    return [np.roll(base, 4 * i, axis=1) for i in range(n)]


def test_writes_an_mp4_that_reads_back(tmp_path):
    import imageio.v3 as iio
    path = tmp_path / "v.mp4"
    with Mp4Writer(path, fps=8) as w:
        for f in _frames():
            w.append_data(f)
    got = iio.imread(path)
    assert got.shape == (5, 48, 64, 3)
    assert np.abs(got.astype(int) - np.stack(_frames()).astype(int)).mean() < 6  # H.264 at CRF 10, 4:2:0 chroma
    assert w.closed and w.proc.returncode == 0


def _spy(monkeypatch, name: str) -> dict:
    """subprocess.<name> wrapped: the returned dict takes its last call's keywords and command."""
    seen, real = {}, getattr(subprocess, name)

    def call(cmd, **kw):
        seen.update(kw, cmd=cmd)
        return real(cmd, **kw)
    monkeypatch.setattr(subprocess, name, call)
    return seen


def test_ffmpeg_starts_in_its_own_session_without_a_python_pre_exec_hook(tmp_path, monkeypatch):
    seen = _spy(monkeypatch, "Popen")
    with Mp4Writer(tmp_path / "v.mp4", fps=8) as w:
        w.append_data(_frames(1)[0])
    assert seen["start_new_session"] is True and seen.get("preexec_fn") is None
    assert seen["cmd"][-1] == str(tmp_path / "v.mp4") and ["-crf", str(CRF)] == seen["cmd"][-5:-3]


def test_no_frame_no_file(tmp_path):
    w = Mp4Writer(tmp_path / "v.mp4", fps=8)
    w.close()
    assert w.closed and not (tmp_path / "v.mp4").exists()


def test_frames_are_checked(tmp_path):
    with Mp4Writer(tmp_path / "v.mp4", fps=8) as w:
        with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
            w.append_data(np.zeros((8, 8), np.uint8))
        w.append_data(np.zeros((16, 16, 3), np.uint8))
        with pytest.raises(ValueError, match="one size, 16x16, got 32x16"):
            w.append_data(np.zeros((16, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="closed"):
        w.append_data(np.zeros((16, 16, 3), np.uint8))


def test_ffmpeg_failure_is_one_line_with_its_reason(tmp_path):
    w = Mp4Writer(tmp_path / "v.mp4", fps=8)
    w.append_data(np.zeros((15, 15, 3), np.uint8))  # odd sizes: libx264's 4:2:0 needs even ones
    with pytest.raises(RuntimeError, match=r"ffmpeg (exited with code|stopped reading).* writing .*v\.mp4: width not "
                       r"divisible by 2 \(15x15\)$") as e:
        w.close()
    assert "\n" not in str(e.value)


@pytest.fixture
def stuck(tmp_path):
    """An "ffmpeg" that runs but never finishes."""
    exe = tmp_path / "stuck"
    exe.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    exe.chmod(0o755)
    return exe


def test_close_is_bounded_and_abort_kills(tmp_path, stuck):
    w = Mp4Writer(tmp_path / "v.mp4", fps=8, close_seconds=0.5)
    w.exe = str(stuck)
    w.append_data(np.zeros((16, 16, 3), np.uint8))
    with pytest.raises(RuntimeError, match=r"ffmpeg did not finish within 0.5 s writing"):
        w.close()
    assert w.proc.poll() is not None  # (killed)
    a = Mp4Writer(tmp_path / "a.mp4", fps=8)
    a.exe = str(stuck)
    a.append_data(np.zeros((16, 16, 3), np.uint8))
    a.abort()
    assert a.closed and a.proc.poll() is not None


def test_interrupted_close_stops_ffmpeg(tmp_path, stuck):
    """Ctrl-C while close() waits: ffmpeg, in its own session, is killed rather than left to run on."""
    w = Mp4Writer(tmp_path / "v.mp4", fps=8)
    w.exe = str(stuck)
    w.append_data(_frames(1)[0])

    real_wait, calls = w.proc.wait, []

    def interrupted_once(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(timeout)
    w.proc.wait = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        w.close()
    assert w.closed and w.proc.returncode == -9  # (killed and reaped)


def test_ffmpeg_that_cannot_start_is_one_line(tmp_path):
    w = Mp4Writer(tmp_path / "v.mp4", fps=8)
    w.exe = str(tmp_path / "no-ffmpeg")
    with pytest.raises(RuntimeError, match=r"^could not start ffmpeg \(.*no-ffmpeg\) for .*v\.mp4: No such file") as e:
        w.append_data(_frames(1)[0])
    assert "\n" not in str(e.value) and w.closed
    w.close()  # (nothing left to do)


def test_read_frames_matches_imageios_reader_and_starts_ffmpeg_without_pre_exec(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    from qvg.app.mp4 import read_frames
    path = tmp_path / "v.mp4"
    with Mp4Writer(path, fps=8) as w:
        for f in _frames(7, 40, 72):
            w.append_data(f)
    with imageio.get_reader(str(path)) as r:
        want = np.stack([np.asarray(f) for f in r])
    seen = _spy(monkeypatch, "run")
    got = read_frames(path)
    assert got.shape == (7, 40, 72, 3) and got.dtype == np.uint8 and np.array_equal(got, want)
    assert seen["start_new_session"] is True and seen.get("preexec_fn") is None


def test_read_frames_failure_is_one_line_with_ffmpegs_reason(tmp_path):
    from qvg.app.mp4 import read_frames
    (tmp_path / "bad.mp4").write_text("not a video")
    for name, why in (("missing.mp4", "No such file"), ("bad.mp4", "Invalid data")):
        with pytest.raises(RuntimeError) as e:
            read_frames(tmp_path / name)
        assert "\n" not in str(e.value) and why in str(e.value) and name in str(e.value)


def test_qvg_eval_reads_mp4_through_read_frames(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    from qvg.eval.video import read_video
    path = tmp_path / "v.mp4"
    with Mp4Writer(path, fps=8) as w:
        for f in _frames(3):
            w.append_data(f)

    def no_imageio(*a, **k):
        raise AssertionError("imageio's reader starts ffmpeg with a pre-exec hook")
    monkeypatch.setattr(imageio, "get_reader", no_imageio)
    v = read_video(path)
    assert v.shape == (3, 3, 48, 64) and v.min() >= -1 and v.max() <= 1
