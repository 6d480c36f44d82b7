"""`qvg-generate`: generate a video chunk by chunk with the history in a compressed KV cache; write an mp4 and a
JSON report (method, options, frames, seconds, KV bytes by component, BF16-equivalent bytes, compression ratio,
peak GPU memory, device, commit) next to it.

Bad input gives one `qvg-generate: error: ...` line and exit status 2; nothing is left behind (the mp4 and the
JSON are written to temporary files and renamed into place only when both are complete).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from qvg.help_format import Parser
from qvg.numbers import parse_int
from qvg.outputs import Terminated, new_file_mode, sigterm_held, sigterm_raises, target, targets_error

from .start_image import image_array, size_problem, unreadable_reason

PIPELINES = ("tiny", "self-forcing")
DEFAULT_PROMPT = "a red fox running through fresh snow, cinematic"
WEIGHTS = {"auto": None, "generator_ema": True, "generator": False}  # --weights -> load_self_forcing's ema
DEFAULT_IMAGE = "astronaut"
DEFAULT_ACTIONS = "right*3,down*2,left*3,up*2"  # a loop: the camera comes back to where it started


OPTION_FLAGS = {"bits": "--bits", "block_size": "--block-size", "stages": "--stages", "centroids": "--centroids"}
MIN_TINY_FRAMES = 2  # the embedded model's frame 1 is its start image: the first generated frame is frame 2
MAX_FRAMES = 100_000  # --frames at most (a sweep's videos are held to it too: qvg.eval.cli.MAX_CHUNKS)


class UsageError(Exception):
    pass


class _Parser(Parser):
    usage_error = UsageError


def build_parser() -> argparse.ArgumentParser:
    from qvg.cache import CACHE_METHODS
    p = _Parser(prog="qvg-generate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--pipeline", default="tiny",
                   help=f"one of {', '.join(PIPELINES)} (default tiny: the embedded model)")
    p.add_argument("--checkpoint", default=None, help="self-forcing: the directory holding the Self-Forcing "
                   "generator (self_forcing_dmd.pt, or checkpoints/self_forcing_dmd.pt) and the Wan2.1-T2V-1.3B files "
                   "(wan_models/Wan2.1-T2V-1.3B/); layouts in the README; needs pip install -e '.[wan]'")
    p.add_argument("--generator", default=None, help="self-forcing: the generator checkpoint file to run instead of "
                   "the one --checkpoint's layout names (e.g. another .pt beside self_forcing_dmd.pt)")
    p.add_argument("--weights", default="auto", help="self-forcing: the checkpoint's state dict to run, "
                   "generator_ema or generator (default auto: generator_ema where present, as Self-Forcing's "
                   "--use_ema, else generator)")
    p.add_argument("--prompt", default=None, help=f"text prompt (self-forcing; default {DEFAULT_PROMPT!r}; the "
                   "embedded model has no text input)")
    p.add_argument("--image", default=None, help="tiny: start image, a bundled photo's name or an image file "
                   f"(default {DEFAULT_IMAGE})")
    p.add_argument("--actions", default=None, help="tiny: camera action per chunk of 3 frames, e.g. 'right*4,left*4' "
                   "(stay, left, right, up, down, zoom_in, zoom_out; repeated to fill the video; default "
                   f"'{DEFAULT_ACTIONS}')")
    p.add_argument("--frames", default=None, help="video frames to write, at most 100,000 (default: tiny 31 at 8 fps, "
                   "about 4 s, at least 2, frame 1 being its start image; self-forcing 49 at 16 fps, about 3 s)")
    p.add_argument("--method", default="qvg", help=f"KV cache method: {', '.join(CACHE_METHODS)} (default qvg)")
    p.add_argument("--bits", default=None, help="2, 4 or 8 (default: the method's, 2; qvg on the tiny pipeline 4)")
    p.add_argument("--stages", default=None, help="k-means stages S (qvg, qvg-pro; 0: none, which is plain RTN)")
    p.add_argument("--block-size", default=None, help="quantization group size (divides the head dim)")
    p.add_argument("--centroids", default=None, help="k-means centroids K (qvg, qvg-pro; default from the unit's "
                   "tokens, chunk x --commit-every: the largest power of two <= tokens / 64, in [4, 256]; 8 on tiny, "
                   "64 on self-forcing)")
    p.add_argument("--kmeans-seed", default=None, help="k-means seed (qvg, qvg-pro; default 0): the seeding "
                   "of cold starts (the first chunk); another value gives the k-means seed-variance floor")
    p.add_argument("--commit-every", default="1", help="compress every k chunks (default 1)")
    p.add_argument("--key-storage", default="auto", help="pack keys before RoPE (pre-rope: rotated again on read) or "
                   "after it (post-rope). auto: pre-rope for rtn / qvg / qvg-pro on the embedded model (1.8 dB better "
                   "on its revisits), post-rope otherwise (on Self-Forcing pre-rope costs 2.3-4.9%% more time per "
                   "chunk)")
    p.add_argument("--read", default="window", help="how the GPU reads a packed rtn / qvg / qvg-pro history for "
                   "attention: window (decode + cuDNN SDPA, the fastest), staged (<= 32 MiB decoded at a time, Triton "
                   "flash kernel) or fused (dequantized on chip, nothing decoded to memory; pre-rope keys are read "
                   "staged by it on a GPU, 7-10x faster than rotating them on chip; the kernels rotate a panning "
                   "camera's spatial offsets too). "
                   "Default window; on CPU the torch reference runs whatever this says, and the report's `read` says "
                   "reference there (and for bf16 / kivi / quarot, which have no packed read: window only)")
    p.add_argument("--history", default="full",
                   help="full (default), or window:N: keep N past latent frames besides the sink, a multiple of 3 "
                        "(Self-Forcing's local_attn_size L counts the sink and the current chunk too: "
                        "N = L - sink - 3)")
    p.add_argument("--sink", default="0", help="latent frames kept in BF16 at the start, a multiple of 3 (default 0)")
    p.add_argument("--seed", default="0", help="sampling seed (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--out", default="qvg-output.mp4",
                   help="output .mp4, the .json report beside it (default qvg-output.mp4)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _int(name: str, value, lo: int | None = None, hi: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    try:
        v = parse_int(value)  # (ASCII digits only: int() takes '٣' as 3)
    except ValueError:
        raise UsageError(f"--{name} must be an integer, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"--{name} must be {rng}, got {v}")
    return v


def _short(stem: str) -> str:
    """A temporary file's stem: the output's cut to 64 bytes (a name the file system allows stays allowed with the
    random part and suffix added; whole characters only)."""
    return os.fsencode(stem)[:64].decode("utf-8", "ignore")


def device_arg(text: str | None):
    """A --device value -> torch.device (none: cuda if available, else cpu); UsageError if it is not cpu or an
    existing CUDA device. Shared by qvg-generate, qvg-app and qvg-eval."""
    import torch

    from qvg.devices import check_device
    if text is not None and not text.strip():  # (an empty --device '' picked the default silently)
        raise UsageError("--device is empty: give cpu, cuda or cuda:N")
    try:
        return check_device(text or ("cuda" if torch.cuda.is_available() else "cpu"), "--device")
    except ValueError as e:
        raise UsageError(str(e)) from None


def parser_device(parser, text: str | None) -> str:
    """device_arg for the module CLIs (world_eval, world_train): the device as text, or argparse's error line."""
    try:
        return str(device_arg(text))
    except UsageError as e:
        parser.error(str(e))


