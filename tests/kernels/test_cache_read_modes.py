"""KVCache(read=...): the GPU read of a packed history through the packed-cache attention kernels ("staged":
Triton flash over small decoded windows; "fused": dequantized on chip) against the default "window" read (decode
+ SDPA). On the CPU the kernels run under the Triton interpreter. In the Self-Forcing pattern (transient denoising
writes, the clean re-run committing each layer) through the rolling window's wrap, with GQA: attention outputs
agree within BF16 attention's error, and the committed histories are bitwise the same (the read changes no
commit). Bad combinations are refused when the cache is made."""
import pytest
import torch

import qvg.backend
from kernel_helpers import clustered, rel_err, self_forcing_chunk
from qvg.cache import CACHE_METHODS, READ_MODES, KVCache, read_error, read_modes

TPF, CF, LAYERS, D = 16, 2, 2, 32
TOL = 2e-2  # relative Frobenius error between two BF16 attentions of the same history


@pytest.fixture(autouse=True)
def _kernel_path(device, monkeypatch):
    """The cache's GPU read path on the CPU too (the Triton interpreter runs the kernels on CPU tensors)."""
    if device == "cpu":
        monkeypatch.setattr(qvg.backend, "use_kernels", lambda t: True)


def _chunk(c, x, q, positions=None):
    return self_forcing_chunk(c, x, q, LAYERS, denoise=1, positions=positions)


def _positions(chunk: int) -> torch.Tensor:
    pos = torch.zeros(1, CF, 3, dtype=torch.int32)
    pos[..., 0] = torch.arange(chunk * CF, chunk * CF + CF)
    return pos


