"""What a UI test prints when it times out waiting on the server (which runs in the test's own process): the gradio
queue's state, this process's child processes (ffmpeg writers) and the stacks of the threads that are inside qvg,
imageio, torch or a subprocess. A wedged queue in CI can then be read from the failure message alone."""
from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path

import qvg

_ROOT = Path(qvg.__file__).resolve().parent.parent  # the checkout: qvg/, app/, pipelines/, kernels/, eval/
OURS = tuple(str(_ROOT / d) + os.sep for d in ("qvg", "app", "pipelines", "kernels", "eval"))
THEIRS = (f"{os.sep}imageio", f"{os.sep}subprocess.py", f"{os.sep}torch{os.sep}")


def _interesting(filename: str) -> bool:
    """A frame in this project's code, imageio(-ffmpeg), subprocess or torch (idle worker threads have none)."""
    path = os.path.realpath(filename)
    return path.startswith(OURS) or any(k in path for k in THEIRS)


def _queue_state(app) -> str:
    q = getattr(app, "_queue", None)
    if q is None:
        return "queue: none"
    per = ", ".join(f"{cid}: {eq.current_concurrency}/{eq.concurrency_limit} running, {len(eq.queue)} waiting"
                    for cid, eq in q.event_queue_per_concurrency_id.items())
    active = sum(job is not None for job in q.active_jobs)
    return f"queue: stopped={q.stopped} active_jobs={active} [{per}]"


def _children() -> list[str]:
    out, me = [], str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[1] != me:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            out.append(f"child {pid} state={fields[0]}: {cmd}")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _threads() -> list[str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = traceback.extract_stack(frame)
        if ident == threading.get_ident() or not any(_interesting(s.filename) for s in stack):
            continue
        lines = [f"  {os.path.basename(s.filename)}:{s.lineno} {s.name}: {(s.line or '').strip()[:100]}"
                 for s in stack[-8:]]
        out.append(f"thread {names.get(ident, ident)}:\n" + "\n".join(lines))
    return out


def hang_report(app) -> str:
    """The server's state, one block of text (never raises: it is called from a failing test)."""
    parts = []
    for part in (lambda: [_queue_state(app)], _children, _threads):
        try:
            parts += part()
        except Exception as e:  # a report, not a second failure
            parts.append(f"({type(e).__name__}: {e})")
    return "\n".join(parts)
