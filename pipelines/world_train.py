"""Train the embedded world model (pipelines/world_model.py) on procedurally generated camera trajectories
(pipelines/world_data.py): teacher forcing on clean context.

Each training sequence is `chunks` chunks of `chunk_frames` frames; chunk 0 is the still start view. One forward
runs the clean copy of every frame and a noisy copy of every generated chunk (chunks 1..), with a per-token
timestep (0 for the clean copy, the chunk's own noise level for the noisy one), per-token actions, and a mask: a
clean chunk sees the clean chunks up to itself (block-causal, as the cache holds them after the t = 0 re-run), a
noisy chunk sees the clean chunks before it and itself. Both copies of frame f take RoPE index f (and, with the
config's world_rope, frame f's pan offset as spatial RoPE offset: `Trainer.spatial_offsets`). The loss is
flow matching (the model predicts v = noise - x0 at x_t = (1 - sigma) x0 + sigma noise, as the sampler uses it),
with half the noise levels drawn from the sampler's own steps. The context after the start chunk is, per
sequence, clean, or blurred with a little noise (as the model's own frames will be), or re-noised to a small level
with that timestep (Self-Forcing's context noise; the sampler's clean re-run uses `context_sigma`).

Rollout context (`--rollout-fraction p`, the exposure-bias fix): on a share p of the steps the context after the
start chunk is the model's own generation for the batch's start views and actions (the sampler with a BF16 cache,
no gradient), while the targets stay the true views. At inference the model sees only its own frames after the
start; trained on them, it learns to take what the true start view holds from the start chunk when the camera comes
back, instead of following its drifted frames.

Resumable: `--ckpt DIR` holds the state (FP32 weights and BF16 Adam moments as sharded safetensors, each under
16 MB, plus state.json with the step, the settings and the log); a run continues from it and stops after
`--minutes`. `--export DIR` writes the shippable model (FP16 safetensors + config.json with the training card).

    python -m qvg.pipelines.world_train --ckpt runs/world --minutes 8 --total-steps 4000
    python -m qvg.pipelines.world_train --ckpt runs/world --export assets/world

`--world-rope` starts a new run with world-coordinate spatial RoPE (pipelines/world_model.py); a resumed run keeps
the config its state was saved with, and a new `--init` run takes the config of the model it starts from (its
world_rope too; `--world-rope` can only turn that on). A resumed run takes the settings saved with its state; a
setting given again with another value is applied from there on, said on stderr and recorded in state.json
(`setting_changes`, also in the exported model's training card). `--init` starts a new run; given again on
resuming, it must name the model that run started from. state.json and the exported card record every run's argv,
commit and date (`runs`), the commit that exported it, and the SHA-256 of the weights an `--init` run started from.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qvg.help_format import OneLineParser
from qvg.numbers import integer
from qvg.outputs import folder_error
from qvg.revision import code_commit, file_sha256

from .self_forcing import flow_sigmas
from .world_data import WorldData
from .world_model import DEFAULT_CONFIG, build_world, pan_offsets, save_world, world_inputs

SHARD_BYTES = 15 * 2**20
DEFAULTS = dict(chunks=11, batch=16, lr=3e-4, warmup=200, weight_decay=0.01, grad_clip=1.0, seed=0,
                total_steps=4000, step_sigma_fraction=0.5, context_sigma_max=0.2, revisit_fraction=0.7,
                rollout_fraction=0.0)


def token_layout(chunks: int, cf: int, tpf: int, device="cpu"):
    """Per token of [clean frames of all chunks, noisy frames of chunks 1..]: (copy 0/1, chunk index)."""
    clean = torch.arange(chunks * cf * tpf, device=device) // (cf * tpf)
    noisy = 1 + torch.arange((chunks - 1) * cf * tpf, device=device) // (cf * tpf)
    copy = torch.cat([torch.zeros_like(clean), torch.ones_like(noisy)])
    return copy, torch.cat([clean, noisy])


def _may_attend(copy_q, chunk_q, copy_k, chunk_k):
    """The training mask's rule (module docstring), on broadcastable token labels: a clean query sees the clean
    chunks up to its own; a noisy query sees the clean chunks before its own and its own noisy chunk."""
    clean_q = (copy_k == 0) & (chunk_k <= chunk_q)
    noisy_q = ((copy_k == 0) & (chunk_k < chunk_q)) | ((copy_k == 1) & (chunk_k == chunk_q))
    return torch.where(copy_q == 0, clean_q, noisy_q)


def dense_mask(copy: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """[N, N] boolean: True where query token i may attend key token j."""
    return _may_attend(copy[:, None], chunk[:, None], copy[None, :], chunk[None, :])


def block_mask(copy: torch.Tensor, chunk: torch.Tensor):
    """The same mask as a flex-attention BlockMask (fully masked blocks are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mod(b, h, q, k):
        return _may_attend(copy[q], chunk[q], copy[k], chunk[k])

    n = copy.numel()
    return create_block_mask(mod, None, None, n, n, device=copy.device)


def degrade(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Blur (down + up by 2) and a little noise: what the model's own generated frames look like."""
    b, c, f, h, w = x.shape
    y = x.transpose(1, 2).reshape(b * f, c, h, w)
    y = F.interpolate(F.avg_pool2d(y, 2), size=(h, w), mode="bilinear", align_corners=False)
    y = y.reshape(b, f, c, h, w).transpose(1, 2)
    return y + 0.03 * torch.randn(y.shape, generator=gen).to(y)


class Trainer:
    def __init__(self, args: dict, cfg: dict = DEFAULT_CONFIG, device="cpu", attention: str = "auto"):
        self.args, self.cfg, self.device = dict(DEFAULTS, **args), cfg, torch.device(device)
        a = self.args
        self.model = build_world(cfg, seed=a["seed"]).to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a["lr"], betas=(0.9, 0.99),
                                     weight_decay=a["weight_decay"])
        self.step, self.elapsed, self.log = 0, 0.0, []
        self.init = None  # the exported model a fine-tune started from: its directory and training card
        self.setting_changes: list[dict] = []  # settings a resumed run changed: {"step", "settings": {k: [old, new]}}
        self.runs: list[dict] = []  # each run of this state: {"step" it started at, "argv", "commit", "date"}
        cf, size = cfg["chunk_frames"], cfg["frame_size"]
        tpf = (size // cfg["transformer"]["patch_size"][1]) ** 2
        self.copy, self.chunk = token_layout(a["chunks"], cf, tpf, self.device)
        use_flex = attention == "flex" or (attention == "auto" and self.device.type == "cuda")
        self.mask = block_mask(self.copy, self.chunk) if use_flex else dense_mask(self.copy, self.chunk)
        self.frame_ids = torch.cat([torch.arange(a["chunks"] * cf), torch.arange(cf, a["chunks"] * cf)])
        self.sigmas = torch.tensor(flow_sigmas(cfg["steps"], cfg["shift"]))
        self.gen = torch.Generator().manual_seed(a["seed"] + 1)
        self.compiled = None  # torch.compile(model) when asked: fuses Wan's many FP32 elementwise ops

    def compile(self) -> None:
        self.compiled = torch.compile(self.model)

    def lr_at(self, step: int) -> float:
        a = self.args
        if step < a["warmup"]:
            return a["lr"] * (step + 1) / a["warmup"]
        p = min(1.0, (step - a["warmup"]) / max(1, a["total_steps"] - a["warmup"]))
        return a["lr"] * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))

    def spatial_offsets(self, actions: torch.Tensor) -> torch.Tensor | None:
        """Actions [B, chunks] -> the spatial RoPE offsets of the training tokens' frames, in frame_ids' layout (clean
        copies of all frames, then noisy copies of chunks 1..): [B, len(frame_ids), 2]; None without world_rope."""
        if not self.model.world_rope:
            return None
        return pan_offsets(actions, self.cfg)[:, self.frame_ids.to(actions.device)]

    @torch.no_grad()
    def rollout_context(self, frames: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The model's own frames for chunks 1 .. chunks-2 (the context of the generated chunks; the last chunk is
        never context) from the batch's start chunk and actions: [B, 3, (chunks - 2) * cf, S, S] in [-1, 1]."""
        from qvg.cache import KVCache

        from .world_model import world_pipeline
        a, cfg = self.args, self.cfg
        cf, size = cfg["chunk_frames"], cfg["frame_size"]
        b, dev = frames.shape[0], frames.device
        model = self.model
        was = model.training
        model.eval()
        cache = KVCache(len(model.blocks), "bf16", chunk_frames=cf, tokens_per_frame=model.tokens_per_latent_frame(
            size, size))
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
        try:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                chunks = [r.video.float() for r in world_pipeline(model, cfg).generate(
                    model.null_text(b), (a["chunks"] - 2) * cf, (size, size), cache, seed=seed, batch=b,
                    context=frames[:, :, :cf], chunk_inputs=lambda c: world_inputs(cfg, actions[:, :c + 1].to(dev)))]
        finally:
            model.train(was)
        return torch.cat(chunks, 2)

    def loss(self, frames: torch.Tensor, actions: torch.Tensor, rollout: bool = False) -> torch.Tensor:
        """frames [B, 3, F, S, S] in [-1, 1], actions [B, chunks] -> the flow-matching loss of one batch. rollout:
        the context after the start chunk is the model's own generation (module docstring)."""
        a, cf = self.args, self.cfg["chunk_frames"]
        b, gen = frames.shape[0], self.gen
        dev = frames.device
        gen_chunks = a["chunks"] - 1
        pick = torch.randint(0, len(self.sigmas), (b, gen_chunks), generator=gen)
        sig = torch.where(torch.rand(b, gen_chunks, generator=gen) < a["step_sigma_fraction"], self.sigmas[pick],
                          torch.rand(b, gen_chunks, generator=gen)).to(dev)
        x0 = frames[:, :, cf:]
        noise = torch.randn(x0.shape, generator=gen).to(dev)
        s = sig.repeat_interleave(cf, 1)[:, None, :, None, None]
        xt = (1 - s) * x0 + s * noise
        # the generated chunks' clean context: a third as is, a third degraded (blurred, a little noise, t = 0),
        # a third re-noised to a small level ctx_sigma with that timestep (Self-Forcing's context noise)
        clean = frames.clone()
        mode = torch.randint(0, 3, (b,), generator=gen).to(dev)
        if rollout:  # own frames are already what degrade() imitates: keep them as they are, or re-noised
            clean[:, :, cf:(a["chunks"] - 1) * cf] = self.rollout_context(frames, actions)
            mode = torch.where(mode == 1, torch.zeros_like(mode), mode)
        bad = mode == 1
        if bad.any():
            clean[bad, :, cf:] = degrade(frames[bad, :, cf:], gen).clamp(-1, 1)
        csig = torch.rand(b, gen_chunks, generator=gen).to(dev) * a["context_sigma_max"]
        csig = torch.where((mode == 2)[:, None], csig, torch.zeros_like(csig))
        cs = csig.repeat_interleave(cf, 1)[:, None, :, None, None]
        clean[:, :, cf:] = (1 - cs) * clean[:, :, cf:] + cs * torch.randn(x0.shape, generator=gen).to(dev)
        inp = torch.cat([clean, xt], 2)
        ctx_sig = torch.cat([torch.zeros(b, 1, device=dev), csig], 1)  # the start chunk stays clean
        tok_sigma = torch.where(self.copy[None] == 0, ctx_sig.gather(1, self.chunk[None].expand(b, -1)),
                                sig.gather(1, (self.chunk - 1).clamp(min=0)[None].expand(b, -1)))
        tok_action = actions.gather(1, self.chunk[None].expand(b, -1))
        model = self.compiled or self.model
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model(inp, tok_sigma * 1000.0, model.null_text(b).float(), actions=tok_action,
                        frame_ids=self.frame_ids, attn_mask=self.mask, spatial_offsets=self.spatial_offsets(actions))
        v = out[:, :, a["chunks"] * cf:].float()
        return F.mse_loss(v, noise - x0)

    def train(self, data: WorldData, minutes: float, log_every: int = 50, max_steps: int | None = None,
              save_every: int | None = None, save_to=None) -> None:
        """Train until `minutes` pass, `max_steps` steps are done in this call or total_steps is reached; with
        save_to, the state is saved there every `save_every` steps too (a run killed from outside loses less)."""
        a = self.args
        from concurrent.futures import ThreadPoolExecutor
        t0 = counted = time.perf_counter()
        run_start = self.step
        pool = ThreadPoolExecutor(1)  # the next batch is drawn while this one trains
        nxt = pool.submit(data.batch, a["batch"])
        while self.step < a["total_steps"] and (max_steps is None or self.step - run_start < max_steps):
            if time.perf_counter() - t0 > minutes * 60:
                break
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            frames, actions = nxt.result()
            nxt = pool.submit(data.batch, a["batch"])
            rollout = bool(torch.rand(1, generator=self.gen) < a["rollout_fraction"]) if a["rollout_fraction"] \
                else False
            try:
                loss = self.loss(frames, actions, rollout)
            except Exception as e:  # a compile failure must not lose the run: go on eagerly
                if self.compiled is None:
                    raise
                print(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eagerly", flush=True)
                self.compiled = None
                loss = self.loss(frames, actions, rollout)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a["grad_clip"])
            self.opt.step()
            self.step += 1
            if self.step % log_every == 0 or self.step == run_start + 1:
                el = self.elapsed + time.perf_counter() - counted  # (a save moved `counted` on: not twice)
                rec = {"step": self.step, "loss": round(loss.item(), 5), "grad_norm": round(float(gn), 3),
                       "lr": self.lr_at(self.step - 1), "seconds": round(el, 1)}
                self.log.append(rec)
                print(json.dumps(rec), flush=True)
            if save_to is not None and save_every and self.step % save_every == 0:
                now = time.perf_counter()
                self.elapsed, counted = self.elapsed + now - counted, now
                self.save(save_to)
        pool.shutdown(wait=True, cancel_futures=True)
        self.elapsed += time.perf_counter() - counted

    # state: sharded safetensors (FP32 weights, BF16 Adam moments) + state.json
    def save(self, directory) -> None:
        from safetensors.torch import save_file
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().float().cpu() for k, v in self.model.state_dict().items()}
        names = dict(self.model.named_parameters())
        for k, p in names.items():
            st = self.opt.state.get(p)
            if st:
                tensors[f"adam_m.{k}"] = st["exp_avg"].to(torch.bfloat16).cpu()
                tensors[f"adam_v.{k}"] = st["exp_avg_sq"].to(torch.bfloat16).cpu()
        shards, cur, size = [], {}, 0
        for k in sorted(tensors):
            nb = tensors[k].numel() * tensors[k].element_size()
            if cur and size + nb > SHARD_BYTES:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = tensors[k].contiguous(), size + nb
        shards.append(cur)
        # new files first, then state.json (renamed into place), then the old files: a run killed mid-save still has
        # a complete state, the old or the new one. The names are new at every save (a second save at the same step,
        # e.g. at the end of a run that just saved, rewrote the very files state.json named)
        files, tag = [], os.urandom(4).hex()
        for i, sh in enumerate(shards):
            name = f"state-s{self.step}-{tag}-{i + 1:02d}-of-{len(shards):02d}.safetensors"
            save_file(sh, str(d / name))
            files.append(name)
        meta = {"step": self.step, "elapsed_seconds": round(self.elapsed, 1), "args": self.args,
                "config": self.cfg, "files": files, "log": self.log}
        if self.init:
            meta["init"] = self.init
        if self.setting_changes:
            meta["setting_changes"] = self.setting_changes
        if self.runs:
            meta["runs"] = self.runs
        tmp = d / "state.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1, default=list))
        tmp.replace(d / "state.json")
        for old in d.glob("state-*.safetensors"):
            if old.name not in files:
                old.unlink()

    def init_from(self, directory, loaded=None) -> None:
        """Start from an exported model's weights (FP16 -> FP32), with a fresh optimizer: a fine-tune. loaded: its
        load_world (model, config) when already read (main builds the run from that config)."""
        from .world_model import load_world
        model, cfg = loaded or load_world(directory, device="cpu")
        self.model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        self.init = {"from": str(directory), "training": cfg.get("training"),
                     "sha256": file_sha256(Path(directory) / "model.safetensors")}

    def load(self, directory) -> bool:
        from safetensors.torch import load_file
        d = Path(directory)
        if not (d / "state.json").is_file():
            return False
        meta = json.loads((d / "state.json").read_text())
        tensors = {}
        for name in meta["files"]:
            tensors.update(load_file(str(d / name)))
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        step = meta["step"]
        for k, p in self.model.named_parameters():
            if f"adam_m.{k}" in tensors:
                self.opt.state[p] = {"step": torch.tensor(float(step)),
                                     "exp_avg": tensors[f"adam_m.{k}"].float().to(p.device),
                                     "exp_avg_sq": tensors[f"adam_v.{k}"].float().to(p.device)}
        self.step, self.elapsed, self.log = step, meta["elapsed_seconds"], meta["log"]
        self.init = meta.get("init")
        self.setting_changes = meta.get("setting_changes", [])
        self.runs = meta.get("runs", [])
        self.gen.manual_seed(self.args["seed"] + 1 + step)  # a resumed run draws new noise, not the first run's
        return True


