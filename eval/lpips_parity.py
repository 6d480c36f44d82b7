"""Checks qvg's LPIPS (`qvg.eval.lpips`) against the lpips package's own code (richzhang/PerceptualSimilarity, PyPI
`lpips`): lpips.LPIPS(net, pretrained=True, pnet_rand=True) is built from the package's files with its shipped v0.1
linear weights (lpips/weights/v0.1/{alex,vgg}.pth) and a random backbone (fixed seed); qvg's LPIPS gets the same
backbone through `load_backbone` (lpips's `net.slice{s}.{i}.*` keys as torchvision's `features.{i}.*`) and the
same v0.1 file through `load_linear`, and both measure the same image pairs: random ones of a few sizes, and
scikit-image's photos against a noisy, a blurred and a shifted copy. Writes the distances, the five per-layer
terms and their largest differences.

    pip download lpips --no-deps -d /tmp/lpips-dl && python -m zipfile -e /tmp/lpips-dl/lpips-*.whl /tmp/lpips-dl
    python -m qvg.eval.lpips_parity --lpips /tmp/lpips-dl --out eval/results/lpips-parity-cpu.json

The lpips package imports torchvision (its pretrained_networks.py builds the backbones from `torchvision.models`),
which does not import with this project's CPU torch, and its __init__ imports trainer.py (scipy, tqdm). So only
lpips/lpips.py and lpips/pretrained_networks.py are loaded, from the package's files; `lpips.normalize_tensor` is
taken out of its __init__.py, and `torchvision.models` is a stand-in whose alexnet / vgg16 return qvg's
`alexnet_features()` / `vgg16_features()` as `.features`. The backbone's layer definition is therefore not what is
checked here (it is checked by loading torchvision's key names and shapes); everything lpips does around it is:
the scaling layer, which ReLU outputs its slices tap, the unit normalisation, the lin layers with the real v0.1
weights, the spatial average and the sum. The lpips folder is --lpips, else $QVG_LPIPS_SRC, else an installed
lpips (found, never imported); sys.modules is left as it was (no torchvision in it afterwards).
"""
from __future__ import annotations

import hashlib
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from qvg.help_format import OneLineParser
from .source_loading import exec_function, isolated_modules, load, source_folder, stand_in

ENV = "QVG_LPIPS_SRC"
NETS = ("alex", "vgg")
PHOTOS = ("astronaut", "coffee", "chelsea")
RANDOM_SIZES = ((64, 64), (100, 150), (257, 311))
PERTURBATIONS = ("noise", "blur", "shift")
_TAKEN = ("lpips", "torchvision")


def lpips_folder(explicit=None) -> Path | None:
    """The folder holding lpips/ (its lpips.py and weights/v0.1/), or None."""
    return source_folder("lpips", ENV, explicit, lambda p: all(
        (p / f).is_file() for f in ("lpips.py", "pretrained_networks.py", "weights/v0.1/alex.pth")))


def _backbone(make):
    def build(pretrained=False, **kwargs):
        if pretrained:
            raise RuntimeError("the parity check builds lpips's LPIPS with pnet_rand=True (no torchvision weights)")
        return types.SimpleNamespace(features=make())
    return build


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def load_lpips_package(folder) -> types.SimpleNamespace:
    """lpips's LPIPS class, loaded from `folder`/lpips without importing its package or torchvision (sys.modules
    is left as it was)."""
    from .lpips import alexnet_features, vgg16_features
    root = Path(folder) / "lpips"
    with isolated_modules(*_TAKEN):
        tv = stand_in("torchvision.models", alexnet=_backbone(alexnet_features), vgg16=_backbone(vgg16_features))
        stand_in("torchvision", models=tv)
        pkg = stand_in("lpips", root, torch=torch)
        exec_function(root / "__init__.py", "normalize_tensor", pkg.__dict__)
        pkg.pretrained_networks = load("lpips.pretrained_networks", root / "pretrained_networks.py")
        mod = load("lpips.lpips", root / "lpips.py")
        files = {n: _sha256(root / n) for n in ("lpips.py", "pretrained_networks.py", "__init__.py")}
        files.update({f"weights/v0.1/{n}.pth": _sha256(root / "weights" / "v0.1" / f"{n}.pth") for n in NETS})
        return types.SimpleNamespace(LPIPS=mod.LPIPS, version=_version(Path(folder), root), sha256=files,
                                     weights=root / "weights" / "v0.1")


