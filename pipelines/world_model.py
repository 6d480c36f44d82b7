"""The embedded world model: a tiny causal Wan transformer in pixel space, conditioned on a start image and on
camera actions, trained by this project (pipelines/world_train.py) and shipped in assets/world/.

It is the same `CausalWanTransformer` the Self-Forcing pipeline runs, so the same loop, cache, kernels, CLI and
UI run it unchanged. Two additions, both outside Wan's modules: an action embedding added to the timestep
embedding (WorldPlay-style; one action per chunk at sampling, per token in training), and pixels as "latents"
(3 channels in [-1, 1], 4 x 4 patches; `PixelDecoder` stands in for the VAE). The start image is the first chunk
(`chunk_frames` copies, action "stay"), run clean at t = 0 into the cache before the first generated chunk.

World-coordinate RoPE (config "world_rope", default false; the shipped model is trained with it on): each frame's
spatial RoPE indices are offset by the camera's accumulated pan in patches (`pan_offsets`), so a token and the
remembered token at the same place in the world share a row / column position. Only pans move it (a pan of
`pan_pixels` view pixels per frame must be a whole number of patches); zoom changes the scale, which no integer
offset expresses, so zoom frames keep the offset they have, and pans after a zoom count in the zoomed view's patches.
Per chunk the model takes `world_inputs(config, actions so far)`: the chunk's action and, with world_rope, its
frames' offsets. The KV cache gets keys after RoPE (`qvg.cache.KVCache.write`), so each cached key keeps the world
position it was written with; with key_storage "pre-rope" (qvg-generate's default for this model) the cache packs
them un-rotated, with each chunk's positions, and rotates them back as it reads them.
"""
from __future__ import annotations

import json
import math
import operator
from pathlib import Path

import torch
from diffusers.models.embeddings import TimestepEmbedding

from qvg.numbers import is_int, parse_int

from .causal_wan import CausalWanTransformer

ACTIONS = ("stay", "left", "right", "up", "down", "zoom_in", "zoom_out")
MOVES = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # pans: camera (dx, dy) direction
WORLD_DIR = Path(__file__).resolve().parent.parent / "assets" / "world"

# the shipped model's settings (assets/world/config.json holds the ones it was trained with)
DEFAULT_CONFIG = {
    "transformer": dict(patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=64, in_channels=3,
                        out_channels=3, text_dim=32, freq_dim=64, ffn_dim=1024, num_layers=6, rope_max_seq_len=1024),
    "actions": list(ACTIONS),
    "frame_size": 64,  # pixels, square
    "fps": 8,
    "chunk_frames": 3,
    "steps": [1000, 750, 500, 250],
    "shift": 1.0,
    "context_sigma": 0.1,  # the clean re-run's noise level (trained for 0 .. 0.2; 0.1 drifts less than 0)
    "pan_pixels": 4.0,  # view pixels the camera moves per frame (left/right/up/down)
    "zoom_factor": 1.05,  # view scale change per frame (zoom_in / zoom_out)
    "world_rope": False,  # spatial RoPE in world coordinates (module docstring); build_world reads it as False when
    # absent, load_world wants it in config.json (as every field here)
}


class ActionTimestepEmbedding(TimestepEmbedding):
    """Wan's timestep MLP plus a learned embedding of the camera action, added to its output (zero-initialised, so
    a fresh model starts as plain Wan). `actions` is set per call: [B] (one per chunk) or [B, N] (per token, with
    a per-token timestep)."""

    def __init__(self, base: TimestepEmbedding, num_actions: int):
        super().__init__(base.linear_1.in_features, base.linear_1.out_features)
        self.load_state_dict(base.state_dict())
        self.action_embedding = torch.nn.Embedding(num_actions, base.linear_1.out_features)
        torch.nn.init.zeros_(self.action_embedding.weight)
        self.actions: torch.Tensor | None = None

    def forward(self, sample, condition=None):
        out = super().forward(sample, condition)
        if self.actions is not None:
            a = self.action_embedding(self.actions.to(out.device))
            if a.dim() < out.dim():
                a = a.unsqueeze(1)
            out = out + a.to(out.dtype)
        return out


