"""The standalone CPU studies' command line and results: their shared options (`parser`, `out_error`: --out checked
before the work, --seeds), their provenance fields (`stamp`: centroid_precision, warm_iters), and their JSON +
markdown written both or none after the markdown is printed (`save`: those two and rope_storage)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from qvg.help_format import OneLineParser
from qvg.numbers import parse_int
from qvg.outputs import folder_error, write_texts
from qvg.revision import code_commit

from .provenance import command_line


def parser(module: str, doc: str, names: tuple[str, str]) -> OneLineParser:
    """`python -m qvg.eval.MODULE`'s parser (described by doc's first sentence) with --out (the folder of `names`)
    and --seeds (k-means seeds: the seed floor)."""
    ap = OneLineParser(prog=f"python -m qvg.eval.{module}", description=doc.split(" `")[0])
    ap.add_argument("--out", default=".", help=f"output folder for {' / '.join(names)} (default: the current one; "
                    "the committed copies are in eval/results)")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2],
                    help="k-means seeds, comma-separated (default 0,1,2: the seed floor)")
    return ap


def out_error(prog: str, out: str, names: tuple[str, str]) -> int:
    """2 after one error line if `names` cannot be written in folder `out` (checked before the work), else 0."""
    why = folder_error(out, names)
    if why:
        print(f"{prog}: error: --out: {why}", file=sys.stderr)
        return 2
    return 0


def seed_list(text: str) -> list[int]:
    """--seeds: distinct comma-separated integers in [0, 2**63 - 4] (stage s of qvg-pro's chain uses seed + s)."""
    try:
        seeds = [parse_int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    bad = next((s for s in seeds if not 0 <= s <= 2 ** 63 - 4), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"each seed must be in [0, 2**63 - 4], got {bad}")
    if len(set(seeds)) < len(seeds):  # (a repeated seed would shrink the seed floor)
        raise argparse.ArgumentTypeError(f"each seed once, got {text!r}")
    return seeds


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
