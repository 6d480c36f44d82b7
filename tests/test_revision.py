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


def test_new_python_files_make_the_tree_dirty_new_data_does_not(monkeypatch, tmp_path):
    from qvg.eval.provenance import changed_files
    monkeypatch.delenv("QVG_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("ignored.py\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    monkeypatch.setattr("qvg.revision.REPO", tmp_path)
    assert git_commit()[1] is False and changed_files() == []
    (tmp_path / "result.json").write_text("{}")  # new data: still clean
    (tmp_path / "ignored.py").write_text("")  # ignored: still clean
    assert git_commit()[1] is False and changed_files() == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "new.py").write_text("y = 2\n")  # new code
    assert git_commit()[1] is True and changed_files() == ["pkg/new.py"]
    (tmp_path / "a.py").write_text("x = 3\n")  # a changed tracked file
    assert sorted(changed_files()) == ["a.py", "pkg/new.py"]
