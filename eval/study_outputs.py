"""The standalone CPU studies' results: their provenance fields (`stamp`: centroid_precision, warm_iters), and their
JSON + markdown written both or none after the markdown is printed (`save`: those two and rope_storage)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from qvg.outputs import write_texts
from qvg.revision import code_commit

from .provenance import command_line


def stamp(res: dict, prog: str, argv: list[str] | None, t0: float) -> dict:
    """res with the exact command, the git commit, the date, the platform and the wall time since t0."""
    res.update(command=command_line(prog, argv), commit=code_commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               platform=f"torch {torch.__version__}; python {platform.python_version()}; cpu "
                        f"({platform.machine()}, {torch.get_num_threads()} threads)",
               wall_s=time.time() - t0)
    return res


def save(prog: str, out: str, names: tuple[str, str], res: dict, text: str) -> int:
    """Print the markdown `text`, then write out/names[0] (res as JSON) and out/names[1] (text), both or neither:
    0, or 1 after one error line (a full disk, a folder removed meanwhile)."""
    print(text.rstrip("\n"))
    js, md = (Path(out) / name for name in names)
    try:
        os.makedirs(out, exist_ok=True)
        write_texts({js: json.dumps(res, indent=1), md: text})
    except OSError as e:
        print(f"{prog}: error: cannot write to {out!r} ({e.strerror or e}); nothing written", file=sys.stderr)
        return 1
    print(f"wrote {js}\nwrote {md}")
    return 0
