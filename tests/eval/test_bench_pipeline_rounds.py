"""bench_pipeline's round order and method-list check (CPU: the timing needs a GPU)."""
import pytest
import torch

from qvg.eval.bench_pipeline import rotated


def test_rotated_places_each_method_in_each_place_equally():
    methods = ["bf16", "qvg", "qvg-pro"]
    rounds = [rotated(methods, i) for i in range(9)]
    assert rounds[0] == methods and rounds[1] == ["qvg", "qvg-pro", "bf16"] and rounds[3] == methods
    for place in range(3):
        assert sorted(r[place] for r in rounds) == sorted(methods * 3)
    assert all(sorted(r) == sorted(methods) for r in rounds)


def test_rotated_edge_cases():
    assert rotated([], 4) == []
    assert rotated(["a"], 7) == ["a"]


def test_parse_methods_checks_every_method_and_the_options():
    import pytest

    from qvg.eval.bench_pipeline import parse_methods
    assert parse_methods("bf16,qvg:noprefetch") == (["bf16", "qvg:noprefetch"], None)
    assert parse_methods("qvg", '{"centroids": 64}') == (["qvg"], {"centroids": 64})
    with pytest.raises(ValueError, match="unknown cache method 'nope'"):
        parse_methods("bf16,nope")
    with pytest.raises(ValueError, match="--options is not JSON"):
        parse_methods("qvg", "{centroids: 64")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_methods("qvg", "[64]")


def test_chunks_run_on_the_generation_stream_unless_default_stream(monkeypatch):
    """method_runner wraps the chunk and its forwards in qvg.streams' block, as the pipelines do, except with
    `default-stream` (CPU: the chunk and the block replaced by recorders)."""
    import contextlib

    from qvg import streams
    from qvg.eval import bench_pipeline as bp
    log = []

    @contextlib.contextmanager
    def block(dev):
        log.append("enter")
        yield None
        log.append("exit")
    monkeypatch.setattr(streams, "generation_stream", block)
    monkeypatch.setattr(bp, "chunk_runner", lambda *a, **k: (lambda: log.append("chunk"), lambda: log.append("fwd")))
    chunk, forwards = bp.method_runner(None, None, "qvg")
    chunk()
    forwards()
    assert log == ["enter", "chunk", "exit", "enter", "fwd", "exit"]
    log.clear()
    chunk, forwards = bp.method_runner(None, None, "qvg:default-stream")
    chunk()
    forwards()
    assert log == ["chunk", "fwd"]


def test_every_flag_packs_every_n_chunks_and_times_a_whole_cycle(monkeypatch):
    """`qvg-pro:every=2` builds a cache with commit_every=2; method_runner's chunk is then two chunks (run() divides
    the time by chunks_per_timing); bad every= values are refused before anything runs."""
    import types

    from qvg.eval import bench_pipeline as bp
    model = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: 16)
    assert bp.new_cache(model, "qvg-pro:every=2", 6, {}).commit_every == 2
    assert bp.new_cache(model, "qvg-pro", 6, {}).commit_every == 1
    assert bp.commit_every("qvg:sync:every=4") == 4 and bp.commit_every("bf16") == 1
    for bad in ("qvg:every=0", "qvg:every=x", "qvg:every=2:every=3", "bf16:every=2"):
        with pytest.raises(ValueError, match="every=N"):
            bp.parse_method(bad)
    log = []
    monkeypatch.setattr(bp, "chunk_runner", lambda *a, **k: (lambda: log.append("chunk"), lambda: log.append("fwd")))
    chunk, _ = bp.method_runner(None, None, "qvg-pro:every=3:default-stream")
    chunk()
    assert log == ["chunk"] * 3


def test_attended_frames_of_a_commit_cycle():
    """_attended: the past frames each chunk of the next commit cycle attends, with units of several chunks over a
    rolling window (more than window_frames: KVCache._evict)."""
    from qvg.cache import KVCache
    from qvg.eval.bench_pipeline import _attended
    cache = KVCache(1, "qvg", chunk_frames=1, tokens_per_frame=8, window_frames=3, commit_every=2, centroids=2,
                    block_size=16)
    for _ in range(7):
        kv = torch.randn(2, 1, 2, 8, 16)
        cache.write(0, kv[0], kv[1])
        cache.commit()
    assert _attended(cache) == [3.0, 4.0]  # 1 unit of 2 chunks packed + 1 pending; then 4 before the next pack
    assert _attended(KVCache(1, "bf16", chunk_frames=1, tokens_per_frame=8)) == [0.0]


def test_prefetch_split_flag():
    """`qvg-pro:prefetch-split` builds a cache with prefetch_at="split"; two prefetch placements are refused."""
    import types

    from qvg.eval import bench_pipeline as bp
    model = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: 16)
    assert bp.new_cache(model, "qvg-pro:prefetch-split", 6, {}).prefetch_at == "split"
    assert bp.new_cache(model, "qvg-pro", 6, {}).prefetch_at == "before"
    with pytest.raises(ValueError, match="at most"):
        bp.parse_method("qvg:prefetch-split:noprefetch")


def test_every_is_refused_where_one_chunk_is_timed(capsys):
    """every=N only in bench_pipeline's plain rounds (per commit cycle): --max-history, --split and the other tools
    (checked_methods, profile_pipeline) time one chunk, so they refuse it with one line, exit 2."""
    from qvg.eval import bench_pipeline as bp
    from qvg.eval import profile_pipeline
    assert bp.parse_methods("bf16,qvg-pro:every=2", cycles=True) == (["bf16", "qvg-pro:every=2"], None)
    with pytest.raises(ValueError, match="every=N is timed per commit cycle"):
        bp.parse_methods("bf16,qvg-pro:every=2")
    for argv in (["--max-history", "qvg:every=2"], ["--split", "--methods", "bf16,qvg:every=2"]):
        assert bp.main(argv) == 2
        assert "every=N is timed per commit cycle" in capsys.readouterr().err
    assert profile_pipeline.main(["--methods", "bf16,qvg:every=2"]) == 2
    assert "every=N" in capsys.readouterr().err
    from qvg.eval import find_host_syncs
    assert find_host_syncs.main(["--methods", "bf16,qvg:every=2"]) == 2
    assert "every=N" in capsys.readouterr().err


def test_sms_flags_confine_the_side_streams(monkeypatch):
    """`commit-sms=N` / `prefetch-sms=N` build a cache whose commits / decodes go to a green context's stream of N
    SMs (KVCache commit_sms / prefetch_sms); bad values are refused before anything runs."""
    import types

    from qvg.eval import bench_pipeline as bp
    model = types.SimpleNamespace(tokens_per_latent_frame=lambda h, w: 16)
    c = bp.new_cache(model, "qvg-pro:commit-sms=16:prefetch-sms=32", 6, {})
    assert (c.commit_sms, c.prefetch_sms) == (16, 32)
    assert (bp.new_cache(model, "qvg-pro", 6, {}).commit_sms, bp.new_cache(model, "bf16", 6, {}).prefetch_sms) == \
        (None, None)
    for bad in ("qvg:commit-sms=0", "qvg:prefetch-sms=x", "qvg:commit-sms=2:commit-sms=3"):
        with pytest.raises(ValueError, match="-sms=N at most"):
            bp.parse_method(bad)
