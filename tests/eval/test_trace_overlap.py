"""eval/trace_overlap.py's split of side-stream kernel time by what the main stream ran meanwhile (CPU: a
hand-made kernel list)."""
import pytest

from qvg.eval.trace_overlap import split


def _k(name, stream, t0, t1):
    return {"name": name, "stream": stream, "t0": t0, "t1": t1}


def test_split_by_main_stream_activity():
    kernels = [_k("gemm", 7, 0, 10), _k("cudnn_fmha_fprop", 7, 10, 30), _k("gemm", 7, 35, 40),
               _k("_dequant_kernel", 20, 5, 15),  # 5 during the gemm, 5 during attention
               _k("_dequant_kernel", 20, 28, 36),  # 2 during attention, 5 idle, 1 during the gemm
               _k("_assign_kernel", 13, 31, 34),  # main idle
               _k("_pack_kernel", 13, 38, 44)]  # 2 during the gemm, 4 after the main stream's last kernel
    got = split(kernels)
    assert got["decode"] == {"kernels": 2, "gpu_us": 18, "during_attention_us": 7, "during_other_main_kernels_us": 6,
                             "after_main_us": 0, "main_idle_us": 5}
    assert got["commit"] == {"kernels": 2, "gpu_us": 9, "during_attention_us": 0, "during_other_main_kernels_us": 2,
                             "after_main_us": 4, "main_idle_us": 3}
    assert got["main"] == {"span_us": 40, "kernel_us": 35, "idle_us": 5, "attention_us": 20, "attention_kernels": 1}


def test_split_needs_attention():
    with pytest.raises(RuntimeError, match="no attention kernel"):
        split([_k("gemm", 7, 0, 1)])


def test_gaps_place_the_main_streams_idle_time():
    from qvg.eval.trace_overlap import gaps
    kernels = [_k("fmha_self", 7, 0, 10), _k("fmha_cross", 7, 10, 12),  # layer-forward 0 (2 attention kernels)
               _k("gemm", 7, 112, 120),  # 100 us gap in layer-forward 1: 30 of it under a decode, 50 under commits
               _k("_dequant_kernel", 20, 20, 50),
               _k("_assign_kernel", 13, 40, 60), _k("_pack_kernel", 13, 55, 90),  # union 40-90, 10 shared
               _k("fmha_self", 7, 125, 130)]  # 5 us gap
    got = gaps(kernels, layers=2, forwards=2)
    assert got["by_length_us"] == {"lt20": 5, "20to200": 100, "ge200": 0}
    assert got["by_side_us"] == {"decode": 30, "commit": 50, "nothing": 100 - 70 + 5}
    assert got["by_forward_us"] == [105, 0] and got["by_layer_us"] == [0, 105]
    assert got["longest"][0] == {"us": 100, "layer_forwards_before": 1, "decode_us": 30, "commit_us": 50,
                                 "next_op": "gemm"}
    assert got["by_next_op"] == [{"op": "gemm", "us": 100, "gaps": 1}, {"op": "fmha_self", "us": 5, "gaps": 1}]


def test_copies_and_fills_count_as_stream_operations():
    from qvg.eval.trace_overlap import _kernels
    ev = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 2, "args": {"stream": 7}},
          {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 3, "dur": 1, "args": {"stream": 7}},
          {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 1, "args": {}}]
    assert [k["name"] for k in _kernels(ev)] == ["gemm", "[gpu_memcpy] Memcpy DtoD"]


def test_gaps_split_into_the_hosts_part_and_the_gpus():
    from qvg.eval.trace_overlap import gaps, with_launches

    def op(name, t0, t1, corr):
        return {"cat": "kernel", "name": name, "ts": t0, "dur": t1 - t0, "args": {"stream": 7, "correlation": corr}}

    def call(t0, dur, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0, "dur": dur, "args": {"correlation": corr}}
    ev = [op("fmha", 0, 10, 1), call(-50, 4, 1),
          op("add", 12, 20, 2), call(-40, 4, 2),  # queued long before: the 2 us gap is the GPU's
          op("gemm", 30, 40, 3), call(27, 2, 3),  # called 7 us after the stream freed, started 3 us later
          op("add", 45, 50, 4)]  # no call in the trace: counted apart
    ks = with_launches(ev)
    assert [k["launch"] for k in ks] == [(-50, 4), (-40, 4), (27, 2), None]
    got = gaps(ks, layers=1, forwards=1)
    assert got["host"] == {"matched_gaps": 2, "gaps": 3, "host_us": 7, "gpu_us": 2 + 3, "lt20_host_us": 7,
                           "median_lead_us": 50, "mean_call_us": 10 / 3}
    by_op = {e["op"]: e for e in got["by_next_op"]}
    assert by_op["gemm"]["host_us"] == 7 and by_op["gemm"]["mean_call_us"] == 2
    assert by_op["add"]["host_us"] == 0 and by_op["add"]["mean_call_us"] == 4 and by_op["add"]["gaps"] == 2
    assert "host" not in gaps([{**k, "launch": None} for k in ks], layers=1, forwards=1)


def test_bad_arguments_give_one_error_line(capsys):
    from qvg.eval.trace_overlap import main
    for args in (["--methods", "bf16,nope"], ["--options", "[1]"], ["--options", "{x"]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
