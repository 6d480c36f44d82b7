"""VBench dimensions: the formulas, the preprocessing, randomly initialised backbones through the real code paths,
DINO's checkpoint layout, and the missing-weights messages."""
from __future__ import annotations

import pytest
import torch

from qvg.eval.vbench import consistency, load_dimensions
from qvg.eval.vbench.backbones import DINO_FILE, dino_config, load_aesthetic_head, load_dino, vit_layout
from qvg.eval.vbench.preprocess import center_crop, clip_input, dino_input, resize_short

VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=1, intermediate_size=128, patch_size=16,
           image_size=224, qkv_bias=True, layer_norm_eps=1e-6)
CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=32,
            image_size=224, projection_dim=16)
MUSIQ = dict(patch_size=16, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=1, spatial_pos_grid_size=4,
             longer_side_lengths=(32, 48))
CONFIGS = {"subject_consistency": VIT, "background_consistency": CLIP, "aesthetic_quality": CLIP,
           "imaging_quality": MUSIQ}


def test_consistency_formula():
    e = torch.eye(3)
    assert consistency(torch.ones(4, 8)) == pytest.approx(1.0)
    # frames: e0, e1, e0: pairs (e0, e1): prev 0, first 0 -> 0; (e1, e0): prev 0, first 1 -> 0.5; mean 0.25
    assert consistency(torch.stack([e[0], e[1], e[0]])) == pytest.approx(0.25)
    assert consistency(torch.stack([e[0], -e[0]])) == 0.0  # negative similarities clipped at 0
    with pytest.raises(ValueError):
        consistency(torch.ones(1, 4))


def test_preprocessing_sizes():
    x = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    assert resize_short(x, 224, "bilinear").shape[-2:] == (224, 336)
    assert resize_short(x.transpose(-1, -2), 224, "bicubic").shape[-2:] == (336, 224)
    assert center_crop(torch.arange(10).view(1, 1, 1, 10).expand(1, 1, 10, 10), 4)[0, 0, 0].tolist() == [3, 4, 5, 6]
    v = torch.rand(3, 2, 64, 96) * 2 - 1
    assert dino_input(v).shape == (2, 3, 224, 336)  # DINO: no crop
    c = clip_input(v)
    assert c.shape == (2, 3, 224, 224) and c.dtype == torch.float32
    same = torch.zeros(3, 1, 224, 224)  # grey 127.5 -> 128 after rounding; no resize at 224
    assert torch.allclose(dino_input(same)[0, 0], torch.full((224, 224), (128 / 255 - 0.485) / 0.229))


def test_dimensions_with_random_backbones():
    dims = load_dimensions(configs=CONFIGS)
    v = torch.rand(3, 4, 64, 64) * 2 - 1
    for name in ("subject_consistency", "background_consistency"):
        s = dims[name](v)
        assert 0.0 <= s <= 1.0
        assert dims[name](v[:, :1].expand(-1, 4, -1, -1)) == pytest.approx(1.0, abs=1e-5)  # a still video
    a = dims["aesthetic_quality"]
    assert a(v) == pytest.approx(float(a.frame_scores(v).mean()))
    iq = dims["imaging_quality"]
    assert iq(v) == pytest.approx(float(iq.frame_scores(v).mean()) / 100, rel=1e-6)


def test_missing_weights_messages(tmp_path):
    dims = load_dimensions(weights=tmp_path)
    assert "dino-vitb16" in dims["subject_consistency"] and str(tmp_path) in dims["subject_consistency"]
    assert "clip-vit-base-patch32" in dims["background_consistency"]
    assert "clip-vit-large-patch14" in dims["aesthetic_quality"]
    assert "musiq_spaq_ckpt-358bb6af.pth" in dims["imaging_quality"]
    with pytest.raises(ValueError, match="unknown VBench dimension"):
        load_dimensions(["motion"])


def _to_dino(sd: dict, layers: int, layout: str) -> dict:
    """transformers ViT keys -> DINO's (the inverse of dino_to_vit, written out independently)."""
    out = {"cls_token": sd["embeddings.cls_token"], "pos_embed": sd["embeddings.position_embeddings"],
           "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
           "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
           "norm.weight": sd["layernorm.weight"], "norm.bias": sd["layernorm.bias"],
           "head.weight": torch.zeros(3, 3)}  # DINO heads are dropped
    new = layout == "new"
    for i in range(layers):
        e = f"layers.{i}." if new else f"encoder.layer.{i}."
        att = "attention." if new else "attention.attention."
        qkv = ("q_proj", "k_proj", "v_proj") if new else ("query", "key", "value")
        for p in ("weight", "bias"):
            out[f"blocks.{i}.norm1.{p}"] = sd[e + f"layernorm_before.{p}"]
            out[f"blocks.{i}.norm2.{p}"] = sd[e + f"layernorm_after.{p}"]
            out[f"blocks.{i}.attn.proj.{p}"] = sd[e + ("attention.o_proj" if new else "attention.output.dense")
                                                  + f".{p}"]
            out[f"blocks.{i}.mlp.fc1.{p}"] = sd[e + ("mlp.fc1" if new else "intermediate.dense") + f".{p}"]
            out[f"blocks.{i}.mlp.fc2.{p}"] = sd[e + ("mlp.fc2" if new else "output.dense") + f".{p}"]
            out[f"blocks.{i}.attn.qkv.{p}"] = torch.cat([sd[e + att + f"{n}.{p}"] for n in qkv])
    return out


def test_dino_checkpoint_layout(tmp_path, tiny_backbones):
    ref = load_dino(config=VIT)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    (tmp_path / "dino-vitb16").mkdir()
    dino = _to_dino(ref.state_dict(), 2, vit_layout(ref))
    torch.save(dino, tmp_path / "dino-vitb16" / DINO_FILE)
    got = load_dino(tmp_path)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(got(pixel_values=x).last_hidden_state, ref(pixel_values=x).last_hidden_state,
                              atol=1e-5)
    assert dino_config(dino)["num_attention_heads"] == 1 and dino_config(dino)["image_size"] == 224


def test_aesthetic_head_file(tmp_path):
    torch.save({"weight": torch.ones(1, 768), "bias": torch.zeros(1)}, tmp_path / "sa_0_4_vit_l_14_linear.pth")
    head = load_aesthetic_head(tmp_path)
    assert head(torch.ones(1, 768)).item() == pytest.approx(768.0)
    torch.save({"weight": torch.ones(1, 512), "bias": torch.zeros(1)}, tmp_path / "sa_0_4_vit_l_14_linear.pth")
    with pytest.raises(ValueError, match="LAION linear head"):
        load_aesthetic_head(tmp_path)
