"""Runs and attempts: claim, lease, fenced finish, cancel, events and observation reads.

Every write an attempt makes carries its attempt number. ``finish`` only applies where
the run still has that attempt, is ``running`` and leased by this worker; anything else is
stale and comes back refused, never applied. A delivery for a run that is terminal,
cancelled, leased or no longer pointing at that job is acknowledged and dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from queues.errors import RunNotFound
from queues.lanes import RetryPolicy
from queues.queries import q


class RunState(StrEnum):
    QUEUED = "queued"  # admitted, waiting for a worker or for its retry time
    RUNNING = "running"  # leased by a live attempt
    SLEEPING = "sleeping"  # suspended durably; re-spawned when due or woken
    SUCCEEDED = "succeeded"  # terminal: the play returned
    FAILED = "failed"  # terminal: retries exhausted
    CANCELLED = "cancelled"  # terminal: cancelled

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the play raised
    LEASE_EXPIRED = "lease_expired"  # the lease lapsed; counts against retries
    SUPERSEDED = "superseded"  # a newer attempt owns the run
    CANCELLED = "cancelled"
    HANDED_BACK = "handed_back"  # graceful shutdown returned the run
    SUSPENDED = "suspended"  # sleep or event wait


@dataclass(frozen=True, slots=True)
class Claimed:
    claimed: bool
    run_id: uuid.UUID
    attempt: int | None
    org: str | None
    play: str | None
    params: dict[str, Any] | None
    lane: str | None
    release: str | None
    job_id: int
    lease_expires_at: datetime | None
    wake_payload: Any
    lease_ttl_s: float | None
    heartbeat_s: float | None
    retry_max_attempts: int | None
    retry_base_s: float | None
    retry_cap_s: float | None
    retry_jitter: float | None
    failures: int | None  # failed attempts before this one (sleeps, hand-backs excluded)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy.of(self)


@dataclass(frozen=True, slots=True)
class Run:
    id: uuid.UUID
    org: str
    play: str
    params: dict[str, Any]
    release: str
    lane: str
    idempotency_key: str | None
    state: str
    attempt: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    job_id: int | None
    available_at: datetime | None
    wait_event: str | None
    result: Any
    error: Any
    cancel_requested_at: datetime | None
    cancel_reason: str | None
    input_rows: int  # rows given at submit
    rows_admitted: int
    rows_done: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def terminal(self) -> bool:
        return RunState(self.state).terminal

    @property
    def rows_total(self) -> int:
        """The rows the run will work on, as far as known: its input, or what it admitted."""
        return max(self.input_rows, self.rows_admitted)


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    run_id: uuid.UUID
    attempt: int | None
    kind: str
    data: dict[str, Any]
    at: datetime


@dataclass(frozen=True, slots=True)
class Attempt:
    run_id: uuid.UUID
    attempt: int
    worker_id: str | None
    outcome: str
    error: Any
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class Finish:
    """The final write of one attempt: the run's next state and what to spawn."""

    run_id: uuid.UUID
    attempt: int
    state: RunState
    outcome: Outcome
    kind: str  # the ledger event
    result: Any = None
    error: dict[str, Any] | None = None
    spawn: bool = False
    spawn_at: datetime | None = None
    wait_event: str | None = None


def succeeded(run_id: uuid.UUID, attempt: int, result: Any) -> Finish:
    return Finish(run_id, attempt, RunState.SUCCEEDED, Outcome.SUCCEEDED, "run_succeeded", result)


def failed(
    run_id: uuid.UUID,
    attempt: int,
    error: dict[str, Any],
    policy: RetryPolicy,
    *,
    now: datetime,
    failure: int,
    retryable: bool = True,
) -> Finish:
    """A failed attempt: retry per policy (exponential backoff, cap, jitter) or fail.

    ``failure`` is this failure's number (1 for the first): sleeps and hand-backs are
    attempts too, but they do not spend the retry budget.
    """
    if retryable and not policy.exhausted(failure):
        at = now + timedelta(seconds=policy.delay(failure))
        return Finish(
            run_id,
            attempt,
            RunState.QUEUED,
            Outcome.FAILED,
            "retry_scheduled",
            error=error,
            spawn=True,
            spawn_at=at,
        )
    return Finish(run_id, attempt, RunState.FAILED, Outcome.FAILED, "run_failed", error=error)


def cancelled(run_id: uuid.UUID, attempt: int, reason: str | None) -> Finish:
    return Finish(
        run_id,
        attempt,
        RunState.CANCELLED,
        Outcome.CANCELLED,
        "run_cancelled",
        error={"type": "Cancelled", "message": reason or "cancelled"},
    )


