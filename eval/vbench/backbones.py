"""The VBench backbones as transformers models, from local files only (`qvg.eval.weights`):

- DINO ViT-B/16 -> `transformers.ViTModel` (no pooler); its feature is the final-LayerNorm CLS token, what DINO's
  own VisionTransformer returns. Read from the weights folder's `dino-vitb16/`: either a Hugging Face folder
  (config.json + weights, e.g. facebook/dino-vitb16) or VBench's `dino_vitbase16_pretrain.pth` (DINO's own key
  names: converted by `dino_to_vit`; the configuration is read from the tensors' shapes, heads = width / 64 as in
  every DINO ViT).
- CLIP ViT-B/32 and ViT-L/14 -> `transformers.CLIPVisionModelWithProjection` from a Hugging Face folder
  (openai/clip-vit-base-patch32, openai/clip-vit-large-patch14); `image_embeds` = the projected post-LayerNorm CLS
  token, what OpenAI CLIP's `encode_image` returns.
- LAION aesthetic head: `nn.Linear(768, 1)` from sa_0_4_vit_l_14_linear.pth (keys weight, bias).

Every loader takes `config=` to build the same class with random weights instead (tests). A file or folder that is
there but is not these weights (unreadable, keys the model lacks or does not fill, another patch size or width) raises
`BadWeights` naming it; a loaded model's `weight_files` are the files read.
"""
from __future__ import annotations

import contextlib
import math
import types
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..weights import BadWeights, MissingWeights, hf_files, read_state_dict, reading, weight_path

DINO_FILE = "dino_vitbase16_pretrain.pth"


# DINO block parameter -> transformers ViT name, in transformers' two layouts (5.x renamed ViT's modules)
_VIT_NAMES = {
    "old": {"prefix": "encoder.layer.{i}.", "norm1": "layernorm_before", "norm2": "layernorm_after",
            "attn.proj": "attention.output.dense", "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense",
            "q": "attention.attention.query", "k": "attention.attention.key", "v": "attention.attention.value"},
    "new": {"prefix": "layers.{i}.", "norm1": "layernorm_before", "norm2": "layernorm_after",
            "attn.proj": "attention.o_proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
            "q": "attention.q_proj", "k": "attention.k_proj", "v": "attention.v_proj"},
}


def vit_layout(model) -> str:
    """"new" (transformers >= 5: layers.{i}.attention.q_proj) or "old" (encoder.layer.{i}.attention.attention)."""
    return "new" if any(k.startswith("layers.0.") for k in model.state_dict()) else "old"


def dino_config(sd: dict) -> dict:
    """ViTConfig kwargs of a DINO VisionTransformer state dict, read from its shapes (heads = width / 64, as in
    every DINO ViT; LayerNorm eps 1e-6, GELU, qkv bias: DINO's)."""
    width = sd["cls_token"].shape[-1]
    patch = sd["patch_embed.proj.weight"].shape[-1]
    grid = int(round((sd["pos_embed"].shape[1] - 1) ** 0.5))
    return dict(hidden_size=width, num_hidden_layers=1 + max(int(k.split(".")[1]) for k in sd
                                                             if k.startswith("blocks.")),
                num_attention_heads=width // 64, intermediate_size=sd["blocks.0.mlp.fc1.weight"].shape[0],
                patch_size=patch, image_size=grid * patch, qkv_bias=True, layer_norm_eps=1e-6, hidden_act="gelu")


def dino_to_vit(sd: dict, layout: str) -> dict:
    """DINO's VisionTransformer state dict (its `head` dropped) -> transformers ViTModel's, in `layout`."""
    names = _VIT_NAMES[layout]
    out = {"embeddings.cls_token": sd["cls_token"], "embeddings.position_embeddings": sd["pos_embed"],
           "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
           "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
           "layernorm.weight": sd["norm.weight"], "layernorm.bias": sd["norm.bias"]}
    for i in range(dino_config(sd)["num_hidden_layers"]):
        b, o = f"blocks.{i}.", names["prefix"].format(i=i)
        for p in ("weight", "bias"):
            for src in ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc2"):
                out[f"{o}{names[src]}.{p}"] = sd[f"{b}{src}.{p}"]
            for name, t in zip("qkv", sd[f"{b}attn.qkv.{p}"].chunk(3)):
                out[f"{o}{names[name]}.{p}"] = t
    return out


def _hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


# what each backbone must be (VBench's DINO ViT-B/16, CLIP ViT-B/32 and ViT-L/14: patch size and width): another
# model's weights under a backbone's name (a ViT-S/16, a CLIP of another size) are refused, not scored
EXPECTED = {"dino": ("DINO ViT-B/16", {"patch_size": 16, "hidden_size": 768}),
            "clip-b32": ("CLIP ViT-B/32", {"patch_size": 32, "hidden_size": 768}),
            "clip-l14": ("CLIP ViT-L/14", {"patch_size": 14, "hidden_size": 1024})}


