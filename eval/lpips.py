"""LPIPS (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric", v0.1) in pure
torch: no torchvision, no lpips import (neither imports with this project's CPU torch).

Definition, as the lpips package computes it (checked against richzhang/PerceptualSimilarity, v0.1):
  1. inputs in [-1, 1]; the scaling layer maps them to the backbone's ImageNet statistics:
     x' = (x - shift) / scale, shift = (-0.030, -0.088, -0.188), scale = (0.458, 0.448, 0.450) per RGB channel;
  2. features at five ReLU outputs of the backbone: AlexNet `features[1, 4, 7, 9, 11]` (channels 64, 192, 384,
     256, 256), VGG16 `features[3, 8, 15, 22, 29]` (relu1_2 .. relu5_3: 64, 128, 256, 512, 512);
  3. each feature map is unit-normalised over channels per position: f / (sqrt(sum_c f^2) + 1e-10);
  4. d_l = (f0 - f1)^2, weighted over channels by the learned non-negative 1x1 conv (no bias) `lin_l`, then
     averaged over the spatial positions (`spatial_average`); LPIPS = sum over the five layers.

Weights (local files, `qvg.eval.weights`): the backbone is torchvision's file, read with torchvision's key names
(`features.{i}.weight` / `.bias`; the classifier keys are ignored): alexnet-owt-7be5be79.pth or
vgg16-397923af.pth; the linear layers are the lpips package's weights/v0.1/{alex,vgg}.pth (keys
`lin{l}.model.1.weight`, [1, C_l, 1, 1]), put under the weights folder as lpips/alex.pth and lpips/vgg.pth.

Parity (`python -m qvg.eval.lpips_parity`, eval/results/lpips-parity-cpu.json): against the lpips package's own
LPIPS (0.1.4, loaded from its files, with its shipped v0.1 lin weights and the same random backbone), alex and vgg
agree on CPU to 1.5e-8 in the distance and 1.9e-9 in each per-layer term, on random pairs (64 x 64 to 257 x 311)
and on scikit-image photos against noisy, blurred and shifted copies; the backbone's layer definition itself is
checked by loading torchvision's key names and shapes, not by that comparison.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .weights import BadWeights, read_state_dict, weight_paths

SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
NETS = {
    # net: (ReLU indices tapped in `features`, their channels, backbone weight key, linear weight key)
    "alex": ((1, 4, 7, 9, 11), (64, 192, 384, 256, 256), "alexnet", "lpips-alex"),
    "vgg": ((3, 8, 15, 22, 29), (64, 128, 256, 512, 512), "vgg16", "lpips-vgg"),
}
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def alexnet_features() -> nn.Sequential:
    """torchvision's `alexnet().features` layer for layer (same indices, so the same state-dict keys)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(inplace=False), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=False), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=False),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=False),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=False), nn.MaxPool2d(3, 2))


def vgg16_features() -> nn.Sequential:
    """torchvision's `vgg16().features` (configuration "D", no batch norm), layer for layer."""
    layers, c = [], 3
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=False)]
            c = v
    return nn.Sequential(*layers)


class LPIPS(nn.Module):
    """LPIPS v0.1 distance of image batches in [-1, 1]: forward(a, b) -> [N] (a, b [N, 3, H, W])."""

    def __init__(self, net: str = "alex"):
        super().__init__()
        if net not in NETS:
            raise ValueError(f"LPIPS net must be one of {', '.join(NETS)}, got {net!r}")
        self.net = net
        self.taps, chans, _, _ = NETS[net]
        self.features = alexnet_features() if net == "alex" else vgg16_features()
        self.features = self.features[:self.taps[-1] + 1]  # nothing after the last tapped ReLU is needed
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for c in chans)
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1))
        self.requires_grad_(False)
        self.eval()

    def load_backbone(self, sd: dict, source: str = "backbone") -> None:
        """torchvision's state dict (or just its `features.*` part); strict on the layers used."""
        own = {k: v for k, v in self.features.state_dict().items()}
        got = {k[len("features."):]: v for k, v in sd.items() if k.startswith("features.")}
        missing = sorted(set(own) - set(got))
        bad = sorted(k for k in own if k in got and tuple(got[k].shape) != tuple(own[k].shape))
        if missing or bad:
            raise BadWeights(f"{source}: not torchvision's {self.net} features (missing: "
                             f"{', '.join('features.' + k for k in missing[:4]) or '-'}; wrong shape: "
                             f"{', '.join('features.' + k for k in bad[:4]) or '-'})")
        self.features.load_state_dict({k: got[k].float() for k in own})

    def load_linear(self, sd: dict, source: str = "linear layers") -> None:
        """The lpips package's v0.1 file: lin{l}.model.1.weight (with dropout) or lin{l}.model.0.weight."""
        for i, lin in enumerate(self.lins):
            w = sd.get(f"lin{i}.model.1.weight", sd.get(f"lin{i}.model.0.weight"))
            if w is None or tuple(w.shape) != tuple(lin.weight.shape):
                raise BadWeights(f"{source}: no lin{i}.model.1.weight of shape {list(lin.weight.shape)} "
                                 f"(not the lpips package's v0.1 {self.net}.pth)")
            lin.weight.data.copy_(w.float())

    def layer_distances(self, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        """The five per-layer terms, each [N]."""
        if a.shape != b.shape or a.dim() != 4 or a.shape[1] != 3:
            raise ValueError(f"LPIPS expects two [N, 3, H, W] batches of one shape, got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        if min(a.shape[-2:]) < 32:
            raise ValueError(f"LPIPS needs frames of at least 32 x 32 pixels, got {tuple(a.shape[-2:])}")
        x = (torch.cat([a, b]).float() - self.shift) / self.scale
        out, t = [], 0
        for i, layer in enumerate(self.features):
            x = layer(x)
            if t < len(self.taps) and i == self.taps[t]:
                f = x / (x.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
                f0, f1 = f.chunk(2)
                out.append(self.lins[t]((f0 - f1) ** 2).mean((2, 3))[:, 0])
                t += 1
        return out

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.layer_distances(a, b)).sum(0)


def load_lpips(net: str = "alex", weights=None, device="cpu") -> LPIPS:
    """LPIPS with its backbone and linear weights from the weights folder (`qvg.eval.weights`); raises
    MissingWeights (one line naming the file) when one is not there, BadWeights (one line naming it) when it is not
    the file it should be. `.weight_files`: the two files read."""
    if net not in NETS:
        raise ValueError(f"LPIPS net must be one of {', '.join(NETS)}, got {net!r}")
    _, _, backbone, linear = NETS[net]
    pb, pl = weight_paths([backbone, linear], weights)
    m = LPIPS(net)
    m.load_backbone(read_state_dict(pb), str(pb))
    m.load_linear(read_state_dict(pl), str(pl))
    m.weight_files = [pb, pl]
    return m.to(device)


@torch.no_grad()
def lpips_frames(model: LPIPS, ref: torch.Tensor, test: torch.Tensor, batch: int = 16) -> list[float]:
    """LPIPS per frame of two videos [3, F, H, W] in [-1, 1]."""
    dev = model.shift.device
    a, b = ref.transpose(0, 1), test.transpose(0, 1)  # [F, 3, H, W]
    out = []
    for i in range(0, a.shape[0], batch):
        out += model(a[i:i + batch].to(dev), b[i:i + batch].to(dev)).float().cpu().tolist()
    return out
