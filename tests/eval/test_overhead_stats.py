"""eval/overhead_stats.py: per-run overheads pooled from bench_pipeline JSONs, the one-sided 95% bound of their mean
against the target, and one clear line (exit 2) for a file that is not a results file."""
import json
import math
import subprocess

import pytest

from qvg.eval import overhead_stats as st


def _run(path, overhead, commit="abc1234", **header):
    rows = [{"history_frames": 21, "method": "bf16", "overhead_vs_bf16": 0.0},
            {"history_frames": 21, "method": "qvg-pro", "overhead_vs_bf16": overhead},
            {"history_frames": 60, "method": "qvg-pro", "overhead_vs_bf16": 0.5}]
    path.write_text(json.dumps({"commit": commit, "date": "2026-11-27", "device": "GPU X", "rows": rows, **header}))
    return str(path)


def test_t_quantiles():
    assert st.t95(1) == 6.314 and st.t95(19) == 1.729 and st.t95(30) == 1.697
    assert abs(st.t95(31) - 1.6955) < 1e-3 and abs(st.t95(120) - 1.6577) < 1e-3
    assert abs(st.t95(10 ** 6) - 1.6449) < 1e-4


def test_summary_and_cli(tmp_path, capsys):
    vals = [0.012, 0.014, 0.013, 0.016]
    files = [_run(tmp_path / f"r{i}.json", v) for i, v in enumerate(vals)]
    s = st.summarize(vals, 0.015)
    mean, sd = sum(vals) / 4, math.sqrt(sum((v - 0.01375) ** 2 for v in vals) / 3)
    assert math.isclose(s["mean"], mean) and math.isclose(s["sd"], sd)
    assert math.isclose(s["upper95_of_mean"], mean + 2.353 * sd / 2)
    assert s["runs_over_target"] == 1 and s["median"] == 0.0135 and s["met"] is False
    assert st.summarize([0.010, 0.011, 0.012], 0.015)["met"] is True
    out = tmp_path / "s.json"
    assert st.main(files + ["--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["n"] == 4 and [r["overhead"] for r in d["runs"]] == vals and d["command"].startswith("python -m")
    assert d["devices"] == ["GPU X"] and d["commit"] and d["date"].startswith("20") and "git_dirty" in d
    assert "not met" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{nope")
    assert st.main([str(bad), _run(tmp_path / "ok.json", 0.01)]) == 2
    assert st.main([_run(tmp_path / "one.json", 0.01)]) == 2
    assert st.main([_run(tmp_path / "a.json", 0.01), "--method", "kivi"]) == 2
    twice = _run(tmp_path / "t.json", 0.01)
    assert st.main([twice, twice]) == 2
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"rows": [{"history_frames": 21, "method": "qvg-pro", "overhead_vs_bf16": None}]}))
    assert st.main([str(odd), _run(tmp_path / "b.json", 0.01)]) == 2
    odd.write_text(json.dumps({"rows": [1, 2]}))
    assert st.main([str(odd), _run(tmp_path / "c.json", 0.01)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 6 and all(e.startswith("overhead_stats: ") for e in err)
    assert "given twice" in err[3] and "numeric overhead" in err[4]


def test_bad_target_or_out_is_one_line_before_the_work(tmp_path, capsys):
    """--target nan gave "not met" and status 0 on data the default target met; an --out in a missing folder was a
    traceback after the summary."""
    runs = [_run(tmp_path / "a.json", 0.01), _run(tmp_path / "b.json", 0.012)]
    for args, msg in ((["--target", "nan"], "--target: must be a finite number"),
                      (["--target", "-0.01"], "--target: must be a fraction > 0"),
                      (["--out", str(tmp_path / "no" / "s.json")], f"--out: cannot write to {str(tmp_path / 'no')!r}")):
        with pytest.raises(SystemExit) as e:
            st.main(runs + args)
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1 and msg in err, err


def _run_on(path, overhead, uuid):
    _run(path, overhead)
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "gpu_uuid": uuid}))
    return str(path)


