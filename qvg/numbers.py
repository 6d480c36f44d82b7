"""Whole numbers typed by a user (command-line flags, the UI's fields, action repeat counts): ASCII decimal digits
only. Python's int() also takes other scripts' digits ('٣' is 3) and underscores ('1_000'), which a flag's value
should not silently become."""
from __future__ import annotations

import argparse
import math
import operator
import re

_DECIMAL = re.compile(r"[+-]?[0-9]+")


def parse_int(text) -> int:
    """`text` (surrounding spaces allowed) as an int; ValueError unless it is an optional sign and ASCII digits."""
    s = str(text).strip()
    if not _DECIMAL.fullmatch(s):
        raise ValueError(f"invalid literal for a whole number: {text!r}")
    return int(s)


def integer(text) -> int:
    """`parse_int` as an argparse type (argparse then says "invalid integer value: '...'")."""
    return parse_int(text)


def is_int(v) -> bool:
    """Whether v is a Python int and not a bool (True is an int to isinstance). Options and sizes that are stored and
    written to JSON reports take these only (a numpy integer is not JSON)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_whole(v, low: int = 0) -> bool:
    """Whether v is an integer of any integer type (Python, numpy, a 0-d integer tensor: operator.index), not a
    bool, and >= low. For arguments only computed with, never stored in a JSON report (is_int for those)."""
    try:
        return not isinstance(v, bool) and operator.index(v) >= low
    except TypeError:
        return False


def finite(text: str) -> float:
    """A finite number, as an argparse type (nan and inf would reach a JSON report as non-standard NaN / Infinity,
    or pass every comparison's test the wrong way)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v
