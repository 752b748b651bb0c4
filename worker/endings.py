"""How an attempt ends: the rules both executors follow, in-process (:mod:`worker.attempt`)
and sandboxed (:mod:`worker.sandbox`), so a play's end means the same wherever it ran.

The outcome policy itself (retry, backoff, interruption budget) is :mod:`queues.outcomes`;
this module applies it to a claimed run: what fails a run at once (:func:`is_fatal`), the
run's retry budget (:func:`budget`), a result that must be JSON (:func:`success`), and a
run's deadline (:func:`past_deadline`, :func:`until_deadline`).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from queues import fields, outcomes, runs
from queues.errors import WorkerError
from queues.outcomes import Finish
from worker.blips import is_blip


class Fatal(Exception):
    """Raised by a play for a failure that retrying cannot fix (bad params, 4xx)."""


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
        fields.encode(result, field="result", max_bytes=fields.MAX_RESULT_BYTES)
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
    return outcomes.succeeded(c.run_id, c.attempt, result)