def _version(folder: Path, root: Path) -> str:
    for meta in [*sorted(folder.glob("lpips-*.dist-info/METADATA")), root.parent / "PKG-INFO"]:
        m = re.search(r"^Version:\s*(\S+)", meta.read_text() if meta.is_file() else "", re.M)
        if m:
            return m.group(1)
    return "unknown"


def pair(ref, net: str = "alex", seed: int = 0):
    """(lpips's LPIPS, qvg's LPIPS) holding the same weights: lpips's own v0.1 lin file (loaded by lpips.LPIPS
    itself, and by qvg's `load_linear`), and a random backbone drawn under torch.manual_seed(seed): He-normal
    (fan-in) conv weights and N(0, 0.01^2) biases, so the signal stays O(1) down to VGG's 13th conv (torch's default
    init shrinks it layer after layer, leaving the deep terms near zero where a mismatch could hide)."""
    from .lpips import LPIPS
    from .weights import read_state_dict
    torch.manual_seed(seed)
    theirs = ref.LPIPS(pretrained=True, net=net, version="0.1", pnet_rand=True, verbose=False).eval()
    with torch.no_grad():
        for name, t in theirs.net.named_parameters():
            if name.endswith(".weight"):
                torch.nn.init.kaiming_normal_(t, mode="fan_in", nonlinearity="relu")
            else:
                t.normal_(0, 0.01)
    lin_file = ref.weights / f"{net}.pth"
    lin = read_state_dict(lin_file)
    for i, l in enumerate(theirs.lins):  # lpips loads it with strict=False: check that it did
        if not torch.equal(l.model[-1].weight, lin[f"lin{i}.model.1.weight"]):
            raise RuntimeError(f"lpips.LPIPS did not load {lin_file} into lin{i}")
    backbone = {}
    for k, v in theirs.net.state_dict().items():
        m = re.fullmatch(r"slice\d+\.(\d+)\.(weight|bias)", k)
        if m is None:
            raise RuntimeError(f"unexpected key in lpips's {net} backbone: {k}")
        backbone[f"features.{m.group(1)}.{m.group(2)}"] = v
    ours = LPIPS(net)
    ours.load_backbone(backbone, f"lpips's {net} backbone")
    ours.load_linear(lin, str(lin_file))
    if set(backbone) != {"features." + k for k in ours.features.state_dict()}:
        raise RuntimeError(f"lpips's {net} backbone and qvg's use different layers")
    return theirs, ours


@torch.no_grad()
def compare(theirs, ours, a: torch.Tensor, b: torch.Tensor) -> dict:
    """Batches a, b [N, 3, H, W] in [-1, 1]: both models' distances and per-layer terms, and their differences."""
    d_theirs, layers_theirs = theirs(a, b, retPerLayer=True)
    d_theirs = d_theirs.reshape(-1)
    layers_theirs = torch.stack([t.reshape(-1) for t in layers_theirs])  # [5, N]
    layers_ours = torch.stack(ours.layer_distances(a, b))
    d_ours = ours(a, b)
    return {"size": list(a.shape[-2:]), "lpips": d_theirs.tolist(), "qvg": d_ours.tolist(),
            "abs_diff": float((d_theirs - d_ours).abs().max()),
            "rel_diff": float(((d_theirs - d_ours).abs() / d_theirs.abs().clamp_min(1e-12)).max()),
            "layers_lpips": layers_theirs.tolist(),
            "layers_abs_diff": float((layers_theirs - layers_ours).abs().max())}


