"""`KVCache`: the one KV cache of every chunk-wise pipeline (and, later, the LLM side).

Per layer, three zones, for keys and values alike ([B, H, tokens, D], H = kv heads):

    | BF16 sink | compressed history (packed units) | BF16 pending | BF16 current |
      first `sink_frames`   method's packed bytes      committed,     the chunk being denoised
      frames, never evicted                            not yet packed (written at every step)

- `write(layer, k, v)`: the current chunk's K/V, overwriting the previous write (each denoising step, then the
  clean re-run at t=0). `write(..., transient=True)` (the denoising steps: their K/V serve one attention and are
  overwritten before any commit): when the layer holds a packed history and no sink or pending tokens, the cache
  keeps references to k and v instead of copying them into the current zone, and its next `attend` on the GPU path
  copies them once, straight into the staging window behind the decoded history (else they would be copied twice:
  zone, then window). On the other paths they are stored first, as by a plain write. Once attended, on every path, a
  transient chunk can't be attended again, committed or read.
- `commit()` (after the clean re-run): the current chunk becomes history. The first `sink_frames` frames fill the
  sink; after that chunks wait in the pending zone until `commit_every` of them are there, then they are
  compressed as one unit (`qvg.compress`; qvg / qvg-pro warm-start k-means from the previous unit's centroids of
  the same layer: the streaming centroid cache). With a rolling window (`window_frames`) the oldest units are
  evicted while `window_frames` past frames would still remain besides the sink (exactly that many with
  commit_every = 1; units of several chunks can leave up to a unit less one chunk more). Once the window is full,
  the new unit overwrites the evicted one's slot in place (`PackedSequence.replace_oldest`): a commit moves one
  unit's bytes, not the whole history's. While the history grows, a layer's K and V sequences are rebuilt into one
  allocation (`PackedSequence.append_pair`): the allocator's rounding of large blocks (up to 1 MiB each) is then
  paid once per layer, not twice.
- `commit_layer(layer)`: the same for one layer, called by the model right after that layer's last attention of
  the chunk (the clean re-run); `commit()` then finishes the rest.
- Asynchronous commits (`async_commit`, on by default; CUDA only): once a rolling window is full, a commit's GPU
  work (compression and the copy into the evicted unit's slot) is queued on a side stream behind the current
  stream's work so far, instead of in line with the forward. Commits that grow the history (the first window's
  fill, a full history) allocate, and run in line (see `_in_place`). With `defer_commits` (the default) the
  side-stream commits that `commit_layer` asks for are queued at `commit()`, all layers at once: they then run on
  into the next chunk's first forward rather than beside the re-run's later layers (False: each is queued by its
  `commit_layer`, as before). The cache orders every later use without a host sync: a layer's next `write` / `attend` /
  `read` waits for that layer's queued commit (a read before `commit()` queues the layer's deferred commit first).
  Bitwise the same history as synchronous commits.
- `attend(layer, q)`: attention of q over sink + history + pending + current. On CUDA the history of rtn / qvg /
  qvg-pro is decoded window by window (<= 1 GiB of one layer's BF16 K + V, plus the next layer's prefetched window;
  never the whole history) and attended by torch's SDPA (cuDNN), windows merged by log-sum-exp
  (kernels/windowed_sdpa.py); kivi / quarot and CPU decode the history first (the reference path). The BF16 zones
  are one contiguous buffer, read as a view. `read` picks the GPU read: "window" (that, the default: the fastest
  on the H100), "staged" (the history decoded in windows of <= 32 MiB, each attended by a Triton flash kernel that
  carries the online-softmax state: a smaller transient, slower attention) or "fused" (the packed-cache attention
  kernel: codes, scales and centroids are dequantized on chip, nothing is decoded to memory; the slowest; pre-RoPE
  keys are read "staged" by it on a GPU, `rope_on_chip`). Only rtn
  / qvg / qvg-pro have a packed history: bf16 / kivi / quarot take "window" alone and refuse the others
  (`read_error`). Each read is measured in the Self-Forcing chunk in eval/results/pipeline-h100.md.
- Decode prefetch (`prefetch_bytes`, `prefetch_at`; CUDA only): just before a layer's SDPA call is queued, the
  next layer's history is decoded into its staging window on a second side stream (`prefetch_at="split"`: between
  the two halves of an SDPA call split by query rows, its whole waves first; measured slower on Self-Forcing). It
  then runs during the attention, most likely on the SMs the attention's last wave leaves idle. In one traced
  21-frame Self-Forcing chunk, 14.9 of qvg's 15.1 ms of decode ran during attention, and 19.1 of qvg-pro's 23.2 ms.
  Queued after the SDPA call (`prefetch_at="after"`, the default before 525b5c6) it mostly ran while the main stream
  was idle (qvg: 9.9 of 12.8 ms), probably waiting for it because the GEMMs that follow hold every SM
  (eval/results/pipeline-h100.md). Only when history and tail fit one window of at most `prefetch_bytes` (1 GiB, the
  largest staging window, by default: Self-Forcing histories up to ~109 latent frames). The prefetched window is
  alive beside the layer's own: a chunk's peak above the resident cache is ~530 MiB at 21 frames (~440 MiB with the
  decode queued after the SDPA call) and ~1.21 GiB at 60 (~660 MiB decoding in line). A prefetch whose buffers
  can't be allocated is skipped (`prefetch_stats["no_memory"]`): that layer decodes in line, and no other prefetch
  is tried until `commit()` (each failed allocation makes the allocator free its cache first). Like the staging
  window itself the prefetched one is attention workspace, not counted by `memory()`. A commit of the layer drops
  its prefetch; one whose tail length no longer matches is dropped too, and the layer decodes in line. The last
  layer prefetches the first one for the next forward, except after the first layer's commit in this chunk: nothing
  is held across `commit()`. Bitwise the same outputs as without.
- Key storage (`key_storage`): "post-rope" packs the keys as written (after RoPE: Self-Forcing's layout);
  "pre-rope" (rtn / qvg / qvg-pro) turns each key back to before RoPE when it is packed and rotates it again when it
  is read, so k-means groups keys by content rather than by position (eval/results/rope_storage.md: 1.8x lower
  INT2 key error for qvg). The model gives each chunk's per-frame positions (`set_positions`); each packed unit
  keeps them (a few integers per frame). The BF16 zones always hold keys after RoPE. On the GPU the kernels rotate
  the keys as they decode them (factorized tables: each frame's time and spatial offsets, the world model's pans
  included, `RopeTables.positions`): the dequant kernel for the "window" and "staged" reads, and for "fused" too on
  a GPU (it reads pre-RoPE keys staged: the attention kernel's on-chip rotation, which the interpreter runs, was
  7-10x slower on the H200, eval/results/rope-on-chip-h200.json). Only positions that differ across the batch are
  beyond the tables (negative times and offsets are not): then the history is decoded whole and rotated in torch, a
  transient of its size.
- `reads`: how many attends (one per layer and forward) read a compressed history, by the path that ran ("window",
  "staged", "fused" or "reference", the torch path), so a report names the read that ran rather than the one asked
  for. Attends with no compressed history (bf16, or before the first commit) are not counted.
- `memory()`: bytes by component (codes, scales, ids, centroids, positions, bf16, and workspace: the compression
  graphs' static tensors and private memory pools, and the kernel's rotation tables) and in total, next to the BF16
  bytes the same tokens would take; `bf16` is also split by zone (bf16_sink, bf16_pending, bf16_current,
  bf16_residual), which sum to it exactly.

Method "bf16" keeps everything in the BF16 buffer (no compression): the reference every method is compared with.
With a rolling window it is a ring too (`bf16_rolling="ring"`, the default): once the window is full, the next
chunk is written over the slot of the chunk that leaves it, so a commit moves no bytes, as the packed methods'
`replace_oldest` does; the buffer then holds the chunks in slot order, which attention (no mask) does not see, and
`read` returns them in time order. `bf16_rolling="shift"` copies the history one chunk back at each commit instead
(upstream Self-Forcing's rolling cache does so): a Wan-1.3B chunk took 3.6 ms (21 frames of history) and 11.3 ms
(60) longer with it on an H200 (eval/results/pipeline-h100.md, section "the BF16 baseline a ring").
Attention has no mask: past chunks are fully visible, the current chunk attends to itself (block-causal).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import operator
import warnings

import torch

from . import compression
from .attention import attend_reference, sdpa_gqa
from .backend import kernel_head_dim, kernels_on, triton_available, use_kernels
from .numbers import is_int
from .compression.graphed import GraphedCompress
from .packed import COMPONENTS
from .rope import RopeTables, apply_rope, frame_angles
from .sequence import PER_TOKEN_METHODS, PackedSequence, carved_bytes
from .streams import green_stream, reserved

CACHE_METHODS = ("bf16", *compression.methods())
KEY_STORAGE = ("post-rope", "pre-rope")
# memory()'s components: they sum to its total
MEMORY_COMPONENTS = ("codes", "scales", "ids", "centroids", "positions", "bf16", "workspace")
PREFETCH_BYTES = 1 << 30  # the largest staging window (BF16 K + V) decoded ahead: = WINDOW_BYTES, any single window
PREFETCH_AT = ("before", "after", "split")  # where the next layer's decode is queued: just before / after a layer's
# SDPA call, or between the two calls of a split one (its whole waves, then its last partial wave)
# how the GPU path reads a packed history for attention (see the module docstring): the default decodes it into
# staging windows for cuDNN's SDPA (fastest on Hopper); the others run this project's packed-cache attention kernels
READ_MODES = ("window", "staged", "fused")
# how method bf16's full rolling window makes room for the next chunk (see the module docstring)
BF16_ROLLING = ("ring", "shift")


def read_modes(method: str) -> tuple[str, ...]:
    """The read modes of a cache `method`: all of READ_MODES for a packed rtn / qvg / qvg-pro history (the packed
    reads are kernels over a PackedSequence); the default "window" only for bf16, kivi and quarot, which have no
    packed read (their history is BF16, or decoded by the reference path)."""
    return READ_MODES if method in PER_TOKEN_METHODS else READ_MODES[:1]


def read_error(method: str, read: str, options: dict | None = None) -> str | None:
    """Why KVCache(method, read=read, **options) can't read its history that way, or None when it can: the one
    check of the read mode, made by KVCache and by qvg-generate before anything runs. (Every read takes keys stored
    before or after RoPE.)"""
    options = options or {}
    if read not in READ_MODES:
        return f"read must be one of {', '.join(READ_MODES)}, got {read!r}"
    supported = read_modes(method)
    if read not in supported:
        return (f"method {method!r} supports read={' / '.join(map(repr, supported))} only, not {read!r}: the "
                f"{' and '.join(m for m in READ_MODES if m not in supported)} reads are for a packed "
                f"{', '.join(PER_TOKEN_METHODS)} history")
    if read == "fused" and options.get("grid") == "asym":
        return "read='fused' reads the sym / midrise grids, not 'asym': use read='staged' or 'window'"
    if read == "fused" and options.get("bits") == 1:
        return "read='fused' reads 2-, 4- and 8-bit codes, not 1-bit: use read='staged' or 'window'"
    return None


def gpu_read(read: str, pre_rope: bool, device, head_dim: int) -> str:
    """The read a packed history takes on the GPU path for `read`: as asked, except "fused" with pre-RoPE keys where
    the attention kernel does not rotate on chip (`rope_on_chip`: a GPU), and "fused" at a head dim the on-chip
    kernel does not take there (`fused_head_dim`: 256 on a GPU), which read "staged". The one rule of `KVCache` and
    of qvg-generate's report."""
    if read != "fused":
        return read
    from .kernels.attention import fused_head_dim, rope_on_chip
    dev = torch.device(device)
    return "staged" if (pre_rope and not rope_on_chip(dev)) or not fused_head_dim(head_dim, dev) else read


