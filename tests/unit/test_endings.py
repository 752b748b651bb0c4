"""How an attempt ends, the one rulebook (``worker.endings``): each ending of either
executor becomes the final write the outcome policy says, decided without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from queues import outcomes, runs
from queues.outcomes import Outcome, RunState
from tests.claimed import RUN
from tests.claimed import claimed as claimed_row
from worker import endings
from worker.endings import Fatal, Fenced, Raised, Returned, Stopped, Suspended, final

T0 = datetime(2030, 1, 1, tzinfo=UTC)
# The second attempt, after one failure, leased at T0.
SECOND = {
    "attempt": 2,
    "failures": 1,
    "authority": None,
    "lease_expires_at": T0 + timedelta(seconds=30),
    "created_at": T0,
}


def claimed(**changes: Any) -> runs.Claimed:
    return claimed_row(**(SECOND | changes))


def raised(exc: BaseException) -> Raised:
    """How the in-process executor reports an exception."""
    return Raised(
        outcomes.error_of(exc),
        fatal=endings.is_fatal(exc),
        interrupted=outcomes.is_interruption(exc),
    )


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("boom"), Fatal("bad params"), psycopg.OperationalError("server closed")],
    ids=["retryable", "fatal", "interruption"],
)
def test_a_raised_ending_is_the_outcome_policys_write_for_the_exception(exc: Exception) -> None:
    c = claimed()
    got = final(c, raised(exc)).finish
    want = outcomes.after_exception(
        c.run_id, 2, exc, endings.budget(c), now=datetime.now(UTC), fatal=endings.is_fatal(exc)
    )
    assert got is not None
    assert (got.state, got.outcome, got.kind, got.error) == (
        want.state,
        want.outcome,
        want.kind,
        want.error,
    )


def test_each_ending_has_its_final_write() -> None:
    c = claimed(timeout_at=T0 + timedelta(hours=1))
    returned = final(c, Returned({"ok": 1}))
    assert returned.finish is not None and returned.finish.state is RunState.SUCCEEDED
    assert final(c, Returned(float("nan"))).finish.error["type"] == "ResultNotJSON"  # type: ignore[union-attr]
    sleep = final(c, Suspended(T0 + timedelta(days=1)))
    assert sleep.finish is not None and sleep.event is None
    assert sleep.finish.spawn_at == c.timeout_at  # woken by its deadline at the latest
    wait = final(c, Suspended(None, "paid"))
    assert wait.event == "paid" and wait.finish is not None
    assert wait.finish.state is RunState.SLEEPING
    stops = {
        reason: final(c, Stopped(reason)).finish for reason in ("cancel", "timeout", "handback")
    }
    assert {r: (f.state, f.outcome) for r, f in stops.items() if f} == {
        "cancel": (RunState.CANCELLED, Outcome.CANCELLED),
        "timeout": (RunState.FAILED, outcomes.timed_out(RUN, 2, c.timeout_at).outcome),
        "handback": (RunState.QUEUED, outcomes.handed_back(RUN, 2).outcome),
    }
    assert final(c, Stopped("lease_lost")) == endings.Ended(None)
    assert final(c, Fenced("FENCE_STALE_ATTEMPT", "stale")) == endings.Ended(None)


def test_a_fatal_error_fails_at_once_and_another_is_retried_within_the_budget() -> None:
    c = claimed()
    error = {"type": "X", "message": "m", "code": None}
    fatal = final(c, Raised(error, fatal=True, interrupted=False)).finish
    retried = final(c, Raised(error, fatal=False, interrupted=False)).finish
    spent = final(claimed(failures=4), Raised(error, fatal=False, interrupted=False)).finish
    assert fatal is not None and fatal.state is RunState.FAILED
    assert retried is not None and retried.state is RunState.QUEUED
    assert spent is not None and spent.state is RunState.FAILED  # its fifth failure of five
