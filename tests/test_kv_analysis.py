"""qvg.eval.kv_analysis: the quick run's result structure and basic orderings."""
from __future__ import annotations

import json

import pytest

from qvg.eval import kv_analysis

TENSORS = ("K", "V")
LABELS = ("rtn", "rtn B=16", "kivi", "quarot", "qvg", "qvg-pro", "rtn sym", "rtn B=16 sym", "qvg sym", "qvg-pro sym")


@pytest.fixture(scope="module")
def res():
    return kv_analysis.run(quick=True, seed=0, progress=False)


def test_structure(res):
    assert set(res) == {"meta", "mse", "reduction", "stages", "warm_start", "frontier", "summary"}
    m = res["meta"]
    for key in ("command", "git_commit", "date", "torch", "device", "data", "kmeans", "wall_s", "checks"):
        assert key in m
    assert m["quick"] is True
    for t in TENSORS:
        assert set(LABELS) <= set(res["mse"][t])
        for label in LABELS:
            for b in ("int2", "int4"):
                e = res["mse"][t][label][b]
                assert e["mse"] > 0 and e["rel_mse"] > 0 and e["n_seeds"] >= 1
                assert e["bpe_measured"] == pytest.approx(e["bpe_analytic"], rel=1e-6)
        for grid in kv_analysis.grids():
            for pair in ("qvg / rtn @ B=64", "qvg-pro / rtn @ B=16"):
                assert set(res["reduction"][t][grid][pair]) == {"int2", "int4"}
        for grid in kv_analysis.stage_grids():
            for bs in (16, 64):
                assert len(res["stages"][t][f"B{bs} {grid}"]["mse"]) == 5
        for key in ("main", "slow"):
            chunks = res["warm_start"][key][t]["chunks"]
            assert len(chunks) >= 1
            iters = res["warm_start"][key][t]["iters"]
            for c in chunks:
                if iters:  # full traces: iters + 1 values
                    assert len(c["warm"]) == len(c["cold"]) == iters + 1
                    assert c["cold_iters_to_warm2"] is None or 0 <= c["cold_iters_to_warm2"] <= iters
                for k in ("stored_objective", "empty_clusters_per_head", "qvg_int2_mse"):
                    assert set(c[k]) == {"cold8", "warm2"}
        assert any(p["pareto"] for p in res["frontier"][t])
    for key in ("qvg_beats_rtn_everywhere", "stages_monotone_everywhere", "cold_iters_to_reach_warm2"):
        assert key in res["summary"]
    json.dumps(res)  # JSON-able


def test_consistency_checks_pass(res):
    checks = [v for c in res["meta"]["checks"].values() for v in c.values()]
    assert checks and all(checks)
    assert res["summary"]["qvg_beats_rtn_everywhere"] and res["summary"]["stages_monotone_everywhere"]


def test_orderings(res):
    for t in TENSORS:
        mse = res["mse"][t]
        for b in ("int2", "int4"):
            assert mse["qvg"][b]["mse"] < mse["rtn"][b]["mse"]
            assert mse["qvg-pro"][b]["mse"] < mse["rtn B=16"][b]["mse"]
            assert mse["qvg-pro"][b]["mse"] < mse["qvg"][b]["mse"]
            assert mse["rtn B=16"][b]["mse"] < mse["rtn"][b]["mse"]
            assert mse["qvg"][b]["bpe_measured"] > mse["rtn"][b]["bpe_measured"]
        for label in LABELS:
            assert mse[label]["int4"]["mse"] < mse[label]["int2"]["mse"]
        for grid in kv_analysis.grids():
            for by_bits in res["reduction"][t][grid].values():
                assert by_bits["int2"]["ratio"] > 1 and by_bits["int4"]["ratio"] > 1
        for e in res["stages"][t].values():
            assert e["monotone"]
            rtn = ("rtn" if e["block_size"] == 64 else "rtn B=16") + kv_analysis._suffix(e["grid"])
            assert e["mse"][0] == pytest.approx(mse[rtn]["int2"]["mse"], rel=1e-6)  # S = 0 is RTN
        for c in res["warm_start"]["main"][t]["chunks"]:
            # Lloyd iterations never increase the objective
            for tr in (c["cold"], c["warm"]):
                assert all(b <= a * (1 + 1e-5) for a, b in zip(tr, tr[1:]))
            # the stored pair's objective is at most the objective of the assignment it came from
            assert c["stored_objective"]["cold8"] <= c["cold"][7] * (1 + 1e-5)
            assert c["stored_objective"]["warm2"] <= c["warm"][1] * (1 + 1e-5)


def test_markdown_and_save(res, tmp_path):
    md = kv_analysis.to_markdown(res)
    for head in ("## a.", "## b.", "## c.", "## d."):
        assert head in md
    notes = kv_analysis.save(res, tmp_path)
    assert (tmp_path / "kv_analysis.json").exists() and (tmp_path / "kv_analysis.md").exists()
    assert json.loads((tmp_path / "kv_analysis.json").read_text())["meta"]["quick"] is True
    assert any("kv_analysis.png" in n for n in notes)  # written, or a note that it was skipped