def _commit() -> str:
    from qvg.revision import code_commit
    found = code_commit()
    if found == "unknown":
        import qvg
        return f"qvg {qvg.__version__} (no git checkout)"
    return found


def read_ran(read: str, method: str, key_storage: str, dev, head_dim: int) -> str:
    """The packed read that ran: where the kernels do not run (CPU, no triton, QVG_BACKEND=torch, a head dim they do
    not take), and for methods without a packed read (bf16, kivi, quarot) on any device, the torch path
    ("reference": decode, if any, then SDPA); "fused" with pre-RoPE keys (the on-chip rotation is 7-10x slower) or
    at head dim 256 reads the history staged on a GPU (`qvg.cache.gpu_read`)."""
    from qvg.backend import kernel_head_dim, kernels_on
    from qvg.cache import gpu_read
    from qvg.sequence import PER_TOKEN_METHODS
    if not kernels_on(dev) or not kernel_head_dim(head_dim) or method not in PER_TOKEN_METHODS:
        return "reference"
    return gpu_read(read, key_storage == "pre-rope", dev, head_dim)


def _reads_label(reads: dict) -> str:
    """The read paths the cache took for its history (KVCache.reads), most used first: "window", or e.g.
    "reference + window" if some reads fell back to the torch path; "" when no history was read (then the
    report names the read that would run, `read_ran`)."""
    return " + ".join(k for k, _ in sorted(reads.items(), key=lambda kv: (-kv[1], kv[0])))


def _key_storage(given: str, method: str, pipeline: str) -> str:
    """auto: pre-RoPE keys where they are measured to pay (the embedded model:
    eval/results/world-confirm2-m6-h100.md, QVG INT2 B16 -0.34 dB vs BF16 against -2.15 post-RoPE); on Self-Forcing
    they cost 2.3-3.9 points more chunk time at 21 latent frames over four H200 runs of 2026-11-29 (pipeline-h100.md;
    the one after the RoPE-table changes, the 04:49 UTC run: +2.35% against post-RoPE keys, +2.31% against bf16) and
    4.3-4.9% on the H100 (pipeline-h100.prerope-168b957.json), for a gain not yet measured on real weights."""
    from qvg.cache import KEY_STORAGE
    from qvg.sequence import PER_TOKEN_METHODS
    if given == "auto":
        return auto_key_storage(method, pipeline)
    if given not in KEY_STORAGE:
        raise UsageError(f"--key-storage must be auto, {' or '.join(KEY_STORAGE)}, got {given!r}")
    if given == "pre-rope" and method == "bf16":  # (the cache takes it and keeps BF16 keys after RoPE anyway)
        raise UsageError("--method bf16 stores keys as written, after RoPE: --key-storage pre-rope does not apply")
    if given == "pre-rope" and method not in PER_TOKEN_METHODS:
        raise UsageError(f"--key-storage pre-rope is for {', '.join(PER_TOKEN_METHODS)}, not --method {method}")
    return given