def handed_back(run_id: uuid.UUID, attempt: int) -> Finish:
    return Finish(
        run_id, attempt, RunState.QUEUED, Outcome.HANDED_BACK, "run_handed_back", spawn=True
    )


def suspended(
    run_id: uuid.UUID, attempt: int, *, wake_at: datetime | None, wait_event: str | None
) -> Finish:
    return Finish(
        run_id,
        attempt,
        RunState.SLEEPING,
        Outcome.SUSPENDED,
        "run_waiting" if wait_event else "run_sleeping",
        spawn=wake_at is not None,
        spawn_at=wake_at,
        wait_event=wait_event,
    )


async def claim(
    conn: psycopg.AsyncConnection[Any],
    *,
    lanes: Sequence[str],
    worker_id: str,
    limit: int,
    plays: Sequence[str],
    procrastinate_worker: int | None = None,
    now: datetime | None = None,
) -> list[Claimed]:
    """Claim up to ``limit`` due jobs of ``lanes``; each claimed run gets a new attempt.

    Dropped deliveries (claimed=False) are acknowledged in the same transaction.
    """
    async with conn.transaction():
        async with conn.cursor(row_factory=class_row(Claimed)) as cur:
            await cur.execute(
                q("run_claim_batch"),
                {
                    "lanes": list(lanes),
                    "limit": limit,
                    "plays": list(plays),
                    "worker": worker_id,
                    "procrastinate_worker": procrastinate_worker,
                    "now": now,
                },
            )
            rows = await cur.fetchall()
        dropped = [r.job_id for r in rows if not r.claimed]
        if dropped:
            await conn.execute(q("job_drop"), {"job_ids": dropped})
    return rows


@dataclass(frozen=True, slots=True)
class Renewed:
    run_id: uuid.UUID
    attempt: int
    lease_expires_at: datetime
    cancel: bool


async def heartbeat(
    conn: psycopg.AsyncConnection[Any],
    *,
    worker_id: str,
    leases: Sequence[tuple[uuid.UUID, int]],
    now: datetime | None = None,
) -> list[Renewed]:
    """Renew the leases of live attempts; a lease missing from the answer is lost."""
    if not leases:
        return []
    async with conn.transaction(), conn.cursor(row_factory=class_row(Renewed)) as cur:
        await cur.execute(
            q("run_heartbeat"),
            {
                "worker": worker_id,
                "run_ids": [run_id for run_id, _ in leases],
                "attempts": [attempt for _, attempt in leases],
                "now": now,
            },
        )
        return await cur.fetchall()


async def finish(
    conn: psycopg.AsyncConnection[Any], *, worker_id: str, finishes: Sequence[Finish]
) -> set[tuple[uuid.UUID, int]]:
    """Write a batch of final outcomes, fenced; returns the (run, attempt) pairs applied.

    A pair missing from the answer was stale (a newer attempt owns the run, or its lease
    was rescued): nothing of it was written but its attempt row's ``superseded`` mark.
    """
    if not finishes:
        return set()
    async with conn.transaction():
        cur = await conn.execute(
            q("run_finish_batch"),
            {
                "worker": worker_id,
                "run_ids": [f.run_id for f in finishes],
                "attempts": [f.attempt for f in finishes],
                "states": [str(f.state) for f in finishes],
                "outcomes": [str(f.outcome) for f in finishes],
                "results": [None if f.result is None else Jsonb(f.result) for f in finishes],
                "errors": [None if f.error is None else Jsonb(f.error) for f in finishes],
                "spawn": [f.spawn for f in finishes],
                "spawn_at": [f.spawn_at for f in finishes],
                "wait_events": [f.wait_event for f in finishes],
                "kinds": [f.kind for f in finishes],
            },
        )
        applied = {(row[0], row[1]) for row in await cur.fetchall()}
        for f in finishes:
            if (f.run_id, f.attempt) not in applied:
                await mark_superseded(conn, f.run_id, f.attempt)
    return applied


async def mark_superseded(
    conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, attempt: int
) -> None:
    """Record on its attempt row that a stale attempt's write was refused."""
    await conn.execute(q("run_attempt_superseded"), {"run_id": run_id, "attempt": attempt})


@dataclass(frozen=True, slots=True)
class CancelResult:
    run_id: uuid.UUID
    before: str
    after: str
    changed: bool
    jobs_cancelled: int
    notified: bool