class WorldModel(CausalWanTransformer):
    """CausalWanTransformer + camera actions. forward(..., actions=LongTensor [B] or [B, N]) (default: stay).
    world_rope: the model was trained with world-coordinate RoPE; every forward then needs `spatial_offsets`."""

    def __init__(self, num_actions: int = len(ACTIONS), world_rope: bool = False, **wan_config):
        super().__init__(**wan_config)
        emb = self.condition_embedder
        emb.time_embedder = ActionTimestepEmbedding(emb.time_embedder, num_actions)
        self.num_actions, self.world_rope = num_actions, world_rope

    def forward(self, hidden_states, timestep, encoder_hidden_states, *, actions: torch.Tensor | None = None,
                **kwargs):
        if self.world_rope and kwargs.get("spatial_offsets") is None:
            raise ValueError("this world model uses world-coordinate RoPE (world_rope): pass spatial_offsets "
                             "(qvg.pipelines.world_model.world_inputs gives each chunk's)")
        if actions is None:
            actions = torch.zeros(hidden_states.shape[0], dtype=torch.long)
        if not actions.is_cuda and (actions.min() < 0 or actions.max() >= self.num_actions):  # (no GPU sync)
            raise ValueError(f"actions must be in [0, {self.num_actions}), got {actions.unique().tolist()}")
        te = self.condition_embedder.time_embedder
        te.actions = actions
        try:
            return super().forward(hidden_states, timestep, encoder_hidden_states, **kwargs)
        finally:
            te.actions = None

    def null_text(self, batch: int = 1) -> torch.Tensor:
        """The model is not text-conditioned: its cross-attention reads one zero token."""
        return torch.zeros(batch, 1, self.config.text_dim, device=self.device, dtype=self.dtype)


class PixelDecoder:
    """The world model works on pixels: 'decoding' is clamping to [-1, 1] (the StreamingVAEDecoder interface)."""

    def reset(self) -> None:
        pass

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z.clamp(-1.0, 1.0)


class WorldModelError(ValueError):
    pass


def _number(cfg: dict, key: str, low: float, high: float, *, integer: bool = False,
            low_open: bool = False, high_open: bool = False):
    v = cfg[key]
    ok = (is_int(v) or not integer and isinstance(v, float) and math.isfinite(v)) and low <= v <= high
    # (an int compares exactly: 10**400 overflowed isfinite; every field has a finite upper bound, so no int that
    # passes overflows a float later)
    if not ok or (low_open and v == low) or (high_open and v == high):
        what = "an integer" if integer else "a number"
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise ValueError(f"{key} must be {what} {bound} and {'<' if high_open else '<='} {high:g}, got {v!r}")
    return v


