"""Checks qvg's MUSIQ (`qvg.eval.vbench.musiq`) against pyiqa's own module, the code VBench runs: pyiqa's MUSIQ is
built as VBench builds it (num_class 1, every other option at its default) with random weights (fixed seed), its
state dict is loaded into qvg's with strict key checking, and both score the same images: random ones, and
scikit-image's photos after VBench's "longer" resize. Writes the scores and their largest differences.

    pip download pyiqa --no-deps -d /tmp/pyiqa && python -m zipfile -e /tmp/pyiqa/pyiqa-*.whl /tmp/pyiqa/src
    python -m qvg.eval.musiq_parity --pyiqa /tmp/pyiqa/src --out eval/results/musiq-parity-cpu.json

pyiqa's package imports torchvision (among much else), which does not import with this project's CPU torch, so
only what MUSIQ needs is loaded, from pyiqa's files: archs/musiq_arch.py, data/multiscale_trans_util.py,
matlab_utils/padding.py, and `dist_to_mos` taken out of archs/arch_util.py; its registry and download helpers are
stand-ins. The pyiqa folder is --pyiqa, else $QVG_PYIQA_SRC, else an installed pyiqa (found, never imported).
"""
from __future__ import annotations

import hashlib
import re
import sys
import types
from pathlib import Path

import torch

from qvg.help_format import OneLineParser
from .source_loading import exec_function, isolated_modules, load, source_folder, stand_in

ENV = "QVG_PYIQA_SRC"
PHOTOS = ("astronaut", "coffee", "rocket", "chelsea", "camera")  # rocket: longer side 640 -> VBench's resize
RANDOM_SIZES = ((64, 96), (200, 300), (389, 517))


def pyiqa_folder(explicit=None) -> Path | None:
    """The folder holding pyiqa/ (its musiq_arch.py), or None."""
    return source_folder("pyiqa", ENV, explicit, lambda p: (p / "archs" / "musiq_arch.py").is_file())


class _Registry:
    def register(self):
        return lambda cls: cls


def _no_download(*args, **kwargs):
    raise RuntimeError("the parity check builds pyiqa's MUSIQ with pretrained=False")


def load_pyiqa_musiq(folder) -> types.SimpleNamespace:
    """pyiqa's MUSIQ class and get_multiscale_patches, loaded from `folder`/pyiqa without importing its package
    (sys.modules is left as it was)."""
    root = Path(folder) / "pyiqa"
    with isolated_modules("pyiqa"):
        for sub in ("", "archs", "matlab_utils", "utils", "data"):
            stand_in("pyiqa" + (f".{sub}" if sub else ""), root / sub)
        padding = load("pyiqa.matlab_utils.padding", root / "matlab_utils" / "padding.py")
        sys.modules["pyiqa.matlab_utils"].__dict__.update(ExactPadding2d=padding.ExactPadding2d,
                                                          exact_padding_2d=padding.exact_padding_2d)
        stand_in("pyiqa.utils.registry", ARCH_REGISTRY=_Registry())
        multiscale = load("pyiqa.data.multiscale_trans_util", root / "data" / "multiscale_trans_util.py")
        util = stand_in("pyiqa.archs.arch_util", torch=torch, get_url_from_name=lambda name, *a, **k: name,
                        load_pretrained_network=_no_download)
        exec_function(root / "archs" / "arch_util.py", "dist_to_mos", util.__dict__)
        arch = load("pyiqa.archs.musiq_arch", root / "archs" / "musiq_arch.py")
        return types.SimpleNamespace(MUSIQ=arch.MUSIQ, get_multiscale_patches=multiscale.get_multiscale_patches,
                                     version=_version(root), musiq_sha256=hashlib.sha256(
                                         (root / "archs" / "musiq_arch.py").read_bytes()).hexdigest())


def _version(root: Path) -> str:
    f = root / "version.py"
    m = re.search(r"^__version__[^:\n]*=[^'\"\n]*['\"]([^'\"]+)['\"]", f.read_text() if f.is_file() else "", re.M)
    return m.group(1) if m else "unknown"


