"""What an operator does to runs and lanes, each action recorded with who did it.

- :func:`retry`: a failed or cancelled run runs again **as itself** (the same run id, not a
  linked new run): a new job on its own lane, a new attempt sequence, and everything the run
  paid for kept: its completed steps replay from their receipts, its sheet admissions reuse
  its write intents (finished rows come back ``already_terminal``), its ledger goes on
  (``run_retried``, with ``by``). Attempt numbers keep growing, so no attempt of the earlier
  sequence can write again (the fence is by attempt number); the retry budget counts only
  the attempts after the retry (``wq_runs.retry_floor``). It is fenced by the run's row
  lock: two concurrent retries make one retry (the second finds the run queued and changes
  nothing), and a retry racing a cancel is settled by the order they take that lock (a
  cancel after the retry cancels the requeued run at once; a cancel before it finds a
  finished run and changes nothing). A lane that was reclaimed takes no retry.
- :func:`set_policy`, :func:`drain`, :func:`reclaim`, :func:`cancel`: the lane and run
  actions, each with its audit row (``wq_operator_actions``) written in the same transaction.

Every function takes the connection of the narrowest role that may act (the worker role)
and an ``actor`` (``cli:<user>``, ``dashboard:<name>``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from queues import children, lanes, policy, runs
from queues.errors import InvalidField, LaneReclaimed, RunNotFound, RunNotRetryable
from queues.queries import q

RETRYABLE = ("failed", "cancelled")
MAX_ACTOR = 200
MAX_REASON = 500


def check_actor(actor: str) -> str:
    if not isinstance(actor, str) or not actor.strip() or len(actor) > MAX_ACTOR:
        raise InvalidField(
            f"actor {actor!r:.80} is empty or too long",
            field="actor",
            rule=f"1 to {MAX_ACTOR} characters naming who acts",
            fix="pass e.g. cli:alice or dashboard:alice",
        )
    return actor.strip()


def _check_reason(reason: str | None) -> str | None:
    if reason is not None and len(reason) > MAX_REASON:
        raise InvalidField(
            f"the reason is {len(reason)} characters",
            field="--reason",
            rule=f"at most {MAX_REASON} characters",
            fix="say it shorter",
        )
    return reason or None


@dataclass(frozen=True, slots=True)
class Retried:
    run_id: uuid.UUID
    before: str  # the run's state when the retry took its lock
    retried: bool  # False: it was not failed or cancelled (e.g. a concurrent retry won)
    lane: str
    job_id: int | None
    after_attempt: int  # the last attempt of the earlier sequence; the next is this + 1


async def retry(
    conn: psycopg.AsyncConnection[Any],
    run_id: uuid.UUID,
    *,
    actor: str,
    reason: str | None = None,
) -> Retried:
    """Requeue a failed or cancelled run as a new attempt sequence (see the module doc).

    A run that is queued, running or sleeping comes back ``retried=False`` (nothing to do:
    it has not finished, or a concurrent retry requeued it first). A succeeded run is
    :class:`RunNotRetryable`; a run whose lane was reclaimed is the lane's own error.
    """
    actor = check_actor(actor)
    reason = _check_reason(reason)
    async with conn.transaction():
        cur = await conn.execute(q("run_retry_lock"), {"run_id": run_id})
        row = await cur.fetchone()
        if row is None:
            raise RunNotFound(f"no run {run_id}", fix="check the id with `worker runs list`")
        before, lane, attempt = str(row[0]), str(row[1]), int(row[2])
        if before == "succeeded":
            raise RunNotRetryable(
                f"run {run_id} succeeded: a retry runs only a failed or cancelled run",
                field="RUN",
                rule="a run in state failed or cancelled",
                fix="submit a new run to do the work again",
            )
        if before not in RETRYABLE:
            return Retried(run_id, before, False, lane, None, attempt)
        cur = await conn.execute(q("lane_share_lock"), {"lane": lane})
        lane_row = await cur.fetchone()
        lane_state = str(lane_row[0]) if lane_row else None
        if lane_state == lanes.LaneState.RECLAIMED:
            release = lanes.release_of(lane)
            raise LaneReclaimed(
                f"lane {lane!r} of run {run_id} was reclaimed: the run was not retried",
                fix=f"reopen the lane first (`worker queues reopen {release}`), then retry",
            )
        cur = await conn.execute(
            q("run_retry"),
            {"run_id": run_id, "actor": actor, "reason": reason, "before": before},
        )
        done = await cur.fetchone()
    assert done is not None  # the state was checked under the lock this transaction holds
    return Retried(run_id, before, True, str(done[1]), int(done[2]), int(done[3]))


async def record(
    conn: psycopg.AsyncConnection[Any],
    *,
    actor: str,
    action: str,
    lane: str | None = None,
    run_id: uuid.UUID | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    """Append one operator action to the audit log (call it inside the action's transaction)."""
    await conn.execute(
        q("operator_action_record"),
        {
            "actor": check_actor(actor),
            "action": action,
            "lane": lane,
            "run_id": run_id,
            "data": Jsonb(data or {}),
        },
    )


async def set_policy(
    conn: psycopg.AsyncConnection[Any],
    release: str,
    change: policy.PolicyChange,
    *,
    actor: str,
    names: str = "flag",
) -> tuple[lanes.Lane, dict[str, Any]]:
    """Change a lane's policy in one transaction, checked against its current values under
    its row lock; returns the lane and what changed (``{column: [old, new]}``). Nothing is
    written when a value is refused."""
    actor = check_actor(actor)
    name = lanes.lane_name(release)
    async with conn.transaction():
        cur = await conn.execute(q("lane_lock_policy"), {"name": name})
        row = await cur.fetchone()
        if row is None:
            raise lanes.not_prepared(release)
        policy.check_against(change, lease_ttl_s=row[1], heartbeat_s=row[2], names=names)
        before = await lanes.get(conn, name)
        assert before is not None
        lane = await lanes.set_policy(conn, release, **change.changed())
        diff = {
            column: [getattr(before, column), value]
            for column, value in change.changed().items()
            if getattr(before, column) != value
        }
        await record(conn, actor=actor, action="set_policy", lane=name, data={"changed": diff})
    return lane, diff


async def drain(conn: psycopg.AsyncConnection[Any], release: str, *, actor: str) -> lanes.Lane:
    """Drain a lane (no new runs) and record who did it."""
    actor = check_actor(actor)
    async with conn.transaction():
        lane = await lanes.drain(conn, release)
        await record(conn, actor=actor, action="drain", lane=lane.name)
    return lane


async def reclaim(
    conn: psycopg.AsyncConnection[Any], release: str, *, actor: str, force: bool = False
) -> lanes.ReclaimReport:
    """Reclaim a lane (refused while it has unfinished runs unless ``force``) and record it."""
    actor = check_actor(actor)
    async with conn.transaction():
        report = await lanes.reclaim(conn, release, force=force)
        await record(
            conn,
            actor=actor,
            action="reclaim",
            lane=report.lane,
            data={"force": force, "unfinished": report.unfinished, "was": report.was},
        )
    return report


async def cancel(
    conn: psycopg.AsyncConnection[Any],
    run_id: uuid.UUID,
    *,
    actor: str,
    reason: str | None = None,
    force: bool = False,
) -> runs.CancelResult:
    """Cancel a run (the ledger records ``by``) and record the action in the audit log; then
    its unfinished child runs, and theirs, each in a transaction of its own
    (:func:`queues.children.cancel_descendants`; a repeated cancel reaches any it missed)."""
    actor = check_actor(actor)
    reason = _check_reason(reason)
    async with conn.transaction():
        result = await runs.cancel(conn, run_id, reason=reason, force=force, actor=actor)
        # Every request is recorded with who asked, a repeat too (it wakes the run's worker
        # again, which reads the request the first one wrote).
        if result.changed or result.notified:
            await record(
                conn,
                actor=actor,
                action="cancel",
                run_id=run_id,
                data={"before": result.before, "after": result.after, "force": force}
                | ({} if result.changed else {"repeated": True}),
            )
    if result.before in ("queued", "running", "sleeping", "cancelled"):
        await children.cancel_descendants(conn, run_id, force=force, actor=actor)
    return result


@dataclass(frozen=True, slots=True)
class Action:
    id: int
    at: datetime
    actor: str
    action: str
    lane: str | None
    run_id: uuid.UUID | None
    data: dict[str, Any]


async def recent_actions(
    conn: psycopg.AsyncConnection[Any], *, lane: str | None = None, limit: int = 20
) -> list[Action]:
    """The latest operator actions, newest first (read-only)."""
    async with conn.cursor(row_factory=class_row(Action)) as cur:
        await cur.execute(q("operator_actions_recent"), {"lane": lane, "limit": limit})
        return await cur.fetchall()