def check_config(cfg: dict) -> None:
    """ValueError naming the first field of a world-model config that the runners cannot use (a string size, a
    negative chunk, an empty step list), before any layer is built from it."""
    tr = cfg["transformer"]
    if not isinstance(tr, dict):
        raise ValueError(f"transformer must be an object of CausalWanTransformer settings, got {tr!r}")
    acts = cfg["actions"]
    if (not isinstance(acts, list) or not acts or not all(isinstance(a, str) and a for a in acts)
            or len(set(acts)) != len(acts)):
        raise ValueError(f"actions must be a non-empty list of distinct names, got {acts!r}")
    if acts[0] != "stay":
        raise ValueError(f"actions must start with 'stay' (id 0, the start image's action), got {acts!r}")
    patch = tr.get("patch_size", (1, 2, 2))
    if (not isinstance(patch, (list, tuple)) or len(patch) != 3
            or not all(is_int(p) and p >= 1 for p in patch)):
        raise ValueError(f"transformer.patch_size must be three positive integers, got {patch!r}")
    size = _number(cfg, "frame_size", 1, 16384, integer=True)
    if size % patch[1] or size % patch[2]:
        raise ValueError(f"frame_size ({size}) must be a multiple of the patch ({patch[1]} x {patch[2]})")
    _number(cfg, "fps", 0, 1000, low_open=True)
    _number(cfg, "chunk_frames", 1, 1024, integer=True)
    steps = cfg["steps"]
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"steps must be a non-empty list of timesteps in (0, 1000], got {steps!r}")
    for i in range(len(steps)):  # (the bounds SelfForcingPipeline / flow_sigmas take: a config passing here runs)
        _number({f"steps[{i}]": steps[i]}, f"steps[{i}]", 0, 1000, low_open=True)
    _number(cfg, "shift", 0, 1000, low_open=True)
    _number(cfg, "context_sigma", 0, 1, high_open=True)
    _number(cfg, "pan_pixels", 0, size)
    _number(cfg, "zoom_factor", 0, 10, low_open=True)
    if not isinstance(cfg.get("world_rope", False), bool):
        raise ValueError(f"world_rope must be true or false, got {cfg['world_rope']!r}")
    if cfg.get("world_rope", False):
        _pan_patches(cfg)


def build_world(config: dict | None = None, seed: int = 0) -> WorldModel:
    cfg = config or DEFAULT_CONFIG
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WorldModel(num_actions=len(cfg["actions"]), world_rope=bool(cfg.get("world_rope", False)),
                          **cfg["transformer"])


def save_world(model: WorldModel, config: dict, directory, *, dtype=torch.float16, card: dict | None = None) -> None:
    """Weights as safetensors (`dtype`, default FP16: half the bytes, well inside its range) + config.json; both
    written to temporary files first, then put in place together (a run stopped while writing left new weights
    beside the old config)."""
    import contextlib

    from safetensors.torch import save_file

    from qvg.outputs import atomic
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
          for k, v in model.state_dict().items()}
    cfg = dict(config, **({"training": card} if card else {}))
    with contextlib.ExitStack() as stack:
        weights, conf = (stack.enter_context(atomic(d / n)) for n in ("model.safetensors", "config.json"))
        save_file(sd, str(weights), metadata={"format": "pt"})
        conf.write_text(json.dumps(cfg, indent=1, default=list))