def auto_key_storage(method: str, pipeline: str) -> str:
    """--key-storage auto (see `_key_storage`): pre-rope for rtn / qvg / qvg-pro on the embedded model ("tiny"),
    post-rope otherwise. The eval runners build their caches by it too."""
    from qvg.sequence import PER_TOKEN_METHODS
    return "pre-rope" if method in PER_TOKEN_METHODS and pipeline == "tiny" else "post-rope"


def parse(argv) -> dict:
    """Check every argument (cheap checks first, before any model is built) -> the run's settings."""
    from qvg.cache import CACHE_METHODS
    a = build_parser().parse_args(argv)
    if a.pipeline not in PIPELINES:
        raise UsageError(f"unknown pipeline {a.pipeline!r}; choose one of: {', '.join(PIPELINES)}")
    if a.method not in CACHE_METHODS:
        raise UsageError(f"unknown method {a.method!r}; choose one of: {', '.join(CACHE_METHODS)}")
    tiny = a.pipeline == "tiny"
    frames = a.frames if a.frames is not None else ("31" if tiny else "49")
    s = {"pipeline": a.pipeline, "method": a.method, "quiet": a.quiet,
         "frames": _int("frames", frames), "seed": _int("seed", a.seed, 0, 2**63 - 1),
         "commit_every": _int("commit-every", a.commit_every, 1, 1000), "sink": _int("sink", a.sink, 0, MAX_FRAMES)}
    opts = {"bits": _int("bits", a.bits, allow_none=True), "stages": _int("stages", a.stages, 0, 16, True),
            "block_size": _int("block-size", a.block_size, 1, allow_none=True),
            "centroids": _int("centroids", a.centroids, 1, 65536, True),
            "seed": _int("kmeans-seed", a.kmeans_seed, 0, 2**31 - 1, True)}
    from qvg.compression import kmeans_methods
    if opts["seed"] is not None and a.method not in kmeans_methods():
        raise UsageError(f"--kmeans-seed is for {' and '.join(kmeans_methods())} (k-means), not --method {a.method}")
    if a.method != "bf16":  # (bf16: its own message below)
        from qvg.compression import get_method
        own = get_method(a.method).defaults
        bad = [flag for k, flag in OPTION_FLAGS.items() if opts[k] is not None and k not in own]
        if bad:
            mine = ", ".join(flag for k, flag in OPTION_FLAGS.items() if k in own)
            raise UsageError(f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not apply to --method "
                             f"{a.method} (its options: {mine})")
    for k, flag in (("centroids", "--centroids"), ("seed", "--kmeans-seed")):
        if opts["stages"] == 0 and opts[k] is not None:
            raise UsageError(f"{flag}: --stages 0 runs no k-means (the residual is quantized as plain RTN); leave "
                             f"{flag} out or give --stages 1 or more")
    if opts["bits"] is not None and opts["bits"] not in (2, 4, 8):
        raise UsageError(f"--bits must be 2, 4 or 8, got {opts['bits']}")
    if a.pipeline == "tiny" and a.method == "qvg" and opts["bits"] is None:
        # the embedded model is sensitive to INT2 (eval/results/world-eval-h100.md: QVG INT2 at its default options
        # costs 1.0-2.4 dB on revisits, INT4 0.0 dB): its default is INT4; --bits 2 gives the 2-bit cache
        opts["bits"] = 4
    if not 1 <= s["frames"] <= MAX_FRAMES:  # (the embedded model's lower bound: checked below, after its flags')
        raise UsageError(f"--frames must be in [{MIN_TINY_FRAMES if tiny else 1}, {MAX_FRAMES}], got {s['frames']}")
    s["options"] = {k: v for k, v in opts.items() if v is not None}
    if a.method == "bf16" and s["options"]:
        given = [OPTION_FLAGS.get(k, "--kmeans-seed") for k in s["options"]]
        raise UsageError(f"--method bf16 stores BF16: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not "
                         "apply")
    s["key_storage"] = _key_storage(a.key_storage, a.method, a.pipeline)
    from qvg.cache import read_error
    bad_read = read_error(a.method, a.read, s["options"])  # (KVCache's own check and message)
    if bad_read:  # ("read must be one of ..." names the flag itself)
        raise UsageError("--" + bad_read if bad_read.startswith("read must") else f"--read {a.read}: {bad_read}")
    s["read"] = a.read
    if a.history == "full":
        s["window"] = None
    elif a.history.startswith("window:"):
        s["window"] = _int("history window:N", a.history.split(":", 1)[1], 1)
    else:
        raise UsageError(f"--history must be 'full' or 'window:N', got {a.history!r}")
    if a.pipeline == "self-forcing":  # (its chunk size is fixed: said before gigabytes of weights are read)
        check_chunk_multiples(s, chunk_frames(s))
    s["device"] = device_arg(a.device)
    out = Path(a.out)
    if a.out.endswith(("/", os.sep)):  # (Path drops the slash: "v.mp4/" named a folder and wrote the file v.mp4)
        raise UsageError(f"--out names a folder (it ends in '/'); give the video's file name, got {a.out!r}")
    if out.name.lower() == ".mp4":  # (a dot file: its suffix is "", and "must end in .mp4" would contradict it)
        raise UsageError(f"--out needs a file name before .mp4 (e.g. video.mp4), got {a.out!r}")
    if out.suffix.lower() != ".mp4":
        raise UsageError(f"--out must end in .mp4, got {a.out!r}")
    bad = targets_error([out, out.with_suffix(".json")])  # each where it will be written: symlinks followed
    if bad:
        raise UsageError(f"--out: {bad[1]}")
    s["out"] = out
    if a.pipeline == "self-forcing":
        if not a.checkpoint:
            raise UsageError("--pipeline self-forcing needs --checkpoint DIR")
        if Path(a.checkpoint).exists() and not Path(a.checkpoint).is_dir():
            raise UsageError(f"--checkpoint: {a.checkpoint!r} is a file; give the directory that holds the generator "
                             "checkpoint and the Wan2.1-T2V-1.3B files")
        if not Path(a.checkpoint).is_dir():
            raise UsageError(f"--checkpoint: no such directory: {a.checkpoint!r}")
    elif a.checkpoint:
        raise UsageError("--checkpoint applies to --pipeline self-forcing")
    if a.generator is not None:
        if tiny:
            raise UsageError("--generator applies to --pipeline self-forcing")
        if not Path(a.generator).is_file():
            what = "a directory, not a file" if Path(a.generator).is_dir() else "no such file"
            raise UsageError(f"--generator: {what}: {a.generator!r}")
    if a.weights not in WEIGHTS:
        raise UsageError(f"--weights must be {', '.join(WEIGHTS)}, got {a.weights!r}")
    if tiny and a.weights != "auto":
        raise UsageError("--weights applies to --pipeline self-forcing")
    s["checkpoint"], s["weights"], s["generator"] = a.checkpoint, a.weights, a.generator
    if tiny:
        if a.prompt is not None:
            raise UsageError("--prompt: the embedded world model is not text-conditioned; steer it with --image and "
                             "--actions")
        if a.image is not None and not a.image.strip():
            raise UsageError(f"--image: empty; give a bundled photo's name or an image file, or leave it out for "
                             f"{DEFAULT_IMAGE!r}")
        if a.actions is not None and not a.actions.strip():
            raise UsageError(f"--actions: empty; give e.g. 'right*4,left*4' or leave it out for '{DEFAULT_ACTIONS}'")
        if s["frames"] < MIN_TINY_FRAMES:  # (one frame would be the start image alone: a chunk generated for nothing)
            raise UsageError(f"--frames must be in [{MIN_TINY_FRAMES}, {MAX_FRAMES}] for the embedded model (its "
                             f"frame 1 is the start image), got {s['frames']}")
        s.update(_world_inputs(a.image or DEFAULT_IMAGE, DEFAULT_ACTIONS if a.actions is None else a.actions))
    else:
        for name in ("image", "actions"):
            if getattr(a, name) is not None:
                raise UsageError(f"--{name} applies to --pipeline tiny (the embedded world model)")
        if a.prompt is not None and not a.prompt.strip():
            raise UsageError(f"--prompt: empty; give the text to generate from, or leave it out for {DEFAULT_PROMPT!r}")
        s["prompt"] = a.prompt or DEFAULT_PROMPT
    return s


