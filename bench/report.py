"""docs/performance.md's tables and plots, made from the results files in ``bench/results/``.

    python -m bench.report            # rewrite the page's generated sections and its SVGs
    python -m bench.report --check    # exit 1 when the page is not what the results make
    python -m bench.report --results DIR --page PATH --figures DIR

The page's prose is written by hand (what the figures mean); each bench's figures live
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, which this rewrites and
nothing else. A bench with results and no such section gets one at the end of the page
(a page that does not exist yet is started). Per bench, from its results files
(:mod:`bench.results`):

- the latest run: when, on what commit and machine, with what command; a table of every
  system's figures and the subject's ratio against each baseline (above 1: the subject
  does better), with the range over the rounds where the bench ran rounds;
- ``<bench>-ratios.svg``: every ratio of every run on record, over time, one panel per
  baseline;
- ``<bench>-<distribution>.svg``: the latest run's latency distributions (the share of
  samples at or below each latency), where the bench keeps its samples.

Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import majors
from bench.results import RESULTS_DIR, ROOT, load_all

PAGE = ROOT / "docs" / "performance.md"
FIGURES = ROOT / "docs" / "performance"
# The order of the sections a page gets appended, and their headings.
TITLES = {
    "baselines": "Beside plain SQL, procrastinate, Absurd and Graphile Worker",
    "majors": "On every supported Postgres major",
    "rows": "One big run's rows",
    "history": "As finished history grows",
    "wake": "Waking one claimer, against the broadcast",
    "scale": "Worker hosts on one Postgres",
    "throughput": "Against bare procrastinate",
    "window": "What the schema window costs a command",
    "chaos": "Nothing lost under faults",
}
SECTION = re.compile(r"<!-- bench:(?P<name>[\w-]+) -->\n.*?<!-- /bench:(?P=name) -->", re.S)


def begin(name: str) -> str:
    return f"<!-- bench:{name} -->"


def end(name: str) -> str:
    return f"<!-- /bench:{name} -->"


# ---- numbers ----------------------------------------------------------------------------


def number(value: Any) -> str:
    """A figure as the tables show it: whole and thousands separated from 100, one decimal
    from 10, four significant digits below."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}".removesuffix(".0")
    return f"{value:.4g}"