def _same_init(directory, started: dict | None) -> bool:
    """Whether the exported model at `directory` is the one a state's run started from (`Trainer.init`): the same
    folder (as stored, resolved from here) or the same training card (a path given from another folder)."""
    if not started:
        return False
    if Path(directory).resolve() == Path(started["from"]).resolve():
        return True
    if started.get("training") is None:
        return False
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("training") == started["training"]
    except (OSError, ValueError, AttributeError):
        return False


# the numbers' ranges ([low, high]; POSITIVE: also > 0; UNBOUNDED: inf allowed, "no limit"), checked before anything
# runs (a NaN learning rate or an empty batch was a traceback from deep in a step; --minutes -1 saved an untrained
# state). The seed is 32-bit: the data's seed is seed * 1000003 + step, which must stay a 64-bit integer.
RANGES = {"chunks": (2, 1000), "batch": (1, 65536), "lr": (0, 1), "warmup": (0, math.inf),
          "weight_decay": (0, math.inf), "grad_clip": (0, math.inf), "seed": (0, 2**32 - 1),
          "total_steps": (1, math.inf), "step_sigma_fraction": (0, 1), "context_sigma_max": (0, 1),
          "revisit_fraction": (0, 1), "rollout_fraction": (0, 1), "minutes": (0, math.inf), "max_steps": (1, math.inf),
          "save_every": (0, math.inf)}
