"""LPIPS in pure torch: torchvision's key layout, the lpips package's linear-layer file, the v0.1 formula, the
missing-weights message, and, where the lpips package's sources can be found ($QVG_LPIPS_SRC or an installed lpips),
parity with its own LPIPS (without importing torchvision)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qvg.eval.lpips import LPIPS, NETS, load_lpips, lpips_frames
from qvg.eval.weights import FILES, MissingWeights

# torchvision's alexnet().features / vgg16().features parameters (name: shape), as its state dict holds them
ALEX_KEYS = {"features.0.weight": (64, 3, 11, 11), "features.3.weight": (192, 64, 5, 5),
             "features.6.weight": (384, 192, 3, 3), "features.8.weight": (256, 384, 3, 3),
             "features.10.weight": (256, 256, 3, 3)}
VGG_CONVS = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]
PHOTO = Path(__file__).resolve().parents[2] / "assets" / "photos" / "coffee.png"


def _torchvision_file(net: str, path, seed=0):
    """A random state dict in torchvision's layout (features + classifier), saved as torchvision ships it."""
    g = torch.Generator().manual_seed(seed)
    feats = LPIPS(net).features if net == "alex" else LPIPS("vgg").features
    sd = {f"features.{k}": torch.randn(v.shape, generator=g) * 0.05 for k, v in feats.state_dict().items()}
    sd["classifier.1.weight"] = torch.zeros(4, 4)  # ignored
    torch.save(sd, path)
    return sd


def _linear_file(net: str, path, seed=1):
    g = torch.Generator().manual_seed(seed)
    chans = NETS[net][1]
    sd = {f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1, generator=g) for i, c in enumerate(chans)}
    torch.save(sd, path)
    return sd


@pytest.fixture
def weights(tmp_path):
    _torchvision_file("alex", tmp_path / FILES["alexnet"].name)
    (tmp_path / "lpips").mkdir()
    _linear_file("alex", tmp_path / FILES["lpips-alex"].name)
    return tmp_path


def test_feature_stacks_have_torchvisions_keys():
    sd = LPIPS("alex").features.state_dict()
    for k, shape in ALEX_KEYS.items():
        assert tuple(sd[k[len("features."):]].shape) == shape
    vgg = LPIPS("vgg").features.state_dict()
    assert sorted({int(k.split(".")[0]) for k in vgg}) == VGG_CONVS
    assert tuple(vgg["28.weight"].shape) == (512, 512, 3, 3)


def test_lpips_formula(weights):
    m = load_lpips("alex", weights)
    g = torch.Generator().manual_seed(2)
    a, b = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1, torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    d = m(a, b)
    assert d.shape == (2,) and (d > 0).all()
    assert torch.allclose(m(a, a), torch.zeros(2), atol=1e-7)
    assert torch.allclose(d, m(b, a), rtol=1e-5)
    # the v0.1 definition written out: scale, ReLU taps 1/4/7/9/11, unit-normalise, squared diff, 1x1 weights, mean
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    xa, xb, total = (a - shift) / scale, (b - shift) / scale, 0
    for i, layer in enumerate(m.features):
        xa, xb = layer(xa), layer(xb)
        if i in (1, 4, 7, 9, 11):
            na = xa / (xa.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            nb = xb / (xb.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            w = m.lins[(1, 4, 7, 9, 11).index(i)].weight
            total = total + F.conv2d((na - nb) ** 2, w).mean((1, 2, 3))
    assert torch.allclose(d, total, rtol=1e-5)
    video_a, video_b = a.transpose(0, 1), b.transpose(0, 1)  # [3, F, H, W]
    assert lpips_frames(m, video_a, video_b, batch=1) == pytest.approx(d.tolist(), rel=1e-5)


def test_missing_and_wrong_files(tmp_path, weights):
    with pytest.raises(MissingWeights, match="alexnet-owt-7be5be79.pth"):
        load_lpips("alex", tmp_path / "empty")
    with pytest.raises(MissingWeights, match="vgg16-397923af.pth"):
        load_lpips("vgg", weights)
    torch.save({"features.0.weight": torch.zeros(3)}, weights / FILES["alexnet"].name)
    with pytest.raises(ValueError, match="not torchvision's alex features"):
        load_lpips("alex", weights)


def test_small_frames_rejected(weights):
    m = load_lpips("alex", weights)
    with pytest.raises(ValueError, match="at least 32"):
        m(torch.zeros(1, 3, 16, 16), torch.zeros(1, 3, 16, 16))


@pytest.fixture(scope="module")
def lpips_package():
    from qvg.eval.lpips_parity import load_lpips_package, lpips_folder
    folder = lpips_folder()
    if folder is None:
        pytest.skip("the lpips package's sources not found (set QVG_LPIPS_SRC to the folder holding lpips/, e.g. an "
                    "unzipped `pip download lpips --no-deps` wheel)")
    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("lpips", "torchvision")}
    ref = load_lpips_package(folder)
    after = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("lpips", "torchvision")}
    assert after == before and "torchvision" not in sys.modules  # the stand-ins are gone again
    return ref


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_parity_with_lpips_package(lpips_package, net):
    import imageio.v2 as imageio
    from qvg.eval.lpips_parity import compare, pair, perturb
    theirs, ours = pair(lpips_package, net, 0)
    g = torch.Generator().manual_seed(3)
    photo = torch.from_numpy(imageio.imread(PHOTO)[..., :3].copy()).permute(2, 0, 1)[None].float() / 255
    small = F.interpolate(photo, scale_factor=0.25, mode="area")  # 100 x 150: a quick forward
    altered = torch.cat([perturb(small, k) for k in ("noise", "blur", "shift")])
    for a, b in ((torch.rand(2, 3, 48, 64, generator=g) * 2 - 1, torch.rand(2, 3, 48, 64, generator=g) * 2 - 1),
                 (small.expand_as(altered) * 2 - 1, altered * 2 - 1)):
        r = compare(theirs, ours, a, b)
        assert min(r["lpips"]) > 1e-3 and r["abs_diff"] <= 1e-6 and r["layers_abs_diff"] <= 1e-6, r
    with torch.no_grad():  # the check can fail: lin0's channel weights permuted
        ours.lins[0].weight.copy_(ours.lins[0].weight.flip(1))
    assert compare(theirs, ours, a, b)["layers_abs_diff"] > 1e-4
    assert "torchvision" not in sys.modules
