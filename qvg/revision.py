"""Which code made a result: QVG_COMMIT when set (a copied checkout's git metadata may lag, as in the GPU machine's
copy of the tree), else this checkout's git HEAD. The CLI's report and every eval result file read it here."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty): "unknown" outside a git checkout; dirty = tracked files changed or new Python files
    (`changed_code`; None when QVG_COMMIT gives the commit, or git cannot say)."""
    env = os.environ.get("QVG_COMMIT")
    if env:
        return env, None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return "unknown", None
        changed = changed_code()
        return head.stdout.strip(), (bool(changed) if changed is not None else None)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def changed_code() -> list[str] | None:
    """Paths that make the tree differ from its commit: changed tracked files and untracked, not ignored Python
    files (new code; new results or other untracked data do not count). None where git cannot say."""
    st = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"],
                        capture_output=True, text=True, timeout=10)
    if st.returncode:
        return None
    lines = st.stdout.splitlines()
    return [ln[3:] for ln in lines if not ln.startswith("??") or ln.endswith(".py")]


def code_commit() -> str:
    """The commit as one string (see `git_commit`), "-dirty" appended when the code differs from it (so a copy
    of the tree whose git metadata lags, run without QVG_COMMIT, does not pass for that old commit)."""
    commit, dirty = git_commit()
    return commit + "-dirty" if dirty else commit


def file_sha256(path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 4 MiB blocks."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
