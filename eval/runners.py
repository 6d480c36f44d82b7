"""Make videos for the sweep and the analyses: one call = one video of a pipeline with one KV-cache method.

- `EmbeddedRunner` rolls out the embedded world model (`qvg.pipelines.world_model`, or any WorldModel + config)
  in memory: start image (a bundled photo's centre view or an image file) + camera actions, the cache built as
  `qvg-generate` builds it (`qvg.cache.KVCache`, K = `default_centroids` for qvg / qvg-pro, keys packed before
  RoPE for rtn / qvg / qvg-pro: `--key-storage auto`), or with every method's keys after RoPE
  (key_storage="post-rope", as every runner did before 2026-11-30).
- `GenerateRunner` runs any `qvg-generate` pipeline (`--pipeline self-forcing --checkpoint DIR` ...) through its
  own code (`qvg.app.generate.parse` + `run`), writing the mp4 + JSON into a work folder and reading them back
  (the mp4's 8-bit H.264 coding is then part of what every video holds, reference and test alike).

`run(input, seed, method, options, chunks)` -> `Video(video [3, F, H, W] in [-1, 1] on the CPU, memory: the
cache's bytes by component at its largest, seconds)`.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_ACTIONS = "right*3,down*2,left*3,up*2"  # qvg-generate's default loop
KEY_STORAGES = ("auto", "post-rope")  # the runners' key storage: qvg-generate's default, or after RoPE for all


@dataclass
class Video:
    video: torch.Tensor
    memory: dict
    seconds: float
    path: str | None = None  # the mp4 it was read from (qvg-generate's runs), recorded in a sweep's runs


def check_key_storage(key_storage: str) -> str:
    if key_storage not in KEY_STORAGES:
        raise ValueError(f"key storage must be {' or '.join(KEY_STORAGES)}, got {key_storage!r}")
    return key_storage


class EmbeddedRunner:
    kind = "embedded"

    def __init__(self, model=None, config: dict | None = None, device="cpu", actions: str = DEFAULT_ACTIONS,
                 key_storage: str = "auto"):
        from qvg.pipelines.world_model import load_world, parse_actions
        self.key_storage = check_key_storage(key_storage)
        if model is None:
            model, config = load_world(device=device)
        self.model, self.config, self.device = model, config, torch.device(device)
        self.actions_text = actions
        self.actions = parse_actions(actions, config)
        cf, size = config["chunk_frames"], config["frame_size"]
        self.lead, self.first, self.chunk = 1, cf, cf
        self.tokens_per_frame = model.tokens_per_latent_frame(size, size)
        self.fps = config.get("fps", 8)

    def describe(self) -> dict:
        c = self.model.config
        return {"pipeline": "embedded world model", "layers": c.num_layers, "heads": c.num_attention_heads,
                "head_dim": c.attention_head_dim, "frame_size": self.config["frame_size"],
                "chunk_frames": self.config["chunk_frames"], "tokens_per_chunk": self.unit_tokens,
                "actions": self.actions_text, "parameters": sum(p.numel() for p in self.model.parameters()),
                "trained_steps": self.config.get("training", {}).get("steps"), "key_storage": self.key_storage}

    def keys(self, method: str) -> str:
        """The cache's key storage for `method`."""
        from qvg.app.generate import auto_key_storage
        return auto_key_storage(method, "tiny") if self.key_storage == "auto" else "post-rope"

    @property
    def unit_tokens(self) -> int:
        return self.config["chunk_frames"] * self.tokens_per_frame

    def start_frame(self, image: str) -> torch.Tensor:
        """The start frame qvg-generate --image takes (a bundled photo's centre view, or an image file's view at
        the bundled photos' scale), at this model's frame size; UsageError (naming --inputs) where it can't."""
        from qvg.app.generate import start_frame
        return start_frame(image, "--inputs", self.config["frame_size"])[0]

    def frames(self, chunks: int) -> int:
        return self.lead + chunks * self.chunk

    def run(self, image: str, seed: int, method: str, options: dict, chunks: int, capture=None) -> Video:
        """One rollout of `chunks` generated chunks (plus the start frame); `capture`: a `KVCapture` on this model,
        entered for this rollout only (it records this video's K/V)."""
        from qvg.cache import KVCache
        from qvg.pipelines.world_model import rollout
        cf = self.config["chunk_frames"]
        cache = KVCache(len(self.model.blocks), method, chunk_frames=cf, tokens_per_frame=self.tokens_per_frame,
                        key_storage=self.keys(method), **options)  # (qvg / qvg-pro: the cache's default K)
        start = self.start_frame(image).to(self.device)
        acts = [self.actions[i % len(self.actions)] for i in range(chunks)]
        t0 = time.perf_counter()
        vids, mem = [start[:, None].float().cpu()], None
        with torch.no_grad(), (capture if capture is not None else contextlib.nullcontext()):
            for r in rollout(self.model, self.config, start, acts, cache, seed=seed):
                vids.append(r.video[0].float().cpu())
                m = cache.memory()
                mem = m if mem is None or m["total"] >= mem["total"] else mem  # (ties: the latest)
        return Video(torch.cat(vids, 1), mem, time.perf_counter() - t0)


