"""eval/kernels_report.py renders a bench_kernels JSON as markdown; attention errors too large for BF16 rounding are
flagged (a wrong kernel must not pass as a row of numbers)."""
import copy
import json
from pathlib import Path

from qvg.eval.kernels_report import render

RUN = Path(__file__).resolve().parents[2] / "eval" / "results" / "kernels-h200.rope-554201a.json"


def test_render_flags_wrong_attention():
    d = json.loads(RUN.read_text())
    md = render(d, "")
    assert "19.666" in md and "1.0e-03 / 2.6e-03" in md and "WRONG" not in md
    bad = copy.deepcopy(d)
    bad["attention"][0]["fused_rope_rel_err_vs_fp32_reference_512_queries"] = 0.85
    bad["attention"][1]["rel_err_vs_sdpa_on_dequantized"]["fused"] = float("nan")
    assert render(bad, "").count("**WRONG**") == 2


def test_render_lists_eager_rounds_with_host_probes():
    d = json.loads((RUN.parent / "kernels-h200.compress-a460072.json").read_text())
    md = render(d, "")
    assert "qvg [auto]: eager rounds 1.069 ms (probe 13.5 ms), 1.090 ms (probe 13.3 ms)" in md
    assert "0.990 ms (probe 10.2 ms)" in md
    old = copy.deepcopy(d)  # a file from before the probe: no such lines
    for r in old["compress"]:
        del r["host_probe_rounds_ms"]
    assert "eager rounds" not in render(old, "")
