"""eval/provenance.py: which files differ from the commit, and when it cannot say."""
from qvg.eval import provenance


def test_changed_files_says_nothing_when_qvg_commit_names_the_commit(monkeypatch):
    monkeypatch.setenv("QVG_COMMIT", "abc1234")
    assert provenance.changed_files() is None
    monkeypatch.delenv("QVG_COMMIT")
    assert isinstance(provenance.changed_files(), list)
