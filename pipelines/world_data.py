"""Training and evaluation data for the embedded world model, generated on the fly: camera trajectories over a
large image (a bundled photo, assets/photos/, or a procedural texture), rendered as 64 x 64 views.

A camera is (x, y, z): the view's centre in canvas pixels and its scale (canvas pixels per view pixel). Per frame
an action moves it: left/right/up/down by `pan_pixels` view pixels (pan_pixels * z canvas pixels), zoom_in /
zoom_out divide / multiply z by `zoom_factor`. A trajectory holds one action per chunk; the first chunk is the
start view, still ("stay"). A share of the trajectories (WorldData's `revisit`; 70% in training) are revisits: go somewhere for m chunks and come straight back,
so the returning views are exactly views seen m chunks earlier (the model must use its long memory).
Views are rendered with 2x supersampling (bilinear at 128 x 128, then 2 x 2 mean), so zooming out does not alias.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from .world_model import ACTIONS, DEFAULT_CONFIG, MOVES

PHOTO_DIR = Path(__file__).resolve().parent.parent / "assets" / "photos"
HELD_OUT = ("coffee", "camera")  # never in training (assets/build_photos.py)
PHOTO_SHORT_SIDE = 384  # pixels: the bundled photos' most common short side (they range from 147 to 384)
Z_RANGE = (0.5, 2.2)  # camera scale limits (canvas pixels per view pixel)
REVERSE = {"left": "right", "right": "left", "up": "down", "down": "up", "zoom_in": "zoom_out",
           "zoom_out": "zoom_in"}


def photo_names(split: str = "train") -> list[str]:
    names = sorted(p.stem for p in PHOTO_DIR.glob("*.png"))
    if split == "all":
        return names
    held = [n for n in names if n in HELD_OUT]
    return held if split == "eval" else [n for n in names if n not in HELD_OUT]


@lru_cache(maxsize=None)
def _photo_cpu(name: str) -> torch.Tensor:
    import imageio.v2 as imageio
    path = PHOTO_DIR / f"{name}.png"
    if not path.is_file():
        raise ValueError(f"no bundled photo {name!r}; choose from: {', '.join(photo_names('all'))}")
    a = torch.from_numpy(imageio.imread(path)[..., :3].copy())
    return a.permute(2, 0, 1).float() / 127.5 - 1.0


def load_photo(name: str, device="cpu") -> torch.Tensor:
    """A bundled photo as a canvas [3, H, W] in [-1, 1]."""
    return _photo_cpu(name).to(device)


def procedural_canvas(gen: torch.Generator, size=(256, 320), device="cpu") -> torch.Tensor:
    """A random texture [3, H, W] in [-1, 1]: smooth colour noise, then random filled discs and rectangles."""
    h, w = size
    base = torch.rand(1, 3, 3 + int(torch.randint(0, 6, (1,), generator=gen)), 4 + int(torch.randint(0, 6, (1,),
                      generator=gen)), generator=gen) * 2 - 1
    img = F.interpolate(base, size=(h, w), mode="bicubic", align_corners=False)[0].clamp(-1, 1)
    yy, xx = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    for _ in range(int(torch.randint(6, 20, (1,), generator=gen))):
        c = torch.rand(3, generator=gen) * 2 - 1
        cy, cx = float(torch.rand(1, generator=gen)) * h, float(torch.rand(1, generator=gen)) * w
        r = 6 + float(torch.rand(1, generator=gen)) * 40
        if float(torch.rand(1, generator=gen)) < 0.5:
            m = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
        else:
            m = ((yy - cy).abs() < r) & ((xx - cx).abs() < r * (0.3 + 1.4 * float(torch.rand(1, generator=gen))))
        img[:, m] = c[:, None]
    return img.to(device)


@dataclass
class Camera:
    x: float
    y: float
    z: float

    def moved(self, action: str, pan: float, zoom: float) -> "Camera":
        if action in MOVES:
            dx, dy = MOVES[action]
            return Camera(self.x + dx * pan * self.z, self.y + dy * pan * self.z, self.z)
        if action == "zoom_in":
            return Camera(self.x, self.y, self.z / zoom)
        if action == "zoom_out":
            return Camera(self.x, self.y, self.z * zoom)
        return Camera(self.x, self.y, self.z)

    def inside(self, h: int, w: int, size: int) -> bool:
        half = self.z * size / 2
        return (Z_RANGE[0] <= self.z <= Z_RANGE[1] and half <= self.x <= w - half and half <= self.y <= h - half)


def cameras_for(start: Camera, actions: list[str], chunk_frames: int, cfg: dict = DEFAULT_CONFIG) -> list[Camera]:
    """One camera per frame: the start chunk is still, then each chunk's action applies once per frame."""
    cams = [start] * chunk_frames
    cam = start
    for a in actions[1:]:
        for _ in range(chunk_frames):
            cam = cam.moved(a, cfg["pan_pixels"], cfg["zoom_factor"])
            cams.append(cam)
    return cams


