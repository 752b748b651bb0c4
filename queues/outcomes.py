"""Outcome policy: what an attempt's end, or a lapsed lease, does to its run. One place.

The worker turns the end of an attempt into a :class:`Finish` here (a return, an
exception, a stop), and the recovery pass decides a lapsed lease here too
(:func:`after_lapse`), so the rules cannot drift apart:

- a failure spends the retry budget (:class:`~queues.lanes.RetryPolicy`: exponential
  backoff with a cap and jitter, a maximum of attempts);
- an **interruption** (the database stayed away under the attempt past the worker's
  ``max_outage_s``: a shorter blip is absorbed inside the attempt and is nothing here) is
  retried promptly and spends nothing, up to the lane's ``max_interruptions``; past that
  it counts as a failure, so no run loops for ever;
- a **lapsed lease** (its worker died or hung) is an interruption too: retried promptly,
  spending nothing, whatever the number of worker deaths a crash storm brings; a run that
  is itself what kills its workers (lapses in a row with nothing settled, on as many
  workers) fails with ``RUN_KILLS_WORKERS`` (:func:`after_lapse`);
- a fatal error (the play's ``Fatal``, a refused input, a result that is not JSON) fails
  the run at once;
- a hand-back or a suspension (sleep, event wait) spends nothing;
- **cancel is final**: a lapse with a cancel pending gets a cleanup-only attempt (its
  cancel hooks run before the final ``cancelled``) while the budget lasts.
"""

from __future__ import annotations

import random
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import psycopg
import psycopg.errors
from psycopg_pool import PoolTimeout

from queues.errors import RunRowInvalid
from queues.lanes import RetryPolicy


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
    INTERRUPTED = "interrupted"  # the database went away under it; not a failure


class FinishStatus(StrEnum):
    """What ``run_finish_batch`` did with one final write."""

    APPLIED = "applied"  # written now
    REPLAYED = "replayed"  # written by an earlier copy of this write whose reply was lost
    CANCEL_PENDING = "cancel_pending"  # refused: run the cleanup hooks, then write cancelled
    REFUSED = "refused"  # stale: the attempt no longer owns its run; nothing written

    @property
    def applied(self) -> bool:
        return self in (FinishStatus.APPLIED, FinishStatus.REPLAYED)


# An interruption is retried after about this long (with jitter): the database is usually
# back within seconds, and waiting longer only delays the run.
INTERRUPTION_DELAY_S = 1.0
# A run whose attempts lost their workers this many times in a row, on as many workers,
# with nothing settled in any of them, is a poison run (after_lapse). Three: a healthy
# run meets a worker's death only when that death is unrelated to it, and between two such
# deaths it completes steps; three deaths in a row with no step settled, on three workers,
# is what a play that exhausts memory or crashes its process does, and stopping there
# costs at most three workers' restarts.
KILLS_WORKERS_AFTER = 3
RUN_KILLS_WORKERS = "RUN_KILLS_WORKERS"
# Runs that lapsed together twice in a row with nothing settled are retried this far apart.
LAPSE_STAGGER_S = 2.0


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
    # ``result`` as the JSON text it was checked as (queues.fields.encode), written as is:
    # a result is encoded once, not again by the finish batch. Not part of the write's value.
    result_json: str | None = field(default=None, compare=False, repr=False)


def succeeded(
    run_id: uuid.UUID, attempt: int, result: Any, *, result_json: str | None = None
) -> Finish:
    """A returned play's final write; ``result_json``: ``result`` already encoded."""
    return Finish(
        run_id,
        attempt,
        RunState.SUCCEEDED,
        Outcome.SUCCEEDED,
        "run_succeeded",
        result,
        result_json=result_json,
    )


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


