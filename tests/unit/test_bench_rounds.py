"""bench.baselines --rounds: figures are medians over the rounds, ratios the median of each
round's own ratio (ours and the baseline measured in the same round), with their range."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench.baselines import combine, parse_args, print_floor, print_table


def rate(per_s: float) -> dict[str, float]:
    return {"n": 5000, "seconds": round(5000 / per_s, 4), "per_s": per_s}


def round_of(ours: float, graphile: float, p50: tuple[float, float]) -> dict[str, Any]:
    return {
        "ours": {
            "drain_analyzed": rate(ours),
            "drain_free_slots": rate(ours / 2),
            "pickup": {"n": 200, "p50_ms": p50[0], "p99_ms": 5.0},
        },
        "graphile": {
            "drain_analyzed": rate(graphile),
            "pickup": {"n": 200, "p50_ms": p50[1], "p99_ms": 3.0},
        },
        "absurd": {"skipped": "absurd-sdk not installed"},
    }


def test_medians_and_ratios_of_the_rounds() -> None:
    rounds = [
        round_of(2000.0, 2500.0, (2.0, 1.0)),  # 0.8x in a slow round for ours
        round_of(3000.0, 2000.0, (2.4, 1.2)),  # 1.5x
        round_of(2400.0, 2000.0, (2.2, 1.1)),  # 1.2x
    ]
    report = combine(rounds)
    ours = report["results"]["ours"]
    assert ours["drain_analyzed"]["per_s"] == 2400.0
    assert ours["drain_analyzed"]["rounds_per_s"] == [2000.0, 3000.0, 2400.0]
    assert ours["pickup"]["p50_ms"] == 2.2 and ours["pickup"]["n"] == 600
    assert report["results"]["absurd"] == {"skipped": "absurd-sdk not installed"}
    # The median of the rounds' own ratios (1.2), not the ratio of the medians (2400/2000).
    assert report["ratios"]["drain_analyzed"]["graphile"] == 1.2
    assert report["ratio_ranges"]["drain_analyzed"]["graphile"] == [0.8, 1.5]
    # Ours alone against the baselines' after-ANALYZE row, round by round.
    assert report["ratios"]["drain_free_slots"]["graphile"] == 0.6
    # Pickup: baseline p50 / ours p50 (0.5 in every round).
    assert report["ratios"]["pickup"]["graphile"] == 0.5


def test_one_round_is_that_round() -> None:
    only = round_of(1869.0, 2016.0, (2.2, 1.1))
    report = combine([only])
    assert report["results"]["ours"]["drain_analyzed"]["per_s"] == 1869.0
    assert report["ratios"]["drain_analyzed"]["graphile"] == 0.93
    assert report["ratio_ranges"]["drain_analyzed"]["graphile"] == [0.93, 0.93]


def test_a_failed_round_shows_its_error_and_no_ratio() -> None:
    rounds = [round_of(2000.0, 2500.0, (2.0, 1.0)), round_of(3000.0, 2000.0, (2.4, 1.2))]
    rounds[1]["graphile"]["drain_analyzed"] = {"error": "timed out waiting for every run"}
    report = combine(rounds)
    assert report["results"]["graphile"]["drain_analyzed"] == {
        "error": "timed out waiting for every run"
    }
    assert "graphile" not in report["ratios"].get("drain_analyzed", {})
    assert "graphile" not in report["ratios"].get("drain_free_slots", {})


def test_the_table_shows_the_range_of_the_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    rounds = [round_of(2000.0, 2500.0, (2.0, 1.0)), round_of(3000.0, 2000.0, (2.4, 1.2))]
    report = combine(rounds)
    args = parse_args(["--rounds", "2", "--systems", "ours,graphile,absurd"])
    print_table(report["results"], report["ratios"], args, report["ratio_ranges"])
    row = next(
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| drain 5,000 at concurrency 10, after ANALYZE (runs/s)")
    )
    assert "| 2,500 |" in row  # ours' median
    assert "1.15x graphile (0.8-1.5)" in row


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    assert "--rounds 0: at least 1" in capsys.readouterr().err


def test_one_round_prints_no_range(capsys: pytest.CaptureFixture[str]) -> None:
    report = combine([round_of(1869.0, 2016.0, (2.2, 1.1))])
    args: argparse.Namespace = parse_args(["--systems", "ours,graphile"])
    print_table(report["results"], report["ratios"], args, report["ratio_ranges"])
    out = capsys.readouterr().out
    assert "0.93x graphile |" in out and "(0.93-0.93)" not in out


def test_the_floor_is_compared_with_the_baselines_not_with_ours(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rounds = []
    for floor_p50, floor_rate in ((0.8, 3000.0), (1.0, 2200.0), (0.9, 2600.0)):
        r = round_of(2000.0, 2000.0, (2.0, 1.0))
        r["floor"] = {
            "drain_analyzed": rate(floor_rate),
            "pickup": {"n": 200, "p50_ms": floor_p50, "p99_ms": 2.0},
        }
        rounds.append(r)
    report = combine(rounds)
    # Ours against the floor too (2000 / 2600 in the middle round) ...
    assert report["ratios"]["drain_analyzed"]["floor"] == 0.77
    # ... and the floor against the others, never against ours.
    assert report["floor_ratios"]["drain_analyzed"] == {"graphile": 1.3}
    assert report["floor_ratio_ranges"]["drain_analyzed"]["graphile"] == [1.1, 1.5]
    assert report["floor_ratios"]["pickup"] == {"graphile": 1.11}
    assert "drain_free_slots" not in report["floor_ratios"]  # ours alone
    print_floor(report, parse_args(["--rounds", "3"]))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "the design's floor (bench/floor.py) / baseline:"
    assert "- drain N at concurrency C, after ANALYZE (runs/s): 1.3x graphile (1.1-1.5)" in out


def test_no_floor_prints_no_floor_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_floor(combine([round_of(1869.0, 2016.0, (2.2, 1.1))]), parse_args([]))
    assert capsys.readouterr().out == ""