def test_machines_are_the_unit_when_known(tmp_path, capsys):
    vals = [0.010, 0.020, 0.012, 0.014, 0.013]
    files = [_run(tmp_path / f"r{i}.json", v) for i, v in enumerate(vals)]
    out = tmp_path / "m.json"
    assert st.main(files + ["--machine-sizes", "2,1,2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    means = [0.015, 0.012, 0.0135]
    assert d["verdict_over"] == "machines" and d["runs_per_machine"] == [2, 1, 2]
    assert all(math.isclose(a, b) for a, b in zip(d["machine_means"], means))
    want = st.summarize(means, 0.015)  # the top level is the verdict's summary: over the machines
    assert d["n"] == 3 and d["upper95_of_mean"] == want["upper95_of_mean"] and d["met"] == want["met"]
    assert d["over_runs"] == st.summarize(vals, 0.015)
    assert [r["machine"] for r in d["runs"]] == [0, 0, 1, 2, 2]
    assert "(the verdict: machines are the unit)" in capsys.readouterr().out
    # by the GPU's UUID when every file has one (in order of first appearance)
    u = [_run_on(tmp_path / f"u{i}.json", v, g) for i, (v, g) in enumerate(zip(vals, "ABBCA"))]
    assert st.main(u + ["--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["runs_per_machine"] == [2, 2, 1] and [r["machine"] for r in d["runs"]] == [0, 1, 1, 2, 0]
    # without either: runs are the unit, as before
    assert st.main(files + ["--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["verdict_over"] == "runs" and d["n"] == 5 and "over_runs" not in d
    # UUIDs on some files only: runs are the unit, and it says so
    capsys.readouterr()
    assert st.main(files[:2] + u[:1] + ["--out", str(out)]) == 0
    assert json.loads(out.read_text())["verdict_over"] == "runs" and "runs are the unit" in capsys.readouterr().out


def test_bad_machine_sizes_are_one_line(tmp_path, capsys):
    files = [_run(tmp_path / f"r{i}.json", 0.01 + i / 1000) for i in range(3)]
    assert st.main(files + ["--machine-sizes", "2,2"]) == 2
    assert st.main(files + ["--machine-sizes", "a,b"]) == 2
    assert st.main(files + ["--machine-sizes", "3,0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("overhead_stats: --machine-sizes") for e in err)
    assert st.main(files + ["--machine-sizes", "3"]) == 2  # one machine: no spread to bound
    assert "at least two machines" in capsys.readouterr().err
    u = [_run_on(tmp_path / f"u{i}.json", 0.01 + i / 1000, g) for i, g in enumerate("AAB")]
    assert st.main(u + ["--machine-sizes", "1,2"]) == 2  # A's runs split, B's with A's
    assert st.main(u + ["--machine-sizes", "2,1"]) == 0
    assert "holds runs of 2 GPUs" in capsys.readouterr().err


def test_runs_against_different_bf16_caches_are_not_pooled(tmp_path, capsys):
    """A file's bf16_baseline (or, without one, its commit: the ring since BASELINE_RING) must agree."""
    ring = [_run(tmp_path / f"r{i}.json", 0.02, bf16_baseline="ring") for i in range(2)]
    assert st.main(ring) == 0
    shift = _run(tmp_path / "s.json", 0.01, bf16_baseline="shift")
    assert st.main(ring + [shift]) == 2
    err = capsys.readouterr().err
    assert "against different BF16 caches" in err and "s.json: shift" in err and len(err.strip().splitlines()) == 1
    assert st._baseline_of("not-a-commit") == "unknown" and st._baseline_of(None) == "unknown"


def test_baseline_of_a_commit_by_git():
    if subprocess.run(["git", "-C", str(st.REPO), "merge-base", "--is-ancestor", "72bb8a4", "fa6c326"],
                      capture_output=True).returncode:
        pytest.skip("a checkout without this history (e.g. a copied tree)")
    assert st._baseline_of("72bb8a4") == "shift" and st._baseline_of("fa6c326") == "ring"
    assert st._baseline_of(st.BASELINE_RING + "-dirty") == "ring"
