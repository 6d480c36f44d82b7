"""A causal (chunk-wise) Wan transformer on diffusers' `WanTransformer3DModel`.

Same config, modules and weights as diffusers' model (`from_pretrained` loads a diffusers Wan checkpoint; our
converter loads the original key names, pipelines/checkpoints.py). Three changes, all outside the weights:
- RoPE's time index starts at `frame_offset` (the chunk's first latent frame), not at 0; optionally each frame's
  row / column indices are shifted by `spatial_offsets` (the world model's world-coordinate RoPE);
- the self-attention processors write the chunk's K/V (after RoPE, [B, heads, tokens, 128]) into a `qvg.cache
  .KVCache` and attend over everything it holds; without a cache they attend over the input, optionally
  block-causally (each chunk of `chunk_frames` frames sees itself and earlier chunks): the full-sequence reference;
- the cross-attention processors keep the text K/V of each layer once per prompt (`CrossKV`).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed


class OffsetRotaryPosEmbed(WanRotaryPosEmbed):
    """Wan's factorized 3D RoPE with the time index shifted by `frame_offset`, or given per frame by `frame_ids`
    (both set per call by the model). The time table grows on demand past `max_seq_len` (Wan's 1024 frames), so
    any video length works; the first `max_seq_len` rows are Wan's own.

    `spatial_offsets` (int [B, frames, 2], (dy, dx) in patches, or None): token (i, j) of frame f of sample b takes
    row index dy + i and column index dx + j instead of i and j (world coordinates: the world model offsets each
    frame by the camera's accumulated pan). Negative indices are exact: Wan's tables hold cos / sin of position x
    frequency from position 0, and cos is even and sin odd, so position -p reads row p with sin negated; a zero
    offset therefore gives exactly the tables of None. Indices must stay within +-(max_seq_len - 1). With offsets
    cos / sin are [B, N, 1, D] (one table per sample), else [1, N, 1, D]."""

    frame_offset = 0
    frame_ids: torch.Tensor | None = None  # [frames] time index of each frame (training's clean + noisy copies)
    spatial_offsets: torch.Tensor | None = None  # [B, frames, 2] (dy, dx) per frame, in patches

    def _time_table(self, table: torch.Tensor, which: int, need: int) -> torch.Tensor:
        ft = table[:, :self.t_dim]
        if need <= ft.shape[0]:
            return ft
        from diffusers.models.embeddings import get_1d_rotary_pos_embed
        grown = getattr(self, "_grown", None)
        if grown is None or grown[0].shape[0] < need or grown[0].device != ft.device:
            n = max(need, 2 * ft.shape[0])
            cos, sin = get_1d_rotary_pos_embed(self.t_dim, n, 10000.0, use_real=True, repeat_interleave_real=True,
                                               freqs_dtype=torch.float64)
            self._grown = grown = (cos.to(ft), sin.to(ft))
        return grown[which]

    def _checked_offsets(self, batch: int, f: int, h: int, w: int) -> torch.Tensor:
        off = self.spatial_offsets
        if off.dim() != 3 or off.shape[1:] != (f, 2) or off.shape[0] != batch or off.is_floating_point():
            raise ValueError(f"spatial_offsets must be an integer tensor [{batch}, {f}, 2] ((dy, dx) per sample and "
                             f"frame, in patches), got {off.dtype} {list(off.shape)}")
        lo = torch.minimum(off[..., 0].min(), off[..., 1].min())
        hi = torch.maximum(off[..., 0].max() + h, off[..., 1].max() + w) - 1
        reach = int(torch.maximum(-lo, hi))  # (one host sync per forward, as frame_ids' max)
        if reach >= self.max_seq_len:
            raise ValueError(f"spatial_offsets put a RoPE row / column index at {reach} patches from 0, outside the "
                             f"table's +-{self.max_seq_len - 1} (rope_max_seq_len {self.max_seq_len})")
        return off

    @staticmethod
    def _shifted(band: torch.Tensor, which: int, n: int, off: torch.Tensor) -> torch.Tensor:
        """band [R, d] (positions 0 ..), off [B, f] -> rows of positions off + 0 .. n - 1: [B, f, n, d]."""
        pos = off[..., None] + torch.arange(n, device=off.device)
        rows = band[pos.abs()]
        return rows if which == 0 else torch.where((pos < 0)[..., None], -rows, rows)  # sin(-x) = -sin(x)

    def forward(self, hidden_states: torch.Tensor):
        batch, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.patch_size
        f, h, w = frames // pt, height // ph, width // pw
        dev = self.freqs_cos.device  # (cos and sin tables: one device)
        ids = self.frame_ids
        if ids is None:  # (made where the tables are: a copy from host memory would wait for the GPU's queue)
            ids = torch.arange(self.frame_offset, self.frame_offset + f, device=dev)
            need = self.frame_offset + f
        elif ids.numel() != f:
            raise ValueError(f"frame_ids has {ids.numel()} entries for {f} frames")
        else:
            need = int(ids.max()) + 1
        off = None if self.spatial_offsets is None else self._checked_offsets(batch, f, h, w)
        b = 1 if off is None else batch
        ids = ids.to(dev, non_blocking=True)
        off = None if off is None else off.to(dev, non_blocking=True)
        out = []
        for which, table in enumerate((self.freqs_cos, self.freqs_sin)):
            _, fh, fw = table.split([self.t_dim, self.h_dim, self.w_dim], dim=1)
            ft = self._time_table(table, which, need)[ids]
            if off is None:
                rows, cols = fh[:h].view(1, 1, h, 1, -1), fw[:w].view(1, 1, 1, w, -1)
            else:
                rows = self._shifted(fh, which, h, off[..., 0])[:, :, :, None]
                cols = self._shifted(fw, which, w, off[..., 1])[:, :, None]
            grid = torch.cat([ft.view(1, f, 1, 1, -1).expand(b, f, h, w, -1), rows.expand(b, f, h, w, -1),
                              cols.expand(b, f, h, w, -1)], dim=-1)
            out.append(grid.reshape(b, f * h * w, 1, -1))
        return out[0], out[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, N, H, D], cos/sin [1 or B, N, 1, D] (each pair's value repeated)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).type_as(x)


class _Context:
    """What the processors of one forward call share."""

    def __init__(self):
        self.cache = None  # qvg.cache.KVCache, or None
        self.block_tokens = None  # without a cache: tokens per causal block (None: full attention)
        self.attn_mask = None  # without a cache: an explicit [N, N] boolean mask (True: may attend)
        self.cross = None  # CrossKV, or None
        self.commit = False  # commit each layer's chunk right after its attention (the clean re-run)
        self.transient = False  # this forward's K/V are overwritten before any commit (a denoising step)


class CrossKV:
    """Text K/V per layer, computed at the first forward and reused: one CrossKV per prompt (a new prompt needs a
    new CrossKV; the pipeline makes one per `generate` call)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv.values() for t in kv)

    def covers(self, layers: int) -> bool:
        """Whether every one of `layers` layers has its K/V here."""
        return all(i in self.kv for i in range(layers))


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
            cache.write(self.layer, k, v, transient=self.ctx.transient)
            out = cache.attend(self.layer, q)
            if self.ctx.commit:
                cache.commit_layer(self.layer)
        else:
            mask = self.ctx.attn_mask
            if self.ctx.block_tokens:
                blk = torch.arange(q.shape[2], device=q.device) // self.ctx.block_tokens
                mask = blk[None, :] <= blk[:, None]  # block-causal: a chunk sees itself and earlier chunks
            if mask is not None and not isinstance(mask, torch.Tensor):  # a flex-attention BlockMask (training)
                out = _flex_attention()(q, k, v, block_mask=mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


_FLEX = None


def _flex_attention():
    """torch's flex attention, compiled once (it is only fast compiled)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


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

    # diffusers takes a model's config keys from its __init__ signature (from_config / from_pretrained): with
    # `*args, **kwargs` alone it would drop every key of a saved config and build Wan's default model
    __init__.__signature__ = inspect.signature(WanTransformer3DModel.__init__)

    def to(self, *args, **kwargs):
        """torch's Module.to: the whole model moves / casts, as Self-Forcing runs it (every module in the one dtype).
        diffusers' override logs a notice on every cast meant for from_pretrained's fp32-kept modules, which
        printed in each bf16 run of the loaders, the CLI and the benchmarks."""
        return torch.nn.Module.to(self, *args, **kwargs)

    def tokens_per_latent_frame(self, height: int, width: int) -> int:
        _, ph, pw = self.config.patch_size
        return (height // ph) * (width // pw)

    def rope_positions(self, shape, frame_offset: int = 0, frame_ids: torch.Tensor | None = None,
                       spatial_offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
        """The RoPE position of each input frame as a cache's `set_positions` takes it (keys stored before RoPE):
        (int [B, F, 3] of (time index, dy, dx), token rows, token columns) for hidden_states of this shape."""
        batch, _, frames, height, width = shape
        pt, ph, pw = self.config.patch_size
        f = frames // pt
        ids = torch.arange(frame_offset, frame_offset + f) if frame_ids is None else frame_ids.cpu().long()
        pos = torch.zeros(batch, f, 3, dtype=torch.int32)
        pos[..., 0] = ids.to(torch.int32)
        if spatial_offsets is not None:
            pos[..., 1:] = spatial_offsets.cpu().to(torch.int32)
        return pos, height // ph, width // pw

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                *, frame_offset: int | None = None, cache=None, cross: CrossKV | None = None,
                chunk_frames: int | None = None, commit: bool = False, transient: bool = False,
                frame_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                spatial_offsets: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """hidden_states [B, C, F, H, W] (one chunk with a cache; any number of frames without), timestep [B]
        -> the model output [B, C, F, H, W]. frame_offset: the first frame's time index (default: with a cache, the
        frames it has committed, `cache.frames`, so the chunk follows its history; else 0). cache: a KVCache to write
        into and attend over. commit: each layer commits the chunk right after its attention (`cache.commit_layer`; the
        clean re-run; the cache decides when the compression is queued); the caller still calls `cache.commit()` after
        it.
        transient: this forward's K/V serve only its own attention and a later forward overwrites them before any commit
        (a denoising step): the cache may skip storing them (`KVCache.write(..., transient=True)`). chunk_frames
        (without a cache): attend block-causally in chunks of that many frames. attn_mask (without a cache): an explicit
        boolean [N, N] token mask, True where a query may attend, or a flex-attention BlockMask (e.g. a rolling window's
        reference, or training's clean + noisy copies); frame_ids: each input frame's RoPE time index (instead of
        frame_offset + 0, 1, ...). spatial_offsets: int [B, F, 2], each input frame's (dy, dx) added to its RoPE row /
        column indices, in patches (`OffsetRotaryPosEmbed`; None: screen coordinates). Keys enter the cache after RoPE,
        so each cached key keeps the position it was written with; a cache with key_storage "pre-rope" also gets each
        chunk's positions (`rope_positions`) to undo and redo it. timestep may be [B] or per token [B, N] (diffusers'
        Wan 2.2 path)."""
        if cache is not None and (chunk_frames is not None or attn_mask is not None):
            raise ValueError("chunk_frames and attn_mask are for the cache-free (full-sequence) forward")
        if chunk_frames is not None and attn_mask is not None:
            raise ValueError("give chunk_frames or attn_mask, not both")
        if commit and cache is None:
            raise ValueError("commit needs a cache")
        if commit and transient:
            raise ValueError("a transient forward's K/V are not kept: it can't commit")
        _, _, frames, height, width = hidden_states.shape
        if cache is not None and hasattr(cache, "chunk_frames"):  # (else the cache's write named its K/V's shapes)
            got = (frames // self.config.patch_size[0], self.tokens_per_latent_frame(height, width))
            if got != (cache.chunk_frames, cache.tokens_per_frame):
                raise ValueError(f"with this cache, hidden_states must be one chunk: {cache.chunk_frames} latent "
                                 f"frames of {cache.tokens_per_frame} tokens each; got {got[0]} of {got[1]} (shape "
                                 f"{list(hidden_states.shape)})")
        if frame_offset is None:  # (forgetting it gave every chunk time 0 without a word)
            frame_offset = getattr(cache, "frames", 0) if cache is not None else 0
        self.rope.frame_offset, self.rope.frame_ids = frame_offset, frame_ids
        self.rope.spatial_offsets = spatial_offsets
        if cache is not None and getattr(cache, "key_storage", "post-rope") == "pre-rope":
            cache.set_positions(*self.rope_positions(hidden_states.shape, frame_offset, frame_ids, spatial_offsets))
        if cross is not None and cross.covers(len(self.blocks)):
            # every layer's text K/V is held: the text is only read by diffusers' text embedder, whose output no
            # layer reads, so it embeds one token (the prompt's projections run once per prompt, not per forward)
            encoder_hidden_states = encoder_hidden_states[:, :1]
        ctx = self._ctx
        ctx.cache, ctx.cross, ctx.commit, ctx.attn_mask = cache, cross, commit, attn_mask
        ctx.transient = transient
        ctx.block_tokens = None if chunk_frames is None else chunk_frames * self.tokens_per_latent_frame(height, width)
        try:
            return super().forward(hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0]
        finally:
            self.rope.frame_offset, self.rope.frame_ids, self.rope.spatial_offsets = 0, None, None
            ctx.cache = ctx.cross = ctx.block_tokens = ctx.attn_mask = None
            ctx.commit = ctx.transient = False
