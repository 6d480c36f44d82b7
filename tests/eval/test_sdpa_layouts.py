"""eval/sdpa_layouts.py: the K/V layouts it times hold the same values (GPU), and it refuses to run without one."""
import json

import pytest
import torch

from qvg.eval import sdpa_layouts


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_refuses_without_a_gpu(capsys):
    assert sdpa_layouts.main(["--keys", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_layouts_hold_the_same_values_and_the_run_writes_its_file(tmp_path):
    pairs = sdpa_layouts.layouts(1000, h=2, d=64, chunk=100)
    k0, v0 = pairs["contiguous"]
    for name, (k, v) in pairs.items():
        assert torch.equal(k, k0) and torch.equal(v, v0), name
    assert sdpa_layouts.main(["--keys", "4680", "--rounds", "1", "--out", str(tmp_path)]) == 0
    res = json.loads(next(tmp_path.glob("sdpa-layouts-*.json")).read_text())
    assert {r["layout"] for r in res["rows"]} == set(pairs) and res["commit"]
    assert all(r["max_abs_diff_vs_contiguous"] < 1e-2 for r in res["rows"])
