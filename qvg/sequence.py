"""`PackedSequence`: several packed chunks of one layer's K (or V) laid end to end, the layout attention reads.

Chunks are qvg / qvg-pro / rtn packs of the same options and the same length L (tokens per head). Token n of the
sequence belongs to chunk n // L; its ids index that chunk's centroid table and its FP8 scales are relative to
that chunk's tscale. Tensors ([B, H] = batch x kv heads, C chunks, N = C * L):
    codes [B, H, N, D*b/8] uint8    scale [B, H, N, D/B]    tscale [B, H, C] fp32 (FP8 scales only)
    zero [B, H, N, D/B] bf16 (asym grid only)
    ids [S, B, H, N]                centroids [S, B, H, C, K, D] bf16
`nbytes` is the sum of these bytes, the same as the chunks' own. A rolling window reuses the oldest chunk's slot for
the newest (`replace_oldest`): chunks then sit in slot order, oldest at slot `head` (per-chunk RoPE frames follow
the slots).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .packed import Packed
from .quant import QuantSpec, dequantize_packed, to_dtype

PER_TOKEN_METHODS = ("rtn", "qvg", "qvg-pro")
_TOKEN_DIM = {"codes": 2, "scale": 2, "zero": 2, "tscale": 2, "ids": 3, "centroids": 3}  # the dim chunks extend


def _layout(p: Packed) -> tuple:
    """(spec, stages, chunk length, dtype, (B, H, D, K centroids)) of a chunk; chunks of one sequence share it."""
    from .compression.registry import token_spec
    if p.method not in PER_TOKEN_METHODS:
        raise ValueError(f"packed attention reads {PER_TOKEN_METHODS}, not {p.method!r}")
    b, h, n, d = p.shape
    return token_spec(p.meta), p.meta.get("stages", 0), n, p.dtype, (b, h, d, _centroid_count(p.tensors))


def _centroid_count(tensors: dict) -> int:
    return tensors["centroids"].shape[-2] if "centroids" in tensors else 0


_ALIGN = 256  # bytes: every array of a sequence starts aligned in the shared allocation


def carved_bytes(nbytes: int) -> int:
    """Bytes an array of `nbytes` takes in a sequence's allocation (`_carve`): rounded up to the alignment."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _carve(like: dict[str, torch.Tensor], sizes: dict[str, int], device, copies: int = 1) -> list[dict]:
    """`copies` sets of empty arrays shaped like `like` except along their token dim (`sizes`), all views of ONE
    allocation: the CUDA caching allocator may round each large block up by as much as 1 MiB, so a sequence (or a
    layer's K and V sequences: `copies=2`) pays that once, not once per array (codes, scales and ids are each over
    1 MiB for a few frames of history)."""
    shapes, offs, total = {}, [], 0
    for name, t in like.items():
        shape = list(t.shape)
        shape[_TOKEN_DIM[name]] = sizes[name]
        shapes[name] = shape
    for _ in range(copies):
        offs.append({})
        for name, t in like.items():
            offs[-1][name] = total
            total += carved_bytes(math.prod(shapes[name]) * t.element_size())
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return [{name: buf[off[name]:off[name] + math.prod(shapes[name]) * like[name].element_size()]
             .view(like[name].dtype).view(shapes[name]) for name in like} for off in offs]


def _chunk_tensors(p: Packed) -> dict[str, torch.Tensor]:
    """A chunk's stored tensors as a one-chunk sequence's: per-chunk tscale and centroid tables get a chunk axis."""
    t = {name: p.tensors[name] for name in ("codes", "scale", "zero", "ids") if name in p.tensors}
    if "tscale" in p.tensors:
        t["tscale"] = p.tensors["tscale"].unsqueeze(2)
    if "centroids" in p.tensors:
        t["centroids"] = p.tensors["centroids"].unsqueeze(3)
    return t


