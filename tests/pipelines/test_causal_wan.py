"""The causal Wan transformer and the Self-Forcing loop on tiny configs (CPU): chunk-wise cached forward vs the
full-sequence block-causal forward, and vs a masked full forward for the rolling window with and without a sink
(24 frames), QVG at 8 bits vs BF16, RoPE offsets, cross-attention K/V reuse, save / from_pretrained, the loop's
determinism and window bookkeeping, and the streaming VAE decode vs a one-shot decode."""
import pytest
import torch

from optional_deps import need
from qvg.cache import KVCache
from qvg.pipelines.causal_wan import CausalWanTransformer, CrossKV, OffsetRotaryPosEmbed, _SelfAttention
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


def _chunkwise(model, x, t, txt, cache, cf=CF, offsets=True):
    outs = []
    with torch.no_grad():
        for c in range(x.shape[2] // cf):
            kw = {"frame_offset": c * cf} if offsets else {}  # (default: the cache's committed frames)
            outs.append(model(x[:, :, c * cf:(c + 1) * cf], t, txt, cache=cache, **kw))
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
    # with a cache, frame_offset defaults to the frames it has committed (forgetting it gave every chunk time 0)
    same = _chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF), offsets=False)
    assert torch.equal(same, got)
    # a chunk of another size is named in frames and tokens (was the cache's "write expects k and v of shape ...")
    with pytest.raises(ValueError, match=rf"one chunk: {CF} latent frames of {TPF} tokens each; got {CF + 1} of"):
        model(x[:, :, :CF + 1], t, txt, cache=KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF))


def test_capture_records_the_forwards_default_frame_offset(model):
    """KVCapture (qvg.eval) records the offset a forward given a cache and no frame_offset runs at (the cache's
    frames), not None."""
    from qvg.eval.kv_capture import KVCapture
    x, t, txt = _inputs()
    cap = KVCapture(model)
    with cap:
        _chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF), offsets=False)
    assert [c["frame_offset"] for c in cap.chunks] == []  # (it records committing forwards only)
    cache = KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF)
    with cap, torch.no_grad():
        for c in range(2):
            model(x[:, :, c * CF:(c + 1) * CF], t, txt, cache=cache, commit=True)
            cache.commit()
    assert [c["frame_offset"] for c in cap.chunks] == [0, CF]


def test_qvg_int8_cache_is_close_to_bf16(model):
    x, t, txt = _inputs()
    ref = _chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF))
    got = _chunkwise(model, x, t, txt, KVCache(2, "qvg", chunk_frames=CF, tokens_per_frame=TPF, bits=8,
                                               centroids=8))
    assert ((got - ref).norm() / ref.norm()) < 1e-2


