"""MUSIQ (VBench's imaging quality): pyiqa's key names and shapes, the multi-scale patches and hashed positions,
the checkpoint loading and its errors, the VBench dimension on random weights, and, where pyiqa's sources can be
found ($QVG_PYIQA_SRC or an installed pyiqa), parity with pyiqa's own module."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qvg.eval.vbench import load_dimensions
from qvg.eval.vbench.musiq import MUSIQ, StdConv, hashed_positions, load_musiq, multiscale_patches
from qvg.eval.vbench.preprocess import musiq_input, vbench_longer
from qvg.eval.weights import FILES, MissingWeights

TINY = dict(patch_size=16, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2, spatial_pos_grid_size=4,
            longer_side_lengths=(32, 48))
PHOTO = Path(__file__).resolve().parents[2] / "assets" / "photos" / "coffee.png"

# pyiqa's MUSIQ as VBench builds it (musiq_spaq_ckpt-358bb6af.pth): parameter names and shapes, read from
# pyiqa/archs/musiq_arch.py (14 blocks: encoderblock_0 .. 13, each with the keys of encoderblock_0)
SPAQ_KEYS = {
    "conv_root.weight": (64, 3, 7, 7), "gn_root.weight": (64,), "gn_root.bias": (64,),
    "block1.conv1.weight": (64, 64, 1, 1), "block1.gn1.weight": (64,), "block1.conv2.weight": (64, 64, 3, 3),
    "block1.gn2.bias": (64,), "block1.conv3.weight": (256, 64, 1, 1), "block1.gn3.weight": (256,),
    "block1.conv_proj.weight": (256, 64, 1, 1), "block1.gn_proj.bias": (256,),
    "embedding.weight": (384, 16384), "embedding.bias": (384,),
    "transformer_encoder.posembed_input.position_emb": (1, 100, 384),
    "transformer_encoder.scaleembed_input.scale_emb": (3, 384), "transformer_encoder.cls": (1, 1, 384),
    "transformer_encoder.encoder_norm.weight": (384,), "transformer_encoder.encoder_norm.bias": (384,),
    "head.weight": (1, 384), "head.bias": (1,)}
BLOCK_KEYS = {"norm1.weight": (384,), "norm1.bias": (384,), "attention.query.weight": (384, 384),
              "attention.query.bias": (384,), "attention.key.weight": (384, 384), "attention.key.bias": (384,),
              "attention.value.weight": (384, 384), "attention.value.bias": (384,),
              "attention.out.weight": (384, 384), "attention.out.bias": (384,), "norm2.weight": (384,),
              "norm2.bias": (384,), "mlp.fc1.weight": (1152, 384), "mlp.fc1.bias": (1152,),
              "mlp.fc2.weight": (384, 1152), "mlp.fc2.bias": (384,)}


def test_spaq_key_names_and_shapes():
    sd = {k: tuple(v.shape) for k, v in MUSIQ().state_dict().items()}
    for k, shape in SPAQ_KEYS.items():
        assert sd[k] == shape, k
    for i in range(14):
        for k, shape in BLOCK_KEYS.items():
            assert sd[f"transformer_encoder.transformer.encoderblock_{i}.{k}"] == shape
    gn = {f"block1.{n}.{p}" for n in ("gn1", "gn2", "gn3", "gn_proj") for p in ("weight", "bias")}
    assert len(sd) == len(SPAQ_KEYS) + 14 * len(BLOCK_KEYS) + len(gn - set(SPAQ_KEYS))
    assert "head.0.weight" in MUSIQ(**TINY, num_class=10).state_dict()  # AVA's head: Linear + Softmax


def test_hashed_positions_and_patches():
    # 7 rows onto a 10-grid: torch's nearest picks floor(i * 10 / 7); a 10 x 10 image maps to itself
    assert hashed_positions(7, 1, 10).tolist() == [0, 10, 20, 40, 50, 70, 80]
    assert hashed_positions(10, 10, 10).tolist() == list(range(100))
    x = torch.rand(2, 3, 70, 100) * 2 - 1
    patches, pos, scale, keep = multiscale_patches(x)
    n224, n384, own = 49, 144, 3 * 4  # ceil(L / 32)^2 padded slots; 70 x 100 -> 3 x 4 patches of its own
    assert patches.shape == (2, n224 + n384 + own, 3 * 32 * 32)
    assert scale[0].tolist() == [0] * 35 + [0] * 14 + [1] * 108 + [0] * 36 + [2] * 12  # 224: 5 x 7, 384: 9 x 12
    assert keep[0].sum() == 35 + 108 + 12 and not keep[0, 35:49].any() and (patches[:, 35:49] == 0).all()
    # the image's own patches: SAME padding puts the 96 - 70 = 26 rows 13 above (and 13 below), 14 | 14 columns
    first = patches[0, n224 + n384].view(3, 32, 32)
    assert (first[:, :13] == 0).all() and torch.equal(first[:, 13:, 14:], x[0, :, :19, :18])


def test_std_conv_ignores_filter_scale_and_offset():
    conv = StdConv(3, 8, 3, 2, bias=False)
    x = torch.randn(1, 3, 9, 9)
    y = conv(x)
    assert y.shape == (1, 8, 5, 5)  # SAME: ceil(9 / 2)
    with torch.no_grad():
        conv.weight.mul_(torch.rand(8, 1, 1, 1) + 0.5).add_(torch.randn(8, 1, 1, 1))
    assert torch.allclose(conv(x), y, rtol=1e-3, atol=1e-3)  # up to the + 1e-5 beside the std


def test_scores_padding_and_batch():
    torch.manual_seed(0)
    m = MUSIQ(**TINY).eval()
    x = torch.rand(3, 3, 40, 56)
    with torch.no_grad():
        s = m(x)
        assert s.shape == (3,) and torch.isfinite(s).all() and s.std() > 0
        assert torch.allclose(m(x[1:2]), s[1:2], atol=1e-5)
        ava = MUSIQ(**TINY, num_class=10).eval()(x)  # softmax over 10 -> expected class in [1, 10]
        assert ((ava >= 1) & (ava <= 10)).all()


def test_checkpoint_loading(tmp_path):
    with pytest.raises(MissingWeights, match="musiq_spaq_ckpt-358bb6af.pth.*put it there"):
        load_musiq(tmp_path)
    torch.manual_seed(1)
    sd = MUSIQ().state_dict()
    f = tmp_path / FILES["musiq"].name
    torch.save({f"module.{k}": v for k, v in sd.items()}, f)  # a DataParallel prefix is dropped, as pyiqa does
    got = load_musiq(tmp_path).state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    sd["head.0.weight"] = sd.pop("head.weight")
    torch.save(sd, f)
    with pytest.raises(ValueError, match=r"not pyiqa's MUSIQ-SPAQ checkpoint \(missing: head.weight; unexpected: "
                                         r"head.0.weight"):
        load_musiq(tmp_path)
    f.write_bytes(b"<html>not found</html>")  # e.g. a failed download
    with pytest.raises(ValueError, match="not a weights-only torch state dict"):
        load_musiq(tmp_path)


def test_vbench_resize_rule():
    x = torch.randint(0, 256, (2, 3, 480, 832), dtype=torch.uint8)
    y = vbench_longer(x)
    s = 512.0 / 832
    assert y.shape[-2:] == (int(s * 480), int(s * 832)) == (295, 512) and y.dtype == torch.float32
    assert not torch.equal(y, y.round())  # float frames: VBench does not round back to uint8
    small = torch.zeros(3, 1, 64, 96) + 0.5
    assert torch.allclose(musiq_input(small), torch.full((1, 3, 64, 96), 191 / 255))  # no resize at <= 512


def test_imaging_quality_dimension():
    dims = load_dimensions(["imaging_quality"], configs={"imaging_quality": TINY})
    iq = dims["imaging_quality"]
    v = torch.rand(3, 3, 40, 60) * 2 - 1
    frames = iq.frame_scores(v)
    assert frames.shape == (3,)
    assert iq(v) == pytest.approx(float(frames.mean()) / 100, rel=1e-6)
    assert "musiq_spaq_ckpt-358bb6af.pth" in load_dimensions(["imaging_quality"], weights="/nonexistent")[
        "imaging_quality"]


def test_musiq_does_not_import_torchvision():
    code = ("import sys, torch; from qvg.eval.vbench.musiq import MUSIQ; from qvg.eval.vbench import "
            f"load_dimensions; d = load_dimensions(['imaging_quality'], configs={{'imaging_quality': {TINY!r}}}); "
            "d['imaging_quality'](torch.zeros(3, 2, 40, 40)); print('torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.fixture(scope="module")
def pyiqa():
    from qvg.eval.musiq_parity import load_pyiqa_musiq, pyiqa_folder
    folder = pyiqa_folder()
    if folder is None:
        pytest.skip("pyiqa's sources not found (set QVG_PYIQA_SRC to the folder holding pyiqa/, e.g. an unzipped "
                    "`pip download pyiqa --no-deps` wheel)")
    return load_pyiqa_musiq(folder)


@pytest.mark.parametrize("config", [TINY, dict(TINY, num_class=10), {}], ids=["tiny", "tiny-ava-head", "spaq"])
def test_parity_with_pyiqa(pyiqa, config):
    import imageio.v2 as imageio
    from qvg.eval.musiq_parity import compare_image, pair
    theirs, ours = pair(pyiqa, 0, **config)
    photo = torch.from_numpy(imageio.imread(PHOTO)[..., :3].copy()).permute(2, 0, 1)[None].float() / 255
    small = torch.nn.functional.interpolate(photo, scale_factor=0.25, mode="area")  # 96 x 64: a quick forward
    for img in (torch.rand(1, 3, 50, 70, generator=torch.Generator().manual_seed(3)), small):
        r = compare_image(pyiqa, theirs, ours, img)
        assert r["patches_max_abs_diff"] <= 1e-6 and r["abs_diff"] <= 1e-5 * max(1.0, abs(r["pyiqa"])), r
