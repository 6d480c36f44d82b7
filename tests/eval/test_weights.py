"""Pretrained weight files that are there but wrong (text junk, another network's state dict, a Hugging Face folder
without its weights): one `BadWeights` line naming the file, and from the CLI one `qvg-eval: error:` line with
status 2, never a traceback; and the record of the files read (path, size, mtime, sha256) in the results' meta."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qvg.eval.cli import main
from qvg.eval.lpips import load_lpips
from qvg.eval.provenance import weight_files
from qvg.eval.vbench.backbones import DINO_FILE, load_aesthetic_head, load_clip, load_dino, vit_layout
from qvg.eval.vbench.musiq import load_musiq
from qvg.eval.weights import FILES, BadWeights, read_state_dict

from test_lpips import _linear_file, _torchvision_file
from test_vbench import CLIP, VIT, _to_dino

JUNK = b"junk\n"  # what made torch's weights-only unpickler raise a bare KeyError


@pytest.fixture
def video(tmp_path):
    path = tmp_path / "v.npy"
    np.save(path, (np.random.default_rng(0).random((3, 32, 32, 3)) * 255).astype(np.uint8))
    return str(path)


def _lpips_folder(root: Path) -> Path:
    (root / "lpips").mkdir(parents=True)
    _torchvision_file("alex", root / FILES["alexnet"].name)
    _linear_file("alex", root / FILES["lpips-alex"].name)
    return root


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-eval: error: "), err
    assert all(n in err[0] for n in needles), err
    return err[0]


def test_a_text_file_as_weights_says_what_the_unpicklers_bare_key_means(tmp_path):
    f = tmp_path / "w.pth"
    f.write_bytes(b"junk\n")  # (torch.load's unpickler fails with KeyError: 174812789)
    with pytest.raises(BadWeights, match=r"not a weights-only torch state dict \(corrupt, or not a file torch.save"):
        read_state_dict(f)
    from qvg.eval.weights import reading
    with pytest.raises(BadWeights, match=r"w.pth: not a DINO ViT checkpoint \(KeyError: 'cls_token'\)"):
        with reading(f, "a DINO ViT checkpoint"):  # (a key the checkpoint lacks is named, not called corrupt)
            raise KeyError("cls_token")


@pytest.mark.parametrize("content", [JUNK, b"<html>not found</html>", b""])
def test_read_state_dict_junk_is_bad_weights(tmp_path, content):
    f = tmp_path / "w.pth"
    f.write_bytes(content)
    with pytest.raises(BadWeights, match=f"{f}: not a weights-only torch state dict"):
        read_state_dict(f)
    torch.save([torch.zeros(1)], f)  # a list, not a dict
    with pytest.raises(BadWeights, match="not a state dict"):
        read_state_dict(f)
    (tmp_path / "w.safetensors").write_bytes(JUNK)
    with pytest.raises(BadWeights, match="w.safetensors: not a safetensors file"):
        read_state_dict(tmp_path / "w.safetensors")


def test_lpips_wrong_backbone_file(tmp_path, video, capsys):
    w = _lpips_folder(tmp_path / "w")
    backbone = w / FILES["alexnet"].name
    torch.save({"conv.weight": torch.zeros(3, 3)}, backbone)  # not torchvision's AlexNet, beside a valid lpips/alex
    with pytest.raises(BadWeights, match="not torchvision's alex features"):
        load_lpips("alex", w)
    assert main(["compare", video, video, "--weights", str(w), "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, "LPIPS weights", str(backbone), "not torchvision's alex features")
    backbone.write_bytes(JUNK)
    assert main(["compare", video, video, "--weights", str(w), "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, str(backbone), "not a weights-only torch state dict")
    _torchvision_file("alex", backbone)
    (w / FILES["lpips-alex"].name).write_bytes(JUNK)
    assert main(["compare", video, video, "--weights", str(w), "--out", str(tmp_path / "c")]) == 2
    _one_error_line(capsys, "lpips/alex.pth")
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("dim,path", [("subject_consistency", f"dino-vitb16/{DINO_FILE}"),
                                      ("imaging_quality", FILES["musiq"].name)])
def test_vbench_junk_file(tmp_path, video, capsys, dim, path):
    f = tmp_path / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(JUNK)
    with pytest.raises(BadWeights, match="not a weights-only torch state dict"):
        (load_dino if dim == "subject_consistency" else load_musiq)(tmp_path)
    assert main(["vbench", video, "--dims", dim, "--weights", str(tmp_path)]) == 2
    _one_error_line(capsys, "VBench weights", str(f), "not a weights-only torch state dict")


def test_dino_file_of_another_network(tmp_path):
    (tmp_path / "dino-vitb16").mkdir()
    torch.save({"cls_token": torch.zeros(1, 1, 64)}, tmp_path / "dino-vitb16" / DINO_FILE)
    with pytest.raises(BadWeights, match=f"{DINO_FILE}: not a DINO ViT checkpoint"):
        load_dino(tmp_path)


@pytest.mark.parametrize("key,dim", [("clip-b32", "background_consistency"), ("clip-l14", "aesthetic_quality"),
                                     ("dino", "subject_consistency")])
def test_hugging_face_folder_without_weights(tmp_path, video, capsys, key, dim):
    folder = tmp_path / FILES[key].name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(BadWeights, match=f"{folder}: not a Hugging Face"):
        load_dino(tmp_path) if key == "dino" else load_clip(key, tmp_path)
    assert main(["vbench", video, "--dims", dim, "--weights", str(tmp_path)]) == 2
    _one_error_line(capsys, "VBench weights", str(folder), "not a Hugging Face")
    (folder / "config.json").write_text("not json")
    with pytest.raises(BadWeights, match=str(folder)):
        load_dino(tmp_path) if key == "dino" else load_clip(key, tmp_path)


def test_aesthetic_head_junk(tmp_path):
    f = tmp_path / FILES["laion-aesthetic"].name
    f.write_bytes(JUNK)
    with pytest.raises(BadWeights, match=str(f)):
        load_aesthetic_head(tmp_path)
    torch.save({"weight": torch.ones(1, 768), "bias": torch.zeros(2)}, f)
    with pytest.raises(BadWeights, match="LAION linear head"):
        load_aesthetic_head(tmp_path)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_compare_records_the_weight_files(tmp_path, video):
    w = _lpips_folder(tmp_path / "w")
    assert main(["compare", video, video, "--weights", str(w), "--out", str(tmp_path / "c")]) == 0
    rec = json.loads((tmp_path / "c.json").read_text())["meta"]["weight_files"]
    files = [w / FILES["alexnet"].name, w / FILES["lpips-alex"].name]
    assert [r["path"] for r in rec] == [str(f.resolve()) for f in files]
    assert [r["sha256"] for r in rec] == [_sha(f) for f in files]
    assert [r["bytes"] for r in rec] == [f.stat().st_size for f in files] and rec[0]["mtime"].endswith("+00:00")
    assert main(["compare", video, video, "--lpips", "none", "--out", str(tmp_path / "n")]) == 0
    assert json.loads((tmp_path / "n.json").read_text())["meta"]["weight_files"] == []


def test_vbench_records_the_weight_files(tmp_path, video, tiny_backbones):
    ref = load_dino(config=VIT)
    (tmp_path / "dino-vitb16").mkdir()
    torch.save(_to_dino(ref.state_dict(), 2, vit_layout(ref)), tmp_path / "dino-vitb16" / DINO_FILE)
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    clip = tmp_path / FILES["clip-b32"].name
    CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP)).save_pretrained(clip)
    out = tmp_path / "vb.json"
    assert main(["vbench", video, "--dims", "subject_consistency,background_consistency", "--weights",
                 str(tmp_path), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rec = {Path(r["path"]).name: r for r in res["meta"]["weight_files"]}
    assert set(rec) == {DINO_FILE, "config.json", "model.safetensors"}
    assert rec["model.safetensors"]["sha256"] == _sha(clip / "model.safetensors")
    assert 0 <= res["videos"][video]["background_consistency"] <= 1


def test_report_records_the_weight_files(tmp_path, tiny_runner, tiny_preset):
    from qvg.eval import report
    w = _lpips_folder(tmp_path / "w")
    model = load_lpips("alex", w)
    res = report.run(tmp_path / "rep", tiny_preset, tiny_runner, command="test", lpips_model=model,
                     progress=False, skip=("sweep", "long", "block", "kv", "warm", "rope"))
    assert res["meta"]["weight_files"] == weight_files(model) and len(weight_files(model)) == 2
    saved = json.loads((tmp_path / "rep" / "results.json").read_text())["meta"]["weight_files"]
    assert saved[1]["sha256"] == _sha(w / FILES["lpips-alex"].name)
    assert f"`{saved[0]['path']}`" in (tmp_path / "rep" / "report.md").read_text()


def test_eval_extra_has_the_backbones_package():
    tomllib = pytest.importorskip("tomllib")  # python >= 3.11
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("eval", "test"):
        names = {d.split(">")[0].split("=")[0].split(";")[0].strip() for d in extras[extra]}
        assert {"transformers", "matplotlib"} <= names, extra


def test_another_models_folder_is_refused_not_scored(tmp_path, video, capsys):
    """A Hugging Face folder of another model under a backbone's name (transformers fills the tensors it lacks
    with random values: the scores were random-weight scores, status 0), or a ViT of another patch size, is one
    error line naming the folder; transformers' load report (a table of every key) is not printed."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, ViTConfig, ViTModel
    dino = tmp_path / "a" / "dino-vitb16"
    CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP)).save_pretrained(dino)
    capsys.readouterr()  # (save_pretrained's own progress bar)
    assert main(["vbench", video, "--dims", "subject_consistency", "--weights", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, str(dino), "not DINO ViT-B/16 weights", "tensors are not in the folder")
    clip = tmp_path / "b" / FILES["clip-b32"].name
    ViTModel(ViTConfig(**VIT), add_pooling_layer=False).save_pretrained(clip)
    with pytest.raises(BadWeights, match="not CLIP ViT-B/32 weights"):
        load_clip("clip-b32", tmp_path / "b")
    ViTModel(ViTConfig(**{**VIT, "patch_size": 8}), add_pooling_layer=False).save_pretrained(tmp_path / "c" /
                                                                                            "dino-vitb16")
    with pytest.raises(BadWeights, match="a model of patch size 8, hidden size 64, not DINO ViT-B/16"):
        load_dino(tmp_path / "c")
    ViTModel(ViTConfig(**VIT), add_pooling_layer=False).save_pretrained(tmp_path / "d" / "dino-vitb16")
    with pytest.raises(BadWeights, match="a model of hidden size 64, not DINO ViT-B/16 .patch size 16, hidden "
                                         "size 768."):  # (every tensor filled, patch 16: a smaller ViT)
        load_dino(tmp_path / "d")
    vit = ViTModel(ViTConfig(**VIT), add_pooling_layer=False)
    (tmp_path / "e" / "dino-vitb16").mkdir(parents=True)
    torch.save(_to_dino(vit.state_dict(), 2, vit_layout(vit)), tmp_path / "e" / "dino-vitb16" / DINO_FILE)
    with pytest.raises(BadWeights, match=f"{DINO_FILE}: a model of hidden size 64"):  # (VBench's .pth form too)
        load_dino(tmp_path / "e")


def test_a_folder_of_the_right_model_loads(tmp_path, tiny_backbones):
    """With the check's numbers those of the tests' tiny ViT, its folder loads (every tensor filled)."""
    from transformers import ViTConfig, ViTModel
    ViTModel(ViTConfig(**VIT), add_pooling_layer=False).save_pretrained(tmp_path / "dino-vitb16")
    assert load_dino(tmp_path).config.hidden_size == 64