def _check_arch(key: str, config, source) -> None:
    name, want = EXPECTED[key]
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    wrong = [f"{k.replace('_', ' ')} {get(k)}" for k, v in want.items() if get(k) != v]
    if wrong:
        need = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in want.items())
        raise BadWeights(f"{source}: a model of {', '.join(wrong)}, not {name} ({need}): another model's weights")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off (its load report of another model's folder is a table of
    dozens of lines, and its bar ignores --no-progress): what is wrong is said by BadWeights, in one line."""
    from transformers.utils import logging as tlog
    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def _from_pretrained(cls, path: Path, what: str, key: str, **kw):
    """cls.from_pretrained of a local folder; any failure (no weights file, a broken config, other shapes) is
    BadWeights naming the folder, and so is a folder whose weights leave any of the model's keys unfilled
    (transformers would start those from random values and score with them: another model's folder) or whose
    patch size or width is not the backbone's (`EXPECTED`)."""
    with reading(path, f"a Hugging Face {what} folder (config.json + model.safetensors or pytorch_model.bin)"), \
            _quiet_transformers():
        model, info = cls.from_pretrained(str(path), local_files_only=True, output_loading_info=True,
                                          ignore_mismatched_sizes=True, **kw)  # (named below, not raised)
    unfilled = [*info.get("missing_keys", ()), *(m[0] if isinstance(m, tuple) else m
                                                  for m in info.get("mismatched_keys", ()))]
    if unfilled:
        few = ", ".join(sorted(unfilled)[:3]) + (", ..." if len(unfilled) > 3 else "")
        raise BadWeights(f"{path}: not {EXPECTED[key][0]} weights: {len(unfilled)} of the {what} model's tensors are "
                         f"not in the folder or have other shapes ({few})")
    _check_arch(key, model.config, path)
    model.weight_files = hf_files(path)
    return model


def load_dino(weights=None, device="cpu", config=None) -> nn.Module:
    """DINO ViT-B/16 (VBench's subject consistency backbone) as a transformers ViTModel: from `config` (random
    weights), a Hugging Face folder, or VBench's DINO checkpoint; with DINO's own position-embedding interpolation
    (dino_positions)."""
    model = _load_dino(weights, device, config)
    model.embeddings.interpolate_pos_encoding = types.MethodType(dino_positions, model.embeddings)
    return model


def dino_positions(emb, embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """ViTEmbeddings.interpolate_pos_encoding as DINO's vision_transformer computes it, which VBench runs: the
    patch grid's embeddings resized bicubically by the scale factors ((rows + 0.1) / grid, (cols + 0.1) / grid),
    not to the target size. PyTorch samples by that scale, so an axis whose length stays is resampled too: for a
    480 x 832 video (a 14 x 24 grid after the resize) transformers' size= form differed by up to 0.46 on embeddings
    of std 1. Unchanged where DINO leaves them: as many patches as positions on a square frame."""
    pos = emb.position_embeddings
    n = pos.shape[1] - 1
    if embeddings.shape[1] - 1 == n and height == width:
        return pos
    g = math.isqrt(n)
    rows, cols = height // emb.patch_size, width // emb.patch_size
    grid = pos[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((rows + 0.1) / g, (cols + 0.1) / g), mode="bicubic",
                         align_corners=False)
    assert grid.shape[-2:] == (rows, cols), (grid.shape, rows, cols)
    return torch.cat((pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)), dim=1)


def _load_dino(weights, device, config) -> nn.Module:
    from transformers import ViTConfig, ViTModel
    if config is not None:
        return ViTModel(ViTConfig(**config) if isinstance(config, dict) else config, add_pooling_layer=False) \
            .eval().to(device)
    p = weight_path("dino", weights)
    if _hf_folder(p):
        return _from_pretrained(ViTModel, p, "ViT", "dino", add_pooling_layer=False).eval().to(device)
    f = p / DINO_FILE if p.is_dir() else p
    if not f.is_file():
        raise MissingWeights(f"missing {f} (DINO ViT-B/16: VBench's {DINO_FILE}) and {p} is not a Hugging Face "
                             "folder (no config.json)")
    raw = read_state_dict(f)
    with reading(f, "a DINO ViT checkpoint"):  # keys or shapes other than DINO's
        config = dino_config(raw)
        model = ViTModel(ViTConfig(**config), add_pooling_layer=False)
        missing, unexpected = model.load_state_dict(dino_to_vit(raw, vit_layout(model)), strict=False)
    _check_arch("dino", config, f)
    if missing or unexpected:
        raise BadWeights(f"{f}: not a DINO ViT checkpoint (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.weight_files = [f]
    return model.eval().to(device)


def dino_features(model, pixels: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] (normalized) -> [N, C]: the final-LayerNorm CLS token (position embeddings interpolated when
    the frame is not the model's image size, as DINO does: dino_positions)."""
    size = model.config.image_size
    interp = tuple(pixels.shape[-2:]) != (size, size)
    return model(pixel_values=pixels, interpolate_pos_encoding=interp).last_hidden_state[:, 0]


def load_clip(key: str, weights=None, device="cpu", config=None) -> nn.Module:
    """key: "clip-b32" or "clip-l14" (`qvg.eval.weights.FILES`)."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    if config is not None:
        cfg = CLIPVisionConfig(**config) if isinstance(config, dict) else config
        return CLIPVisionModelWithProjection(cfg).eval().to(device)
    p = weight_path(key, weights)
    if not _hf_folder(p):
        raise MissingWeights(f"missing {p / 'config.json'}: {p} must be a Hugging Face CLIP folder")
    return _from_pretrained(CLIPVisionModelWithProjection, p, "CLIP", key).eval().to(device)


def clip_features(model, pixels: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixels).image_embeds


def load_aesthetic_head(weights=None, device="cpu", dim: int | None = None) -> nn.Module:
    """LAION's linear aesthetic head; dim= builds a random one of that input width instead."""
    head = nn.Linear(dim or 768, 1)
    if dim is None:
        p = weight_path("laion-aesthetic", weights)
        sd = read_state_dict(p)
        if set(sd) != {"weight", "bias"} or tuple(sd["weight"].shape) != (1, 768):
            raise BadWeights(f"{p}: expected the LAION linear head (weight [1, 768], bias [1]), got "
                             f"{ {k: list(v.shape) for k, v in sd.items()} }")
        with reading(p, "the LAION linear head"):
            head.load_state_dict({k: v.float() for k, v in sd.items()})
        head.weight_files = [p]
    return head.eval().to(device)