async def cancel(
    conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, *, reason: str | None = None
) -> CancelResult:
    """Request cancellation in one transaction; idempotent; a finished run is unchanged."""
    async with conn.transaction():
        cur = await conn.execute(q("run_cancel"), {"run_id": run_id, "reason": reason})
        row = await cur.fetchone()
    assert row is not None
    before, after, jobs_cancelled, notified = row
    if before is None:
        raise RunNotFound(f"no run {run_id}", fix="check the id with `worker runs list`")
    return CancelResult(
        run_id=run_id,
        before=before,
        after=after or before,
        changed=after is not None,
        jobs_cancelled=int(jobs_cancelled),
        notified=bool(notified),
    )


async def get(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> Run:
    async with conn.cursor(row_factory=class_row(Run)) as cur:
        await cur.execute(q("run_get"), {"run_id": run_id})
        run = await cur.fetchone()
    if run is None:
        raise RunNotFound(f"no run {run_id}", fix="check the id with `worker runs list`")
    return run


async def list_runs(
    conn: psycopg.AsyncConnection[Any],
    *,
    state: str | None = None,
    lane: str | None = None,
    limit: int = 50,
) -> list[Run]:
    async with conn.cursor(row_factory=class_row(Run)) as cur:
        await cur.execute(q("run_list"), {"state": state, "lane": lane, "limit": limit})
        return await cur.fetchall()


async def events(
    conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, *, after: int = 0
) -> list[Event]:
    async with conn.cursor(row_factory=class_row(Event)) as cur:
        await cur.execute(q("run_events"), {"run_id": run_id, "after": after})
        return await cur.fetchall()


async def attempts(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> list[Attempt]:
    async with conn.cursor(row_factory=class_row(Attempt)) as cur:
        await cur.execute(q("run_attempts"), {"run_id": run_id})
        return await cur.fetchall()


@dataclass(frozen=True, slots=True)
class Emitted:
    first: bool
    woken: int


async def emit(conn: psycopg.AsyncConnection[Any], name: str, payload: Any = None) -> Emitted:
    """Emit an event: the first emit of a name wins; waiting runs are re-spawned."""
    async with conn.transaction():
        await conn.execute(q("event_lock"), {"name": name})
        cur = await conn.execute(q("event_emit"), {"name": name, "payload": Jsonb(payload)})
        row = await cur.fetchone()
    assert row is not None
    return Emitted(first=bool(row[0]), woken=int(row[1]))


async def emitted_payload(conn: psycopg.AsyncConnection[Any], name: str) -> tuple[bool, Any]:
    """(emitted, payload) of an event name."""
    cur = await conn.execute(q("event_get"), {"name": name})
    row = await cur.fetchone()
    return (False, None) if row is None else (True, row[0])


async def suspend_for_event(
    conn: psycopg.AsyncConnection[Any], *, worker_id: str, finish_: Finish, event: str
) -> tuple[bool, bool]:
    """Suspend a run on an event unless it was emitted meanwhile; no lost wake-up.

    Takes the event's advisory lock (the same one ``emit`` takes), then, in a new
    statement that sees every committed emit, either finds the event (returns
    ``(True, False)``, nothing written) or writes the suspension, fenced: ``(False,
    applied)``.
    """
    async with conn.transaction():
        await conn.execute(q("event_lock"), {"name": event})
        found, _payload = await emitted_payload(conn, event)
        if found:
            return True, False
        applied = await finish(conn, worker_id=worker_id, finishes=[finish_])
    return False, (finish_.run_id, finish_.attempt) in applied


async def register_worker(
    conn: psycopg.AsyncConnection[Any],
    *,
    worker_id: str,
    lanes: Sequence[str],
    release: str,
    host: str,
    pid: int,
) -> int:
    """Register the worker here and in procrastinate's worker table; returns the latter's id."""
    async with conn.transaction():
        cur = await conn.execute("SELECT procrastinate_register_worker_v1()")
        row = await cur.fetchone()
        assert row is not None
        procrastinate_id = int(row[0])
        await conn.execute(
            q("worker_register"),
            {
                "id": worker_id,
                "lanes": list(lanes),
                "release": release,
                "host": host,
                "pid": pid,
                "procrastinate_id": procrastinate_id,
            },
        )
    return procrastinate_id


async def worker_heartbeat(conn: psycopg.AsyncConnection[Any], worker_id: str) -> None:
    async with conn.transaction():
        await conn.execute(q("worker_heartbeat"), {"id": worker_id})


async def worker_stopped(conn: psycopg.AsyncConnection[Any], worker_id: str) -> None:
    async with conn.transaction():
        await conn.execute(q("worker_stop"), {"id": worker_id})


async def input_page(
    conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, page: int
) -> list[tuple[str, Any]] | None:
    """One page of a run's submitted input rows, or None past the last page."""
    cur = await conn.execute(q("run_input_page"), {"run_id": run_id, "page": page})
    row = await cur.fetchone()
    return None if row is None else [(str(key), value) for key, value in row[0]]
