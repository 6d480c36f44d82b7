"""The mp4 writer of qvg-generate and the UI, and the video reader of qvg-eval. The writer: H.264 from
imageio-ffmpeg's own ffmpeg binary (no system ffmpeg), fed raw RGB frames on its stdin, with the command imageio's
FFMPEG writer builds for libx264 at quality 8 (CRF 10, yuv420p, no resize).

Why not imageio's writer: imageio-ffmpeg starts ffmpeg with preexec_fn=os.setpgrp, a fork that runs Python code in
the child before exec, which can deadlock in a multi-threaded process (Python's subprocess documentation;
imageio-ffmpeg issue #58, its IMAGEIO_FFMPEG_NO_PREVENT_SIGINT workaround): the parent then waits inside Popen for an
exec that never comes, at the video's first frame. The UI server is such a process (gradio's worker threads,
torch's), and one generation stuck so holds its one-at-a-time queue. Here ffmpeg starts with start_new_session
(Ctrl-C still does not reach it, as with setpgrp, but the child runs no Python: vfork, setsid in C), close() waits a
bounded time for an ffmpeg that runs but does not finish, and a failure says why in ffmpeg's own words. (Writing a
frame waits while ffmpeg reads: no bound there.) `read_frames` decodes a video the same way for the same reason
(imageio's reader starts ffmpeg like its writer, and qvg-eval's process has torch's threads).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from fractions import Fraction

import numpy as np

CRF = 10  # imageio's quality 8 for libx264: int((1 - 8 / 10) * 51)
CLOSE_SECONDS = 120.0  # the longest ffmpeg may take to finish the file once its input has ended
READ_SECONDS = 600.0  # the longest ffmpeg may take to decode a whole video


def _ffmpeg_exe(what: str) -> str:
    try:
        import imageio_ffmpeg
    except ImportError:
        raise RuntimeError(f"{what} mp4 needs the imageio-ffmpeg package (a dependency of this project: "
                           "pip install imageio-ffmpeg)") from None
    return imageio_ffmpeg.get_ffmpeg_exe()


def _cause(log, last: bool = False) -> str | None:
    """ffmpeg's line naming the cause of a failure, less its "[lib @ 0x..]" prefixes: the first of an error-level
    log, the last of an info-level one."""
    log.seek(0)
    said = [re.sub(r"^(\[[^]]*\]\s*)+", "", s).strip()
            for s in log.read().decode(errors="replace").splitlines() if s.strip()]
    return (said[-1] if last else said[0]) if said else None


def read_frames(path, timeout: float = READ_SECONDS) -> np.ndarray:
    """Every frame of a video file's first video stream as uint8 [F, H, W, 3] RGB, decoded by imageio-ffmpeg's
    ffmpeg (as imageio's reader does: rgb24, no scaling) started in its own session; RuntimeError in one line (ffmpeg's
    own words) if it cannot."""
    exe = _ffmpeg_exe("reading")
    cmd = [exe, "-hide_banner", "-nostdin", "-i", str(path), "-map", "0:v:0", "-f", "rawvideo", "-pix_fmt", "rgb24",
           "-"]
    with tempfile.TemporaryFile() as log:
        try:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"ffmpeg did not finish reading {path} within {timeout:g} s") from None
        except OSError as e:
            raise RuntimeError(f"could not start ffmpeg ({exe}) to read {path}: {e.strerror or e}") from None
        if out.returncode != 0:
            said = _cause(log, last=True)
            raise RuntimeError(f"ffmpeg could not read {path}" + (f": {said}" if said else ""))
        log.seek(0)
        info = log.read().decode(errors="replace")
    size = re.search(r"Output #0.*?Video: rawvideo.*?, (\d+)x(\d+)[ ,\n]", info, re.S)
    if size is None:
        raise RuntimeError(f"ffmpeg found no video stream in {path}")
    w, h = int(size.group(1)), int(size.group(2))
    data = np.frombuffer(out.stdout, np.uint8)
    if data.size == 0 or data.size % (w * h * 3):
        raise RuntimeError(f"ffmpeg decoded {data.size} bytes from {path}, not whole {w}x{h} RGB frames")
    return data.reshape(-1, h, w, 3)


class Mp4Writer:
    """append_data(frame uint8 [H, W, 3]) ..., then close(). ffmpeg starts at the first frame; a writer given no
    frame writes no file. As a context manager: closed on success, aborted (ffmpeg killed) on an exception."""

    def __init__(self, path, fps: int, close_seconds: float = CLOSE_SECONDS):
        self.exe = _ffmpeg_exe("writing")
        self.path, self.fps, self.close_seconds = str(path), fps, close_seconds
        self.proc: subprocess.Popen | None = None
        self.size: tuple[int, int] | None = None
        self.closed = False
        self._log = None

    def append_data(self, frame) -> None:
        a = np.ascontiguousarray(frame)
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
            raise ValueError(f"mp4 frames are uint8 [H, W, 3], got {a.dtype} {list(a.shape)}")
        if self.closed:
            raise ValueError(f"{self.path}: the writer is closed")
        if self.proc is None:
            self._start(a.shape[1], a.shape[0])
        elif (a.shape[1], a.shape[0]) != self.size:
            raise ValueError(f"{self.path}: every frame of a video has one size, {self.size[0]}x{self.size[1]}, "
                             f"got {a.shape[1]}x{a.shape[0]}")
        try:
            self.proc.stdin.write(a.data)
        except OSError:  # (BrokenPipeError: ffmpeg has stopped)
            self._fail("ffmpeg stopped reading frames")

    def _start(self, width: int, height: int) -> None:
        cmd = [self.exe, "-y", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}", "-pix_fmt", "rgb24",
               "-r", str(Fraction(self.fps).limit_denominator()), "-i", "-", "-an", "-vcodec", "libx264",
               "-pix_fmt", "yuv420p", "-crf", str(CRF), "-v", "error", self.path]
        log = tempfile.TemporaryFile()  # ffmpeg's errors (a file, never a pipe that could fill and block it)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                                         start_new_session=True)
        except OSError as e:
            log.close()
            self.closed = True
            raise RuntimeError(f"could not start ffmpeg ({self.exe}) for {self.path}: {e.strerror or e}") from None
        self._log, self.size = log, (width, height)

    def close(self) -> None:
        """End the input and wait (at most close_seconds) for ffmpeg to finish the file; RuntimeError if it fails."""
        if self.closed:
            return
        if self.proc is None:
            self.closed = True
            return
        try:
            self.proc.stdin.close()
            code = self.proc.wait(self.close_seconds)
        except subprocess.TimeoutExpired:
            self._fail(f"ffmpeg did not finish within {self.close_seconds:g} s")
        except BaseException:  # (Ctrl-C while waiting: ffmpeg, in its own session, would go on alone)
            self.abort()
            raise
        if code != 0:
            self._fail(f"ffmpeg exited with code {code}")
        self.closed = True
        self._log.close()

    def abort(self) -> None:
        """Stop ffmpeg now (the file is left unfinished: for a run that failed or was cancelled)."""
        self.closed = True
        if self.proc is not None:
            self._stop()
        if self._log is not None:
            self._log.close()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:  # (the pipe's unwritten buffer, ffmpeg gone)
            pass

    def _fail(self, what: str):
        self.closed = True
        self._stop()
        said = _cause(self._log)
        self._log.close()
        raise RuntimeError(f"{what} writing {self.path}" + (f": {said}" if said else ""))

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.abort()
