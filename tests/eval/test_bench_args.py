"""bench_pipeline's and bench_kernels' command lines (CPU): every bad argument is refused with one `error:` line
naming the option and exit 2, before the GPU check (so on any machine) and before anything runs or is written."""
import os

import pytest
import torch

from qvg.eval import bench_kernels as bk
from qvg.eval import bench_pipeline as bp


class Ran(Exception):
    """Raised where a run would start (result_header): the checks let the command line through."""


@pytest.fixture
def gpu_claimed(monkeypatch):
    """torch says a GPU is there, and a run stops at its first step: bad input must be refused before either."""
    def started(*a, **k):
        raise Ran
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp, "result_header", started)
    monkeypatch.setattr(bk, "result_header", started)


def _one_line(capsys) -> str:
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1, cap.err
    assert "Traceback" not in cap.err and "usage:" not in cap.err and cap.out == ""
    return lines[0]


PIPELINE_BAD = [
    (["--options", "{bad"], "--options is not JSON"),
    (["--options", "[1]"], "--options must be a JSON object"),
    (["--options", '{"centroids": -1}'], "--options"),
    (["--options", '{"nope": 1}'], "--options"),
    (["--methods", "bf16,rtn"], "--options (the default): rtn"),  # (rtn takes no centroids)
    (["--history", "abc"], "--history"),
    (["--history", "-3"], "--history"),
    (["--history", "0"], "--history"),
    (["--history", "20"], "--history must be comma-separated positive multiples of 3"),
    (["--history", "21,"], "--history"),
    (["--history", "21,21"], "--history lists 21 twice"),
    (["--repeat", "-1"], "--repeat must be >= 1"),
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--repeat", "abc"], "--repeat"),
    (["--foo"], "--foo"),
    (["--out", ""], "--out"),
    (["--methods", "bf16,nope"], "--methods: unknown cache method 'nope'"),
    (["--methods", "qvg"], "--methods must include bf16"),
    (["--methods", "bf16,qvg,qvg"], "--methods lists 'qvg' twice"),
    (["--max-history", "bf16,nope"], "--max-history: unknown cache method"),
    (["--max-history", "qvg", "--options", "[1]"], "--options must be a JSON object"),
    (["--methods", "bf16,kivi", "--options", '{"block_size": 0}'], "--options"),  # (was a ZeroDivisionError)
    (["--methods", "bf16,qvg", "--options", '{"block_size": 7}'], "--options"),  # (not dividing Wan's head dim 128)
]


@pytest.mark.parametrize("argv,says", PIPELINE_BAD)
def test_pipeline_bad_input_one_line_exit_2_before_the_gpu(argv, says, capsys, gpu_claimed):
    assert bp.main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith("bench_pipeline: error: ") and says in line


KERNELS_BAD = [
    (["--only", "foo"], "--only: unknown section 'foo'"),
    (["--only", "dequant,foo"], "--only: unknown section 'foo'"),
    (["--only", ","], "--only: no section given"),
    (["--compress-variants", "nope"], "--compress-variants: unknown variant 'nope'"),
    (["--compress-variants", "fast,nope"], "--compress-variants: unknown variant 'nope'"),
    (["--compress-variants", ","], "--compress-variants: no variant given"),
    (["--repeat", "abc"], "--repeat"),
    (["--foo"], "--foo"),
    (["--out", ""], "--out"),
]


@pytest.mark.parametrize("argv,says", KERNELS_BAD)
def test_kernels_bad_input_one_line_exit_2_before_the_gpu(argv, says, capsys, gpu_claimed):
    assert bk.main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith("bench_kernels: error: ") and says in line


def test_kernels_errors_list_the_choices(capsys):
    from qvg.kernels.compress import COMPRESS_VARIANTS
    assert bk.main(["--only", "foo"]) == 2
    line = _one_line(capsys)
    assert all(s in line for s in bk.SECTIONS)
    assert bk.main(["--compress-variants", "nope"]) == 2
    line = _one_line(capsys)
    assert all(v in line for v in ("auto", *COMPRESS_VARIANTS))


@pytest.mark.parametrize("main,tool", [(bp.main, "bench_pipeline"), (bk.main, "bench_kernels")])
def test_out_not_writable_is_refused_before_the_gpu(main, tool, tmp_path, capsys, gpu_claimed):
    if os.path.isdir("/proc"):  # (a folder there whose file system takes no files)
        assert main(["--out", "/proc/x"]) == 2
        line = _one_line(capsys)
        assert line.startswith(f"{tool}: error: --out '/proc/x'") and "/proc" in line
    afile = tmp_path / "a-file"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        assert main(["--out", str(out)]) == 2
        assert f"--out {str(out)!r}" in _one_line(capsys)
    if os.geteuid() != 0:  # (root writes in a read-only folder)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert main(["--out", str(ro / "new")]) == 2
        assert "cannot write to" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a-file"] + (["ro"] if os.geteuid() else []))


def test_out_error():
    assert bk.out_error("") is not None
    assert bk.out_error(os.getcwd()) is None


def test_good_input_reaches_the_run_and_makes_no_folder(tmp_path, gpu_claimed):
    """The checks let good command lines through (each stops where its run starts) and make nothing: the result's
    folder, missing parents included, is made when the result is written."""
    out = str(tmp_path / "a" / "b")
    for argv in ([], ["--history", "3,21,60", "--repeat", "6", "--split", "--methods", "bf16,qvg:sync,qvg-pro"],
                 ["--methods", "bf16,qvg-pro:every=2", "--options", '{"centroids": 32, "bits": 4}'],
                 ["--methods", "bf16,rtn", "--options", "{}"], ["--max-history", "bf16,qvg"],
                 ["--max-history", "bf16,qvg", "--history", "20"],  # (--history is not read there)
                 ["--methods", "bf16,bf16:shift,qvg:pre-rope,qvg:fused-read,qvg:compress=auto"]):
        with pytest.raises(Ran):
            bp.main(argv + ["--out", out])
    for argv in ([], ["--quick", "--only", "dequant, compress", "--compress-variants", "auto,fast-sort"]):
        with pytest.raises(Ran):
            bk.main(argv + ["--out", out])
    assert list(tmp_path.iterdir()) == []


def test_good_input_without_a_gpu_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="bench_pipeline: needs a CUDA GPU"):
        bp.main(["--out", str(tmp_path)])
    assert bk.main(["--out", str(tmp_path)]) == 2
    assert _one_line(capsys) == "bench_kernels: needs a CUDA GPU"


def test_parse_histories():
    assert bp.parse_histories("21,60") == [21, 60]
    assert bp.parse_histories(" 3 , 1200") == [3, 1200]
    for bad in ("", "21,", "x", "-3", "0", "4", "2.5e1", "²1"):
        with pytest.raises(ValueError, match="--history"):
            bp.parse_histories(bad)


@pytest.mark.parametrize("tool", ["host_slack", "trace_overlap"])
def test_the_one_history_tools_say_a_usage_error_in_one_line(tool, capsys):
    """pipeline_args' parser (host_slack, trace_overlap): one 'error:' line and exit 2, no usage block."""
    import importlib
    main = importlib.import_module(f"qvg.eval.{tool}").main
    for argv, says in ((["--history", "abc"], "--history: invalid int value"), (["--foo"], "--foo")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        line = _one_line(capsys)
        assert ": error: " in line and says in line
