"""qvg-eval's input checks (a new-user walkthrough's findings): every bad value is one `qvg-eval: error:` line and
status 2 before any model loads or any output is written; notes (videos of different lengths, a chunk layout
guessed, a floor one seed can't give) come after the work, so an error stays the only line; the eval runners
build the cache as qvg-generate does (keys before RoPE for rtn / qvg / qvg-pro on the embedded model)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from qvg.eval.cli import main


def _video(path, frames=6, size=16, seed=0):
    np.save(path, (np.random.default_rng(seed).random((frames, size, size, 3)) * 255).astype(np.uint8))
    return str(path)


def _one_error(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-eval: error: "), err
    assert all(n in err[0] for n in needles), err
    return err[0]


SWEEP = ["--inputs", "coffee", "--seeds", "0", "--methods", "qvg", "--bits", "2", "--kmeans-seeds", "0",
         "--chunks", "1", "--lpips", "none", "--vbench", "none", "--no-progress"]


@pytest.mark.parametrize("change,needle", [
    (["--bits", "3"], "--bits must be 2, 4 or 8, got 3"),
    (["--bits", ""], "--bits: give one value at least"),
    (["--inputs", "nosuchphoto"], "'nosuchphoto' neither a bundled photo (astronaut"),
    (["--onset-chunks", "0"], "--onset-chunks in [1, chunks]"),
    (["--chunks", "100000000"], "--chunks must be in [1, 33333]"),  # (was accepted: days of runs)
    (["--methods", "fp4"], "--methods: unknown fp4"),
    (["--key-storage", "pre"], "--key-storage: invalid choice: 'pre'"),
    (["--vbench", "bogus"], "--vbench: unknown bogus"),
    (["--threads", "-3"], "--threads must be in [1, "),
    (["--threads", "100000"], "--threads must be in [1, 1024], got 100000"),  # (libgomp failed, or a crash)
    (["--seeds", "0,-1"], "--seeds must be in [0, "),
    (["--seeds", "\u0660,1"], "--seeds must be comma-separated integers, got '\u0660,1'"),  # (int() took it as 0)
    (["--chunks", "\u0663"], "argument --chunks: invalid integer value: '\u0663'"),
    (["--threads", "1_0"], "argument --threads: invalid integer value: '1_0'"),
    (["--kmeans-seeds", "0,2147483648"], "--kmeans-seeds must be in [0, 2147483647], got 2147483648"),
    (["--checkpoint", "."], "--checkpoint applies to --pipeline self-forcing, not the embedded model"),
    (["--seeds", "3,3"], "--seeds: 3 given twice"),  # (a seed that is its own floor: inf dB)
    (["--kmeans-seeds", "0,1,0"], "--kmeans-seeds: 0 given twice"),
    (["--methods", "qvg,rtn,qvg"], "--methods: 'qvg' given twice"),
    (["--inputs", "coffee,camera,coffee"], "--inputs: 'coffee' given twice"),
    (["--inputs", "coffee,{notimage}"], "--inputs: cannot read '{notimage}' as an image"),
    (["--inputs", "{small}"], "--inputs: '{small}' is 10 x 10 pixels"),  # (qvg-generate's own rule)
])
def test_sweep_bad_values_before_any_work(tmp_path, capsys, monkeypatch, change, needle):
    import numpy as np
    from PIL import Image
    from qvg.eval import cli
    monkeypatch.setattr(cli, "_embedded", lambda *a, **k: pytest.fail("the model loaded before the check"))
    files = {"notimage": str(tmp_path / "notimage.png"), "small": str(tmp_path / "small.png")}
    (tmp_path / "notimage.png").write_text("not an image")
    Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(files["small"])
    change, needle = [c.format(**files) for c in change], needle.format(**files)
    args = list(SWEEP)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(["sweep", str(tmp_path / "sw")] + args) == 2
    _one_error(capsys, needle)
    assert not (tmp_path / "sw").exists()


@pytest.mark.parametrize("cmd", ["sweep", "report"])
def test_unwritable_output_folder_before_any_work(tmp_path, capsys, cmd):
    (tmp_path / "file").write_text("x")
    extra = SWEEP if cmd == "sweep" else ["--skip", "sweep,long,kv,warm,rope", "--no-progress", "--lpips", "none",
                                          "--vbench", "none"]
    assert main([cmd, str(tmp_path / "file" / "out")] + extra) == 2
    _one_error(capsys, f"cannot write to {str(tmp_path / 'file' / 'out')!r}")
    assert main([cmd, str(tmp_path / "file")] + extra) == 2  # the folder named is a file (was "(File exists)")
    _one_error(capsys, f"cannot write to {str(tmp_path / 'file')!r}: a file is there, not a folder")
    assert main([cmd, ""] + extra) == 2  # (Path("") is the current folder: it wrote there)
    _one_error(capsys, "OUTDIR is empty")


def test_report_with_every_part_skipped_is_an_error(tmp_path, capsys):
    """--skip naming all six parts: one line, nothing made (was an empty report and status 0)."""
    assert main(["report", str(tmp_path / "r"), "--skip", "sweep,long,block,kv,warm,rope", "--lpips", "none",
                 "--vbench", "none"]) == 2
    _one_error(capsys, "every part skipped; nothing to report")
    assert not (tmp_path / "r").exists()


def test_report_from_json_still_checks_its_values(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--from-json", "--preset", "nope"]) == 2
    _one_error(capsys, "--preset must be one of")
    assert main(["report", str(tmp_path), "--from-json", "--skip", "bogus"]) == 2
    _one_error(capsys, "--skip: unknown part(s) bogus")
    for text, why in (("{}", "KeyError: no 'meta'"), ("[1, 2]", "TypeError"), ('{"pipeline": "tiny"}', "no 'meta'")):
        (tmp_path / "results.json").write_text(text)  # JSON, but not a report's results (the last: a video's)
        assert main(["report", str(tmp_path), "--from-json"]) == 2
        _one_error(capsys, "--from-json:", "is not the results of a qvg-eval report", why)
        assert sorted(f.name for f in tmp_path.iterdir()) == ["results.json"]


def test_compare_refuses_to_write_over_a_video_report(tmp_path, capsys):
    ref, test = _video(tmp_path / "ref.npy"), _video(tmp_path / "qvg.npy", seed=1)
    (tmp_path / "ref.json").write_text(json.dumps({"pipeline": "tiny"}))
    for stem in ("ref", "qvg", "qvg.json"):
        assert main(["compare", ref, test, "--out", str(tmp_path / stem), "--lpips", "none"]) == 2
        _one_error(capsys, "would overwrite", "choose another name")
    assert json.loads((tmp_path / "ref.json").read_text()) == {"pipeline": "tiny"}


def test_compare_notes_come_after_the_result(tmp_path, capsys):
    """Different lengths and a guessed chunk layout are said (stderr, after the summary), not silent."""
    ref, test = _video(tmp_path / "ref.npy", frames=8), _video(tmp_path / "t.npy", frames=5)
    assert main(["compare", ref, test, "--lpips", "none"]) == 0
    cap = capsys.readouterr()
    assert "PSNR" in cap.out and (tmp_path / "t.compare.json").exists()
    err = cap.err.strip().splitlines()
    assert err[0] == "qvg-eval: note: REF has 8 frames, TEST 5: the first 5 were compared"
    assert err[1].startswith("qvg-eval: note: no qvg-generate report beside") and len(err) == 2
    assert main(["compare", ref, ref, "--lpips", "none", "--lead", "1", "--first", "3", "--chunk", "3"]) == 0
    assert capsys.readouterr().err == ""  # the layout given: nothing to say


def test_compare_reads_a_sidecar_that_is_no_report_as_none(tmp_path, capsys):
    """REF's .json beside it that is valid JSON but not an object (was an AttributeError traceback): no report."""
    ref, test = _video(tmp_path / "ref.npy"), _video(tmp_path / "t.npy", seed=1)
    for side, said in (("[1]", "beside REF, is not a qvg-generate report"), (b"\xff\xfe{", "is not a qvg-generate"),
                       ('{"pipeline": ["tiny"]}', "no qvg-generate report beside")):  # (an object, no pipeline name)
        (tmp_path / "ref.json").write_bytes(side if isinstance(side, bytes) else side.encode())
        assert main(["compare", ref, test, "--lpips", "none"]) == 0
        assert said in capsys.readouterr().err


