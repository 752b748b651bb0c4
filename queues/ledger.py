"""The run ledger and its projection to consumers through a leased outbox.

**The ledger** (``wq_events``) is the append-only log of each run. The statement that
changes a run appends its event in the same transaction (admission, claim, sheet
admission and completion, a failed step, a rescue, a cancel, the final write; see
:data:`SYSTEM_KINDS`). Every event has a per-run ``seq`` (1, 2, 3, ... gapless, in commit
order: a reader that follows a run by seq never misses one) and an optional idempotency
key: :func:`append` with a key already stored for the run stores nothing and returns the
stored event.

**The progress projection** (``wq_progress``, what ``worker observe`` reads) is folded from
the events by the statement that appends them (the built-in ``progress`` sink: a trigger,
migration 0030): it commits with them, so it is never behind the ledger while that sink is
enabled, but for two events the run row stands for. A run's ``run_created`` is not folded:
admission writes no progress row, and a run without one is queued with no rows (the row
appears with the run's next event). An attempt's start is folded by its worker's
announcement a moment after the claim (:func:`queues.runs.announce`), unless an HTTP sink
is enabled (then by the claim). Every column only moves forward, so the folds of
concurrent or late statements converge.

**The outbox** (``wq_outbox``) holds one delivery per (event, HTTP sink enabled when it was
appended), written by the same trigger. Each event is POSTed as JSON with the header
``Idempotency-Key: <run_id>:<seq>``. A projector takes a batch with
:func:`lease_deliveries` (``FOR UPDATE SKIP LOCKED``: never the same row as another
projector), delivers it, and records the result with :func:`mark_delivered` or
:func:`mark_failed`, each applied only while the lease is still the caller's. A lease that
lapses mid-delivery lets another projector deliver again with the same key: receivers
dedupe on it. Failed deliveries are retried with capped exponential backoff
(:data:`DELIVERY_RETRY`), without limit, until delivered or the sink is disabled.
Delivered rows stay until their run is deleted by retention (the event's cascade).

The loop that drives this, and the HTTP client, live in :mod:`worker.projector`.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from queues import fields, runs
from queues.errors import InvalidField, RunNotFound, did_you_mean
from queues.lanes import RetryPolicy
from queues.queries import q

# The kinds the queue itself appends, each by the statement that makes the change. They
# are reserved: :func:`append` refuses them, so a consumer can trust what they say.
SYSTEM_KINDS: frozenset[str] = frozenset(
    {
        "run_created",  # admission (wq_submit): play, lane, org
        "attempt_started",  # a claim: the worker
        "cleanup_started",  # a claim of a cancelled run's cleanup-only attempt
        "rows_admitted",  # a sheet page admitted: counts, the run's rows_admitted after
        "rows_completed",  # a page of rows completed: counts per outcome, rows_done after
        "step_failed",  # a step's receipt recorded as failed: step, scope, error
        "lease_expired",  # recovery rescued a lapsed lease: next_state, retry_at
        "respawned",  # recovery gave an orphan, a due sleeper or a woken waiter a job
        "adopted",  # an operator moved the run to another lane
        "event_received",  # an emit woke the run
        "budget_changed",  # a budget write woke a run paused on its budget (queues.costs)
        "cancel_requested",  # a cancel asked the running attempt to stop
        "run_cancelled",  # finishing: cancelled
        "run_succeeded",  # finishing: the play returned
        "run_failed",  # finishing: failed for good
        "retry_scheduled",  # the attempt failed; a retry is queued
        "run_interrupted",  # the database went away under the attempt; retried promptly
        "run_handed_back",  # graceful shutdown returned the run to its lane
        "run_sleeping",  # suspended until a time
        "run_waiting",  # suspended until an event
        "run_retried",  # an operator requeued a failed or cancelled run (queues.operator)
    }
)

_KIND = re.compile(r"^[a-z][a-z0-9_.]{0,99}$")
MAX_KEY_LENGTH = 200
MAX_DATA_BYTES = 64 * 1024

PROGRESS_SINK = "progress"
_SINK_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")  # wq_sinks' CHECK
MAX_URL_LENGTH = 2048

DEFAULT_BATCH = 50  # deliveries per lease
DEFAULT_LEASE_S = 30.0  # well above an HTTP delivery's timeout (worker.projector)
# Backoff of a failed delivery: 1 s, 2 s, 4 s, ... capped at 5 minutes, +-10% jitter. A
# delivery is never given up: an operator disables a sink that should stop.
DELIVERY_RETRY = RetryPolicy(max_attempts=2**31 - 1, base_s=1.0, cap_s=300.0, jitter=0.1)
MAX_ERROR_LENGTH = 2000
_BACKOFF_EXPONENT_MAX = 32  # 2^31 s is far past any cap


# ---- the ledger --------------------------------------------------------------------------


def event_json(event: runs.Event) -> dict[str, Any]:
    """An event as consumers see it (``worker events --json``, the HTTP sink's body)."""
    return {
        "run_id": str(event.run_id),
        "seq": event.seq,
        "at": event.at.isoformat(),
        "kind": event.kind,
        "attempt": event.attempt,
        "data": event.data,
        "idempotency_key": event.idempotency_key,
    }


async def append(
    conn: psycopg.AsyncConnection[Any],
    run_id: uuid.UUID,
    kind: str,
    data: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    *,
    attempt: int | None = None,
) -> runs.Event:
    """Append an event to a run's ledger; returns the stored event.

    With ``idempotency_key``, a key already stored for the run stores nothing and returns
    the event it stored (also when a concurrent append of the key committed first). The
    outbox deliveries of the event are written in the same transaction. Raises
    :class:`RunNotFound` for an unknown run and :class:`InvalidField` for a kind the queue
    reserves (:data:`SYSTEM_KINDS`) or that is not a lowercase name.
    """
    _check_kind(kind)
    payload = _check_data(data)
    if idempotency_key is not None:
        _check_key(idempotency_key)
    params = {
        "run_id": run_id,
        "attempt": attempt,
        "kind": kind,
        "data": Jsonb(payload),
        "key": idempotency_key,
    }
    async with conn.transaction():
        cur = await conn.execute(q("ledger_append"), params)
        row = await cur.fetchone()
        assert row is not None  # the statement always answers one row
        found, *columns = row
        if not found:
            raise RunNotFound(f"no run {run_id}", fix="check the id with `worker runs list`")
        if columns[0] is not None:
            return runs.Event(*columns)
        # The key is taken: by an earlier append, or by a concurrent one that committed
        # while this statement waited on it (a new statement sees it).
        async with conn.cursor(row_factory=class_row(runs.Event)) as reread:
            await reread.execute(
                q("ledger_event_by_key"), {"run_id": run_id, "key": idempotency_key}
            )
            stored = await reread.fetchone()
    assert stored is not None, "the conflicting event vanished (its run was deleted)"
    return stored


def _check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise InvalidField(
            f"event kind {kind!r} is not a lowercase name",
            field="kind",
            rule="1-100 characters: a lowercase letter, then letters, digits, '_' or '.'",
            fix="name the event like the queue's own kinds, e.g. crm_synced",
        )
    if kind in SYSTEM_KINDS:
        raise InvalidField(
            f"event kind {kind!r} is reserved: the queue appends it itself",
            field="kind",
            rule="a kind that is not one of the queue's own (queues.ledger.SYSTEM_KINDS)",
            fix=f"use a name of your own, e.g. app.{kind}",
        )


def _check_data(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidField(
            f"event data must be a JSON object, got {type(data).__name__}",
            field="data",
            rule='a JSON object such as {"rows": 10}',
            fix="wrap the value in an object",
        )
    fields.encode(data, field="data", what="event data", max_bytes=MAX_DATA_BYTES)
    return data


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_LENGTH:
        raise InvalidField(
            f"idempotency key {key!r} is empty or too long",
            field="idempotency_key",
            rule=f"1-{MAX_KEY_LENGTH} characters, not only spaces",
            fix="use a request id, a delivery id or another stable, short string",
        )


# ---- the outbox ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """One leased outbox row: an event on its way to one sink."""

    id: int
    sink: str
    url: str | None
    attempts: int  # leases taken so far, this one included
    lease_expires_at: datetime
    leased_at: datetime  # the database's time of the lease (retries count from it)
    event: runs.Event

    @property
    def idempotency_key(self) -> str:
        """What a receiver dedupes on: the same for every delivery of this event."""
        return f"{self.event.run_id}:{self.event.seq}"

    def body(self) -> dict[str, Any]:
        return event_json(self.event)

    def retry_at(self, *, rng: random.Random | None = None) -> datetime:
        """When to try again after this attempt failed (capped exponential backoff)."""
        # Deliveries are retried without limit: past the cap the exponent stops growing
        # (2.0 ** n overflows a float after about a thousand attempts).
        failures = min(self.attempts, _BACKOFF_EXPONENT_MAX)
        return self.leased_at + timedelta(seconds=DELIVERY_RETRY.delay(failures, rng=rng))


@dataclass(frozen=True, slots=True)
class _LeaseRow:
    id: int
    sink: str
    url: str | None
    attempts: int
    lease_expires_at: datetime
    leased_at: datetime
    event_id: int | None  # None: an event a state row stands for (migration 0041)
    run_id: uuid.UUID
    seq: int
    attempt: int | None
    kind: str
    data: dict[str, Any]
    idempotency_key: str | None
    at: datetime


async def lease_deliveries(
    conn: psycopg.AsyncConnection[Any],
    owner: str,
    limit: int = DEFAULT_BATCH,
    lease_s: float = DEFAULT_LEASE_S,
    now: datetime | None = None,
) -> list[Delivery]:
    """Lease up to ``limit`` due deliveries of enabled sinks to ``owner`` for ``lease_s``,
    in turns across sinks.

    A due delivery is pending, and its retry time (or the lease another projector held)
    has passed. Each lease counts as an attempt.
    """
    if limit <= 0 or lease_s <= 0:
        raise InvalidField(
            f"cannot lease {limit} deliveries for {lease_s}s",
            field="limit" if limit <= 0 else "lease_s",
            rule="a positive batch and a positive lease",
            fix=f"pass e.g. limit={DEFAULT_BATCH}, lease_s={DEFAULT_LEASE_S:g}",
        )
    async with conn.transaction(), conn.cursor(row_factory=class_row(_LeaseRow)) as cur:
        await cur.execute(
            q("outbox_lease"),
            {
                "owner": owner,
                "limit": limit,
                "lease_s": lease_s,
                "now": now,
            },
        )
        rows = await cur.fetchall()
    return [
        Delivery(
            id=r.id,
            sink=r.sink,
            url=r.url,
            attempts=r.attempts,
            lease_expires_at=r.lease_expires_at,
            leased_at=r.leased_at,
            event=runs.Event(
                r.event_id, r.run_id, r.seq, r.attempt, r.kind, r.data, r.idempotency_key, r.at
            ),
        )
        for r in rows
    ]


async def mark_delivered(
    conn: psycopg.AsyncConnection[Any],
    owner: str,
    ids: Sequence[int],
    now: datetime | None = None,
) -> list[int]:
    """Mark deliveries delivered where ``owner`` still holds their lease; the ids marked.

    An id missing from the answer was not this owner's any more (its lease lapsed and
    another projector took it, or it was delivered): nothing was written for it.
    """
    if not ids:
        return []
    async with conn.transaction():
        cur = await conn.execute(
            q("outbox_delivered"), {"owner": owner, "ids": list(ids), "now": now}
        )
        return sorted(int(row[0]) for row in await cur.fetchall())


async def mark_failed(
    conn: psycopg.AsyncConnection[Any],
    owner: str,
    id: int,
    error: str,
    retry_at: datetime,
) -> bool:
    """Record a failed delivery and its next try, where ``owner`` still holds its lease.

    False when it did not (another projector leased it since): nothing was written.
    """
    async with conn.transaction():
        cur = await conn.execute(
            q("outbox_failed"),
            {
                "owner": owner,
                "id": id,
                "error": error[:MAX_ERROR_LENGTH],
                "retry_at": retry_at,
            },
        )
        return await cur.fetchone() is not None


# ---- the progress projection ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    run_id: uuid.UUID
    state: str | None
    attempt: int | None
    rows_admitted: int
    rows_done: int
    last_event_seq: int  # the latest event folded in
    updated_at: datetime
    ledger_seq: int  # the run's latest event

    @property
    def behind(self) -> bool:
        """Whether events of the run are not folded in yet."""
        return self.last_event_seq < self.ledger_seq


async def progress(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> Progress | None:
    """A run's progress projection, or None when none was folded: a run whose one event is
    its ``run_created`` (admission writes no progress row; the run is queued, no rows), or
    whose events were appended while the progress sink was disabled."""
    async with conn.cursor(row_factory=class_row(Progress)) as cur:
        await cur.execute(q("progress_get"), {"run_id": run_id})
        return await cur.fetchone()


async def progress_counts(conn: psycopg.AsyncConnection[Any], run: runs.Run) -> tuple[int, int]:
    """(rows done, rows in all) for a progress bar, from the progress projection.

    The total is the run's input rows or what it admitted, whichever is more. A finished
    run whose projection is behind or missing (its events appended while the progress sink
    was disabled) shows its own final counters.
    """
    found = await progress(conn, run.id)
    if found is None or (run.terminal and found.behind):
        return run.rows_done, run.rows_total
    return found.rows_done, max(run.input_rows, found.rows_admitted)


# ---- sinks ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sink:
    name: str
    kind: str
    url: str | None
    enabled: bool
    kinds: list[str] | None  # the kinds of event it gets (None: every kind)
    pending: int  # deliveries not delivered yet
    failing: int  # of which tried and failed at least once
    oldest_pending_s: float
    last_error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "url": redact_url(self.url) if self.url else None,
            "enabled": self.enabled,
            "kinds": self.kinds,
            "pending": self.pending,
            "failing": self.failing,
            "oldest_pending_s": round(self.oldest_pending_s, 3),
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class SinkChange:
    name: str
    kind: str
    url: str | None
    enabled: bool
    kinds: list[str] | None
    created: bool


SINK_KINDS_MAX = 100


def validate_sink_kinds(kinds: Sequence[str] | None) -> list[str] | None:
    """The kinds of event an HTTP sink asks for (the queue's own, ``SYSTEM_KINDS``, and a
    play's), distinct and in order; None or empty: every kind."""
    if not kinds:
        return None
    found: list[str] = []
    for kind in kinds:
        if not isinstance(kind, str) or not _KIND.match(kind):
            raise InvalidField(
                f"event kind {kind!r} is not a lowercase name",
                field="--kind",
                rule="1-100 characters: a lowercase letter, then letters, digits, '_' or '.'",
                fix="name a kind the ledger shows, e.g. --kind run_succeeded --kind run_failed",
            )
        if kind not in found:
            found.append(kind)
    if len(found) > SINK_KINDS_MAX:
        raise InvalidField(
            f"{len(found)} kinds for one sink",
            field="--kind",
            rule=f"at most {SINK_KINDS_MAX} kinds",
            fix="leave --kind out to deliver every kind",
        )
    return found


def validate_sink_name(name: str) -> str:
    if not isinstance(name, str) or not _SINK_NAME.match(name):
        raise InvalidField(
            f"sink name {name!r} is not a short lowercase name",
            field="NAME",
            rule="1-63 characters: a lowercase letter or digit, then letters, digits, "
            "'_', '.' or '-'",
            fix="name the sink after its consumer, e.g. crm-webhook",
        )
    return name


def validate_sink_url(url: str) -> str:
    parts = urlsplit(url) if isinstance(url, str) else None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or len(url) > MAX_URL_LENGTH
    ):
        raise InvalidField(
            f"sink URL {url!r} is not an http(s) URL",
            field="--url",
            rule=f"http:// or https://, a host, at most {MAX_URL_LENGTH} characters",
            fix="pass e.g. --url https://example.com/hooks/runs",
        )
    return url


def redact_url(url: str) -> str:
    """A URL without the password of its user info (for listings and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def add_sink(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    url: str,
    kinds: Sequence[str] | None = None,
) -> SinkChange:
    """Add an HTTP sink (or point one at a new URL and enable it). It receives the events
    appended from now on, only those of ``kinds`` when given (no delivery row is written
    for another kind); the built-in progress sink cannot be changed."""
    validate_sink_name(name)
    validate_sink_url(url)
    wanted = validate_sink_kinds(kinds)
    async with conn.transaction(), conn.cursor(row_factory=class_row(SinkChange)) as cur:
        await cur.execute(q("sink_add"), {"name": name, "url": url, "kinds": wanted})
        changed = await cur.fetchone()
    if changed is None:
        raise _builtin(name)
    return changed


async def disable_sink(conn: psycopg.AsyncConnection[Any], name: str) -> SinkChange:
    """Stop delivering to an HTTP sink: new events get no delivery for it, and its pending
    deliveries wait until it is added again."""
    async with conn.transaction(), conn.cursor(row_factory=class_row(SinkChange)) as cur:
        await cur.execute(q("sink_disable"), {"name": name})
        changed = await cur.fetchone()
    if changed is not None:
        return changed
    found = await conn.execute(q("sink_names"))
    names = [str(n) for (n,) in await found.fetchall()]
    if name in names:
        raise _builtin(name)
    near = did_you_mean(name, names)
    raise InvalidField(
        f"no sink named {name!r}",
        field="NAME",
        rule="a sink that exists (`worker sinks list`)",
        fix=f"did you mean {near!r}?" if near else "list the sinks with `worker sinks list`",
    )


async def list_sinks(conn: psycopg.AsyncConnection[Any]) -> list[Sink]:
    async with conn.cursor(row_factory=class_row(Sink)) as cur:
        await cur.execute(q("sink_list"))
        return await cur.fetchall()


def _builtin(name: str) -> InvalidField:
    return InvalidField(
        f"sink {name!r} is the built-in progress sink: it is always enabled and has no URL",
        field="NAME",
        rule="an HTTP sink of your own",
        fix="choose another name for an HTTP sink",
    )