def _joined(parts: list[dict[str, torch.Tensor]], copies: int = 1) -> dict[str, torch.Tensor] | list[dict]:
    """The parts' arrays concatenated along their token dims, into one allocation (`_carve`). copies > 1: also that
    many more empty sets of the same arrays in the same allocation -> [filled, empty, ...]."""
    first = parts[0]
    sizes = {n: sum(p[n].shape[_TOKEN_DIM[n]] for p in parts) for n in first}
    out = _carve(first, sizes, next(iter(first.values())).device, copies)
    _fill(out[0], parts)
    return out if copies > 1 else out[0]


def _fill(dest: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]]) -> None:
    for n, d in dest.items():
        if len(parts) == 1:
            d.copy_(parts[0][n])
        else:
            torch.cat([p[n] for p in parts], _TOKEN_DIM[n], out=d)


def _layout_of(seq: "PackedSequence") -> tuple:
    b, h, _, d = seq.shape
    return seq.spec, seq.stages, seq.chunk_len, seq.dtype, (b, h, d, _centroid_count(seq.tensors))


@dataclass
class PackedSequence:
    tensors: dict[str, torch.Tensor]
    spec: QuantSpec
    stages: int
    chunk_len: int
    dtype: torch.dtype
    head: int = 0  # the slot of the oldest chunk (non-zero once `replace_oldest` has wrapped the ring)

    @classmethod
    def from_chunks(cls, chunks: list[Packed]) -> "PackedSequence":
        if not chunks:
            raise ValueError("a packed sequence needs at least one chunk")
        lay = _layout(chunks[0])
        if any(_layout(c) != lay for c in chunks[1:]):
            raise ValueError("all chunks of a packed sequence need the same storage options and shape")
        parts = [_chunk_tensors(c) for c in chunks]
        return cls(_joined(parts), *lay[:4])

    def _check(self, chunk: Packed) -> None:
        if _layout(chunk) != _layout_of(self):
            raise ValueError("an appended chunk needs the sequence's storage options and shape")

    def _span(self, name: str, first: int, count: int) -> torch.Tensor:
        """Chunk slots [first, first + count) of one array (a view)."""
        unit = 1 if name in ("tscale", "centroids") else self.chunk_len
        return self.tensors[name].narrow(_TOKEN_DIM[name], first * unit, count * unit)

    def append(self, chunk: Packed) -> "PackedSequence":
        """A new sequence with `chunk` at the end (one copy of the stored bytes; the cache calls it once per commit
        while the history grows)."""
        self._check(chunk)
        return self._rebuilt(self._parts() + [_chunk_tensors(chunk)])

    @staticmethod
    def append_pair(k_seq: "PackedSequence | None", k_chunk: Packed, v_seq: "PackedSequence | None"):
        """A layer's K and V sequences, each with one more chunk, carved from ONE allocation (the allocator then
        rounds one block per layer, not two). V's chunk usually comes later (its compression may reuse the
        buffers K's came in), so this returns (K's new sequence, finish) and finish(v_chunk) returns V's. The V
        sequence must hold as many chunks of the same layout as K's (or both be None)."""
        lay = _layout(k_chunk)
        if k_seq is not None:
            k_seq._check(k_chunk)
        if (k_seq is None) != (v_seq is None) or (v_seq is not None and (
                v_seq.num_chunks != k_seq.num_chunks or v_seq.head != k_seq.head
                or _layout_of(v_seq) != _layout_of(k_seq))):
            raise ValueError("append_pair: the K and V sequences must hold the same chunks' layout")
        k_parts = (k_seq._parts() if k_seq is not None else []) + [_chunk_tensors(k_chunk)]
        dk, dv = _joined(k_parts, copies=2)

        def finish(v_chunk: Packed) -> PackedSequence:
            if _layout(v_chunk) != lay:
                raise ValueError("append_pair: V's chunk needs K's storage options and shape")
            _fill(dv, (v_seq._parts() if v_seq is not None else []) + [_chunk_tensors(v_chunk)])
            return PackedSequence(dv, *lay[:4])
        return PackedSequence(dk, *lay[:4]), finish

    def replace_oldest(self, chunk: Packed) -> "PackedSequence":
        """Overwrite the oldest chunk's slot with `chunk` in place, which becomes the newest: a ring, so a rolling
        window's commit moves one chunk's bytes, not the history's. Slots then stop being in time order (`head`
        is the oldest); attention over the whole sequence does not depend on the order, and `in_order`,
        `decompress`, `append` and `drop_first` restore it. Returns self."""
        self._check(chunk)
        for n, src in _chunk_tensors(chunk).items():
            self._span(n, self.head, 1).copy_(src)
        self.head = (self.head + 1) % self.num_chunks
        return self

    def in_order(self) -> "PackedSequence":
        """The same chunks oldest first: self when the slots are in order, else a copy."""
        return self._rebuilt(self._parts()) if self.head else self

    def _parts(self, skip: int = 0) -> list[dict[str, torch.Tensor]]:
        """Views of the chunks in time order without the oldest `skip`: one or two runs of slots."""
        c = self.num_chunks
        first, n = (self.head + skip) % c, c - skip
        runs = [(first, n)] if first + n <= c else [(first, c - first), (0, n - (c - first))]
        return [{n: self._span(n, a, k) for n in self.tensors} for a, k in runs]

    def _rebuilt(self, parts: list[dict[str, torch.Tensor]]) -> "PackedSequence":
        return PackedSequence(_joined(parts), self.spec, self.stages, self.chunk_len, self.dtype)

    def drop_first(self, count: int) -> "PackedSequence | None":
        """The sequence without its oldest `count` chunks (copied, so their bytes are freed), or None if none
        remain."""
        if count >= self.num_chunks:
            return None
        return self._rebuilt(self._parts(count))

    @property
    def num_chunks(self) -> int:
        return self.tensors["codes"].shape[2] // self.chunk_len

    def last_centroids(self) -> torch.Tensor | None:
        """The newest chunk's centroids [S, B, H, K, D] (a view): the next chunk's k-means warm start."""
        return self.tensors["centroids"][:, :, :, self.head - 1] if self.stages else None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, n, w = self.tensors["codes"].shape
        return b, h, n, w * 8 // self.spec.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def decompress(self, rope=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reference decode of the whole sequence, oldest chunk first (materializes it: tests and the torch fallback
        only, on the CPU and at head dims the kernels do not take). `rope` (qvg.rope.RopeTables): the keys were
        stored before RoPE; rotate them as they are read.
        dtype: of the result (default the stored dtype; torch.float32 gives the exact decode, unrounded)."""
        b, h, n, d = self.shape
        c = n // self.chunk_len
        t = self.tensors
        if "tscale" in t:  # per-chunk tscale -> dequantize chunk by chunk
            parts = []
            for i in range(c):
                sl = slice(i * self.chunk_len, (i + 1) * self.chunk_len)
                part = {name: t[name][:, :, sl] for name in ("codes", "scale", "zero") if name in t}
                parts.append(dequantize_packed({**part, "tscale": t["tscale"][:, :, i]}, self.spec, d))
            y = torch.cat(parts, 2)
        else:
            y = dequantize_packed(t, self.spec, d)
        for s in range(self.stages):
            cent = t["centroids"][s].float()  # [B, H, C, K, D]
            ids = t["ids"][s].long().view(b, h, c, self.chunk_len)
            y = y + torch.gather(cent, 3, ids[..., None].expand(-1, -1, -1, -1, d)).view(b, h, n, d)
        if rope is not None:  # per slot, as the kernels rotate: the tables list each slot's frame positions
            from .rope import apply_rope
            y = apply_rope(y, rope.angles(self.chunk_len).to(y.device))
        if self.head:  # a wrapped ring: the oldest chunk first
            y = torch.cat([y[:, :, self.head * self.chunk_len:], y[:, :, :self.head * self.chunk_len]], 2)
        return to_dtype(y, self.dtype if dtype is None else dtype)