def _gauss_blur(x: torch.Tensor, sigma: float = 1.5, k: int = 7) -> torch.Tensor:
    t = torch.arange(k, dtype=x.dtype) - k // 2
    g = torch.exp(-t ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    w = (g[:, None] * g[None, :]).expand(3, 1, k, k)
    return F.conv2d(F.pad(x, (k // 2,) * 4, mode="reflect"), w, groups=3)


def perturb(x: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """x [N, 3, H, W] in [0, 1]: noise N(0, 0.05^2) (clamped), Gaussian blur (sigma 1.5), or a shift by 3 rows and
    5 columns (edges repeated)."""
    if kind == "noise":
        g = torch.Generator().manual_seed(seed)
        return (x + 0.05 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    if kind == "blur":
        return _gauss_blur(x)
    if kind == "shift":
        return F.pad(x[..., :-3, :-5], (5, 0, 3, 0), mode="replicate")
    raise ValueError(kind)


def photo(name: str) -> torch.Tensor:
    """scikit-image's photo `name` as [1, 3, H, W] in [0, 1]."""
    import numpy as np
    import skimage.data
    a = np.asarray(getattr(skimage.data, name)())
    a = np.repeat(a[..., None], 3, -1) if a.ndim == 2 else a[..., :3]
    return torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)[None].float() / 255


def pairs(seed: int = 0, sizes=RANDOM_SIZES, photos=PHOTOS):
    """(name, a, b) in [-1, 1]: two random pairs per size, then each photo against its perturbed copies."""
    g = torch.Generator().manual_seed(seed)
    for h, w in sizes:
        yield f"random {h}x{w} (2 pairs)", *(torch.rand(2, 3, h, w, generator=g) * 2 - 1 for _ in range(2))
    for name in photos:
        x = photo(name)
        b = torch.cat([perturb(x, k, seed) for k in PERTURBATIONS])
        yield f"{name} vs {'/'.join(PERTURBATIONS)}", x.expand_as(b) * 2 - 1, b * 2 - 1


def run(ref, nets=NETS, seed: int = 0, **kw) -> dict:
    out = {}
    for net in nets:
        theirs, ours = pair(ref, net, seed)
        rows = {name: compare(theirs, ours, a, b) for name, a, b in pairs(seed, **kw)}
        out[net] = {"max_abs_diff": max(r["abs_diff"] for r in rows.values()),
                    "max_rel_diff": max(r["rel_diff"] for r in rows.values()),
                    "max_layers_abs_diff": max(r["layers_abs_diff"] for r in rows.values()), "pairs": rows}
    return out


def main(argv=None) -> int:
    from .provenance import changed_files, command_line, emit_json, meta
    p = OneLineParser(prog="python -m qvg.eval.lpips_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--lpips", default=None, help=f"folder holding lpips/ (default ${ENV}, else an installed lpips)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    folder = lpips_folder(a.lpips)
    if folder is None:
        p.error(f"no lpips sources: pass --lpips DIR (the folder holding lpips/) or set ${ENV}")
    ref = load_lpips_package(folder)
    nets = run(ref, seed=a.seed)
    res = {"meta": meta(command_line("python -m qvg.eval.lpips_parity", argv), "cpu",
                        changed_files=changed_files()), "device": "CPU",
           "lpips": {"version": ref.version, "sha256": ref.sha256},
           "what": "the lpips package's LPIPS (lpips.py + pretrained_networks.py, loaded from its files; "
                   "pretrained=True: its shipped weights/v0.1 lin layers; pnet_rand=True: a random backbone under "
                   f"torch.manual_seed({a.seed}), He-normal fan-in conv weights, N(0, 0.01^2) biases; "
                   "torchvision.models a stand-in returning qvg's alexnet_features() / vgg16_features(), so the "
                   "backbone layer definition itself is not what is checked) vs qvg.eval.lpips.LPIPS holding the "
                   "same backbone (load_backbone, slice keys as features.{i}) and the same v0.1 file (load_linear); "
                   "distance = each model's output for image pairs in [-1, 1]; layers = the five per-layer terms "
                   "(lpips's retPerLayer vs qvg's layer_distances); photos: scikit-image's, against Gaussian noise "
                   "sigma 0.05, Gaussian blur sigma 1.5, a 3-row / 5-column shift",
           "max_abs_diff": max(n["max_abs_diff"] for n in nets.values()),
           "max_rel_diff": max(n["max_rel_diff"] for n in nets.values()),
           "max_layers_abs_diff": max(n["max_layers_abs_diff"] for n in nets.values()), "nets": nets}
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
