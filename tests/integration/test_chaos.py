"""The chaos suite at CI size (``bench.chaos.ChaosConfig``'s defaults: 10 runs x 500 rows
over 5 shared sheets), on three worker processes and a recovery process, at the lane's
default retry policy, with SIGKILLed workers, zombie workers (SIGSTOPped until their
leases were taken over, then continued), one Postgres crash-restart and terminated
backends, all scheduled by progress.

A cut connection no longer ends an attempt: the worker sends the call again on a new one.
So a step runs again only when the attempt that ran it lost its worker (``worker_killed``,
``zombie``) or when the fault met the play's own paid call (``paid_call``): the duplicate
executions are split by cause, and one repeated after a database fault alone met by the
worker's calls (``database``) fails the suite.

A killed worker or a cut connection writes nothing late; a zombie does, and this is where
the suite proves the attempt fence under load: the zombies' late writes reached the
database and were refused (``wq_refusals``), their attempts ended ``lease_expired``, and
no stale row output, row admission or receipt was applied. ``scripts/fence_mutants.py``
runs this test against the fence mutants it kills.

``python -m bench.chaos --runs 100 --rows 1000`` runs the same suite larger.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from bench.chaos import ChaosConfig, run_chaos


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nothing_is_lost_and_no_late_write_lands_under_kills_zombies_and_restarts() -> None:
    ci = ChaosConfig()
    cfg = ChaosConfig(
        runs=int(os.environ.get("CHAOS_RUNS", ci.runs)),
        rows=int(os.environ.get("CHAOS_ROWS", ci.rows)),
        seed=int(os.environ.get("CHAOS_SEED", ci.seed)),
        deadline_s=180.0,  # a stuck run ends in a report, within the test's timeout
    )
    report = run_chaos(cfg)  # its timeline of faults, printed: shown when the test fails
    print(asdict(report))  # the figures, for the CI log
    # The faults really happened, and the runs really competed for rows.
    assert report.kills >= 3 and report.postgres_restarts == 1
    assert report.backend_terminations > 0
    assert report.rows_taken_over > 0
    # Zombies: each stayed stopped until every attempt it held was closed as lapsed and
    # one of its runs was claimed again; woken, its writes reached the database late and
    # the fence refused them.
    assert report.zombies >= 1
    assert report.zombie_runs_reclaimed >= report.zombies
    assert report.zombie_attempt_outcomes == {"lease_expired": report.zombie_attempts}
    assert sum(report.zombie_refusals.values()) >= 1
    assert all(report.refusals[kind] >= n for kind, n in report.zombie_refusals.items())
    # Lapsed leases (kills, zombies) cost no run; the cut connections and the restart,
    # absorbed inside the attempts, made no step run again.
    assert report.attempt_outcomes.get("lease_expired", 0) >= report.zombie_attempts
    assert report.duplicate_executions_by_cause.get("database", 0) == 0
    # A provider that honours the idempotency key charged each paid step once, however
    # many times the chaos made the plays call it.
    assert report.provider_charges == report.paid_steps > 0
    assert report.provider_calls >= report.provider_charges
    assert report.states == {"succeeded": cfg.runs}
    # Nothing lost, nothing twice, nothing stale: at the default retry policy.
    assert report.rows_done == cfg.total_rows
    assert report.rows_with_one_terminal_write == cfg.total_rows
    assert report.rows_with_more_terminal_writes == 0
    assert report.stale_rows == 0 and report.stale_admissions == 0
    assert report.stale_receipts == 0
    assert report.rows_written_after_close == 0
    # No live attempt ran a completed step again. (A zombie stopped inside its paying
    # window pays when woken: zombie_late_payments, made free by the provider's key above.)
    assert report.reexecuted_completed_steps == 0
    assert report.problems == []
