"""bench_pipeline's round order and method-list check (CPU: the timing needs a GPU)."""
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
