"""This system on two (or more) Postgres majors, side by side, in one run.

For each round and each major in turn (alternating, so a machine slowing down over the
run weighs on every major alike), ``bench.baselines`` and ``bench.rows`` run at their
defaults against a throwaway server of that major (``--pg-bin``; the embedded wheel's
Postgres when the directory is ``embedded``). Their reports (JSON) are kept in ``--dir``;
the table printed, and written to ``--out``, has per major the median over the rounds of:

- ours, with the range over the rounds: drain at concurrency 10 (cold and after
  ANALYZE), the high-throughput drain, the pickup p50, steps per second, rows per second
  of one big run;
- ours against the other systems on the same server, the medians of each round's ratios
  (drain after ANALYZE / Graphile Worker, pickup p50 / Graphile Worker, steps / Absurd,
  rows / the plain-SQL floor and / procrastinate with one job per page);

and, for every major after the first, ours on it over ours on the first.

    python -m bench.majors --pg-bin embedded --pg-bin /usr/lib/postgresql/15/bin --rounds 2
    python -m bench.majors --tabulate DIR        # the table of reports already in DIR

The table is written as a results file under ``bench/results/`` (:mod:`bench.results`;
``--out`` names another path), which ``python -m bench.report`` shows in
docs/performance.md. The rounds' own reports stay in ``--dir``
(``bench/results/majors/``), which the report does not read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import results
from bench.common import add_out, add_rounds, write_results
from bench.results import as_speed, metric, summary

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "embedded"

# (label, report, how to read ours' figure, higher is better)
FIGURES: list[tuple[str, str, Callable[[dict[str, Any]], float], bool]] = [
    (
        "drain c10, cold (runs/s)",
        "baselines",
        lambda r: r["results"]["ours"]["drain_cold"]["per_s"],
        True,
    ),
    (
        "drain c10, after ANALYZE (runs/s)",
        "baselines",
        lambda r: r["results"]["ours"]["drain_analyzed"]["per_s"],
        True,
    ),
    (
        "drain, high-throughput mode (runs/s)",
        "baselines",
        lambda r: r["results"]["ours"]["drain_tuned"]["per_s"],
        True,
    ),
    ("pickup p50 (ms)", "baselines", lambda r: r["results"]["ours"]["pickup"]["p50_ms"], False),
    (
        "steps of one run (steps/s)",
        "baselines",
        lambda r: r["results"]["ours"]["steps"]["per_s"],
        True,
    ),
    (
        "rows of one run, 100,000 (rows/s)",
        "rows",
        lambda r: r["results"]["ours"]["rows_per_s"],
        True,
    ),
]
# (label, report, how to read the ratio) on the same server
RATIOS: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
    (
        "drain after ANALYZE / Graphile Worker",
        "baselines",
        lambda r: r["ratios"]["drain_analyzed"]["graphile"],
    ),
    (
        "pickup p50 as a speed / Graphile Worker",
        "baselines",
        lambda r: r["ratios"]["pickup"]["graphile"],
    ),
    ("steps / Absurd", "baselines", lambda r: r["ratios"]["steps"]["absurd"]),
    ("rows / plain-SQL floor (unnest)", "rows", lambda r: r["ratios"]["ours_over_floor_unnest"]),
    (
        "rows / procrastinate, 1 job per page",
        "rows",
        lambda r: r["ratios"]["ours_over_procrastinate_pages"],
    ),
]


def _report_name(kind: str, major: str, n: int) -> str:
    return f"{kind}-{major}-round{n}.json"


def _major_label(pg_bin: str) -> str:
    return "embedded" if pg_bin == EMBEDDED else Path(pg_bin).parent.name


def run(pg_bins: list[str], rounds: int, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, rounds + 1):
        for pg_bin in pg_bins:
            extra = [] if pg_bin == EMBEDDED else ["--pg-bin", pg_bin]
            for kind, module in (("baselines", "bench.baselines"), ("rows", "bench.rows")):
                out = folder / _report_name(kind, _major_label(pg_bin), n)
                print(f"round {n}: {module} on {pg_bin} -> {out}", file=sys.stderr)
                subprocess.run(
                    [sys.executable, "-m", module, *extra, "--out", str(out)],
                    cwd=ROOT,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )


def tabulate(folder: Path) -> dict[str, Any]:
    """The medians per major of the reports in ``folder``, keyed by the server version."""
    reports: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*-round*.json")):
        kind = path.name.split("-", 1)[0]
        report = json.loads(path.read_text())
        if "error" in report:
            raise SystemExit(f"bench.majors: {path} records an error: {report['error']}")
        version = str(report["postgres"]["version"]).split()[0]
        reports.setdefault(version, {}).setdefault(kind, []).append(report)
    if not reports:
        raise SystemExit(f"bench.majors: no reports in {folder}")
    majors = sorted(reports, key=lambda v: [int(x) for x in v.split(".")], reverse=True)
    table: dict[str, Any] = {"majors": majors, "figures": {}, "ratios": {}, "rounds": {}}
    for version in majors:
        table["rounds"][version] = {k: len(v) for k, v in reports[version].items()}
    table["ranges"] = {}
    for label, kind, read, _ in FIGURES:
        seen = {v: [read(r) for r in reports[v][kind]] for v in majors}
        table["figures"][label] = {v: round(statistics.median(x), 1) for v, x in seen.items()}
        table["ranges"][label] = {v: [round(min(x), 1), round(max(x), 1)] for v, x in seen.items()}
    for label, kind, read in RATIOS:
        table["ratios"][label] = {
            v: round(statistics.median(read(r) for r in reports[v][kind]), 2) for v in majors
        }
    return table


def markdown(table: dict[str, Any]) -> str:
    majors: list[str] = table["majors"]
    first = majors[0]
    head = ["ours", *(f"Postgres {v}" for v in majors)]
    head += [f"{v} / {first}" for v in majors[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, _, _, higher in FIGURES:
        values = table["figures"][label]
        spans = table["ranges"][label]
        cells = [label, *(f"{values[v]:,} ({spans[v][0]:,}-{spans[v][1]:,})" for v in majors)]
        for v in majors[1:]:
            ratio = values[v] / values[first] if higher else values[first] / values[v]
            cells.append(f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| ours / another system, same server | "
        + " | ".join(f"Postgres {v}" for v in majors)
        + " |",
        "|" + "---|" * (len(majors) + 1),
    ]
    for label, _, _ in RATIOS:
        values = table["ratios"][label]
        lines.append("| " + " | ".join([label, *(f"{values[v]:.2f}x" for v in majors)]) + " |")
    return "\n".join(lines)


def summarize(table: dict[str, Any]) -> dict[str, Any]:
    """The table for :mod:`bench.results`: ours per major (the columns), and each major
    after the first against the first (``15.18 / 18.6``)."""
    majors: list[str] = table["majors"]
    systems = {v: f"Postgres {v}" for v in majors}
    metrics = []
    for label, _, _, higher in FIGURES:  # "drain c10, cold (runs/s)": the unit in brackets
        shown, unit = label.removesuffix(")").rsplit(" (", 1)
        metrics.append(metric(label, shown, unit, higher_is_better=higher))
    figures = {
        systems[v]: {label: table["figures"][label][v] for label, *_ in FIGURES} for v in majors
    }
    ratios: dict[str, dict[str, float]] = {}
    for label, _, _, higher in FIGURES:
        first = table["figures"][label][majors[0]]
        for v in majors[1:]:
            speed = as_speed(table["figures"][label][v], first, higher_is_better=higher)
            if speed is not None:
                ratios.setdefault(label, {})[f"{v} / {majors[0]}"] = speed
    return summary(metrics, figures, subject=None, ratios=ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg-bin", action="append", default=[], metavar="DIR|embedded")
    add_rounds(p, default=2, help="rounds over every major, the majors alternating")
    p.add_argument("--dir", type=Path, default=ROOT / "bench" / "results" / "majors")
    p.add_argument("--tabulate", type=Path, metavar="DIR", help="only tabulate DIR's reports")
    add_out(p)
    args = p.parse_args(argv)
    folder = args.tabulate or args.dir
    report = results.start("majors", args)
    if args.tabulate is None:
        if len(args.pg_bin) < 2:
            p.error("give two --pg-bin or more (the embedded server is 'embedded')")
        run(args.pg_bin, args.rounds, folder)
    table = tabulate(folder)
    table["tabulated_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    report["results"] = table
    report["summary"] = summarize(table)
    print(markdown(table))
    write_results(report, args.out, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
