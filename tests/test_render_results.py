"""benchmarks/render_results.py: the README's table and chart from bench_fwd.py's JSON."""
import json
import math
import pathlib
import random
import sys
import xml.etree.ElementTree as ET

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import render_results  # noqa: E402


def run_data(n, without_fla=()):
    rng = random.Random(n)
    rows = []
    for i in range(1, n + 1):
        ours = rng.uniform(0.2, 3.0)
        rows.append(dict(case=i, name=f"case {i}", H=rng.choice([16, 32, 96]), torch_kda_ms=ours,
                         fla_ms=None if i in without_fla else ours * rng.uniform(1.5, 7.0),
                         floor_ms=ours / rng.uniform(2.0, 8.0)))
    run = dict(date="2026-01-01", gpu="GPU X", torch="2.x", fla="0.x", commit="abc1234", gate="bounded",
               command="python benchmarks/bench_fwd.py --json out.json", copy_bandwidth_tb_s=4.1)
    return dict(run=run, rows=rows)


def test_table_rows_and_speedups():
    data = run_data(5, without_fla={3})
    text = render_results.table(data)
    body = [line for line in text.splitlines() if line.startswith("| case ") and not line.startswith("| case |")]
    assert len(body) == 5
    for line, row in zip(body, data["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row["name"] and float(cells[2]) == pytest.approx(row["torch_kda_ms"], abs=5e-4)
        if row["fla_ms"] is None:
            assert cells[3] == cells[4] == "n/a"
        else:
            assert float(cells[4]) == pytest.approx(row["fla_ms"] / row["torch_kda_ms"], abs=5e-3)
    speedups = [r["fla_ms"] / r["torch_kda_ms"] for r in data["rows"] if r["fla_ms"] is not None]
    mean = math.exp(sum(map(math.log, speedups)) / len(speedups))
    assert f"min {min(speedups):.2f}, geometric mean {mean:.2f} (4 cases)" in text
    for field in ("GPU X", "2026-01-01", "abc1234", "bench_fwd.py --json out.json", "4.10 TB/s"):
        assert field in text


def test_svg_has_a_bar_per_value_and_a_floor_per_case():
    data = run_data(6, without_fla={2, 5})
    root = ET.fromstring(render_results.svg(data))
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(ns + "rect") if float(r.get("width")) != 10]  # not the legend's
    assert len(bars) == 6 + 4
    assert len(list(root.iter(ns + "line"))) == 6
    widths = {round(float(b.get("width")), 1) for b in bars}
    assert max(widths) <= 760


def test_readme_table_is_replaced_between_the_markers(tmp_path):
    readme = f"intro\n{render_results.MARK_BEGIN}\nold table\n{render_results.MARK_END}\nrest\n"
    out = render_results.replace_in_readme(readme, "new table")
    assert out == f"intro\n{render_results.MARK_BEGIN}\nnew table\n{render_results.MARK_END}\nrest\n"
    with pytest.raises(ValueError, match="markers"):
        render_results.replace_in_readme("no markers here", "x")
    data = run_data(3)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    md = tmp_path / "README.md"
    md.write_text(readme)
    assert render_results.main([str(path), "--svg", str(tmp_path / "c.svg"), "--readme", str(md)]) == 0
    assert "case 3" in md.read_text() and (tmp_path / "c.svg").read_text().startswith("<svg")


def test_readme_has_the_markers():
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert readme.count(render_results.MARK_BEGIN) == 1 and readme.count(render_results.MARK_END) == 1
