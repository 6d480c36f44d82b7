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


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host tensor x on `device`. To a GPU it goes from pinned memory without blocking the host (a blocking copy
    waits for the stream's queued work: once per chunk here, in the middle of the forward); the caching host
    allocator keeps the pinned buffer until the copy has run."""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class RopeTables:
    """Factorized RoPE for keys stored before RoPE and rotated on read (by `PackedSequence.decompress` or the
    dequant kernel). Frame f of slot c of a packed sequence of chunks (L = frames * height * width tokens each) sits
    at time t, with its rows and columns offset by (dy, dx) (as `frame_angles`): `positions[c, f]` = (t, dy, dx),
    or, given `frame0` instead, t = `frame0[c] + f` (< `max_frames`) and no offsets. Token (i, j) of that frame sits
    at row dy + i, column dx + j; times and offsets may be negative. `table` [2, R, D / 2] float32 holds cos then
    sin of position x frequency for R = T' + H' + W' positions: the times' range first (the times in `positions`,
    or [min(0, frame0), max_frames)), then the rows' (height plus the offsets' spread), then the columns'; channel
    pair j reads the axis of its band. `kernel_positions(frames)`: per (slot, frame), the table rows of its time
    and of its first row and first column, which the kernels read. `table` and the kernels' positions live on
    `device` (default: that of frame0 / positions); the positions themselves stay on the host (int32), where the
    reference path reads them."""

    def __init__(self, height: int, width: int, head_dim: int, frame0: torch.Tensor | None = None,
                 max_frames: int | None = None, theta: float = 10000.0, positions: torch.Tensor | None = None,
                 device=None):
        if (frame0 is None) == (positions is None) or (frame0 is not None and max_frames is None):
            raise ValueError("RopeTables takes positions [slots, frames, 3], or frame0 [slots] with max_frames")
        device = device if device is not None else (frame0 if positions is None else positions).device
        bt, bh, bw = bands(head_dim)
        self.height, self.width, self.head_dim, self._theta = height, width, head_dim, theta
        self.split = (bt // 2, (bt + bh) // 2)  # pair index where the h band, then the w band, starts
        if positions is None:  # (frame0 and positions are checked on the host)
            self._frame0 = frame0.cpu().to(torch.int32).reshape(-1)
            if self._frame0.numel() == 0:
                raise ValueError("frame0 must hold a first frame per slot, got none")
            self.positions, self.max_frames, self.slots = None, max_frames, len(self._frame0)
            t_lo, t_hi, dy, dx = min(0, int(self._frame0.min())), max_frames - 1, torch.zeros(1), torch.zeros(1)
        else:
            host = positions.cpu().to(torch.int32)
            if host.dim() != 3 or host.shape[2] != 3 or host.numel() == 0:
                raise ValueError(f"positions must be [slots, frames, 3] (t, dy, dx), got {list(host.shape)}")
            self._frame0, self.positions, self.slots = None, host, len(host)
            # the times held, not [0, max]: a rolling window's tables do not grow with the video's length
            t_lo, t_hi = int(host[..., 0].min()), int(host[..., 0].max())
            self.max_frames = None  # (frame0's bound; positions say their times)
            dy, dx = host[..., 1], host[..., 2]
        h_lo, h_hi = min(0, int(dy.min())), height - 1 + max(0, int(dy.max()))
        w_lo, w_hi = min(0, int(dx.min())), width - 1 + max(0, int(dx.max()))
        nt, nh, nw = t_hi - t_lo + 1, h_hi - h_lo + 1, w_hi - w_lo + 1
        self._time0, self._row0, self._col0 = -t_lo, nt - h_lo, nt + nh - w_lo  # table rows of positions 0
        ang = torch.zeros(nt + nh + nw, head_dim // 2, dtype=torch.float64)
        ang[:nt, :bt // 2] = axis_angles(torch.arange(t_lo, t_hi + 1), bt, theta)
        ang[nt:nt + nh, bt // 2:(bt + bh) // 2] = axis_angles(torch.arange(h_lo, h_hi + 1), bh, theta)
        ang[nt + nh:, (bt + bh) // 2:] = axis_angles(torch.arange(w_lo, w_hi + 1), bw, theta)
        self.table = _to_device(torch.stack([ang.cos(), ang.sin()]).float(), device)
        self._device = device
        self._kpos: dict[int, torch.Tensor] = {}
        if self.positions is not None:
            self.kernel_positions(self.positions.shape[1])

    def frame_positions(self, frames: int) -> torch.Tensor:
        """[slots, frames, 3] (t, dy, dx) of every slot's frames (int32, on the host)."""
        if self.positions is not None:
            if self.positions.shape[1] != frames:
                raise ValueError(f"these tables hold positions for {self.positions.shape[1]} frames per chunk, "
                                 f"not {frames}")
            return self.positions
        if int(self._frame0.max()) + frames > self.max_frames:
            raise ValueError(f"these tables hold times below {self.max_frames}: a chunk of {frames} frames from "
                             f"frame {int(self._frame0.max())} is past them")
        pos = torch.zeros(self.slots, frames, 3, dtype=torch.int32)
        pos[..., 0] = self._frame0[:, None] + torch.arange(frames, dtype=torch.int32)
        return pos

    def kernel_positions(self, frames: int) -> torch.Tensor:
        """int32 [slots * frames, 3]: the table rows of each (slot, frame)'s time, first row and first column, as
        the kernels index them, on the tables' device (kept per frames per chunk; counted in `nbytes`)."""
        if frames not in self._kpos:
            base = torch.tensor([self._time0, self._row0, self._col0], dtype=torch.int32)
            self._kpos[frames] = _to_device(self.frame_positions(frames).reshape(-1, 3) + base, self._device)
        return self._kpos[frames]

    def check(self, head_dim: int, chunk_len: int, chunks: int) -> None:
        """Refuse (ValueError) a packed history these tables cannot rotate: another head dim, chunks that are not
        whole frames, fewer slots than chunks, or positions for another number of frames per chunk."""
        hw = self.height * self.width
        held = self.positions.shape[1] if self.positions is not None else chunk_len // hw
        for bad, why in ((head_dim != self.head_dim, f"head dim {head_dim}, the tables' {self.head_dim}"),
                         (chunk_len % hw, f"{chunk_len} tokens per chunk are not whole {self.height} x {self.width} "
                                          f"frames"),
                         (self.slots < max(1, chunks), f"{chunks} chunks, the tables hold {self.slots} slots"),
                         (held != chunk_len // hw, f"{chunk_len // hw} frames per chunk, the positions hold {held}")):
            if bad:
                raise ValueError(f"rope: the tables must match a packed history ({why})")

    @property
    def nbytes(self) -> int:
        """Bytes on the tables' device: the table and the kernels' positions."""
        return self.table.numel() * 4 + sum(t.numel() * 4 for t in self._kpos.values())

    def angles(self, chunk_len: int) -> torch.Tensor:
        """[C * chunk_len, D / 2] angles of every token (the reference path)."""
        frames = chunk_len // (self.height * self.width)
        ang = frame_angles(self.frame_positions(frames), self.height, self.width, self.head_dim, self._theta)
        return ang.reshape(-1, self.head_dim // 2)
