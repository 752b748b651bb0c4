"""``python -m bench.report`` makes docs/performance.md's tables and plots from the results
files the benches write (bench/results.py): a fixture's figures land in the page's
generated section, the hand-written prose around it stays, and the SVGs are made."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from bench import report, results

PROSE = """# Performance

What the figures say, written by hand.

<!-- bench:baselines -->
stale table
<!-- /bench:baselines -->

## Conclusions

Kept as written.
"""


def fixture_run(folder: Path, started_at: str, ours_drain: float) -> Path:
    """A small results file as bench.baselines writes one: two systems, one ratio with its
    range, a latency distribution."""
    rng = random.Random(7)
    run = results.start("baselines", {"runs": 100, "rounds": 2})
    run["started_at"] = started_at
    run["postgres"] = {"version": "18.6", "major": 18}
    run["summary"] = results.summary(
        [
            results.metric("drain_cold", "drain 100 at concurrency 4, cold", "runs/s"),
            results.metric("pickup_p50", "pickup latency p50", "ms", higher_is_better=False),
        ],
        {
            "ours": {"drain_cold": ours_drain, "pickup_p50": 1.5},
            "graphile": {"drain_cold": 2000.0, "pickup_p50": 1.0},
        },
        labels={"graphile": "Graphile Worker"},
        ratio_ranges={"drain_cold": {"graphile": [1.1, 1.3]}},
        distributions=[
            {
                "key": "pickup",
                "label": "pickup latency",
                "unit": "ms",
                "samples": {
                    "ours": [rng.uniform(1.0, 3.0) for _ in range(50)],
                    "graphile": [rng.uniform(0.5, 2.0) for _ in range(50)],
                },
            }
        ],
    )
    return results.finish(run, results.default_path("baselines", started_at, folder))


def test_the_page_and_its_plots_are_made_from_the_results(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    first = fixture_run(folder, "2026-12-01T10:00:00+00:00", 2400.0)
    fixture_run(folder, "2026-12-03T10:00:00+00:00", 2500.0)
    (folder / "majors").mkdir()  # a bench's raw round reports: not read
    (folder / "majors" / "baselines-embedded-round1.json").write_text('{"results": {}}')
    assert first.name == "baselines-20261201T100000Z.json"
    written: dict[str, Any] = json.loads(first.read_text())
    assert written["schema"] == results.SCHEMA and written["bench"] == "baselines"
    assert {"commit", "machine", "config", "finished_at"} <= set(written)
    assert written["machine"]["cpus"] and "loadavg_end" in written["machine"]
    # Ours against the baseline, as a speed: a rate over the rate, a latency's inverse.
    assert written["summary"]["ratios"] == {
        "drain_cold": {"graphile": 1.2},
        "pickup_p50": {"graphile": 0.67},
    }

    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text(PROSE)
    figures = tmp_path / "docs" / "performance"
    args = ["--results", str(folder), "--page", str(page), "--figures", str(figures)]
    assert report.main([*args, "--check"]) == 1  # the stale table
    assert report.main(args) == 0

    text = page.read_text()
    assert text.startswith("# Performance\n\nWhat the figures say, written by hand.\n")
    assert text.endswith("## Conclusions\n\nKept as written.\n")
    assert "stale table" not in text
    assert "The latest of 2 runs on record: 2026-12-03 10:00 UTC" in text
    assert "| figure | ours | Graphile Worker | ours against (above 1: better) |" in text
    assert "| drain 100 at concurrency 4, cold (runs/s) | 2,500 | 2,000 |" in text
    assert "1.25x Graphile Worker (1.1-1.3)" in text
    assert "![bench.baselines: ratios run by run](performance/baselines-ratios.svg)" in text
    assert "(performance/baselines-pickup.svg)" in text
    for name in ("baselines-ratios.svg", "baselines-pickup.svg"):
        svg = (figures / name).read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert report.main([*args, "--check"]) == 0  # now in step with the results


def test_a_bench_without_a_section_gets_one_and_a_page_is_started(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    run = results.start("window", {"rounds": 5})
    run["summary"] = results.summary(
        [results.metric("stmts", "schema check: statements", "statements")],
        {"exact": {"stmts": 2}, "newer": {"stmts": 3}},
        subject=None,
        ratios={},
    )
    results.finish(run, results.default_path("window", run["started_at"], folder))
    page = tmp_path / "performance.md"
    args = ["--results", str(folder), "--page", str(page), "--figures", str(tmp_path / "svg")]
    assert report.main(args) == 0
    text = page.read_text()
    assert text.startswith("# Performance\n\n## What the schema window costs a command\n")
    assert "<!-- bench:window -->\nThe only run on record:" in text
    assert "| schema check: statements (statements) | 2 | 3 |" in text
    assert not (tmp_path / "svg").exists()  # no ratios, no samples: no plot
