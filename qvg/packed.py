"""`Packed`: the one container every compressed tensor lives in.

A packed object is a set of named tensors plus JSON-able metadata. Its size is the real size: `nbytes` is the
sum of the bytes of the tensors it holds, nothing estimated. Tensor names say which storage component they belong
to (see `COMPONENTS`), so caches and reports can break memory down by component without knowing the method.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Tensor name -> storage component, for accounting by component.
COMPONENTS = {
    "codes": "codes",  # packed 1/2/4/8-bit quantization codes
    "scale": "scales",  # per-group scales (FP8 E4M3 or BF16)
    "zero": "scales",  # per-group zero points of asymmetric grids (BF16)
    "tscale": "scales",  # per-(batch, head) FP32 scale of the FP8 scales
    "ids": "ids",  # per-stage k-means assignments (uint8 when K <= 256, uint16 otherwise)
    "centroids": "centroids",  # per-stage k-means centroids (BF16)
    "residual": "bf16",  # tokens kept in full precision (KIVI's residual window / token-group tail)
}


@dataclass
class Packed:
    """A compressed [B, H, N, D] tensor.

    method:  the registry name that made it (`qvg.methods()`); `qvg.decompress` dispatches on it.
    shape, dtype: of the original tensor; `decompress` returns exactly these.
    tensors: the stored data, by name (see `COMPONENTS`).
    meta:    the options needed to decode (bits, grid, block size, stages, ...), JSON-able.
    """

    method: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__} ({self.__dict__.get('method')}) has no tensor {name!r}")

    @property
    def nbytes(self) -> int:
        """Bytes held: the sum over the stored tensors of numel x element size."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def components(self) -> dict[str, int]:
        """Bytes by storage component (codes, scales, ids, centroids, bf16)."""
        out: dict[str, int] = {}
        for name, t in self.tensors.items():
            comp = COMPONENTS.get(name, name)
            out[comp] = out.get(comp, 0) + t.numel() * t.element_size()
        return out

    @property
    def bits_per_element(self) -> float:
        n = 1
        for s in self.shape:
            n *= s
        return 8.0 * self.nbytes / n

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device) -> "Packed":
        return Packed(self.method, self.shape, self.dtype, {k: v.to(device) for k, v in self.tensors.items()},
                      dict(self.meta))

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items())
        return (f"Packed({self.method!r}, shape={tuple(self.shape)}, {self.bits_per_element:.3f} bits/elem, "
                f"{self.nbytes} B: {parts})")
