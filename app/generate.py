"""`qvg-generate`: generate a video chunk by chunk with the history in a compressed KV cache; write an mp4 and a
JSON report (method, options, frames, seconds, KV bytes by component, BF16-equivalent bytes, compression ratio,
peak GPU memory, device, commit) next to it.

Bad input gives one `qvg-generate: error: ...` line and exit status 2; nothing is left behind (the mp4 and the
JSON are written to temporary files and renamed into place only when both are complete).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIPELINES = ("tiny", "self-forcing")
DEFAULT_PROMPT = "a red fox running through fresh snow, cinematic"
DEFAULT_IMAGE = "astronaut"
DEFAULT_ACTIONS = "right*3,down*2,left*3,up*2"  # a loop: the camera comes back to where it started


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from qvg.cache import CACHE_METHODS
    p = _Parser(prog="qvg-generate", description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", default="tiny", help=f"one of {', '.join(PIPELINES)} (default tiny: the embedded model)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (self-forcing)")
    p.add_argument("--prompt", default=None, help="text prompt (self-forcing; the embedded model has no text input)")
    p.add_argument("--image", default=None, help="tiny: start image, a bundled photo's name or an image file "
                   f"(default {DEFAULT_IMAGE})")
    p.add_argument("--actions", default=None, help="tiny: camera action per chunk of 3 frames, e.g. 'right*4,left*4' "
                   "(stay, left, right, up, down, zoom_in, zoom_out; repeated to fill the video; default "
                   f"'{DEFAULT_ACTIONS}')")
    p.add_argument("--frames", default=None, help="video frames to write (default: about 4 s; tiny 31 at 8 fps, "
                   "self-forcing 49 at 16 fps)")
    p.add_argument("--method", default="qvg", help=f"KV cache method: {', '.join(CACHE_METHODS)} (default qvg)")
    p.add_argument("--bits", default=None, help="2, 4 or 8 (default: the method's)")
    p.add_argument("--stages", default=None, help="k-means stages S (qvg, qvg-pro)")
    p.add_argument("--block-size", default=None, help="quantization group size (divides the head dim)")
    p.add_argument("--centroids", default=None, help="k-means centroids K (qvg, qvg-pro)")
    p.add_argument("--commit-every", default="1", help="compress every k chunks (default 1)")
    p.add_argument("--history", default="full", help="full, or window:N (keep N past latent frames)")
    p.add_argument("--sink", default="0", help="latent frames kept in BF16 at the start (a multiple of 3)")
    p.add_argument("--seed", default="0")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--out", default="qvg-output.mp4", help="output .mp4 (the .json report goes beside it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _int(name: str, value, lo: int | None = None, hi: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    try:
        v = int(str(value), 10)
    except ValueError:
        raise UsageError(f"--{name} must be an integer, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"--{name} must be {rng}, got {v}")
    return v


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        import qvg
        return f"qvg {qvg.__version__} (no git checkout)"


def parse(argv) -> dict:
    """Check every argument (cheap checks first, before any model is built) -> the run's settings."""
    import torch

    from qvg.cache import CACHE_METHODS
    a = build_parser().parse_args(argv)
    if a.pipeline not in PIPELINES:
        raise UsageError(f"unknown pipeline {a.pipeline!r}; choose one of: {', '.join(PIPELINES)}")
    if a.method not in CACHE_METHODS:
        raise UsageError(f"unknown method {a.method!r}; choose one of: {', '.join(CACHE_METHODS)}")
    tiny = a.pipeline == "tiny"
    frames = a.frames if a.frames is not None else ("31" if tiny else "49")
    s = {"pipeline": a.pipeline, "method": a.method, "quiet": a.quiet,
         "frames": _int("frames", frames, 1, 100000), "seed": _int("seed", a.seed, 0, 2**63 - 1),
         "commit_every": _int("commit-every", a.commit_every, 1, 1000), "sink": _int("sink", a.sink, 0)}
    opts = {"bits": _int("bits", a.bits, allow_none=True), "stages": _int("stages", a.stages, 0, 16, True),
            "block_size": _int("block-size", a.block_size, 1, allow_none=True),
            "centroids": _int("centroids", a.centroids, 1, 65536, True)}
    if opts["bits"] is not None and opts["bits"] not in (2, 4, 8):
        raise UsageError(f"--bits must be 2, 4 or 8, got {opts['bits']}")
    if a.pipeline == "tiny" and a.method == "qvg" and opts["bits"] is None:
        # the embedded model is sensitive to INT2 keys (eval/results/world-eval-h100.md: QVG INT2 costs 2.3 dB on
        # revisits, INT4 0.02 dB): its default is INT4; --bits 2 gives the 2-bit cache
        opts["bits"] = 4
    s["options"] = {k: v for k, v in opts.items() if v is not None}
    if a.method == "bf16" and s["options"]:
        raise UsageError(f"--method bf16 stores BF16: {', '.join('--' + k.replace('_', '-') for k in s['options'])}"
                         " do not apply")
    if a.history == "full":
        s["window"] = None
    elif a.history.startswith("window:"):
        s["window"] = _int("history window", a.history.split(":", 1)[1], 1)
    else:
        raise UsageError(f"--history must be 'full' or 'window:N', got {a.history!r}")
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(dev)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: not a device: {a.device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda[:N], got {a.device!r}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {a.device}: there are {torch.cuda.device_count()} CUDA devices")
    s["device"] = dev
    out = Path(a.out)
    if out.suffix.lower() != ".mp4":
        raise UsageError(f"--out must end in .mp4, got {a.out!r}")
    parent = out.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--out: cannot write to {str(parent)!r} (no such directory or not writable)")
    for path in (out, out.with_suffix(".json")):
        if path.is_dir():
            raise UsageError(f"--out: {str(path)!r} is a directory")
    s["out"] = out
    if a.pipeline == "self-forcing":
        if not a.checkpoint:
            raise UsageError("--pipeline self-forcing needs --checkpoint DIR")
        if not Path(a.checkpoint).is_dir():
            raise UsageError(f"--checkpoint: no such directory: {a.checkpoint!r}")
    elif a.checkpoint:
        raise UsageError("--checkpoint applies to --pipeline self-forcing")
    s["checkpoint"] = a.checkpoint
    if tiny:
        if a.prompt is not None:
            raise UsageError("--prompt: the embedded world model is not text-conditioned; steer it with --image and "
                             "--actions")
        s.update(_world_inputs(a.image or DEFAULT_IMAGE, a.actions or DEFAULT_ACTIONS))
    else:
        for name in ("image", "actions"):
            if getattr(a, name) is not None:
                raise UsageError(f"--{name} applies to --pipeline tiny (the embedded world model)")
        s["prompt"] = a.prompt or DEFAULT_PROMPT
    return s


def _world_inputs(image: str, actions: str) -> dict:
    """The start image ([3, H, W] in [-1, 1]) and per-chunk action ids of the embedded world model."""
    from qvg.pipelines.world_data import load_photo, photo_names
    from qvg.pipelines.world_model import WorldModelError, parse_actions
    try:
        ids = parse_actions(actions)
    except WorldModelError as e:
        raise UsageError(f"--actions: {e}") from None
    if image in photo_names("all"):  # the view at the photo's centre at scale 1, as the model saw them in training
        from qvg.pipelines.world_data import centre_view
        img = centre_view(load_photo(image))
        source = f"bundled photo {image!r} (the {img.shape[-1]} x {img.shape[-1]} view at its centre)"
    else:
        path = Path(image)
        if not path.is_file():
            raise UsageError(f"--image: {image!r} is neither a bundled photo ({', '.join(photo_names('all'))}) nor "
                             "a file")
        try:
            import imageio.v2 as imageio
            import numpy as np
            import torch
            a = np.asarray(imageio.imread(path))
            if a.ndim == 2:
                a = np.repeat(a[..., None], 3, -1)
            if a.ndim != 3 or a.shape[-1] < 3 or min(a.shape[:2]) < 16 or a.dtype != np.uint8:
                raise ValueError(f"shape {a.shape} dtype {a.dtype}")
            img = torch.from_numpy(a[..., :3].copy()).permute(2, 0, 1).float() / 127.5 - 1
        except Exception as e:
            raise UsageError(f"--image: cannot read {image!r} as an 8-bit RGB image "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        source = str(path)
    return {"image": img, "image_source": source, "actions": ids, "actions_text": actions}


def _model(s):
    """(transformer, vae or None, text encoder or None, fps, latent (h, w), latent frames to generate)."""
    import torch

    from qvg.pipelines import tiny
    if s["pipeline"] == "tiny":
        from qvg.pipelines.world_model import WorldModelError, load_world
        try:
            model, cfg = load_world(device=s["device"])
        except WorldModelError as e:
            raise UsageError(f"the embedded model: {e}") from None
        s["world_config"] = cfg
        size = cfg["frame_size"]
        return model, None, None, cfg["fps"], (size, size), max(1, s["frames"] - 1)  # frame 0 is the start image
    from qvg.pipelines.checkpoints import load_self_forcing
    from qvg.pipelines.state_dicts import CheckpointError
    from qvg.pipelines.umt5 import MissingDependency
    try:  # Self-Forcing runs its generator in BF16; layout and checks: pipelines/checkpoints.py
        m = load_self_forcing(s["checkpoint"], s["device"], torch.bfloat16)
    except (CheckpointError, MissingDependency) as e:
        raise UsageError(f"--checkpoint: {e}") from None
    s["checkpoint_sources"] = m.sources
    # Wan2.1-T2V-1.3B's 480 x 832 at 16 fps: 60 x 104 latents (the VAE's 8x), the same frame rule as tiny
    return m.transformer, m.vae, m.text_encoder, tiny.FPS, (60, 104), tiny.latent_frames_for(s["frames"])


def _chunks(s, transformer, vae, text_encoder, latent_hw, latent_frames, cache):
    """The pipeline's chunks (ChunkResult), and the frames [3, F, H, W] in [-1, 1] that come before them."""
    if s["pipeline"] == "tiny":
        from qvg.pipelines.world_model import image_frame, rollout
        cfg = s["world_config"]
        start = image_frame(s["image"], cfg["frame_size"]).to(s["device"])
        n = -(-latent_frames // cfg["chunk_frames"])
        acts = [s["actions"][i % len(s["actions"])] for i in range(n)]
        s["chunk_actions"] = [cfg["actions"][a] for a in acts]
        return rollout(transformer, cfg, start, acts, cache, seed=s["seed"]), start[:, None]
    from qvg.pipelines.self_forcing import SelfForcingPipeline
    text = text_encoder(s["prompt"])
    pipe = SelfForcingPipeline(transformer, vae)
    return pipe.generate(text, latent_frames, latent_hw, cache, seed=s["seed"]), None


def _cache(s, transformer, latent_hw):
    from qvg.cache import KVCache, default_centroids
    from qvg.compression import resolve_options
    cf = 3
    tpf = transformer.tokens_per_latent_frame(*latent_hw)
    heads, hd = transformer.config.num_attention_heads, transformer.config.attention_head_dim
    opts = dict(s["options"])
    unit = cf * tpf * s["commit_every"]
    if s["method"] in ("qvg", "qvg-pro") and "centroids" not in opts:
        opts["centroids"] = default_centroids(unit)
    if s["method"] != "bf16":
        try:  # kivi compresses keys and values with different roles: check both
            for role in (("key", "value") if s["method"] == "kivi" else (None,)):
                resolved = resolve_options(s["method"], (1, heads, unit, hd), **opts,
                                           **({"role": role, "residual": 0} if role else {}))
        except ValueError as e:
            raise UsageError(f"--method {s['method']}: {e}") from None
        s["resolved_options"] = {k: v for k, v in resolved.items() if k not in ("role", "residual")}
        if opts.get("centroids", 0) > unit:
            raise UsageError(f"--centroids {opts['centroids']} > tokens per compressed unit ({unit})")
    for name, frames in (("sink", s["sink"]), ("history window", s["window"])):
        if frames is not None and frames % cf:
            raise UsageError(f"--{name} must be a multiple of the chunk size ({cf} latent frames), got {frames}")
    s["options"] = opts
    return KVCache(len(transformer.blocks), s["method"], chunk_frames=cf, tokens_per_frame=tpf,
                   sink_frames=s["sink"], window_frames=s["window"], commit_every=s["commit_every"], **opts)


def run(s) -> dict:
    import numpy as np
    import torch
    from tqdm import tqdm

    dev = s["device"]
    transformer, vae, text_encoder, fps, latent_hw, latent_frames = _model(s)
    cf = s.get("world_config", {}).get("chunk_frames", 3)
    s["latent_frames"] = -(-latent_frames // cf) * cf  # whole chunks are generated
    cache = _cache(s, transformer, latent_hw)
    # the text is encoded before the peak-memory window: a real text encoder is freed after it
    chunks, lead = _chunks(s, transformer, vae, text_encoder, latent_hw, latent_frames, cache)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out: Path = s["out"]
    fd_v, tmp_video = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".mp4", dir=out.resolve().parent)
    os.close(fd_v)
    tmp_json = tmp_video[:-4] + ".json"
    t0 = time.perf_counter()
    written, peak_kv, writer = 0, None, None
    try:
        import imageio.v2 as imageio
        writer = imageio.get_writer(tmp_video, fps=fps, codec="libx264", quality=8, macro_block_size=1)

        def put(video):  # [3, F, H, W] in [-1, 1]
            nonlocal written
            frames = ((video.permute(1, 2, 3, 0).float().cpu().numpy() + 1) * 127.5).round()
            for f in frames.clip(0, 255).astype(np.uint8):
                if written < s["frames"]:
                    writer.append_data(f)
                    written += 1

        bar = tqdm(total=-(-latent_frames // cf), desc=f"{s['method']} chunks", unit="chunk", disable=s["quiet"],
                   file=sys.stderr)
        with writer:
            if lead is not None:
                put(lead)
            for res in chunks:
                mem = cache.memory()
                peak_kv = mem if peak_kv is None or mem["total"] > peak_kv["total"] else peak_kv
                put(res.video[0])
                bar.set_postfix(kv=f"{mem['total'] / 2**20:.1f} MiB", ratio=f"{mem['compression_ratio']:.2f}x")
                bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        mem = peak_kv
        report = {
            "method": s["method"], "options": s.get("resolved_options", {}), "pipeline": s["pipeline"],
            **({"image": s["image_source"], "actions": s["chunk_actions"]} if s["pipeline"] == "tiny"
               else {"prompt": s["prompt"]}),
            "seed": s["seed"], "frames": written, "fps": fps, "latent_frames": latent_frames,
            "history": "full" if s["window"] is None else f"window:{s['window']}", "sink": s["sink"],
            "commit_every": s["commit_every"], "seconds": round(seconds, 3),
            "kv_bytes": {k: mem[k] for k in ("codes", "scales", "ids", "centroids", "bf16", "workspace", "total")},
            "bf16_zones": {k[5:]: mem[k] for k in ("bf16_sink", "bf16_pending", "bf16_current", "bf16_residual")
                           if k in mem},
            "bf16_equivalent_bytes": mem["bf16_equivalent"], "compression_ratio": round(mem["compression_ratio"], 4),
            "kv_bytes_note": "the cache at its largest during the run (after the last chunk for full history)",
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "commit": _commit(),
        }
        if "checkpoint_sources" in s:
            report["checkpoint"] = s["checkpoint_sources"]
        if dev.type == "cuda":
            report["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
        with open(tmp_json, "w") as f:
            json.dump(report, f, indent=1)
        mode = 0o666 & ~_umask()
        os.chmod(tmp_video, mode)
        os.chmod(tmp_json, mode)
        os.replace(tmp_video, out)
        try:
            os.replace(tmp_json, out.with_suffix(".json"))
        except BaseException:
            os.remove(out)  # both or neither
            raise
        return report
    finally:
        # imageio's writer does not close (and ffmpeg does not write the file) when its `with` block raises: close
        # it here, before the temporary files go, or ffmpeg writes the mp4 later
        if writer is not None and not writer.closed:
            try:
                writer.close()
            except Exception:
                pass
        for t in (tmp_video, tmp_json):
            if os.path.exists(t):
                os.remove(t)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        s = parse(argv)
        report = run(s)
    except UsageError as e:
        print(f"qvg-generate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qvg-generate: interrupted; nothing written", file=sys.stderr)
        return 130
    except Exception as e:  # anything else (ffmpeg, disk full, out of memory): one line, nothing left behind
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"qvg-generate: error: {type(e).__name__}: {msg}; nothing written", file=sys.stderr)
        return 1
    print(f"wrote {s['out']} ({report['frames']} frames, {report['seconds']:.1f} s; KV cache "
          f"{report['kv_bytes']['total'] / 2**20:.2f} MiB, {report['compression_ratio']:.2f}x smaller than BF16) "
          f"and {s['out'].with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
