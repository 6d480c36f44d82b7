"""Where the evaluation's pretrained weights live. Nothing is downloaded: every file is read from a local folder,

    --weights DIR  (the qvg-eval flag)  >  $QVG_WEIGHTS  >  ~/.cache/qvg/weights

under the names in `FILES` (a file, or a Hugging Face model folder). A missing file raises `MissingWeights`, whose
message is one line naming the file, where it is looked for and where it comes from; a file that is there but
cannot be used (not a state dict, other keys or shapes, a Hugging Face folder without its weights) raises
`BadWeights`, one line naming the file and what is wrong. Files are opened with `torch.load(weights_only=True)`
(no arbitrary unpickling) or safetensors. `used_files` lists the files a loaded model was read from (provenance).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


ENV = "QVG_WEIGHTS"


@dataclass(frozen=True)
class WeightFile:
    name: str  # file or folder name under the weights folder
    what: str  # what it is and where it comes from


FILES = {
    "alexnet": WeightFile("alexnet-owt-7be5be79.pth", "torchvision's ImageNet AlexNet "
                          "(https://download.pytorch.org/models/alexnet-owt-7be5be79.pth; LPIPS backbone)"),
    "vgg16": WeightFile("vgg16-397923af.pth", "torchvision's ImageNet VGG16 "
                        "(https://download.pytorch.org/models/vgg16-397923af.pth; LPIPS-vgg backbone)"),
    "lpips-alex": WeightFile("lpips/alex.pth", "the lpips package's lpips/weights/v0.1/alex.pth (in its wheel: "
                             "`pip download lpips --no-deps` and unzip; never imported)"),
    "lpips-vgg": WeightFile("lpips/vgg.pth", "the lpips package's lpips/weights/v0.1/vgg.pth (in its wheel)"),
    "dino": WeightFile("dino-vitb16", "DINO ViT-B/16: VBench's dino_vitbase16_pretrain.pth placed in this folder, "
                       "or the Hugging Face facebook/dino-vitb16 folder (config.json + weights)"),
    "clip-b32": WeightFile("clip-vit-base-patch32", "CLIP ViT-B/32 as a Hugging Face folder "
                           "(openai/clip-vit-base-patch32: config.json + weights)"),
    "clip-l14": WeightFile("clip-vit-large-patch14", "CLIP ViT-L/14 as a Hugging Face folder "
                           "(openai/clip-vit-large-patch14: config.json + weights)"),
    "laion-aesthetic": WeightFile("sa_0_4_vit_l_14_linear.pth", "the LAION aesthetic predictor's linear head "
                                  "(LAION-AI/aesthetic-predictor: sa_0_4_vit_l_14_linear.pth)"),
    "musiq": WeightFile("musiq_spaq_ckpt-358bb6af.pth", "pyiqa's MUSIQ trained on SPAQ, VBench's imaging-quality "
                        "model: https://github.com/chaofengc/IQA-PyTorch/releases/download/v0.1-weights/"
                        "musiq_spaq_ckpt-358bb6af.pth, the file VBench fetches into ~/.cache/vbench/pyiqa_model/"),
}


class MissingWeights(FileNotFoundError):
    """A pretrained file is not where it is looked for (str(e) is one line naming it)."""


class BadWeights(ValueError):
    """A pretrained file is there but is not the weights it should be (str(e) is one line naming it)."""




@contextmanager
def reading(path, what: str, unpickling: bool = False):
    """Turn any failure to read `path` as `what` into BadWeights naming it (ImportError, MemoryError, MissingWeights
    and BadWeights pass through: a missing package, memory or file is reported as such). unpickling: the block is
    torch.load, whose unpickler fails on other bytes with a bare key or index (KeyError: 174812789), which the
    message then says in words."""
    try:
        yield
    except (ImportError, MemoryError, MissingWeights, BadWeights):
        raise
    except Exception as e:
        from ..pipelines.state_dicts import first_line  # (imports torch: not at qvg-eval's start)
        bare = unpickling and isinstance(e, (KeyError, IndexError))
        why = "corrupt, or not a file torch.save wrote" if bare else first_line(e)
        raise BadWeights(f"{path}: not {what} ({why})") from None


def hf_files(folder: Path) -> list[Path]:
    """The files transformers' from_pretrained reads from a model folder: config.json and the weights it picks
    (safetensors first, then pytorch_model.bin; sharded ones through their index)."""
    out = [folder / "config.json"]
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json"):
        p = folder / name
        if p.is_file():
            out.append(p)
            if name.endswith(".index.json"):
                with reading(p, "a Hugging Face weights index"):
                    shards = sorted(set(json.loads(p.read_text())["weight_map"].values()))
                out += [folder / s for s in shards]
            break
    return out


def used_files(*objs) -> list[Path]:
    """The weight files the given loaded models / scorers were read from (their `weight_files`), in order, once."""
    out = []
    for o in objs:
        for p in getattr(o, "weight_files", None) or []:
            if Path(p) not in out:
                out.append(Path(p))
    return out


def weights_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    return Path.home() / ".cache" / "qvg" / "weights"


def weight_path(key: str, directory: str | os.PathLike | None = None) -> Path:
    """The path of weight `key` (a FILES key), or MissingWeights naming the file and its source."""
    return weight_paths([key], directory)[0]


def weight_paths(keys, directory: str | os.PathLike | None = None) -> list[Path]:
    """The paths of weights `keys` (FILES keys), or one MissingWeights naming every one that is missing (a metric
    that needs two files names both at once, not one per run)."""
    paths = [weights_dir(directory) / FILES[k].name for k in keys]
    missing = [(p, FILES[k]) for p, k in zip(paths, keys) if not p.exists()]
    if missing:
        names = " and ".join(f"{p} ({f.what})" for p, f in missing)
        them = "it" if len(missing) == 1 else "them"
        raise MissingWeights(f"missing {names}; put {them} there, or point --weights / ${ENV} at the folder that "
                             f"holds {' and '.join(f.name for _, f in missing)}")
    return paths


def available(key: str, directory=None) -> bool:
    try:
        weight_path(key, directory)
        return True
    except MissingWeights:
        return False


def read_state_dict(path: str | os.PathLike) -> dict:
    """A flat {name: tensor} from a .safetensors or torch file (weights_only); {"state_dict": ...} / {"model": ...}
    wrappers are unwrapped. A file that is not one (text, a failed download, pickled objects) -> BadWeights."""
    import torch
    path = Path(path)
    with reading(path, "a weights-only torch state dict" if path.suffix != ".safetensors" else "a safetensors file",
                 unpickling=path.suffix != ".safetensors"):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not a zip archive (legacy format): no mmap
            sd = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "params"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)} if isinstance(sd, dict) else None
    if not sd:
        raise BadWeights(f"{path}: not a state dict (no tensors in it)")
    return sd
