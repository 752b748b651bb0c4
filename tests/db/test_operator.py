"""Operator actions in one rolled-back transaction: retry, set-policy, the audit log, and
metric totals that survive retention."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from queues import lanes, operator, outcomes, policy, runs, totals
from queues.errors import InvalidField, LaneNotPrepared, LaneReclaimed, RunNotRetryable
from tests import attempts
from tests.attempts import RELEASE, Attempt

Conn = psycopg.AsyncConnection[Any]
NOW = datetime(2030, 1, 1, tzinfo=UTC)


async def _one(conn: Conn, sql: str, *params: Any) -> Any:
    cur = await conn.execute(sql, params)  # type: ignore[arg-type]
    row = await cur.fetchone()
    assert row is not None
    return row[0] if len(row) == 1 else row


async def _finish(conn: Conn, a: Attempt, final: outcomes.Finish) -> None:
    status = await runs.finish(conn, worker_id=a.fence.owner, finishes=[final])
    assert status[(a.run_id, a.fence.attempt)] is outcomes.FinishStatus.APPLIED


async def _failed_run(conn: Conn) -> Attempt:
    """A run whose only attempt failed for good (its lane allows one attempt)."""
    a = await attempts.start(conn)
    error = {"type": "ValueError", "message": "boom", "traceback": "Traceback ...\nValueError"}
    policy_ = a.claimed.retry
    final = outcomes.failed(
        a.run_id, a.fence.attempt, error, policy_, now=NOW, failure=policy_.max_attempts
    )
    assert final.state is outcomes.RunState.FAILED
    await _finish(conn, a, final)
    return a


async def test_a_failed_run_is_retried_as_itself_with_a_new_job(conn: Conn) -> None:
    a = await _failed_run(conn)
    done = await operator.retry(conn, a.run_id, actor="cli:alice", reason="the API is back")
    assert done.retried and done.before == "failed" and done.after_attempt == 1
    run = await runs.get(conn, a.run_id)
    assert (run.state, run.attempt, run.error, run.finished_at) == ("queued", 1, None, None)
    assert run.job_id == done.job_id
    assert await _one(
        conn, "SELECT status::text, queue_name FROM procrastinate_jobs WHERE id = %s", done.job_id
    ) == ("todo", lanes.lane_name(RELEASE))
    assert await _one(conn, "SELECT retry_floor FROM wq_runs WHERE id = %s", a.run_id) == 1
    event = (await runs.events(conn, a.run_id))[-1]
    assert event.kind == "run_retried"
    assert event.data["by"] == "cli:alice" and event.data["previous_state"] == "failed"
    assert event.data["reason"] == "the API is back"
    action = (await operator.recent_actions(conn, limit=1))[0]
    assert (action.actor, action.action, action.run_id) == ("cli:alice", "retry", a.run_id)


async def test_the_next_claim_is_a_new_attempt_with_a_fresh_budget(conn: Conn) -> None:
    a = await _failed_run(conn)
    await operator.retry(conn, a.run_id, actor="cli:alice")
    again = await attempts.claim(conn, run_id=a.run_id, now=NOW)
    assert again.fence.attempt == 2
    assert again.claimed.failures == 0  # attempt 1 belongs to the earlier sequence
    assert again.claimed.cleanup is False


async def test_each_claim_counts_the_failures_and_interruptions_before_it(conn: Conn) -> None:
    """The claim reads the budget spent so far (none for a first attempt, which reads no
    attempt rows at all); an operator's retry starts a new count."""
    a = await attempts.start(conn)
    assert (a.claimed.failures, a.claimed.interruptions) == (0, 0)
    error = {"type": "E", "message": "x"}
    history = [outcomes.Outcome.FAILED, outcomes.Outcome.INTERRUPTED, outcomes.Outcome.FAILED]
    for n, outcome in enumerate(history, start=1):
        await _finish(
            conn,
            a,
            outcomes.Finish(
                a.run_id,
                a.fence.attempt,
                outcomes.RunState.QUEUED,
                outcome,
                "retry_scheduled",
                error=error,
                spawn=True,
                spawn_at=NOW,
            ),
        )
        a = await attempts.claim(conn, run_id=a.run_id, now=NOW)
        assert a.fence.attempt == n + 1
        spent = history[:n]
        assert (a.claimed.failures, a.claimed.interruptions) == (
            spent.count(outcomes.Outcome.FAILED),
            spent.count(outcomes.Outcome.INTERRUPTED),
        )
    await _finish(
        conn,
        a,
        outcomes.Finish(
            a.run_id,
            a.fence.attempt,
            outcomes.RunState.FAILED,
            outcomes.Outcome.FAILED,
            "run_failed",
            error=error,
        ),
    )
    await operator.retry(conn, a.run_id, actor="cli:alice")
    again = await attempts.claim(conn, run_id=a.run_id, now=NOW)
    assert (again.fence.attempt, again.claimed.failures, again.claimed.interruptions) == (5, 0, 0)