class _Layer:
    """One layer's K and V zones."""

    def __init__(self, chunk: int):
        self.chunk = chunk  # tokens of a chunk (every write)
        self.buf: list[torch.Tensor] | None = None  # [K, V] BF16 [B, H, capacity, D]: sink | pending | current
        self.n_sink = 0  # tokens in the sink
        self.n_pending = 0  # tokens committed but not packed (bf16: the whole history)
        self.head = 0  # method bf16, rolling ring: the pending zone's slot (in chunks) holding its oldest chunk
        self.n_cur = 0  # tokens of the current chunk
        self.hist: list = [None, None]  # K, V history: PackedSequence (rtn/qvg/qvg-pro) or list[Packed]
        self.warm: list = [None, None]  # centroids of the last packed unit when no history holds them
        self.committed = False  # committed by commit_layer since the last commit()
        self.deferred = False  # committed by commit_layer, its work queued only at commit() (defer_commits)
        self.pos_pending: list[torch.Tensor] = []  # pre-rope: positions [B, F, 3] of each pending chunk
        self.pos_hist: list[torch.Tensor] = []  # pre-rope: positions [B, F_unit, 3] of each packed unit, oldest first
        self.done = None  # async commit: (device, CUDA event recorded after this layer's queued commit work) or None
        self.prefetch = None  # (tail tokens, K, V, CUDA event): the history decoded ahead on a side stream (every
        # commit of the layer drops it first, so a held one always matches the history)
        self.loose = None  # (K, V) of a transient write, not copied into the current zone (attend takes them)
        self.transient = False  # the current chunk came from a transient write (it serves one attention)
        self.spent = False  # a transient write was attended: no current chunk to attend, commit or read

    def slots(self) -> list[int]:
        """The pending zone's chunk slots (in chunks past the sink) in time order, the current chunk's last when
        written. Slots run in order until method bf16's rolling ring turns (`head`): then the j-th oldest pending
        chunk is in slot (head + j) mod R and the current one in the slot after the newest, R = pending chunks + 1."""
        p = self.n_pending // self.chunk
        return [(self.head + j) % (p + 1) for j in range(p + (self.n_cur > 0))]

    def cur_start(self) -> int:
        """First token of the current chunk's slot."""
        p = self.n_pending // self.chunk
        return self.n_sink + (self.head + p) % (p + 1) * self.chunk

    def tail(self, i: int) -> torch.Tensor:
        """Sink, pending and current tokens for attention, which has no mask, so slot order serves: a view of the
        buffer, unless the ring has turned and no current chunk fills its slot (then a copy without that slot)."""
        n = self.n_sink + self.n_pending + self.n_cur
        if not self.head or self.n_cur:
            return self.buf[i][:, :, :n]
        return torch.cat([self.buf[i][:, :, :self.n_sink]] + self.chunks(i), 2)

    def chunks(self, i: int) -> list[torch.Tensor]:
        """Views of the pending and current chunks in time order."""
        c, a = self.chunk, self.n_sink
        return [self.buf[i][:, :, a + s * c:a + (s + 1) * c] for s in self.slots()]


# The commits' compress preset by method where it differs from the kernels' "auto". The commits run beside the next
# chunk's forward: for qvg the memory-bound segmented-sum preset ("fast") overlaps it better than the one-hot update,
# which is 24% faster alone but made the whole chunk 0.3-0.5% slower in two same-run A/B runs on the H100; for
# qvg-pro "auto" (the one-hot update) made it 1.2-1.3% faster (eval/results/compress-sweep-h100.md).
COMMIT_PRESETS = {"qvg": "fast"}


