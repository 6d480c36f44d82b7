"""K/V capture, the sweep, the analyses and the report on a tiny random world model (seconds).

The pipelines (diffusers, which imports triton) are imported inside the tests, not at collection: this folder is
collected before tests/kernels/, whose conftest must set TRITON_INTERPRET before triton is first imported."""
from __future__ import annotations

import json

import pytest
import torch

from qvg.cache import KVCache
from qvg.eval import report, sweep
from qvg.eval.cli import main


def test_capture_is_what_the_cache_stores(tiny_runner):
    from qvg.eval.kv_capture import KVCapture
    from qvg.pipelines.world_model import rollout
    r = tiny_runner
    cap = KVCapture(r.model)
    r.run("coffee", 0, "bf16", {}, 2, capture=cap)
    assert len(cap.chunks) == 3  # the start image's context chunk + 2 generated
    cache = KVCache(len(r.model.blocks), "bf16", chunk_frames=3, tokens_per_frame=r.tokens_per_frame)
    for _ in rollout(r.model, r.config, r.start_frame("coffee"), r.actions[:2], cache, seed=0):
        pass
    n = r.unit_tokens
    for layer in range(len(r.model.blocks)):
        k, v = cache.read(layer)
        for c in range(3):
            assert torch.equal(k[:, :, c * n:(c + 1) * n], cap.key(c, layer).bfloat16())
            assert torch.equal(v[:, :, c * n:(c + 1) * n], cap.value(c, layer).bfloat16())
    assert not torch.equal(cap.key(1, 0), cap.key(1, 0, post_rope=False))
    r.run("coffee", 1, "bf16", {}, 1)  # a run without the capture: nothing recorded
    assert len(cap.chunks) == 3


def test_sweep_table_and_floors(tiny_runner, tiny_preset):
    spec = tiny_preset["sweep"]
    res = sweep.run(tiny_runner, spec, progress=False)
    rows = {(r["method"], r["bits"]): r for r in res["table"]}
    assert set(rows) == {("bf16", 16), ("rtn", 2), ("qvg", 2), ("bf16: another sampling seed", 16),
                         ("qvg: another k-means seed", 2)}
    # 1 input x 2 seeds x (bf16 + rtn + qvg at k-means seeds 0 and 1)
    assert len(res["runs"]) == 2 * 4 and rows["qvg", 2]["n"] == 2 and rows["qvg", 2]["kmeans_seeds"] == 2
    q = [r for r in res["runs"] if r["method"] == "qvg" and r["kmeans_seed"] == 0]
    assert rows["qvg", 2]["compression_ratio"] == pytest.approx(
        sum(r["memory"]["compression_ratio"] for r in q) / 2)
    assert rows["qvg", 2]["onset"]["psnr"]["std"] is not None and rows["rtn", 2]["compression_ratio"] > 1
    assert len(res["sampling_floor"]) == 1 and res["sampling_floor"][0]["seeds"] == [0, 1]
    again = json.loads(json.dumps(res))  # the table is computed from the saved records alone
    assert sweep.rows(again) == json.loads(json.dumps(res["table"]))
    md = sweep.table_markdown(res)
    assert "*floor: bf16: another sampling seed*" in md and "| qvg | INT2 |" in md


