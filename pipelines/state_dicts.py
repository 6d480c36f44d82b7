"""Reading checkpoint files safely and loading them into a model strictly.

- `read_torch` opens a `torch.save` file with `weights_only=True` (no arbitrary unpickling) and memory-mapped
  where the format allows (tensors are read from disk when used, not at open);
- `read_safetensors` reads every `*.safetensors` file of a folder (a sharded diffusers / transformers folder);
- `empty_init` builds a model with its parameters on the meta device (no memory, no random init), for
  `load_strict` to fill: every key the model expects must be in the state dict with the same shape, and nothing
  else may be; any difference raises one `CheckpointError` naming the file and the first few keys at fault.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

SHOWN = 5  # keys named per kind of problem in an error message


class CheckpointError(ValueError):
    """A checkpoint file or directory that is missing, unreadable or does not match the model (one line)."""


def first_line(e: BaseException) -> str:
    """`Type: reason` of e as one short line: its message's first sentence (the advice libraries append, such as
    miniz's "This is an internal miniz error...", is not the user's), at most 200 characters. A weights-only
    `torch.load` that refused a file says what that means here instead of PyTorch's advice to load it with
    weights_only=False, which this project never does."""
    name, text = type(e).__name__, str(e).strip()
    if name == "UnpicklingError" and "weights only load failed" in text.lower():
        return (f"{name}: a weights-only load refused it: the file is corrupt, or it holds pickled Python objects "
                "besides tensors, which are never unpickled here")
    if not text:
        return name
    line = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text.splitlines()[0], maxsplit=1)[0]
    return f"{name}: {line[:200]}"


def read_torch(path: Path) -> dict:
    """The object in a `torch.save` file, loaded with `weights_only=True` (mmap when the file format allows)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        size = path.stat().st_size
        hint = (f"; the file is only {size} bytes: an incomplete download, or a Git LFS pointer?"
                if size < 2**20 else "")
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({first_line(e)}){hint}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found a {type(obj).__name__}")
    return obj


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `folder` (shards merged)."""
    from safetensors.torch import load_file
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({first_line(e)})") from None
    return out


def read_json(path: Path) -> dict:
    """A JSON object from a config file."""
    import json
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable JSON config ({first_line(e)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON config (an object)")
    return obj


def describe_missing(path, what: str) -> str:
    """Why `path` is not the `what` looked for, for a message after its name: a broken symbolic link, a directory,
    another kind of file, or absent."""
    path = Path(path)
    if path.is_symlink() and not path.exists():  # (a dangling or looping link: `ls` shows the very name)
        return f"a broken symbolic link, not a {what}"
    if path.is_dir():
        return f"a directory, not a {what}"
    return f"not a {what}" if path.exists() else f"no such {what}"


def check_tensors(sd: dict, source) -> dict[str, torch.Tensor]:
    """`sd` if it is a flat state dict (str -> tensor), else a CheckpointError."""
    bad = [str(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{source}: not a state dict: {few_keys(bad)} {'is' if len(bad) == 1 else 'are'} not "
                              f"tensor{'' if len(bad) == 1 else 's'}")
    # tensors without plain data (saved from the meta device, sparse, quantized) failed later in a copy, naming
    # neither the file nor the key
    odd = [f"{k} ({'meta' if v.is_meta else v.layout if v.layout != torch.strided else 'quantized'})"
           for k, v in sd.items() if v.is_meta or v.layout != torch.strided or v.is_quantized]
    if odd:
        raise CheckpointError(f"{source}: {len(odd)} tensor{'s' * (len(odd) > 1)} without dense data: "
                              f"{few_keys(odd)}")
    return sd


def merged_keys_error(source, what: str, keys: list[str]) -> CheckpointError:
    """The error for a file's keys that its renaming merged into a key another of its keys also became (a Wan name
    beside its diffusers / transformers name): named as unexpected, since one tensor would silently replace the
    other."""
    return CheckpointError(f"{source}: not a {what} checkpoint: {len(keys)} unexpected key{'s' * (len(keys) > 1)} "
                           f"({few_keys(keys)}): once converted, another key of the file has the same name")


def few_keys(keys) -> str:
    """The first few keys, comma-separated, and how many more (for one-line messages)."""
    keys = list(keys)
    shown = ", ".join(keys[:SHOWN])
    return shown + (f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")


@contextlib.contextmanager
def empty_init():
    """Within: module parameters are created on the meta device (buffers stay real: non-persistent ones such as
    RoPE tables are computed at init and never in a checkpoint)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_strict(model: torch.nn.Module, sd: dict[str, torch.Tensor], source, *, what: str,
                file_names: dict[str, str] | None = None, missing_names=None, missing_note: str = "",
                device="cpu", dtype: torch.dtype | None = None):
    """Fill `model` (built under `empty_init`) with `sd`, cast to `dtype` (floating tensors) on `device`.
    Every key of the model's state dict must be in `sd` with its shape, and `sd` must hold nothing else.
    file_names: model key -> the key as the file names it (for messages; default: the same). Tensors shared by
    several keys (the same storage and view) stay shared. missing_names: model key -> the name the file would
    give it, for the keys it lacks (default: the model's names, which the message then says), and missing_note
    what the message adds after them. Returns the model, in eval mode."""
    file_names = file_names or {}
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in sd]
    unexpected = [file_names.get(k, k) for k in sd if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:  # (named as the file would name them: keys the model ties to one tensor are one file key)
            shown = list(dict.fromkeys(map(missing_names, missing))) if missing_names else missing
            named = few_keys(shown) + missing_note if missing_names else \
                f"{few_keys(missing)}; as the model names {'them' if len(missing) > 1 else 'it'}"
            parts.append(f"{len(shown)} missing key{'s' * (len(shown) > 1)} ({named})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key{'s' * (len(unexpected) > 1)} ({few_keys(unexpected)})")
        raise CheckpointError(f"{source}: not a {what} checkpoint: {' and '.join(parts)}")
    wrong = [f"{file_names.get(k, k)} {list(sd[k].shape)} (expected {list(v.shape)})"
             for k, v in expected.items() if sd[k].shape != v.shape]
    if wrong:
        raise CheckpointError(f"{source}: {len(wrong)} tensor{'s' * (len(wrong) > 1)} of the wrong shape for a "
                              f"{what}: {few_keys(wrong)}")
    kinds = [f"{file_names.get(k, k)} ({sd[k].dtype}, expected {v.dtype})" for k, v in expected.items()
             if sd[k].is_floating_point() != v.is_floating_point() or sd[k].is_complex() != v.is_complex()]
    if kinds:  # (an integer weight: load_state_dict's error was two lines naming neither file nor key)
        raise CheckpointError(f"{source}: {len(kinds)} tensor{'s' * (len(kinds) > 1)} of the wrong kind for a "
                              f"{what}: {few_keys(kinds)}")
    moved: dict[tuple, torch.Tensor] = {}
    out = {}
    for k in expected:
        t = sd[k]
        same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if same not in moved:
            moved[same] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)
        out[k] = moved[same]
    model.load_state_dict(out, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:  # a parameter outside the state dict: a bug here, not in the file
        raise RuntimeError(f"{what}: parameters left unloaded: {few_keys(left)}")
    return model.to(device).eval()
