"""The chaos suite at CI size: 20 runs x 500 rows over 5 shared sheets, on three worker
processes and a recovery process, at the lane's default retry policy, with SIGKILLed
workers, one Postgres crash-restart and terminated backends, all scheduled by progress.

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
        seed=int(os.environ.get("CHAOS_SEED", "7")),
    )
    report = run_chaos(cfg, echo=lambda _line: None)
    print(asdict(report))  # the figures, for the CI log
    # The faults really happened, and the runs really competed for rows.
    assert report.kills >= 3 and report.postgres_restarts == 1
    assert report.backend_terminations > 0
    assert report.attempt_outcomes.get("lease_expired", 0) > 0
    # Nothing lost, nothing twice, nothing stale: at the default retry policy.
    assert report.states == {"succeeded": cfg.runs}
    assert report.rows_done == cfg.total_rows
    assert report.rows_with_one_terminal_write == cfg.total_rows
    assert report.rows_with_more_terminal_writes == 0
    assert report.stale_rows == 0 and report.stale_receipts == 0
    assert report.rows_written_after_close == 0
    assert report.reexecuted_completed_steps == 0
    assert report.problems == []
