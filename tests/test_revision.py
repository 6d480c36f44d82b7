"""The commit a result names (qvg.revision): QVG_COMMIT first (the GPU machine's copy of the tree carries stale git
metadata), else the checkout's HEAD; the CLI's report and the eval tools all read it there."""
import subprocess

from qvg.app.generate import _commit
from qvg.revision import REPO, code_commit, git_commit


def test_qvg_commit_overrides_git(monkeypatch):
    monkeypatch.setenv("QVG_COMMIT", "abc1234")
    assert git_commit() == ("abc1234", None) and code_commit() == "abc1234" and _commit() == "abc1234"


def test_checkout_head_without_override(monkeypatch):
    monkeypatch.delenv("QVG_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    want = head.stdout.strip() if head.returncode == 0 else "unknown"
    commit, dirty = git_commit()
    assert commit == want and (dirty is None) == (want == "unknown")
    assert code_commit() == want + ("-dirty" if dirty else "")
    assert _commit() == code_commit() if want != "unknown" else _commit().endswith("(no git checkout)")


def test_a_changed_tree_is_marked(monkeypatch):
    monkeypatch.delenv("QVG_COMMIT", raising=False)
    monkeypatch.setattr("qvg.revision.git_commit", lambda: ("abc1234", True))
    assert code_commit() == "abc1234-dirty" and _commit() == "abc1234-dirty"


def test_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("QVG_COMMIT", raising=False)
    monkeypatch.setattr("qvg.revision.REPO", tmp_path)  # (no .git there)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_commit() == ("unknown", None) and _commit().endswith("(no git checkout)")
