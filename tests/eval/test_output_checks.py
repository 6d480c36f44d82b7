"""The standalone analysis tools (kv_analysis, rope_storage, centroid_precision, warm_iters) check --out before their work (one
line, status 2, nothing run) and write their files all or none (a failure after the work: one line, status 1,
nothing written)."""
from __future__ import annotations

import errno

import pytest
import torch

from qvg import outputs
from qvg.eval import centroid_precision, kv_analysis, rope_storage, warm_iters


OUT_NAME = {kv_analysis: "kv_analysis.json", rope_storage: "rope_storage.md",
            centroid_precision: "centroid_precision.md", warm_iters: "warm_iters.md"}


def _never(*a, **k):
    raise AssertionError("the work ran before --out was checked")


@pytest.mark.parametrize("tool", [kv_analysis, rope_storage, centroid_precision, warm_iters])
def test_bad_out_is_one_line_before_any_work(tool, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tool, "run", _never)
    (tmp_path / "f").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / OUT_NAME[tool]).mkdir()  # (a folder where an output file goes)
    for out, msg in ((tmp_path / "f", "is not a folder"), (tmp_path / "f" / "sub", "is not a folder"),
                     ("/proc/qvg-out", "cannot write to '/proc'"), ("", "empty: give a folder"),
                     (tmp_path / "dangling", "is a symlink to nothing"), (tmp_path / "d", "is a directory")):
        with pytest.raises(SystemExit) as e:
            code = tool.main(["--out", str(out)])
            raise SystemExit(code)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "error: --out: " in err[0] and msg in err[0], err


def test_kv_analysis_writes_all_or_none(tmp_path, capsys, monkeypatch):
    """A full disk while the PNG is written: neither the JSON nor the markdown is put in place; the error names
    the file."""
    res = {"meta": {"quick": True}}
    monkeypatch.setattr(kv_analysis, "run", lambda **k: res)
    monkeypatch.setattr(kv_analysis, "to_markdown", lambda r: "# md\n")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(kv_analysis, "_plot", full)
    with pytest.raises(SystemExit) as e:
        kv_analysis.main(["--out", str(tmp_path / "out"), "--quick", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err == [
        f"python -m qvg.eval.kv_analysis: error: cannot write {str(tmp_path / 'out' / 'kv_analysis.png')!r}: "
        "No space left on device; nothing written"]
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("seed,msg", [("-1", "must be in [0, 9223372036854775800], got -1"),
                                      ("9223372036854775807", "must be in [0, 9223372036854775800]"),
                                      ("x", "must be an integer, got 'x'")])
def test_kv_analysis_seed_out_of_range_is_one_line(tmp_path, capsys, seed, msg):
    """(--seed -1 was a traceback from the k-means, after the parse)"""
    with pytest.raises(SystemExit) as e:
        kv_analysis.main(["--out", str(tmp_path / "out"), "--quick", "--no-progress", "--seed", seed])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"argument --seed: {msg}" in err[0], err


def _tiny_precision_run(seeds):
    x = torch.randn(1, 1, 128, 64, generator=torch.Generator().manual_seed(0))
    return {"sets": [{"data": "synthetic", "tensor": "K", "K": 4, "rows": centroid_precision.measure(x, 4, seeds)}]}


def _tiny_warm_run(seeds):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 1, 128, 64, generator=g) for _ in range(3)]
    return {"sets": [{"data": "synthetic", "tensor": "K", "K": 4, "rows": warm_iters.measure(xs, 4, seeds)}],
            "chunks": 3, "seeds": seeds}


@pytest.mark.parametrize("tool,run,names", [
    (rope_storage, lambda **k: {"rows": []}, ["rope_storage.json", "rope_storage.md"]),
    (centroid_precision, _tiny_precision_run, ["centroid_precision.json", "centroid_precision.md"]),
    (warm_iters, lambda seeds, chunks: _tiny_warm_run(seeds), ["warm_iters.json", "warm_iters.md"])])
def test_json_and_markdown_written_both_or_none(tool, run, names, tmp_path, capsys, monkeypatch):
    """A full disk while the second file is written: neither is put in place (one line, status 1); then both."""
    monkeypatch.setattr(tool, "run", run)
    real = outputs.atomic
    calls = []

    def failing_second(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path)
    monkeypatch.setattr(outputs, "atomic", failing_second)
    assert tool.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing written" in err[0] and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(outputs, "atomic", real)
    assert tool.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_warm_iters_chains_warm_start_as_the_cache_does(capsys):
    """A chain's chunk i > 0 is compressed warm from the centroids stored for chunk i - 1 (what the cache's commits
    do), and the summary's ratio at 2 iterations is 1; --chunks out of range is one line, status 2."""
    from qvg.compression import resolve_options
    from qvg.compression.prq import COLD_ITERS, compress_torch
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 2, 96, 64, generator=g) for _ in range(3)]
    rel = warm_iters.chain(xs, "qvg-pro", 4, 0, 1)
    o = {**resolve_options("qvg-pro", tuple(xs[0].shape), bits=2, centroids=4), "seed": 0}
    t0 = compress_torch(xs[0], o, None, COLD_ITERS)
    t1 = compress_torch(xs[1], o, t0["centroids"].reshape(o["stages"], 2, 4, 64), 1)
    import qvg
    from qvg.packed import Packed
    y = qvg.decompress(Packed("qvg-pro", tuple(xs[1].shape), xs[1].dtype, t1, o))
    assert len(rel) == 2 and rel[0] == pytest.approx(float((y - xs[1]).pow(2).mean() / xs[1].pow(2).mean()))
    res = {"sets": [{"data": "synthetic", "tensor": "K", "K": 4, "rows": warm_iters.measure(xs, 4, [0, 1])}]}
    rows = {(r["method"], r["iters"]): r for r in warm_iters.summary(res)}
    assert rows[("qvg-pro", 2)]["ratio_mean"] == 1 and rows[("qvg-pro", 1)]["seed_floor"] is not None
    assert warm_iters.main(["--chunks", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chunks must be in [2, 8], got 1" in err[0]
