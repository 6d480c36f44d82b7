"""The method registry: a method is a named composition of the primitives (rotation, clustering, scalar quantizer,
packer) plus its preset options and its analytic bits-per-element formula. Adding a method = one `Method(...)`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..packed import Packed
from ..quant import QuantSpec

Shape = tuple[int, int, int, int]


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    defaults: dict  # every option the method takes, with its preset value
    compress: Callable[..., dict[str, torch.Tensor]]  # (x, options[, init]) -> the tensors to store
    decompress: Callable[[Packed], torch.Tensor]
    bits: Callable[[Shape, dict], float]  # analytic bits per element, from the storage layout
    formula: str  # the same, as text for docs
    warm_start: bool = False  # takes `init` (centroids of a previous chunk)


REGISTRY: dict[str, Method] = {}


def register(m: Method) -> Method:
    REGISTRY[m.name] = m
    return m


def token_spec(o: dict) -> QuantSpec:
    """The per-token group quantizer most methods share."""
    return QuantSpec(bits=o["bits"], grid=o["grid"], axis="token", group=o["block_size"],
                     scale_dtype=o["scale_dtype"])


def scale_overhead_bits(spec: QuantSpec, n: int, d: int) -> float:
    """Bits per element of the group scales (+ zero points) and, for FP8, the per-(batch, head) FP32 tscale."""
    return spec.scale_bits / spec.group + (32 / (n * d) if spec.scale_dtype == "fp8" else 0.0)


QUANT_DEFAULTS = {"bits": 2, "block_size": 64, "grid": "auto", "scale_dtype": "fp8"}  # (a seed only where it is used)
