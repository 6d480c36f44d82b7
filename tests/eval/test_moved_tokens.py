"""eval/moved_tokens.py (the fraction of tokens the second k-means assignment moves, per PRQ stage) and
eval/sweep_update.py's refusal without a GPU."""
import json

import torch

from qvg.eval import moved_tokens, sweep_update


def test_moved_tokens_writes_one_row_per_stage(tmp_path):
    assert moved_tokens.main(["--heads", "1", "--tokens", "600", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "moved-tokens.json").read_text())
    assert {"device", "date", "commit", "command", "shape", "rows"} <= set(res)
    assert res["shape"] == [1, 1, 600, 128]
    assert [(r["method"], r["stage"]) for r in res["rows"]] == [("qvg", 0)] + [("qvg-pro", s) for s in range(4)]
    assert all(0.0 <= r["moved"] <= 1.0 for r in res["rows"])


def test_sweep_update_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        return
    assert sweep_update.main([]) == 2
    assert capsys.readouterr().err.strip() == "error: sweep_update needs a CUDA GPU"
