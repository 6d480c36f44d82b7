"""Output files of the command-line tools (qvg-generate, qvg-eval): whether a folder takes new files, writes that
leave either the whole file or nothing, and SIGTERM turned into an exception so that a run stopped by `timeout`,
Slurm or `docker stop` cleans up as on Ctrl-C. Standard library only."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path


def writable_error(folder: str | os.PathLike) -> str | None:
    """Why no file can be made in `folder`, or None if one can (tried, then removed: `os.access` says yes to root
    in /proc or /sys, where making one fails)."""
    folder = Path(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".qvg-write-check.", dir=folder)
    except OSError as e:
        if e.errno == errno.ENOENT and folder.is_dir():  # (/proc: the folder is there, its file system takes none)
            return "its file system takes no new files"
        return e.strerror or type(e).__name__
    try:
        os.close(fd)
    finally:
        os.remove(probe)
    return None


def stem_path(out: str | os.PathLike, ext: str, given=(".json",)) -> Path:
    """Output stem `out` with `ext` appended, not swapped for a suffix the stem has ("run-v1.5" -> run-v1.5.json, not
    run-v1.json, another run's); a stem given with one of the extensions `given` (any case) loses it first."""
    out = Path(out)
    if out.suffix.lower() in given:
        out = out.with_suffix("")
    return out.with_name(out.name + ext)


def target(path: str | os.PathLike) -> Path:
    """The file a write to `path` replaces: `path` with symlinks followed (a dangling link: the file it names), as
    open() would write it. ValueError for a symlink loop."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:  # not there yet (or a dangling link): where it would be
        return Path(os.path.realpath(path))
    except OSError as e:
        why = "a symlink loop" if e.errno == errno.ELOOP else (e.strerror or type(e).__name__)
        raise ValueError(f"{str(path)!r}: {why}") from None


def special_kind(t: Path) -> str | None:
    """What `t` is if it exists and is neither a regular file nor a folder (a device, a FIFO, a socket), else None:
    a write must not replace such a file (root replacing /dev/null through an `--out` symlink)."""
    try:
        mode = os.stat(t).st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def target_error(path: str | os.PathLike) -> str | None:
    """Why `path` can't be written as a new or replaced file (its target's folder missing or taking no files, the
    target a folder, a device, a FIFO or a socket, a symlink loop), or None."""
    try:
        t = target(path)
    except ValueError as e:
        return str(e)
    if t.is_dir():
        return f"{str(path)!r} is a directory"
    kind = special_kind(t)
    if kind:
        via = f" (through a symlink to {str(t)!r})" if t != Path(os.path.abspath(path)) else ""
        return f"{str(path)!r} is {kind}{via}, not a regular file"
    if not t.parent.is_dir():
        return f"cannot write to {str(t.parent)!r} (no such directory)"
    err = writable_error(t.parent)
    return f"cannot create files in {str(t.parent)!r} ({err})" if err else None


def targets_error(paths) -> tuple[Path, str] | None:
    """The first of `paths` (files a tool writes together) that can't be written, and why (target_error, or two of
    them being one file through a symlink); None if all can."""
    seen: dict[Path, Path] = {}
    for p in map(Path, paths):
        err = target_error(p)
        if err:
            return p, err
        t = target(p)
        if t in seen:
            return p, f"{str(seen[t])!r} and {str(p)!r} are the same file (a symlink)"
        seen[t] = p
    return None


def folder_error(folder: str | os.PathLike, names=()) -> str | None:
    """Why files `names` can't be written in the output folder `folder` (made, with its parents, when written), or
    None: for tools that check their outputs before their work (a failure after minutes of work is a traceback
    and a lost result)."""
    if not str(folder).strip():
        return "empty: give a folder"
    f = Path(os.path.abspath(folder))
    if os.path.lexists(f) and not f.exists():  # (a symlink to nothing, or a loop)
        return f"{str(folder)!r} is a symlink to nothing (or a loop), not a folder"
    if f.exists() and not f.is_dir():
        return f"{str(folder)!r} is not a folder"
    there = next(p for p in (f, *f.parents) if os.path.lexists(p))
    if not there.is_dir():
        return f"cannot make {str(folder)!r}: {str(there)!r} is not a folder"
    err = writable_error(there)
    if err:
        return f"cannot write to {str(there)!r} ({err})"
    bad = targets_error(Path(folder) / n for n in names) if f.is_dir() else None
    return bad[1] if bad else None


@contextlib.contextmanager
def atomic(path: str | os.PathLike):
    """Yields a temporary path beside `path`; on a clean exit it replaces `path` (readable as a new file would be),
    else it is removed: `path` is then left as it was, never half written. A symlink is written through, as open()
    would: the file it names is replaced (its folder holds the temporary file), the link stays."""
    path = target(path)
    kind = special_kind(path)
    if kind:  # (never replaced: callers check with target_error first; this guards the others)
        raise OSError(errno.EEXIST, f"{str(path)!r} is {kind}, not a regular file")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    try:
        os.close(fd)
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def new_file_mode() -> int:
    """The permissions a newly made file gets (0o666 less the umask): mkstemp's files are 0o600 until given these."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`path`'s whole new text, or the file untouched (`atomic`)."""
    with atomic(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_texts(texts: dict) -> None:
    """Each {path: text} written all or none: every text goes to a temporary file beside its path, and they are put
    in place only once all are written (an OSError before that leaves every path as it was)."""
    with contextlib.ExitStack() as stack:
        tmps = {p: stack.enter_context(atomic(p)) for p in texts}
        for p, text in texts.items():
            tmps[p].write_text(text)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread inside `sigterm_raises`."""


def _raiser(seen: list | None):
    """A signal handler: SIGTERM raises Terminated, SIGINT KeyboardInterrupt, each first appended to `seen`."""
    def on_signal(signum, frame):
        if seen is not None:
            seen.append(signum)
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    return on_signal


_on_sigterm = _raiser(None)


@contextlib.contextmanager
def sigterm_raises(seen: list | None = None):
    """Within: SIGTERM raises Terminated (in the main thread only: elsewhere signals can't be caught). seen: a list
    that SIGTERM and SIGINT (which still raises KeyboardInterrupt) are also appended to, so that a library that
    swallows the exception can't hide that the user stopped the run (diffusers' lazy import turns a Ctrl-C raised
    inside it into a RuntimeError: "maximum recursion depth exceeded")."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _on_sigterm if seen is None else _raiser(seen)
    old = signal.signal(signal.SIGTERM, handler)
    # SIGINT only when recording, and only over Python's own Ctrl-C handler: a SIGINT the parent set to be ignored
    # (`cmd &` in a script) stays ignored
    old_int = signal.signal(signal.SIGINT, handler) if seen is not None and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler else None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)


@contextlib.contextmanager
def sigterm_held():
    """Within: a SIGTERM waits, so that steps that must happen together (two renames) do; on exit it goes to the
    handler that was there before (Terminated inside `sigterm_raises`). A recording handler, not a signal mask: a
    process with more threads than the main one (torch starts some) gets SIGTERM on any thread that does not
    block it, and Python then runs the handler in the main thread at once. Main thread only, else a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        if got and callable(old):
            old(signal.SIGTERM, None)
        elif got and old == signal.SIG_DFL:
            signal.raise_signal(signal.SIGTERM)
