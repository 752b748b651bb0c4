"""Runs and attempts: claim, lease, fenced finish, cancel, events and observation reads.

Every write an attempt makes carries its fence (:mod:`queues.fence`). ``finish`` only
applies where the run still has that attempt, is ``running`` and leased by this worker;
anything else is stale and comes back refused, never applied. Cancel is final: while a
cancel is pending, only a ``cancelled`` outcome is applied (after the cleanup hooks ran).
A delivery for a run that is terminal, leased or no longer pointing at that job is
acknowledged and dropped.

What an attempt's end does to its run (retry, fail, interrupted, cancel) is decided in
:mod:`queues.outcomes`, next to the same rule for lapsed leases.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb, JsonbLoader

from queues import fields, migrations, transport
from queues.authority import Descriptor
from queues.errors import RunNotFound, translate
from queues.fence import Fence, refused
from queues.lanes import RetryPolicy
from queues.outcomes import Finish, FinishStatus, RunState
from queues.queries import fields_row, json_text, one_statement, own_transaction, q


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
    created_at: datetime | None
    authority: dict[str, Any] | None  # the run's authority descriptor (admission's)
    cleanup: bool | None  # a cleanup-only attempt: run the cancel hooks, write cancelled
    lease_ttl_s: float | None
    heartbeat_s: float | None
    retry_max_attempts: int | None
    retry_base_s: float | None
    retry_cap_s: float | None
    retry_jitter: float | None
    max_interruptions: int | None
    failures: int | None  # failed attempts before this one (sleeps, hand-backs excluded)
    interruptions: int | None  # interrupted attempts before this one
    # The run's own options (queues.options); the retry_* columns above are already the
    # run's values over its lane's.
    retry_kind: str | None = None  # none | fixed | exponential (None: the lane's, exponential)
    retry_factor: float | None = None
    timeout_at: datetime | None = None  # the run's deadline: first start + its timeout
    meta: dict[str, Any] | None = None
    # Its lane caps the runs per org: the end of this attempt may let a waiting org's job
    # be claimed, which no spawn announces.
    org_capped: bool | None = None
    # The attempt before this one was cut short (interrupted, or its worker lost): the
    # steps it was in the middle of may run again (worker.instruments counts them).
    resumed: bool | None = None

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy.of(self)

    @property
    def claimed_at(self) -> datetime | None:
        """The database's time of this claim (its lease was granted for the TTL from it)."""
        if self.lease_expires_at is None or self.lease_ttl_s is None:
            return None
        return self.lease_expires_at - timedelta(seconds=self.lease_ttl_s)

    def fence(self, owner: str) -> Fence:
        """This attempt's fence, for every write it makes."""
        assert self.claimed and self.attempt is not None
        return Fence(self.run_id, self.attempt, owner)

    @property
    def descriptor(self) -> Descriptor:
        """The run's authority descriptor (what its attempt tokens are minted from)."""
        assert self.claimed and self.org and self.play and self.release
        stored = self.authority or {}
        return Descriptor.from_json(
            self.run_id,
            {"org": self.org, "play": self.play, "release": self.release} | stored,
        )


