"""K/V captured from a real rollout: hooks on a `CausalWanTransformer` (the embedded world model, or Wan) that
record, at every clean re-run (the forward with commit=True, whose K/V the cache stores as history), each layer's
self-attention keys before RoPE, its values and the chunk's RoPE (cos, sin). Keys after RoPE, what the cache holds,
are the pre-RoPE keys rotated as the attention processor rotates them (`post_rope_key`). Nothing in the model or
the cache changes: the hooks read `attn1.norm_k` / `attn1.to_v` outputs and `rope` outputs.

    cap = KVCapture(model)
    with cap:                            # (or EmbeddedRunner.run(..., capture=cap))
        for _ in rollout(model, cfg, start, actions, cache): pass
    cap.key(c, layer), cap.value(c, layer)   # [1, H, N, D] float32; chunk 0 is the start image's context chunk
"""
from __future__ import annotations

from functools import partial

import torch

from ..pipelines.causal_wan import _rotate


class KVCapture:
    def __init__(self, model):
        self.model = model
        self.heads = model.blocks[0].attn1.heads
        self.chunks: list[dict] = []
        self._handles = []
        self._active = False
        self._cur: dict | None = None

    def __enter__(self) -> "KVCapture":
        if self._handles:
            raise RuntimeError("KVCapture is already recording")
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._end))
        self._handles.append(m.rope.register_forward_hook(self._rope))
        for i, blk in enumerate(m.blocks):
            self._handles.append(blk.attn1.norm_k.register_forward_hook(partial(self._kv, "k", i)))
            self._handles.append(blk.attn1.to_v.register_forward_hook(partial(self._kv, "v", i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _start(self, module, args, kwargs):
        self._active = bool(kwargs.get("commit"))
        if self._active:
            n = len(self.model.blocks)
            fo = kwargs.get("frame_offset")
            if fo is None:  # (the forward's default: the frames its cache has committed)
                fo = getattr(kwargs.get("cache"), "frames", 0)
            self._cur = {"k": [None] * n, "v": [None] * n, "rope": None, "frame_offset": fo}

    def _end(self, module, args, out):
        if self._active:
            self.chunks.append(self._cur)
        self._active, self._cur = False, None

    def _rope(self, module, args, out):
        if self._active:
            self._cur["rope"] = tuple(t.detach().float().cpu() for t in out)

    def _kv(self, which: str, layer: int, module, args, out):
        if self._active:  # [B, N, H * D] -> [B, H, N, D]
            self._cur[which][layer] = out.detach().float().cpu().unflatten(2, (self.heads, -1)).transpose(1, 2)

    # ---- views ---------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.model.blocks)

    def key(self, chunk: int, layer: int, post_rope: bool = True) -> torch.Tensor:
        """Keys [1, H, N, D] float32 of a captured chunk: after RoPE (as the attention sees them) or before."""
        k = self.chunks[chunk]["k"][layer]
        return post_rope_key(k, *self.chunks[chunk]["rope"]) if post_rope else k

    def value(self, chunk: int, layer: int) -> torch.Tensor:
        return self.chunks[chunk]["v"][layer]

    def rotate(self, chunk: int, k: torch.Tensor) -> torch.Tensor:
        """Apply chunk `chunk`'s RoPE to keys [1, H, N, D] (RoPE on read of keys stored before it)."""
        return post_rope_key(k, *self.chunks[chunk]["rope"])


def post_rope_key(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention processor's RoPE on keys [B, H, N, D] (it rotates [B, N, H, D])."""
    return _rotate(k.transpose(1, 2).float(), cos, sin).transpose(1, 2)
