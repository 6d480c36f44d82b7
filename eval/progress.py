"""Progress bars for the evaluation's long runs: tqdm on stderr, or a silent stand-in where tqdm is disabled or not
installed (a bare GPU image)."""
from __future__ import annotations

import sys


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, s: str) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it", leave: bool = True):
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=leave)
