"""argparse for the command-line tools (qvg-generate, qvg-app, qvg-eval, the `python -m` tools): a bad flag is one
error line (the tool's usage-error type, or "PROG: error: ..." and exit 2; no usage dump), and help lines never
break inside a hyphenated word (argparse's default wraps `qvg-output.mp4`, `self-forcing` and `qvg-pro` across two
lines)."""
from __future__ import annotations

import argparse
import sys
import textwrap


class HelpFormatter(argparse.HelpFormatter):
    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `usage_error` (a subclass sets the tool's type), with `HelpFormatter`."""
    usage_error: type[Exception] = ValueError

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, no usage dump
        raise self.usage_error(message)


class OneLineParser(Parser):
    """A Parser for the `python -m` tools: an error (a bad flag, or the tool's own `error(...)` call) is one line on
    stderr, "PROG: error: ...", and exit 2."""

    def __init__(self, *args, **kwargs):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if not args and "prog" not in kwargs and spec is not None and spec.name.startswith("qvg."):
            kwargs["prog"] = f"python -m {spec.name}"  # (run as `python -m qvg.x.y`: argparse said "y.py")
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