# qvg-generate's flags, as a sweep names what they come from (its errors are said in the sweep's words)
SWEEP_FLAGS = {"--image": "--inputs", "--prompt": "--inputs", "--seed": "--seeds", "--kmeans-seed": "--kmeans-seeds",
               "--method": "--methods"}


def sweep_words(message: str, workdir: Path) -> str:
    """A qvg-generate error in a sweep's words: its flags -> the sweep's options, --out -> the videos' folder.
    Quoted text (a path, a prompt, an input's name) is left as it is."""
    def words(text: str) -> str:
        for flag, name in SWEEP_FLAGS.items():  # whole flags only: --seed is not --seeds
            text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", name, text)
        return re.sub(r"(?<![\w-])--out(?![\w-])", f"the videos' folder {str(workdir)!r}", text)
    # odd items: quoted as repr() quotes ("can't" opens no quote)
    parts = re.split(r"""((?<!\w)(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?!\w))""", message)
    return "".join(p if i % 2 else words(p) for i, p in enumerate(parts))


class GenerateRunner:
    """Any qvg-generate pipeline, through its CLI code. Inputs are prompts (self-forcing) or images (tiny)."""
    kind = "qvg-generate"

    def __init__(self, pipeline: str, checkpoint: str | None, device: str, workdir: str | Path,
                 frames_per_chunk: tuple[int, int, int] | None = None, key_storage: str = "auto"):
        from .compare import LAYOUTS
        self.pipeline, self.checkpoint, self.device = pipeline, checkpoint, device
        self.key_storage = check_key_storage(key_storage)
        self.workdir = Path(workdir)  # (made at the first run)
        lay = LAYOUTS.get(pipeline, LAYOUTS["self-forcing"])
        self.lead, self.first, self.chunk = frames_per_chunk or (lay["lead"], lay["first"], lay["chunk"])
        self.fps = None
        self._n = 0

    def describe(self) -> dict:
        return {"pipeline": self.pipeline, "checkpoint": self.checkpoint, "key_storage": self.key_storage}

    def frames(self, chunks: int) -> int:
        return self.lead + self.first + (chunks - 1) * self.chunk

    def argv(self, text: str, seed: int, method: str, options: dict, chunks: int, out: Path) -> list[str]:
        """qvg-generate's arguments for one run; options' "seed" (the compression's: k-means) is --kmeans-seed, not
        the sampling seed."""
        argv = ["--pipeline", self.pipeline, "--method", method, "--seed", str(seed), "--frames",
                str(self.frames(chunks)), "--out", str(out), "--quiet", "--device", str(self.device),
                "--key-storage", self.key_storage]
        if self.checkpoint:
            argv += ["--checkpoint", self.checkpoint]
        argv += ["--image", text] if self.pipeline == "tiny" else ["--prompt", text]
        for k, v in options.items():
            argv += [f"--{'kmeans-seed' if k == 'seed' else k.replace('_', '-')}", str(v)]
        return argv

    def check(self, spec: dict) -> None:
        """Every input x method x bits of a sweep `spec` through qvg-generate's own argument checks (its UsageError
        names the first bad one), before any run; the seeds' ranges are the caller's to check. Nothing is
        written (qvg-generate's output check makes and removes a probe file where the work folder will be)."""
        from qvg.app import generate
        folder = self.workdir
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():  # the videos' folder or one above it is a file
            raise generate.UsageError(f"cannot write the videos to {str(self.workdir)!r}: {str(folder)!r} is a file")
        probe = folder / ".qvg-sweep-check.mp4"
        from qvg.compression import kmeans_methods
        runs = [("bf16", {})] + [(m, {"bits": b, **({"seed": spec["kmeans_seeds"][0]} if m in kmeans_methods()
                                                    else {})}) for m in spec["methods"] for b in spec["bits"]]
        try:
            for text in spec["inputs"]:
                for method, opts in runs:
                    generate.parse(self.argv(text, spec["seeds"][0], method, opts, spec["chunks"], probe))
        except generate.UsageError as e:
            raise generate.UsageError(sweep_words(str(e), self.workdir)) from None

    def run(self, text: str, seed: int, method: str, options: dict, chunks: int, capture=None) -> Video:
        from qvg.app import generate
        from .video import read_video
        if capture is not None:
            raise ValueError("KV capture needs the in-memory embedded runner")
        self._n += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        bits = f"-int{options['bits']}" if options.get("bits") else ""
        k = f"-kmeans{options['seed']}" if options.get("seed") is not None else ""
        out = self.workdir / f"run{self._n}-{method}{bits}-seed{seed}{k}.mp4"  # (the run's record names it too)
        t0 = time.perf_counter()
        rep = generate.run(generate.parse(self.argv(text, seed, method, options, chunks, out)))
        video = read_video(out)
        self.fps = rep.get("fps")
        mem = {**rep["kv_bytes"], "bf16_equivalent": rep["bf16_equivalent_bytes"],
               "compression_ratio": rep["compression_ratio"]}
        return Video(video, mem, time.perf_counter() - t0, os.path.abspath(out))
