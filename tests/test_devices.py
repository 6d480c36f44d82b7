"""qvg.devices.check_device: what a user names as a device, checked before anything is loaded (torch's errors were
a list of twenty device types, an AssertionError on a CPU build, or a CUDA error at the first tensor moved)."""
import pytest
import torch

from qvg.devices import check_device


def test_cpu_and_torch_devices_pass():
    assert check_device("cpu") == torch.device("cpu") and check_device(torch.device("cpu")).type == "cpu"


@pytest.mark.parametrize("device,msg", [("gpu", r"device: not a device: 'gpu' \(use cpu, cuda or cuda:N\)"),
                                        ("cpu:5", r"device must be cpu or cuda\[:N\], got 'cpu:5'"),
                                        ("meta", "device must be cpu or cuda"), (None, "not a device: None"),
                                        ("cuda:99", "cuda:99: ")])
def test_a_device_that_is_not_here_is_one_value_error(device, msg):
    with pytest.raises(ValueError, match=msg):
        check_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_cuda_without_a_gpu_says_so_in_the_loaders():
    from qvg.pipelines.world_model import load_world
    with pytest.raises(ValueError, match="device cuda: no CUDA GPU is available"):
        load_world(device="cuda")
    with pytest.raises(ValueError, match="device: not a device: 'gpu'"):
        load_world(device="gpu")
