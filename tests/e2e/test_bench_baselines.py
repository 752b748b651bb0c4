"""A smoke run of ``python -m bench.baselines``: ours, plain SQL and the design's floor,
chosen groups, two rounds, tiny sizes; what it writes and prints (the bench had no run of
its own in the suite: a change that broke it would have shown only at the next
measurement)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benches import run_bench


def test_bench_baselines_runs_the_chosen_groups_in_rounds(tmp_path: Path) -> None:
    out = tmp_path / "baselines.json"
    done = run_bench(
        "baselines",
        *("--systems", "ours,plain,floor", "--groups", "drain,submit", "--rounds", "2"),
        *("--runs", "60", "--batch", "20", "--tuned-runs", "80", "--tuned-prefetch", "20"),
        *("--concurrency", "4", "--out", str(out)),
        timeout=420,
    )
    report = json.loads(out.read_text())
    assert report["config"]["groups"] == ["submit", "drain"]  # the bench's own order
    rounds = report["rounds"]
    assert len(rounds) == 2
    for r in rounds:
        assert set(r["ours"]) == {
            "submit_one",
            "submit_batch",
            "drain_cold",
            "drain_analyzed",
            "drain_free_slots",
            "drain_tuned",
        }
        assert set(r["plain"]) == {"submit_one", "submit_batch"}  # plain SQL does not drain
        assert set(r["floor"]) == {
            "submit_one",
            "submit_batch",
            "drain_cold",
            "drain_analyzed",
            "drain_tuned",
        }
    ours = report["results"]["ours"]
    for scenario in ("submit_one", "drain_cold", "drain_tuned"):
        figures = ours[scenario]["rounds_per_s"]
        assert len(figures) == 2 and all(f > 0 for f in figures)
        assert min(figures) <= ours[scenario]["per_s"] <= max(figures)
    assert ours["drain_tuned"]["n"] == 80
    low, high = report["ratio_ranges"]["submit_one"]["plain"]
    assert low <= report["ratios"]["submit_one"]["plain"] <= high
    assert set(report["ratios"]["drain_cold"]) == {"floor"}  # the only other that drains
    # The floor against the baselines but ours: plain SQL here.
    assert set(report["floor_ratios"]) == {"submit_one", "submit_batch"}
    assert set(report["floor_ratios"]["submit_one"]) == {"plain"}
    assert "the design's floor (bench/floor.py) / baseline:" in done.stdout
    row = next(
        line for line in done.stdout.splitlines() if line.startswith("| submit 60, one at a time")
    )
    assert f"x plain ({low}-{high})" in row
    assert "pickup" not in done.stdout and "step calls" not in done.stdout


def test_bench_baselines_refuses_an_unknown_group() -> None:
    done = run_bench("baselines", "--groups", "drain,latency", timeout=60, code=2)
    assert "unknown groups ['latency']; choose from submit, drain, pickup, steps" in done.stderr