class KVCache:
    """KV cache of `num_layers` layers. method: "bf16" or a `qvg.methods()` name; options: that method's
    (`bits`, `block_size`, `stages`, `centroids`, ...). chunk_frames / tokens_per_frame: the chunk layout (every
    write holds chunk_frames * tokens_per_frame tokens). sink_frames and window_frames are multiples of
    chunk_frames; window_frames=None keeps the whole history. cuda_graphs: on CUDA, warm-started compression
    replays a captured graph (qvg.compression.graphed; same result, a fraction of the host time). key_storage:
    "post-rope" or "pre-rope" (see the module docstring; pre-rope needs `set_positions` before each chunk's writes).
    async_commit: on CUDA, commits run on a side stream (see the module docstring); False: in line.
    defer_commits: with async_commit, a side-stream commit asked for by `commit_layer` is queued at `commit()`, all
    layers together, instead of right away (see the module docstring).
    prefetch_bytes: on CUDA, while a layer attends, the next layer's history is decoded on a side stream when its
    staging window (BF16 K + V of history and tail) takes at most this many bytes (see the module docstring); 0: no
    prefetch. prefetch_at: "before" (the next layer's decode queued just before a layer's SDPA call, so it runs
    during the attention), "after" (once the SDPA call is queued) or "split" (the SDPA call split in two by query
    rows, the whole waves first, and the decode queued between them: it then runs on the SMs that the last partial
    wave leaves idle; `kernels.windowed_sdpa.query_split`).
    read: on CUDA, how a packed history (rtn / qvg / qvg-pro) is read for attention: "window" (decoded into staging
    windows of <= 1 GiB BF16 K + V, then cuDNN SDPA, with the decode prefetch), "staged" (kernels/attention.py's
    `staged_attention`: windows of <= 32 MiB, each attended by a Triton flash kernel that carries the softmax state)
    or "fused" (`packed_attention`: codes, scales and centroids dequantized on chip, nothing decoded to memory;
    post-RoPE keys, any grid but asym, 2- 4- or 8-bit codes). bf16 / kivi / quarot have no packed read: "window" only
    (`read_modes`; any other read is refused, see `read_error`). See the module docstring for what each costs.
    bf16_rolling: method bf16 with a full rolling window: "ring" (the next chunk is written over the evicted one's
    slot; nothing moves) or "shift" (the history is copied one chunk back, as upstream Self-Forcing's cache does;
    kept to time that baseline). Other methods: ignored.
    compress_preset: on CUDA, the compress kernels' preset (a kernels/compress.py COMPRESS_VARIANTS name); None: the
    method's entry in COMMIT_PRESETS, else the kernels' default "auto" (picked by shape). Same compression either way
    (ids equal, centroids up to the order of the FP32 sums).
    commit_sms / prefetch_sms (experimental): on CUDA, the queued commits / the prefetched decodes run on this many
    SMs only (a CUDA green context's stream, `qvg.streams.green_stream`) instead of a side stream that may use every
    SM; None: the latter.
    """

    def __init__(self, num_layers: int, method: str = "qvg", *, chunk_frames: int, tokens_per_frame: int,
                 sink_frames: int = 0, window_frames: int | None = None, commit_every: int = 1,
                 cuda_graphs: bool = True, key_storage: str = "post-rope", async_commit: bool = True,
                 prefetch_bytes: int = PREFETCH_BYTES, defer_commits: bool = True, compress_preset: str | None = None,
                 prefetch_at: str = "before", read: str = "window", bf16_rolling: str = "ring",
                 commit_sms: int | None = None, prefetch_sms: int | None = None, **options):
        if method not in CACHE_METHODS:
            raise ValueError(f"unknown cache method {method!r}; choose one of: {', '.join(CACHE_METHODS)}")
        if key_storage not in KEY_STORAGE:
            raise ValueError(f"key_storage must be one of {', '.join(KEY_STORAGE)}, got {key_storage!r}")
        if key_storage == "pre-rope" and method not in ("bf16", *PER_TOKEN_METHODS):
            raise ValueError(f"pre-rope key storage is for {', '.join(PER_TOKEN_METHODS)} (and bf16, which packs "
                             f"nothing), not {method!r}")
        for name, v in (("num_layers", num_layers), ("chunk_frames", chunk_frames),
                        ("tokens_per_frame", tokens_per_frame), ("commit_every", commit_every)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, v in (("sink_frames", sink_frames), ("window_frames", window_frames)):
            if v is not None and (not is_int(v) or v < 0 or v % chunk_frames):
                raise ValueError(f"{name} must be a non-negative multiple of chunk_frames ({chunk_frames}), got {v!r}")
        for name, v in (("async_commit", async_commit), ("defer_commits", defer_commits),
                        ("cuda_graphs", cuda_graphs)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        if not is_int(prefetch_bytes) or prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be a non-negative integer (0: no prefetch), got {prefetch_bytes!r}")
        if prefetch_at not in PREFETCH_AT:
            raise ValueError(f"prefetch_at must be one of {', '.join(PREFETCH_AT)}, got {prefetch_at!r}")
        if bf16_rolling not in BF16_ROLLING:
            raise ValueError(f"bf16_rolling must be one of {', '.join(BF16_ROLLING)}, got {bf16_rolling!r}")
        if method != "bf16" and window_frames is not None and window_frames < (commit_every - 1) * chunk_frames:
            raise ValueError(f"a window of {window_frames} frames evicts the chunks waiting to be packed before there "
                             f"are commit_every = {commit_every} of them: {method} would never pack a unit (give a "
                             f"window of at least {(commit_every - 1) * chunk_frames} frames, or a smaller "
                             "commit_every)")
        bad_read = read_error(method, read, options)
        if bad_read:
            raise ValueError(bad_read)
        if method == "kivi" and {"role", "residual"} & set(options):
            raise ValueError(f"kivi in the cache takes no {' or '.join(sorted({'role', 'residual'} & set(options)))}: "
                             "the cache quantizes keys per channel and values per token, and its pending and "
                             "current zones are KIVI's full-precision window")
        misspelt = _misspelt(options, method)
        if misspelt:
            raise ValueError(misspelt)
        if method == "bf16" and (options or compress_preset is not None):
            raise ValueError(f"method 'bf16' takes no options, got {', '.join(sorted(options)) or 'compress_preset'}")
        if compress_preset is not None and triton_available():  # (without triton no preset applies, and the
            from .kernels.compress import check_variant  # kernels' module, which holds the names, can't be imported)
            check_variant(compress_preset)
        self.compress_preset = compress_preset if compress_preset is not None else COMMIT_PRESETS.get(method)
        unit = commit_every * chunk_frames * tokens_per_frame
        self.method, self.options = method, cache_options(method, options, unit)
        if method != "bf16":
            check_options(method, self.options, unit)
        self.chunk_frames, self.tokens_per_frame = chunk_frames, tokens_per_frame
        self.sink_frames, self.window_frames, self.commit_every = sink_frames, window_frames, commit_every
        self.num_layers = num_layers
        self.key_storage = key_storage
        self._positions = None  # pre-rope: the current chunk's positions [B, F, 3] (set_positions)
        self._head_dims: set[int] = set()  # head dims the options were checked with (_check_head_dim, at a write)
        self._grid = None  # pre-rope: (height, width, theta) of the token grid
        self._rope_memo: dict = {}  # the dequant kernel's rotation tables by positions (shared by the layers)
        self.layers = [_Layer(self.chunk_tokens) for _ in range(num_layers)]
        self.frames = 0  # frames committed so far (the next chunk's start frame: its RoPE time offset)
        self.commits = 0
        self.resets = 0  # reset() calls so far
        # (with commit_sms the graphs are captured on the green stream: replays then stay on its SMs)
        self._graphed = GraphedCompress(commit_sms is not None) if cuda_graphs and method != "bf16" else None
        self.async_commit, self.defer_commits = async_commit, defer_commits
        for name, v in (("commit_sms", commit_sms), ("prefetch_sms", prefetch_sms)):
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        self.commit_sms, self.prefetch_sms = commit_sms, prefetch_sms
        self._side: dict = {}  # device -> the CUDA side stream of the async commits
        self.prefetch_bytes, self.prefetch_at = prefetch_bytes, prefetch_at
        self.read_mode = read
        self._bf16_rolling = bf16_rolling  # (fixed: a turned ring can't start shifting)
        # attends that read a compressed history, by the path that ran: "window" / "staged" / "fused" (the GPU
        # reads) or "reference" (the torch path: CPU, kivi / quarot, pre-RoPE keys the kernels' tables can't rotate)
        self.reads = collections.Counter()
        self._ahead: dict = {}  # device -> the CUDA side stream of the prefetched decodes
        self._clear_prefetch_state()

    @property
    def bf16_rolling(self) -> str:
        return self._bf16_rolling

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def _pre_rope(self) -> bool:
        return self.key_storage == "pre-rope" and self.method != "bf16"

    def _angles(self, units: list[torch.Tensor], device, head_dim: int) -> torch.Tensor:
        """RoPE angles [B, 1, N, D / 2] (float32) of the tokens of these units' positions, in order: computed per
        call, a transient like the decoded history it rotates (the cache keeps no per-token table)."""
        h, w, theta = self._grid
        pos = torch.cat(units, 1).to(device, non_blocking=True)  # a few integers: no blocking copy, no table copy
        return frame_angles(pos, h, w, head_dim, theta).float()[:, None]

    def _rope_tables(self, L: _Layer, device) -> RopeTables | None:
        """The history's RoPE as the dequant kernel's factorized tables (each ring slot's frames: time and spatial
        offsets, negative ones included), or None when they cannot say it: positions that differ across the batch.
        Kept per positions while they last (during the clean re-run, layers committed already hold one more unit
        than the rest: two live keys; older ones are dropped) and counted in memory()'s workspace."""
        pos = torch.stack(L.pos_hist)  # [C, B, F, 3]
        head, d = L.hist[0].head, L.hist[0].shape[3]
        key = (pos.shape, pos.numpy().tobytes(), head, str(device), d)
        if key not in self._rope_memo:
            if len(self._rope_memo) >= 2:
                self._rope_memo.pop(next(iter(self._rope_memo)))
            self._rope_memo[key] = self._make_tables(pos, head, device, d)
        return self._rope_memo[key]

    def _make_tables(self, pos: torch.Tensor, head: int, device, head_dim: int) -> RopeTables | None:
        if (pos != pos[:, :1]).any():  # (one table serves the batch)
            return None
        slots = torch.roll(pos[:, 0], head, 0)  # [C, F, 3]: slot s holds the unit (s - head) mod C
        h, w, theta = self._grid
        return RopeTables(h, w, head_dim, theta=theta, positions=slots, device=device)  # (host positions: no sync)

    # ---- writing ------------------------------------------------------------------------------------------
    def set_positions(self, positions: torch.Tensor, height: int, width: int, theta: float = 10000.0) -> None:
        """The current chunk's RoPE positions (pre-rope key storage; the model calls it once per forward): integer
        [B, chunk_frames, 3], per frame (time index, row offset dy, column offset dx) on a height x width token
        grid, Wan's 3D RoPE with base theta (qvg.rope.frame_angles)."""
        if not isinstance(positions, torch.Tensor):
            raise ValueError(f"positions must be an integer tensor [B, {self.chunk_frames}, 3], got "
                             f"{type(positions).__name__}")
        if (positions.dim() != 3 or positions.shape[1:] != (self.chunk_frames, 3)
                or positions.is_floating_point()):
            raise ValueError(f"positions must be an integer tensor [B, {self.chunk_frames}, 3], got "
                             f"{positions.dtype} {list(positions.shape)}")
        if height * width != self.tokens_per_frame:
            raise ValueError(f"a {height} x {width} token grid does not hold {self.tokens_per_frame} tokens per frame")
        self._positions = positions.detach().to("cpu", torch.int32).clone()
        self._grid = (height, width, float(theta))

    def _check_head_dim(self, d: int, device: torch.device) -> None:
        """The options checked against the model's head dim d at its first write (a block size d does not divide
        is said then, not at the first commit, after a whole forward); a warning if a unit packs into more bits
        per element than BF16 (units too small for the method's fixed costs: centroids, scales), and one if the
        kernels would run on `device` but do not take d (`ReferenceReadWarning`)."""
        if self.method in PER_TOKEN_METHODS and kernels_on(device) and not kernel_head_dim(d):
            warnings.warn(f"KVCache: head dim {d} is not one the Triton kernels take (a power of two from 16 to 256): "
                          f"on {device} this {self.method} cache compresses and reads through the torch reference, "
                          "which decodes each layer's whole history into BF16 for its attention",
                          ReferenceReadWarning, stacklevel=3)
        if self.method != "bf16":
            unit = self.commit_every * self.chunk_tokens
            try:
                check_options(self.method, self.options, unit, d)
            except ValueError as e:
                raise ValueError(f"write: K/V of head dim {d}: {e}") from None
            bits = unit_bits(self.method, self.options, unit, d)
            if bits > 16:
                warnings.warn(f"KVCache: {self.method} packs a unit of {unit} tokens x {d} channels into {bits:.1f} "
                              "bits per element, more than BF16's 16: its fixed costs (centroids, scales) need "
                              "larger units (chunk_frames x tokens_per_frame x commit_every)", UnitCostWarning,
                              stacklevel=3)
        self._head_dims.add(d)

    def _layer(self, layer: int, what: str) -> _Layer:
        try:
            i = None if isinstance(layer, bool) else operator.index(layer)
        except TypeError:
            i = None
        if i is None or not 0 <= i < self.num_layers:
            raise ValueError(f"{what}: layer must be an integer in [0, {self.num_layers - 1}] (this cache has "
                             f"{self.num_layers} layers), got {layer!r}")
        return self.layers[i]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, transient: bool = False) -> None:
        """Store the current chunk's K/V [B, H, chunk_tokens, D] of `layer` (overwrites the previous write).
        transient: they serve only the layer's next `attend` (a denoising step); the cache may hold k and v by
        reference until then (see the module docstring): don't modify them in place before that attend."""
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise ValueError(f"write expects k and v as torch tensors, got {type(k).__name__} and {type(v).__name__}")
        if k.shape != v.shape or k.dim() != 4 or k.shape[2] != self.chunk_tokens:
            raise ValueError(f"write expects k and v of shape [B, H, {self.chunk_tokens}, D], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if not (k.is_floating_point() and v.is_floating_point()) or k.device != v.device:
            raise ValueError(f"write expects floating-point k and v on one device, got {k.dtype} on {k.device} and "
                             f"{v.dtype} on {v.device}")
        if k.requires_grad or v.requires_grad:  # (the cache holds values, never an autograd graph: each chunk's
            k, v = k.detach(), v.detach()  # would stay alive through the buffer's in-place copies)
        if k.shape[3] not in self._head_dims:
            self._check_head_dim(k.shape[3], k.device)
        L = self._layer(layer, "write")
        if L.committed:
            raise RuntimeError(f"write: layer {layer} was committed by commit_layer; call commit() before the next "
                               "chunk")
        self._wait(L)  # (its queued commit still reads the zone this write overwrites)
        if self._positions is not None and self._pre_rope:
            self._check_batch(k.shape[0], "write")
        if L.buf is not None and (L.buf[0].shape[:2] != k.shape[:2] or L.buf[0].shape[3] != k.shape[3]
                                  or L.buf[0].device != k.device):
            if L.n_sink or L.n_pending or L.hist[0] is not None:
                raise ValueError(f"layer {layer}: K/V of shape {tuple(k.shape)} on {k.device} do not match the "
                                 f"cached tokens' {tuple(L.buf[0].shape)} on {L.buf[0].device}")
            L.buf = None
        held = L.n_sink + L.n_pending
        if L.buf is None or L.buf[0].shape[2] < held + self.chunk_tokens:  # grows to sink + commit_every chunks
            # (bf16: + history; its rolling ring turns only once the buffer holds the whole window)
            assert not L.head, "a turned ring does not grow (its chunks are in slot order)"
            L.buf = [_grown(L.buf[i] if L.buf else None, held, held + self.chunk_tokens, k) for i in range(2)]
        L.n_cur = self.chunk_tokens
        L.spent, L.transient = False, transient
        if transient and held == 0 and isinstance(L.hist[0], PackedSequence):
            L.loose = (k, v)
            return
        L.loose = None
        start = L.cur_start()
        L.buf[0][:, :, start:start + self.chunk_tokens] = k
        L.buf[1][:, :, start:start + self.chunk_tokens] = v

    def _store_loose(self, L: _Layer, what: str) -> None:
        """Copy a transient write still held by reference into the current zone (before any other use of it)."""
        if L.spent:
            raise RuntimeError(f"{what}: layer {self.layers.index(L)}'s current chunk was written with transient=True "
                               "and has been attended (it serves one attention): write it again first")
        if L.loose is not None:
            start = L.cur_start()
            for i in range(2):
                L.buf[i][:, :, start:start + L.n_cur] = L.loose[i]
            L.loose = None

    def commit(self) -> None:
        """Make the current chunk history in every layer (fill the sink, pack every `commit_every` chunks, evict
        outside the window) and advance the frame count. Every layer must have been written since the last commit
        (layers already committed by `commit_layer` are done)."""
        for i, L in enumerate(self.layers):  # (every check before any layer changes)
            if not L.n_cur and not L.committed:
                raise RuntimeError(f"commit: layer {i} has no current chunk (write it first)")
            if not L.committed:
                self._check_positions(L, "commit")
        for L in self.layers:
            if not L.committed:
                self._store_loose(L, "commit")
        for L in self.layers:
            if not L.committed or L.deferred:
                self._commit(L)
            L.committed = L.deferred = False
        # no join: each layer's next write / attend / read waits for its own queued commit, so the queued work runs
        # on into the next chunk's first forward
        self._positions = None  # the next chunk's must be given again
        self._prefetch_off = False
        self.frames += self.chunk_frames
        self.commits += 1

    def commit_layer(self, layer: int) -> None:
        """Commit one layer (called right after its last attention of the chunk). A commit that goes to the side
        stream is queued by `commit()` with the others when `defer_commits` (the default), else right away; one in
        line runs now. `commit()` must still follow once every layer is done; until then the layer takes no new
        write."""
        L = self._layer(layer, "commit_layer")
        if L.committed:
            raise RuntimeError(f"commit_layer: layer {layer} is committed already; call commit() once every layer is "
                               "done, then write the next chunk")
        if not L.n_cur:
            raise RuntimeError(f"commit_layer: layer {layer} has no current chunk (write it first)")
        self._check_positions(L, "commit_layer")
        self._store_loose(L, "commit_layer")
        if self.defer_commits and self._queued(L):
            L.deferred = True  # (queued by commit(); a read of the layer before that queues it then)
        else:
            self._commit(L)
        L.committed = True

    def _check_positions(self, L: _Layer, what: str) -> None:
        """Pre-RoPE keys: a chunk committed past the sink needs its positions (set_positions), one row or one per
        sample of the written batch; checked before the commit changes anything (a failed commit left the layers
        before it counted and a retry packed the chunk twice)."""
        if not self._pre_rope or L.n_sink < self.sink_frames * self.tokens_per_frame:
            return
        if self._positions is None:
            raise RuntimeError(f"{what}: pre-rope key storage: call set_positions(...) with the chunk's positions "
                               "before committing it")
        self._check_batch(L.buf[0].shape[0], what)

    def _check_batch(self, b: int, what: str) -> None:
        """ValueError unless set_positions' positions serve K/V of batch b (one row, or one per sample)."""
        if self._positions.shape[0] not in (1, b):
            raise ValueError(f"{what}: K/V of batch {b}, but set_positions gave positions for batch "
                             f"{self._positions.shape[0]} (give one row, shared by the batch, or one per sample)")

    def _queued(self, L: _Layer) -> bool:
        """Whether L's commit goes to the side stream (else it runs in line)."""
        return self.async_commit and L.buf[0].device.type == "cuda" and self._in_place(L)

    def _settle(self, L: _Layer) -> None:
        """Queue L's deferred commit now (a read of the layer comes before `commit()`)."""
        if L.deferred:
            self._commit(L)
            L.deferred = False

    def _commit(self, L: _Layer) -> None:
        self._drop_prefetch(L)  # (its history changes now)
        dev = L.buf[0].device
        if not self._queued(L):
            if any(x.done is not None for x in self.layers):  # queued commits first: the layers share the
                self._join()  # compression graphs' static tensors
            return self._commit_now(L)
        side = _stream(self._side, dev, self.commit_sms)
        side.wait_stream(torch.cuda.current_stream(dev))  # behind this chunk's writes and the layer's reads
        with torch.cuda.stream(side):
            self._commit_now(L)
        L.done = (dev, torch.cuda.Event())
        L.done[1].record(side)

    def _in_place(self, L: _Layer) -> bool:
        """Whether committing the layer's current chunk leaves the history's memory as it is: method bf16
        (counters, and a full window's shift within its buffer), or a unit packed into the slot of the oldest one of
        a full rolling window (`PackedSequence.replace_oldest`). Only such commits go to the side stream; their
        transients (pre-RoPE keys' rotation, a compression graph's first capture) come from the side stream's own
        pool. Commits that grow the history run in line: on the side stream, the history copies made from that
        stream's separate pool got more of the allocator's oversized blocks (up to 1 MiB each), 1.5-2.4% more
        allocator bytes than accounted at 60 frames against 0.2-1.05% in line (eval/results/alloc-slack-h100.json)."""
        if self.method == "bf16":
            return True
        unit = L.n_pending + L.n_cur
        return (L.n_sink >= self.sink_frames * self.tokens_per_frame and unit >= self.commit_every * self.chunk_tokens
                and self._ring_slot(L, unit))

    def _ring_slot(self, L: _Layer, unit: int) -> bool:
        """Whether a new packed unit of `unit` tokens goes into the slot of the oldest one, in place: a full rolling
        window of same-length units, which would evict exactly that unit after this one."""
        h = L.hist[0]
        if self.window_frames is None or not isinstance(h, PackedSequence) or h.chunk_len != unit:
            return False
        limit = self.window_frames * self.tokens_per_frame
        return limit <= h.shape[2] < limit + unit

    @staticmethod
    def _wait(L: _Layer) -> None:
        """The current stream waits for the layer's queued commit (no host sync)."""
        if L.done is not None:
            torch.cuda.current_stream(L.done[0]).wait_event(L.done[1])

    def _join(self) -> None:
        """The current stream (and the generation stream) waits for every queued commit (the next chunk then writes
        over what they read)."""
        _owners_wait(self._side)
        for L in self.layers:
            L.done = None

    def wait_side_streams(self) -> None:
        """The current stream (and the generation stream) waits for every commit and decode the cache queued on its
        side streams (no host sync): timing a `commit()` whole, or before the cache's memory is handed back."""
        self._join()
        _owners_wait(self._ahead)

    def __del__(self):
        # a cache dropped between chunks may still have commits (or a prefetch) queued that read and write blocks
        # of the current stream's or the generation stream's pool: make both wait for them before those blocks go
        # back to them
        try:
            self.wait_side_streams()
        except Exception:  # (interpreter shutdown)
            pass

    def _commit_now(self, L: _Layer) -> None:
        if L.n_sink < self.sink_frames * self.tokens_per_frame:
            L.n_sink += L.n_cur
        else:
            L.n_pending += L.n_cur
            if self._pre_rope:  # (positions checked by _check_positions)
                pos, rows = self._positions, {p.shape[0] for p in L.pos_hist[:1] + L.pos_pending[:1]}
                if rows and rows != {pos.shape[0]}:  # (one row shared by the batch beside per-sample rows: all
                    b = max(rows | {pos.shape[0]})  # per sample, so the units concatenate)
                    L.pos_hist, L.pos_pending = ([p.expand(b, -1, -1).contiguous() for p in ps]
                                                 for ps in (L.pos_hist, L.pos_pending))
                    pos = pos.expand(b, -1, -1).contiguous()
                L.pos_pending.append(pos)
        L.n_cur = 0
        if self.method != "bf16" and L.n_pending >= self.commit_every * self.chunk_tokens:
            self._pack_pending(L)
        self._evict(L)

    def _pack_pending(self, L: _Layer) -> None:
        a, b = L.n_sink, L.n_sink + L.n_pending
        ring = self._ring_slot(L, b - a)
        finish_v = None  # growth: K and V's new sequences share one allocation (PackedSequence.append_pair)
        for i, role in enumerate(("key", "value")):
            x = L.buf[i][:, :, a:b]
            if i == 0 and self._pre_rope:  # back to before RoPE (fp32 rotation, BF16 as written)
                x = apply_rope(x, self._angles(L.pos_pending, x.device, x.shape[3]), inverse=True).to(x.dtype)
            opts = unit_options(self.method, self.options, role)
            warm = self._warm_start(L, i) if "init" not in opts else None
            if self._graphed is not None and self._graphed.supports(x, self.method, warm, opts):
                # one graph replay (copied into the history below)
                p = self._graphed(x, self.method, warm, preset=self.compress_preset, **opts)
            else:
                with _preset(self.compress_preset, x):
                    p = compression.compress(x, self.method, check_finite=False, init=warm, **opts)  # no host sync
            if self.method in PER_TOKEN_METHODS:
                if ring:
                    L.hist[i] = L.hist[i].replace_oldest(p)
                elif i == 0:  # (K's chunk is copied now: V's compression may reuse the buffers it came in)
                    L.hist[0], finish_v = PackedSequence.append_pair(L.hist[0], p, L.hist[1])
                else:
                    L.hist[1] = finish_v(p)
            else:
                L.hist[i] = (L.hist[i] or []) + [p]
            L.warm[i] = None
        L.n_pending = 0
        if self._pre_rope:
            unit = torch.cat(L.pos_pending, 1)
            L.pos_hist = (L.pos_hist[1:] if ring else L.pos_hist) + [unit]
            L.pos_pending = []

    def _warm_start(self, L: _Layer, i: int):
        if self.method not in ("qvg", "qvg-pro") or self.options.get("stages") == 0:
            return None
        if L.hist[i] is not None:
            return L.hist[i].last_centroids()
        return L.warm[i]

    def _evict(self, L: _Layer) -> None:
        """Drop the oldest packed units while at least window_frames past frames (besides the sink) remain
        without them, then (bf16, or pending chunks beyond the window) the oldest pending chunks. With
        commit_every = 1 exactly window_frames remain; with larger units up to a unit less one chunk more."""
        if self.window_frames is None:
            return
        limit = self.window_frames * self.tokens_per_frame
        unit = self.commit_every * self.chunk_tokens
        while L.hist[0] is not None and self._hist_tokens(L) + L.n_pending - unit >= limit:
            for i in range(2):
                h = L.hist[i]
                if isinstance(h, PackedSequence):
                    if h.num_chunks == 1 and h.stages:
                        L.warm[i] = h.last_centroids().clone()  # the next unit still warm-starts from it
                    L.hist[i] = h.drop_first(1)
                else:
                    L.hist[i] = h[1:] or None
            L.pos_hist = L.pos_hist[1:]
        over = self._hist_tokens(L) + L.n_pending - limit
        if over > 0 and L.n_pending and L.hist[0] is None:
            drop = min(L.n_pending, -(-over // self.chunk_tokens) * self.chunk_tokens)
            keep = L.n_pending - drop
            if self.method == "bf16" and self._bf16_rolling == "ring" and drop == self.chunk_tokens:
                # the oldest chunk's slot takes the next chunk: no copy (bf16 grows by one chunk per commit, so a
                # full window drops exactly one)
                L.head = (L.head + 1) % (L.n_pending // self.chunk_tokens)
                L.n_pending = keep
                return
            a = L.n_sink
            for buf in L.buf:  # shift left in place, `drop` tokens per copy (no slice overlaps its source)
                for s in range(0, keep, drop):
                    w = min(drop, keep - s)
                    buf[:, :, a + s:a + s + w] = buf[:, :, a + drop + s:a + drop + s + w]
            L.n_pending = keep
            if L.pos_pending:
                L.pos_pending = L.pos_pending[drop // self.chunk_tokens:]

    @staticmethod
    def _hist_tokens(L: _Layer) -> int:
        h = L.hist[0]
        if h is None:
            return 0
        if isinstance(h, PackedSequence):
            return h.shape[2]
        return sum(p.shape[2] for p in h)

    # ---- reading ------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """softmax(q K^T * scale) V over the layer's sink + history + pending + current tokens. q [B, Hq, M, D]
        (Hq a multiple of the kv heads)."""
        L = self._layer(layer, "attend")
        if L.buf is None:
            raise RuntimeError(f"attend: layer {layer} holds nothing (write the current chunk first)")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != L.buf[0].shape[0] or \
                q.shape[3] != L.buf[0].shape[3] or q.shape[1] % L.buf[0].shape[1]:
            b, h, _, d = L.buf[0].shape
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"attend: q must be [{b}, Hq, M, {d}] with Hq a multiple of the {h} kv heads, got {got}")
        if not q.is_floating_point() or q.device != L.buf[0].device:
            raise ValueError(f"attend: q must be floating point on the cache's device ({L.buf[0].device}), got "
                             f"{q.dtype} on {q.device}")
        self._settle(L)
        self._wait(L)
        out = self._attend(L, layer, q, scale)
        if L.transient:  # (on every path, so a transient chunk behaves alike on every device)
            L.loose, L.spent, L.transient = None, True, False
        return out

    def _attend(self, L: _Layer, layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        kh, vh = L.hist
        if isinstance(kh, PackedSequence):
            from .backend import use_kernels
            if use_kernels(q):
                tables = self._rope_tables(L, q.device) if self._pre_rope else None
                if tables is not None or not self._pre_rope:
                    if L.loose is None:
                        self._store_loose(L, "attend")  # (refuses a spent chunk)
                    kt, vt = L.loose or (L.tail(0), L.tail(1))  # (a transient write goes straight into the window)
                    L.loose = None
                    if self.read_mode == "window":
                        self.reads["window"] += 1
                        return self._attend_windowed(layer, q, kt, vt, scale, tables)
                    return self._attend_packed(L, q, kt, vt, scale, tables)
        self._store_loose(L, "attend")
        kt, vt = L.tail(0), L.tail(1)
        if kh is None:
            return sdpa_gqa(q, kt, vt, scale)
        self.reads["reference"] += 1
        if isinstance(kh, PackedSequence):
            if self._pre_rope:  # the reference (it materializes the history): decode, rotate, attend
                k = apply_rope(kh.decompress(), self._angles(L.pos_hist, q.device, kh.shape[3]))
                return sdpa_gqa(q.float(), torch.cat([k, kt.float()], 2),
                                torch.cat([vh.decompress().float(), vt.float()], 2), scale).to(q.dtype)
            return attend_reference(q, kh, vh, kt, vt, scale=scale)
        k = torch.cat([compression.decompress(p).to(kt.dtype) for p in kh] + [kt], 2)
        v = torch.cat([compression.decompress(p).to(vt.dtype) for p in vh] + [vt], 2)
        return sdpa_gqa(q, k, v, scale)

    def _attend_windowed(self, layer: int, q: torch.Tensor, kt, vt, scale, rope) -> torch.Tensor:
        """The GPU path: the history decoded into a staging window (or taken from this layer's prefetch), then
        SDPA; the next layer's history is prefetched just before the SDPA call (`prefetch_at="before"`), after it
        ("after") or between the two calls of a split one ("split")."""
        from .kernels.windowed_sdpa import windowed_attention
        L = self.layers[layer]
        ahead = self.layers[(layer + 1) % self.num_layers]
        early = self.prefetch_at != "after"
        out = windowed_attention(q, *L.hist, kt, vt, scale=scale, rope=rope,
                                 decoded=self._take_prefetch(L, kt.shape[2]),
                                 before_sdpa=(lambda: self._prefetch(ahead, kt.shape[2])) if early else None,
                                 split_rows=self._split_rows(q) if self.prefetch_at == "split"
                                 and self._prefetchable(ahead, kt.shape[2]) else None)  # (split for a decode only)
        if not early:
            self._prefetch(ahead, kt.shape[2])
        return out

    @staticmethod
    def _split_rows(q: torch.Tensor) -> int | None:
        from .kernels.windowed_sdpa import query_split
        return query_split(q.shape[2], q.shape[0] * q.shape[1], _sm_count(q.device))

    def _attend_packed(self, L: _Layer, q: torch.Tensor, kt, vt, scale, rope) -> torch.Tensor:
        """The GPU path with read="staged" / "fused": this project's packed-cache attention kernels (no prefetch:
        nothing is decoded ahead). Pre-RoPE keys are read staged on a GPU (`rope_on_chip`: each key rotated once as
        its window is decoded, not again for every query block on chip)."""
        from .kernels.attention import packed_attention, staged_attention
        kh, vh = L.hist
        path = gpu_read(self.read_mode, rope is not None, q.device, q.shape[-1])
        self.reads[path] += 1
        return (staged_attention if path == "staged" else packed_attention)(q, kh, vh, kt, vt, scale=scale, rope=rope)

    def _prefetch(self, L: _Layer, tail: int) -> None:
        """Queue the decode of L's history (and room for a tail of `tail` tokens) on a side stream, behind the
        current stream's work so far: it then runs beside this layer's attention (`prefetch_at`) instead of in line
        before L's. Only when that one window takes at most `prefetch_bytes`, L holds no prefetch yet and L has not
        been committed in this chunk (then its next read is the next chunk's, after `commit()`: nothing is held
        across chunks). The buffers come from the current stream's pool: its later kernels use and free them after
        waiting for the decode."""
        from .kernels.windowed_sdpa import decode_window
        if not self._prefetchable(L, tail):
            return
        kh, vh = L.hist
        dev = kh.tensors["codes"].device
        b, h, n, d = kh.shape
        try:
            rope = self._rope_tables(L, dev) if self._pre_rope else None
            if self._pre_rope and rope is None:
                return
            ks, vs = _window_pair(b, h, n + tail, d, dev)
        except torch.cuda.OutOfMemoryError:  # the prefetch is optional: the layer then decodes in line, and no
            self.prefetch_stats["no_memory"] += 1  # other prefetch is tried before commit() (each failure makes the
            self._prefetch_off = True  # allocator free its whole cache first)
            return
        side = _stream(self._ahead, dev, self.prefetch_sms)
        side.wait_stream(torch.cuda.current_stream(dev))
        if L.done is not None:  # (a commit of L still queued on the commit stream)
            side.wait_event(L.done[1])
        with torch.cuda.stream(side):
            decode_window(kh, vh, tail, rope, out=(ks, vs))
        event = torch.cuda.Event()
        event.record(side)
        L.prefetch = (tail, ks, vs, event)

    def _prefetchable(self, L: _Layer, tail: int) -> bool:
        """Whether `_prefetch(L, tail)` would queue a decode (if its buffers can be allocated)."""
        from .kernels.windowed_sdpa import WINDOW_BYTES
        kh = L.hist[0]
        if (not self.prefetch_bytes or self._prefetch_off or L.prefetch is not None or L.committed
                or not isinstance(kh, PackedSequence) or kh.tensors["codes"].device.type != "cuda"):
            return False
        b, h, n, d = kh.shape
        return 2 * b * h * (n + tail) * d * 2 <= min(self.prefetch_bytes, WINDOW_BYTES)

    def _clear_prefetch_state(self) -> None:
        self._prefetch_off = False  # a prefetch ran out of memory in this chunk: none until commit()
        # prefetched windows attended / dropped as stale / not taken for lack of memory (that layer decodes in line)
        self.prefetch_stats = {"used": 0, "dropped": 0, "no_memory": 0}

    def _take_prefetch(self, L: _Layer, tail: int | None):
        """L's prefetched (K, V) window if it holds L's history and this tail, else None (dropped; tail None: drop
        it). The current stream waits for the decode either way, so the buffers are safe to use or free on it."""
        p, L.prefetch = L.prefetch, None
        if p is None:
            return None
        t, ks, vs, event = p
        torch.cuda.current_stream(ks.device).wait_event(event)
        if t != tail or ks.shape[2] != L.hist[0].shape[2] + tail:
            self.prefetch_stats["dropped"] += 1
            return None
        self.prefetch_stats["used"] += 1
        return ks, vs

    def _drop_prefetch(self, L: _Layer) -> None:
        self._take_prefetch(L, None)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as BF16 [B, H, tokens, D]: sink, history, pending and current tokens in time order
        (decoded: tests and analyses only)."""
        L = self._layer(layer, "read")
        if L.buf is None:
            raise RuntimeError(f"read: layer {layer} holds nothing (write the current chunk first)")
        self._settle(L)
        self._wait(L)
        self._store_loose(L, "read")
        out = []
        for i in range(2):
            h = L.hist[i]
            parts = [L.buf[i][:, :, :L.n_sink]]
            if isinstance(h, PackedSequence):
                y = h.decompress()
                if i == 0 and self._pre_rope:
                    y = apply_rope(y, self._angles(L.pos_hist, y.device, y.shape[3]))
                parts.append(y)
            elif h is not None:
                parts += [compression.decompress(p) for p in h]
            parts += L.chunks(i)
            out.append(torch.cat([p.to(torch.bfloat16) for p in parts], 2))
        return out[0], out[1]

    # ---- accounting ---------------------------------------------------------------------------------------
    def tokens(self, layer: int = 0) -> int:
        """Tokens a chunk attends to in `layer` (sink + history + pending + current)."""
        L = self._layer(layer, "tokens")
        return L.n_sink + self._hist_tokens(L) + L.n_pending + L.n_cur

    def memory(self) -> dict:
        """Bytes held, by component and in total, and the BF16 bytes of the same tokens. Components (they sum to
        `total`): codes, scales, ids, centroids, positions (pre-rope: each packed or pending chunk's RoPE positions),
        bf16, workspace; a packed sequence's arrays count with the 256-byte alignment each takes in its one
        allocation (so `total` is the bytes allocated, not the `Packed.components()` of its chunks summed). `bf16` counts the whole allocated BF16 buffers
        (sink, pending and current zones, with their reserved room) and any full-precision tokens a method keeps
        inside its packed history. The BF16 equivalent is what a BF16 cache of the same tokens holds: the sink,
        history, pending and current tokens, plus, for method "bf16" itself, its buffers' rounding room (so it is
        always 1.0x); a compressed cache's idle current-chunk slot between chunks is bytes it holds, and equivalent
        only where a BF16 cache holds one too: a wrapped rolling window, whose ring keeps the slot of the chunk the
        next write evicts. So with commit_every 1 the equivalent is what a BF16 cache of the same settings holds at
        the same point, up to that cache's allocation rounding on CUDA (2 MiB blocks); with commit_every k > 1 the
        compressed cache holds up to k - 1 pending chunks beyond the window, and the equivalent counts those tokens
        in BF16 too (a BF16 cache of the same window would not hold them). `bf16` split by zone (not components:
        they sum to `bf16` exactly, not counted again in `total`):
        - bf16_sink: the sink's tokens;
        - bf16_pending: the committed chunks not packed yet (method "bf16": its whole history past the sink);
        - bf16_current: the rest of the buffers: the current chunk's slot (held between chunks too) and the
          buffers' reserved room (room for `commit_every` chunks; on CUDA, the allocator granule's rounding);
        - bf16_residual: full-precision tokens inside the packed history (kivi's key tail that fills no token
          group; 0 for the other methods)."""
        comp = {c: 0 for c in MEMORY_COMPONENTS}
        zones = {z: 0 for z in ("bf16_sink", "bf16_pending", "bf16_current", "bf16_residual")}
        equiv, positions = 0, {}
        for L in self.layers:
            if L.buf is not None:
                b, h, cap, d = L.buf[0].shape
                held = sum(t.numel() * t.element_size() for t in L.buf)
                comp["bf16"] += held
                per_token = held // cap  # K + V bytes of one token
                zones["bf16_sink"] += L.n_sink * per_token
                zones["bf16_pending"] += L.n_pending * per_token
                zones["bf16_current"] += (cap - L.n_sink - L.n_pending) * per_token
                # the BF16 cache's own reserved room (allocator rounding) is its equivalent too, so "bf16" is 1.0x;
                # a compressed cache's room (the current chunk's slot between chunks, commit_every room) is not:
                # a BF16 cache holds no such slot between chunks
                room = cap - (L.n_sink + L.n_pending + L.n_cur) if self.method == "bf16" else self._ring_slot_room(L)
            elif L.hist[0] is not None:  # a history installed before any write (benchmarks)
                h0 = L.hist[0]
                b, h, _, d = h0.shape if isinstance(h0, PackedSequence) else h0[0].shape
                room = 0
            else:
                continue
            equiv += 2 * b * h * d * 2 * (L.n_sink + self._hist_tokens(L) + L.n_pending + L.n_cur + room)
            for i in range(2):
                for name, nbytes in _stored(L.hist[i]):
                    c = COMPONENTS.get(name, name)
                    comp[c] = comp.get(c, 0) + nbytes
                    if c == "bf16":
                        zones["bf16_residual"] += nbytes
                if L.warm[i] is not None:
                    comp["centroids"] += L.warm[i].numel() * L.warm[i].element_size()
            # (a pending chunk's positions are one tensor shared by the layers: counted once)
            positions.update((p.data_ptr(), p.nbytes) for p in L.pos_hist + L.pos_pending)
        comp["positions"] = sum(positions.values())
        comp["workspace"] = self._graphed.nbytes if self._graphed is not None else 0  # the compression graphs
        comp["workspace"] += sum(t.nbytes for t in self._rope_memo.values()
                                 if t is not None)  # and the kernel's rotation tables (pre-rope keys)
        total = sum(comp.values())
        return {**comp, **zones, "total": total, "bf16_equivalent": equiv,
                "compression_ratio": equiv / total if total else 1.0}

    def _ring_slot_room(self, L: _Layer) -> int:
        """Tokens a BF16 cache of these settings holds beyond L's tokens: once its rolling window has wrapped, its
        ring keeps the slot of the chunk being written, between chunks too (holding the chunk the next write
        evicts); a compressed cache evicts at the commit instead, so between chunks its history is a chunk short of
        what the BF16 ring holds."""
        frames = self.frames + (self.chunk_frames if L.committed else 0)  # (a layer committed before commit())
        if self.window_frames is None or frames <= self.sink_frames + self.window_frames:
            return 0  # (not wrapped: a BF16 cache holds the same tokens)
        ring = self.window_frames * self.tokens_per_frame + self.chunk_tokens
        return max(0, ring - (self._hist_tokens(L) + L.n_pending + L.n_cur))

    def reset(self) -> None:
        """Forget everything (a new video), the compression graphs and their memory too: a reset cache holds no
        bytes (the next video captures its graphs again, at its first warm-started commit)."""
        self._join()  # (queued commits still read the buffers dropped here)
        for L in self.layers:
            self._drop_prefetch(L)  # (and queued decodes still write theirs)
        self.layers = [_Layer(self.chunk_tokens) for _ in range(self.num_layers)]
        self.frames = 0
        self.commits = 0
        self.resets += 1  # (a video loop that reset the cache checks that no other one has since)
        self._clear_prefetch_state()
        self.reads.clear()
        self._positions = None
        self._rope_memo = {}
        if self._graphed is not None:
            self._graphed.clear()


def _preset(name: str | None, x: torch.Tensor):
    """The GPU compress kernels' preset `name` inside the block (None: their default), where they run on x: the
    torch reference has none to set (and entering it would import the kernels, so triton, which a CPU install lacks)."""
    if name is None or not use_kernels(x):
        return contextlib.nullcontext()
    from .kernels.compress import use_variant
    return use_variant(name)


def _window_pair(b: int, h: int, n: int, d: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty BF16 K and V staging buffers [b, h, n, d] for a prefetched window."""
    ks = torch.empty(b, h, n, d, device=dev, dtype=torch.bfloat16)
    return ks, torch.empty_like(ks)


def _owners_wait(streams: dict) -> None:
    """The streams whose memory pools the cache's blocks can come from wait for these side streams: the current
    one, and the generation stream (qvg.streams) when that is another (a cache dropped or reset outside the
    pipeline's block, or on another thread, hands its blocks back to the pool of the stream that made them)."""
    for dev, side in streams.items():
        current = torch.cuda.current_stream(dev)
        current.wait_stream(side)
        gen = reserved(dev)
        if gen is not None and gen != current:
            gen.wait_stream(side)


def _stream(streams: dict, dev, sms: int | None = None) -> torch.cuda.Stream:
    """The side stream of `dev` in `streams` (made on first use). torch hands out its pool's streams in turn, so a
    new one can be the stream the chunk runs on (the current one, or the generation stream): such a draw is skipped,
    or the side stream's work would queue behind the forward. sms: a green context's stream on that many SMs."""
    if dev not in streams and sms is not None:
        streams[dev] = green_stream(dev, sms)
    if dev not in streams:
        avoid = (torch.cuda.current_stream(dev), reserved(dev))
        s = torch.cuda.Stream(dev)
        while s in avoid:
            s = torch.cuda.Stream(dev)
        streams[dev] = s
    return streams[dev]


def _stored(hist) -> list:
    """(name, bytes held) of each array a history holds: a PackedSequence's, with the alignment its allocation
    gives each (`carved_bytes`: the components then sum to the bytes allocated), or each Packed unit's."""
    if hist is None:
        return []
    if isinstance(hist, PackedSequence):
        return [(name, carved_bytes(t.nbytes)) for name, t in hist.tensors.items()]
    return [(name, t.nbytes) for p in hist for name, t in p.tensors.items()]


def _grown(old: torch.Tensor | None, used: int, need: int, like: torch.Tensor) -> torch.Tensor:
    """A BF16 [B, H, cap, D] buffer (cap >= need) holding the first `used` tokens of `old`. On CUDA, cap fills the
    allocator's 2 MiB granule: the caching allocator hands out (and `memory_allocated` counts) a block of a large
    size rounded up to 2 MiB anyway; as buffer room those bytes are usable and accounted, not hidden slack."""
    cap = need
    if like.is_cuda:
        per_token = like.shape[0] * like.shape[1] * like.shape[3] * 2
        if need * per_token >= 1 << 20:
            cap = -(-need * per_token // (2 << 20)) * (2 << 20) // per_token
    new = torch.empty(*like.shape[:2], cap, like.shape[3], dtype=torch.bfloat16, device=like.device)
    if old is not None and used:
        new[:, :, :used] = old[:, :, :used]
    return new


def _misspelt(options: dict, method: str) -> str | None:
    """A message for an option neither the method nor KVCache takes that is close to one of KVCache's own arguments
    (window=4 for window_frames=4: it would be reported as an unknown option of the method), else None."""
    import difflib
    import inspect
    own = [p for p in inspect.signature(KVCache.__init__).parameters if p not in ("self", "options")]
    taken = compression.methods(details=True)[method]["defaults"] if method != "bf16" else {}
    for k in options:
        if k in taken:
            continue
        near = difflib.get_close_matches(k, own, n=1, cutoff=0.6) or [p for p in own if p.startswith(k + "_")]
        if near:
            return f"KVCache got {k}=..., which is no argument of the cache nor an option of {method!r}; did you " \
                   f"mean {near[0]}?"
    return None


def cache_options(method: str, options: dict, unit_tokens: int) -> dict:
    """A cache's options: the given ones, and for qvg / qvg-pro K = default_centroids(unit) unless given
    (compress's preset, 256, suits larger units)."""
    o = dict(options)
    if method != "bf16" and "centroids" in compression.methods(details=True)[method]["defaults"] and \
            o.get("centroids") is None:
        o["centroids"] = default_centroids(unit_tokens)
    return o


def unit_options(method: str, options: dict, role: str) -> dict:
    """What a commit passes `compress` for a unit of keys (role "key") or values: kivi also gets its role, and no
    full-precision window of its own (the cache's pending / current zones are KIVI's recent window)."""
    return {**options, "role": role, "residual": 0} if method == "kivi" else dict(options)


class ReferenceReadWarning(UserWarning):
    """A GPU cache of a packed-read method (rtn, qvg, qvg-pro) at a head dim the Triton kernels do not take (80, 96):
    it runs the torch reference, whose read materializes each layer's BF16 history (KVCache's first write)."""


class UnitCostWarning(UserWarning):
    """A cache whose every packed unit takes more bits per element than BF16 (KVCache's first write): no history
    length repays it (qvg-generate says so in its own words and filters this)."""


def unit_bits(method: str, options: dict, unit_tokens: int, head_dim: int) -> float:
    """Bits per element of one packed unit (a commit of unit_tokens tokens x head_dim channels) with the cache's
    options: the most of keys' and values' where they differ (kivi). Above 16 the unit is larger than BF16."""
    roles = ("key", "value") if method == "kivi" else ("key",)
    return max(compression.bits_per_element(method, (1, 1, unit_tokens, head_dim),
                                            **unit_options(method, options, r)) for r in roles)


def check_options(method: str, options: dict, unit_tokens: int, head_dim: int | None = None) -> dict:
    """A cache's options checked as compress checks them at each commit (ValueError naming the first bad one); the
    options resolved (the method's presets filled in; kivi's role and window left out). head_dim None (a cache
    being made, before any write): a head dim the block size divides, so what depends on the model's head dim is
    checked at the first write."""
    if head_dim is None:
        bs = options.get("block_size", compression.methods(details=True)[method]["defaults"].get("block_size"))
        head_dim = 8 * bs if is_int(bs) and bs > 0 else 128
    for role in (("key", "value") if method == "kivi" else ("key",)):
        resolved = compression.resolve_options(method, (1, 1, unit_tokens, head_dim),
                                               **unit_options(method, options, role))
    return {k: v for k, v in resolved.items() if k not in ("role", "residual")}


def default_centroids(unit_tokens: int) -> int:
    """K per compressed unit: the largest power of two <= tokens / 64 (centroids then cost <= 0.25 bit per
    element: 16 K / N), at most 256, at least 4 (units under 256 tokens cannot keep that cost with more than one
    centroid; 4 keeps some grouping), and never more than tokens / 4. Non-decreasing in the unit's tokens.
    Self-Forcing's 4,680-token chunk gets K = 64: 2.41 bits per element, a 6.6x history (eval/results/pipeline-h100.md)."""
    return max(1, min(unit_tokens // 4, 256, max(4, 1 << max(unit_tokens // 64, 1).bit_length() - 1)))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count
