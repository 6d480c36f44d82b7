"""eval/compress_host.py: without a GPU it refuses with one error line and exit status 2 (the measurement itself
runs on the GPU, in the device calls that wrote eval/results/compress-host-h200.*.json)."""
import pytest
import torch

from qvg.eval import compress_host


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_gpu(capsys):
    assert compress_host.main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compress_host: needs a CUDA GPU"]


def test_host_probe_times_a_fixed_loop():
    from qvg.eval.bench_kernels import host_probe_ms
    assert 0 < host_probe_ms(1000) < host_probe_ms(400_000)  # 400x the loop: longer on any host