def _world_inputs(image: str, actions: str) -> dict:
    """The start image ([3, H, W] in [-1, 1]) and per-chunk action ids of the embedded world model."""
    from qvg.pipelines.world_model import WorldModelError, parse_actions
    try:
        ids = parse_actions(actions)
    except WorldModelError as e:
        raise UsageError(f"--actions: {e}") from None
    img, source = start_frame(image)
    return {"image": img, "image_source": source, "actions": ids, "actions_text": actions}


def start_frame(image: str, flag: str = "--image", size: int | None = None):
    """(the embedded model's start frame [3, size, size] in [-1, 1], where it came from) for --image: a bundled
    photo's name or an image file (the UI's preview and qvg-eval's embedded runs take the same frame); UsageError
    naming what is wrong (and `flag`, the option that gave `image`). size: the frame's (default: the embedded
    model's)."""
    from qvg.pipelines.world_model import DEFAULT_CONFIG
    size = size or DEFAULT_CONFIG["frame_size"]
    from qvg.pipelines.world_data import load_photo, photo_names
    if image in photo_names("all"):  # the view at the photo's centre at scale 1, as the model saw them in training
        from qvg.pipelines.world_data import centre_view
        img = centre_view(load_photo(image), size)
        source = f"bundled photo {image!r} (the {img.shape[-1]} x {img.shape[-1]} view at its centre)"
    else:
        path = Path(image)
        if not path.is_file():
            raise UsageError(f"{flag}: {image!r} is neither a bundled photo ({', '.join(photo_names('all'))}) nor "
                             "a file")
        try:
            a = image_array(path)
        except Exception as e:
            raise UsageError(f"{flag}: cannot read {image!r} as an image ({unreadable_reason(e)})") from None
        small = size_problem(a)
        if small:
            raise UsageError(f"{flag}: {image!r} {small}")
        import torch

        from qvg.pipelines.world_data import photo_view  # the scale the model was trained at
        img = photo_view(torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 127.5 - 1, size)
        source = os.path.abspath(path)  # (the report names the file wherever it is read from)
    return img, source