async def test_a_cancelled_run_is_retried_without_its_cancel(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    await runs.cancel(conn, run_id, reason="oops", actor="cli:bob")
    done = await operator.retry(conn, run_id, actor="cli:bob")
    assert done.retried and done.before == "cancelled"
    run = await runs.get(conn, run_id)
    assert run.state == "queued" and run.cancel_requested_at is None and run.cancel_reason is None
    again = await attempts.claim(conn, run_id=run_id, now=NOW)
    assert again.claimed.cleanup is False  # a real attempt, not a cleanup-only one


async def test_a_run_that_has_not_finished_is_left_alone(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    done = await operator.retry(conn, run_id, actor="cli:alice")
    assert not done.retried and done.before == "queued" and done.job_id is None
    assert [e.kind for e in await runs.events(conn, run_id)] == ["run_created"]


async def test_a_succeeded_run_is_not_retried(conn: Conn) -> None:
    a = await attempts.start(conn)
    await _finish(conn, a, outcomes.succeeded(a.run_id, a.fence.attempt, {"ok": True}))
    with pytest.raises(RunNotRetryable) as raised:
        await operator.retry(conn, a.run_id, actor="cli:alice")
    assert raised.value.exit_code == 2 and "submit a new run" in (raised.value.fix or "")


async def test_a_reclaimed_lane_takes_no_retry(conn: Conn) -> None:
    a = await _failed_run(conn)
    await lanes.reclaim(conn, RELEASE)
    with pytest.raises(LaneReclaimed, match="reopen"):
        await operator.retry(conn, a.run_id, actor="cli:alice")
    assert (await runs.get(conn, a.run_id)).state == "failed"


async def test_set_policy_changes_and_records_what_changed(conn: Conn) -> None:
    await lanes.prepare(conn, RELEASE)
    change = policy.parse({"concurrency": "3", "lease_ttl_s": "2m", "retention_s": "7d"})
    lane, diff = await operator.set_policy(conn, RELEASE, change, actor="cli:alice")
    assert (lane.concurrency, lane.lease_ttl_s) == (3, 120.0)
    assert diff == {"concurrency": [16, 3], "lease_ttl_s": [30.0, 120.0]}  # retention kept
    action = (await operator.recent_actions(conn, lane=lane.name))[0]
    assert action.action == "set_policy" and action.data == {"changed": diff}


async def test_a_refused_policy_writes_nothing(conn: Conn) -> None:
    lane = await lanes.prepare(conn, RELEASE)
    with pytest.raises(InvalidField) as raised:
        await operator.set_policy(
            conn, RELEASE, policy.parse({"lease_ttl_s": "3s"}), actor="cli:alice"
        )
    assert raised.value.field == "--lease-ttl"
    after = await lanes.get(conn, lane.name)
    assert after is not None and after.lease_ttl_s == lane.lease_ttl_s
    assert await operator.recent_actions(conn, lane=lane.name) == []
    with pytest.raises(LaneNotPrepared):
        await operator.set_policy(
            conn, "nowhere", policy.parse({"concurrency": "2"}), actor="cli:alice"
        )


async def test_drain_and_reclaim_record_who_did_it(conn: Conn) -> None:
    lane = await lanes.prepare(conn, RELEASE)
    await operator.drain(conn, RELEASE, actor="dashboard:carol")
    await operator.reclaim(conn, RELEASE, actor="dashboard:carol")
    found = await operator.recent_actions(conn, lane=lane.name)
    assert [(x.actor, x.action) for x in found] == [
        ("dashboard:carol", "reclaim"),
        ("dashboard:carol", "drain"),
    ]


async def test_totals_never_go_down_when_retention_deletes(conn: Conn) -> None:
    a = await _failed_run(conn)
    b = await attempts.start(conn)
    await _finish(conn, b, outcomes.succeeded(b.run_id, b.fence.attempt, None))
    before = await totals.read(conn)
    assert before.runs_admitted >= 2
    assert before.attempts.get("failed", 0) >= 1 and before.attempts.get("succeeded", 0) >= 1
    await conn.execute("DELETE FROM wq_runs WHERE id = ANY(%s)", ([a.run_id, b.run_id],))
    await conn.execute(
        "INSERT INTO wq_refusals (run_id, attempt, kind, rows) VALUES "
        "(gen_random_uuid(), 1, 'rows', 7)"
    )
    mid = await totals.read(conn)
    await conn.execute("DELETE FROM wq_refusals WHERE kind = 'rows'")
    after = await totals.read(conn)
    assert after.runs_admitted == before.runs_admitted
    assert after.attempts == before.attempts
    assert after.rows_completed == before.rows_completed
    assert after.refusals == mid.refusals and after.refused_rows == mid.refused_rows
    assert mid.refused_rows["rows"] >= 7


async def test_every_cancel_request_of_a_running_run_is_recorded_with_who_asked(
    conn: Conn,
) -> None:
    a = await attempts.start(conn)
    first = await operator.cancel(conn, a.run_id, actor="cli:alice", reason="wrong list")
    again = await operator.cancel(conn, a.run_id, actor="dashboard:bob")
    assert (first.changed, first.notified) == (True, True)
    assert (again.changed, again.notified) == (False, True)  # it wakes the worker again
    cur = await conn.execute(
        "SELECT actor, action, data FROM wq_operator_actions WHERE run_id = %s ORDER BY id",
        (a.run_id,),
    )
    assert await cur.fetchall() == [
        ("cli:alice", "cancel", {"before": "running", "after": "running", "force": False}),
        (
            "dashboard:bob",
            "cancel",
            {"before": "running", "after": "running", "force": False, "repeated": True},
        ),
    ]
