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