def test_transient_forward_equals_a_plain_one_and_cannot_commit(model):
    """forward(transient=True) (the denoising steps: the cache may hold the K/V by reference until the attention)
    gives the plain forward's output; with commit=True it is refused."""
    x, t, txt = _inputs()
    caches = [KVCache(2, "qvg", chunk_frames=CF, tokens_per_frame=TPF, bits=8, centroids=8) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(x[:, :, :CF], t, txt, cache=cache)
            cache.commit()
        outs = [model(x[:, :, CF:2 * CF], t, txt, frame_offset=CF, cache=c, transient=tr)
                for c, tr in zip(caches, (True, False))]
        assert torch.equal(*outs)
        with pytest.raises(ValueError, match="transient forward"):
            model(x[:, :, CF:2 * CF], t, txt, frame_offset=CF, cache=caches[0], transient=True, commit=True)


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


WCF, WCHUNKS = 3, 8  # the window tests: 8 chunks of 3 latent frames (24 frames, past Self-Forcing's 21)


def _window_mask(sink_frames, window_frames):
    """The [N, N] token mask of what KVCache holds while each chunk is denoised (commit_every = 1): the first
    sink_frames / WCF chunks committed fill the sink and stay; every later chunk is kept while it is among the
    last window_frames / WCF committed (`KVCache._evict`; None: all). So a query of chunk i sees chunk i, the sink
    chunks before it, and the chunks j with i - window <= j < i."""
    s = sink_frames // WCF
    w = WCHUNKS if window_frames is None else window_frames // WCF
    i, j = torch.arange(WCHUNKS)[:, None], torch.arange(WCHUNKS)[None, :]
    blocks = (j == i) | ((j < i) & ((j < s) | (j >= i - w)))
    tok = torch.arange(WCHUNKS * WCF * TPF) // (WCF * TPF)
    return blocks[tok[:, None], tok[None, :]]


@pytest.mark.parametrize("sink,window", [(0, None), (0, 6), (3, 6)])
def test_chunkwise_bf16_window_equals_masked_full_forward_past_21_frames(model, sink, window):
    """The rolling window (with and without a sink) and the full history over 24 frames: the chunk-wise cached
    forward equals the full-sequence forward under the mask of what the cache holds, up to the cache's BF16
    storage (~4e-5 of the max here; the bound is 10x tighter than the block-causal test's, since the tiny model's
    attention is nearly uniform: a wrong mask moves the output by only 5e-3 to 1e-2 of the max, checked below)."""
    x, t, txt = _inputs(WCHUNKS * WCF)
    with torch.no_grad():
        full = model(x, t, txt, attn_mask=_window_mask(sink, window))
    cache = KVCache(2, "bf16", chunk_frames=WCF, tokens_per_frame=TPF, sink_frames=sink, window_frames=window)
    got = _chunkwise(model, x, t, txt, cache, cf=WCF)
    assert (got - full).abs().max() < 2e-4 * full.abs().max()
    assert cache.frames == WCHUNKS * WCF
    assert cache.tokens() == (WCHUNKS * WCF if window is None else sink + window) * TPF
    if window is not None:  # the window reference is not the block-causal one: late chunks see less
        with torch.no_grad():
            causal = model(x, t, txt, chunk_frames=WCF)
        assert (full - causal)[:, :, -WCF:].abs().max() > 2e-3 * full.abs().max()


def test_qvg_int8_window_with_sink_is_close_to_the_masked_reference(model):
    """The same rule holds when the window evicts packed units (QVG at 8 bits, commit_every = 1)."""
    x, t, txt = _inputs(WCHUNKS * WCF)
    with torch.no_grad():
        full = model(x, t, txt, attn_mask=_window_mask(3, 6))
    cache = KVCache(2, "qvg", chunk_frames=WCF, tokens_per_frame=TPF, sink_frames=3, window_frames=6, bits=8,
                    centroids=8)
    got = _chunkwise(model, x, t, txt, cache, cf=WCF)
    assert ((got - full).norm() / full.norm()) < 1e-2


def test_the_sink_changes_what_late_chunks_see(model):
    """Window of 2 chunks with and without a 1-chunk sink: the first 3 chunks see the same tokens (bitwise the same
    output); from chunk 3 on the sink keeps chunk 0 in view, and the outputs differ by 10x the window parity bound
    (the tiny model's attention is nearly uniform: ~5e-3 of the max)."""
    x, t, txt = _inputs(WCHUNKS * WCF)
    out = [_chunkwise(model, x, t, txt, KVCache(2, "bf16", chunk_frames=WCF, tokens_per_frame=TPF, sink_frames=sink,
                                                 window_frames=6), cf=WCF) for sink in (0, 3)]
    n = 3 * WCF
    assert torch.equal(out[0][:, :, :n], out[1][:, :, :n])
    for c in range(3, WCHUNKS):
        a, b = (o[:, :, c * WCF:(c + 1) * WCF] for o in out)
        assert (a - b).abs().max() > 2e-3 * b.abs().max(), c


def test_save_pretrained_and_from_pretrained_round_trip(model, tmp_path):
    """A saved CausalWanTransformer loads back with its config, weights, RoPE with offsets and causal processors:
    the same outputs, full-sequence and chunk-wise over a cache."""
    need("accelerate", "diffusers' from_pretrained of Wan (fp32 modules) needs it: pip install -e '.[test]'")
    model.save_pretrained(tmp_path)
    loaded = CausalWanTransformer.from_pretrained(tmp_path).eval()
    assert loaded.config.num_layers == CFG["num_layers"] and loaded.config.ffn_dim == CFG["ffn_dim"]
    assert isinstance(loaded.rope, OffsetRotaryPosEmbed)
    assert all(isinstance(b.attn1.processor, _SelfAttention) for b in loaded.blocks)
    x, t, txt = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(x, t, txt, chunk_frames=CF), model(x, t, txt, chunk_frames=CF))
    a, b = (_chunkwise(m, x, t, txt, KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF))
            for m in (model, loaded))
    assert torch.equal(a, b)


