"""PackedSequence storage: every array of a sequence lives in one allocation (one allocator block per layer's K
or V), and building, appending and dropping keep the decoded values."""
import torch

import qvg
from qvg.sequence import PackedSequence


def _chunks(n=3):
    g = torch.Generator().manual_seed(0)
    return [qvg.compress(torch.randn(1, 2, 40, 64, generator=g).bfloat16(), "qvg", centroids=4, seed=i)
            for i in range(n)]


def _one_storage(seq: PackedSequence) -> bool:
    return len({t.untyped_storage().data_ptr() for t in seq.tensors.values()}) == 1


def test_one_allocation_and_same_values():
    ch = _chunks()
    whole = PackedSequence.from_chunks(ch)
    grown = PackedSequence.from_chunks(ch[:1]).append(ch[1]).append(ch[2])
    dropped = whole.drop_first(1)
    for seq in (whole, grown, dropped):
        assert _one_storage(seq)
    assert torch.equal(whole.decompress(), grown.decompress())
    assert torch.equal(dropped.decompress(), PackedSequence.from_chunks(ch[1:]).decompress())
    want = torch.cat([qvg.decompress(c) for c in ch], 2)
    assert torch.equal(whole.decompress(), want)
    assert whole.nbytes == sum(c.nbytes for c in ch)


def test_ring_replaces_the_oldest_chunk_in_place():
    """replace_oldest: the rolling window's commit. Same storage, same bytes; decoding (oldest first), appending
    and dropping see the chunks in time order; the warm start is the newest chunk's centroids."""
    ch = _chunks(6)
    ring = PackedSequence.from_chunks(ch[:3])
    ptr, nbytes = ring.tensors["codes"].data_ptr(), ring.nbytes
    for i in range(3, 6):
        ring = ring.replace_oldest(ch[i])
        want = PackedSequence.from_chunks(ch[i - 2:i + 1])
        assert ring.tensors["codes"].data_ptr() == ptr and ring.nbytes == nbytes
        assert ring.head == (i - 2) % 3
        assert torch.equal(ring.decompress(), want.decompress())
        assert torch.equal(ring.last_centroids(), ch[i].tensors["centroids"])
        assert torch.equal(ring.in_order().tensors["ids"], want.tensors["ids"])
    ring = PackedSequence.from_chunks(ch[:3]).replace_oldest(ch[3])  # wrapped once: head 1
    assert torch.equal(ring.append(ch[4]).decompress(), PackedSequence.from_chunks(ch[1:5]).decompress())
    assert torch.equal(ring.drop_first(1).decompress(), PackedSequence.from_chunks(ch[2:4]).decompress())
    assert ring.drop_first(3) is None


def test_wrapped_ring_rotates_keys_by_their_slots_frames():
    """Keys stored before RoPE: frame0 lists the slots' start frames (as the kernels read them); the reference
    decode of a wrapped ring equals the same chunks in time order with their frames in time order."""
    from qvg.rope import RopeTables
    ch = _chunks(4)  # 40 tokens per chunk = 2 frames of 4 x 5
    ring = PackedSequence.from_chunks(ch[:3]).replace_oldest(ch[3])  # slots hold chunks 3, 1, 2
    by_slot = RopeTables(4, 5, 64, torch.tensor([6, 2, 4]), max_frames=16)
    in_time = RopeTables(4, 5, 64, torch.tensor([2, 4, 6]), max_frames=16)
    want = PackedSequence.from_chunks(ch[1:4]).decompress(in_time)
    assert torch.equal(ring.decompress(by_slot), want)


def test_append_pair_puts_a_layers_k_and_v_in_one_allocation():
    """The cache's growth path: K's and V's sequences, each one chunk longer, in ONE allocation (one allocator
    block per layer), holding exactly what separate appends hold."""
    import pytest
    ks, vs = _chunks(3), _chunks(4)[1:]
    k_seq = v_seq = None
    for kc, vc in zip(ks, vs):
        k_seq, finish = PackedSequence.append_pair(k_seq, kc, v_seq)
        v_seq = finish(vc)
        assert len({t.untyped_storage().data_ptr() for s in (k_seq, v_seq) for t in s.tensors.values()}) == 1
    assert torch.equal(k_seq.decompress(), PackedSequence.from_chunks(ks).decompress())
    assert torch.equal(v_seq.decompress(), PackedSequence.from_chunks(vs).decompress())
    assert k_seq.nbytes + v_seq.nbytes == sum(c.nbytes for c in ks + vs)
    with pytest.raises(ValueError, match="same chunks"):
        PackedSequence.append_pair(k_seq, ks[0], None)
    with pytest.raises(ValueError, match="same chunks"):
        PackedSequence.append_pair(k_seq, ks[0], v_seq.drop_first(1))
    other = qvg.compress(torch.randn(1, 2, 40, 64).bfloat16(), "qvg", centroids=8)
    _, finish = PackedSequence.append_pair(k_seq, ks[0], v_seq)
    with pytest.raises(ValueError, match="V's chunk"):
        finish(other)