def test_compare_names_the_argument_and_says_when_a_report_does_not_fit(tmp_path, capsys):
    """A missing REF or TEST says which; a threshold <= 0 dB (never triggers) is refused; a report beside REF whose
    frame count is not the video's is used with a note (its layout may be another video's)."""
    ref, test = _video(tmp_path / "ref.npy", frames=7), _video(tmp_path / "t.npy", frames=7, seed=1)
    for args, needle in (([str(tmp_path / "no.npy"), test], "REF: no such file"),
                         ([ref, str(tmp_path / "no.npy")], "TEST: no such file"),
                         ([ref, test, "--threshold", "-5"], "--threshold: must be > 0 dB, got '-5'"),
                         ([ref, test, "--threshold", "0"], "--threshold: must be > 0 dB")):
        assert main(["compare", *args, "--lpips", "none"]) == 2
        _one_error(capsys, needle)
    (tmp_path / "ref.json").write_text(json.dumps({"pipeline": "self-forcing", "frames": 31}))
    assert main(["compare", ref, test, "--lpips", "none"]) == 0
    assert ("REF's report says 31 frames, REF holds 7: the chunk layout taken from it (lead 0, first 9, chunk 12) may "
            "not be this video's") in capsys.readouterr().err
    assert main(["compare", ref, test, "--lpips", "none", "--first", "3"]) == 0  # (only what the report gave)
    assert "taken from it (lead 0, chunk 12)" in capsys.readouterr().err
    assert main(["compare", ref, test, "--lpips", "none", "--lead", "0", "--first", "3", "--chunk", "3"]) == 0
    assert capsys.readouterr().err == ""  # (the layout given whole: nothing taken from the report)
    (tmp_path / "ref.json").write_text(json.dumps({"pipeline": "tiny", "frames": 7}))
    assert main(["compare", ref, test, "--lpips", "none"]) == 0
    assert capsys.readouterr().err == ""


