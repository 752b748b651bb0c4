"""The chaos suite at CI size: 20 runs x 500 rows on three worker processes and a recovery
process, with SIGKILLed workers, one Postgres crash-restart and terminated backends.

``python -m bench.chaos --runs 100 --rows 1000`` runs the same suite larger.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from bench.chaos import ChaosConfig, run_chaos


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nothing_is_lost_under_kills_restarts_and_terminated_backends() -> None:
    cfg = ChaosConfig(
        runs=int(os.environ.get("CHAOS_RUNS", "20")),
        rows=int(os.environ.get("CHAOS_ROWS", "500")),
    )
    report = run_chaos(cfg, echo=lambda _line: None)
    print(asdict(report))  # the figures, for the CI log
    assert report.kills >= 3 and report.postgres_restarts == 1
    assert report.backend_terminations > 0
    assert report.states == {"succeeded": cfg.runs}
    assert report.rows_done == cfg.runs * cfg.rows
    assert report.rows_with_one_terminal_write == cfg.runs * cfg.rows
    assert report.rows_with_more_terminal_writes == 0
    assert report.reexecuted_completed_steps == 0
    assert report.stale_rows == 0
    # Side effects: one per row plus at most the in-flight chunk of each killed attempt.
    assert report.side_effects == cfg.runs * cfg.rows + report.extra_side_effects
    assert report.extra_side_effects <= (report.kills + 1) * cfg.concurrency * cfg.chunk
    assert report.problems == []
