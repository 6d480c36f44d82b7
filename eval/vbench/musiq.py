"""MUSIQ (Ke et al. 2021, "MUSIQ: Multi-scale Image Quality Transformer") as pyiqa builds it (chaofengc/IQA-PyTorch,
`pyiqa/archs/musiq_arch.py`, the model VBench's imaging_quality runs), in pure torch and under pyiqa's parameter
names, so that pyiqa's checkpoints load with strict key checking. Checked against pyiqa's own module:
`qvg.eval.musiq_parity`.

The forward pass of images [N, 3, H, W] in [0, 1] (pyiqa's evaluation path):

1. x = (x - 0.5) * 2.
2. Multi-scale patches: the image resized to longer side 224 and to 384 (bicubic, align_corners=False, no
   antialiasing; sizes round(h * L / max(h, w)), round(w * L / max(h, w))), and the image itself. Each is zero
   padded TF-"SAME"-style to whole 32 x 32 patches (the odd pixel on the right / bottom) and cut into patches,
   row-major, each flattened channel-first. Every patch carries a hashed position: its row and column mapped onto
   a 10 x 10 grid by torch's nearest-neighbour interpolation of 0..9 (index row * 10 + column), and a scale index
   (0: 224, 1: 384, 2: the image). The two resized scales are padded with all-zero patches (position 0, scale 0,
   masked) to ceil(L / 32)^2 patches; the image keeps all of its own.
3. Each patch through a ResNet root: weight-standardised 7x7 stride-2 conv (64 channels; w -> (w - mean) /
   (std + 1e-5) per output filter, unbiased std; SAME padding), GroupNorm(32, eps 1e-6), ReLU, SAME-padded 3x3
   stride-2 max pool, one bottleneck 64 -> 256 (weight-standardised 1x1, 3x3, 1x1 convs, GroupNorm eps 1e-4,
   projection shortcut) -> 8 x 8 x 256, flattened in (row, column, channel) order -> Linear(16384, 384).
4. + position embedding (a 100-row table) at the hashed index + scale embedding at the scale index; a learned CLS
   token in front; 14 pre-LayerNorm transformer blocks (width 384, 6 heads, MLP 1152 with exact GELU, LayerNorm eps
   1e-6) in which an attention logit between a masked token and any other is replaced by -1000; a final LayerNorm.
5. The head on the CLS token. SPAQ's (the checkpoint VBench uses, `musiq_spaq_ckpt-358bb6af.pth`): Linear(384, 1),
   whose output is the score, a mean opinion score on SPAQ's 0..100 scale. With C > 1 classes (AVA's 10), a softmax
   over C then the expected class, sum_i i * p_i.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..weights import BadWeights, read_state_dict, weight_path

ROOT_WIDTH = 64  # channels of the ResNet root (GroupNorm's 32 groups need it)


def same_pad(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """TensorFlow "SAME" zero padding of [N, C, H, W] for a square kernel: the extra pixel goes right / bottom."""
    pads = []
    for n in (x.shape[-1], x.shape[-2]):
        total = (math.ceil(n / stride) - 1) * stride + kernel - n
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class StdConv(nn.Conv2d):
    """Weight-standardised convolution with SAME padding (MUSIQ's are bias-free)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        w = w / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(same_pad(x, self.kernel_size[0], self.stride[0]), w, self.bias, self.stride)


def _conv_gn(cin: int, cout: int, kernel: int, eps: float = 1e-4) -> tuple[nn.Module, nn.Module]:
    return StdConv(cin, cout, kernel, 1, bias=False), nn.GroupNorm(32, cout, eps=eps)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1, self.gn1 = _conv_gn(cin, cin, 1)
        self.conv2, self.gn2 = _conv_gn(cin, cin, 3)
        self.conv3, self.gn3 = _conv_gn(cin, cout, 1)
        self.conv_proj, self.gn_proj = _conv_gn(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.gn_proj(self.conv_proj(x))
        x = F.relu(self.gn1(self.conv1(x)))
        x = F.relu(self.gn2(self.conv2(x)))
        return F.relu(self.gn3(self.conv3(x)) + skip)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = (f(x).view(n, length, self.heads, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        logits = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
        pair = keep[:, None, :, None] & keep[:, None, None, :]
        y = logits.masked_fill(~pair, -1e3).softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(n, length, dim))


class Block(nn.Module):
    def __init__(self, dim: int, mlp_dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attention = Attention(dim, heads)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, mlp_dim), "fc2": nn.Linear(mlp_dim, dim)})

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), keep)
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, dim: int, mlp_dim: int, heads: int, layers: int, scales: int, grid: int):
        super().__init__()
        self.posembed_input = nn.ParameterDict({"position_emb": nn.Parameter(torch.randn(1, grid * grid, dim) * .02)})
        self.scaleembed_input = nn.ParameterDict({"scale_emb": nn.Parameter(torch.randn(scales, dim) * .02)})
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder_norm = nn.LayerNorm(dim, eps=1e-6)
        self.transformer = nn.ModuleDict({f"encoderblock_{i}": Block(dim, mlp_dim, heads) for i in range(layers)})

    def forward(self, x, position, scale, keep) -> torch.Tensor:
        x = x + self.posembed_input["position_emb"][0][position]
        x = x + self.scaleembed_input["scale_emb"][scale]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        keep = torch.cat([keep.new_ones(x.shape[0], 1), keep], 1)
        for block in self.transformer.values():
            x = block(x, keep)
        return self.encoder_norm(x)


def hashed_positions(rows: int, cols: int, grid: int) -> torch.Tensor:
    """[rows * cols] indices into the grid x grid position table, row-major."""
    ramp = torch.arange(grid, dtype=torch.float32).view(1, 1, grid)
    r, c = (F.interpolate(ramp, size=n, mode="nearest").view(-1).long() for n in (rows, cols))
    return (r[:, None] * grid + c[None, :]).reshape(-1)


