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
