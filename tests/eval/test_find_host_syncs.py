"""find_host_syncs' counting (CPU: torch's sync-debug warnings are emitted by hand)."""
import traceback
import warnings

import torch

from qvg.eval import find_host_syncs as fhs


def test_counts_sync_warnings_by_site_and_passes_others_on(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 2)
    monkeypatch.setattr(fhs, "_site", lambda stack: "here")
    passed = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: passed.append(str(a[0])))

    def chunk():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("something else", UserWarning)
    assert fhs.count_syncs(chunk) == {"here": 3}
    assert passed == ["something else"] and modes == ["warn", 2]  # (the mode before is restored)


def test_site_is_the_innermost_project_frame():
    stack = [traceback.FrameSummary("/x/site-packages/torch/nn/modules/module.py", 1, "f", line="a"),
             traceback.FrameSummary(str(fhs.REPO / "pipelines" / "causal_wan.py"), 77, "g", line="ids.to(dev)"),
             traceback.FrameSummary("/x/site-packages/torch/cuda/__init__.py", 9, "h", line="b")]
    assert fhs._site(stack) == "pipelines/causal_wan.py:77 ids.to(dev)"
    assert fhs._site(stack[:1]) == "(no Python frame)"
    other = traceback.FrameSummary("/usr/lib/python3.12/threading.py", 5, "run", line="x()")
    assert fhs._site([other, stack[0]]) == "(outside the project) /usr/lib/python3.12/threading.py:5 x()"
