"""The Self-Forcing chunk-wise loop (model + cache + loop), and the streaming VAE decode.

Per chunk of `chunk_frames` latent frames, starting from noise: for each of the few denoising steps the causal
transformer predicts the flow v (= noise - x0) at the step's noise level sigma, x0 = x_t - sigma v, and the next
step re-noises x0 to its own sigma with fresh noise. After the last step the clean x0 runs once more at t = 0,
which writes the clean K/V into the cache, and the cache commits the chunk. Steps: the timesteps
[1000, 750, 500, 250] warped by the flow-matching shift (5.0): sigma = shift s / (1 + (shift - 1) s), s = t/1000.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qvg.numbers import is_whole
from qvg.streams import generation_stream


def flow_sigmas(steps=(1000, 750, 500, 250), shift: float = 5.0, train_steps: int = 1000) -> list[float]:
    """The denoising steps' noise levels (sigma in (0, 1]) after the shift warp. steps: timesteps in
    (0, train_steps]; shift > 0 (ValueError otherwise)."""
    shift = _real(shift, "shift")
    if not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a positive number, got {shift!r}")
    if isinstance(steps, (str, bytes)):
        raise ValueError(f"steps must be timesteps in (0, {train_steps}], got {steps!r}")
    steps = [_real(t, "steps") for t in steps]  # (numpy / torch numbers and arrays too, as before the checks)
    if not all(0 < t <= train_steps for t in steps):
        raise ValueError(f"steps must be timesteps in (0, {train_steps}], got {steps!r}")
    out = []
    for t in steps:
        s = t / train_steps
        out.append(shift * s / (1 + (shift - 1) * s))
    return out


def _real(v, name: str) -> float:
    """v as a float: a Python, numpy or 0-d torch number (not a bool); ValueError naming `name` otherwise."""
    if isinstance(v, bool) or getattr(v, "dtype", None) == getattr(torch, "bool"):
        raise ValueError(f"{name} must be numbers, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be numbers, got {v!r}") from None


@dataclass
class ChunkResult:
    index: int  # chunk number
    first_frame: int  # its first latent frame in the cache's time (a context chunk counts: the world model's is 0-2)
    latents: torch.Tensor  # [B, C, chunk_frames, h, w], the clean prediction
    video: torch.Tensor | None  # decoded frames [B, 3, frames, H, W] in [-1, 1] (with a VAE)


class StreamingVAEDecoder:
    """Decodes latents chunk by chunk with diffusers' causal Wan VAE, keeping its temporal feature cache between
    chunks, so every chunk's frames exist as soon as it is done and equal a one-shot decode of all latents."""

    def __init__(self, vae):
        self.vae = vae
        cfg = vae.config
        self.mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        self.reset()

    def reset(self) -> None:
        self.vae.clear_cache()
        self.first = True

    @torch.no_grad()
    def decode(self, z: torch.Tensor, normalized: bool = True) -> torch.Tensor:
        """z [B, C, f, h, w] (normalized latents, as the transformer makes them) -> frames [B, 3, F, H, W]."""
        vae = self.vae
        if normalized:
            z = z * self.std.to(z) + self.mean.to(z)
        x = vae.post_quant_conv(z.to(vae.dtype))
        outs = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                    first_chunk=self.first))
            self.first = False
        out = torch.cat(outs, 2)
        if getattr(vae.config, "patch_size", None) is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp(-1.0, 1.0)