def when(run: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(run["started_at"]).astimezone(UTC)


# ---- the page ---------------------------------------------------------------------------


def run_line(run: dict[str, Any], count: int) -> str:
    """When, what and where the latest run measured."""
    parts = [f"{when(run):%Y-%m-%d %H:%M} UTC"]
    sha = (run.get("commit") or {}).get("sha")
    if sha:
        dirty = " with local changes" if run["commit"].get("dirty") else ""
        parts.append(f"commit `{sha[:7]}`{dirty}")
    if run.get("command"):
        parts.append(f"`{run['command']}`")
    pg = run.get("postgres") or {}
    if pg.get("version") or pg.get("major"):
        parts.append(f"Postgres {pg.get('version') or pg.get('major')}")
    m = run.get("machine") or {}
    if m.get("cpus"):
        what = m.get("cpu") or m.get("note")
        cpu = f" ({what})" if what else ""
        load = [x for x in (m.get("loadavg_start"), m.get("loadavg_end")) if x is not None]
        shown = f", load {'-'.join(number(x) for x in load)}" if load else ""
        parts.append(f"{m['cpus']} CPUs{cpu}{shown}")
    runs = "the only run" if count == 1 else f"the latest of {count} runs"
    line = f"{runs.capitalize()} on record: " + "; ".join(parts) + "."
    if run.get("source"):
        line += f" {run['source']}"
    if run.get("error"):
        line += f" It recorded an error: {run['error']}"
    return line


def table(summary: dict[str, Any]) -> str:
    """Every system's figures, one row per figure; the subject's ratios in the last
    column."""
    systems: list[str] = summary["systems"]
    labels: dict[str, str] = summary.get("labels", {})
    ratios: dict[str, dict[str, float]] = summary.get("ratios", {})
    ranges: dict[str, dict[str, list[float]]] = summary.get("ratio_ranges", {})
    subject = summary.get("subject")
    head = ["figure", *(labels.get(s, s) for s in systems)]
    if ratios:
        who = labels.get(subject, subject) if subject else "each"
        head.append(f"{who} against (above 1: better)" if subject else "ratios (above 1: better)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in summary["metrics"]:
        cells = [f"{m['label']} ({m['unit']})"]
        for s in systems:
            value = summary["figures"].get(s, {}).get(m["key"])
            cells.append("-" if value is None else number(value))
        if ratios:
            shown = []
            for base, value in ratios.get(m["key"], {}).items():
                span = ranges.get(m["key"], {}).get(base)
                extra = f" ({number(span[0])}-{number(span[1])})" if span else ""
                shown.append(f"{number(value)}x {labels.get(base, base)}{extra}")
            cells.append(", ".join(shown) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section(name: str, runs: list[dict[str, Any]], svgs: list[tuple[str, str]]) -> str:
    """A bench's generated section: its latest run, its table, its plots."""
    if not runs:
        return f"No results on record: `python -m bench.{name}` writes them."
    latest = runs[-1]
    body = [run_line(latest, len(runs)), ""]
    if name == "majors" and "majors" in latest.get("results", {}):
        tabulated = latest["results"]
        rounds = ", ".join(f"{v}: {min(n.values())}" for v, n in tabulated["rounds"].items())
        body += [f"Medians over the rounds (per major: {rounds}), with their range.", ""]
        body.append(majors.markdown(tabulated))
    else:
        body.append(table(latest["summary"]))
    for alt, href in svgs:
        body += ["", f"![{alt}]({href})"]
    return "\n".join(body)


def fill(text: str, sections: dict[str, str]) -> str:
    """``text`` with every bench section replaced; a section the page lacks is appended."""
    done: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        done.add(name)
        if name not in sections:
            sections[name] = section(name, [], [])
        return f"{begin(name)}\n{sections[name]}\n{end(name)}"

    text = SECTION.sub(replace, text)
    for name, body in sections.items():
        if name not in done:
            title = TITLES.get(name, name)
            text = text.rstrip("\n") + f"\n\n## {title}\n\n{begin(name)}\n{body}\n{end(name)}\n"
    return text


# ---- the plots --------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib, set up for SVGs that change only when their data does."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("bench.report: matplotlib is needed (pip install -e '.[bench]')") from exc
    matplotlib.use("Agg")
    matplotlib.rcParams.update(
        {
            "svg.hashsalt": "bench.report",  # stable element ids
            "svg.fonttype": "none",  # text as text: small files, the reader's font
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})


def ratios_plot(name: str, runs: list[dict[str, Any]], path: Path) -> bool:
    """Every ratio of every run over time, a panel per baseline; False when there are
    none to plot."""
    series: dict[str, dict[str, list[tuple[datetime, float]]]] = {}
    labels: dict[str, str] = {}
    order: dict[str, int] = {}
    for run in runs:
        summary = run["summary"]
        labels |= summary.get("labels", {})
        titles = {m["key"]: m["label"] for m in summary["metrics"]}
        for m in summary["metrics"]:
            order.setdefault(m["label"], len(order))
        for key, against in summary.get("ratios", {}).items():
            for base, value in against.items():
                line = series.setdefault(base, {}).setdefault(titles.get(key, key), [])
                line.append((when(run), value))
    if not series:
        return False
    plt = _pyplot()
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.ticker import FuncFormatter, LogLocator

    subject = runs[-1]["summary"].get("subject")
    who = labels.get(subject, subject) if subject else None
    # One colour and marker per figure, the same in every panel.
    names = sorted(
        {label for lines in series.values() for label in lines}, key=lambda n: order.get(n, 0)
    )
    styles = {
        label: {"color": f"C{i % 10}", "marker": "os^Dv<>p*h"[i // 10 % 10]}
        for i, label in enumerate(names)
    }
    times = [when(run) for run in runs]
    pad = max(timedelta(days=1), (max(times) - min(times)) / 20)
    heights = [max(2.0, 0.6 + 0.17 * len(lines)) for lines in series.values()]
    fig, axes = plt.subplots(
        len(series),
        1,
        figsize=(9, sum(heights)),
        height_ratios=heights,
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, (base, lines) in zip(axes[:, 0], series.items(), strict=True):
        for label, points in lines.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, markersize=4, linewidth=1.2, label=label, **styles[label])
        values = [y for points in lines.values() for _, y in points]
        ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylim(min(*values, 1.0) / 2, max(*values, 1.0) * 2)
        ax.yaxis.set_major_locator(LogLocator(base=2))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        shown = labels.get(base, base)
        ax.set_title(f"{who} / {shown}" if who else shown, loc="left", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        locator = AutoDateLocator()  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    axes[0, 0].set_xlim(min(times) - pad, max(times) + pad)
    fig.suptitle(
        f"bench.{name}: ratios run by run (above 1: better)", x=0.0, ha="left", fontsize=10
    )
    _save(fig, path)
    plt.close(fig)
    return True


def distribution_plot(name: str, run: dict[str, Any], dist: dict[str, Any], path: Path) -> None:
    """The share of samples at or below each value, one line per system."""
    plt = _pyplot()
    labels = run["summary"].get("labels", {})
    fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
    low, high = float("inf"), 0.0
    for system, samples in dist["samples"].items():
        if not samples:
            continue
        ordered = sorted(samples)
        share = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, share, where="post", linewidth=1.2, label=labels.get(system, system))
        low, high = min(low, ordered[0]), max(high, ordered[-1])
    if low > 0 and high / low > 20:
        ax.set_xscale("log")
    ax.set_xlabel(dist["unit"])
    ax.set_ylabel("share of samples at or below")
    ax.set_ylim(0, 1.02)
    ax.grid(True, linewidth=0.3)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.set_title(
        f"bench.{name}: {dist['label']}, {when(run):%Y-%m-%d} run", loc="left", fontsize=10
    )
    _save(fig, path)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------


def by_bench(runs: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs with figures, per bench, oldest first; benches in the page's order."""
    found: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if isinstance(run.get("summary"), dict):
            found.setdefault(run["bench"], []).append(run)
    order = [*TITLES, *sorted(set(found) - set(TITLES))]
    return {name: found[name] for name in order if name in found}


def generate(
    results: Path = RESULTS_DIR, page: Path = PAGE, figures: Path = FIGURES, *, plots: bool = True
) -> tuple[str, list[Path]]:
    """The page's new text, and the SVGs written (none when ``plots`` is off: their
    links are made all the same)."""
    href = Path(os.path.relpath(figures, page.parent)).as_posix()
    sections: dict[str, str] = {}
    written: list[Path] = []
    for name, runs in by_bench(load_all(results)).items():
        svgs: list[tuple[str, str]] = []
        if any(r["summary"].get("ratios") for r in runs):
            path = figures / f"{name}-ratios.svg"
            if not plots or ratios_plot(name, runs, path):
                svgs.append((f"bench.{name}: ratios run by run", f"{href}/{path.name}"))
                written += [path] if plots else []
        latest = runs[-1]
        for dist in latest["summary"].get("distributions", []):
            path = figures / f"{name}-{dist['key']}.svg"
            if plots:
                distribution_plot(name, latest, dist, path)
                written.append(path)
            svgs.append((f"bench.{name}: {dist['label']}", f"{href}/{path.name}"))
        sections[name] = section(name, runs, svgs)
    text = page.read_text() if page.exists() else "# Performance\n"
    return fill(text, sections), written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results files")
    p.add_argument("--page", type=Path, default=PAGE, help="the page to write")
    p.add_argument("--figures", type=Path, default=FIGURES, help="where the SVGs go")
    p.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the page is out of date"
    )
    args = p.parse_args(argv)
    text, written = generate(args.results, args.page, args.figures, plots=not args.check)
    current = args.page.read_text() if args.page.exists() else None
    if args.check:
        if text != current:
            print(f"{args.page} is out of date: run python -m bench.report", file=sys.stderr)
            return 1
        return 0
    if text != current:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(text)
    for path in [args.page, *written]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
