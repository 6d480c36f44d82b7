"""tests/optional_deps.py: a missing optional dependency skips (also from a test module's top, as tests/app/test_ui.py
asks for gradio_client) and fails under CI."""
import pytest

from optional_deps import missing, need


def test_missing_module_skips_and_may_be_asked_at_module_level(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as e:
        need("no_such_module_for_qvg_tests", "nothing to install")
    assert e.value.allow_module_level  # (without it, a module-level call is a collection error)
    assert "no_such_module_for_qvg_tests is not installed (nothing to install)" in str(e.value)


def test_missing_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI"):
        missing("chromium is not installed", "playwright install chromium")


def test_present_module_is_returned():
    import json
    assert need("json", "stdlib") is json