class SelfForcingPipeline:
    """transformer: a CausalWanTransformer; vae: a diffusers AutoencoderKLWan or None (latents only); decoder: any
    object with reset() and decode(latents) -> frames in [-1, 1], used instead of the VAE (the world model's
    PixelDecoder)."""

    def __init__(self, transformer, vae=None, *, chunk_frames: int = 3, steps=(1000, 750, 500, 250),
                 shift: float = 5.0, decoder=None, context_sigma: float = 0.0):
        self.transformer, self.vae, self.decoder = transformer, vae, decoder
        cs = _real(context_sigma, "context_sigma")
        if not 0 <= cs < 1:
            raise ValueError(f"context_sigma must be a noise level in [0, 1), got {context_sigma!r}")
        # Self-Forcing's context noise: the clean re-run at this noise level (x0 re-noised to it, timestep cs * 1000),
        # as its training does (about context_noise / 1000 there); its inference feeds the clean x0 with timestep
        # context_noise and adds no noise. Both defaults are 0 (identical paths); the embedded world model uses 0.1
        self.context_sigma = cs
        if not is_whole(chunk_frames, 1):
            raise ValueError(f"chunk_frames must be a positive integer, got {chunk_frames!r}")
        if isinstance(steps, (str, bytes)) or not len(steps):
            raise ValueError(f"steps: give at least one denoising step, got {steps!r}")
        self.chunk_frames = chunk_frames
        self.sigmas = flow_sigmas(steps, shift)

    def generate(self, text: torch.Tensor, latent_frames: int, latent_hw: tuple[int, int], cache, *, seed: int = 0,
                 batch: int = 1, context: torch.Tensor | None = None,
                 chunk_inputs: Callable[[int], dict] | None = None) -> Iterator[ChunkResult]:
        """Yield the chunks of a video of `latent_frames` latent frames (the last chunk cut to fit). text:
        encoder hidden states [B, L, text_dim]; cache: a qvg.cache.KVCache of this model's layers, chunk_frames and
        tokens per latent frame (reset when the first chunk is asked for; one video at a time: a loop whose cache
        another loop reset since raises). context: clean latents [B, C, chunk_frames, h, w] that come first (the
        world model's start image): run once at t = 0 into the cache as chunk 0, not yielded; the generated chunks
        follow it. chunk_inputs(c): extra model inputs for chunk c (counting the context chunk), e.g. the world
        model's action. The arguments are checked here, before anything runs."""
        model = self.transformer
        for name, v, low in (("latent_frames", latent_frames, 1), ("batch", batch, 1), ("seed", seed, 0)):
            if not is_whole(v, low):
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        _, ph, pw = model.config.patch_size
        if (not isinstance(latent_hw, (tuple, list)) or len(latent_hw) != 2
                or not all(is_whole(v, 1) for v in latent_hw) or latent_hw[0] % ph or latent_hw[1] % pw):
            raise ValueError(f"latent_hw must be (height, width), positive multiples of the patch size ({ph}, {pw}), "
                             f"got {latent_hw!r}")
        text_dim = model.config.text_dim
        if (not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[0] not in (1, batch)
                or text.shape[2] != text_dim or not text.is_floating_point()):
            got = list(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
            raise ValueError(f"text must be encoder hidden states [{batch if batch == 1 else f'1 or {batch}'}, tokens, "
                             f"{text_dim}] (floating point), got {got}")
        shape = (batch, model.config.in_channels, self.chunk_frames, *latent_hw)
        if context is not None and (not isinstance(context, torch.Tensor) or tuple(context.shape) != shape):
            got = list(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
            raise ValueError(f"context must be {list(shape)}, got {got}")
        tpf = model.tokens_per_latent_frame(*latent_hw)
        if (getattr(cache, "num_layers", None), getattr(cache, "chunk_frames", None),
                getattr(cache, "tokens_per_frame", None)) != (len(model.blocks), self.chunk_frames, tpf):
            raise ValueError(f"the cache must have num_layers={len(model.blocks)}, chunk_frames={self.chunk_frames} "
                             f"and tokens_per_frame={tpf} for this model at {tuple(latent_hw)} latents")
        return self._generate(text, latent_frames, tuple(latent_hw), cache, seed, batch, context, chunk_inputs)

    @torch.no_grad()
    def _generate(self, text, latent_frames, latent_hw, cache, seed, batch, context, chunk_inputs):
        from .causal_wan import CrossKV
        model = self.transformer
        dev, dtype = model.device, model.dtype
        cf = self.chunk_frames
        h, w = latent_hw
        chunks = -(-latent_frames // cf)
        cache.reset()
        mine = cache.resets
        cross = CrossKV()
        decoder = self.decoder or (StreamingVAEDecoder(self.vae) if self.vae is not None else None)
        if decoder is not None:
            decoder.reset()
        gen = torch.Generator().manual_seed(seed)  # CPU draws: the same noise on every device
        text = text.to(dev, dtype)
        shape = (batch, model.config.in_channels, cf, h, w)
        extra = chunk_inputs or (lambda c: {})
        first = 0
        if context is not None:
            with generation_stream(dev):
                model(context.to(dev, dtype), torch.zeros(batch, device=dev), text, frame_offset=0, cache=cache,
                      cross=cross, commit=True, **extra(0))
                cache.commit()
            first = 1
        for c in range(chunks):
            if cache.resets != mine:  # (another video's loop took the cache between two chunks of this one)
                raise RuntimeError("the cache was reset (by another generate() or reset()) while this video was "
                                   "running: give each video its own cache")
            with generation_stream(dev):  # (not across the yield: the caller's code runs on its own stream)
                f0 = (c + first) * cf
                lat, video = self._chunk(shape, gen, text, f0, cache, cross, extra(c + first), decoder,
                                         keep=min(cf, latent_frames - c * cf))
            yield ChunkResult(c, f0, lat, video)

    def _chunk(self, shape, gen, text, f0, cache, cross, kw, decoder, keep):
        """One chunk: the denoising steps (x0 prediction, re-noised between steps), the clean re-run that writes its
        K/V, the commit; its first `keep` latent frames and their decoded video (None without a decoder)."""
        model, dtype, batch = self.transformer, self.transformer.dtype, shape[0]
        dev = model.device
        x = torch.randn(shape, generator=gen).to(dev, dtype)
        x0 = x
        for i, sigma in enumerate(self.sigmas):
            t = torch.full((batch,), sigma * 1000.0, device=dev)
            v = model(x, t, text, frame_offset=f0, cache=cache, cross=cross, transient=True, **kw)
            x0 = (x.float() - sigma * v.float()).to(dtype)
            if i + 1 < len(self.sigmas):
                nxt = self.sigmas[i + 1]
                noise = torch.randn(shape, generator=gen).to(dev, torch.float32)
                x = ((1 - nxt) * x0.float() + nxt * noise).to(dtype)
        # the clean re-run at t = 0 writes the chunk's clean K/V, then it becomes history (the last chunk too: the
        # cache then holds the whole video, ready for a continuation)
        xc, cs = x0, self.context_sigma
        if cs > 0:
            xc = ((1 - cs) * x0.float() + cs * torch.randn(shape, generator=gen).to(dev)).to(dtype)
        model(xc, torch.full((batch,), cs * 1000.0, device=dev), text, frame_offset=f0, cache=cache, cross=cross,
              commit=True, **kw)
        cache.commit()
        lat = x0[:, :, :keep]
        return lat, decoder.decode(lat.float()) if decoder is not None else None
