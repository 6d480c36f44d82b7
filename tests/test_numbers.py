"""qvg.numbers.parse_int: ASCII decimal whole numbers only."""
import pytest

from qvg.numbers import parse_int


def test_ascii_decimal_only():
    assert [parse_int(t) for t in ("0", " 12 ", "-3", "+7", 5, "007")] == [0, 12, -3, 7, 5, 7]
    for bad in ("\u0663", "1\u0660", "1_000", "0x10", "1.0", "", " ", "1e3", "--1", "\uff11"):
        with pytest.raises(ValueError, match="invalid literal for a whole number"):
            parse_int(bad)


def test_integer_argparse_type_says_integer():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=__import__("qvg.numbers", fromlist=["integer"]).integer)
    assert p.parse_args(["--n", " 7"]).n == 7
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "\u0663"])
