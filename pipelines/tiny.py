"""A tiny Self-Forcing model: the same causal Wan transformer, loop, cache and Wan VAE as the real one, at a size
that runs on a laptop CPU, with seeded random weights (`build_tiny`), so its video is structured noise: the tests
build it to exercise the Self-Forcing path end to end. (qvg-generate's `--pipeline tiny` runs the trained embedded
world model instead, pipelines/world_model.py.) Also Wan's frame rate and its frames -> latent frames rule, which
the Self-Forcing path of qvg-generate uses."""
from __future__ import annotations

import torch

TINY_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16,
                        out_channels=16, text_dim=64, freq_dim=64, ffn_dim=256, num_layers=4, rope_max_seq_len=1024)
TINY_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
FPS = 16  # Wan's frame rate
SPATIAL, TEMPORAL = 8, 4  # the Wan VAE's compression: pixels per latent (H, W) and frames per latent frame


class ByteTextEncoder(torch.nn.Module):
    """Prompt -> [1, L, dim]: UTF-8 bytes through a seeded embedding table (a stand-in for umT5 at tiny size)."""

    def __init__(self, dim: int, max_len: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.max_len = max_len

    @torch.no_grad()
    def forward(self, prompt: str) -> torch.Tensor:
        ids = list(prompt.encode("utf-8")[:self.max_len]) or [0]
        return self.embed(torch.tensor([ids], device=self.embed.weight.device))


def build_tiny(seed: int = 0, device="cpu", dtype=torch.float32):
    """(transformer, vae, text encoder), seeded random init."""
    from diffusers import AutoencoderKLWan

    from .causal_wan import CausalWanTransformer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = CausalWanTransformer(**TINY_TRANSFORMER)
        vae = AutoencoderKLWan(**TINY_VAE)
        text = ByteTextEncoder(TINY_TRANSFORMER["text_dim"])
    if dtype != torch.float32:
        transformer = transformer.to(dtype=dtype)  # (diffusers keeps its fp32 modules only through from_pretrained)
    return transformer.to(device).eval(), vae.to(device).eval(), text.to(device).eval()


def latent_frames_for(frames: int) -> int:
    """Latent frames whose decode gives at least `frames` video frames (1 + 4 (n - 1))."""
    return 1 + -(-(max(frames, 1) - 1) // TEMPORAL)
