"""qvg.eval.profile_attention's command line: bad input is refused with one line and exit 2 before any GPU work."""
import pytest

from qvg.eval import profile_attention


@pytest.mark.parametrize("argv,says", [(["--only", "256,64,8"], "is not BLOCK_M,BLOCK_N,WARPS,STAGES"),
                                       (["--only", "256,64,x,2"], "is not BLOCK_M"),
                                       (["--only", ";"], "names no tile config"),
                                       (["--rounds", "0"], "--rounds must be >= 1"),
                                       (["--formats", "qvg,fp8"], "unknown format 'fp8'"),
                                       (["--keys", "1000"], "multiples of the 4,680-token chunk"),
                                       (["--centroids", "0"], "--centroids must be in 1..4680"),
                                       (["--baseline", "/no/such/file.py"], "is not a file")])
def test_bad_input_one_line(argv, says, capsys):
    assert profile_attention.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_configs_are_packed_attention_keywords():
    import inspect
    from qvg.kernels.attention import packed_attention
    params = set(inspect.signature(packed_attention).parameters)
    for cfg in profile_attention.parse_only(profile_attention.DEFAULT):
        assert set(cfg) <= params
    assert profile_attention.parse_only("256,64,8,2,3") == [dict(block_m=256, block_n=64, num_warps=8, num_stages=2,
                                                                 splits=3)]


def test_baseline_loads_another_planes_kernel():
    import pathlib
    import qvg.kernels.attention_planes as current
    from qvg.eval.profile_dequant import _load_baseline
    kernel = _load_baseline(str(pathlib.Path(current.__file__)), "_attn_planes_kernel")
    assert kernel is not current._attn_planes_kernel and kernel.fn.__name__ == "_attn_planes_kernel"
    stream = kernel.fn.__globals__["_attn_stream_kernel"]  # (main() takes the stream-K kernel from the same load)
    assert stream is not current._attn_stream_kernel and "FULL" in stream.arg_names


def test_baseline_kernels_get_only_the_arguments_they_take():
    """A baseline kernel from before d45552c takes no FULL, and one from before 79551df none of the RoPE arguments:
    Adapted passes packed_attention's arguments for the current kernel by name, less those, with the launch
    options."""
    calls = []

    class Fake:
        def __init__(self, *names):
            self.arg_names = list(names)

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))
    current = Fake("q_ptr", "FULL", "rope_ptr", "D", "ROPE")
    profile_attention.Adapted(Fake("q_ptr", "D"), current)[(3,)](1, 0, 7, D=128, ROPE=False, num_warps=8)
    assert calls == [((3,), (), {"q_ptr": 1, "D": 128, "num_warps": 8})]
    # a baseline from 79551df to e957e25 takes the rotation as frame0_ptr, H_OFF, W_OFF: given their no-rope values
    calls.clear()
    current = Fake("q_ptr", "rope_ptr", "rpos_ptr", "R", "D")
    old = Fake("q_ptr", "rope_ptr", "frame0_ptr", "R", "H_OFF", "W_OFF", "D")
    profile_attention.Adapted(old, current)[(2,)]("q", "tab", "pos", 0, D=64)
    assert calls == [((2,), (), {"q_ptr": "q", "rope_ptr": "tab", "R": 0, "D": 64, "frame0_ptr": "pos", "H_OFF": 0,
                                 "W_OFF": 0})]
