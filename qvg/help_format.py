"""argparse help for the command-line tools: lines never break inside a hyphenated word (argparse's default wraps
`qvg-output.mp4`, `self-forcing` and `qvg-pro` across two lines)."""
from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.HelpFormatter):
    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)
