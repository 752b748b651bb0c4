"""How an attempt ends: one rulebook for both executors, in-process (:mod:`worker.attempt`)
and sandboxed (:mod:`worker.sandbox`), so a play's end means the same wherever it ran.

Each executor reports how its attempt ended as an :data:`Ending`: the play returned
(:class:`Returned`), raised (:class:`Raised`), suspended (:class:`Suspended`), was stopped
by the runtime (:class:`Stopped`: a cancel or the run's timeout, after its cleanup hooks
ran; a lost lease; a hand-back), or a fence refused one of its writes (:class:`Fenced`).
:func:`final` is the one function that turns an ending into the attempt's final write.

The outcome policy itself (retry, backoff, interruption budget) is :mod:`queues.outcomes`;
this module applies it to a claimed run: what fails a run at once (:func:`is_fatal`), the
run's retry budget (:func:`budget`), a result that must be JSON (:func:`success`), and a
run's deadline (:func:`past_deadline`, :func:`until_deadline`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from queues import fields, outcomes, runs
from queues.errors import WorkerError
from queues.outcomes import Finish
from worker.blips import is_blip


class Fatal(Exception):
    """Raised by a play for a failure that retrying cannot fix (bad params, 4xx)."""


class Suspend(BaseException):
    """Raised inside a play to leave the worker durably (sleep, event wait, a budget's
    pause): until ``wake_at``, or until ``event`` wakes it.

    A BaseException so that a play's ``except Exception`` cannot swallow it.
    """

    def __init__(self, wake_at: datetime | None, event: str | None = None) -> None:
        super().__init__(wake_at, event)
        self.wake_at = wake_at
        self.event = event


def budget(c: runs.Claimed) -> outcomes.Budget:
    """What the run has spent of its retries and interruptions before this attempt."""
    return outcomes.Budget(
        policy=c.retry,
        failures=c.failures or 0,
        interruptions=c.interruptions or 0,
        max_interruptions=c.max_interruptions or 0,
    )


def is_fatal(exc: BaseException) -> bool:
    """Whether a play's exception fails its run at once: the play's ``Fatal``, or a
    refusal of the project's that no later attempt could get past; never the database
    going away (an interruption) or a refusal that passes (``WorkerError.passes``: an
    older receiver during a rollout). The one rule, for in-process and sandboxed plays."""
    if outcomes.is_interruption(exc) or is_blip(exc):
        return False
    if isinstance(exc, WorkerError):
        return not exc.passes
    return isinstance(exc, Fatal)


def past_deadline(c: runs.Claimed) -> bool:
    """Whether the run's timeout had passed when this attempt was claimed."""
    claimed_at = c.claimed_at
    return c.timeout_at is not None and claimed_at is not None and claimed_at >= c.timeout_at


def until_deadline(c: runs.Claimed, final: Finish) -> Finish:
    """A suspension wakes the run by its timeout at the latest (to fail it then)."""
    if c.timeout_at is None or final.state != outcomes.RunState.SLEEPING:
        return final
    if final.spawn_at is not None and final.spawn_at <= c.timeout_at:
        return final
    return dataclasses.replace(final, spawn=True, spawn_at=c.timeout_at)


def success(c: runs.Claimed, result: Any) -> Finish:
    """The play returned ``result``: succeeded, or failed for good when the result is not
    JSON the database takes."""
    assert c.attempt is not None
    try:
        # The one JSON rule (no NaN, no NUL, no lone surrogate, bounded depth and size): a
        # result the database would refuse must fail this run, not the finish batch it
        # shares with other runs.
        encoded = fields.encode(result, field="result", max_bytes=fields.MAX_RESULT_BYTES)
    except WorkerError as exc:
        return outcomes.failed(
            c.run_id,
            c.attempt,
            {"type": "ResultNotJSON", "message": f"the play's result: {exc.message}"},
            c.retry,
            now=datetime.now(UTC),
            failure=(c.failures or 0) + 1,
            retryable=False,
        )
    return outcomes.succeeded(c.run_id, c.attempt, result, result_json=encoded)


@dataclass(frozen=True, slots=True)
class Returned:
    """The play returned ``result``."""

    result: Any


@dataclass(frozen=True, slots=True)
class Raised:
    """The play raised: its error (``type``, ``message``, ``code``, ``traceback``, as
    :func:`queues.outcomes.error_of` makes it), whether it fails the run at once
    (:func:`is_fatal`), and whether it is an interruption (the database, or a sandbox's
    gateway, went away under it: not the play's fault, retried promptly)."""

    error: dict[str, Any]
    fatal: bool
    interrupted: bool


@dataclass(frozen=True, slots=True)
class Suspended:
    """The play left durably: to sleep until ``wake_at``, or to wait for ``event``."""

    wake_at: datetime | None
    event: str | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """The runtime stopped the attempt: a ``cancel`` or the run's ``timeout`` (its cleanup
    hooks ran), a lost lease (``lease_lost``: a newer attempt or the rescuer owns the run),
    or a ``handback`` (the run goes back to its lane, spending nothing)."""

    reason: Literal["cancel", "timeout", "lease_lost", "handback"]


@dataclass(frozen=True, slots=True)
class Fenced:
    """A fence refused one of the attempt's writes: a newer attempt owns the run."""

    code: str | None = None
    message: str | None = None


Ending = Returned | Raised | Suspended | Stopped | Fenced


@dataclass(frozen=True, slots=True)
class Ended:
    """An attempt's final write, if any, and an event to suspend on (written under the
    event's lock)."""

    finish: Finish | None  # None: stale, nothing to write
    event: str | None = None


def final(c: runs.Claimed, ending: Ending) -> Ended:
    """The attempt's final write for how it ended: the one rule, whichever executor ran it."""
    assert c.attempt is not None
    if isinstance(ending, Returned):
        return Ended(success(c, ending.result))
    if isinstance(ending, Suspended):
        suspended = outcomes.suspended(
            c.run_id, c.attempt, wake_at=ending.wake_at, wait_event=ending.event
        )
        return Ended(until_deadline(c, suspended), event=ending.event)
    if isinstance(ending, Raised):
        spent = budget(c)
        now = datetime.now(UTC)
        if ending.interrupted:
            return Ended(
                outcomes.interrupted(
                    c.run_id,
                    c.attempt,
                    ending.error,
                    spent.policy,
                    now=now,
                    failure=spent.failures + 1,
                    interruption=spent.interruptions + 1,
                    max_interruptions=spent.max_interruptions,
                )
            )
        return Ended(
            outcomes.failed(
                c.run_id,
                c.attempt,
                ending.error,
                spent.policy,
                now=now,
                failure=spent.failures + 1,
                retryable=not ending.fatal,
            )
        )
    if isinstance(ending, Stopped):
        if ending.reason == "cancel":
            return Ended(outcomes.cancelled(c.run_id, c.attempt, "cancel requested"))
        if ending.reason == "timeout":
            return Ended(outcomes.timed_out(c.run_id, c.attempt, c.timeout_at))
        if ending.reason == "handback":
            return Ended(outcomes.handed_back(c.run_id, c.attempt))
    return Ended(None)  # a lost lease, or fenced: nothing to write