def pair(ref, seed: int = 0, **config):
    """(pyiqa's MUSIQ with random weights, qvg's MUSIQ holding the same weights, strictly loaded). The weights:
    pyiqa's initialisation under torch.manual_seed(seed), then N(0, 0.02^2) added to every parameter, so that none
    is left at a constant (norms at 1 and 0, the CLS token at 0) where a swapped pair of names could hide."""
    from .vbench.musiq import MUSIQ
    torch.manual_seed(seed)
    theirs = ref.MUSIQ(pretrained=False, **config).eval()
    with torch.no_grad():
        for t in theirs.parameters():
            t.add_(torch.randn_like(t) * 0.02)
    ours = MUSIQ(**config).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


@torch.no_grad()
def compare_image(ref, theirs, ours, image: torch.Tensor) -> dict:
    """One image [1, 3, H, W] in [0, 1]: both scores and the largest difference of the multi-scale patch tensors."""
    from .vbench.musiq import multiscale_patches
    cfg = theirs.data_preprocess_opts
    x = (image - 0.5) * 2
    a = ref.get_multiscale_patches(x, **cfg)
    b = multiscale_patches(x, cfg["patch_size"], cfg["hse_grid_size"], cfg["longer_side_lengths"])
    b = torch.cat([b[0], *(t[..., None].to(b[0].dtype) for t in b[1:])], -1)
    s_theirs, s_ours = float(theirs(image).reshape(-1)[0]), float(ours(image).reshape(-1)[0])
    return {"size": list(image.shape[-2:]), "tokens": int(a.shape[1]), "pyiqa": s_theirs, "qvg": s_ours,
            "abs_diff": abs(s_theirs - s_ours), "patches_max_abs_diff": float((a - b).abs().max())
            if a.shape == b.shape else float("inf")}


def images(seed: int = 0):
    """(name, [1, 3, H, W] in [0, 1]): random images, then scikit-image's photos through VBench's resize."""
    from .vbench.preprocess import vbench_longer
    g = torch.Generator().manual_seed(seed)
    for h, w in RANDOM_SIZES:
        yield f"random {h}x{w}", torch.rand(1, 3, h, w, generator=g)
    import numpy as np
    import skimage.data
    for name in PHOTOS:
        a = np.asarray(getattr(skimage.data, name)())
        a = np.repeat(a[..., None], 3, -1) if a.ndim == 2 else a[..., :3]
        frames = torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)[None]
        yield f"{name} ({a.shape[0]}x{a.shape[1]})", vbench_longer(frames) / 255.0


def main(argv=None) -> int:
    from .provenance import changed_files, command_line, emit_json, meta
    p = OneLineParser(prog="python -m qvg.eval.musiq_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--pyiqa", default=None, help=f"folder holding pyiqa/ (default ${ENV}, else an installed pyiqa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    folder = pyiqa_folder(a.pyiqa)
    if folder is None:
        p.error(f"no pyiqa sources: pass --pyiqa DIR (the folder holding pyiqa/) or set ${ENV}")
    ref = load_pyiqa_musiq(folder)
    theirs, ours = pair(ref, a.seed)
    rows = {name: compare_image(ref, theirs, ours, img) for name, img in images(a.seed)}
    res = {"meta": meta(command_line("python -m qvg.eval.musiq_parity", argv), "cpu",
                        changed_files=changed_files()), "device": "CPU",
           "pyiqa": {"version": ref.version, "musiq_arch.py sha256": ref.musiq_sha256},
           "what": "pyiqa's MUSIQ (VBench's configuration: num_class 1; pretrained=False, random weights: "
                   f"pyiqa's init under torch.manual_seed({a.seed}), + N(0, 0.02^2) on every parameter) vs "
                   "qvg.eval.vbench.musiq.MUSIQ holding its state dict (strict load); score = each model's output "
                   "for one image in [0, 1]; patches = pyiqa's get_multiscale_patches vs qvg's multiscale_patches",
           "max_abs_diff": max(r["abs_diff"] for r in rows.values()),
           "max_patches_abs_diff": max(r["patches_max_abs_diff"] for r in rows.values()), "images": rows}
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