def _scale_tokens(x: torch.Tensor, p: int, grid: int, scale: int, length: int | None) -> list[torch.Tensor]:
    """One scale's (patches [N, L, C p p], position [N, L], scale [N, L], keep [N, L]); zero-padded (or cut) to
    `length` patches unless it is None."""
    x = same_pad(x, p, p)
    n, c, h, w = x.shape
    rows, cols = h // p, w // p
    patches = x.reshape(n, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(n, rows * cols, c * p * p)
    position = hashed_positions(rows, cols, grid).to(x.device).expand(n, -1)
    out = [patches, position, torch.full_like(position, scale), torch.ones_like(position, dtype=torch.bool)]
    if length is not None:
        extra = length - rows * cols
        out = [t[:, :length] if extra <= 0 else torch.cat([t, t.new_zeros(n, extra, *t.shape[2:])], 1) for t in out]
    return out


def multiscale_patches(x: torch.Tensor, patch_size: int = 32, grid: int = 10, longer_side_lengths=(224, 384)):
    """Images [N, 3, H, W] (already in [-1, 1]) -> (patches [N, L, 3 p p], position index [N, L], scale index
    [N, L], keep mask [N, L] bool): the resized scales (shortest first), then the image itself."""
    h, w = x.shape[-2:]
    parts = []
    for scale, side in enumerate(sorted(longer_side_lengths)):
        r = side / max(h, w)
        y = F.interpolate(x, size=(round(h * r), round(w * r)), mode="bicubic", align_corners=False)
        parts.append(_scale_tokens(y, patch_size, grid, scale, math.ceil(side / patch_size) ** 2))
    parts.append(_scale_tokens(x, patch_size, grid, len(longer_side_lengths), None))
    return tuple(torch.cat(t, 1) for t in zip(*parts))


class MUSIQ(nn.Module):
    """MUSIQ; the defaults are the SPAQ checkpoint's configuration (VBench builds pyiqa's MUSIQ with them).
    forward(images [N, 3, H, W] in [0, 1]) -> scores [N]."""

    def __init__(self, patch_size: int = 32, num_class: int = 1, hidden_size: int = 384, mlp_dim: int = 1152,
                 num_heads: int = 6, num_layers: int = 14, spatial_pos_grid_size: int = 10,
                 longer_side_lengths=(224, 384)):
        super().__init__()
        self.patch_size, self.grid = patch_size, spatial_pos_grid_size
        self.longer_side_lengths = tuple(longer_side_lengths)
        self.conv_root = StdConv(3, ROOT_WIDTH, 7, 2, bias=False)
        self.gn_root = nn.GroupNorm(32, ROOT_WIDTH, eps=1e-6)
        self.block1 = Bottleneck(ROOT_WIDTH, 4 * ROOT_WIDTH)
        self.embedding = nn.Linear(4 * ROOT_WIDTH * (patch_size // 4) ** 2, hidden_size)
        self.transformer_encoder = Encoder(hidden_size, mlp_dim, num_heads, num_layers,
                                           len(self.longer_side_lengths) + 1, spatial_pos_grid_size)
        head = nn.Linear(hidden_size, num_class)
        self.head = head if num_class == 1 else nn.Sequential(head, nn.Softmax(-1))

    def embed_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, L, 3 p p] -> [N, L, hidden]: the ResNet root on every patch, then the linear embedding."""
        n, length, _ = patches.shape
        x = patches.reshape(n * length, 3, self.patch_size, self.patch_size)
        x = F.relu(self.gn_root(self.conv_root(x)))
        x = self.block1(F.max_pool2d(same_pad(x, 3, 2), 3, 2))
        return self.embedding(x.permute(0, 2, 3, 1).reshape(n, length, -1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches, position, scale, keep = multiscale_patches((images - 0.5) * 2, self.patch_size, self.grid,
                                                            self.longer_side_lengths)
        cls = self.transformer_encoder(self.embed_patches(patches), position, scale, keep)[:, 0]
        q = self.head(cls)
        return (q * torch.arange(1, q.shape[-1] + 1, dtype=q.dtype, device=q.device)).sum(-1)


def check_keys(own: dict, got: dict, source: str, what: str) -> None:
    """BadWeights (a ValueError, one line) unless `got` has exactly `own`'s keys, with the same shapes."""
    missing, unexpected = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    bad = sorted(k for k in own if k in got and tuple(got[k].shape) != tuple(own[k].shape))
    if missing or unexpected or bad:
        raise BadWeights(f"{source}: not {what} (missing: {', '.join(missing[:4]) or '-'}; unexpected: "
                         f"{', '.join(unexpected[:4]) or '-'}; wrong shape: {', '.join(bad[:4]) or '-'})")


def load_musiq(weights=None, device="cpu", config: dict | None = None) -> MUSIQ:
    """pyiqa's MUSIQ-SPAQ from the weights folder's musiq_spaq_ckpt-358bb6af.pth (`qvg.eval.weights`; keys checked
    strictly, a "module." prefix dropped as pyiqa does; a file that is not that checkpoint: BadWeights naming it);
    config= builds MUSIQ(**config) with random weights."""
    if config is not None:
        return MUSIQ(**config).eval().to(device)
    p = weight_path("musiq", weights)
    sd = {k.removeprefix("module."): v for k, v in read_state_dict(p).items()}
    model = MUSIQ()
    check_keys(model.state_dict(), sd, str(p), "pyiqa's MUSIQ-SPAQ checkpoint")
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    model.weight_files = [p]
    return model.eval().to(device)
