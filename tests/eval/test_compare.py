"""qvg-eval compare: windows, the onset / divergence frame, the CLI on mp4 files, and no torchvision."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from qvg.eval.cli import main
from qvg.eval.compare import chunk_bounds, compare


def test_chunk_bounds():
    assert chunk_bounds(10, lead=1, first=3, chunk=3) == [(1, 4), (4, 7), (7, 10)]
    assert chunk_bounds(9, lead=1, first=3, chunk=3) == [(1, 4), (4, 7), (7, 9)]
    assert chunk_bounds(33, lead=0, first=9, chunk=12) == [(0, 9), (9, 21), (21, 33)]


def test_windows_and_first_below():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(3, 10, 32, 32, generator=g) * 2 - 1
    test = ref.clone()
    test[:, 7:] += 0.2 * torch.randn(3, 3, 32, 32, generator=g)  # diverges from frame 7 (the last chunk)
    r = compare(ref, test, lead=1, first=3, chunk=3, onset_chunks=1)
    assert r["windows"]["onset"]["frames"] == [1, 4] and r["windows"]["onset"]["psnr"] == 100.0
    assert [c["frames"] for c in r["windows"]["chunks"]] == [[1, 4], [4, 7], [7, 10]]
    assert r["first_below"] == 7 and r["windows"]["chunks"][2]["psnr"] < 30
    assert r["windows"]["video"]["ssim"] < 1 and r["frames"]["lpips"] is None
    assert compare(ref, test, lead=1, onset_chunks=3)["windows"]["onset"]["frames"] == [1, 10]
    assert not any(c["partial"] for c in r["windows"]["chunks"])
    cut = compare(ref[:, :9], test[:, :9], lead=1)["windows"]["chunks"]  # (the last chunk cut by the video's end)
    assert [c["partial"] for c in cut] == [False, False, True] and cut[2]["frames"] == [7, 9]
    with pytest.raises(ValueError, match="differ in shape"):
        compare(ref, test[:, :5])


def _write_mp4(path, frames: np.ndarray, report: dict | None = None):
    import imageio.v2 as imageio
    with imageio.get_writer(str(path), fps=8, codec="libx264", quality=8, macro_block_size=1) as w:
        for f in frames:
            w.append_data(f)
    if report is not None:
        path.with_suffix(".json").write_text(json.dumps(report))


def test_cli_compare_mp4(tmp_path, capsys):
    rng = np.random.default_rng(0)
    base = (rng.random((10, 32, 32, 3)) * 255).astype(np.uint8)
    noisy = np.clip(base.astype(int) + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    _write_mp4(tmp_path / "ref.mp4", base, {"pipeline": "tiny"})
    _write_mp4(tmp_path / "test.mp4", noisy)
    assert main(["compare", str(tmp_path / "ref.mp4"), str(tmp_path / "test.mp4"), "--out", str(tmp_path / "c"),
                 "--lpips", "none"]) == 0
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["layout"] == {"lead": 1, "first": 3, "chunk": 3, "frames": 10}  # from ref.json: the embedded model
    assert len(res["frames"]["psnr"]) == 10 and res["windows"]["onset"]["frames"] == [1, 4]
    assert res["meta"]["command"].startswith("qvg-eval compare") and res["meta"]["git_commit"]
    assert (tmp_path / "c.png").stat().st_size > 0
    assert "onset (1-3)" in capsys.readouterr().out


def test_cli_compare_default_out_keeps_the_reports(tmp_path, capsys):
    """The default output stem is TEST + ".compare": it writes qvg.compare.json / .png beside qvg.mp4 and leaves
    qvg.json (qvg-generate's report of that video) alone; a stem given with ".json" is not doubled."""
    rng = np.random.default_rng(1)
    base = (rng.random((7, 16, 16, 3)) * 255).astype(np.uint8)
    _write_mp4(tmp_path / "ref.mp4", base, {"pipeline": "tiny"})
    _write_mp4(tmp_path / "qvg.mp4", base, {"pipeline": "tiny", "method": "qvg"})
    assert main(["compare", str(tmp_path / "ref.mp4"), str(tmp_path / "qvg.mp4"), "--lpips", "none"]) == 0
    assert json.loads((tmp_path / "qvg.json").read_text()) == {"pipeline": "tiny", "method": "qvg"}
    assert "windows" in json.loads((tmp_path / "qvg.compare.json").read_text())
    assert (tmp_path / "qvg.compare.png").stat().st_size > 0
    assert main(["compare", str(tmp_path / "ref.mp4"), str(tmp_path / "qvg.mp4"), "--lpips", "none",
                 "--out", str(tmp_path / "named.json")]) == 0
    assert (tmp_path / "named.json").exists() and (tmp_path / "named.png").exists()
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'qvg.compare.json'}" in out and f"wrote {tmp_path / 'named.json'}" in out


