"""world_eval: results are written after every configuration, and runs of one set made in parallel processes
merge into one results file with the differences recomputed (CPU, the shipped model, a tiny set)."""
import json
from pathlib import Path

import pytest

from qvg.eval import world_eval

SET = ["--m", "1", "--seeds", "2", "--trajectories", "1", "--skip-quality", "--device", "cpu"]


def test_parallel_runs_merge_into_one_result(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert world_eval.main(SET + ["--configs", "bf16 full", "--out", str(a)]) == 0
    assert world_eval.main(SET + ["--configs", "bf16 window:3,bf16 full", "--out", str(b)]) == 0
    ra, rb = (json.loads(p.with_suffix(".json").read_text()) for p in (a, b))
    assert ra["revisit"]["bf16 full"]["per_seed"] == rb["revisit"]["bf16 full"]["per_seed"]  # deterministic
    # (a dotted stem keeps its dot: "m-v1.5" wrote m-v1.json, .md, .png, another run's names)
    assert world_eval.main(["--merge", str(a.with_suffix(".json")), str(b.with_suffix(".json")),
                            "--out", str(tmp_path / "m-v1.5")]) == 0
    assert not list(tmp_path.glob("m-v1.[jm]*"))
    m = json.loads((tmp_path / "m-v1.5.json").read_text())
    assert list(m["revisit"]) == ["bf16 full", "bf16 window:3"] and len(m["argv_runs"]) == 2
    assert m["differences"] == world_eval.differences(rb["revisit"])
    md = (tmp_path / "m-v1.5.md").read_text()
    assert "2 processes at once" in md and "bf16 full - bf16 window:3: region_psnr" in md
    other = dict(ra, settings=dict(ra["settings"], seed_offset=5))
    with pytest.raises(ValueError, match="setting seed_offset differs"):
        world_eval.merge([ra, other])


@pytest.mark.parametrize("flag", ["--seeds", "--trajectories", "--chunks", "--m", "--first"])
def test_counts_below_one_are_one_error_line(flag, capsys):
    """--seeds 0 was a StatisticsError traceback after the model loaded (--seeds is a count here)."""
    with pytest.raises(SystemExit) as e:
        world_eval.main([flag, "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith(f"error: {flag} is a count and must be >= 1, got 0"), err


def test_a_missing_report_or_model_is_one_error_line(tmp_path, capsys):
    for args, msg in ((["--report", str(tmp_path / "none.json")], "--report: cannot read"),
                      (["--model", str(tmp_path), "--skip-quality"], "--model: no world model in"),
                      # --out's folder is checked before the work and not made (a typo made folders, at the root too)
                      (["--skip-quality", "--out", str(tmp_path / "typo" / "x")],
                       f"--out: cannot write to {str(tmp_path / 'typo')!r} (no such directory)"),
                      (["--merge", str(tmp_path / "none.json"), "--out", "/proc/x/y"],
                       "--out: cannot write to '/proc/x' (no such directory)")):
        with pytest.raises(SystemExit) as e:
            world_eval.main(args + ([] if "--out" in args else ["--out", str(tmp_path / "out")]))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1] and "Traceback" not in "".join(err), err
    assert not (tmp_path / "typo").exists()


def test_a_device_that_is_not_there_is_one_error_line(tmp_path, capsys):
    """--device takes qvg-generate's rule (cpu, or an existing cuda[:N]); cpu:5 was taken as the CPU."""
    with pytest.raises(SystemExit) as e:
        world_eval.main(["--device", "cpu:5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith("--device must be cpu or cuda[:N], got 'cpu:5'"), err
    assert not (tmp_path / "out").exists()


def test_the_json_names_the_gpu_of_device(tmp_path, monkeypatch):
    """--device cuda:1 records cuda:1's name (it recorded device 0's: torch.cuda.get_device_name() with no
    argument). CPU: two GPUs claimed, the run stopped right after the header."""
    import torch

    class Stop(Exception):
        pass

    def stop():
        raise Stop
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: asked.append(d) or f"GPU {d}")
    monkeypatch.setattr(world_eval, "load_world", lambda *a, **k: (None, {"chunk_frames": 3}))
    monkeypatch.setattr(world_eval, "code_commit", stop)
    with pytest.raises(Stop):
        world_eval.main(["--device", "cuda:1", "--skip-quality", "--out", str(tmp_path / "out")])
    assert asked == ["cuda:1"]



# world_eval's committed results (not the training and configuration files beside them)
RESULTS = sorted(p for p in (Path(__file__).parents[2] / "eval" / "results").glob("world*.json")
                 if isinstance(d := json.loads(p.read_text()), dict) and "revisit" in d)


def test_a_json_that_is_not_a_results_file_is_one_error_line(tmp_path, capsys):
    """--report / --merge of {} or [1] (or a results dict without a number the report shows) were KeyError /
    AttributeError tracebacks; now one line naming the file, and nothing written beside it. Every committed results
    file still passes the check."""
    assert RESULTS and all(world_eval.read_results(p) for p in RESULTS)
    full = json.loads(RESULTS[0].read_text())
    cases = {"empty.json": {}, "list.json": [1], "text.json": "x",
             "bad-revisit.json": {"settings": {}, "revisit": {"a": 1}},
             "no-seconds.json": {k: v for k, v in full.items() if k != "seconds"}}
    for name, data in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        for args in (["--report", str(tmp_path / name)],
                     ["--merge", str(tmp_path / name), "--out", str(tmp_path / "m")]):
            with pytest.raises(SystemExit) as e:
                world_eval.main(args)
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and "Traceback" not in "".join(err), err
            assert "is not a" in err[-1] and str(tmp_path / name) in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)
