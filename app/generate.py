"""`qvg-generate`: the main job's CLI. The chunk-wise generation pipeline lands with issue 4; until then this
command says so instead of pretending."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: qvg-generate [options]\n\nGenerates video chunk by chunk with a QVG-compressed KV cache.\n"
              "Not yet available: the generation pipeline lands with issue 4.")
        return 0
    print("qvg-generate: not yet: the chunk-wise generation pipeline lands with issue 4. The compression core is "
          "here: try `python -m qvg.eval.kv_analysis` or `import qvg; qvg.compress(...)`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
