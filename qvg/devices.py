"""A device a user names (a --device flag, a `device=` argument) -> torch.device, or one ValueError that says what is
wrong: torch's own errors were a list of twenty device types ('gpu'), an AssertionError ('Torch not compiled with
CUDA enabled') or a CUDA error at the first tensor moved ('cuda:5' on one GPU)."""
from __future__ import annotations

import torch


def check_device(device, name: str = "device") -> torch.device:
    """`device` (text or a torch.device) as a torch.device that exists here: cpu, or cuda[:N] with a GPU N.
    ValueError otherwise, its message led by `name` (the flag or argument)."""
    if isinstance(device, torch.device):
        dev = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"{name}: not a device: {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"{name} must be cpu or cuda[:N], got {str(device)!r}")  # (torch takes cpu:5 as cpu)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {device}: no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name} {device}: there are {torch.cuda.device_count()} CUDA devices")
    return dev