def load_world(directory=None, device="cpu", dtype=torch.float32) -> tuple[WorldModel, dict]:
    """(model in eval mode, config) from a directory holding config.json + model.safetensors (default: the shipped
    one). Strict: missing / unexpected / misshapen keys raise WorldModelError naming them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from qvg.devices import check_device
    device = check_device(device)
    d = Path(directory) if directory is not None else WORLD_DIR
    try:
        cfg = json.loads((d / "config.json").read_text())
        if not isinstance(cfg, dict) or not set(DEFAULT_CONFIG) <= set(cfg):  # (what the runners read)
            raise KeyError(f"not an object with the fields {', '.join(sorted(DEFAULT_CONFIG))}")
        check_config(cfg)
        model = build_world(cfg)
    except FileNotFoundError:
        raise WorldModelError(f"no world model in {str(d)!r} (config.json missing)") from None
    except OSError as e:  # (the folder is a file, config.json a folder, unreadable)
        raise WorldModelError(f"no world model in {str(d)!r} (cannot read config.json: "
                              f"{e.strerror or type(e).__name__})") from None
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ArithmeticError, AssertionError) as e:
        # (not JSON, not UTF-8, a missing or mistyped field, a size the layers refuse: -256 channels)
        from .state_dicts import first_line
        raise WorldModelError(f"{d / 'config.json'}: not a world-model config ({first_line(e)})") from None
    try:
        sd = load_file(str(d / "model.safetensors"))
    except FileNotFoundError:
        raise WorldModelError(f"no weights in {str(d)!r} (model.safetensors missing)") from None
    except (SafetensorError, OSError) as e:
        raise WorldModelError(f"{d / 'model.safetensors'}: unreadable ({e})") from None
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(k for k in set(own) & set(sd) if own[k].shape != sd[k].shape)
    if missing or unexpected or shapes:
        parts = [f"{n}: {', '.join(ks[:5])}{' ...' if len(ks) > 5 else ''}"
                 for n, ks in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if ks]
        raise WorldModelError(f"{d / 'model.safetensors'} does not match its config ({'; '.join(parts)})")
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    model = model.to(device) if dtype == torch.float32 else model.to(device=device, dtype=dtype)
    return model.eval(), cfg


def action_ids(names, config: dict | None = None) -> list[int]:
    acts = (config or DEFAULT_CONFIG)["actions"]
    out = []
    for n in names:
        if n not in acts:
            raise WorldModelError(f"unknown action {n!r}; choose from: {', '.join(acts)}")
        out.append(acts.index(n))
    return out


MAX_REPEAT = 100_000  # chunks an action list may spell out, NAME*N included (100,000 chunks of 3 frames is 10 hours
# at 8 fps; the list is built in memory, and the UI's text box reaches it too)


def parse_actions(text: str, config: dict | None = None) -> list[int]:
    """'right*4,left*4,stay' -> one action id per chunk. A trailing comma is allowed; an empty entry between two
    actions is refused (it was skipped: 'left,,right' may mean a missing action, not none)."""
    names = []
    parts = [p.strip() for p in text.split(",")]
    while parts and not parts[-1]:
        parts.pop()
    for i, part in enumerate(parts):
        if not part:
            raise WorldModelError(f"empty action at position {i + 1} in {text.strip()!r} (give NAME or NAME*N "
                                  "between the commas)")
        name, star, times = part.partition("*")
        try:
            n = parse_int(times) if star else 1
        except ValueError:
            raise WorldModelError(f"bad repeat count in action {part!r} (use NAME or NAME*N)") from None
        if not 1 <= n <= MAX_REPEAT:
            raise WorldModelError(f"repeat count must be in [1, {MAX_REPEAT:,}] in action {part!r}")
        if len(names) + n > MAX_REPEAT:
            raise WorldModelError(f"the actions spell out more than {MAX_REPEAT:,} chunks (the list repeats to fill "
                                  "the video: give one loop of it)")
        names += [name.strip()] * n
    if not names:
        raise WorldModelError("no actions given")
    return action_ids(names, config)


def image_frame(image: torch.Tensor, size: int) -> torch.Tensor:
    """An RGB image [3, H, W] in [-1, 1] -> a start frame [3, size, size]: centre square, area-resized."""
    import torch.nn.functional as F
    h, w = image.shape[-2:]
    s = min(h, w)
    sq = image[:, (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    mode = "area" if s >= size else "bilinear"
    return F.interpolate(sq[None].float(), size=(size, size), mode=mode)[0].clamp(-1, 1)


def _pan_patches(config: dict) -> int:
    """pan_pixels in patches; world RoPE's offsets are whole patches."""
    _, ph, pw = config["transformer"]["patch_size"]
    step = config["pan_pixels"] / ph
    if step != int(step) or config["pan_pixels"] / pw != step:
        raise ValueError(f"world_rope needs pan_pixels ({config['pan_pixels']}) to be a whole number of "
                         f"{ph} x {pw} patches")
    return int(step)


def pan_offsets(actions: torch.Tensor, config: dict) -> torch.Tensor:
    """Action ids [B, chunks] (chunk 0: the still start chunk, its action ignored, as world_data.cameras_for does)
    -> each frame's accumulated pan in patches, (dy, dx): int64 [B, chunks * chunk_frames, 2]. Each frame of a pan
    chunk moves the camera by pan_pixels / patch patches (right and down positive, as world_data's camera x / y),
    so a world point at screen patch (i, j) sits at (i + dy, j + dx) in every frame."""
    cf, step = config["chunk_frames"], _pan_patches(config)
    moves = torch.zeros(len(config["actions"]), 2, dtype=torch.long)
    for name, (dx, dy) in MOVES.items():
        if name in config["actions"]:
            moves[config["actions"].index(name)] = torch.tensor([dy, dx]) * step
    per_chunk = moves.to(actions.device)[actions]  # [B, chunks, 2]
    per_chunk[:, 0] = 0
    return per_chunk.repeat_interleave(cf, 1).cumsum(1)


