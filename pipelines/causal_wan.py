"""A causal (chunk-wise) Wan transformer on diffusers' `WanTransformer3DModel`.

Same config, modules and weights as diffusers' model (`from_pretrained` loads a diffusers Wan checkpoint; our
converter loads the original key names, pipelines/checkpoints.py). Three changes, all outside the weights:
- RoPE's time index starts at `frame_offset` (the chunk's first latent frame), not at 0;
- the self-attention processors write the chunk's K/V (after RoPE, [B, heads, tokens, 128]) into a `qvg.cache
  .KVCache` and attend over everything it holds; without a cache they attend over the input, optionally
  block-causally (each chunk of `chunk_frames` frames sees itself and earlier chunks): the full-sequence reference;
- the cross-attention processors keep the text K/V of each layer once per prompt (`CrossKV`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed


class OffsetRotaryPosEmbed(WanRotaryPosEmbed):
    """Wan's factorized 3D RoPE with the time index shifted by `frame_offset` (set per call by the model)."""

    frame_offset = 0

    def forward(self, hidden_states: torch.Tensor):
        _, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.patch_size
        f, h, w = frames // pt, height // ph, width // pw
        t0 = self.frame_offset
        if t0 + f > self.max_seq_len:
            raise ValueError(f"frames {t0}..{t0 + f} exceed the RoPE table ({self.max_seq_len} frames: "
                             f"rope_max_seq_len in the config)")
        out = []
        for table in (self.freqs_cos, self.freqs_sin):
            ft, fh, fw = table.split([self.t_dim, self.h_dim, self.w_dim], dim=1)
            grid = torch.cat([ft[t0:t0 + f].view(f, 1, 1, -1).expand(f, h, w, -1),
                              fh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                              fw[:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1)
            out.append(grid.reshape(1, f * h * w, 1, -1))
        return out[0], out[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, N, H, D], cos/sin [1, N, 1, D] (each pair's value repeated)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).type_as(x)


class _Context:
    """What the processors of one forward call share."""

    def __init__(self):
        self.cache = None  # qvg.cache.KVCache, or None
        self.block_tokens = None  # without a cache: tokens per causal block (None: full attention)
        self.cross = None  # CrossKV, or None
        self.commit = False  # commit each layer's chunk right after its attention (the clean re-run)


class CrossKV:
    """Text K/V per layer, computed at the first forward and reused: one CrossKV per prompt (a new prompt needs a
    new CrossKV; the pipeline makes one per `generate` call)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv.values() for t in kv)


class _SelfAttention:
    def __init__(self, layer: int, ctx: _Context):
        self.layer, self.ctx = layer, ctx

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        heads = attn.heads
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (heads, -1))
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, N, D]
        cache = self.ctx.cache
        if cache is not None:
            cache.write(self.layer, k, v)
            out = cache.attend(self.layer, q)
            if self.ctx.commit:
                cache.commit_layer(self.layer)
        else:
            mask = None
            if self.ctx.block_tokens:
                blk = torch.arange(q.shape[2], device=q.device) // self.ctx.block_tokens
                mask = blk[None, :] <= blk[:, None]  # block-causal: a chunk sees itself and earlier chunks
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


class _CrossAttention:
    def __init__(self, layer: int, ctx: _Context):
        self.layer, self.ctx = layer, ctx

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        heads = attn.heads
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (heads, -1)).transpose(1, 2)
        cross = self.ctx.cross
        if cross is not None and self.layer in cross.kv:
            k, v = cross.kv[self.layer]
        else:
            k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (heads, -1)).transpose(1, 2)
            v = attn.to_v(encoder_hidden_states).unflatten(2, (heads, -1)).transpose(1, 2)
            if cross is not None:
                cross.kv[self.layer] = (k, v)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


class CausalWanTransformer(WanTransformer3DModel):
    """`WanTransformer3DModel` that runs chunk by chunk over a KV cache (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        old = self.rope
        self.rope = OffsetRotaryPosEmbed(old.attention_head_dim, old.patch_size, old.max_seq_len)
        self._ctx = _Context()
        for i, block in enumerate(self.blocks):
            if block.attn1.add_k_proj is not None or block.attn2.add_k_proj is not None:
                raise ValueError("image-conditioned (I2V) Wan configs are not supported by the causal model")
            block.attn1.set_processor(_SelfAttention(i, self._ctx))
            block.attn2.set_processor(_CrossAttention(i, self._ctx))

    def tokens_per_latent_frame(self, height: int, width: int) -> int:
        _, ph, pw = self.config.patch_size
        return (height // ph) * (width // pw)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                *, frame_offset: int = 0, cache=None, cross: CrossKV | None = None, chunk_frames: int | None = None,
                commit: bool = False, **kwargs) -> torch.Tensor:
        """hidden_states [B, C, F, H, W] (one chunk with a cache; any number of frames without), timestep [B]
        -> the model output [B, C, F, H, W]. frame_offset: the first frame's time index. cache: a KVCache to
        write into and attend over. commit: each layer commits the chunk right after its attention
        (`cache.commit_layer`; the clean re-run), so compression overlaps the forward; the caller still calls
        `cache.commit()` after it. chunk_frames (without a cache): attend block-causally in chunks of that many
        frames."""
        if cache is not None and chunk_frames is not None:
            raise ValueError("chunk_frames is for the cache-free (full-sequence) forward")
        if commit and cache is None:
            raise ValueError("commit needs a cache")
        _, _, frames, height, width = hidden_states.shape
        self.rope.frame_offset = frame_offset
        ctx = self._ctx
        ctx.cache, ctx.cross, ctx.commit = cache, cross, commit
        ctx.block_tokens = None if chunk_frames is None else chunk_frames * self.tokens_per_latent_frame(height, width)
        try:
            return super().forward(hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0]
        finally:
            self.rope.frame_offset = 0
            ctx.cache = ctx.cross = ctx.block_tokens = None
            ctx.commit = False