POSITIVE = ("lr", "grad_clip", "minutes")
UNBOUNDED = ("grad_clip", "minutes")  # (inf: no clipping; train until --max-steps)
# flags that only steer a training run (how long, where, how): --export refuses them, as it trains nothing
RUN_FLAGS = ("minutes", "device", "attention", "compile", "max_steps", "save_every")
RUN_DEFAULTS = {"minutes": 8.0, "device": lambda: "cuda" if torch.cuda.is_available() else "cpu",
                "attention": "auto", "save_every": 200}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _state_meta(ck: Path) -> dict | None:
    """A state directory's state.json (a dict), or None where there is none or it cannot be read."""
    try:
        meta = json.loads((ck / "state.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(meta, dict) and isinstance(meta.get("args"), dict) and isinstance(meta.get("config"), dict)
    return meta if ok else None


def _loaded(p, make, ck) -> "Trainer":
    """make()'s Trainer with the state in `ck` loaded; a state that does not load (a key or a shard file missing,
    tensors of another model) is one error line (argparse's p.error), not a traceback."""
    from safetensors import SafetensorError
    try:
        tr = make()
        tr.load(ck)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:  # (a damaged shard)
        from .state_dicts import first_line
        p.error(f"--ckpt: the training state in {ck} does not load ({first_line(e)})")
    return tr


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m qvg.pipelines.world_train", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="state directory (created; resumed when it holds a state)")
    # (the run-only flags default to None so that --export can tell which were given: RUN_DEFAULTS fills them)
    p.add_argument("--minutes", type=float, default=None, help="stop (and save) after this much training (default 8)")
    p.add_argument("--export", default=None, help="write the shippable model here from the state and exit")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--attention", default=None, choices=("auto", "flex", "dense"), help="default auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA)")
    p.add_argument("--max-steps", type=integer, default=None, help="stop after this many steps in this run")
    p.add_argument("--save-every", type=integer, default=None,
                   help="also save the state every this many steps (default 200; 0: only at the end)")
    p.add_argument("--init", default=None, help="a new run starts from this exported model's weights (fine-tune)")
    p.add_argument("--world-rope", action="store_true", help="a new run: world-coordinate spatial RoPE")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=integer if isinstance(v, int) else float, default=None,
                       help=f"default {v}")
    a = p.parse_args(argv)
    for k, (low, high) in RANGES.items():
        v = getattr(a, k)
        finite = v is not None and (isinstance(v, int) or math.isfinite(v) or k in UNBOUNDED and v == math.inf)
        if v is not None and not (finite and low <= v <= high and (k not in POSITIVE or v > 0)):
            p.error(f"--{k.replace('_', '-')} must be {'> 0' if k in POSITIVE else f'>= {low}'}"
                    + (f" and <= {high}" if high < math.inf else "") + f", got {v}")
    given = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k) is not None}
    if not a.ckpt.strip():  # ('' trained into the current folder)
        p.error("--ckpt: empty: give the folder a run saves its state in")
    if a.export is not None:  # ('' was taken as no --export: it trained instead)
        extra = list(given) + [k for k in ("init", "world_rope", *RUN_FLAGS)
                               if getattr(a, k) is not None and getattr(a, k) is not False]  # (0 is given too)
        if extra:  # (training flags would change nothing but the card's record; run flags nothing at all)
            flags = ", ".join("--" + k.replace("_", "-") for k in extra)
            p.error(f"--export writes the state's model as trained; drop {flags}")
        bad = folder_error(a.export, ("model.safetensors", "config.json"))  # (a file there was a traceback)
        if bad:
            p.error(f"--export: {bad}")
        meta = _state_meta(Path(a.ckpt))
        if meta is None:
            p.error(f"--export: {a.ckpt} holds no readable training state (state.json); give a --ckpt a run saved")
        tr = _loaded(p, lambda: Trainer(meta["args"], meta["config"], "cpu", attention="dense"), a.ckpt)
        card = {"steps": tr.step, "seconds": tr.elapsed, "args": tr.args, "final_log": tr.log[-3:]}
        for k in ("init", "setting_changes", "runs"):  # (runs: each training run's argv, commit and date)
            if k in meta:
                card[k] = meta[k]
        card["exported"] = {"commit": code_commit(), "date": _now()}
        cfg = dict(tr.cfg, context_sigma=DEFAULT_CONFIG["context_sigma"])  # a sampler setting, chosen after training
        save_world(tr.model, cfg, a.export, card=card)
        print(f"exported step {tr.step} to {a.export}")
        return 0
    for k, v in RUN_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, v() if callable(v) else v)
    from ..app.generate import parser_device  # (qvg-generate's check: cpu or an existing cuda[:N])
    a.device = parser_device(p, a.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    ck = Path(a.ckpt)
    if ck.exists() and not ck.is_dir():
        p.error(f"--ckpt: {ck} is a file; give the folder a run saves its state in")
    bad = folder_error(ck)  # (before the work: an unwritable folder was a traceback at the first save)
    if bad:
        p.error(f"--ckpt: {bad}")
    meta = _state_meta(ck) if (ck / "state.json").exists() else {}
    if meta is None:
        p.error(f"--ckpt: {ck}/state.json cannot be read as a training state; resume from a --ckpt a run saved, or "
                "start a new run in another folder")
    init = None  # a new fine-tune: the model it starts from, whose config the run takes (world_rope included)
    if not meta and a.init:
        from .world_model import load_world
        try:
            init = load_world(a.init, device="cpu")
        except (OSError, KeyError, ValueError, RuntimeError) as e:  # (WorldModelError is a ValueError)
            from .state_dicts import first_line
            p.error(f"--init: {a.init} is no model this run can start from ({first_line(e)})")
    if meta:  # a resumed run keeps the config its state was saved with
        cfg = dict(DEFAULT_CONFIG, **meta["config"])
    else:
        cfg = dict(DEFAULT_CONFIG, **({k: v for k, v in init[1].items() if k != "training"} if init else {}))
        cfg["world_rope"] = bool(a.world_rope or cfg.get("world_rope", False))
    if a.world_rope and not cfg["world_rope"]:
        p.error(f"--world-rope: the state in {ck} was trained without world-coordinate RoPE")
    if meta and a.init and not _same_init(a.init, meta.get("init")):
        p.error(f"--init: {ck} already holds a training state (step {meta.get('step', '?')}) that did not start from "
                f"{a.init}; start a fine-tune in a new --ckpt directory")
    args = {**DEFAULTS, **meta.get("args", {}), **given}  # (a resumed run: its saved settings, then the flags)
    if args["rollout_fraction"] > 0 and args["chunks"] < 3:
        p.error(f"--rollout-fraction {args['rollout_fraction']:g} needs --chunks >= 3 (chunks 1 .. chunks - 2 are the "
                f"rolled-out context), got {args['chunks']}")
    tr = Trainer(args, cfg, a.device, attention=a.attention)
    resumed = bool(meta)
    if resumed:
        _loaded(p, lambda: tr, ck)
    if init:
        tr.init_from(a.init, init)
    saved = dict(DEFAULTS, **meta.get("args", {}))
    changed = {k: [saved[k], v] for k, v in given.items() if saved[k] != v} if resumed else {}
    if changed:  # applied, said, and kept with the state (and the exported model's card)
        tr.setting_changes.append({"step": tr.step, "settings": changed})
        print(f"world_train: resumed at step {tr.step} with changed settings: "
              + ", ".join(f"{k} {o} -> {n}" for k, (o, n) in changed.items()) + " (recorded in state.json)",
              file=sys.stderr, flush=True)
    tr.runs.append({"step": tr.step, "argv": sys.argv[1:] if argv is None else list(argv), "commit": code_commit(),
                    "date": _now()})
    if a.compile:
        tr.compile()
    print(f"{'resumed at step ' + str(tr.step) if resumed else 'new run'}; {json.dumps(tr.args)}", flush=True)
    data = WorldData(tr.args["seed"] * 1000003 + tr.step, tr.args["chunks"], tr.cfg, "train", a.device,
                     revisit=tr.args["revisit_fraction"])
    tr.train(data, a.minutes, max_steps=a.max_steps, save_every=a.save_every, save_to=ck)
    tr.save(ck)
    print(f"saved step {tr.step} ({tr.elapsed:.0f} s of training) to {ck}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
