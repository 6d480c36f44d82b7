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


def _attention_rows(md: str) -> list[list[str]]:
    sec = md[md.index("## Attention"):]
    sec = sec[:sec.index("Variants of the reads")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in sec.splitlines()
            if line.startswith("| 3")]


def test_attention_target_is_judged_on_the_on_chip_read():
    """The issue's target is the on-chip (fused) read against SDPA-flash: a run whose staged read beats SDPA but whose
    on-chip read does not is missed (kernels-h100.head-f2c79bc: staged 117-119%, on chip 53-54%), and a read that
    allocates the BF16 history is missed whatever its speed. The cuDNN default SDPA, the windowed read and each
    ablation format's share of SDPA-flash are shown beside it."""
    d = json.loads((RUN.parent / "kernels-h100.head-f2c79bc.json").read_text())
    rows = _attention_rows(render(d, ""))
    assert [r[4] for r in rows] == ["53%", "54%"] and all(r[-1] == "**missed**" for r in rows), rows
    assert all(int(r[7].rstrip("%")) > 100 for r in rows), rows  # (staged beat SDPA there: not what is judged)
    d = json.loads((RUN.parent / "kernels-h200.44b558f.json").read_text())
    md = render(d, "")
    rows = _attention_rows(md)
    assert [(r[2], r[4], r[5], r[8], r[-1]) for r in rows] == [
        ("1.823", "96%", "58%", "1.898", "met"), ("19.294", "99%", "62%", "19.351", "met")], rows
    assert "| qvg-pro int2 S4 B16 | 7.027 | 134 | 43% |" in md
    big = copy.deepcopy(d)
    big["attention"][0]["peak_transient_bytes"]["fused"] = big["attention"][0]["bf16_history_bytes_kv"]
    assert _attention_rows(render(big, ""))[0][-1] == "**missed** (allocates the BF16 history)"


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    from qvg.eval.kernels_report import main
    text, folder, lst = tmp_path / "t.json", tmp_path / "d", tmp_path / "l.json"
    text.write_text("hi")
    folder.mkdir()
    lst.write_text("[1]")
    empty = tmp_path / "e.json"
    empty.write_text("{}")
    for args, msg in (([str(text)], f"{str(text)!r} is not a bench_kernels JSON (Expecting value"),
                      ([str(tmp_path / "nope.json")], "cannot read"), ([str(folder)], "cannot read"),
                      ([str(lst)], "(a JSON list, not an object)"),
                      ([str(lst), "--notes", str(tmp_path / "n.md")], f"cannot read {str(tmp_path / 'n.md')!r}"),
                      ([str(empty)], "is not a bench_kernels JSON (no 'ceilings')")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "t.md").exists() and not (tmp_path / "e.md").exists()