def test_from_pretrained_loads_a_diffusers_wan_checkpoint(model, tmp_path):
    """A checkpoint saved by diffusers' own WanTransformer3DModel (its class name in the config) loads into the
    causal model, whose full-attention forward then matches diffusers' forward."""
    need("accelerate", "diffusers' from_pretrained of Wan (fp32 modules) needs it: pip install -e '.[test]'")
    from diffusers import WanTransformer3DModel
    wan = WanTransformer3DModel(**CFG).eval()
    wan.load_state_dict(model.state_dict())
    wan.save_pretrained(tmp_path)
    loaded = CausalWanTransformer.from_pretrained(tmp_path).eval()
    x, t, txt = _inputs()
    with torch.no_grad():
        want = wan(x, t, txt, return_dict=False)[0]
        got = loaded(x, t, txt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_cross_attention_kv_is_computed_once_per_prompt(model):
    x, t, txt = _inputs(2)
    cross = CrossKV()
    with torch.no_grad():
        a = model(x, t, txt, cross=cross)
        assert len(cross.kv) == 2 and cross.nbytes > 0
        b = model(x, t, torch.zeros_like(txt), cross=cross)  # the cached text K/V win over the new text
    assert torch.equal(a, b)


def test_text_is_embedded_once_per_prompt(model):
    """Once every layer's text K/V is held, diffusers' text embedder (whose output then feeds no layer) gets one
    token per forward, not the prompt's; the output is unchanged."""
    x, t, txt = _inputs(2)
    seen = []
    hook = model.condition_embedder.text_embedder.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    try:
        with torch.no_grad():
            cross = CrossKV()
            first, second = model(x, t, txt, cross=cross), model(x, t, txt, cross=cross)
            partial = CrossKV()
            partial.kv[0] = cross.kv[0]  # one layer still to compute: it needs the embedded prompt
            third = model(x, t, txt, cross=partial)
            plain = model(x, t, txt)
    finally:
        hook.remove()
    assert seen == [7, 1, 7, 7]
    assert torch.equal(first, second) and torch.equal(first, third) and torch.equal(first, plain)
    assert CrossKV().covers(0) and not partial.covers(3) and cross.covers(2)


def test_flow_sigmas_and_the_pipeline_take_numpy_and_torch_numbers():
    """(the range checks first took Python ints and floats only: numpy / torch steps that worked were refused)"""
    import numpy as np
    want = flow_sigmas((1000, 750, 500, 250))
    assert flow_sigmas(np.array([1000, 750, 500, 250])) == want == flow_sigmas(torch.tensor([1000, 750, 500, 250]))
    assert flow_sigmas([np.int64(1000)], np.float32(5.0)) == want[:1]
    with pytest.raises(ValueError, match="steps must be numbers, got True"):
        flow_sigmas([True])
    pipe = SelfForcingPipeline(CausalWanTransformer(**CFG), context_sigma=np.float32(0.25))
    assert pipe.context_sigma == 0.25


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


def test_two_loops_on_one_cache_is_an_error_not_a_wrong_video(tiny):
    """A loop whose cache another generate() (or reset()) reset between its chunks raises (it attended the other
    video's chunks, with no error); one loop after another on the same cache is fine."""
    tr, vae, text = tiny
    cache = KVCache(len(tr.blocks), "bf16", chunk_frames=3, tokens_per_frame=16)
    pipe, emb = SelfForcingPipeline(tr, vae), text("a prompt")
    first = [c.video for c in pipe.generate(emb, 6, (8, 8), cache, seed=3)]
    again = [c.video for c in pipe.generate(emb, 6, (8, 8), cache, seed=3)]  # (after the first ran to its end)
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    g1 = pipe.generate(emb, 9, (8, 8), cache, seed=3)
    next(g1)
    next(pipe.generate(emb, 9, (8, 8), cache, seed=5))
    with pytest.raises(RuntimeError, match=r"reset \(by another generate\(\) or reset\(\)\)"):
        next(g1)
    g2 = pipe.generate(emb, 9, (8, 8), cache, seed=3)
    next(g2)
    cache.reset()
    with pytest.raises(RuntimeError, match="give each video its own cache"):
        next(g2)


def test_generate_checks_its_arguments_before_anything_runs(tiny):
    tr, vae, text = tiny
    pipe, emb = SelfForcingPipeline(tr, vae), text("a prompt")
    cache = KVCache(len(tr.blocks), "bf16", chunk_frames=3, tokens_per_frame=16)
    for args, kw, msg in (((2.5, (8, 8)), {}, r"latent_frames must be an integer >= 1, got 2.5"),
                          ((True, (8, 8)), {}, "latent_frames must be an integer"),
                          ((9, (9, 9)), {}, r"latent_hw must be \(height, width\), positive multiples of the patch"),
                          ((9, (8, 8)), {"seed": None}, "seed must be an integer >= 0"),
                          ((9, (8, 8)), {"batch": 0}, "batch must be an integer >= 1")):
        with pytest.raises(ValueError, match=msg):
            pipe.generate(emb, *args, cache, **kw)  # (raised by the call, not at the first chunk)
    for bad in (KVCache(len(tr.blocks), "bf16", chunk_frames=1, tokens_per_frame=48),  # (the same tokens per chunk)
                KVCache(len(tr.blocks) + 1, "bf16", chunk_frames=3, tokens_per_frame=16)):
        with pytest.raises(ValueError, match=f"the cache must have num_layers={len(tr.blocks)}, chunk_frames=3 and tokens_per_frame=16"):
            pipe.generate(emb, 9, (8, 8), bad)
    # text and context too, before the cache is reset (they failed at the first chunk, in torch's words)
    cache.write(0, torch.ones(1, 2, 48, 64), torch.ones(1, 2, 48, 64))
    for text_, kw, msg in ((emb[0], {}, r"text must be encoder hidden states \[1, tokens, 64\].*got \[\d+, 64\]"),
                           (torch.randn(1, 5, 4096), {}, r"text must be .*got \[1, 5, 4096\]"),
                           (torch.cat([emb, emb]), {}, r"text must be .*got \[2, \d+, 64\]"),
                           (emb.long(), {}, "floating point"),
                           ("a prompt", {}, "got str"),
                           (emb, {"context": torch.zeros(1, 16, 2, 8, 8)},
                            r"context must be \[1, 16, 3, 8, 8\], got \[1, 16, 2, 8, 8\]")):
        with pytest.raises(ValueError, match=msg):
            pipe.generate(text_, 9, (8, 8), cache, **kw)
    assert cache.frames == 0 and cache.read(0)[0].shape[2] == 48  # (not reset)
    next(pipe.generate(torch.cat([emb, emb]), 3, (8, 8), cache, batch=2))  # (one text per video, or one for all)
    for kw, msg in ((dict(chunk_frames=0), "chunk_frames must be a positive integer"),
                    (dict(steps=()), "at least one denoising step"),
                    (dict(steps="1000"), "at least one denoising step"),
                    (dict(steps=(1500, 500)), r"steps must be timesteps in \(0, 1000\]"),
                    (dict(steps=(0,)), r"steps must be timesteps in \(0, 1000\]"),
                    (dict(shift=0), "shift must be a positive number"),
                    (dict(shift=-1.0), "shift must be a positive number"),
                    (dict(context_sigma=2.0), r"context_sigma must be a noise level in \[0, 1\)"),
                    (dict(context_sigma=-0.1), "context_sigma must be")):
        with pytest.raises(ValueError, match=msg):
            SelfForcingPipeline(tr, vae, **kw)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunks_run_on_the_generation_stream_with_the_default_streams_result(monkeypatch):
    """On CUDA every chunk's forwards run on qvg.streams' generation stream (side-stream commits and prefetched
    decodes included: a full rolling window), and the video equals the one made on the default stream."""
    import contextlib

    from qvg.pipelines import self_forcing
    from qvg.streams import reserved
    tr, vae, text = build_tiny(seed=0, device="cuda")
    seen = []
    hook = tr.register_forward_pre_hook(lambda *_: seen.append(torch.cuda.current_stream()))

    def run():
        cache = KVCache(len(tr.blocks), "qvg", chunk_frames=3, tokens_per_frame=16, centroids=8, window_frames=6)
        chunks = []
        for c in SelfForcingPipeline(tr, vae).generate(text("a prompt"), 15, (8, 8), cache, seed=3):
            assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the block is left before the yield
            chunks.append(c)
        return torch.cat([c.video for c in chunks], 2), cache
    try:
        own, cache = run()
        assert seen and set(seen) == {reserved("cuda")} and torch.cuda.current_stream() == torch.cuda.default_stream()
        assert cache.prefetch_stats["used"] > 0 and cache._side  # the side streams ran
        monkeypatch.setattr(self_forcing, "generation_stream", lambda dev: contextlib.nullcontext())
        seen.clear()
        default, _ = run()
        assert set(seen) == {torch.cuda.default_stream()}
    finally:
        hook.remove()
    assert torch.equal(own, default)


def _rope_with(rope, x, offsets):
    rope.spatial_offsets = offsets
    try:
        return rope(x)
    finally:
        rope.spatial_offsets = None


def test_spatial_offsets_none_zero_and_shifted_tables(model):
    """None: Wan's tables (row i, column j); zero offsets: the same values per sample; offsets (dy, dx): row dy + i
    and column dx + j, negative positions exact (cos even, sin odd); an index past the table: one ValueError."""
    rope, x = model.rope, torch.zeros(2, 4, 3, 8, 8)
    cos, sin = rope(x)
    _, fh, fw = rope.freqs_cos.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
    grid = cos.view(3, 4, 4, -1)
    assert cos.shape == (1, 3 * TPF, 1, 64) and torch.equal(grid[1, 2, 3, rope.t_dim:], torch.cat([fh[2], fw[3]]))
    zc, zs = _rope_with(rope, x, torch.zeros(2, 3, 2, dtype=torch.long))
    assert zc.shape == (2, 3 * TPF, 1, 64) and torch.equal(zc, cos.expand(2, -1, -1, -1))
    assert torch.equal(zs, sin.expand(2, -1, -1, -1))
    off = torch.tensor([[[0, 0], [1, -2], [-3, 5]], [[2, 2], [0, 0], [0, 0]]])
    oc, os_ = _rope_with(rope, x, off)
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    pos = torch.arange(-10, 10)
    ref_cos, ref_sin = get_1d_rotary_pos_embed(rope.h_dim, pos.double(), 10000.0, use_real=True,
                                               repeat_interleave_real=True, freqs_dtype=torch.float64)
    for b, f, i, j in ((0, 1, 0, 3), (0, 2, 1, 0), (1, 0, 3, 3), (0, 0, 2, 1)):
        dy, dx = off[b, f].tolist()
        for got, ref in ((oc, ref_cos), (os_, ref_sin)):
            tok = got[b].view(3, 4, 4, -1)[f, i, j]
            assert torch.allclose(tok[rope.t_dim:rope.t_dim + rope.h_dim], ref[dy + i + 10].float(), atol=1e-6)
            assert torch.allclose(tok[rope.t_dim + rope.h_dim:], ref[dx + j + 10].float(), atol=1e-6)
        assert torch.equal(oc[b].view(3, 4, 4, -1)[f, i, j, :rope.t_dim], grid[f, i, j, :rope.t_dim])  # time as is
    for bad in (torch.tensor([[[0, 61]] * 3] * 2), torch.tensor([[[-64, 0]] * 3] * 2)):  # table: +-63 (64 rows)
        with pytest.raises(ValueError, match=r"outside the table's \+-63"):
            _rope_with(rope, x, bad)
    with pytest.raises(ValueError, match=r"integer tensor \[2, 3, 2\]"):
        _rope_with(rope, x, torch.zeros(1, 3, 2, dtype=torch.long))


def test_chunkwise_cache_with_spatial_offsets_equals_full_forward(model):
    """World-coordinate RoPE: each chunk's keys enter the cache after RoPE with their own offsets, so the chunk-wise
    cached forward equals the full block-causal forward given all frames' offsets (two samples, different offsets);
    zero offsets give exactly the plain forward, and real offsets change what later chunks see."""
    x, t, txt = _inputs()
    x, txt = torch.cat([x, x.flip(2)]), txt.expand(2, -1, -1)
    off = torch.tensor([[[0, 0], [0, 0], [0, 1], [0, 2], [-1, 2], [-2, 2]],
                        [[0, 0], [0, 0], [0, -1], [0, -2], [0, -3], [1, -3]]])
    cache = KVCache(2, "bf16", chunk_frames=CF, tokens_per_frame=TPF)
    outs = []
    with torch.no_grad():
        full = model(x, t, txt, chunk_frames=CF, spatial_offsets=off)
        for c in range(3):
            sl = slice(c * CF, (c + 1) * CF)
            outs.append(model(x[:, :, sl], t, txt, frame_offset=c * CF, cache=cache, spatial_offsets=off[:, sl]))
            cache.commit()
        plain = model(x, t, txt, chunk_frames=CF)
        zero = model(x, t, txt, chunk_frames=CF, spatial_offsets=torch.zeros_like(off))
    got = torch.cat(outs, 2)
    assert (got - full).abs().max() < 2e-3 * full.abs().max()  # BF16 storage, as the plain parity test
    assert torch.equal(zero, plain)
    assert not torch.allclose(full[:, :, CF:], plain[:, :, CF:], atol=1e-4)


def test_a_cast_is_quiet_and_casts_every_module(capfd, caplog):
    """.to(bf16) casts the whole model (fp32-kept modules too, as Self-Forcing runs it) and prints nothing: diffusers'
    override logged a from_pretrained notice on each cast, in every bf16 run of the loaders, CLI and benchmarks."""
    torch.manual_seed(0)
    m = CausalWanTransformer(**CFG).to(torch.bfloat16)
    assert m.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.to("cpu", torch.float32).dtype == torch.float32
    assert "float32" not in capfd.readouterr().err + caplog.text
