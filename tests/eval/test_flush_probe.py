"""qvg.eval.flush_probe's command line (CPU): bad input and a machine without a GPU are one line and exit 2."""
from __future__ import annotations

import pytest
import torch

from qvg.eval import flush_probe as fp


@pytest.mark.parametrize("argv,msg", [(["--reps", "0"], "--rounds and --reps must be >= 1"),
                                      (["--rounds", "-1"], "--rounds and --reps must be >= 1"),
                                      (["--reps", "2.5"], "--reps"), ([], "needs a CUDA GPU"),
                                      (["--out", "/proc/x"], "cannot write to '/proc'")])
def test_bad_input_and_no_gpu_are_one_line(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        raise SystemExit(fp.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and msg in err[0] and "flush_probe: error:" in err[0], err
