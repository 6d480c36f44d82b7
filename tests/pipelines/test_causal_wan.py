"""The causal Wan transformer and the Self-Forcing loop on tiny configs (CPU): chunk-wise cached forward vs the
full-sequence block-causal forward, QVG at 8 bits vs BF16, RoPE offsets, cross-attention K/V reuse, the loop's
determinism and window bookkeeping, and the streaming VAE decode vs a one-shot decode."""
import pytest
import torch

from qvg.cache import KVCache
from qvg.pipelines.causal_wan import CausalWanTransformer, CrossKV
from qvg.pipelines.self_forcing import SelfForcingPipeline, flow_sigmas
from qvg.pipelines.tiny import build_tiny

CFG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
           text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64)
CF, TPF = 2, 16  # frames per chunk; tokens per latent frame at 8 x 8 latents with 2 x 2 patches


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalWanTransformer(**CFG).eval()


def _inputs(frames=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 4, frames, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 32, generator=g)


def _chunkwise(model, x, t, txt, cache):
    outs = []
    with torch.no_grad():
        for c in range(x.shape[2] // CF):
            outs.append(model(x[:, :, c * CF:(c + 1) * CF], t, txt, frame_offset=c * CF, cache=cache))
            cache.commit()
    return torch.cat(outs, 2)


def test_chunkwise_bf16_cache_equals_full_block_causal_forward(model):
    x, t, txt = _inputs()
    with torch.no_grad():
        full = model(x, t, txt, chunk_frames=CF)
    got = _chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF))
    # the only difference: the cache stores K/V in BF16 (the model here runs in FP32)
    assert (got - full).abs().max() < 2e-3 * full.abs().max()
    with torch.no_grad():
        causal_first = model(x[:, :, :CF], t, txt)
    assert torch.allclose(full[:, :, :CF], causal_first, atol=1e-5)  # block-causal: chunk 0 sees only itself


def test_qvg_int8_cache_is_close_to_bf16(model):
    x, t, txt = _inputs()
    ref = _chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF))
    got = _chunkwise(model, x, t, txt, KVCache(2, "qvg", chunk_frames=CF, tokens_per_frame=TPF, bits=8,
                                               centroids=8))
    assert ((got - ref).norm() / ref.norm()) < 1e-2


def test_rope_offset_shifts_the_time_index(model):
    """RoPE of frames 5..6 = the last two frames of RoPE over frames 0..6 (RoPE being relative, a shift alone
    leaves one chunk's self-attention unchanged: the cached parity test above covers the cross-chunk effect)."""
    x7 = torch.zeros(1, 4, 7, 8, 8)
    whole = model.rope(x7)
    model.rope.frame_offset = 5
    try:
        part = model.rope(x7[:, :, :2])
    finally:
        model.rope.frame_offset = 0
    for a, b in zip(part, whole):
        assert torch.equal(a, b[:, 5 * TPF:])


def test_rope_table_grows_past_its_configured_length(model):
    """Wan's table stops at rope_max_seq_len (64 here); frames past it get the same formula, computed on demand,
    and the rows inside it are Wan's own."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    rope = model.rope
    x = torch.zeros(1, 4, 2, 8, 8)
    rope.frame_ids = torch.tensor([62, 100])
    try:
        cos, sin = rope(x)
    finally:
        rope.frame_ids = None
    ref_cos, ref_sin = get_1d_rotary_pos_embed(rope.t_dim, 101, 10000.0, use_real=True,
                                               repeat_interleave_real=True, freqs_dtype=torch.float64)
    for got, ref in ((cos, ref_cos), (sin, ref_sin)):
        t = got.view(2, TPF, -1)[:, 0, :rope.t_dim]
        assert torch.allclose(t[0], ref[62].to(t), atol=1e-6) and torch.allclose(t[1], ref[100].to(t), atol=1e-6)
    x, t, txt = _inputs(2)
    with torch.no_grad():
        assert torch.isfinite(model(x, t, txt, frame_offset=200)).all()


def test_explicit_mask_and_frame_ids_reproduce_the_block_causal_forward(model):
    x, t, txt = _inputs()
    blk = torch.arange(6 * TPF) // (CF * TPF)
    with torch.no_grad():
        ref = model(x, t, txt, chunk_frames=CF)
        got = model(x, t, txt, attn_mask=blk[None, :] <= blk[:, None], frame_ids=torch.arange(6))
    assert torch.equal(ref, got)


def test_cross_attention_kv_is_computed_once_per_prompt(model):
    x, t, txt = _inputs(2)
    cross = CrossKV()
    with torch.no_grad():
        a = model(x, t, txt, cross=cross)
        assert len(cross.kv) == 2 and cross.nbytes > 0
        b = model(x, t, torch.zeros_like(txt), cross=cross)  # the cached text K/V win over the new text
    assert torch.equal(a, b)


def test_flow_sigmas_follow_the_shift_warp():
    s = flow_sigmas()
    assert s[0] == 1.0 and all(a > b for a, b in zip(s, s[1:]))
    assert abs(s[2] - 5 * 0.5 / (1 + 4 * 0.5)) < 1e-12


@pytest.fixture(scope="module")
def tiny():
    return build_tiny(seed=0)


def _generate(tiny, method, frames=9, **kw):
    tr, vae, text = tiny
    cache = KVCache(len(tr.blocks), method, chunk_frames=3, tokens_per_frame=16, **kw)
    chunks = list(SelfForcingPipeline(tr, vae).generate(text("a prompt"), frames, (8, 8), cache, seed=3))
    return chunks, cache


def test_loop_is_deterministic_and_cuts_the_last_chunk(tiny):
    a, _ = _generate(tiny, "qvg", frames=8, centroids=8)
    b, _ = _generate(tiny, "qvg", frames=8, centroids=8)
    assert [c.latents.shape[2] for c in a] == [3, 3, 2]
    assert all(torch.equal(x.latents, y.latents) and torch.equal(x.video, y.video) for x, y in zip(a, b))


def test_loop_window_and_sink_bookkeeping(tiny):
    chunks, cache = _generate(tiny, "qvg", frames=18, centroids=8, sink_frames=3, window_frames=6)
    assert len(chunks) == 6 and cache.frames == 18  # every chunk committed (the cache is ready to continue)
    assert cache.tokens() == (3 + 6) * 16  # sink + window


def test_the_clean_rerun_writes_the_cache(tiny):
    """The committed K/V of chunk 0 are those of the clean prediction at t = 0, not of a denoising step."""
    tr, _, text = tiny
    chunks, cache = _generate(tiny, "bf16", frames=6)
    fresh = KVCache(len(tr.blocks), "bf16", chunk_frames=3, tokens_per_frame=16)
    with torch.no_grad():
        tr(chunks[0].latents, torch.zeros(1), text("a prompt"), frame_offset=0, cache=fresh)
    for layer in (0, len(tr.blocks) - 1):
        assert torch.equal(cache.read(layer)[0][:, :, :48], fresh.read(layer)[0])


def test_streaming_vae_decode_equals_one_shot_decode(tiny):
    _, vae, _ = tiny
    chunks, _ = _generate(tiny, "bf16", frames=9)
    lat = torch.cat([c.latents for c in chunks], 2)
    z = lat * torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1) + \
        torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        full = vae.decode(z).sample
    torch.testing.assert_close(torch.cat([c.video for c in chunks], 2), full, atol=1e-5, rtol=0)
