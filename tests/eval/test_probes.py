"""The GPU probes' CPU parts: placement_probe's and flush_probe's command lines (bad input and a machine without a
GPU: one line, exit 2), the copies placement_probe times and its summary."""
from __future__ import annotations

import pytest
import torch

import qvg
from qvg.eval import flush_probe as fp
from qvg.eval import placement_probe as pp
from qvg.sequence import PackedSequence


@pytest.mark.parametrize("tool,argv,msg", [
    (pp, ["--buffers", "0"], "--buffers must be in [1, 64] and --rounds >= 1"),
    (pp, ["--buffers", "65"], "--buffers must be in [1, 64]"), (pp, ["--rounds", "x"], "--rounds"),
    (pp, [], "needs a CUDA GPU"), (pp, ["--out", "/proc/x"], "cannot write to '/proc'"),
    (fp, ["--reps", "0"], "--rounds and --reps must be >= 1"),
    (fp, ["--rounds", "-1"], "--rounds and --reps must be >= 1"), (fp, ["--reps", "2.5"], "--reps"),
    (fp, [], "needs a CUDA GPU"), (fp, ["--out", "/proc/x"], "cannot write to '/proc'")])
def test_bad_input_and_no_gpu_are_one_line(tool, argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        raise SystemExit(tool.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    prog = tool.__name__.rsplit(".", 1)[1]
    assert e.value.code == 2 and len(err) == 1 and msg in err[0] and f"{prog}: error:" in err[0], err


def test_copies_hold_the_same_bits_elsewhere():
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    p = qvg.compress(x, "qvg", centroids=4)
    for obj in (p, PackedSequence.from_chunks([p, p])):
        q = pp._copy(obj)
        assert type(q) is type(obj) and q.tensors.keys() == obj.tensors.keys()
        for k, v in obj.tensors.items():
            assert torch.equal(q.tensors[k], v) and q.tensors[k].data_ptr() != v.data_ptr()


def test_summary():
    s = pp._summary([[1.0, 1.1, 0.9], [2.0, 2.0, 2.0]])
    assert s["median_ms"] == [1.0, 2.0] and s["max_over_min"] == 2.0
    assert s["largest_spread_over_rounds"] == pytest.approx(0.2)
