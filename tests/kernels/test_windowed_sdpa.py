"""`windowed_attention` (packed history decoded window by window, SDPA with log-sum-exp, exact merge) against
`qvg.attention.attend_reference` (torch, fp32), and its merge against one softmax over the union."""
import pytest
import torch

from kernel_helpers import gen, poisoned, rel_err
from qvg.attention import attend_reference
from qvg.kernels.windowed_sdpa import decode_window, merge_lse, sdpa_lse, windowed_attention
from test_attention_kernel import HKV, TOL, _history, _qkv, _to


def _bytes(tokens: int, b: int = 1, d: int = 64) -> int:
    """window_bytes holding `tokens` tokens of K + V."""
    return tokens * 2 * b * HKV * d * 2


def _run(device, q, kh, vh, kt, vt, **kw):
    args = (q.to(device), _to(kh, device), _to(vh, device), None if kt is None else kt.to(device),
            None if vt is None else vt.to(device))
    with poisoned():  # staging buffers start as NaN: every row read must have been written
        out = windowed_attention(*args, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == device
    assert torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("tokens", [8, 50, 119, 120, 130, 144, 10 ** 6])
@pytest.mark.parametrize("name", ["qvg", "qvg-pro", "rtn-int4"])
def test_windows_and_tail(name, tokens, device):
    """History of 120 tokens + a 24-token tail; windows smaller than a chunk, ragged, exactly the history, the
    history with part / all of the tail (inline), and everything in one window."""
    kh, vh = _history(name)
    q, kt, vt = _qkv()
    ref = attend_reference(q, kh, vh, kt, vt)
    err = rel_err(_run(device, q, kh, vh, kt, vt, window_bytes=_bytes(tokens)), ref)
    assert err < TOL, f"{name} window {tokens}: {err:.4f}"


@pytest.mark.parametrize("tokens", [16, 10 ** 6])
def test_history_only_gqa_batch2_scale(tokens, device):
    kh, vh = _history("qvg", b=2, chunks=2, seed=5)
    q, _, _ = _qkv(b=2, m=40, t=0, seed=6)  # Hq = 2 Hkv
    ref = attend_reference(q, kh, vh, scale=0.3)
    err = rel_err(_run(device, q, kh, vh, None, None, scale=0.3, window_bytes=_bytes(tokens, b=2)), ref)
    assert err < TOL, err


def test_tail_only_and_tail_view(device):
    q, kt, vt = _qkv(m=33, t=45, seed=7)
    assert rel_err(_run(device, q, None, None, kt, vt), attend_reference(q, None, None, kt, vt)) < TOL
    kh, vh = _history("qvg", seed=5)
    room = torch.zeros(1, HKV, 7, kt.shape[3], dtype=kt.dtype)
    view_k, view_v = torch.cat([kt, room], 2)[:, :, :45], torch.cat([vt, room], 2)[:, :, :45]
    ref = attend_reference(q, kh, vh, kt, vt)
    for tokens in (30, 10 ** 6):  # the tail as a separate window and inline
        assert rel_err(_run(device, q, kh, vh, view_k, view_v, window_bytes=_bytes(tokens)), ref) < TOL


def test_input_errors(device):
    kh, vh = _history("rtn-int4", chunks=1)
    q, kt, vt = _qkv(m=8, t=4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        windowed_attention(q[:, :3].to(device), _to(kh, device), _to(vh, device), kt.to(device), vt.to(device))
    with pytest.raises(ValueError, match="history or a tail"):
        windowed_attention(q.to(device), None, None)


def test_lse_merge_is_the_softmax_of_the_union(device):
    g = gen(3)
    q = torch.randn(2, 3, 17, 32, generator=g).to(device)
    k = torch.randn(2, 3, 50, 32, generator=g).to(device)
    v = torch.randn(2, 3, 50, 32, generator=g).to(device)
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # the fused backends take BF16
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    whole, whole_lse = sdpa_lse(q, k, v, 0.2)
    ref_lse = torch.logsumexp(torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * 0.2, -1)
    assert torch.allclose(whole_lse, ref_lse, atol=1e-2, rtol=1e-3)
    acc = lse = None
    for a, b in ((0, 7), (7, 31), (31, 50)):
        acc, lse = merge_lse(acc, lse, *sdpa_lse(q, k[:, :, a:b], v[:, :, a:b], 0.2))
    assert torch.allclose(lse, whole_lse, atol=1e-2, rtol=1e-3)
    assert rel_err(acc.to(dt), whole) < TOL


@pytest.mark.parametrize("window", [None, 6])
def test_pre_rope_cache_tables_rotate_as_the_reference(window, device):
    """A pre-RoPE KVCache's history through the dequant kernel's rotation (the tables `KVCache._rope_tables` builds
    for its GPU path, each ring slot's frame positions) attends as the cache's reference path (decode, rotate by the stored
    positions' angles, SDPA), also after the rolling window's ring wrapped."""
    from qvg.cache import KVCache
    from qvg.rope import apply_rope, frame_angles
    g = torch.Generator().manual_seed(3)
    cache = KVCache(1, "qvg", chunk_frames=2, tokens_per_frame=16, window_frames=window, key_storage="pre-rope",
                    bits=4, centroids=4)
    for c in range(5):
        pos = torch.zeros(1, 2, 3, dtype=torch.int32)
        pos[..., 0] = torch.arange(2 * c, 2 * c + 2)
        k = apply_rope(torch.randn(1, 2, 32, 64, generator=g), frame_angles(pos, 4, 4, 64)[:, None])
        cache.set_positions(pos, 4, 4)
        cache.write(0, k.to(torch.bfloat16), torch.randn(1, 2, 32, 64, generator=g).to(torch.bfloat16))
        cache.commit()
    cache.write(0, *(torch.randn(1, 2, 32, 64, generator=g).to(torch.bfloat16) for _ in range(2)))
    L = cache.layers[0]
    assert window is None or L.hist[0].head == 2  # 3 slots: a wrong slot order rotates wrongly
    q = torch.randn(1, 4, 32, 64, generator=g).to(torch.bfloat16)
    ref = cache.attend(0, q)
    tables = cache._rope_tables(L, device)
    err = rel_err(_run(device, q, *L.hist, L.tail(0), L.tail(1), rope=tables), ref)
    assert err < TOL, f"window {window}: {err:.4f}"


@pytest.mark.parametrize("name", ["qvg", "qvg-pro"])
def test_decoded_ahead_is_the_same(name, device):
    """A window decoded ahead (`decode_window`, as the cache's prefetch does) gives bitwise the same attention;
    buffers that do not hold history + tail in one window are refused."""
    kh, vh = _history(name)
    q, kt, vt = _qkv()
    kh, vh, q, kt, vt = _to(kh, device), _to(vh, device), q.to(device), kt.to(device), vt.to(device)
    want = windowed_attention(q, kh, vh, kt, vt)
    with poisoned():
        decoded = decode_window(kh, vh, kt.shape[2])
    assert torch.equal(windowed_attention(q, kh, vh, kt, vt, decoded=decoded), want)
    with pytest.raises(ValueError, match="do not hold one window"):
        windowed_attention(q, kh, vh, kt, vt, decoded=decode_window(kh, vh, 0))
    with pytest.raises(ValueError, match="do not hold one window"):  # history over several windows
        windowed_attention(q, kh, vh, kt, vt, window_bytes=_bytes(50), decoded=decode_window(kh, vh, kt.shape[2]))
    with pytest.raises(ValueError, match="do not hold one window"):  # the history fits one window, the tail not
        windowed_attention(q, kh, vh, kt, vt, window_bytes=_bytes(kh.shape[2] + 1),
                           decoded=decode_window(kh, vh, kt.shape[2]))


@pytest.mark.parametrize("history,tokens", [(False, 10 ** 6), (True, 10 ** 6), (True, 30), (True, 50), (True, 130)])
def test_before_sdpa_is_called_once(history, tokens, device):
    """The hook (the cache queues its next prefetch there) runs once, before any SDPA call, on every path: tail
    only; history and tail in one window; several windows with the tail apart (30) or inline (50); one history window
    with the tail apart (130); the result is unchanged."""
    q, kt, vt = _qkv(seed=8)
    kh, vh = _history("qvg", seed=9) if history else (None, None)
    calls = []
    out = _run(device, q, kh, vh, kt, vt, window_bytes=_bytes(tokens), before_sdpa=lambda: calls.append(1))
    assert calls == [1]
    assert torch.equal(out, _run(device, q, kh, vh, kt, vt, window_bytes=_bytes(tokens)))


@pytest.mark.parametrize("rows", [1, 16, 39])
def test_split_sdpa_call(rows, device):
    """split_rows: the one-window SDPA call split by query rows, before_sdpa called once between the halves; the
    same attention as unsplit (GQA, history and inline tail), returned in [B, M, H, D] memory; with several windows
    (or rows 0 / M) the call is not split and before_sdpa runs before the first SDPA call as before."""
    kh, vh = _history("qvg-pro")
    q, kt, vt = _qkv(m=40)
    calls = []
    whole = _run(device, q, kh, vh, kt, vt)
    got = _run(device, q, kh, vh, kt, vt, split_rows=rows, before_sdpa=lambda: calls.append(1))
    assert calls == [1] and torch.allclose(got, whole, rtol=1e-2, atol=1e-2)
    assert got.transpose(1, 2).is_contiguous()  # (the model's output projection reads it without a copy)
    for kw in ({"split_rows": 0}, {"split_rows": 40}, {"split_rows": 16, "window_bytes": _bytes(30)}):
        calls.clear()
        out = _run(device, q, kh, vh, kt, vt, before_sdpa=lambda: calls.append(1), **kw)
        assert calls == [1] and rel_err(out, attend_reference(q, kh, vh, kt, vt)) < TOL, kw


def test_query_split_fills_whole_waves():
    """query_split: the first call's programs (128-query blocks x batch x heads) are whole waves of the SMs and the
    second's less than one; None without a partial wave or without such a split."""
    from qvg.kernels.windowed_sdpa import query_split
    assert query_split(4680, 12, 132) == 33 * 128  # Self-Forcing's chunk: 396 of 444 programs, then 48
    assert query_split(4680, 12, 66) == 33 * 128
    assert query_split(4680, 1, 132) is None  # 37 blocks of one head: less than one wave
    assert query_split(128, 12, 132) is None  # one block: nothing to split
    assert query_split(4096, 33, 132) is None  # 32 blocks x 33 = 8 whole waves: no partial wave
    assert query_split(4000, 30, 132) is None  # 22 x 30 = 5 waves, then 10 x 30 = 300 > 132: no single tail wave
    assert query_split(3900, 12, 132) == 22 * 128  # 31 blocks: 264 programs (2 waves), then 108
