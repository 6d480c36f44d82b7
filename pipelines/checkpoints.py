"""Self-Forcing on Wan2.1-T2V-1.3B from a local directory: the generator, the Wan VAE and the umT5 text encoder.

    load_self_forcing(DIR, device, dtype=torch.bfloat16) -> (transformer, vae, text_encoder, sources)

The directory (`qvg-generate --pipeline self-forcing --checkpoint DIR`) is laid out as the Self-Forcing repository
downloads it, or flatter:

    DIR/
      self_forcing_dmd.pt            or DIR/checkpoints/self_forcing_dmd.pt, or the only *.pt in DIR or DIR/checkpoints
      wan_models/Wan2.1-T2V-1.3B/    or DIR/Wan2.1-T2V-1.3B/, or these files directly in DIR:
        Wan2.1_VAE.pth
        models_t5_umt5-xxl-enc-bf16.pth
        google/umt5-xxl/             the tokenizer
        config.json                  optional: Wan's transformer config (default: Wan2.1-T2V-1.3B's)

or, in place of the Wan2.1-T2V-1.3B folder, the diffusers layout (Wan2.1-T2V-1.3B-Diffusers: vae/, text_encoder/,
tokenizer/, and transformer/config.json, optional; the transformer's weights come from the generator).

The generator file holds {'generator': state dict, 'generator_ema': state dict, ...} with Wan's own key names
under Self-Forcing's wrapper prefix `model.` (diffusers' names, as a CausalWanTransformer's state_dict() has them,
are taken as they are); loaded with `weights_only=True` (never unpickled arbitrarily),
memory-mapped. `ema=None` (default) takes 'generator_ema' where present (what Self-Forcing's `--use_ema`
inference uses), else 'generator'; True / False insist on one. Wan's keys are converted to diffusers' names by
diffusers' own converters, and every component is loaded strictly (state_dicts.load_strict): a wrong, incomplete
or corrupt file raises one CheckpointError naming the file and the keys at fault.

Architectures: the transformer's from config.json (Wan's names: dim, num_heads, ffn_dim, ...; missing entries
take the 1.3B values); the VAE is Wan2.1's (4 stages, 2 residual blocks each) with its base width read from the
file (96 in Wan2.1_VAE.pth); the text encoder is umT5-XXL's (24 layers) with its widths read from the file.
Dtypes: the transformer's weights in `dtype`, as Self-Forcing runs it (its RoPE tables stay FP32: they are
computed, not loaded, and Self-Forcing too keeps them out of its BF16 cast); the VAE in `vae_dtype` (FP32, Wan's
default; Self-Forcing's inference script casts it to BF16 with the rest); the text encoder in `text_dtype` (BF16,
its file's dtype), its output cast to `dtype`. Nothing is randomly initialised on the way: models are built with
their parameters on the meta device and take the file's tensors (memory-mapped, so a CPU load in the file's dtype
copies nothing).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .state_dicts import CheckpointError, check_tensors, describe_missing, empty_init, first_line, load_strict, \
    merged_keys_error, read_json, read_safetensors, read_torch

GENERATOR_FILE = "self_forcing_dmd.pt"
WAN_FOLDERS = ("Wan2.1-T2V-1.3B", "Wan2.1-T2V-1.3B-Diffusers")
VAE_FILE, T5_FILE, TOKENIZER_FOLDER = "Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl"
WRAPPER_PREFIX = "model."  # Self-Forcing's WanDiffusionWrapper holds the Wan model as `.model`
# FSDP's, activation checkpointing's and torch.compile's wrappers
TRAINING_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
DDP_PREFIX = "module."  # DistributedDataParallel's, at the start of every key
WAN_T2V_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan's config.json names -> diffusers' (dim and num_heads become heads x head dim)
WAN_CONFIG_NAMES = {"in_dim": "in_channels", "out_dim": "out_channels", "ffn_dim": "ffn_dim", "freq_dim": "freq_dim",
                    "text_dim": "text_dim", "num_layers": "num_layers", "eps": "eps",
                    "cross_attn_norm": "cross_attn_norm"}


class WanFiles(NamedTuple):
    generator: Path
    wan: Path  # the Wan2.1-T2V-1.3B folder
    diffusers: bool  # its layout


class SelfForcingModel(NamedTuple):
    transformer: torch.nn.Module  # CausalWanTransformer
    vae: torch.nn.Module  # diffusers AutoencoderKLWan
    text_encoder: object  # umt5.UMT5TextEncoder: prompt -> [1, 512, text_dim]
    sources: dict  # what was loaded from where (for reports)


def find_files(root, generator=None) -> WanFiles:
    """The files of the layout in the module docstring (`generator`: that file instead of the layout's generator); a
    CheckpointError listing what was looked for."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    if generator is not None and not Path(generator).is_file():
        raise CheckpointError(f"{generator}: {describe_missing(generator, 'generator checkpoint file')}")
    named = (root / GENERATOR_FILE, root / "checkpoints" / GENERATOR_FILE)
    gen = Path(generator) if generator is not None else next((p for p in named if p.is_file()), None)
    if gen is None:
        found = sorted(p for d in (root, root / "checkpoints") if d.is_dir() for p in d.glob("*.pt") if p.is_file())
        if not found:  # (a broken link is said only where it is why nothing was found)
            broken_link(*named, *(p for d in (root, root / "checkpoints") if d.is_dir() for p in d.glob("*.pt")))
            raise CheckpointError(f"{root}: no Self-Forcing generator checkpoint (looked for {GENERATOR_FILE} or "
                                  f"one *.pt file in {root} and {root / 'checkpoints'})")
        if len(found) > 1:
            raise CheckpointError(f"{root}: {len(found)} candidate generator checkpoints "
                                  f"({', '.join(p.name for p in found)}): name the one to use {GENERATOR_FILE}, "
                                  "or choose one with --generator FILE")
        gen = found[0]
    folders = [root / "wan_models" / n for n in WAN_FOLDERS] + [root / n for n in WAN_FOLDERS] + [root]
    for wan in folders:
        if (wan / VAE_FILE).is_file() or (wan / "vae" / "config.json").is_file():
            diffusers = not (wan / VAE_FILE).is_file()
            need = ["vae/config.json", "text_encoder/config.json", "tokenizer"] if diffusers else \
                [T5_FILE, TOKENIZER_FOLDER]
            broken_link(*(wan / n for n in need))
            missing = [n for n in need if not (wan / n).exists()]
            if missing:
                raise CheckpointError(f"{wan}: incomplete Wan2.1-T2V-1.3B folder: missing {', '.join(missing)}")
            return WanFiles(gen, wan, diffusers)
    broken_link(*(wan / VAE_FILE for wan in folders))
    raise CheckpointError(f"{root}: no Wan2.1-T2V-1.3B files (looked for {VAE_FILE}, or vae/config.json in the "
                          f"diffusers layout, in: {', '.join(str(f) for f in folders)})")


def broken_link(*paths: Path) -> None:
    """A CheckpointError for the first of `paths` that is a dangling or looping symbolic link (reported as absent
    before, though `ls` shows the very name)."""
    for p in paths:
        if p.is_symlink() and not p.exists():
            raise CheckpointError(f"{p}: a broken symbolic link (its target does not exist or loops)")


def transformer_config(files: WanFiles) -> tuple[dict, str]:
    """(CausalWanTransformer kwargs, where they came from)."""
    import inspect

    from diffusers import WanTransformer3DModel
    path = files.wan / ("transformer/config.json" if files.diffusers else "config.json")
    if not path.is_file():
        return dict(WAN_T2V_1_3B), "built-in Wan2.1-T2V-1.3B config"
    cfg = read_json(path)
    if files.diffusers:  # diffusers' names already
        params = inspect.signature(WanTransformer3DModel.__init__).parameters
        return dict(WAN_T2V_1_3B, **{k: v for k, v in cfg.items() if k in params}), os.path.abspath(path)
    try:
        return _from_wan_config(cfg, path), os.path.abspath(path)
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: unusable transformer config ({first_line(e)})") from None


def _from_wan_config(cfg: dict, path: Path) -> dict:
    if cfg.get("model_type", "t2v") != "t2v" or list(cfg.get("window_size", (-1, -1))) != [-1, -1]:
        raise CheckpointError(f"{path}: only text-to-video Wan models with full attention are supported "
                              f"(model_type {cfg.get('model_type')!r}, window_size {cfg.get('window_size')})")
    out = dict(WAN_T2V_1_3B, **{WAN_CONFIG_NAMES[k]: v for k, v in cfg.items() if k in WAN_CONFIG_NAMES})
    dim, heads = cfg.get("dim", 1536), cfg.get("num_heads", 12)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (dim, heads)):
        raise CheckpointError(f"{path}: dim and num_heads must be positive integers, got {dim!r} and {heads!r}")
    if dim % heads:
        raise CheckpointError(f"{path}: dim {dim!r} is not a multiple of num_heads {heads!r}")
    out.update(num_attention_heads=heads, attention_head_dim=dim // heads)
    if "patch_size" in cfg:
        out["patch_size"] = tuple(cfg["patch_size"])
    if "qk_norm" in cfg:
        out["qk_norm"] = "rms_norm_across_heads" if cfg["qk_norm"] else None
    return out


def _renamed(sd: dict, converted: dict, source, what: str) -> dict[str, str]:
    """new key -> the file's key, for a converter that renames without copying tensors. A file key the renaming
    dropped (two of the file's keys, e.g. one in Wan's names and one in diffusers', becoming one key, so one tensor
    would silently replace the other) is a CheckpointError naming it as unexpected (`source`: the file, `what`: its
    kind)."""
    kept = {id(t) for t in converted.values()}
    dropped = [k for k, t in sd.items() if id(t) not in kept]
    if dropped:
        raise merged_keys_error(source, what, dropped)
    by_id = {id(t): k for k, t in sd.items()}
    return {k: by_id.get(id(t), k) for k, t in converted.items()}


# a text-to-video transformer's keys in diffusers' names -> Wan's, the inverse of diffusers'
# convert_wan_transformer_to_diffusers (tests check the round trip on every key of a model): for naming the keys a
# Wan-named file lacks in the file's own terms
_TO_WAN = ((r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
           (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
           (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
           (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
           (r"^condition_embedder\.time_proj\.", "time_projection.1."),
           (r"^scale_shift_table$", "head.modulation"), (r"^proj_out\.", "head.head."),
           (r"\.scale_shift_table$", ".modulation"), (r"\.attn1\.", ".self_attn."), (r"\.attn2\.", ".cross_attn."),
           (r"\.to_out\.0\.", ".o."), (r"\.to_([qkv])\.", r".\1."), (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
           (r"\.ffn\.net\.2\.", ".ffn.2."), (r"\.norm2\.", ".norm3."))


def wan_name(key: str) -> str:
    """A transformer key in diffusers' names (a CausalWanTransformer's) -> the same key in Wan's."""
    for pattern, repl in _TO_WAN:
        key = re.sub(pattern, repl, key)
    return key


# the Wan2.1 VAE's keys in diffusers' names (AutoencoderKLWan's) -> Wan's, the inverse of diffusers'
# convert_wan_vae_to_diffusers (tests check the round trip on every key of the VAE at two widths): for naming the
# keys a Wan2.1_VAE.pth lacks in the file's own terms. A residual block's layers, then the rules for the rest of a key
# after `encoder.` / `decoder.` (each decoder stage is 3 residual blocks and an upsampler, flat in Wan's list).
_VAE_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
                 "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
                 "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}
_VAE_TO_WAN = ((r"conv_in\.(.+)", lambda m: f"conv1.{m[1]}"), (r"norm_out\.gamma", lambda m: "head.0.gamma"),
               (r"conv_out\.(.+)", lambda m: f"head.2.{m[1]}"),
               (r"mid_block\.resnets\.(\d+)\.(.+)", lambda m: f"middle.{2 * int(m[1])}.{_VAE_RESIDUAL[m[2]]}"),
               (r"mid_block\.attentions\.0\.(.+)", lambda m: f"middle.1.{m[1]}"),
               (r"down_blocks\.(\d+)\.(.+)", lambda m: f"downsamples.{m[1]}.{_VAE_RESIDUAL.get(m[2], m[2])}"),
               (r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)",
                lambda m: f"upsamples.{4 * int(m[1]) + int(m[2])}.{_VAE_RESIDUAL[m[3]]}"),
               (r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", lambda m: f"upsamples.{4 * int(m[1]) + 3}.{m[2]}"))


def wan_vae_name(key: str) -> str:
    """A Wan2.1 VAE key in diffusers' names -> the same key in Wan's (Wan2.1_VAE.pth's); unchanged if no rule knows
    it."""
    side, _, rest = key.partition(".")
    if side in ("quant_conv", "post_quant_conv"):
        return ("conv1." if side == "quant_conv" else "conv2.") + rest
    if side in ("encoder", "decoder"):
        for pattern, name in _VAE_TO_WAN:
            m = re.fullmatch(pattern, rest)
            if m:
                try:
                    return f"{side}.{name(m)}"
                except KeyError:  # (a residual layer no rule names)
                    break
    return key


def _missing_names(names: dict[str, str], own: Callable[[str], str], naming: str) -> tuple[Callable[[str], str], str]:
    """(model key -> the name a file with these `names` (model key -> file key) would give it, a note for the
    message). The name is `own`'s (wan_name, or no renaming) under the one prefix the file's keys carry before
    their own names (`model.`, `module.model.`, none): then the note is empty. Where that can't be rebuilt (training
    wrappers inside keys: FSDP's, activation checkpointing's; several prefixes), `own`'s name alone, and the note
    says whose names they are (`naming`)."""
    prefixes = {f[:len(f) - len(own(k))] for k, f in names.items() if f.endswith(own(k))}
    if len(prefixes) == 1 and not any(w in f for f in names.values() for w in TRAINING_WRAPPERS):
        prefix = prefixes.pop()
        return (lambda k: prefix + own(k)), ""
    return own, f"; {naming}, without the file's wrappers"


def read_generator(path: Path, ema: bool | None = None) -> tuple[dict, dict, str, tuple[Callable[[str], str], str]]:
    """(state dict in diffusers' names, new key -> key in the file, 'generator_ema' or 'generator', (a function
    giving a key the file lacks the name the file would have given it, a note on those names: `_missing_names`))."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    obj = read_torch(path)
    wanted = ("generator_ema", "generator") if ema is None else ("generator_ema",) if ema else ("generator",)
    which = next((k for k in wanted if isinstance(obj.get(k), dict)), None)  # (a malformed EMA: the plain one)
    if which is None:
        found = ", ".join(repr(k) for k in list(obj)[:5]) + (", ..." if len(obj) > 5 else "") or "none"
        odd = [f"{k!r} is a {type(obj[k]).__name__}" for k in wanted if k in obj]
        raise CheckpointError(f"{path}: not a Self-Forcing checkpoint: no {' or '.join(map(repr, wanted))} state "
                              f"dict ({'; '.join(odd) + ', not a state dict' if odd else 'top-level keys: ' + found})")
    skipped = [k for k in wanted[:wanted.index(which)] if k in obj]
    if skipped:  # (--weights auto: an EMA that is there but not a state dict; say which weights run instead)
        import warnings
        warnings.warn(f"{path}: {skipped[0]!r} is a {type(obj[skipped[0]]).__name__}, not a state dict: loading "
                      f"{which!r} instead", stacklevel=3)
    sd = check_tensors(obj[which], f"{path} [{which}]")
    stripped = {}
    for key, t in sd.items():
        k = key
        for part in TRAINING_WRAPPERS:
            k = k.replace(part, "")
        k = k[len(DDP_PREFIX):] if k.startswith(DDP_PREFIX) else k
        stripped[k[len(WRAPPER_PREFIX):] if k.startswith(WRAPPER_PREFIX) else k] = t
    if diffusers_names(stripped):  # saved from a diffusers-named model (ours included): nothing to rename
        names = _renamed(sd, stripped, f"{path} [{which}]", "Self-Forcing generator")
        return stripped, names, which, _missing_names(names, lambda k: k, "diffusers' names")
    converted = convert_wan_transformer_to_diffusers(dict(stripped))
    names = _renamed(sd, converted, f"{path} [{which}]", "Self-Forcing generator")
    return converted, names, which, _missing_names(names, wan_name, "Wan's names")


def diffusers_names(sd: dict) -> bool:
    """Whether a transformer state dict uses diffusers' key names (WanTransformer3DModel's, as CausalWanTransformer
    saves them) rather than Wan's. Wan's converter must not run on those: it would swap norm2 and norm3."""
    return any(k.startswith("condition_embedder.") or ".attn1.to_q." in k for k in sd)


def _generator_size(sd: dict) -> str:
    """'N blocks of dim D' of a transformer state dict in diffusers' names (what a file holds, for messages)."""
    ids = [int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.split(".")[1].isdigit()]
    patch = sd.get("patch_embedding.weight")
    dim = f" of dim {patch.shape[0]}" if isinstance(patch, torch.Tensor) and patch.dim() else ""
    n = max(ids) + 1 if ids else 0
    return f"{n} block{'s' * (n != 1)}{dim}"


def _build(source, what, ctor, **kwargs):
    try:
        with empty_init():
            return ctor(**kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{source}: unusable {what} config ({first_line(e)})") from None


def load_vae(files: WanFiles, device="cpu", dtype=torch.float32):
    """diffusers' AutoencoderKLWan from Wan2.1_VAE.pth (Wan's names, converted) or the diffusers vae/ folder."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    if files.diffusers:
        folder = files.wan / "vae"
        cfg = read_json(folder / "config.json")
        vae = _build(folder, "VAE", AutoencoderKLWan.from_config, config=cfg)
        return load_strict(vae, read_safetensors(folder), folder, what="Wan VAE", device=device, dtype=dtype)
    path = files.wan / VAE_FILE
    sd = check_tensors(read_torch(path), path)
    conv1 = sd.get("encoder.conv1.weight")
    base_dim = conv1.shape[0] if conv1 is not None and conv1.dim() == 5 else 96
    converted = convert_wan_vae_to_diffusers(sd)
    vae = _build(path, "VAE", AutoencoderKLWan, base_dim=base_dim)
    return load_strict(vae, converted, path, what="Wan2.1 VAE", missing_names=wan_vae_name, device=device, dtype=dtype,
                       file_names=_renamed(sd, converted, path, "Wan2.1 VAE"))


def load_text_encoder(files: WanFiles, text_dim: int, device="cpu", dtype=torch.bfloat16, out_dtype=None):
    """umt5.UMT5TextEncoder from Wan's T5 file + google/umt5-xxl, or the diffusers text_encoder/ + tokenizer/."""
    from . import umt5
    if files.diffusers:
        source, tokenizer = files.wan / "text_encoder", files.wan / "tokenizer"
        config, sd, names = umt5.read_hf_t5(source)
    else:
        source, tokenizer = files.wan / T5_FILE, files.wan / TOKENIZER_FOLDER
        config, sd, names = umt5.read_wan_t5(source)
    if config.get("d_model") != text_dim:
        raise CheckpointError(f"{source}: text encoder width {config.get('d_model')} does not match the "
                              f"transformer's text_dim {text_dim}")
    return umt5.UMT5TextEncoder(config, sd, tokenizer, source, names=names, device=device, dtype=dtype,
                                missing_names=None if files.diffusers else umt5.umt5_key_to_wan, out_dtype=out_dtype)


def load_self_forcing(checkpoint_dir, device="cpu", dtype=torch.bfloat16, *, ema: bool | None = None,
                      vae_dtype=torch.float32, text_dtype=torch.bfloat16, generator=None) -> SelfForcingModel:
    """Everything `SelfForcingPipeline` and a prompt need, from the layout in the module docstring (`generator`: a
    generator checkpoint file to run instead of the one the layout names)."""
    from qvg.devices import check_device

    from . import umt5
    from .causal_wan import CausalWanTransformer
    device = check_device(device)  # (before reading gigabytes, as the packages below)
    for package in ("transformers", "ftfy"):  # the `wan` extra: fail before reading gigabytes
        umt5.require(package)
    files = find_files(checkpoint_dir, generator)
    config, config_source = transformer_config(files)
    sd, names, which, missing_names = read_generator(files.generator, ema)
    model = _build(config_source, "transformer", CausalWanTransformer, **config)
    c = model.config
    what = f"Wan transformer ({c.num_layers} layers, dim {c.num_attention_heads * c.attention_head_dim})"
    try:
        transformer = load_strict(model, sd, f"{files.generator} [{which}]", what=what, file_names=names,
                                  missing_names=missing_names[0], missing_note=missing_names[1],
                                  device=device, dtype=dtype)
    except CheckpointError as e:  # which side is wrong: say what the config asked for and what the file holds
        raise CheckpointError(f"{e}; the model's config is {config_source}, the checkpoint holds "
                              f"{_generator_size(sd)}") from None
    vae = load_vae(files, device, vae_dtype)
    text = load_text_encoder(files, c.text_dim, device, text_dtype, out_dtype=dtype)
    sources = {"generator": os.path.abspath(files.generator), "generator_bytes": files.generator.stat().st_size,
               "weights": which, "wan": os.path.abspath(files.wan),
               "layout": "diffusers" if files.diffusers else "original", "transformer_config": config_source}
    return SelfForcingModel(transformer, vae, text, sources)
