"""Diagnostic of the fused k-means iteration (kernels/kmeans_fused.py) on the GPU: time, registers, spills and
PTX instruction counts of its tilings and forms (TRANS: sums as [D, K]; HIST: cluster sizes by tl.histogram),
against the two separate steps. `python eval/diag_kmeans_fused.py` (PYTHONPATH at the repo root, qvg/ links)."""
import torch, triton, re, itertools
from qvg.kernels.kmeans_fused import _assign_update_kernel
from qvg.kernels.kmeans import assign, update_with_counts
from qvg.kmeans import id_dtype
from triton.testing import do_bench
g, n, d, k = 32, 29640, 128, 256
torch.manual_seed(0)
x = (torch.randn(g, n, d, device="cuda") * 3).bfloat16()
c = x[:, :k].float().contiguous()
cb = c.bfloat16().contiguous(); csq = cb.float().pow(2).sum(-1)
print("assign", do_bench(lambda: assign(x, c, True, mode="min", block_n=64, block_k=256, num_warps=4, progs=8)))
ids0, _ = assign(x, c)
print("update", do_bench(lambda: update_with_counts(x, ids0, c, method="segsum", item=256, rows=32, num_warps=4, num_stages=3, sort_block=1024)))
for bn, nw, tr, hi, p in [(64, 8, False, False, 4), (64, 8, False, True, 4), (64, 8, True, False, 4), (64, 8, True, True, 4),
                          (64, 4, True, True, 8), (32, 4, True, True, 8), (128, 8, True, True, 4), (64, 16, True, True, 4), (128, 16, True, True, 4)]:
    nblk = triton.cdiv(n, bn)
    ids = torch.empty(g, n, device="cuda", dtype=id_dtype(k)); dist = torch.empty(g, n, device="cuda")
    sums = torch.empty(g, p, k, d, device="cuda"); cnt = torch.empty(g, p, k, device="cuda", dtype=torch.int32)
    f = lambda: _assign_update_kernel[(p, g)](x, cb, csq, ids, dist, sums, cnt, n, k, nblk, p, D=d, KP=k, BLOCK_N=bn, PARTS=1, INTERP=False, TRANS=tr, HIST=hi, num_warps=nw, num_stages=2)
    try:
        kern = f()
        ms = do_bench(f)
        ptx = kern.asm.get("ptx", "")
        cnts = {t: len(re.findall(t, ptx)) for t in ("wgmma.mma_async", "mma.sync", "fma.rn.f32", "ld.local", "st.local")}
        print(f"bn{bn} w{nw} trans={tr} hist={hi} p{p}: {ms:.4f} ms regs={kern.n_regs} spills={kern.n_spills} {cnts}", flush=True)
    except Exception as e:
        print(f"bn{bn} w{nw} trans={tr} hist={hi}: {type(e).__name__} {str(e)[:200]}")
