"""VBench dimensions: the formulas, the preprocessing, randomly initialised backbones through the real code paths,
DINO's checkpoint layout, and the missing-weights messages."""
from __future__ import annotations

import math

import pytest
import torch

from qvg.eval.vbench import consistency, load_dimensions
from qvg.eval.vbench.backbones import (DINO_FILE, dino_config, dino_features, load_aesthetic_head, load_dino,
                                       vit_layout)
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
    # VBench resizes float frames: bicubic's overshoot at an edge stays (was rounded and clamped to uint8)
    edge = torch.zeros(1, 3, 8, 8)
    edge[..., 4:] = 255
    up = resize_short(edge, 32, "bicubic")
    assert up.dtype == torch.float32 and up.min() < 0 and up.max() > 255 and not torch.equal(up, up.round())
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


def _cubic(values: list[float], t: float, a: float = -0.75) -> float:
    """values sampled at source coordinate t by cubic convolution (PyTorch's bicubic: a = -0.75, edge taps clamped)."""
    def w(x):
        x = abs(x)
        return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1 if x <= 1 else a * (x ** 3 - 5 * x ** 2 + 8 * x - 4)
    i = math.floor(t)
    return sum(values[min(max(i + m, 0), len(values) - 1)] * w(t - i - m) for m in (-1, 0, 1, 2))


def test_dino_position_interpolation_is_dinos():
    """Embeddings of a non-square frame are resized as DINO's own code does (scale factors (n + 0.1) / grid, which
    PyTorch samples by), not transformers' size= form: on a ramp, position k of n is the cubic convolution at source
    (k + 0.5) * grid / (n + 0.1) - 0.5, on the axis whose length stays too."""
    model = load_dino(config=VIT)
    emb, g = model.embeddings, 14  # (224 / 16)
    with torch.no_grad():
        ramp = torch.zeros(1, 1 + g * g, VIT["hidden_size"])
        ramp[0, 1:, 0] = torch.arange(g).repeat(g).float()  # column index
        ramp[0, 1:, 1] = torch.arange(g).repeat_interleave(g).float()  # row index
        emb.position_embeddings.copy_(ramp)
        rows, cols = 14, 24  # a 224 x 384 frame
        out = emb.interpolate_pos_encoding(torch.zeros(1, 1 + rows * cols, VIT["hidden_size"]), 224, 384)[0, 1:]
        out = out.reshape(rows, cols, -1)
        line = [float(j) for j in range(g)]
        for k in range(cols):
            assert out[5, k, 0].item() == pytest.approx(_cubic(line, (k + 0.5) * g / (cols + 0.1) - 0.5), abs=1e-4)
        for i in range(rows):
            assert out[i, 5, 1].item() == pytest.approx(_cubic(line, (i + 0.5) * g / (rows + 0.1) - 0.5), abs=1e-4)
        assert (out[:, 5, 1] - torch.arange(rows)).abs().max() > 0.01  # (resampled, not kept)
        square = emb.interpolate_pos_encoding(torch.zeros(1, 1 + g * g, VIT["hidden_size"]), 224, 224)
        assert square is emb.position_embeddings  # (as many patches as positions on a square frame: as they are)
        x = torch.randn(1, 3, 224, 384)
        assert dino_features(model, x).shape == (1, VIT["hidden_size"])


def test_aesthetic_head_file(tmp_path):
    torch.save({"weight": torch.ones(1, 768), "bias": torch.zeros(1)}, tmp_path / "sa_0_4_vit_l_14_linear.pth")
    head = load_aesthetic_head(tmp_path)
    assert head(torch.ones(1, 768)).item() == pytest.approx(768.0)
    torch.save({"weight": torch.ones(1, 512), "bias": torch.zeros(1)}, tmp_path / "sa_0_4_vit_l_14_linear.pth")
    with pytest.raises(ValueError, match="LAION linear head"):
        load_aesthetic_head(tmp_path)
