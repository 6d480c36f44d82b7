"""Progress bars for the evaluation's long runs: tqdm on stderr, or a silent stand-in where tqdm is disabled or not
installed (a bare GPU image)."""
from __future__ import annotations

import sys
import weakref

_OPEN = weakref.WeakSet()  # the bars made here and not yet closed (`end_all`)


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
    b = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=leave)
    _OPEN.add(b)
    return b


def end_all() -> None:
    """Close every bar still open (a run stopped by an error or a signal): each ends its line, so what is printed
    next (the error) is a line of its own and the last one, not glued to a bar that is drawn again at exit."""
    for b in list(_OPEN):
        b.close()
    _OPEN.clear()