@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
@pytest.mark.parametrize("read", ["staged", "fused"])
def test_packed_reads_match_the_window_read(device, method, read):
    """Midrise grid, no sink or pending zone: the transient denoising writes are held by reference and read
    straight from the model's K / V."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, centroids=4, block_size=16,
              grid="midrise")
    caches = [KVCache(LAYERS, method, read=r, **kw) for r in ("window", read)]
    q = torch.randn(1, 4, CF * TPF, D, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    for i in range(4):  # the history grows, then the ring fills and wraps
        x = clustered(2 * LAYERS, 2, CF * TPF, D, spread=1.0, noise=0.5, seed=60 + i).bfloat16().to(device)
        outs = [_chunk(c, x, q) for c in caches]
        for j, (a, b) in enumerate(zip(*outs)):
            assert torch.isfinite(b).all() and rel_err(b, a) < TOL, (i, j, rel_err(b, a))
    for layer in range(LAYERS):
        for a, b in zip(caches[0].read(layer), caches[1].read(layer)):
            assert torch.equal(a, b)
    assert caches[1].prefetch_stats["used"] == 0  # (nothing is decoded ahead for the kernels' reads)
    # every attend after the first chunk read a packed history, by the path asked for (KVCache.reads)
    assert caches[0].reads == {"window": 3 * 2 * LAYERS} and caches[1].reads == {read: 3 * 2 * LAYERS}


@pytest.mark.parametrize("read", ["staged", "fused"])
def test_packed_reads_with_sink_pending_and_the_default_grid(device, read):
    """qvg-pro at its default grid ("auto": sym or midrise per group), a BF16 sink and a pending chunk (units of two
    chunks): the tail the kernels read is sink + pending + current."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, window_frames=4 * CF, sink_frames=CF, commit_every=2,
              centroids=4, block_size=16)
    caches = [KVCache(LAYERS, "qvg-pro", read=r, **kw) for r in ("window", read)]
    q = torch.randn(1, 4, CF * TPF, D, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    for i in range(6):
        x = clustered(2 * LAYERS, 2, CF * TPF, D, spread=1.0, noise=0.5, seed=80 + i).bfloat16().to(device)
        outs = [_chunk(c, x, q) for c in caches]
        for j, (a, b) in enumerate(zip(*outs)):
            assert torch.isfinite(b).all() and rel_err(b, a) < TOL, (i, j, rel_err(b, a))
    L = caches[1].layers[0]
    assert L.n_sink > 0 and L.hist[0] is not None  # (the sink and a packed history both took part)


@pytest.mark.parametrize("method,read,d", [("qvg", "staged", 32), ("qvg", "fused", 64), ("qvg-pro", "fused", 64),
                                           ("qvg", "fused", 32)])
def test_packed_reads_with_keys_stored_before_rope(device, monkeypatch, method, read, d):
    """Pre-RoPE keys rotated as the staged read decodes them, over several staging windows (each window's rows
    start at an offset into the history), or on chip by the fused read under the interpreter (head dim 64 at 2 bits:
    16-column code planes, rotated plane by plane; head dim 32: 8-column planes, joined; a GPU reads both staged,
    `rope_on_chip`), with GQA and a rolling window whose ring has wrapped (slots out
    of frame order) when the kernels read it."""
    import qvg.kernels.attention as ka
    monkeypatch.setattr(ka, "STAGING_BYTES", 1)  # the smallest window: one 64-token tile of history at a time
    heads = []  # the ring's head in each rotated read by the kernels

    def recording(fn):
        def run(q, k_hist, *a, rope=None, **kw):
            if rope is not None:
                heads.append(k_hist.head)
            return fn(q, k_hist, *a, rope=rope, **kw)
        return run
    for name in ("packed_attention", "staged_attention"):
        monkeypatch.setattr(ka, name, recording(getattr(ka, name)))
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, window_frames=4 * CF, centroids=4, block_size=16,
              key_storage="pre-rope")
    caches = [KVCache(LAYERS, method, read=r, **kw) for r in ("window", read)]
    q = torch.randn(1, 4, CF * TPF, d, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    for i in range(6):
        x = clustered(2 * LAYERS, 2, CF * TPF, d, spread=1.0, noise=0.5, seed=70 + i).bfloat16().to(device)
        outs = [_chunk(c, x, q, positions=_positions(i)) for c in caches]
        for j, (a, b) in enumerate(zip(*outs)):
            assert rel_err(b, a) < TOL, (i, j, rel_err(b, a))
    assert heads and max(heads) > 0  # (read while the ring's oldest chunk was not in slot 0)


def test_fused_read_of_pre_rope_keys_is_staged_where_rope_is_not_on_chip(device, monkeypatch):
    """Where rope_on_chip says no (a GPU: on chip the rotation is redone for every query block, 7-10x slower than the
    staged read), the fused read of pre-RoPE keys goes to the staged read (the same history, the same rotation)."""
    import qvg.kernels.attention as ka
    assert ka.rope_on_chip(torch.device("cpu")) and not ka.rope_on_chip(torch.device("cuda"))
    seen, used = [], []
    monkeypatch.setattr(ka, "rope_on_chip", lambda dev: seen.append(dev.type) or False)
    monkeypatch.setattr(ka, "packed_attention", lambda *a, **k: used.append("fused"))
    staged = ka.staged_attention
    monkeypatch.setattr(ka, "staged_attention", lambda *a, **k: used.append("staged") or staged(*a, **k))
    c = KVCache(LAYERS, "qvg", read="fused", chunk_frames=CF, tokens_per_frame=TPF, centroids=4, block_size=16,
                key_storage="pre-rope", bits=4)
    q = torch.randn(1, 4, CF * TPF, D, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    for i in range(2):
        x = clustered(2 * LAYERS, 2, CF * TPF, D, seed=90 + i).bfloat16().to(device)
        _chunk(c, x, q, positions=_positions(i))
    assert used and set(used) == {"staged"} and set(seen) == {device}
    assert c.reads == {"staged": len(used)}  # (what a report names: the read that ran, not the one asked for)


@pytest.mark.parametrize("read", READ_MODES)
def test_pre_rope_keys_at_spatial_offsets_are_read_by_the_kernels(device, read):
    """Pre-RoPE keys at spatial offsets (a camera that pans, as the world model's), times from -4: the kernels'
    tables hold each frame's time and offsets, so every read takes the path asked for (KVCache.reads; fused reads
    pre-RoPE keys staged on a GPU), and agrees with the torch path (decode the whole history, rotate it by
    `frame_angles`: a cache whose tables are withheld)."""
    kw = dict(read=read, chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, centroids=4, block_size=16,
              key_storage="pre-rope", bits=4)
    c, ref = KVCache(LAYERS, "qvg", **kw), KVCache(LAYERS, "qvg", **kw)
    ref._rope_tables = lambda L, dev: None  # (the torch path's reads)
    heads, tables = [], c._rope_tables
    c._rope_tables = lambda L, dev: heads.append(L.hist[0].head) or tables(L, dev)
    q = torch.randn(1, 4, CF * TPF, D, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    for i in range(5):
        pos = _positions(i)
        pos[..., 0] -= 4  # (times before 0 too)
        pos[..., 1], pos[..., 2] = -3 * i, 2 * i - 5  # (the camera pans: rows up, columns right from the left)
        x = clustered(2 * LAYERS, 2, CF * TPF, D, seed=95 + i).bfloat16().to(device)
        for a, b in zip(_chunk(c, x, q, positions=pos), _chunk(ref, x, q, positions=pos)):
            assert rel_err(a, b) < TOL, (i, rel_err(a, b))
    assert max(heads) > 0  # (read while the ring had wrapped: slots out of time order, offsets per slot)
    from qvg.kernels.attention import rope_on_chip
    ran = "staged" if read == "fused" and not rope_on_chip(torch.device(device)) else read  # (a GPU: staged)
    assert c.reads == {ran: 4 * 2 * LAYERS} and ref.reads == {"reference": 4 * 2 * LAYERS}


def test_tables_refuse_positions_that_differ_across_the_batch():
    """One table serves the batch: positions that differ between samples leave the history to the torch path
    (None), anything else gets tables, spatial offsets and negative times included."""
    c = KVCache(LAYERS, "qvg", chunk_frames=CF, tokens_per_frame=TPF, key_storage="pre-rope")
    c._grid = (4, 4, 10000.0)
    pos = torch.zeros(2, 2, CF, 3, dtype=torch.int32)  # [units, batch, frames, 3]
    pos[..., 0] = torch.arange(CF)
    pos[1, ..., 0] += CF
    pos[..., 2] = 3
    assert c._make_tables(pos, 0, "cpu", D) is not None
    moved = pos.clone()
    moved[1, 1, :, 1] = 1  # sample 1 of the second unit sits a row lower
    assert c._make_tables(moved, 0, "cpu", D) is None
    early = pos.clone()
    early[0, :, 0, 0] = -1
    assert c._make_tables(early, 0, "cpu", D) is not None


def test_read_mode_errors():
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF)
    assert READ_MODES[0] == "window" and KVCache(1, "qvg", **kw).read_mode == "window"
    with pytest.raises(ValueError, match="read must be one of window, staged, fused"):
        KVCache(1, "qvg", read="flash", **kw)
    with pytest.raises(ValueError, match="not 'asym'"):
        KVCache(1, "rtn", read="fused", grid="asym", **kw)
    with pytest.raises(ValueError, match="not 1-bit"):
        KVCache(1, "qvg", read="fused", bits=1, **kw)


PACKED_READ = ("rtn", "qvg", "qvg-pro")  # the methods whose history is a PackedSequence, read by the kernels


@pytest.mark.parametrize("method", CACHE_METHODS)
def test_read_modes_by_method(method):
    """The packed reads ("staged", "fused") are taken by rtn / qvg / qvg-pro only; bf16 / kivi / quarot have no
    packed read and refuse them (instead of ignoring them). The default read is taken by every method."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF)
    assert KVCache(1, method, **kw).read_mode == "window" == KVCache(1, method, read="window", **kw).read_mode
    assert read_modes(method) == (READ_MODES if method in PACKED_READ else ("window",))
    for read in ("staged", "fused"):
        if method in PACKED_READ:
            assert read_error(method, read) is None and KVCache(1, method, read=read, **kw).read_mode == read
        else:
            with pytest.raises(ValueError) as e:
                KVCache(1, method, read=read, **kw)
            assert str(e.value) == read_error(method, read) == (
                f"method {method!r} supports read='window' only, not {read!r}: the staged and fused reads are for "
                "a packed rtn, qvg, qvg-pro history")


def test_read_error_is_the_caches_message():
    """read_error (qvg-generate's pre-flight check) says exactly what KVCache raises, for each refusal."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF)
    for method, read, storage, options in [("qvg", "flash", "post-rope", {}), ("kivi", "fused", "post-rope", {}),
                                           ("bf16", "staged", "pre-rope", {}),
                                           ("rtn", "fused", "post-rope", {"grid": "asym"}),
                                           ("qvg", "fused", "pre-rope", {"bits": 1})]:
        msg = read_error(method, read, options)
        assert msg
        with pytest.raises(ValueError) as e:
            KVCache(1, method, read=read, key_storage=storage, **options, **kw)
        assert str(e.value) == msg
    assert read_error("qvg", "staged", {"grid": "asym", "bits": 1}) is None
    assert read_error("bf16", "window") is None
    for method in ("rtn", "qvg", "qvg-pro"):  # every read takes pre-RoPE keys (fused: staged on a GPU)
        assert read_error(method, "fused") is None
        assert KVCache(1, method, read="fused", key_storage="pre-rope", **kw).read_mode == "fused"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.filterwarnings("error:The CUDA Graph is empty")
@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
@pytest.mark.parametrize("read", ["window", "fused"])
def test_a_cache_on_the_second_gpu_while_the_first_is_current(method, read):
    """K/V on cuda:1 while cuda:0 is current (a library caller's default): the Triton kernels, the compression's
    CUDA graphs and the side streams run on cuda:1 (they ran on the current device: 'cannot be accessed from
    Triton'), and every output and the history equal, bitwise, those of the same cache driven with cuda:1 current
    and of the same cache on cuda:0 (whose graphs were captured on torch's process-wide capture stream, made on
    the device current at the first capture: on the other device they replayed wrong work)."""
    kw = dict(chunk_frames=CF, tokens_per_frame=TPF, window_frames=2 * CF, centroids=4, block_size=16,
              grid="midrise", read=read)
    q = torch.randn(1, 4, CF * TPF, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    runs = []
    for current, on in ((0, 1), (1, 1), (0, 0), (1, 0)):
        with torch.cuda.device(current):
            cache = KVCache(LAYERS, method, **kw)
            outs = []
            for i in range(4):
                x = clustered(2 * LAYERS, 2, CF * TPF, D, spread=1.0, noise=0.5, seed=60 + i).bfloat16()
                outs += _chunk(cache, x.to(f"cuda:{on}"), q.to(f"cuda:{on}"))
            cache.wait_side_streams()
            torch.cuda.synchronize(on)
            assert all(o.device == torch.device(f"cuda:{on}") for o in outs)
            runs.append([t.cpu() for t in outs + [t for layer in range(LAYERS) for t in cache.read(layer)]])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