@dataclass
class Loaded:
    """A loaded model: what a Generation needs besides the settings (reusable across videos: the UI keeps one)."""
    transformer: object
    vae: object  # the Wan VAE, or None (the world model works in pixels)
    text_encoder: object  # prompt -> text states, or None
    fps: int
    latent_hw: tuple[int, int]
    info: dict  # merged into the settings: world_config (tiny) or checkpoint_sources (self-forcing)
    _text: tuple | None = None

    def encode(self, prompt: str):
        """The prompt's text states, kept for the next video with the same prompt (umT5 is costly)."""
        if self._text is None or self._text[0] != prompt:
            self._text = (prompt, self.text_encoder(prompt))
        return self._text[1]


def load_model(s) -> Loaded:
    import torch

    from qvg.pipelines import tiny
    if s["pipeline"] == "tiny":
        from qvg.pipelines.world_model import WorldModelError, load_world
        try:
            model, cfg = load_world(device=s["device"])
        except WorldModelError as e:
            raise UsageError(f"the embedded model: {e}") from None
        size = cfg["frame_size"]
        return Loaded(model, None, None, cfg["fps"], (size, size), {"world_config": cfg})
    from qvg.pipelines.checkpoints import load_self_forcing
    from qvg.pipelines.state_dicts import CheckpointError
    from qvg.pipelines.umt5 import MissingDependency
    try:  # Self-Forcing runs its generator in BF16; layout and checks: pipelines/checkpoints.py
        m = load_self_forcing(s["checkpoint"], s["device"], torch.bfloat16, ema=WEIGHTS[s.get("weights", "auto")],
                              generator=s.get("generator"))
    except (CheckpointError, MissingDependency) as e:  # (named for the flag that gave the file at fault)
        gen = s.get("generator")
        flag = "--generator" if gen and str(e).startswith((f"{Path(gen)}:", f"{Path(gen)} [")) else "--checkpoint"
        raise UsageError(f"{flag}: {e}") from None
    # Wan2.1-T2V-1.3B's 480 x 832 at 16 fps: 60 x 104 latents (the VAE's 8x)
    return Loaded(m.transformer, m.vae, m.text_encoder, tiny.FPS, (60, 104), {"checkpoint_sources": m.sources})


def to_uint8(video):
    """Frames [3, F, H, W] in [-1, 1] -> uint8 [F, H, W, 3]."""
    import numpy as np
    frames = ((video.permute(1, 2, 3, 0).float().cpu().numpy() + 1) * 127.5).round()
    return frames.clip(0, 255).astype(np.uint8)


@dataclass
class Chunk:
    index: int  # generated chunk number, from 0
    video: object  # its frames that go into the video: [3, F, H, W] in [-1, 1]
    frames: object  # the same as uint8 [F, H, W, 3]
    memory: dict  # cache.memory() right after the chunk
    seconds: float  # the chunk's wall time
    action: str | None  # tiny: the camera action it was generated with