def _valid(cam: Camera, action: str, times: int, hw, cfg) -> bool:
    for _ in range(times):
        cam = cam.moved(action, cfg["pan_pixels"], cfg["zoom_factor"])
        if not cam.inside(*hw, cfg["frame_size"]):
            return False
    return True


def random_trajectory(rng: random.Random, hw: tuple[int, int], chunks: int, cfg: dict = DEFAULT_CONFIG,
                      revisit: bool | None = None) -> tuple[Camera, list[str]]:
    """(start camera, one action per chunk; the first is 'stay') inside a canvas of size hw. chunks counts the
    start chunk. revisit: go m chunks one way and come back (None: at random, half the time)."""
    h, w = hw
    size, cf = cfg["frame_size"], cfg["chunk_frames"]
    zmax = min(Z_RANGE[1], 0.98 * min(h, w) / size)
    z = min(zmax, rng.uniform(0.75, 1.6))
    half = z * size / 2
    start = Camera(rng.uniform(half, w - half), rng.uniform(half, h - half), z)
    acts = ["stay"]
    cam = start

    def step(action):
        nonlocal cam
        for _ in range(cf):
            cam = cam.moved(action, cfg["pan_pixels"], cfg["zoom_factor"])
        acts.append(action)

    def random_steps(n):
        prev = acts[-1]
        for _ in range(n):
            want = prev if rng.random() < 0.6 and prev != "stay" else rng.choice(ACTIONS)
            if not _valid(cam, want, cf, hw, cfg):
                want = rng.choice([a for a in ACTIONS if _valid(cam, a, cf, hw, cfg)])  # "stay" always is
            step(want)
            prev = want

    gen_chunks = chunks - 1
    if gen_chunks >= 4 and (revisit if revisit is not None else rng.random() < 0.5):
        m = rng.randint(2, gen_chunks // 2)
        random_steps(rng.randint(0, gen_chunks - 2 * m))
        dirs = list(REVERSE)
        rng.shuffle(dirs)
        for mm in range(m, 0, -1):  # the longest excursion some direction allows from here
            ok = [d for d in dirs if _valid(cam, d, mm * cf, hw, cfg)]
            if ok:
                for a in [ok[0]] * mm + [REVERSE[ok[0]]] * mm:
                    step(a)
                break
    random_steps(chunks - len(acts))
    return start, acts


def render(canvas: torch.Tensor, cams: list[Camera], size: int = 64) -> torch.Tensor:
    """canvas [3, H, W] -> views [3, frames, size, size], 2x supersampled."""
    h, w = canvas.shape[-2:]
    n = 2 * size
    t = (torch.arange(n, device=canvas.device, dtype=torch.float32) + 0.5) / n - 0.5  # [-0.5, 0.5) of the view
    cam = torch.tensor([[c.x, c.y, c.z] for c in cams], device=canvas.device, dtype=torch.float32)
    px = cam[:, 0, None] + t[None] * cam[:, 2, None] * size  # canvas x per output column [frames, n]
    py = cam[:, 1, None] + t[None] * cam[:, 2, None] * size
    gx = (2 * px / w - 1)[:, None, :].expand(-1, n, -1)
    gy = (2 * py / h - 1)[:, :, None].expand(-1, -1, n)
    grid = torch.stack([gx, gy], -1)
    out = F.grid_sample(canvas[None].expand(len(cams), -1, -1, -1), grid, mode="bilinear", padding_mode="border",
                        align_corners=False)
    return F.avg_pool2d(out, 2).permute(1, 0, 2, 3)


def centre_view(canvas: torch.Tensor, size: int = DEFAULT_CONFIG["frame_size"], z: float = 1.0) -> torch.Tensor:
    """The view [3, size, size] at the canvas's centre, at scale z (the start frame for a bundled photo)."""
    h, w = canvas.shape[-2:]
    return render(canvas, [Camera(w / 2, h / 2, z)], size)[:, 0]


MAX_ASPECT = 4  # photo_view cuts longer photos to 4:1 around the centre (the bundled photos are at most 2.6:1)


def photo_view(image: torch.Tensor, size: int = DEFAULT_CONFIG["frame_size"]) -> torch.Tensor:
    """A user's photo [3, H, W] in [-1, 1] -> its start frame [3, size, size] at the scale the model was trained
    at: the photo is scaled so its short side is PHOTO_SHORT_SIDE pixels (the bundled photos' most common), and the
    view at its centre at scale 1 is cut (squeezing a whole photo into 64 px gives a far wider view than any in
    training). A photo longer than MAX_ASPECT times its short side is cut to that around its centre first (the
    view needs only the centre; a 16 x 32,000 strip scaled whole took gigabytes)."""
    if not isinstance(image, torch.Tensor) or image.dim() != 3 or image.shape[0] != 3:
        got = list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"a photo must be a tensor [3, H, W] (channels first), got {got}")
    h, w = image.shape[-2:]
    cap = MAX_ASPECT * min(h, w)
    if h > cap:
        image = image[:, (h - cap) // 2:(h - cap) // 2 + cap]
    if w > cap:
        image = image[:, :, (w - cap) // 2:(w - cap) // 2 + cap]
    h, w = image.shape[-2:]
    f = PHOTO_SHORT_SIDE / min(h, w)
    hw = (max(size, round(h * f)), max(size, round(w * f)))
    x = image[None].float()
    x = F.interpolate(x, size=hw, mode="area") if f < 1 else F.interpolate(x, size=hw, mode="bilinear",
                                                                              align_corners=False)
    return centre_view(x[0].clamp(-1, 1), size)


def augment(canvas: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Flips, channel permutation, contrast / brightness and a tint for grey images."""
    if rng.random() < 0.5:
        canvas = canvas.flip(-1)
    if rng.random() < 0.2:
        canvas = canvas.flip(-2)
    if rng.random() < 0.3:
        perm = list(range(3))
        rng.shuffle(perm)
        canvas = canvas[perm]
    c, b = rng.uniform(0.75, 1.2), rng.uniform(-0.15, 0.15)
    canvas = canvas * c + b
    if (canvas[0] - canvas[1]).abs().max() < 1e-3 and rng.random() < 0.5:  # grey: tint it
        tint = torch.tensor([rng.uniform(0.6, 1.0) for _ in range(3)], device=canvas.device)
        canvas = (canvas + 1) * tint[:, None, None] - 1
    return canvas.clamp(-1, 1)


class WorldData:
    """Batches of (frames [B, 3, F, S, S] in [-1, 1], actions [B, chunks] as ids) from a seeded stream.
    split 'train': the training photos + procedural textures; 'eval': the held-out photos (no augmentation).
    revisit: True / False for every sequence, a fraction, or None (half)."""

    def __init__(self, seed: int, chunks: int, cfg: dict = DEFAULT_CONFIG, split: str = "train", device="cpu",
                 procedural: float = 0.25, revisit: bool | float | None = None):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.chunks, self.cfg, self.split, self.device = chunks, cfg, split, device
        self.photos = photo_names(split)
        self.procedural = procedural if split == "train" else 0.0
        self.revisit = revisit

    def canvas(self) -> torch.Tensor:
        if self.rng.random() < self.procedural:
            return procedural_canvas(self.gen, device=self.device)
        c = load_photo(self.rng.choice(self.photos), self.device)
        return augment(c, self.rng) if self.split == "train" else c

    def sample(self):
        """One sequence: (frames [3, F, S, S], action ids [chunks], start camera, canvas)."""
        canvas = self.canvas()
        rv = self.revisit
        if isinstance(rv, float):  # a fraction of the sequences
            rv = self.rng.random() < rv
        start, acts = random_trajectory(self.rng, tuple(canvas.shape[-2:]), self.chunks, self.cfg, rv)
        cams = cameras_for(start, acts, self.cfg["chunk_frames"], self.cfg)
        frames = render(canvas, cams, self.cfg["frame_size"])
        ids = torch.tensor([self.cfg["actions"].index(a) for a in acts])
        return frames, ids, start, canvas

    def batch(self, size: int):
        items = [self.sample()[:2] for _ in range(size)]
        return torch.stack([f for f, _ in items]), torch.stack([a for _, a in items]).to(self.device)
