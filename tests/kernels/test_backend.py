"""Backend selection (qvg.backend.use_kernels), the test harness's own mode, and the GPU compress path of
rtn / qvg / qvg-pro (kernels/compress.py) against the torch path."""
import os
import types

import pytest
import torch

import qvg
import qvg.backend
from kernel_helpers import clustered, poisoned
from qvg.kernels import common

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_kernel_tests_run_in_the_right_mode():
    """Without CUDA the kernel tests run under Triton's interpreter (set up by tests/kernels/conftest.py before
    qvg.kernels was imported); with CUDA they are compiled."""
    interp = not torch.cuda.is_available()
    assert common.INTERPRET is interp
    assert (os.environ.get("TRITON_INTERPRET") == "1") is interp
    from qvg.kernels.dequant import _dequant_kernel
    assert (type(_dequant_kernel).__name__ == "InterpretedFunction") is interp
    import triton.language.standard as standard  # triton's own @jit helpers, which the kernels call
    assert (type(standard.max).__name__ == "InterpretedFunction") is interp


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's set-up: CPU only")
def test_mode_set_before_diffusers_loads_triton():
    """`pytest tests/ -k rope` once failed in interpreted kernel tests: collecting tests/eval/ imports the pipelines
    and so diffusers, which imports torch._dynamo and so triton, before tests/kernels/conftest.py had set
    TRITON_INTERPRET; triton's own @jit helpers were then built compiled. tests/conftest.py now sets it first."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (the whole folder, so that tests/kernels/conftest.py is loaded when pytest reaches it, after the other folders)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k",
                        "test_kernel_tests_run_in_the_right_mode"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_poisoned_helper():
    with poisoned():
        a, b = torch.empty(3), torch.empty_like(torch.zeros(2, dtype=torch.uint8))
    assert torch.isnan(a).all() and (b == 255).all()
    assert torch.empty is not None and torch.empty(2).shape == (2,)


def test_cpu_tensors_use_torch():
    assert qvg.backend.use_kernels(torch.zeros(2)) is False


def test_backend_env_forces_torch(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_cuda=True, shape=(1, 2, 3, 128))  # stands in for a CUDA tensor
    monkeypatch.delenv("QVG_BACKEND", raising=False)
    assert qvg.backend.use_kernels(fake_cuda) is True  # triton imports here
    monkeypatch.setenv("QVG_BACKEND", "torch")
    assert qvg.backend.use_kernels(fake_cuda) is False
    assert qvg.backend.use_kernels(torch.zeros(2)) is False
    monkeypatch.setenv("QVG_BACKEND", "auto")
    assert qvg.backend.use_kernels(fake_cuda) is True


def test_head_dims_the_kernels_take(monkeypatch):
    """Powers of two from 16 to 256 run the kernels; others (80, 96: one `tl.arange` per token's D values, which
    Triton sizes in powers of two) the torch reference on CUDA too, and the kernels refuse them in one ValueError
    (a Triton CompilationError reached qvg.compress at D=96 before)."""
    from qvg.backend import kernel_head_dim
    from qvg.kernels.common import check_head_dim
    assert [d for d in range(1, 600) if kernel_head_dim(d)] == [16, 32, 64, 128, 256]
    monkeypatch.delenv("QVG_BACKEND", raising=False)
    cuda96 = types.SimpleNamespace(is_cuda=True, shape=(1, 2, 3, 96))
    assert qvg.backend.use_kernels(cuda96) is False
    assert qvg.backend.use_kernels(cuda96, head_dim=128) is True  # (packed codes: their last dim is not D)
    with pytest.raises(ValueError, match="power of two from 16 to 256, got 96"):
        check_head_dim(96)
    from qvg.kernels.attention import fused_head_dim  # the on-chip read: up to 128 on a GPU (shared memory at 256)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [fused_head_dim(d, cuda) for d in (16, 128, 256)] == [True, True, False] and fused_head_dim(256, cpu)


@pytest.mark.parametrize("d", [80, 96])
def test_kernel_entry_points_refuse_other_head_dims(device, d):
    from qvg.compression.registry import token_spec
    from qvg.kernels.attention import packed_attention, staged_attention
    from qvg.kernels.compress import compress_prq
    from qvg.kernels.dequant import dequantize
    from qvg.kernels.kmeans import assign, kmeans, update_with_counts
    from qvg.kernels.quantize import quantize_packed
    from qvg.sequence import PackedSequence
    x = torch.randn(1, 1, 32, d, dtype=torch.bfloat16)
    p = qvg.compress(x, "qvg", block_size=16, centroids=4).to(device)  # (compressed by the torch path: D = 96)
    seq = PackedSequence.from_chunks([p])
    x = q = x.to(device)
    o = dict(p.meta, iters=2)
    for call in (lambda: quantize_packed(x, token_spec(o)), lambda: dequantize(p), lambda: dequantize(seq),
                 lambda: compress_prq(x, o, None, 2), lambda: staged_attention(q, seq, seq),
                 lambda: packed_attention(q, seq, seq), lambda: kmeans(x[0].float(), 4),
                 lambda: assign(x[0], torch.zeros(1, 4, d, device=device)),
                 lambda: update_with_counts(x[0], torch.zeros(1, 32, dtype=torch.uint8, device=device),
                                            torch.zeros(1, 4, d, device=device))):
        with pytest.raises(ValueError, match=f"power of two from 16 to 256, got {d}"):
            call()


def test_kernels_on_a_device(monkeypatch):
    """kernels_on(device): a CUDA device where triton imports and QVG_BACKEND is not torch (a CUDA torch without
    triton, as on Windows, runs the reference: the graphed compress and qvg-generate's report follow it too)."""
    from qvg.compression.graphed import GraphedCompress
    monkeypatch.delenv("QVG_BACKEND", raising=False)
    assert qvg.backend.kernels_on("cuda") is True and qvg.backend.kernels_on(torch.device("cuda", 1)) is True
    assert qvg.backend.kernels_on("cpu") is False
    monkeypatch.setenv("QVG_BACKEND", "torch")
    assert qvg.backend.kernels_on("cuda") is False
    monkeypatch.delenv("QVG_BACKEND")
    monkeypatch.setattr(qvg.backend, "triton_available", lambda: False)
    assert qvg.backend.kernels_on("cuda") is False
    assert not GraphedCompress.supports(types.SimpleNamespace(device=torch.device("cuda")), "rtn", None, {})


def _compare_paths(x, method, kernel_packed, torch_packed):
    y_k = qvg.decompress(kernel_packed).float().cpu()
    y_t = qvg.decompress(torch_packed).float().cpu()
    xf = x.float().cpu()
    mse_k, mse_t = (y_k - xf).pow(2).mean().item(), (y_t - xf).pow(2).mean().item()
    assert mse_k <= 1.1 * mse_t and mse_t <= 1.1 * mse_k, (method, mse_k, mse_t)
    kt, tt = kernel_packed.tensors, torch_packed.tensors
    assert set(kt) == set(tt) and all(kt[n].dtype == tt[n].dtype and kt[n].shape == tt[n].shape for n in tt)
    if "ids" in tt:
        agree = (kt["ids"].cpu() == tt["ids"].cpu()).float().mean().item()
        assert agree > 0.8, (method, agree)


@pytest.mark.parametrize("variant", ["current", "fast", "fast-onehot"])
@pytest.mark.parametrize("method", ["qvg", "qvg-pro"])
def test_compress_prq_kernels_vs_torch(method, variant, device):
    """The kernel compress path (Triton k-means + fused residual quantize) called directly, on the device (the
    interpreter on CPU), vs qvg.compress's torch path: same storage layout, MSE within 10%, ids mostly equal; for
    three entries of kernels/compress.py's COMPRESS_VARIANTS (test_compress_variants.py holds the others to these
    bitwise or, for the centroids, within the order of the FP32 sums)."""
    x = clustered(1, 2, 96, 64, clusters=6, seed=2)
    opts = dict(centroids=6, iters=2, grid="midrise")
    torch_packed = qvg.compress(x, method, **opts)  # CPU: torch
    o = torch_packed.meta  # the resolved options
    from qvg.kernels.compress import compress_prq
    with poisoned():
        tensors = compress_prq(x.to(device), o, None, 2, variant=variant)
    kernel_packed = qvg.Packed(method, tuple(x.shape), x.dtype, tensors, o)
    _compare_paths(x, method, kernel_packed, torch_packed)


@cuda
@pytest.mark.parametrize("method", ["rtn", "qvg"])
def test_compress_on_cuda_kernels_vs_torch(method, monkeypatch):
    """qvg.compress with the method's presets on CUDA: kernels vs QVG_BACKEND=torch."""
    x = clustered(2, 4, 1024, 128, clusters=64, spread=3.0, seed=3).cuda()
    monkeypatch.delenv("QVG_BACKEND", raising=False)
    assert qvg.backend.use_kernels(x)
    pk = qvg.compress(x, method)
    monkeypatch.setenv("QVG_BACKEND", "torch")
    pt = qvg.compress(x, method)
    _compare_paths(x, method, pk, pt)


@pytest.mark.parametrize("stages", [1, 3])
def test_residual_bf16_matches_the_reference_chain(stages, device):
    """The k-means input of stage s: BF16 of x - sum_{t<s} C_t[ids_t] in FP32, in the reference's order (bitwise)."""
    g, n, d, k = 3, 50, 32, 7
    gn = torch.Generator().manual_seed(stages)
    x = torch.randn(g, n, d, generator=gn) * 30
    ids = torch.randint(0, k, (stages, g, n), generator=gn).to(torch.uint8)
    cents = (torch.randn(stages, g, k, d, generator=gn) * 30).to(torch.bfloat16)
    want = x.clone()
    for s in range(stages):
        want = want - torch.gather(cents[s].float(), 1, ids[s].long()[..., None].expand(-1, -1, d))
    from qvg.kernels.compress import residual_bf16
    got = residual_bf16(x.to(device), ids.to(device), cents.to(device), stages, block_n=16).cpu()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