def test_report_and_rerender(tiny_runner, tiny_preset, tmp_path, capsys):
    out = tmp_path / "rep"
    res = report.run(out, tiny_preset, tiny_runner, command="test", progress=False)
    for f in ("report.md", "results.json", "sweep_quality.png", "memory_breakdown.png", "long_video.png",
              "kv_analyses.png"):
        assert (out / f).stat().st_size > 0, f
    md = (out / "report.md").read_text()
    for part in ("Table 1", "Fig. 5a", "Fig. 6", "Fig. 5c", "Fig. 7", "Warm vs cold", "Pre- vs post-RoPE"):
        assert part in md
    m = res["meta"]
    assert m["command"] == "test" and m["git_commit"] and m["device"].startswith("cpu") and m["spec"] == tiny_preset
    assert res["capture"]["chunks"] == tiny_preset["long"]["chunks"] + 1
    kv = res["kv"]
    assert set(kv["reduction"]["K"]) >= {"qvg / rtn @ B=64 int2", "qvg-pro / rtn @ B=16 int2"}
    assert len(kv["stages"]["V"]["B=16"]) == 5
    assert set(res["rope"]["summary"]) >= {"qvg int2", "rtn int4"}
    (out / "report.md").unlink()
    assert main(["report", str(out), "--from-json"]) == 0
    assert (out / "report.md").read_text() == md
    # results of another shape (a section without a part its plot needs): one error line, and nothing rewritten
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    broken = json.loads((out / "results.json").read_text())
    del broken["kv"]["stages"]
    (out / "results.json").write_text(json.dumps(broken))
    capsys.readouterr()
    assert main(["report", str(out), "--from-json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the results of a qvg-eval report (KeyError: no 'stages')" in err[0], err
    after = {f.name: f.read_bytes() for f in out.iterdir()}
    assert after.pop("results.json") != before.pop("results.json") and after == before
    zero = json.loads(json.dumps(res, default=str))  # a cache of 0 bytes: the ratio divides by it
    for r in zero["sweep"]["runs"]:
        r["memory"]["total"] = 0
    (out / "results.json").write_text(json.dumps(zero))
    assert main(["report", str(out), "--from-json"]) == 2
    assert "(ZeroDivisionError: " in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "results.json"} == before


def test_skipping_the_long_video_runs_only_its_bf16_capture(tiny_runner, tiny_preset, tmp_path, monkeypatch):
    """--skip long with a K/V analysis kept ran the long video's six runs and put its figure in the report; the
    analyses need only the BF16 run's K/V."""
    runs = []
    real = tiny_runner.run

    def counted(image, seed, method, *args, **kw):
        runs.append((method, seed, kw.get("capture") is not None))
        return real(image, seed, method, *args, **kw)
    monkeypatch.setattr(tiny_runner, "run", counted)
    res = report.run(tmp_path / "rep", tiny_preset, tiny_runner, command="test", progress=False,
                     skip=("sweep", "long", "block", "kv", "warm"))
    assert runs == [("bf16", tiny_preset["long"]["seed"], True)]
    assert "long_video" not in res and res["capture"]["chunks"] == tiny_preset["long"]["chunks"] + 1
    assert "rope" in res and "Fig. 5a" not in (tmp_path / "rep" / "report.md").read_text()


def test_memory_breakdown_adds_up_to_the_total(tmp_path, monkeypatch):
    """On CUDA the cache holds a `workspace` (compression graphs) too: the table and the bars show it, so that the
    components add up to the total (the committed H100 report's rtn INT2: 10,360,512 + 2,491,392 = 12,851,904)."""
    from pathlib import Path
    res = json.loads((Path(__file__).resolve().parents[2] / "eval" / "results" / "report-embedded-h100" /
                      "results.json").read_text())
    rows = sweep.memory_rows(res["sweep"])
    assert any(r["workspace"] for r in rows)
    assert all(sum(r[c] for c in report.MEMORY_COMPONENTS) == r["total"] for r in rows)
    figs = []
    monkeypatch.setattr(report, "_save", lambda plt, fig, path: figs.append(fig) or f"wrote {path}")
    report.render(res, tmp_path)
    md = (tmp_path / "report.md").read_text().splitlines()
    for head in ("| method | bits | codes |", "| B | ratio | codes |"):
        i = next(i for i, line in enumerate(md) if line.startswith(head))
        cols = [c.strip() for c in md[i].strip("|").split("|")]
        assert "workspace" in cols
        a, t = cols.index("codes"), cols.index("total")
        assert t - a == len(report.MEMORY_COMPONENTS)
        body = md[i + 2:md.index("", i)]
        assert body and all(sum(int(c.strip().replace(",", "")) for c in cells[a:t]) ==
                            int(cells[t].strip().replace(",", "")) for cells in (r.strip("|").split("|") for r in body))
    assert "| rtn | INT2 | 5,308,416 | 333,504 | 0 | 0 | 0 | 4,718,592 | 2,491,392 | 12,851,904 |" in "\n".join(md)
    ax = figs[1].axes[0]  # memory_breakdown: one stacked bar per (method, bits)
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x(), 6)
        tops[x] = tops.get(x, 0.0) + bar.get_height()
    assert len(tops) == len(rows)
    assert [tops[x] for x in sorted(tops)] == pytest.approx([r["total"] / 2**20 for r in rows])


def test_a_capped_psnr_and_the_plot_band_read_as_the_tables_do():
    """The sweep table printed a mean PSNR at the metric's 100 dB cap as "inf" (the JSON and report: 100); the sweep
    plot's band was the population std where the tables' "mean ± std" is the sample std."""
    import statistics
    assert sweep._pm({"mean": 100.0, "std": 0.0}, 2) == "100.00 ± 0.00"
    assert sweep._pm({"mean": 41.234, "std": None}, 1) == "41.2"
    xs, mean, std = report._frame_stats([[30.0, 10.0, 70.0], [40.0, 20.0, 80.0]], 1)
    assert xs == [1, 2] and mean == [15.0, 60.0]  # (each value capped at 60 dB)
    assert std == [statistics.stdev([10.0, 20.0]), 0.0]