def test_a_failed_write_leaves_the_old_outputs_and_names_its_file(tmp_path, capsys, monkeypatch):
    """A full disk while the PNG is written: the JSON is not put in place either (the old pair stays), and the one
    error line names the file."""
    import errno

    from qvg.eval import compare as cmp
    rng = np.random.default_rng(2)
    base = (rng.random((7, 16, 16, 3)) * 255).astype(np.uint8)
    _write_mp4(tmp_path / "ref.mp4", base, {"pipeline": "tiny"})
    _write_mp4(tmp_path / "test.mp4", base)
    (tmp_path / "c.json").write_text("old")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(cmp, "plot", full)
    args = ["compare", str(tmp_path / "ref.mp4"), str(tmp_path / "test.mp4"), "--out", str(tmp_path / "c"),
            "--lpips", "none"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qvg-eval: error: [Errno 28] cannot write {str(tmp_path / 'c.png')!r}: No space left on device"]
    assert (tmp_path / "c.json").read_text() == "old" and not (tmp_path / "c.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "ref.json", "ref.mp4", "test.mp4"]


def test_unreadable_report_beside_ref_is_named(tmp_path, capsys):
    """A corrupt JSON beside REF is said to be unreadable (not "no report"), and the default layout is used."""
    base = (np.random.default_rng(3).random((7, 16, 16, 3)) * 255).astype(np.uint8)
    _write_mp4(tmp_path / "ref.mp4", base)
    (tmp_path / "ref.json").write_text("{not json")
    assert main(["compare", str(tmp_path / "ref.mp4"), str(tmp_path / "ref.mp4"), "--out", str(tmp_path / "c"),
                 "--lpips", "none"]) == 0
    err = capsys.readouterr().err
    assert f"{str(tmp_path / 'ref.json')!r}, beside REF, is not a qvg-generate report: chunk layout lead 0" in err


def test_cli_errors(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope.mp4"), str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-eval: error: REF: no such file")
    assert main(["report", str(tmp_path), "--preset", "huge"]) == 2
    assert "--preset must be one of" in capsys.readouterr().err


def test_lpips_missing_weights_message(tmp_path, capsys):
    v = (np.random.default_rng(1).random((4, 32, 32, 3)) * 255).astype(np.uint8)
    np.save(tmp_path / "a.npy", v)
    (tmp_path / "w").mkdir()  # (without the files)
    assert main(["compare", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"), "--weights", str(tmp_path / "w"),
                 "--out", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "LPIPS not computed: missing" in err and "alexnet-owt-7be5be79.pth" in err
    assert json.loads((tmp_path / "c.json").read_text())["meta"]["lpips"].startswith("not computed")


# Records every module that asks for torchvision (the first frame outside the import machinery) and lets the import
# go on: a third-party package may import an installed, working torchvision on its own (transformers does, as on the
# GPU image); this project's code must never ask for it. Where torchvision is not installed (CI), every attempt
# reaches the finder, and nothing may end up in sys.modules either.
_WHO_IMPORTS_TORCHVISION = """
import importlib.util, sys, traceback
installed = importlib.util.find_spec("torchvision") is not None
asked = []
class _Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            asked.append(frames[-1].filename)
        return None
sys.meta_path.insert(0, _Watch())
"""


def test_cpu_paths_do_not_import_torchvision(tmp_path):
    import os

    import qvg
    v = (np.random.default_rng(2).random((4, 32, 32, 3)) * 255).astype(np.uint8)
    np.save(tmp_path / "a.npy", v)
    code = (_WHO_IMPORTS_TORCHVISION + f"from qvg.eval.cli import main; "
            f"main(['compare', {str(tmp_path / 'a.npy')!r}, {str(tmp_path / 'a.npy')!r}, '--out', "
            f"{str(tmp_path / 'c')!r}, '--weights', {str(tmp_path)!r}, '--no-progress']); "
            "import qvg.eval.report, qvg.eval.sweep, qvg.eval.analyses, qvg.eval.vbench, qvg.eval.lpips; "
            "from qvg.eval.vbench import load_dimensions; load_dimensions(weights=" + repr(str(tmp_path)) + "); "
            "print(repr((installed, 'torchvision' in sys.modules, asked)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    installed, loaded, asked = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    # this project's folders (not a virtual environment or anything else that sits inside the repository)
    root = os.path.dirname(os.path.dirname(os.path.realpath(qvg.__file__)))
    folders = [os.path.join(root, d) + os.sep for d in ("qvg", "app", "pipelines", "kernels", "eval", "assets")]
    ours = [f for f in asked if f == "<string>" or any(os.path.realpath(f).startswith(d) for d in folders)]
    assert not ours, f"this project's code imports torchvision: {ours}"
    assert installed or not loaded