def interrupted(
    run_id: uuid.UUID,
    attempt: int,
    error: dict[str, Any],
    policy: RetryPolicy,
    *,
    now: datetime,
    failure: int,
    interruption: int,
    max_interruptions: int,
    rng: random.Random | None = None,
) -> Finish:
    """An attempt the database interrupted (a lost connection, an administrator shutdown,
    a failover, a serialization failure): retried promptly without spending the retry
    budget. Past ``max_interruptions`` an interruption counts as a failure, so a run that
    keeps breaking its connection cannot loop for ever."""
    if interruption > max_interruptions:
        return failed(run_id, attempt, error, policy, now=now, failure=failure)
    delay = INTERRUPTION_DELAY_S * (rng or random).uniform(0.5, 1.5)
    return Finish(
        run_id,
        attempt,
        RunState.QUEUED,
        Outcome.INTERRUPTED,
        "run_interrupted",
        error=error,
        spawn=True,
        spawn_at=now + timedelta(seconds=delay),
    )


def timed_out(run_id: uuid.UUID, attempt: int, deadline: datetime | None) -> Finish:
    """A run past its timeout (queues.options): stopped and failed, never retried."""
    when = deadline.isoformat() if deadline is not None else "its deadline"
    return Finish(
        run_id,
        attempt,
        RunState.FAILED,
        Outcome.FAILED,
        "run_failed",
        error={
            "type": "RunTimedOut",
            "code": "RUN_TIMED_OUT",
            "message": f"the run passed its timeout (deadline {when}) and was stopped",
        },
    )


def row_invalid(run_id: uuid.UUID, attempt: int, problem: str) -> Finish:
    """A claimed run whose stored row no worker can use (:func:`queues.runs.unusable`):
    failed before its play runs, never retried (every attempt would meet the same row)."""
    return Finish(
        run_id,
        attempt,
        RunState.FAILED,
        Outcome.FAILED,
        "run_failed",
        error={"type": "RunRowInvalid", "code": RunRowInvalid.code, "message": problem},
    )


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


# ---- classification ----------------------------------------------------------------------

# What interrupts an attempt without being its fault: psycopg raises OperationalError for a
# lost connection, an administrator shutdown (AdminShutdown), a failover and the
# transaction-rollback class (serialization failure, deadlock); the pool raises PoolTimeout
# while the database is unreachable.
INTERRUPTIONS: tuple[type[BaseException], ...] = (psycopg.OperationalError, PoolTimeout)


def is_interruption(exc: BaseException) -> bool:
    """Whether ``exc`` (or the exception it was raised from) is the database going away."""
    for candidate in (exc, exc.__cause__, exc.__context__):
        if isinstance(candidate, INTERRUPTIONS):
            return True
    return False


# A stored traceback keeps the innermost frames (where it went wrong) of each exception in
# its chain, and at most this many bytes of text (the tail: the raising frames and the
# exception line), so one failure cannot bloat the run, its attempt or a sink's payload.
TRACEBACK_FRAMES = 30
TRACEBACK_MAX_BYTES = 16 * 1024
_TRUNCATED = "... (traceback truncated to its last {n} bytes)\n"


def bounded_traceback(
    exc: BaseException, *, frames: int = TRACEBACK_FRAMES, max_bytes: int = TRACEBACK_MAX_BYTES
) -> str | None:
    """The formatted traceback of ``exc`` (its last ``frames`` frames per exception of the
    chain, capped to ``max_bytes`` of UTF-8 from the end), or None if it was never raised."""
    if exc.__traceback__ is None:
        return None
    text = "".join(traceback.format_exception(exc, limit=-frames))
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    marker = _TRUNCATED.format(n=max_bytes)
    keep = max(0, max_bytes - len(marker.encode()))
    return marker + data[len(data) - keep :].decode("utf-8", errors="ignore")


def error_of(exc: BaseException) -> dict[str, Any]:
    """The recorded form of an attempt's error: type, message, code and its bounded
    traceback (:func:`bounded_traceback`)."""
    error: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "code": getattr(exc, "code", None),
    }
    stack = bounded_traceback(exc)
    if stack is not None:
        error["traceback"] = stack
    return error


@dataclass(frozen=True, slots=True)
class Budget:
    """What one attempt has spent so far, and its lane's policy."""

    policy: RetryPolicy
    failures: int  # failed or lapsed attempts before this one
    interruptions: int  # interrupted attempts before this one
    max_interruptions: int