def test_a_file_no_reader_takes_is_one_line_naming_the_types(tmp_path, capsys):
    (tmp_path / "a.m4a").write_bytes(b"\x00" * 64)
    ref = _video(tmp_path / "ref.npy")
    assert main(["compare", str(tmp_path / "a.m4a"), ref, "--lpips", "none"]) == 2
    _one_error(capsys, "REF: cannot read", "(no reader for .m4a: give an .mp4,", ".gif, .npy or .pt file)")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "x"])
def test_compare_threshold_is_a_finite_number(tmp_path, capsys, value):
    ref = _video(tmp_path / "ref.npy")
    assert main(["compare", ref, ref, "--lpips", "none", f"--threshold={value}"]) == 2
    _one_error(capsys, "--threshold: must be a", repr(value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.npy"]


def test_compare_unwritable_out_and_a_folder_as_video(tmp_path, capsys):
    ref = _video(tmp_path / "ref.npy")
    assert main(["compare", ref, ref, "--out", ref + "/x", "--lpips", "none"]) == 2
    _one_error(capsys, "cannot write to")
    assert main(["compare", ref, str(tmp_path), "--lpips", "none"]) == 2
    _one_error(capsys, "is a folder, not a video file")


def test_vbench_inputs_first_and_missing_metrics_are_null(tmp_path, capsys):
    assert main(["vbench", str(tmp_path / "missing.mp4"), "--weights", str(tmp_path)]) == 2
    _one_error(capsys, "no such file")  # (before any "weights missing" line)
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    assert main(["vbench", _video(tmp_path / "ok.npy"), str(tmp_path / "junk.mp4"), "--weights", str(tmp_path)]) == 2
    _one_error(capsys, "cannot read", "junk.mp4")  # every video read before any weights
    assert main(["vbench", _video(tmp_path / "v.npy"), "--dims", ""]) == 2
    _one_error(capsys, "--dims: none given; choose among subject_consistency")
    assert main(["vbench", _video(tmp_path / "v.npy"), "--dims", "nonsense"]) == 2
    _one_error(capsys, "--dims: unknown nonsense; choose among subject_consistency")
    assert main(["vbench", _video(tmp_path / "v.npy"), "--dims", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("or 'all'") and "'none'" not in err, err  # (vbench refuses --dims none)
    out = tmp_path / "vb.json"
    # nothing computable: one error line naming both files of the metric, status 2, no all-null result
    assert main(["vbench", str(tmp_path / "v.npy"), "--dims", "aesthetic_quality", "--weights", str(tmp_path),
                 "--out", str(out)]) == 2
    err = _one_error(capsys, "no VBench dimension can be computed: aesthetic_quality")
    assert "clip-vit-large-patch14" in err and "sa_0_4_vit_l_14_linear.pth" in err  # both files named at once
    assert not out.exists()
    # --weights (or $QVG_WEIGHTS) naming no folder (a typo): an error, not notes
    for w, msg in ((tmp_path / "nope", "--weights: no such folder"), (out.parent / "v.npy", "--weights: not a folder"),
                   ("", "--weights is empty")):
        assert main(["vbench", str(tmp_path / "v.npy"), "--weights", str(w)]) == 2
        _one_error(capsys, msg)


def test_weights_env_naming_no_folder_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QVG_WEIGHTS", str(tmp_path / "typo"))
    assert main(["vbench", _video(tmp_path / "v.npy")]) == 2
    _one_error(capsys, "$QVG_WEIGHTS: no such folder")
    assert main(["vbench", str(tmp_path / "v.npy"), "--weights", str(tmp_path)]) == 2  # (--weights wins)
    _one_error(capsys, "no VBench dimension can be computed")


def test_vbench_has_no_lpips_option(tmp_path, capsys):
    assert main(["vbench", _video(tmp_path / "v.npy"), "--lpips", "alex"]) == 2
    _one_error(capsys, "unrecognized arguments: --lpips")


def test_runner_keys_as_qvg_generate(tiny_runner):
    from qvg.eval.runners import EmbeddedRunner
    assert tiny_runner.key_storage == "auto" and tiny_runner.describe()["key_storage"] == "auto"
    assert [tiny_runner.keys(m) for m in ("bf16", "rtn", "kivi", "quarot", "qvg", "qvg-pro")] == \
        ["post-rope", "pre-rope", "post-rope", "post-rope", "pre-rope", "pre-rope"]
    post = EmbeddedRunner(tiny_runner.model, tiny_runner.config, "cpu", key_storage="post-rope")
    assert {post.keys(m) for m in ("rtn", "qvg", "qvg-pro", "kivi")} == {"post-rope"}
    with pytest.raises(ValueError, match="key storage must be auto or post-rope"):
        EmbeddedRunner(tiny_runner.model, tiny_runner.config, "cpu", key_storage="pre-rope")


def test_runner_packs_keys_before_rope_by_default(tiny_runner):
    """The runner's qvg cache keeps keys before RoPE (their positions are stored), as qvg-generate's does on this
    model, so its video differs from the post-RoPE cache's."""
    from qvg.eval.runners import EmbeddedRunner
    auto = tiny_runner.run("coffee", 0, "qvg", {"bits": 2}, 2).video
    post = EmbeddedRunner(tiny_runner.model, tiny_runner.config, "cpu", key_storage="post-rope")
    assert not np.array_equal(auto.numpy(), post.run("coffee", 0, "qvg", {"bits": 2}, 2).video.numpy())
    assert tiny_runner.run("coffee", 0, "qvg", {"bits": 2}, 2).memory["positions"] > 0  # pre-RoPE keys keep them


def test_report_checks_before_making_its_folder(tmp_path, capsys):
    for extra, needle in ((["--key-storage", "pre-rope"], "invalid choice"), (["--model", str(tmp_path / "nope")],
                                                                              "--model"),
                          (["--vbench", "bogus"], "--vbench: unknown bogus")):
        assert main(["report", str(tmp_path / "new")] + extra) == 2
        _one_error(capsys, needle)
        assert not (tmp_path / "new").exists()


def test_compare_checks_before_making_its_folder(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--out", str(tmp_path / "new" / "z")]) == 2
    _one_error(capsys, "no such file")
    assert not (tmp_path / "new").exists()


def test_missing_weights_are_a_note_after_the_result_not_a_line_before_an_error(tmp_path, capsys):
    ref = _video(tmp_path / "ref.npy")
    (tmp_path / "w").mkdir()  # (a folder without the files: a note; no such folder is an error)
    assert main(["compare", ref, ref, "--lead", "10", "--weights", str(tmp_path / "w")]) == 2
    _one_error(capsys, "none after the 10 lead frame(s)")
    assert main(["compare", ref, ref, "--weights", str(tmp_path / "w"), "--lead", "1", "--first", "3", "--chunk",
                 "3"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-eval: note: LPIPS not computed: missing ")
    assert "alexnet-owt-7be5be79.pth" in err[0] and "lpips/alex.pth" in err[0]  # both files of the metric at once


def test_floor_notes_only_where_they_apply():
    from qvg.eval.cli import _check_sweep
    spec = dict(inputs=["coffee"], seeds=[0], methods=["kivi"], bits=[2], kmeans_seeds=[0], chunks=1,
                onset_chunks=1)
    assert _check_sweep(spec, "embedded") == ["one sampling seed: no sampling floor (give --seeds 0,1)"]
    assert _check_sweep(dict(spec, seeds=[0, 1], methods=["kivi", "qvg"]), "embedded") == [
        "one k-means seed: no k-means floor (give --kmeans-seeds 0,1)"]


@pytest.mark.parametrize("change,needle", [
    (["--seeds", "-1"], "--seeds must be in [0, "),
    (["--checkpoint", "x"], "--checkpoint applies to --pipeline self-forcing"),
])
def test_sweep_through_qvg_generate_checks_every_run_first(tmp_path, capsys, change, needle):
    """--pipeline tiny / self-forcing runs qvg-generate's code: its own checks of every run's arguments come
    before any work (one line, status 2, nothing made)."""
    args = ["sweep", str(tmp_path / "sw"), "--pipeline", "tiny"] + SWEEP
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == 2
    _one_error(capsys, needle)
    assert not (tmp_path / "sw").exists()
    assert main(["sweep", str(tmp_path / "sw"), "--pipeline", "self-forcing"] + SWEEP) == 2
    _one_error(capsys, "--pipeline self-forcing needs --checkpoint DIR")


@pytest.mark.parametrize("where", ["videos", "outdir"])
def test_sweep_through_qvg_generate_a_file_in_the_way(tmp_path, capsys, where):
    """A file where the sweep's videos folder (OUTDIR/videos) or OUTDIR would be: one line before any run, in the
    sweep's words (not qvg-generate's --out)."""
    out = tmp_path / "sw"
    if where == "videos":
        out.mkdir()
        (out / "videos").write_text("")
    else:
        out.write_text("")
    assert main(["sweep", str(out), "--pipeline", "tiny"] + SWEEP) == 2
    _one_error(capsys, f"cannot write the videos to {str(out / 'videos')!r}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == (["sw", "videos"] if where == "videos" else ["sw"])


def test_output_file_symlinked_into_a_missing_folder_is_refused_first(tmp_path, capsys):
    """qvg-eval checks where a symlinked output file points (its folder), before any work."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.json").symlink_to(tmp_path / "gone" / "sweep.json")
    assert main(["sweep", str(tmp_path / "out")] + SWEEP) == 2
    _one_error(capsys, f"cannot write {str(tmp_path / 'out' / 'sweep.json')!r}: cannot write to ")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sweep.json"]


def test_qvg_generate_errors_in_the_sweeps_words(tmp_path):
    from qvg.eval.runners import sweep_words
    assert sweep_words("--seed must be in [0, 9], got -1; --seeds stays", tmp_path) == \
        "--seeds must be in [0, 9], got -1; --seeds stays"
    assert sweep_words("--image: no such file; --kmeans-seed 3; --method x", tmp_path) == \
        "--inputs: no such file; --kmeans-seeds 3; --methods x"
    assert sweep_words("--out: cannot write", tmp_path) == f"the videos' folder {str(tmp_path)!r}: cannot write"
    # quoted text (a path, an input's name) is kept; an apostrophe in the prose opens no quote
    assert sweep_words("--image: no such file '/data/--image/a.png'; can't read --seed", tmp_path) == \
        "--inputs: no such file '/data/--image/a.png'; can't read --seeds"
    assert sweep_words('--out: "it\'s --out" is a folder', tmp_path) == \
        f'the videos\' folder {str(tmp_path)!r}: "it\'s --out" is a folder'


def test_qvg_generate_runner_passes_kmeans_seed_and_key_storage(tmp_path):
    """The k-means seed of a sweep run is qvg-generate's --kmeans-seed, never a second --seed (which replaced the
    sampling seed before), and the runner's key storage is passed."""
    from qvg.eval.runners import GenerateRunner
    r = GenerateRunner("tiny", None, "cpu", tmp_path / "videos")
    argv = r.argv("coffee", 3, "qvg", {"bits": 2, "seed": 1}, 1, tmp_path / "v.mp4")
    assert argv.count("--seed") == 1 and argv[argv.index("--seed") + 1] == "3"
    assert argv[argv.index("--kmeans-seed") + 1] == "1" and argv[argv.index("--key-storage") + 1] == "auto"
    assert not (tmp_path / "videos").exists()  # (made at the first run)


def test_report_header_names_the_key_storage(tiny_runner, tmp_path):
    from qvg.eval import report
    res = {"meta": {"preset": "x", "command": "c", "git_commit": "g", "date": "d", "device": "cpu", "torch": "t",
                    "centroids": 8, "lpips": "", "vbench": {}}, "model": {"pipeline": "p", "key_storage": "auto"}}
    report.render(res, tmp_path)
    assert "as `qvg-generate` runs it (keys packed before RoPE" in (tmp_path / "report.md").read_text()
    res["model"]["key_storage"] = "post-rope"
    report.render(res, tmp_path)
    assert "with every method's keys after RoPE" in (tmp_path / "report.md").read_text()


def test_an_error_mid_run_ends_the_open_progress_bars_first(tmp_path, capsys, monkeypatch):
    """A failure while a progress bar is open: the bar ends its line, the error is the last line of its own."""
    from qvg.eval import progress, sweep

    def run(*a, **k):
        b = progress.bar(3, "sweep", True, unit="video")
        b.update(1)
        raise OSError("[Errno 28] No space left on device")
    monkeypatch.setattr(sweep, "run", run)
    assert main(["sweep", str(tmp_path / "a" / "sw")] + SWEEP) == 1
    err = capsys.readouterr().err
    assert "sweep" in err and err.endswith("\n")
    assert err.rstrip("\n").split("\n")[-1] == "qvg-eval: error: [Errno 28] No space left on device", err
    assert list(tmp_path.iterdir()) == []  # the folders the failed run made (a/ too) are not left behind, empty


def test_the_folder_clean_up_keeps_the_users_folders_and_runs_for_any_failure(tmp_path, monkeypatch):
    """Through "..": new/../mine/out names mine/out, so of the folders named only new/ (made by mkdir) and out/ may
    go, never the user's (empty) mine/; and a failure that is not a usage error (a bug, out of memory) propagates
    as it is, after the same clean-up."""
    from qvg.eval import sweep
    (tmp_path / "mine").mkdir()

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(sweep, "run", boom)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        main(["sweep", "new/../mine/out"] + SWEEP)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and list((tmp_path / "mine").iterdir()) == []


def test_a_failure_after_the_output_folder_is_made_removes_it(tmp_path, capsys, monkeypatch):
    """The report's folder is made (and checked) before the weights load: a failure there leaves no empty folder."""
    from qvg.eval import cli

    def bad_weights(*a, **k):
        raise cli.UsageError("--weights: a broken LPIPS file")
    monkeypatch.setattr(cli, "_lpips", bad_weights)
    out = tmp_path / "new" / "out"
    assert main(["report", str(out), "--skip", "sweep,long,kv,warm,rope", "--no-progress", "--vbench", "none"]) == 2
    _one_error(capsys, "a broken LPIPS file")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("cmd", ["compare", "vbench"])
def test_an_out_file_in_a_missing_folder_is_refused_not_made(tmp_path, capsys, cmd):
    """--out names a file: its folder must be there, as with qvg-generate's --out (a mistyped path made folders,
    up to one at the file system's root); OUTDIR (report, sweep) is a folder, made."""
    ref = _video(tmp_path / "ref.npy")
    out = tmp_path / "new" / "sub" / "c"
    args = ["compare", ref, ref, "--lpips", "none"] if cmd == "compare" else ["vbench", ref, "--dims",
                                                                              "subject_consistency"]
    assert main([*args, "--out", str(out)]) == 2
    _one_error(capsys, f"--out: cannot write to {str(out.parent)!r} (no such directory)")
    assert not (tmp_path / "new").exists()


def test_vbench_never_writes_over_an_input(tmp_path, capsys):
    """--out naming an input video or its qvg-generate report is refused before any work (it was overwritten with
    the JSON); so are a folder and an empty name."""
    v = _video(tmp_path / "v.npy")
    (tmp_path / "v.json").write_text("{}")
    for out, needle in ((v, "an input video"), (str(tmp_path / "v.json"), "the report of"),
                        (str(tmp_path), "a folder or no name"), ("", "a folder or no name")):
        assert main(["vbench", v, "--dims", "aesthetic_quality", "--out", out]) == 2
        _one_error(capsys, "--out", needle)
    assert np.load(v).shape == (6, 16, 16, 3) and (tmp_path / "v.json").read_text() == "{}"


def test_compare_bad_paths_and_an_onset_past_the_video(tmp_path, capsys):
    """A .pt file that holds no tensor, '.' as a video or as --out, and --onset-chunks past the videos' chunks
    (clamped silently before) are one line each."""
    import torch
    ref = _video(tmp_path / "ref.npy")
    torch.save({"frames": 1}, tmp_path / "d.pt")
    for args, needle in (([ref, str(tmp_path / "d.pt")], "got a dict"), ([".", ref], "is a folder, not a video"),
                         ([ref, ref, "--out", "."], "no name"),
                         ([ref, ref, "--onset-chunks", "3"], "--onset-chunks must be in [1, 2]")):
        assert main(["compare", *args, "--lpips", "none"]) == 2
        _one_error(capsys, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.pt", "ref.npy"]
    (tmp_path / "res").mkdir()  # valid: --out X with a folder X there writes X.json and X.png beside it
    assert main(["compare", ref, ref, "--out", str(tmp_path / "res"), "--lpips", "none", "--onset-chunks", "2"]) == 0
    assert (tmp_path / "res.json").is_file() and (tmp_path / "res.png").is_file()
    capsys.readouterr()
    assert main(["compare", ref, ref, "--out", str(tmp_path / "res") + "/", "--lpips", "none"]) == 2  # the folder
    _one_error(capsys, "--out", "a folder; give the outputs' path without extension")
    # frames under SSIM's 11-pixel window: one line (was a RuntimeError from the convolution)
    small = _video(tmp_path / "small.npy", size=8)
    assert main(["compare", small, small, "--lpips", "none"]) == 2
    _one_error(capsys, "frames of 8 x 8 pixels: SSIM needs at least 11")


def test_a_relative_sweep_folder_is_removed_after_a_failure(tmp_path, capsys, monkeypatch):
    """OUTDIR given relative, the runs' videos/ folder made, then a usage error: no folder stays (videos/ was
    recorded relative and the folders absolute, so OUTDIR was tried first, while videos/ was still in it)."""
    from qvg.eval import cli, sweep

    def fail(*a, **k):
        (tmp_path / "x" / "y" / "videos").mkdir()
        raise cli.UsageError("a checkpoint that does not load")
    monkeypatch.setattr(sweep, "run", fail)
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "x/y"] + SWEEP) == 2
    _one_error(capsys, "a checkpoint that does not load")
    assert list(tmp_path.iterdir()) == []


def test_vbench_frames_and_dims_none(tmp_path, capsys):
    """A video with no frames, one frame for a frame-to-frame dimension, and --dims none: one line each, before any
    weights load (were a ValueError from the scorer, and an empty result with status 0)."""
    one, empty = _video(tmp_path / "one.npy", frames=1), _video(tmp_path / "empty.npy", frames=0)
    assert main(["vbench", one, "--dims", "subject_consistency"]) == 2
    _one_error(capsys, "one.npy: 1 frame; subject_consistency compares frames")
    assert main(["vbench", empty, "--dims", "aesthetic_quality"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-eval: error: ") and "empty.npy" in err[0], err
    assert main(["vbench", one, "--dims", "none"]) == 2
    _one_error(capsys, "--dims none: no dimension to compute")


def test_sweep_files_say_what_ran_and_its_notes(tmp_path, capsys):
    """sweep.md names the command, commit, inputs and seeds above the table, and both files hold the notes (a floor
    one seed cannot give), which went to the terminal only."""
    assert main(["sweep", str(tmp_path / "sw")] + SWEEP) == 0
    md = (tmp_path / "sw" / "sweep.md").read_text()
    res = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert md.startswith("# qvg-eval sweep\n\n`qvg-eval sweep ") and "inputs coffee; seeds 0" in md, md
    assert "- note: one sampling seed: no sampling floor" in md and "no k-means floor" in md, md
    assert any("no sampling floor" in n for n in res["notes"]) and any("k-means floor" in n for n in res["notes"])


def test_sweep_default_inputs_follow_the_pipeline(monkeypatch):
    """Without --inputs the embedded model gets the photos coffee and camera, Self-Forcing qvg-generate's default
    prompt (the photos' "coffee,camera" was read as one prompt)."""
    from qvg.app.generate import DEFAULT_PROMPT
    from qvg.eval import cli
    seen = []

    def stop(spec, pipeline):
        seen.append(spec["inputs"])
        raise cli.UsageError("stop")
    monkeypatch.setattr(cli, "_check_sweep", stop)
    assert main(["sweep", "x"]) == 2 and main(["sweep", "x", "--pipeline", "self-forcing"]) == 2
    assert seen == [["coffee", "camera"], [DEFAULT_PROMPT]]


@pytest.mark.parametrize("cmd", ["compare", "report", "sweep"])
def test_python_m_of_a_subcommands_module_runs_the_subcommand(cmd):
    """`python -m qvg.eval.report --help` printed nothing and exited 0; it is `qvg-eval report` now."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", f"qvg.eval.{cmd}", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: qvg-eval {cmd} "), r.stdout + r.stderr


def test_one_rgb_frame_is_not_read_as_grey_frames(tmp_path, capsys):
    """A [H, W, 3] array was read as H grey frames of W x 3 pixels (then refused for SSIM's window, or scored)."""
    np.save(tmp_path / "one.npy", np.zeros((64, 48, 3), np.uint8))
    ref = _video(tmp_path / "ref.npy", size=64)
    assert main(["compare", ref, str(tmp_path / "one.npy"), "--lpips", "none"]) == 2
    _one_error(capsys, "TEST: ", "frames of shape (64, 48, 3) read like one RGB frame: give frames [F, H, W, 3] "
                                 "(one frame: [1, H, W, 3]), or grey frames [F, H, W]")


def test_metrics_refuse_frames_of_different_shapes():
    """psnr broadcast [3, 1, H, W] against [3, 4, H, W] (one frame compared with four) without a word."""
    import torch
    from qvg.eval.metrics import psnr, ssim
    a, b = torch.zeros(3, 4, 16, 16), torch.zeros(3, 1, 16, 16)
    for f in (psnr, ssim):
        with pytest.raises(ValueError, match=r"frames of different shapes: \(3, 4, 16, 16\) and \(3, 1, 16, 16\)"):
            f(a, b)
    assert psnr(a, a) == 100.0