class Unreadable:
    """A stored JSON value this process cannot read back (nested past Python's recursion
    limit, or an integer longer than Python reads), kept in its place: the claim that
    met it goes on, and the run it belongs to fails (:func:`unusable`)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unreadable({self.reason!r})"


def _loads_or_unreadable(data: bytes | str) -> Any:
    try:
        return json.loads(data)
    except (RecursionError, ValueError) as exc:
        return Unreadable(f"{type(exc).__name__}: {str(exc)[:200]}")


# The claim's jsonb columns: a value that cannot be read is :class:`Unreadable`, never an
# exception that would lose the whole batch the claim took (its runs already leased).
_ClaimJsonbLoader: type[JsonbLoader] = type(
    "_ClaimJsonbLoader", (JsonbLoader,), {"_loads": _loads_or_unreadable}
)


def unusable(c: Claimed) -> str | None:
    """Why a worker cannot use a claimed run's row, or None.

    Admission refuses every such value (``wq_submit``, migration 0036); a row written around
    it (by the owner, or admitted before the database checked) reaches a worker all the
    same, which fails that run (``RUN_ROW_INVALID``, :func:`queues.outcomes.row_invalid`)
    instead of dying on it. Unusable: an empty or missing name; params, authority or
    metadata that are not JSON objects, or JSON this process cannot read; an authority that
    names another run, org or play (its attempt's tokens are minted from it), or whose
    capabilities are not a list of names. (Its release may differ: ``worker queues adopt``
    moves a run to another release's lane and leaves its authority as admitted.)"""
    for name in ("org", "play", "lane", "release"):
        value = getattr(c, name)
        if not isinstance(value, str) or not value:
            return f"its {name} is {fields.shown(value)}"
    for name in ("params", "authority", "meta", "wake_payload"):
        value = getattr(c, name)
        if isinstance(value, Unreadable):
            return f"its {name} cannot be read: {value.reason}"
        if name != "wake_payload" and not isinstance(value, dict | None):
            return f"its {name} is a JSON {type(value).__name__}, not an object"
    if c.params is None:
        return "its params are null, not an object"
    authority = c.authority or {}
    for key, value in (("run", str(c.run_id)), ("org", c.org), ("play", c.play)):
        if key in authority and authority[key] != value:
            return f"its authority names {key} {fields.shown(authority[key])}, not {value!r}"
    caps = authority.get("capabilities")
    if caps is not None and not (isinstance(caps, list) and all(isinstance(x, str) for x in caps)):
        return f"its authority's capabilities are {fields.shown(caps)}, not a list of names"
    return None


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
    # Why a sleeping run waits, when it is not its own wait: BUDGET_EXHAUSTED (paused on a
    # budget, queues.costs); None otherwise.
    wait_reason: str | None = None

    @property
    def terminal(self) -> bool:
        return RunState(self.state).terminal

    @property
    def rows_total(self) -> int:
        """The rows the run will work on, as far as known: its input, or what it admitted."""
        return max(self.input_rows, self.rows_admitted)


@dataclass(frozen=True, slots=True)
class Event:
    id: int | None  # the wq_events row; None for an event a state row stands for
    run_id: uuid.UUID
    seq: int  # the run's own sequence: 1, 2, 3, ... gapless, in commit order
    attempt: int | None
    kind: str
    data: dict[str, Any]
    idempotency_key: str | None
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

    On a connection of its own (autocommit, idle: a worker's) the claim is one statement,
    one round trip, and commits without waiting for its WAL flush (``run_claim_batch``'s
    ``lazy``): its loss in a crash is harmless. WAL is written in order, so the first
    durable commit after it (the attempt's heartbeat, a step's record, its final write, a
    projector's delivery of its events) flushes the claim too: a claim can only be lost
    together with everything that followed it and was not durable. What is lost then is
    the attempt itself: the run is back at its previous attempt number with its job
    waiting, so every write of the lost attempt fails the fence and is refused, and the
    run is claimed again at once (no lease to wait for). Nobody outside the database
    learned of the lost claim from a durable write. What runs again is what runs again
    after any crash: code outside steps (at least once by design); completed steps replay.

    Dropped deliveries (claimed=False) are settled by a second statement: acknowledged;
    sent back to their lane when their run turned out to be waiting for them (the claim's
    snapshot could not see it yet); or, when their run's play is not one of ``plays`` or
    the run was not started by its claim deadline, acknowledged with the run failed at
    once (``PLAY_UNKNOWN``, ``START_DEADLINE_PASSED``). Those rare cases are not the
    claim's own: each statement of a claim costs its executor start-up on every claim, a
    measurable share of the pickup latency. A worker that dies between
    the two leaves such a run waiting for a delivered job; recovery gives it a new one
    (migration 0022), and the old one is dropped as a duplicate if it ever comes back.
    Inside a caller's transaction both statements are part of it, and nothing commits
    lazily.

    The claim does not NOTIFY ``wq_run_events`` nor fold the starts into the progress
    sink (migrations 0040, 0041; with an HTTP sink enabled it delivers and folds): on an
    idle worker those were half the way from a spawn to the play's first line. The caller
    announces the attempts it started (:func:`announce`) once the plays are under way;
    the listeners' poll covers an announcement never made, and the run's next state event
    its fold.
    """
    own = own_transaction(conn)
    params = {
        "lanes": list(lanes),
        "limit": limit,
        "plays": list(plays),
        "worker": worker_id,
        "procrastinate_worker": procrastinate_worker,
        "now": now,
        "lazy": own,
    }
    async with one_statement(conn):
        async with conn.cursor(row_factory=fields_row(Claimed)) as cur:
            cur.adapters.register_loader("jsonb", _ClaimJsonbLoader)
            await cur.execute(q("run_claim_batch"), params)
            rows = await cur.fetchall()
        dropped = [r for r in rows if not r.claimed]
        if dropped:
            await conn.execute(
                q("job_drop"),
                {
                    "job_ids": [r.job_id for r in dropped],
                    "run_ids": [r.run_id for r in dropped],
                    "plays": params["plays"],
                    "now": now,
                },
            )
    return rows


async def announce(conn: psycopg.AsyncConnection[Any], run_ids: Sequence[uuid.UUID]) -> None:
    """Announce the attempts a claim started (:func:`claim`), which its statement neither
    notifies nor folds: NOTIFY ``wq_run_events`` for these runs and fold each one's current
    attempt start into the progress sink (``run_announce``; a fold only moves forward, so
    a late one is harmless). Takes the run rows FOR KEY SHARE first, in id order, then
    the progress rows: every folder's lock order."""
    await conn.execute(q("run_announce"), {"runs": [str(r) for r in run_ids]})


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
    """Renew the leases of live attempts; a lease missing from the answer is lost.

    One statement and no transaction of its own: on the heartbeat's autocommit connection
    the server commits the renewal before it answers. A worker can be paused anywhere
    (SIGSTOP, a frozen VM, a descheduled thread); paused between its renewal and a COMMIT
    of its own, it kept its runs' rows locked, and recovery, which picks lapsed leases
    ``FOR UPDATE SKIP LOCKED``, skipped them for as long as it stayed paused
    (``tests/integration/test_paused_heartbeat.py``). Inside a caller's transaction it
    is part of that transaction.
    """
    if not leases:
        return []
    async with conn.cursor(row_factory=class_row(Renewed)) as cur:
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


async def cancel_requested(
    conn: psycopg.AsyncConnection[Any],
    *,
    worker_id: str,
    leases: Sequence[tuple[uuid.UUID, int]],
) -> set[tuple[uuid.UUID, int]]:
    """Which of this worker's live attempts (``leases``: run, attempt) have a durable cancel
    request on their run: what a worker reads when a control message names one of them,
    before it stops anything (a NOTIFY is anyone's; the request is the worker role's)."""
    if not leases:
        return set()
    cur = await conn.execute(
        q("run_cancel_requested"),
        {
            "worker": worker_id,
            "run_ids": [run_id for run_id, _ in leases],
            "attempts": [attempt for _, attempt in leases],
        },
    )
    return {(row[0], row[1]) for row in await cur.fetchall()}


async def finish(
    conn: psycopg.AsyncConnection[Any], *, worker_id: str, finishes: Sequence[Finish]
) -> dict[tuple[uuid.UUID, int], FinishStatus]:
    """Write a batch of final outcomes, fenced, in one statement; the status of each.

    ``refused``: stale (a newer attempt owns the run, or its lease was rescued): nothing
    was written but the refusal and its attempt row's ``superseded`` mark.
    ``cancel_pending``: a cancel is pending and the outcome is not ``cancelled``: nothing
    was written. ``replayed``: an earlier copy of this write was applied (a lost reply).
    """
    if not finishes:
        return {}
    async with one_statement(conn):
        cur = await conn.execute(
            q("run_finish_batch"),
            {
                "worker": worker_id,
                "run_ids": [f.run_id for f in finishes],
                "attempts": [f.attempt for f in finishes],
                "states": [str(f.state) for f in finishes],
                "outcomes": [str(f.outcome) for f in finishes],
                "results": [_result(f) for f in finishes],
                "errors": [None if f.error is None else Jsonb(f.error) for f in finishes],
                "spawn": [f.spawn for f in finishes],
                "spawn_at": [f.spawn_at for f in finishes],
                "wait_events": [f.wait_event for f in finishes],
                "kinds": [f.kind for f in finishes],
            },
        )
        return {(row[0], row[1]): FinishStatus(row[2]) for row in await cur.fetchall()}


def _result(f: Finish) -> Jsonb | None:
    """A final write's result parameter: none (the run keeps what it had), the JSON text
    it was checked as, or the value encoded here."""
    if f.result is None:
        return None
    return json_text(f.result_json) if f.result_json is not None else Jsonb(f.result)


@dataclass(frozen=True, slots=True)
class CancelResult:
    run_id: uuid.UUID
    before: str
    after: str
    changed: bool
    jobs_cancelled: int
    notified: bool


async def cancel(
    conn: psycopg.AsyncConnection[Any],
    run_id: uuid.UUID,
    *,
    reason: str | None = None,
    force: bool = False,
    actor: str | None = None,
) -> CancelResult:
    """Cancel a run in one transaction; idempotent; a finished run is unchanged.

    A queued or sleeping run is cancelled at once; a running attempt is asked (durably and
    by NOTIFY) and writes ``cancelled`` after its cleanup hooks. ``force`` cancels at once
    in any unfinished state, skipping the cleanup hooks.
    """
    async with one_statement(conn):
        cur = await conn.execute(
            q("run_cancel"), {"run_id": run_id, "reason": reason, "force": force, "actor": actor}
        )
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
    """The run's ledger after seq ``after``, in seq order."""
    async with conn.cursor(row_factory=class_row(Event)) as cur:
        await cur.execute(q("run_events"), {"run_id": run_id, "after": after})
        return await cur.fetchall()


async def attempts(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> list[Attempt]:
    async with conn.cursor(row_factory=class_row(Attempt)) as cur:
        await cur.execute(q("run_attempts"), {"run_id": run_id})
        return await cur.fetchall()


@dataclass(frozen=True, slots=True)
class Emitted:
    woken: int  # runs of the org waiting for the event, now re-spawned


async def emit(
    conn: psycopg.AsyncConnection[Any],
    *,
    org: str,
    name: str,
    payload: Any = None,
    fence: Fence | None = None,
) -> Emitted:
    """Emit an org's event: the latest emit of a name is kept; the org's waiting runs are
    re-spawned. From a play, pass its ``fence``: a stale attempt's emit is refused
    (:class:`~queues.errors.StaleAttempt`) and changes nothing. The org, the name and the
    payload are checked by the field rules first (every entry point goes through here)."""
    fields.org(org)
    fields.event_name(name)
    fields.encode(payload, field="payload", max_bytes=fields.MAX_PAYLOAD_BYTES)
    params = {"org": org, "name": name, "payload": Jsonb(payload)}
    params |= fence.params() if fence else {"run_id": None, "attempt": None, "owner": None}
    async with conn.transaction():
        await conn.execute(q("event_lock"), {"org": org, "name": name})
        cur = await conn.execute(q("event_emit"), params)
        row = await cur.fetchone()
    assert row is not None
    fenced, woken, run_attempt, run_state = row
    if fence is not None and not fenced:
        raise refused(
            fence,
            verb="emit",
            subject=f"event {name!r}",
            run_attempt=run_attempt,
            run_state=run_state,
        )
    return Emitted(woken=int(woken))


async def emitted_payload(
    conn: psycopg.AsyncConnection[Any], *, org: str, name: str, since: datetime
) -> tuple[bool, Any]:
    """(emitted, payload) of the latest emit of an org's event at or after ``since``."""
    cur = await conn.execute(q("event_get"), {"org": org, "name": name, "since": since})
    row = await cur.fetchone()
    return (False, None) if row is None else (True, row[0])


async def suspend_for_event(
    conn: psycopg.AsyncConnection[Any],
    *,
    worker_id: str,
    finish_: Finish,
    org: str,
    event: str,
    since: datetime,
) -> tuple[bool, FinishStatus | None]:
    """Suspend a run on an event unless it was emitted meanwhile; no lost wake-up.

    Takes the event's advisory lock (the same one ``emit`` takes), then, in a new
    statement that sees every committed emit, either finds the event (returns
    ``(True, None)``, nothing written) or writes the suspension, fenced: ``(False,
    status)``.
    """
    async with conn.transaction():
        await conn.execute(q("event_lock"), {"org": org, "name": event})
        found, _payload = await emitted_payload(conn, org=org, name=event, since=since)
        if found:
            return True, None
        statuses = await finish(conn, worker_id=worker_id, finishes=[finish_])
    return False, statuses[(finish_.run_id, finish_.attempt)]


async def register_worker(
    conn: psycopg.AsyncConnection[Any],
    *,
    worker_id: str,
    lanes: Sequence[str],
    release: str,
    host: str,
    pid: int,
) -> int:
    """Register the worker here and with the transport; returns the transport's worker id."""
    async with conn.transaction():
        procrastinate_id = await transport.register_worker(conn)
        try:
            await conn.execute(
                q("worker_register"),
                {
                    "id": worker_id,
                    "lanes": list(lanes),
                    "release": release,
                    "host": host,
                    "pid": pid,
                    "procrastinate_id": procrastinate_id,
                    "schema_version": migrations.code_schema().version,
                },
            )
        except psycopg.Error as exc:  # below the schema floor (migration 0034)
            mapped = translate(exc)
            if mapped is None:
                raise
            raise mapped from exc
    return procrastinate_id


async def hold_liveness(conn: psycopg.AsyncConnection[Any], worker_id: str) -> str:
    """Take the worker's liveness lock on ``conn`` (an autocommit session that lives as long
    as the worker: its LISTEN session) and record it; while the session lasts the worker
    is not gone, and once it ends, by exit or by kill, its leases are rescued at once
    (:func:`queues.recovery.rescue_gone`). Returns the channel of wakes meant for this
    worker alone: spawns wake only workers whose lock is held (migration 0032)."""
    await conn.execute(q("worker_hold_liveness"), {"id": worker_id})
    cur = await conn.execute(q("worker_record_liveness"), {"id": worker_id})
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def stop_waiting(conn: psycopg.AsyncConnection[Any], worker_id: str) -> None:
    """Take a worker out of the set of workers waiting for work, so spawns wake others
    (migration 0032): it is stopping, or passing on a wake it has no room for."""
    await conn.execute(q("worker_stop_waiting"), {"id": worker_id})


async def worker_heartbeat(conn: psycopg.AsyncConnection[Any], worker_id: str) -> None:
    """Mark the worker alive: one statement, committed by the server (see heartbeat)."""
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
