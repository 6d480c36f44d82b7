"""What makes a saved result reproducible: the exact command, the git commit (and whether the tree was dirty), the
date, the device, torch / python versions, and the pretrained weight files read (LPIPS, VBench: path, size, mtime,
sha256; `weight_files`). Every qvg-eval JSON carries this dict under "meta"."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from qvg.revision import changed_code, file_sha256, git_commit


def changed_files() -> list[str] | None:
    """What makes the code differ from the commit (what git_dirty is about: changed tracked files, new Python
    files); None when QVG_COMMIT names the commit (then, as for git_dirty, this checkout's git metadata may lag the
    code: it cannot say)."""
    if os.environ.get("QVG_COMMIT"):
        return None
    try:
        return changed_code() or []
    except (OSError, subprocess.SubprocessError):
        return []


def device_name(device) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def command_line(prog: str, argv: list[str] | None) -> str:
    return " ".join([prog, *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])


def meta(command: str, device="cpu", **extra) -> dict:
    commit, dirty = git_commit()
    return {"command": command, "git_commit": commit, "git_dirty": dirty,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": device_name(device),
            "torch": torch.__version__, "python": platform.python_version(), **extra}


def file_record(path) -> dict:
    """{path (absolute), bytes, mtime (UTC), sha256} of a file."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "bytes": st.st_size,
            "mtime": _dt.datetime.fromtimestamp(st.st_mtime, _dt.timezone.utc).isoformat(timespec="seconds"),
            "sha256": file_sha256(p)}


def weight_files(*models) -> list[dict]:
    """`file_record` of every pretrained file the given loaded models / VBench scorers were read from (their
    `weight_files`; None, strings and randomly initialised models read none)."""
    from .weights import used_files
    return [file_record(p) for p in used_files(*models)]


def emit_json(res: dict, out=None) -> None:
    """A results dict as indented JSON: written to `out` (when given, with a 'wrote' line) and printed."""
    import json
    text = json.dumps(res, indent=1)
    if out:
        Path(out).write_text(text + "\n")
        print(f"wrote {out}")
    print(text)
