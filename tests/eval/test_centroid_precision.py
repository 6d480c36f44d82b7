"""eval/centroid_precision.py: FP8 centroid tables (one power-of-two scale per table) in the torch compress path,
the experiment's rows and its command line."""
from __future__ import annotations

import json

import pytest
import torch

import qvg
from qvg.compression import resolve_options
from qvg.compression.prq import compress_torch
from qvg.eval import centroid_precision as cp
from qvg.packed import Packed


def test_fp8_table_is_fp8_times_a_power_of_two_per_table():
    torch.manual_seed(0)
    c = torch.randn(3, 8, 16) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q = cp.fp8_table(c)
    assert q.dtype == torch.bfloat16
    for g in range(3):
        top = c[g].abs().max()
        ts = 2.0 ** torch.ceil(torch.log2(top / 448))
        assert torch.equal((q[g].float() / ts).to(torch.float8_e4m3fn).float() * ts, q[g].float())  # FP8 x ts exactly
        assert 224 <= float(q[g].float().abs().max() / ts) <= 448  # (the largest entry rounded to FP8)
        big = c[g].abs() > top / 64  # (normal FP8 range: 3 mantissa bits)
        assert ((q[g].float() - c[g]).abs()[big] <= c[g].abs()[big] * 2 ** -4).all()


def _pack(x, name, store, k=8, seed=0):
    o = {**resolve_options(name, tuple(x.shape), bits=2, centroids=k), "seed": seed}
    return Packed(name, tuple(x.shape), x.dtype, compress_torch(x, o, None, 8, store=store), o)


def _fp8_tables(t: torch.Tensor) -> bool:
    """Whether each table of t [G, K, D] is FP8 E4M3 values times one power of two. (Not fp8_table(t) == t: a table
    whose largest entry rounded onto 448 x 2^k takes the next scale up from tensor_scale, whose margin puts exactly
    448 x 2^k above it, and its subnormals would round again.)"""
    from qvg.quant import tensor_scale
    ts = tensor_scale(t.abs()[None])[0][:, None, None]
    fits = [((q.abs() <= 448) & (q.to(torch.float8_e4m3fn).float() == q)).flatten(1).all(1)
            for q in (t / ts, t / (ts / 2))]
    return bool((fits[0] | fits[1]).all())


def test_store_rounds_the_tables_it_is_given_and_decode_replays_them():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 32) + 4 * torch.randn(1, 2, 1, 32)
    ref = _pack(x, "qvg-pro", cp.store_for(None))
    assert all(torch.equal(ref.tensors[k], qvg.compress(x, "qvg-pro", bits=2, centroids=8).tensors[k])
               for k in ref.tensors)  # (the default store is the format's)
    p = _pack(x, "qvg-pro", cp.store_for(1))
    c = p.tensors["centroids"]
    assert torch.equal(c[0], ref.tensors["centroids"][0])  # stage 0 stays BF16 (same k-means, same input)
    for s in range(1, 4):
        assert _fp8_tables(c[s].reshape(2, 8, 32).float())
    err = lambda q: float((qvg.decompress(q).float() - x).pow(2).mean())  # noqa: E731
    assert err(p) < 1.5 * err(ref)


def test_measure_rows_and_bits():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 256, 64)
    rows = cp.measure(x, 8, [0, 1])
    assert [(r["method"], r["variant"]) for r in rows] == [(m, v) for m, _, _ in cp.METHODS for v in cp.VARIANTS]
    for r in rows:
        assert len(r["rel_mse"]) == 2 and all(v > 0 for v in r["rel_mse"])
        if r["variant"] == "bf16":
            assert r["ratio_to_bf16"] == [1.0, 1.0]
            assert r["bits_per_element"] == pytest.approx(qvg.bits_per_element(r["method"], x.shape, bits=2,
                                                                                 centroids=8))
    pro = {r["variant"]: r["bits_per_element"] for r in rows if r["method"] == "qvg-pro"}
    # 4 tables of 8 x 64: BF16 costs 16 bits an entry; FP8 8 bits an entry plus a 32-bit scale per table
    assert pro["bf16"] - pro["fp8 every stage"] == pytest.approx(4 * (8 * 8 * 64 - 32) / (256 * 64))
    assert pro["bf16"] - pro["fp8 from stage 1"] == pytest.approx(3 * (8 * 8 * 64 - 32) / (256 * 64))


def test_table_bits_is_the_formulas_centroid_term():
    """With BF16 tables, table_bits is the 16 S K / N of prq's formula (what the FP8 rows subtract)."""
    from qvg.compression.prq import bits
    shape = (1, 2, 256, 64)
    o = resolve_options("qvg-pro", shape, bits=2, centroids=8)
    assert bits(shape, o) - bits(shape, {**o, "centroids": 1}) == pytest.approx(
        cp.table_bits(4, 8, 256, 64, None) - cp.table_bits(4, 1, 256, 64, None))
    assert cp.table_bits(4, 8, 256, 64, None) == pytest.approx(16 * 4 * 8 / 256)


def test_main_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    x = torch.randn(1, 1, 128, 64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(cp, "run", lambda seeds: {"sets": [{"data": "synthetic", "tensor": "K", "K": 4,
                                                            "rows": cp.measure(x, 4, seeds)}]})
    assert cp.main(["--out", str(tmp_path), "--seeds", "0,1"]) == 0
    res = json.loads((tmp_path / "centroid_precision.json").read_text())
    assert res["command"] == f"python -m qvg.eval.centroid_precision --out {tmp_path} --seeds 0,1"
    assert len(res["summary"]) == len(cp.METHODS) * len(cp.VARIANTS)
    md = (tmp_path / "centroid_precision.md").read_text()
    assert "| synthetic | K | 4 | qvg-pro | fp8 every stage |" in md


@pytest.mark.parametrize("seeds", ["", "0,x", "1.5", "-1", str(2 ** 63), "0,1,0"])
def test_bad_seeds_are_one_line(seeds, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cp.main(["--out", str(tmp_path), "--seeds", seeds])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--seeds" in err[0], err
    assert list(tmp_path.iterdir()) == []
