"""Which code made a result: QVG_COMMIT when set (a copied checkout's git metadata may lag, as in the GPU machine's
copy of the tree), else this checkout's git HEAD. The CLI's report and every eval result file read it here."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty): "unknown" outside a git checkout; dirty = tracked files changed (None when QVG_COMMIT gives
    the commit, or git cannot say)."""
    env = os.environ.get("QVG_COMMIT")
    if env:
        return env, None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return "unknown", None
        st = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), (bool(st.stdout.strip()) if st.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def code_commit() -> str:
    """The commit as one string (see `git_commit`), "-dirty" appended when tracked files differ from it (so a copy
    of the tree whose git metadata lags, run without QVG_COMMIT, does not pass for that old commit)."""
    commit, dirty = git_commit()
    return commit + "-dirty" if dirty else commit