class Generation:
    """One video, chunk by chunk: qvg-generate and the UI both run this. `s`: parse()'s settings (the model is
    loaded here unless `loaded` is given); iterate for Chunk objects. `lead`: the frames before the first chunk (tiny:
    the start image) as [3, F, H, W], or None. `plan(c)` -> the action id of generated chunk c (tiny; default: the
    settings' action list, repeated), asked just before the chunk runs, so a UI can steer the video live; the actions
    used go to s["chunk_actions"]."""

    def __init__(self, s, loaded: Loaded | None = None, plan=None):
        self.s = s
        self.model = loaded or load_model(s)
        s.update(self.model.info)
        m = self.model
        if s["pipeline"] == "tiny":
            latent = max(1, s["frames"] - 1)  # frame 0 is the start image
        else:
            from qvg.pipelines import tiny
            latent = tiny.latent_frames_for(s["frames"])
        cf = chunk_frames(s)
        s["latent_frames"] = -(-latent // cf) * cf  # whole chunks are generated
        self.latent_frames, self.fps = latent, m.fps
        self.total_chunks = -(-latent // cf)
        self.cache = _cache(s, m.transformer, m.latent_hw)
        # the text is encoded before the peak-memory window: a real text encoder is freed after it
        if s["pipeline"] == "tiny":
            self._chunks, self.lead = self._world(plan or (lambda c: s["actions"][c % len(s["actions"])]))
        else:
            from qvg.pipelines.self_forcing import SelfForcingPipeline
            pipe = SelfForcingPipeline(m.transformer, m.vae)
            self._chunks = pipe.generate(m.encode(s["prompt"]), latent, m.latent_hw, self.cache, seed=s["seed"])
            self.lead = None
        self.written = 0 if self.lead is None else self.lead.shape[1]

    def _world(self, plan):
        """The world model's rollout (qvg.pipelines.world_model.rollout) with each chunk's action asked for when
        the chunk starts (rollout takes the whole list up front); tests/app/test_generate.py checks they agree."""
        import torch

        from qvg.pipelines.world_model import image_frame, world_inputs, world_pipeline
        s, model = self.s, self.model.transformer
        cfg = s["world_config"]
        cf, size = cfg["chunk_frames"], cfg["frame_size"]
        start = image_frame(s["image"], size).to(s["device"])
        ctx = start.reshape(1, 3, 1, size, size).expand(1, 3, cf, size, size)
        s["chunk_actions"] = []
        ids = []  # the action ids so far (world RoPE's pan offsets depend on all of them)

        def inputs(c):  # c counts the context chunk (0, action "stay")
            a = 0 if c == 0 else plan(c - 1)
            if c:
                s["chunk_actions"].append(cfg["actions"][a])
            ids[c:] = [a]
            return world_inputs(cfg, torch.tensor([ids]))
        chunks = world_pipeline(model, cfg).generate(model.null_text(1), self.total_chunks * cf, (size, size),
                                                     self.cache, seed=s["seed"], context=ctx, chunk_inputs=inputs)
        return chunks, start[:, None]

    def __iter__(self):
        import time
        while True:
            t0 = time.perf_counter()
            res = next(self._chunks, None)  # (each chunk runs in qvg.streams.generation_stream: its device current)
            if res is None:
                return
            mem = self.cache.memory()
            video = res.video[0][:, :max(0, self.s["frames"] - self.written)]
            self.written += video.shape[1]
            actions = self.s.get("chunk_actions")
            yield Chunk(res.index, video, to_uint8(video), mem, time.perf_counter() - t0,
                        actions[res.index] if actions else None)


def chunk_row(ch: Chunk) -> dict:
    """A chunk's line in the JSON report's `chunks`: its number (from 1), the frames it added to the video, its
    seconds, and the cache right after it (total bytes, BF16 equivalent, ratio); tiny: its camera action."""
    m = ch.memory
    row = {"chunk": ch.index + 1, "frames": int(ch.frames.shape[0]), "seconds": round(ch.seconds, 4),
           "kv_bytes": m["total"], "bf16_equivalent_bytes": m["bf16_equivalent"],
           "compression_ratio": round(m["compression_ratio"], 4)}
    if ch.action is not None:
        row["action"] = ch.action
    return row


def report(s, gen: Generation, frames: int, seconds: float, mem: dict, chunks: list[dict] | None = None,
           load_seconds: float | None = None) -> dict:
    """The JSON report of a run (README: qvg-generate); mem: cache.memory() at the cache's largest; chunks: one
    chunk_row per chunk generated; load_seconds: what ran before the first chunk (qvg-generate's; the UI keeps its
    models loaded between runs)."""
    import torch
    from qvg.cache import MEMORY_COMPONENTS
    dev = s["device"]
    rep = {
        "method": s["method"], "options": s.get("resolved_options", {}), "pipeline": s["pipeline"],
        **({"image": s["image_source"], "actions": s["chunk_actions"]} if s["pipeline"] == "tiny"
           else {"prompt": s["prompt"]}),
        "seed": s["seed"], "frames": frames, "fps": gen.fps, "latent_frames": gen.latent_frames,
        "history": "full" if s["window"] is None else f"window:{s['window']}", "sink": s["sink"],
        "commit_every": s["commit_every"], "key_storage": s["key_storage"],
        "read": _reads_label(gen.cache.reads) or read_ran(s["read"], s["method"], s["key_storage"], dev,
                                                          s["head_dim"]),
        "reads": dict(gen.cache.reads),
        "seconds": round(seconds, 3),
        **({} if load_seconds is None else {"load_seconds": round(load_seconds, 3)}),
        "kv_bytes": {k: mem[k] for k in (*MEMORY_COMPONENTS, "total")},
        "bf16_zones": {k[5:]: mem[k] for k in ("bf16_sink", "bf16_pending", "bf16_current", "bf16_residual")
                       if k in mem},
        "bf16_equivalent_bytes": mem["bf16_equivalent"], "compression_ratio": round(mem["compression_ratio"], 4),
        "kv_bytes_note": "the cache at its largest during the run (after the last chunk for full history)",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "commit": _commit(),
        "chunks": chunks or [],
    }
    if "checkpoint_sources" in s:
        rep["checkpoint"] = s["checkpoint_sources"]
    if dev.type == "cuda":
        rep["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
    return rep


def _cache(s, transformer, latent_hw):
    from qvg.cache import KVCache, cache_options, check_options, unit_bits
    cf = chunk_frames(s)
    tpf = transformer.tokens_per_latent_frame(*latent_hw)
    unit = cf * tpf * s["commit_every"]
    s["head_dim"] = transformer.config.attention_head_dim
    opts = cache_options(s["method"], s["options"], unit)
    if s["method"] != "bf16":
        try:  # with the model's head dim, before anything runs (kivi: keys' and values' roles both)
            s["resolved_options"] = check_options(s["method"], opts, unit, transformer.config.attention_head_dim)
            if s["resolved_options"].get("stages") == 0:  # (no k-means: its settings were not used, so not reported)
                for k in ("centroids", "iters", "seeding", "seed"):
                    s["resolved_options"].pop(k, None)
        except ValueError as e:
            raise UsageError(f"--method {s['method']}: {e}") from None
    check_chunk_multiples(s, cf)
    s["options"] = opts
    if s["method"] != "bf16":  # (said before the run where no history length repays the unit: unit_cost_note)
        s["unit_bits"] = (unit_bits(s["method"], opts, unit, transformer.config.attention_head_dim), unit,
                          transformer.config.attention_head_dim)
    try:
        return KVCache(len(transformer.blocks), s["method"], chunk_frames=cf, tokens_per_frame=tpf,
                       sink_frames=s["sink"], window_frames=s["window"], commit_every=s["commit_every"],
                       key_storage=s["key_storage"], read=s["read"], **opts)
    except ValueError as e:  # (--history window:N / --commit-every the cache can't serve together)
        raise UsageError(str(e)) from None


def chunk_frames(s) -> int:
    """Latent frames per chunk: the embedded world model's from its config (once loaded), Self-Forcing's 3."""
    return s.get("world_config", {}).get("chunk_frames", 3)


def check_chunk_multiples(s, cf: int) -> None:
    """UsageError unless --sink and a --history window are multiples of the chunk size."""
    for name, frames in (("sink", s["sink"]), ("history window:N", s.get("window"))):
        if frames is not None and frames % cf:
            raise UsageError(f"--{name} must be a multiple of the chunk size ({cf} latent frames), got {frames}")


def unit_cost_note(s, page: bool = False) -> str | None:
    """Where every packed unit of the run's cache takes more bits per value than BF16 (a k-means method with many
    centroids for its unit; rtn / kivi / quarot with tiny blocks at 8 bits): what to say, as the cache then never
    gets smaller than BF16; else None. page: the UI's words (no flag it has not: --commit-every)."""
    bits, unit, d = s.get("unit_bits") or (0, 0, 0)
    if bits <= 16:
        return None
    from qvg.compression import kmeans_methods
    if s["method"] in kmeans_methods():  # (its centroid tables: a fixed cost per unit, so a larger unit helps)
        why, fix = ("its centroid tables and scales outweigh a unit this small",
                    "fewer centroids or stages lower it" if page else
                    "fewer --centroids or --stages, or a larger --commit-every, lower it")
    else:  # (codes and per-block scales: the same at any unit size)
        why, fix = "its codes and scales", "a larger block size or fewer bits lower it" if page else \
            "a larger --block-size or fewer --bits lower it"
    return (f"{s['method']} packs each committed unit ({unit} tokens x {d} channels) into {bits:.2f} bits per "
            f"value, more than BF16's 16 ({why}), so its cache stays larger than BF16 however long the history; "
            f"{fix}")


def run(s) -> dict:
    import torch
    from tqdm import tqdm

    dev = s["device"]
    t_load = time.perf_counter()
    gen = Generation(s)
    note = unit_cost_note(s)
    if note:  # (before the run: it can be stopped; KVCache's own warning of it is filtered in main)
        print(f"qvg-generate: note: {note}", file=sys.stderr)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # (the loading's queued copies count in load_seconds, not in the first chunk)
        torch.cuda.reset_peak_memory_stats(dev)
    out: Path = s["out"]
    # each temporary file beside the file it will replace (a symlinked JSON may be in another folder or file system)
    video_path, json_path = target(out), target(out.with_suffix(".json"))
    fd_v, tmp_video = tempfile.mkstemp(prefix=f".{_short(out.stem)}.", suffix=".mp4", dir=video_path.parent)
    os.close(fd_v)
    try:
        fd_j, tmp_json = tempfile.mkstemp(prefix=f".{_short(out.stem)}.", suffix=".json", dir=json_path.parent)
        os.close(fd_j)
    except BaseException:
        os.remove(tmp_video)
        raise
    t0 = time.perf_counter()
    peak_kv, writer, rows = None, None, []
    try:
        writer = mp4_writer(tmp_video, gen.fps)
        bar = tqdm(total=gen.total_chunks, desc=f"{s['method']} chunks", unit="chunk", disable=s["quiet"],
                   file=sys.stderr)
        with bar, writer:  # (the bar ends its line however the loop ends: an error is then a line of its own)
            for f in (to_uint8(gen.lead) if gen.lead is not None else []):
                writer.append_data(f)
            for ch in gen:
                mem = ch.memory
                peak_kv = mem if peak_kv is None or mem["total"] >= peak_kv["total"] else peak_kv  # (ties: the latest)
                rows.append(chunk_row(ch))
                for f in ch.frames:
                    writer.append_data(f)
                bar.set_postfix(kv=f"{mem['total'] / 2**20:.1f} MiB", ratio=f"{mem['compression_ratio']:.2f}x")
                bar.update(1)
        rep = report(s, gen, gen.written, time.perf_counter() - t0, peak_kv, rows, load_seconds=t0 - t_load)
        with open(tmp_json, "w") as f:
            json.dump(rep, f, indent=1)
        mode = new_file_mode()
        os.chmod(tmp_video, mode)
        os.chmod(tmp_json, mode)
        with sigterm_held():  # (a SIGTERM waits for both renames; it then stops the tool with both files there)
            old = _keep_old(video_path)
            os.replace(tmp_video, video_path)
            try:
                os.replace(tmp_json, json_path)
            except BaseException:  # both or neither: the old video back (or none, as before the run)
                if old:
                    os.replace(old, video_path)
                else:
                    os.remove(video_path)
                raise
            finally:
                if old and os.path.exists(old):
                    os.remove(old)
            s["written"] = True
        return rep
    finally:
        close_quietly(writer)
        for t in (tmp_video, tmp_json):
            if os.path.exists(t):
                os.remove(t)


def _keep_old(path: Path) -> str | None:
    """A hard link to the file at `path` (a copy where the file system has no hard links), beside it, so that a
    failed second rename can put it back; None if there is no file there, or neither can be made (then a failed
    rename leaves no video)."""
    if not path.is_file():
        return None
    backup = str(path.parent / f".{path.name}.old-{os.getpid()}")
    try:
        if os.path.lexists(backup):
            os.remove(backup)
        try:
            os.link(path, backup)
        except OSError:
            shutil.copy2(path, backup)
    except BaseException as e:  # (a partial copy: removed, also on Ctrl-C)
        with contextlib.suppress(OSError):
            os.remove(backup)
        if not isinstance(e, OSError):
            raise
        return None
    return backup


def mp4_writer(path, fps: int):
    """The mp4 writer (app/mp4.py: H.264 from imageio-ffmpeg's own ffmpeg, no system ffmpeg needed, started safely
    from a multi-threaded process); RuntimeError naming the package where imageio-ffmpeg is missing."""
    from .mp4 import Mp4Writer
    return Mp4Writer(path, fps)


def close_quietly(writer) -> None:
    """A writer still open when its run failed or was cancelled: stop its ffmpeg before the temporary files go (or it
    would write the mp4 later), saying nothing (the run's own error is the one to report)."""
    if writer is not None and not writer.closed:
        writer.abort()


def ratio_words(ratio: float) -> str:
    """How the cache compares with BF16: "3.10x smaller than BF16", "1.14x larger than BF16" or "the size of BF16"."""
    if round(ratio, 2) == 1:
        return "the size of BF16"
    return f"{ratio:.2f}x smaller than BF16" if ratio > 1 else f"{1 / ratio:.2f}x larger than BF16"


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # (a caller's own filters are back when main returns)
        return _main(sys.argv[1:] if argv is None else argv)


def _stopped(s, sig: int) -> int:
    """Say that a signal stopped the run (and whether the outputs were already in place); its exit status."""
    done = s is not None and s.get("written")
    word = "interrupted" if sig == signal.SIGINT else "terminated"
    print(f"qvg-generate: {word}; {'after writing ' + str(s['out']) if done else 'nothing written'}", file=sys.stderr)
    return 128 + sig


def _main(argv: list[str]) -> int:
    s = None
    seen: list[int] = []  # (SIGINT / SIGTERM, even where a library swallowed the exception they raised)
    try:
        with sigterm_raises(seen):
            from qvg.cache import UnitCostWarning  # (torch loads here, inside the try: a Ctrl-C is one line too)
            warnings.filterwarnings("ignore", category=UnitCostWarning)  # (said as a note of ours: unit_cost_note)
            s = parse(argv)
            report = run(s)
    except UsageError as e:
        print(f"qvg-generate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _stopped(s, signal.SIGINT)
    except Terminated:
        return _stopped(s, signal.SIGTERM)
    except Exception as e:  # anything else (ffmpeg, disk full, out of memory): one line, nothing left behind
        if seen:  # (stopped by the user, the exception a library's rewording of it)
            return _stopped(s, seen[-1])
        from qvg.pipelines.state_dicts import first_line
        print(f"qvg-generate: error: {first_line(e)}; nothing written", file=sys.stderr)
        return 1
    if seen:  # (a Ctrl-C / SIGTERM that a library swallowed, the run finished anyway: still the user's stop)
        return _stopped(s, seen[-1])
    print(f"wrote {s['out']} ({report['frames']} frames, {report['seconds']:.1f} s; KV cache "
          f"{report['kv_bytes']['total'] / 2**20:.2f} MiB, {ratio_words(report['compression_ratio'])}) "
          f"and {s['out'].with_suffix('.json')}")
    if s["method"] != "bf16" and report["kv_bytes"].get("codes") and report["compression_ratio"] < 1 and \
            not unit_cost_note(s):  # (that case was said before the run: a longer history does not repay it)
        print(f"qvg-generate: note: {s['method']} holds more than BF16 here: beside its packed history it keeps "
              "BF16 room for the chunk being generated (and any sink), which a history this short does not repay; "
              "the ratio grows with the history (README, 'What ratio to expect')", file=sys.stderr)
    if s["method"] != "bf16" and not report["kv_bytes"].get("codes"):  # (said: the line reads like a bug otherwise)
        latent = report["latent_frames"]
        why = (f"a sink of --sink {s['sink']} latent frames covering the video's {latent}" if s["sink"] >= latent else
               f"chunks waiting for --commit-every {s['commit_every']}, which the video never filled")
        print(f"qvg-generate: note: {s['method']} compressed nothing: every frame stayed in the BF16 zones ({why})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
