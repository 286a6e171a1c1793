"""The README's performance table and chart from `bench_fwd.py --json`'s output.

    python benchmarks/render_results.py RUN.json [--svg docs/forward.svg] [--readme README.md]

prints the markdown table (with the run's date, GPU, software, build and command
above it), writes the chart as SVG where --svg is given (ms per case for
torch_kda and fla, the memory floor marked on each case), and with --readme
replaces the README's table between its `<!-- perf-table -->` markers. Plain
Python: no plotting package.
"""
import argparse
import json
import math
import re
import sys
from xml.sax.saxutils import escape

MARK_BEGIN, MARK_END = "<!-- perf-table -->", "<!-- /perf-table -->"


def fmt(x, digits=3):
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def speedup(row):
    fla, ours = row.get("fla_ms"), row["torch_kda_ms"]
    if fla is None or not (math.isfinite(fla) and math.isfinite(ours)) or ours <= 0:
        return None
    return fla / ours


def table(data):
    """The run's description and its rows as markdown."""
    run = data["run"]
    fla = f", fla-core {run['fla']}" if run.get("fla") else ""
    lines = [
        f"{run['gpu']}, torch {run['torch']}{fla}, {run['date']}, commit {run.get('commit') or 'unknown'}, "
        f"{run['gate']} gate, `{run['command']}`; floor: the call's inputs read and outputs written once "
        f"at the measured copy bandwidth ({run['copy_bandwidth_tb_s']:.2f} TB/s).",
        "",
        "| case | heads | torch_kda ms | fla ms | speedup | floor ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        s = speedup(r)
        lines.append(f"| {r['name']} | {r['H']} | {fmt(r['torch_kda_ms'])} | {fmt(r.get('fla_ms'))} | "
                     f"{fmt(s, 2) if s is not None else 'n/a'} | {fmt(r['floor_ms'])} |")
    speedups = [s for s in map(speedup, data["rows"]) if s is not None]
    if speedups:
        mean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        lines += ["", f"Speedup over fla: min {min(speedups):.2f}, geometric mean {mean:.2f} "
                      f"({len(speedups)} cases)."]
    return "\n".join(lines)


def svg(data, width=760, bar_h=9, gap=8, left=170, right=70):
    """Horizontal bars, ms per case: torch_kda and fla, the floor as a tick on each case."""
    rows = data["rows"]
    values = [v for r in rows for v in (r["torch_kda_ms"], r.get("fla_ms"), r["floor_ms"])
              if v is not None and math.isfinite(v)]
    top = max(values) if values else 1.0
    plot_w = width - left - right
    x = lambda ms: left + plot_w * ms / top  # noqa: E731
    row_h = 2 * bar_h + gap
    height = 40 + row_h * len(rows) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">',
           f'<text x="{left}" y="16" font-size="12">forward ms per case ({escape(data["run"]["gpu"])}, '
           f'{escape(data["run"]["date"])}); | marks the memory floor</text>']
    for i, r in enumerate(rows):
        y = 30 + i * row_h
        out.append(f'<text x="{left - 6}" y="{y + bar_h + 3}" text-anchor="end">'
                   f'{escape(r["name"])}, H {r["H"]}</text>')
        for j, (key, color) in enumerate((("torch_kda_ms", "#3b6fb6"), ("fla_ms", "#d9822b"))):
            v = r.get(key)
            if v is None or not math.isfinite(v):
                continue
            yy = y + j * bar_h
            out.append(f'<rect x="{left}" y="{yy}" width="{x(v) - left:.1f}" height="{bar_h - 1}" fill="{color}"/>')
            out.append(f'<text x="{x(v) + 3:.1f}" y="{yy + bar_h - 1}">{v:.3f}</text>')
        f = r["floor_ms"]
        out.append(f'<line x1="{x(f):.1f}" x2="{x(f):.1f}" y1="{y - 1}" y2="{y + 2 * bar_h}" stroke="black" '
                   f'stroke-width="2"/>')
    legend_y = height - 12
    out.append(f'<rect x="{left}" y="{legend_y - 9}" width="10" height="9" fill="#3b6fb6"/>'
               f'<text x="{left + 14}" y="{legend_y}">torch_kda</text>'
               f'<rect x="{left + 90}" y="{legend_y - 9}" width="10" height="9" fill="#d9822b"/>'
               f'<text x="{left + 104}" y="{legend_y}">fla chunk_kda</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def replace_in_readme(readme, text):
    """readme with the text between the perf-table markers replaced; raises if they are missing."""
    pattern = re.compile(re.escape(MARK_BEGIN) + r".*?" + re.escape(MARK_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"the README has no {MARK_BEGIN} ... {MARK_END} markers")
    return pattern.sub(lambda _: f"{MARK_BEGIN}\n{text}\n{MARK_END}", readme)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="bench_fwd.py --json's output")
    ap.add_argument("--svg", help="write the chart here")
    ap.add_argument("--readme", help="replace the table between the README's perf-table markers")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    text = table(data)
    print(text)
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(data))
    if args.readme:
        with open(args.readme) as f:
            readme = f.read()
        with open(args.readme, "w") as f:
            f.write(replace_in_readme(readme, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
