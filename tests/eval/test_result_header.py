"""bench_kernels.result_header, the provenance of every GPU result file: the command carries the QVG_* settings
that change what runs (QVG_FAST_LAUNCH=0, say), not QVG_COMMIT, which is the commit field, and CUDA's run settings
(CUDA_DEVICE_MAX_CONNECTIONS); the GPU's UUID."""
from types import SimpleNamespace

import torch

from qvg.eval import bench_kernels


def test_header_records_qvg_settings_and_gpu_uuid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="GPU-1234"))
    for k in bench_kernels.RUN_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("QVG_COMMIT", "abc1234")
    monkeypatch.setenv("QVG_FAST_LAUNCH", "0")
    h = bench_kernels.result_header("compress_host", ["--profile"])
    assert h["command"] == "QVG_FAST_LAUNCH=0 python -m qvg.eval.compress_host --profile"
    assert h["commit"] == "abc1234" and h["gpu_uuid"] == "GPU-1234" and h["device"] == "NVIDIA H200"
    monkeypatch.delenv("QVG_FAST_LAUNCH")
    assert bench_kernels.result_header("compress_host", [])["command"] == "python -m qvg.eval.compress_host"


def test_header_records_cuda_run_settings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="GPU-1234"))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    h = bench_kernels.result_header("trace_overlap", [])
    assert h["command"] == "CUDA_DEVICE_MAX_CONNECTIONS=32 python -m qvg.eval.trace_overlap"


def test_driver_version_from_nvidia_smi_or_none(monkeypatch):
    import subprocess
    ok = SimpleNamespace(returncode=0, stdout="580.95.05\n580.95.05\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ok)
    assert bench_kernels.driver_version() == "580.95.05"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=9, stdout=""))
    assert bench_kernels.driver_version() is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(subprocess, "run", missing)
    assert bench_kernels.driver_version() is None
