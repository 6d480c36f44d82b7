"""3D rotary position embedding in Wan2.1's layout (Self-Forcing's keys are cached after it).

The head dim D is split into a temporal band of D - 4 * (D // 6) channels and two spatial bands (height, width)
of 2 * (D // 6) each (D = 128: 44 + 42 + 42). Each band rotates consecutive channel pairs (2j, 2j + 1) by
position * theta^(-2j / band). The tables are factorized: one per axis, combined per token, so they cost
O((T + H + W) * D) memory, not O(N * D). RoPE is a rotation per pair: it preserves norms, so an error made before
it has the same size after it.
"""
from __future__ import annotations

import torch


def bands(head_dim: int) -> tuple[int, int, int]:
    s = head_dim // 6
    return head_dim - 4 * s, 2 * s, 2 * s


def axis_angles(positions: torch.Tensor, band: int, theta: float = 10000.0) -> torch.Tensor:
    """[P] positions -> [P, band / 2] rotation angles (float64, on the positions' device)."""
    inv = theta ** (-torch.arange(0, band, 2, dtype=torch.float64, device=positions.device) / band)
    return positions.double()[:, None] * inv[None, :]


def grid_angles(frames: int, height: int, width: int, head_dim: int, t0: int = 0,
                theta: float = 10000.0) -> torch.Tensor:
    """Angles [frames * height * width, D / 2] for tokens in T x H x W order starting at frame t0 (screen
    coordinates: `frame_angles` with zero offsets)."""
    pos = torch.zeros(1, frames, 3, dtype=torch.long)
    pos[0, :, 0] = torch.arange(t0, t0 + frames)
    return frame_angles(pos, height, width, head_dim, theta)[0]


def frame_angles(positions: torch.Tensor, height: int, width: int, head_dim: int,
                 theta: float = 10000.0) -> torch.Tensor:
    """Angles [B, F * height * width, D / 2] (float64) of the tokens of F frames per sample, frame f of sample b at
    time positions[b, f, 0] with its rows and columns offset by positions[b, f, 1:] = (dy, dx): token (i, j) sits
    at row dy + i, column dx + j (the causal Wan model's `frame_ids` / `spatial_offsets`; zero offsets: screen
    coordinates, as `grid_angles`). positions: integer [B, F, 3]; computed on its device."""
    if positions.dim() != 3 or positions.shape[-1] != 3 or positions.is_floating_point():
        raise ValueError(f"positions must be an integer tensor [B, F, 3] (t, dy, dx per frame), got "
                         f"{positions.dtype} {list(positions.shape)}")
    bt, bh, bw = bands(head_dim)
    b, f, _ = positions.shape
    p = positions.double()
    at = axis_angles(p[..., 0].reshape(-1), bt, theta).view(b, f, 1, 1, -1)
    rows = p[..., 1:2] + torch.arange(height, dtype=torch.float64, device=p.device)  # [B, F, H]
    cols = p[..., 2:3] + torch.arange(width, dtype=torch.float64, device=p.device)
    ah = axis_angles(rows.reshape(-1), bh, theta).view(b, f, height, 1, -1)
    aw = axis_angles(cols.reshape(-1), bw, theta).view(b, f, 1, width, -1)
    shape = (b, f, height, width)
    return torch.cat([at.expand(*shape, -1), ah.expand(*shape, -1), aw.expand(*shape, -1)], -1).reshape(
        b, f * height * width, -1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate channel pairs of x [..., N, D] by angles [N, D / 2] (or back, with inverse=True); float32 out."""
    a = -angles if inverse else angles
    cos, sin = a.cos().float(), a.sin().float()
    xe, xo = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([xe * cos - xo * sin, xe * sin + xo * cos], -1).flatten(-2)


class RopeTables:
    """Factorized RoPE for keys stored before RoPE and rotated on read (by `PackedSequence.decompress` or the
    dequant kernel). Token n of a packed sequence of chunks with L = frames * height * width tokens sits at frame
    `frame0[n // L] + local // (height * width)`, row `(local // width) % height`, column `local % width`
    (local = n % L). `table` [2, R, D / 2] float32 holds cos then sin of position x frequency for R = T + H + W
    positions: rows [0, T) frames, [T, T + H) rows, [T + H, R) columns; channel pair j reads the axis of its band."""

    def __init__(self, height: int, width: int, head_dim: int, frame0: torch.Tensor, max_frames: int,
                 theta: float = 10000.0):
        bt, bh, bw = bands(head_dim)
        self.height, self.width, self.head_dim = height, width, head_dim
        self.frame0 = frame0.to(torch.int32)
        self.max_frames = max_frames
        self.split = (bt // 2, (bt + bh) // 2)  # pair index where the h band, then the w band, starts
        ang = torch.zeros(max_frames + height + width, head_dim // 2, dtype=torch.float64)
        ang[:max_frames, :bt // 2] = axis_angles(torch.arange(max_frames), bt, theta)
        ang[max_frames:max_frames + height, bt // 2:(bt + bh) // 2] = axis_angles(torch.arange(height), bh, theta)
        ang[max_frames + height:, (bt + bh) // 2:] = axis_angles(torch.arange(width), bw, theta)
        self.table = torch.stack([ang.cos(), ang.sin()]).float().to(frame0.device)

    def angles(self, chunk_len: int) -> torch.Tensor:
        """[C * chunk_len, D / 2] angles of every token (the reference path)."""
        frames = chunk_len // (self.height * self.width)
        return torch.cat([grid_angles(frames, self.height, self.width, self.head_dim, t0=int(f))
                          for f in self.frame0.tolist()])
