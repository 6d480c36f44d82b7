"""qvg.outputs: write checks, all-or-nothing writes and SIGTERM handling shared by qvg-generate and qvg-eval."""
from __future__ import annotations

import errno
import os
import signal
import tempfile
from pathlib import Path

import pytest

from qvg import outputs


def test_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with outputs.atomic(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
    outputs.write_text(p, "new")
    assert p.read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
    m = os.umask(0)
    os.umask(m)
    assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~m)  # as a newly made file


def test_atomic_writes_through_a_symlink(tmp_path):
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "r.json", tmp_path / "r.json"
    target.write_text("old")
    link.symlink_to(target)
    outputs.write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"  # the file it names is replaced, the link stays
    assert sorted(x.name for x in (tmp_path / "real").iterdir()) == ["r.json"]


def test_target_follows_links_and_names_loops(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    assert outputs.target(tmp_path / "a") == tmp_path / "b"  # dangling: the file it names
    (tmp_path / "c").symlink_to(tmp_path / "d")
    (tmp_path / "d").symlink_to(tmp_path / "c")
    with pytest.raises(ValueError, match="c'"):
        outputs.target(tmp_path / "c")
    with pytest.raises(ValueError):
        outputs.write_text(tmp_path / "c", "x")
    assert outputs.target_error(tmp_path / "c") and outputs.target_error(tmp_path) == f"{str(tmp_path)!r} is a directory"
    (tmp_path / "e").symlink_to(tmp_path / "gone" / "e")
    assert "no such directory" in outputs.target_error(tmp_path / "e")
    assert outputs.target_error(tmp_path / "new.json") is None


def test_devices_fifos_and_sockets_are_never_replaced(tmp_path):
    """A write through a symlink to a device (root: `ln -s /dev/null out.mp4`) or to a FIFO is refused, not a
    rename over it: target_error names it, and atomic() raises without touching it."""
    import socket
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "to-null.mp4").symlink_to("/dev/null")
    (tmp_path / "to-pipe.json").symlink_to(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))
    try:
        assert outputs.target_error(tmp_path / "to-null.mp4") == (
            f"{str(tmp_path / 'to-null.mp4')!r} is a character device (through a symlink to '/dev/null'), "
            "not a regular file")
        assert "is a FIFO (through a symlink" in outputs.target_error(tmp_path / "to-pipe.json")
        assert outputs.target_error(fifo) == f"{str(fifo)!r} is a FIFO, not a regular file"
        assert "is a socket" in outputs.target_error(tmp_path / "s")
        assert outputs.targets_error([tmp_path / "ok.mp4", tmp_path / "to-null.mp4"])[0] == tmp_path / "to-null.mp4"
        with pytest.raises(OSError, match="is a FIFO, not a regular file"):
            with outputs.atomic(tmp_path / "to-pipe.json") as tmp:
                tmp.write_text("x")
        assert fifo.is_fifo() and os.path.exists("/dev/null") and not Path("/dev/null").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "s", "to-null.mp4", "to-pipe.json"]
    finally:
        sock.close()


def test_writable_error_names_why(tmp_path, monkeypatch):
    assert outputs.writable_error(tmp_path) is None and list(tmp_path.iterdir()) == []

    def refuse(err):
        def mk(*a, **k):
            raise OSError(err, os.strerror(err))
        return mk
    monkeypatch.setattr(tempfile, "mkstemp", refuse(errno.EACCES))
    assert outputs.writable_error(tmp_path) == "Permission denied"
    monkeypatch.setattr(tempfile, "mkstemp", refuse(errno.ENOENT))  # root in /proc: the folder is there
    assert outputs.writable_error(tmp_path) == "its file system takes no new files"


def test_sigterm_held_until_both_steps_are_done():
    """Held also with other threads running (torch starts some): the kernel may hand SIGTERM to any of them."""
    import threading
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    done = []
    try:
        with pytest.raises(outputs.Terminated):
            with outputs.sigterm_raises():
                with outputs.sigterm_held():
                    os.kill(os.getpid(), signal.SIGTERM)
                    done.append(1)  # still runs: the signal waits
                    done.append(2)
    finally:
        stop.set()
        t.join()
    assert done == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is not outputs._on_sigterm


@pytest.mark.usefixtures("sigint_default")
def test_seen_records_signals_and_keeps_an_ignored_sigint_ignored():
    """sigterm_raises(seen): SIGINT raises KeyboardInterrupt and SIGTERM Terminated, each also recorded; a SIGINT
    the parent set to be ignored (`cmd &` in a script) stays ignored; the handlers are restored."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for sig, exc in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, outputs.Terminated)):
        seen = []
        with pytest.raises(exc):
            with outputs.sigterm_raises(seen):
                os.kill(os.getpid(), sig)
        assert seen == [sig]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        with outputs.sigterm_raises(seen):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # (ignored: nothing raised, nothing recorded)
        assert seen == [] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_stem_path_appends_not_swaps():
    """An output stem's files: the extension appended (a dot in the stem is not a suffix to replace), a stem given
    with one of its own extensions (any case) losing it first."""
    from qvg.outputs import stem_path
    assert stem_path("runs/run-v1.5", ".json") == Path("runs/run-v1.5.json")
    assert stem_path("runs/x.json", ".md") == stem_path("runs/x.JSON", ".md") == Path("runs/x.md")
    assert stem_path("x.png", ".json") == Path("x.png.json")  # (not one of `given`)
    assert stem_path("x.png", ".json", (".json", ".png")) == Path("x.json")
