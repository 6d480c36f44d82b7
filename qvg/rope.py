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
    dequant kernel). Frame f of slot c of a packed sequence of chunks (L = frames * height * width tokens each) sits
    at time t, with its rows and columns offset by (dy, dx) (as `frame_angles`): `positions[c, f]` = (t, dy, dx),
    or without `positions`, t = `frame0[c] + f` and no offsets. Token (i, j) of that frame sits at row dy + i,
    column dx + j. `table` [2, R, D / 2] float32 holds cos then sin of position x frequency for R = T + H' + W'
    positions: rows [0, T) the times, then the rows' range (H' positions, height plus the offsets' spread), then the
    columns'; channel pair j reads the axis of its band. `kernel_positions(frames)`: per (slot, frame), the table
    rows of its time and of its first row and first column, which the kernels read."""

    def __init__(self, height: int, width: int, head_dim: int, frame0: torch.Tensor, max_frames: int,
                 theta: float = 10000.0, positions: torch.Tensor | None = None):
        bt, bh, bw = bands(head_dim)
        self.height, self.width, self.head_dim = height, width, head_dim
        self.frame0 = frame0.to(torch.int32)
        self.max_frames, self._theta = max_frames, theta
        host = None if positions is None else positions.cpu().to(torch.int32)  # (checked on the host: no GPU sync)
        if host is not None and (host.dim() != 3 or host.shape[2] != 3 or host.shape[0] != self.frame0.numel()
                                 or (host[..., 0] < 0).any() or int(host[..., 0].max()) >= max_frames):
            raise ValueError("positions must be [slots, frames, 3] (t, dy, dx), a slot per frame0 entry, with "
                             "0 <= t < max_frames")
        self.positions = None if host is None else host.to(frame0.device)
        self.split = (bt // 2, (bt + bh) // 2)  # pair index where the h band, then the w band, starts
        dy = host[..., 1] if host is not None else torch.zeros(1, dtype=torch.int32)
        dx = host[..., 2] if host is not None else torch.zeros(1, dtype=torch.int32)
        h_lo, h_hi = min(0, int(dy.min())), height - 1 + max(0, int(dy.max()))
        w_lo, w_hi = min(0, int(dx.min())), width - 1 + max(0, int(dx.max()))
        nh, nw = h_hi - h_lo + 1, w_hi - w_lo + 1
        self._row0, self._col0 = max_frames - h_lo, max_frames + nh - w_lo  # table row of row / column position 0
        ang = torch.zeros(max_frames + nh + nw, head_dim // 2, dtype=torch.float64)
        ang[:max_frames, :bt // 2] = axis_angles(torch.arange(max_frames), bt, theta)
        ang[max_frames:max_frames + nh, bt // 2:(bt + bh) // 2] = axis_angles(torch.arange(h_lo, h_hi + 1), bh, theta)
        ang[max_frames + nh:, (bt + bh) // 2:] = axis_angles(torch.arange(w_lo, w_hi + 1), bw, theta)
        self.table = torch.stack([ang.cos(), ang.sin()]).float().to(frame0.device)
        self._kpos: dict[int, torch.Tensor] = {}
        if self.positions is not None:
            self.kernel_positions(self.positions.shape[1])

    def frame_positions(self, frames: int) -> torch.Tensor:
        """[slots, frames, 3] (t, dy, dx) of every slot's frames."""
        if self.positions is not None:
            if self.positions.shape[1] != frames:
                raise ValueError(f"these tables hold positions for {self.positions.shape[1]} frames per chunk, "
                                 f"not {frames}")
            return self.positions
        pos = torch.zeros(self.frame0.numel(), frames, 3, dtype=torch.int32, device=self.frame0.device)
        pos[..., 0] = self.frame0[:, None] + torch.arange(frames, dtype=torch.int32, device=self.frame0.device)
        return pos

    def kernel_positions(self, frames: int) -> torch.Tensor:
        """int32 [slots * frames, 3]: the table rows of each (slot, frame)'s time, first row and first column, as
        the kernels index them (kept per frames per chunk; counted in `nbytes`)."""
        if frames not in self._kpos:
            pos = self.frame_positions(frames).reshape(-1, 3)
            self._kpos[frames] = torch.stack([pos[:, 0], pos[:, 1] + self._row0, pos[:, 2] + self._col0],
                                             1).to(torch.int32).contiguous()
        return self._kpos[frames]

    @property
    def nbytes(self) -> int:
        return (self.table.numel() * 4 + self.frame0.numel() * 4 + sum(t.numel() * 4 for t in self._kpos.values())
                + (self.positions.numel() * 4 if self.positions is not None else 0))

    def angles(self, chunk_len: int) -> torch.Tensor:
        """[C * chunk_len, D / 2] angles of every token (the reference path)."""
        frames = chunk_len // (self.height * self.width)
        pos = self.frame_positions(frames).cpu()
        return frame_angles(pos, self.height, self.width, self.head_dim, self._theta).reshape(-1, self.head_dim // 2)
