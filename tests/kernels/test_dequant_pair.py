"""qvg.kernels.dequant.dequantize_pair: a layer's K and V histories decoded in one launch, bitwise the two
separate decodes, for post- and pre-RoPE keys (only K rotated), through the ring's wrap, whole and by rows, with
the arrays and buffers anywhere (V's before K's too); sequences of different layouts take two launches."""
import pytest
import torch

from kernel_helpers import assert_bitwise_equal, clustered
from qvg.cache import KVCache
from qvg.kernels.dequant import _pair_offsets, dequantize, dequantize_pair
from qvg.rope import apply_rope, frame_angles
from qvg.sequence import PackedSequence

CASES = [("qvg", {"centroids": 4, "block_size": 32}), ("qvg-pro", {"centroids": 4, "block_size": 16}),
         ("rtn", {"bits": 4, "block_size": 32})]


def _layer(method, opts, storage, device, chunks=5):
    """A 1-layer cache's history after `chunks` commits into a 4-frame rolling window (the ring wrapped)."""
    cache = KVCache(1, method, chunk_frames=2, tokens_per_frame=16, window_frames=4, key_storage=storage, **opts)
    for c in range(chunks):
        x = clustered(2, 2, 32, 64, seed=c).to(device)
        k, v = x[:1], x[1:]
        if storage == "pre-rope":
            pos = torch.zeros(1, 2, 3, dtype=torch.int32)
            pos[..., 0] = torch.arange(2 * c, 2 * c + 2)
            k = apply_rope(k, frame_angles(pos, 4, 4, 64).to(device)[:, None])
            cache.set_positions(pos, 4, 4)
        cache.write(0, k.bfloat16(), v.bfloat16())
        cache.commit()
    L = cache.layers[0]
    return L.hist, (cache._rope_tables(L, device) if storage == "pre-rope" else None)


def _poisoned_pair(kh, tokens):
    b, h, _, d = kh.shape
    ks = torch.full((b, h, tokens, d), float("nan"), dtype=torch.bfloat16, device=kh.tensors["codes"].device)
    return ks, ks.clone()


@pytest.mark.parametrize("storage", ["post-rope", "pre-rope"])
@pytest.mark.parametrize("method,opts", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("rows", [None, (5, 50)])
def test_pair_equals_two_decodes(method, opts, storage, rows, device):
    (kh, vh), rope = _layer(method, opts, storage, device)
    assert kh.head != 0  # the ring wrapped
    r0, r1 = rows or (0, kh.shape[2])
    out = _poisoned_pair(kh, r1 - r0 + 3)  # (3 rows left for a tail)
    assert _pair_offsets(kh, vh, *out) is not None  # one launch
    dequantize_pair(kh, vh, out, rows=rows, rope=rope, block_n=16)
    want_k = dequantize(kh, rows=rows, rope=rope, block_n=16)
    want_v = dequantize(vh, rows=rows, block_n=16)
    assert_bitwise_equal(out[0][:, :, :r1 - r0], want_k, "K")
    assert_bitwise_equal(out[1][:, :, :r1 - r0], want_v, "V")
    assert torch.isnan(out[0][:, :, r1 - r0:]).all() and torch.isnan(out[1][:, :, r1 - r0:]).all()  # tail rows


def test_v_anywhere_and_other_layouts(device):
    (kh, vh), _ = _layer("qvg", CASES[0][1], "post-rope", device)
    want = dequantize(kh), dequantize(vh)
    vh2 = PackedSequence({n: t.clone() for n, t in vh.tensors.items()}, vh.spec, vh.stages, vh.chunk_len, vh.dtype,
                         head=vh.head)  # V's arrays in their own allocations
    for v in (vh, vh2):
        for order in (0, 1):  # V's output after K's, then before
            vs, ks = _poisoned_pair(kh, kh.shape[2])
            out = (ks, vs) if order else (vs, ks)
            assert _pair_offsets(kh, v, *out) is not None
            dequantize_pair(kh, v, out)
            assert_bitwise_equal(out[0], want[0], "K")
            assert_bitwise_equal(out[1], want[1], "V")
    (kh3, _), _ = _layer("qvg", CASES[0][1], "post-rope", device, chunks=1)  # fewer tokens: two launches
    assert _pair_offsets(kh3, vh, *_poisoned_pair(kh3, kh3.shape[2])) is None


@pytest.mark.parametrize("grid", [dict(progs=2), dict(plane_split=True), dict(progs=1, plane_split=True)])
def test_pair_batch2_and_grids(grid, device):
    """Batch 2 (B x H groups per sequence) and the persistent / per-plane grids: the same bits as two decodes."""
    import qvg
    x = clustered(2, 2, 48, 64, seed=9).to(device)
    kh, vh = (PackedSequence.from_chunks([qvg.compress(t.bfloat16(), "qvg", centroids=4, seed=s, block_size=32)])
              for s, t in ((0, x), (1, -x)))
    out = _poisoned_pair(kh, 48)
    dequantize_pair(kh, vh, out, **grid)
    assert_bitwise_equal(out[0], dequantize(kh), "K")
    assert_bitwise_equal(out[1], dequantize(vh), "V")


def test_out_must_be_a_contiguous_big_enough_buffer(device):
    (kh, _), _ = _layer("qvg", CASES[0][1], "post-rope", device)
    b, h, n, d = kh.shape
    good = torch.empty(b, h, n + 2, d, dtype=torch.bfloat16, device=device)
    for bad in (good[:, :, :n], good[:, :, :n - 1], good.transpose(2, 3), good[:, :1]):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            dequantize(kh, out=bad)
    dequantize(kh, out=good)
