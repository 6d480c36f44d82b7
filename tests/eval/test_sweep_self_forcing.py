"""`qvg-eval sweep --pipeline self-forcing`: the sweep through qvg-generate's own code (`GenerateRunner`) on a tiny
random Self-Forcing checkpoint in the original layout (tests/pipelines/test_checkpoints.py writes it): prompts x
seeds x methods, mp4s written and read back, the chunk layout of Wan's VAE (9 frames, then 12), the cache bytes of
qvg-generate's JSON, both floors. The generator runs at 32 x 64 instead of Wan's 480 x 832 (the one change,
`Loaded.latent_hw`) so that the 6 videos take seconds on a CPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def sf_checkpoint(tmp_path_factory):
    path = Path(__file__).resolve().parents[1] / "pipelines" / "test_checkpoints.py"
    spec = importlib.util.spec_from_file_location("_sf_checkpoint_files", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # (skips where the wan packages are missing)
    return mod.write_checkpoint(tmp_path_factory.mktemp("sf"), mod.source_models())


@pytest.fixture
def small_frames(monkeypatch):
    from qvg.app import generate
    load = generate.load_model

    def small(s):
        m = load(s)
        m.latent_hw = (4, 8)  # 32 x 64 frames
        return m
    monkeypatch.setattr(generate, "load_model", small)


def test_sweep_through_qvg_generate(sf_checkpoint, small_frames, tmp_path, capsys):
    from qvg.eval.cli import main
    out = tmp_path / "sw"
    prompt = "a red fox, running through fresh snow"  # prompts are separated by '|': the comma stays in
    assert main(["sweep", str(out), "--pipeline", "self-forcing", "--checkpoint", str(sf_checkpoint),
                 "--inputs", prompt, "--seeds", "0,1", "--methods", "qvg", "--bits", "2", "--kmeans-seeds", "0,1",
                 "--chunks", "2", "--device", "cpu", "--lpips", "none", "--vbench", "none", "--no-progress"]) == 0
    res = json.loads((out / "sweep.json").read_text())
    assert res["layout"] == {"lead": 0, "first": 9, "chunk": 12}
    assert res["meta"]["runner"] == {"pipeline": "self-forcing", "checkpoint": str(sf_checkpoint), "key_storage": "auto"}
    assert res["meta"]["command"].startswith("qvg-eval sweep") and res["meta"]["weight_files"] == []
    # 1 prompt x 2 seeds x (bf16, qvg at k-means seeds 0 and 1), each an mp4 + qvg-generate's JSON
    runs = res["runs"]
    assert len(runs) == 6 and {r["input"] for r in runs} == {prompt}
    assert len(list((out / "videos").glob("run*.mp4"))) == len(list((out / "videos").glob("run*.json"))) == 6
    assert len({r["video"] for r in runs}) == 6  # each run names the mp4 it wrote (method, bits, seeds in the name)
    assert all(Path(r["video"]).is_file() and f"-{r['method']}" in Path(r["video"]).name and
               f"-seed{r['seed']}" in r["video"] for r in runs)
    for r in runs:
        assert r["memory"]["total"] > 0 and r["memory"]["bf16_equivalent"] > 0
        if r["method"] == "bf16":
            assert r["memory"]["compression_ratio"] == pytest.approx(1.0)
        else:
            assert r["vs_ref"]["video"]["frames"] == [0, 21] and r["vs_ref"]["onset"]["frames"] == [0, 9]
            assert len(r["vs_ref"]["frame_psnr"]) == 21  # 2 chunks: 9 + 12 frames, read back from the mp4
    rows = {(r["method"], r["bits"]): r for r in res["table"]}
    assert rows["qvg", 2]["compression_ratio"] > 1 and rows["qvg", 2]["n"] == 2
    assert rows["qvg", 2]["kmeans_seeds"] == 2 and rows["qvg", 2]["onset"]["psnr"]["mean"] > 0
    assert len(res["sampling_floor"]) == 1 and len(res["kmeans_floor"]) == 2
    assert "*floor: qvg: another k-means seed*" in (out / "sweep.md").read_text()
    assert f"wrote {out / 'sweep.json'}" in capsys.readouterr().out