def after_exception(
    run_id: uuid.UUID,
    attempt: int,
    exc: BaseException,
    budget: Budget,
    *,
    now: datetime,
    fatal: bool,
    rng: random.Random | None = None,
) -> Finish:
    """The final write of an attempt whose play raised ``exc``."""
    error = error_of(exc)
    if is_interruption(exc):
        return interrupted(
            run_id,
            attempt,
            error,
            budget.policy,
            now=now,
            failure=budget.failures + 1,
            interruption=budget.interruptions + 1,
            max_interruptions=budget.max_interruptions,
            rng=rng,
        )
    return failed(
        run_id,
        attempt,
        error,
        budget.policy,
        now=now,
        failure=budget.failures + 1,
        retryable=not fatal,
    )


@dataclass(frozen=True, slots=True)
class Lapse:
    """What a lapsed lease does to its run: its next state and when it may run again."""

    state: RunState  # queued (retry, or a cleanup-only attempt), failed or cancelled
    delay_s: float
    code: str = "LEASE_EXPIRED"  # the run's error code (RUN_KILLS_WORKERS: a poison run)
    why: str | None = None  # said after the lapse in the run's error message


def after_lapse(
    policy: RetryPolicy,
    *,
    failures: int,
    cancel_requested: bool,
    streak: Sequence[str] = (),
    shared: bool = False,
    rank: int = 0,
    rng: random.Random | None = None,
) -> Lapse:
    """The rule for a lapsed lease: an interruption, not a failure.

    The worker died or hung (a deploy, a crashed host, an OOM kill of the whole process):
    nothing says the play was wrong, so the lapse spends no retry budget (``failures``
    counts the run's failed attempts) and the run is retried promptly. Unless the run is
    what kills its workers. ``streak`` holds the workers of this lapse and of the lapses
    right before it in which nothing settled (no step completed, no row done), newest
    first. At :data:`KILLS_WORKERS_AFTER` of them on as many workers, the run is a poison
    run and fails with ``RUN_KILLS_WORKERS`` (docs/design.md, section 11c) -- unless another
    run was there at each of those last deaths (``shared``: it may as well be the cause).

    Runs that lapsed together a second time in a row with nothing settled are retried
    apart, ``rank`` (their place, drawn at random) times :data:`LAPSE_STAGGER_S` after
    each other: the one that kills its worker then does it alone, and the others get to
    settle a step. (A first death is most often a deploy or a host's: no stagger.)
    """
    quiet = len(streak)
    if cancel_requested:
        # Cleanup first: a cleanup-only attempt runs the cancel hooks, then writes
        # `cancelled`; once the failures and these lapses spent the budget, cancel
        # without them (a cleanup that keeps killing its worker ends).
        exhausted = policy.exhausted(failures + max(quiet, 1))
        return Lapse(RunState.CANCELLED if exhausted else RunState.QUEUED, 0.0)
    if poison_candidate(streak) and not shared:
        workers = len(set(streak))
        return Lapse(
            RunState.FAILED,
            0.0,
            code=RUN_KILLS_WORKERS,
            why=f"{quiet} attempts in a row lost their workers ({workers} workers) with no "
            "step completed, each time without another run that was there at every one "
            "of those deaths: the run kills its workers (memory, a crash in native code); "
            "fix the play, then `worker retry` the run",
        )
    # Promptly: about a second, or the lane's first retry delay when that is shorter.
    delay = min(policy.delay(1, rng=rng), INTERRUPTION_DELAY_S * (rng or random).uniform(0.5, 1.5))
    return Lapse(RunState.QUEUED, delay + rank * LAPSE_STAGGER_S)


def poison_candidate(streak: Sequence[str]) -> bool:
    """Whether a lapse streak reaches the poison bound: :data:`KILLS_WORKERS_AFTER` lapses
    with nothing settled, on as many workers."""
    return len(streak) >= KILLS_WORKERS_AFTER and len(set(streak)) >= KILLS_WORKERS_AFTER


def recent_deaths(streak: Sequence[str]) -> list[str]:
    """The last :data:`KILLS_WORKERS_AFTER` distinct workers of a streak (newest first):
    the deaths another run must have been at to share the blame."""
    return list(dict.fromkeys(streak))[:KILLS_WORKERS_AFTER]
