"""`worker runs retry` with real connections and a real worker.

- Races: two concurrent retries make one retry; a retry and a cancel are settled by the
  run's row lock, in either order. Each race holds the run's row on purpose and waits on
  pg_stat_activity until every contender is blocked on it, then lets them go.
- End to end: a retried run is a new attempt sequence with a fresh retry budget, and its
  completed step is replayed from its receipt, not paid again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from queues import lanes, operator, outcomes, policy, runs
from tests import attempts, ledgers
from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker.context import RunContext
from worker.plays import Registry

Conn = psycopg.AsyncConnection[Any]
NOW = datetime(2030, 1, 1, tzinfo=UTC)


async def _connect(url: str) -> Conn:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def _failed_run(url: str) -> uuid.UUID:
    async with await _connect(url) as conn:
        a = await attempts.start(conn)
        error = {"type": "ValueError", "message": "boom"}
        final = outcomes.failed(
            a.run_id,
            a.fence.attempt,
            error,
            a.claimed.retry,
            now=NOW,
            failure=a.claimed.retry.max_attempts,
        )
        await runs.finish(conn, worker_id=a.fence.owner, finishes=[final])
        return uuid.UUID(str(a.run_id))


async def _blocked(url: str, n: int) -> int:
    rows = await fetch(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND state = 'active'",
    )
    found = int(rows[0][0])
    return found if found >= n else 0


async def _retry(url: str, run_id: uuid.UUID, who: str) -> operator.Retried:
    async with await _connect(url) as conn:
        return await operator.retry(conn, run_id, actor=who)


async def _cancel(url: str, run_id: uuid.UUID) -> runs.CancelResult:
    async with await _connect(url) as conn:
        return await operator.cancel(conn, run_id, actor="cli:canceller")


async def _holding_the_run(url: str, run_id: uuid.UUID) -> Conn:
    holder = await psycopg.AsyncConnection.connect(url)
    await holder.execute("SELECT 1 FROM wq_runs WHERE id = %s FOR UPDATE", (run_id,))
    return holder


async def test_two_concurrent_retries_make_one_retry(db_url: str) -> None:
    run_id = await _failed_run(db_url)
    holder = await _holding_the_run(db_url, run_id)
    try:
        first = asyncio.create_task(_retry(db_url, run_id, "cli:alice"))
        second = asyncio.create_task(_retry(db_url, run_id, "cli:bob"))
        await eventually(lambda: _blocked(db_url, 2))
        await holder.commit()
        results = await asyncio.gather(first, second)
    finally:
        await holder.close()
    assert sorted(r.retried for r in results) == [False, True]
    loser = next(r for r in results if not r.retried)
    assert loser.before == "queued"  # it waited for the winner's commit and saw its result
    jobs = await fetch(
        db_url,
        "SELECT count(*) FROM procrastinate_jobs WHERE args ->> 'run_id' = %s AND status = 'todo'",
        (str(run_id),),
    )
    assert jobs[0][0] == 1
    assert Counter(await ledgers.kinds(db_url, run_id))["run_retried"] == 1
    assert await run_state(db_url, run_id) == "queued"


@pytest.mark.parametrize("first", ["retry", "cancel"])
async def test_a_retry_racing_a_cancel_is_settled_by_the_database(db_url: str, first: str) -> None:
    run_id = await _failed_run(db_url)
    holder = await _holding_the_run(db_url, run_id)
    try:
        # Whoever queues on the row lock first gets it first (Postgres grants in order).
        if first == "retry":
            retrying = asyncio.create_task(_retry(db_url, run_id, "cli:alice"))
            await eventually(lambda: _blocked(db_url, 1))
            cancelling = asyncio.create_task(_cancel(db_url, run_id))
        else:
            cancelling = asyncio.create_task(_cancel(db_url, run_id))
            await eventually(lambda: _blocked(db_url, 1))
            retrying = asyncio.create_task(_retry(db_url, run_id, "cli:alice"))
        await eventually(lambda: _blocked(db_url, 2))
        await holder.commit()
        retried, cancelled = await asyncio.gather(retrying, cancelling)
    finally:
        await holder.close()
    state = await run_state(db_url, run_id)
    todo = await fetch(
        db_url,
        "SELECT count(*) FROM procrastinate_jobs WHERE args ->> 'run_id' = %s AND status = 'todo'",
        (str(run_id),),
    )
    assert retried.retried  # the run was failed when the retry got the lock, either way
    if first == "retry":
        # The cancel saw the requeued run and cancelled it at once, with its new job.
        assert (cancelled.before, cancelled.after, cancelled.changed) == (
            "queued",
            "cancelled",
            True,
        )
        assert state == "cancelled" and todo[0][0] == 0
    else:
        # The cancel found a finished run and changed nothing; the retry requeued it.
        assert (cancelled.before, cancelled.changed) == ("failed", False)
        assert state == "queued" and todo[0][0] == 1


# ---- end to end ------------------------------------------------------------------------------

PAID: Counter[str] = Counter()
FAILS_LEFT: dict[str, int] = {}
registry = Registry()


@registry.play("flaky")
async def flaky(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    key = str(ctx.run_id)

    def pay() -> str:
        PAID[key] += 1
        return "paid"

    receipt = await ctx.step("pay", pay)
    if FAILS_LEFT.get(key, 0) > 0:
        FAILS_LEFT[key] -= 1
        raise RuntimeError(f"the API is down (attempt {ctx.attempt})")
    return {"receipt": receipt, "attempt": ctx.attempt}


async def _state_is(url: str, run_id: uuid.UUID, *states: str) -> str | None:
    state = await run_state(url, run_id)
    return state if state in states else None


async def test_a_retried_run_gets_a_fresh_budget_and_replays_its_paid_step(db_url: str) -> None:
    async with await _connect(db_url) as conn:
        await lanes.prepare(conn, "t")
        change = policy.parse({"retry_max_attempts": "2", "retry_base_s": "0"})
        await operator.set_policy(conn, "t", change, actor="cli:test")
    async with running_worker(db_url, registry):
        run_id = await submit(db_url, "flaky")
        FAILS_LEFT[str(run_id)] = 2  # both attempts of the first sequence fail
        assert await eventually(lambda: _state_is(db_url, run_id, "failed", "succeeded")) == (
            "failed"
        )
        async with await _connect(db_url) as conn:
            FAILS_LEFT[str(run_id)] = 1  # the new sequence fails once, then succeeds
            done = await operator.retry(conn, run_id, actor="cli:test", reason="fixed")
        assert done.retried and done.after_attempt == 2
        assert await eventually(lambda: _state_is(db_url, run_id, "failed", "succeeded")) == (
            "succeeded"
        )
        async with await _connect(db_url) as conn:
            run = await runs.get(conn, run_id)
            tries = await runs.attempts(conn, run_id)
    # Without the retry's fresh budget, attempt 3 would have been the third failure of two.
    assert [a.outcome for a in tries] == ["failed", "failed", "failed", "succeeded"]
    assert run.result == {"receipt": "paid", "attempt": 4}
    assert PAID[str(run_id)] == 1  # paid by attempt 1, replayed by attempts 2 to 4
    failed_error = tries[0].error
    assert "RuntimeError: the API is down (attempt 1)" in failed_error["traceback"]
    assert "in flaky" in failed_error["traceback"]

    # The ledger names the error; the traceback stays with the attempt and the run.
    events = await ledgers.events(db_url, run_id, "retry_scheduled", "run_failed")
    assert events and all("traceback" not in e.data["error"] for e in events)
    assert all(e.data["error"]["type"] == "RuntimeError" for e in events)
