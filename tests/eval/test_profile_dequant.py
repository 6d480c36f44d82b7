"""qvg.eval.profile_dequant's command line: bad input is refused with one line and exit 2 before any GPU work, and
a --baseline file is imported as a module of qvg.kernels (its relative imports resolve)."""
import pathlib

import pytest

from qvg.eval import profile_dequant


@pytest.mark.parametrize("argv,says", [(["--only", "nope"], "unknown option 'nope'"),
                                       (["--rounds", "0"], "--rounds must be >= 1"),
                                       (["--baseline", "/no/such/file.py"], "is not a file")])
def test_bad_input_one_line(argv, says, capsys):
    assert profile_dequant.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_baseline_loads_another_dequant_file():
    import qvg.kernels.dequant as current
    fn = profile_dequant._load_baseline(str(pathlib.Path(current.__file__)))
    assert callable(fn) and fn is not current.dequantize and fn.__name__ == "dequantize"


def test_options_are_dequantize_keywords():
    import inspect
    from qvg.kernels.dequant import dequantize
    params = set(inspect.signature(dequantize).parameters)
    for name, kw in profile_dequant.VARIANTS.items():
        assert set(kw) - {"per_sm"} <= params, name  # (per_sm: resolved to progs per shape)
        if "per_sm" in kw:
            got = profile_dequant.resolve(kw, 12, sms=132)
            assert set(got) <= params and got["progs"] == kw["per_sm"] * 11, name


def test_baseline_info_names_the_file_by_hash(tmp_path):
    import hashlib
    f = tmp_path / "dequant_old.py"
    f.write_bytes(b"# an older kernels/dequant.py\n")
    info = profile_dequant.baseline_info(str(f))
    assert info == {"path": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    assert profile_dequant.baseline_info("") is None
