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


def test_new_tokens_keep_the_centres_and_move_more_tokens(tmp_path):
    """--next-chunk new-tokens: the same cluster centres (the first chunk's pack warm-starts it), other tokens; more
    of them change cluster in the second assignment than with the benchmark's noisy copy."""
    from qvg.eval.bench_kernels import clustered, next_chunk
    shape = (1, 1, 600, 128)
    x0 = clustered(shape, seed=1, device="cpu")
    x1 = next_chunk(x0, shape, "new-tokens")
    assert x1.shape == x0.shape and not torch.equal(x1, x0)
    assert torch.equal(clustered(shape, seed=1, device="cpu", token_seed=2), x1)
    moved = {}
    for kind in ("noisy", "new-tokens"):
        assert moved_tokens.main(["--heads", "1", "--tokens", "600", "--next-chunk", kind, "--out", str(tmp_path)]) == 0
        res = json.loads((tmp_path / "moved-tokens.json").read_text())
        assert res["next_chunk"] == kind
        moved[kind] = sum(r["moved"] for r in res["rows"])
    assert moved["new-tokens"] > moved["noisy"]


def test_sweep_update_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        return
    assert sweep_update.main([]) == 2
    assert capsys.readouterr().err.strip() == "error: sweep_update needs a CUDA GPU"