def world_inputs(config: dict, actions: torch.Tensor) -> dict:
    """The model inputs of one chunk from the action ids so far, [B, c + 1] (counting the context chunk 0): the
    chunk's action and, with world_rope, its frames' spatial_offsets (pan_offsets' last chunk_frames frames)."""
    out = {"actions": actions[:, -1]}
    if config.get("world_rope", False):
        out["spatial_offsets"] = pan_offsets(actions, config)[:, -config["chunk_frames"]:]
    return out


def world_pipeline(model: WorldModel, config: dict):
    """The Self-Forcing loop with the world model's schedule and pixel 'decoder'."""
    from .self_forcing import SelfForcingPipeline
    return SelfForcingPipeline(model, chunk_frames=config["chunk_frames"], steps=config["steps"],
                               shift=config["shift"], decoder=PixelDecoder(),
                               context_sigma=config.get("context_sigma", 0.0))


def rollout(model: WorldModel, config: dict, start: torch.Tensor, actions: list, cache, *, seed: int = 0):
    """Generate one chunk per action from a start frame [3, S, S] in [-1, 1]: yields ChunkResult (video [1, 3,
    chunk_frames, S, S]). actions: names (config["actions"]: "stay", "left", ...) or their ids. cache: a
    qvg.cache.KVCache with one layer per block, chunk_frames = config["chunk_frames"] and tokens_per_frame =
    model.tokens_per_latent_frame(S, S). The start frame, repeated, is the context chunk (action 'stay')."""
    cf, size = config["chunk_frames"], config["frame_size"]
    if not isinstance(start, torch.Tensor) or tuple(start.shape) != (3, size, size):
        got = tuple(start.shape) if isinstance(start, torch.Tensor) else type(start).__name__
        raise ValueError(f"start must be a frame [3, {size}, {size}] in [-1, 1] (e.g. "
                         f"qvg.pipelines.world_data.centre_view(load_photo('coffee'))), got {got}")
    if not start.is_floating_point() or not bool(torch.isfinite(start).all()) or start.abs().max() > 1 + 1e-3:
        lo, hi = (start.min().item(), start.max().item()) if start.numel() else (0, 0)
        raise ValueError(f"start must be a floating-point frame with values in [-1, 1] (an image's [0, 255] as "
                         f"x / 127.5 - 1), got {start.dtype} in [{lo}, {hi}]")
    if not isinstance(actions, str):
        try:
            actions = list(actions)  # (any iterable: a generator, a tensor of ids)
        except TypeError:
            pass
    if not isinstance(actions, list) or not actions:
        raise ValueError(f"actions: give a list of at least one action name or id (parse_actions turns text such as "
                         f"'left*2,right' into one), got {actions!r}")
    names = config["actions"]
    ids = []
    for a in actions:
        try:  # (ids may be numpy or torch integers)
            i = names.index(a) if isinstance(a, str) else None if isinstance(a, bool) else operator.index(a)
        except (ValueError, TypeError):
            i = None
        if i is not None and 0 <= i < len(names):
            ids.append(i)
        else:
            raise ValueError(f"unknown action {a!r}: give names ({', '.join(names)}) or their ids 0..{len(names) - 1}")
    actions = ids  # (the cache's layout is checked by generate)
    pipe = world_pipeline(model, config)
    ctx = start.reshape(1, 3, 1, size, size).expand(1, 3, cf, size, size)
    acts = torch.tensor([[0] + list(actions)])
    return pipe.generate(model.null_text(1), len(actions) * cf, (size, size), cache, seed=seed, context=ctx,
                         chunk_inputs=lambda c: world_inputs(config, acts[:, :c + 1]))
