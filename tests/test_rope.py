"""qvg.rope: Wan's 3D RoPE (bands, factorized tables) and decoding pre-RoPE keys with RoPE applied on read."""
import pytest
import torch

import qvg
from qvg.attention import attend_reference
from qvg.rope import RopeTables, apply_rope, bands, frame_angles, grid_angles
from qvg.sequence import PackedSequence


def test_bands_match_wan():
    assert bands(128) == (44, 42, 42) and sum(bands(64)) == 64


def test_rotation_is_orthogonal_and_invertible():
    x = torch.randn(2, 3, 2 * 4 * 5, 128, generator=torch.Generator().manual_seed(0))
    a = grid_angles(2, 4, 5, 128, t0=9)
    y = apply_rope(x, a)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(y, a, inverse=True), x, rtol=1e-5, atol=1e-5)


def test_positions_follow_t_h_w_order():
    a = grid_angles(2, 3, 4, 128, t0=5)
    bt, bh, _ = bands(128)
    tok = 1 * 12 + 2 * 4 + 3  # frame 5 + 1, row 2, column 3
    assert a[tok, 1] == pytest.approx(6 * 10000 ** (-2 / bt))
    assert a[tok, bt // 2 + 1] == pytest.approx(2 * 10000 ** (-2 / bh))
    assert a[tok, -1] != 0 and a[0, bt // 2:].abs().sum() == 0  # token 0: row 0, column 0


def test_tables_match_per_chunk_angles():
    rope = RopeTables(3, 4, 64, torch.tensor([0, 2, 9]), max_frames=12)
    ang = rope.angles(2 * 3 * 4)
    torch.testing.assert_close(ang[24:48], grid_angles(2, 3, 4, 64, t0=2))
    # every angle is a table entry: frame, row or column row of its band
    t, h, w = 9 + 1, 2, 3
    tok = 48 + 1 * 12 + h * 4 + w
    sp_h, sp_w = rope.split
    cos = rope.table[0]
    assert cos[t, 0] == pytest.approx(ang[tok, 0].cos().item(), abs=1e-6)
    assert cos[12 + h, sp_h] == pytest.approx(ang[tok, sp_h].cos().item(), abs=1e-6)
    assert cos[12 + 3 + w, sp_w] == pytest.approx(ang[tok, sp_w].cos().item(), abs=1e-6)


def _panning_positions() -> torch.Tensor:
    """[3 slots, 2 frames, 3]: times out of step and spatial offsets both ways (a camera that pans)."""
    return torch.tensor([[[0, 0, 0], [1, -2, 3]], [[5, 1, -4], [4, 2, 0]], [[9, 0, 7], [10, -1, 7]]])


def test_tables_with_positions_match_frame_angles():
    """Per-frame positions (time, dy, dx): the reference angles are `frame_angles` of them, and the kernels' view
    (table rows of each frame's time, first row and first column) reads the same angles from the table; negative
    times and offsets included."""
    pos = _panning_positions()
    early = pos.clone()
    early[0, :, 0] = torch.tensor([-3, -2])  # a slot before time 0
    for p in (pos, early):
        rope = RopeTables(3, 4, 64, positions=p)
        ang = rope.angles(2 * 3 * 4)
        torch.testing.assert_close(ang, frame_angles(p, 3, 4, 64).reshape(-1, 32))
        kp = rope.kernel_positions(2)
        sp_h, sp_w = rope.split
        cos, sin = rope.table
        for c, f, i, j in ((0, 0, 1, 1), (0, 1, 2, 3), (1, 0, 0, 0), (2, 1, 1, 2)):
            tok = (c * 2 + f) * 12 + i * 4 + j
            t_row, r_row, c_row = kp[c * 2 + f].tolist()
            for tab, fn in ((cos, torch.cos), (sin, torch.sin)):
                assert tab[t_row, 0] == pytest.approx(fn(ang[tok, 0]).item(), abs=1e-6)
                assert tab[r_row + i, sp_h] == pytest.approx(fn(ang[tok, sp_h]).item(), abs=1e-6)
                assert tab[c_row + j, sp_w] == pytest.approx(fn(ang[tok, sp_w]).item(), abs=1e-6)
        assert rope.slots == 3 and rope.nbytes == rope.table.numel() * 4 + 18 * 4  # (the kernels' positions)
    with pytest.raises(ValueError, match="positions must be"):
        RopeTables(3, 4, 64, positions=pos[0])  # [frames, 3]: no slot axis
    with pytest.raises(ValueError, match="takes positions"):
        RopeTables(3, 4, 64, pos[:, 0, 0], max_frames=11, positions=pos)  # both ways of giving the times
    with pytest.raises(ValueError, match="for 2 frames per chunk, not 3"):
        rope.kernel_positions(3)
    late = pos.clone()
    late[..., 0] += 5000  # a rolling window late in a long video: the table holds the window's times only
    far = RopeTables(3, 4, 64, positions=late)
    assert far.table.shape == RopeTables(3, 4, 64, positions=pos).table.shape  # (11 time rows: 5000 .. 5010)
    torch.testing.assert_close(far.angles(24), frame_angles(late, 3, 4, 64).reshape(-1, 32))
    other = RopeTables(3, 4, 64, theta=500.0, positions=pos)  # (angles keep theta)
    torch.testing.assert_close(other.angles(24), frame_angles(pos, 3, 4, 64, theta=500.0).reshape(-1, 32))


def test_tables_by_first_frame_refuse_times_past_them():
    """Given frame0 and max_frames, a chunk's frames must end below max_frames: the kernels would otherwise read a
    time past the table's time rows (the rows' band) without an error. Negative first frames are covered."""
    rope = RopeTables(3, 4, 64, torch.tensor([0, 2, 9]), max_frames=12)
    rope.kernel_positions(3)  # frames 9, 10, 11
    with pytest.raises(ValueError, match="past them"):
        rope.kernel_positions(4)
    early = RopeTables(3, 4, 64, torch.tensor([-2, 0]), max_frames=4)
    pos = torch.zeros(2, 2, 3, dtype=torch.long)
    pos[..., 0] = torch.tensor([[-2, -1], [0, 1]])
    torch.testing.assert_close(early.angles(24), frame_angles(pos, 3, 4, 64).reshape(-1, 32))
    kp = early.kernel_positions(2)
    assert kp[:, 0].tolist() == [0, 1, 2, 3]  # time rows from -2


def test_decompress_with_rope_and_attention():
    g = torch.Generator().manual_seed(1)
    chunks = [qvg.compress(torch.randn(1, 2, 24, 64, generator=g), "qvg", centroids=8, seed=i) for i in range(3)]
    seq = PackedSequence.from_chunks(chunks)
    rope = RopeTables(3, 4, 64, torch.tensor([0, 2, 4]), max_frames=8)
    torch.testing.assert_close(seq.decompress(rope), apply_rope(seq.decompress(), rope.angles(24)))
    q = torch.randn(1, 4, 5, 64, generator=g)
    k = apply_rope(seq.decompress(), rope.angles(24))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                           seq.decompress().repeat_interleave(2, 1))
    torch.testing.assert_close(attend_reference(q, seq, seq, rope=rope), ref, rtol=1e-4, atol=1e-5)
