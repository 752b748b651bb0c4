"""Where a run waits and what it starts: durable sleeps, events, shared limits, children.

A wait leaves the worker durably (:class:`Suspend`) and is recorded as a step, so a later
attempt replays its outcome instead of waiting again; an emit and a spawn are steps too,
so a retried attempt neither emits nor spawns twice. Every write carries the attempt's
fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from queues import calls, children, fields, limits, receipts, runs
from queues.errors import InvalidField
from queues.options import RunOptions
from worker.endings import Fatal, Suspend
from worker.steps import Run, Steps

EVENT_NAME_MAX = 200

# A play waiting for a permit of a shared limit (ctx.limit) waits in the worker up to this
# long in all; a longer wait hands the run back (it sleeps durably until the permit is due).
HAND_BACK_AFTER_S = 30.0
LIMIT_BUSY_POLL_S = 0.05  # a limit at its concurrency cap is asked again after this, ...
LIMIT_BUSY_MAX_S = 1.0  # ... doubling up to this


@dataclass(frozen=True, slots=True)
class Permit:
    """A permit of a shared limit held by the block of ``ctx.limit``."""

    key: str
    at: datetime  # the database's time of the grant
    waited_s: float  # how long this attempt waited for it


class ChildFailed(Fatal):
    """``ctx.wait_for_run`` on a child run that failed or was cancelled: its ``state`` and
    its ``error``. A ``Fatal``: the recorded outcome replays the same on every attempt."""

    def __init__(self, run_id: uuid.UUID, state: str, error: Any) -> None:
        message = error.get("message") if isinstance(error, dict) else None
        super().__init__(f"child run {run_id} {state}" + (f": {message}" if message else ""))
        self.run_id = run_id
        self.state = state
        self.error = error


class WaitTimedOut(Fatal):
    """``ctx.wait_for_run(..., timeout=...)`` whose durable deadline passed before the child
    ended (the child goes on). Recorded: a later attempt raises it again."""

    def __init__(self, run_id: uuid.UUID) -> None:
        super().__init__(f"child run {run_id} did not end before the wait's timeout")
        self.run_id = run_id


@dataclass(frozen=True, slots=True)
class EventResult:
    """What ``wait_for_event`` returns: the event's payload, or that the wait timed out.

    A timeout is an ordinary result the play decides about (``if result.timed_out: ...``).
    """

    name: str
    received: bool
    payload: Any = None
    emitted_at: str | None = None  # ISO 8601, when received

    @property
    def timed_out(self) -> bool:
        return not self.received


class Waits:
    """One attempt's sleeps, event waits and emits, limit permits and child runs."""

    def __init__(self, info: Any, run: Run, steps: Steps, log: Callable[[], Any]) -> None:
        self.info = info
        self._run = run
        self._steps = steps
        self._log = log
        self._holds = 0  # permits of shared limits taken by this attempt (their names)

    async def now(self) -> datetime:
        now: datetime = await self._run(calls.Now())
        return now

    async def sleep(self, seconds: float) -> None:
        """``ctx.sleep``."""
        _check_seconds(seconds, "seconds")
        now = await self.now()
        await self._sleep_until_recorded((now + timedelta(seconds=seconds)).isoformat)

    async def sleep_until(self, when: datetime) -> None:
        """``ctx.sleep_until``."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise InvalidField(
                f"sleep_until needs a timezone-aware datetime, got {when!r:.80}",
                field="when",
                rule="a datetime with a tzinfo",
                fix="pass e.g. datetime(2027, 1, 1, tzinfo=UTC)",
            )
        await self._sleep_until_recorded(when.isoformat)

    async def _sleep_until_recorded(self, wake: Callable[[], str]) -> None:
        wake_at = datetime.fromisoformat(await self._steps.checkpoint("$sleep", wake))
        if await self.now() >= wake_at:
            return
        raise Suspend(wake_at)

    async def wait_for_event(self, name: str, *, timeout: float | None = None) -> EventResult:
        """``ctx.wait_for_event``: its outcome is recorded, a later attempt replays it."""
        check_event_name(name)
        if timeout is not None:
            _check_seconds(timeout, "timeout")
        now = await self.now()
        deadline_iso = await self._steps.checkpoint(
            f"$event-deadline:{name}",
            lambda: None if timeout is None else (now + timedelta(seconds=timeout)).isoformat(),
        )
        deadline = datetime.fromisoformat(deadline_iso) if deadline_iso else None
        ref = self._steps.ref(f"$event:{name}", None)
        claim = await self._steps.claim(ref)
        if claim.outcome == receipts.ClaimOutcome.REPLAY:
            return _event_result(name, claim.result)
        got: calls.EventFound = await self._run(calls.EventGet(name))
        if got.found:
            outcome: dict[str, Any] | None = {"received": True, "payload": got.payload}
        elif deadline is not None and await self.now() >= deadline:
            outcome = {"received": False}
        else:
            outcome = None
        if outcome is not None:
            done = await self._run(calls.ReceiptComplete(ref, outcome))
            return _event_result(name, done)
        raise Suspend(deadline, event=name)

    async def emit(self, name: str, payload: Any = None) -> int:
        """``ctx.emit``: recorded as a step, so a retried attempt does not emit again."""
        check_event_name(name)
        ref = self._steps.ref(f"$emit:{name}", None)
        claim = await self._steps.claim(ref)
        if claim.outcome == receipts.ClaimOutcome.REPLAY:
            return 0
        emitted: runs.Emitted = await self._run(calls.EventEmit(name, payload))
        await self._run(calls.ReceiptComplete(ref, {"woken": emitted.woken}))
        return int(emitted.woken)

    # ---- rate limits ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def limit(
        self, key: str, *, hand_back_after: float = HAND_BACK_AFTER_S
    ) -> AsyncIterator[Permit]:
        """``ctx.limit``: a permit for the block; a long wait hands the run back."""
        fields.limit_key(key, field="key")
        _check_seconds(hand_back_after, "hand_back_after")
        self._holds += 1
        hold = f"{self.info.attempt}:{self._holds}:{key}"
        waited = 0.0
        backoff = LIMIT_BUSY_POLL_S
        while True:
            permit: limits.Permit = await self._run(calls.LimitAcquire(key, hold))
            if permit.granted:
                break
            if permit.wait_s is not None:
                wait = float(permit.wait_s)
            else:  # at its concurrency cap: ask again, backing off
                wait, backoff = backoff, min(backoff * 2, LIMIT_BUSY_MAX_S)
            if waited + wait > hand_back_after:
                now = await self.now()
                self._log().info("limit_wait_handed_back", key=key, waited_s=round(waited, 3))
                raise Suspend(now + timedelta(seconds=max(wait, LIMIT_BUSY_MAX_S)))
            await asyncio.sleep(wait)
            waited += wait
        try:
            assert permit.at is not None  # a grant is made at the database's time
            yield Permit(key=key, at=permit.at, waited_s=waited)
        finally:
            if permit.held:
                # A stale attempt's release is refused (and its permit stopped counting).
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._run(calls.LimitRelease(hold)))

    # ---- child runs -------------------------------------------------------------------

    async def spawn(
        self,
        play: str,
        params: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        retry: fields.Retry | str | Mapping[str, Any] | None = None,
        timeout: float | None = None,
        start_by: datetime | float | str | None = None,
        meta: Mapping[str, Any] | None = None,
        budget: float | Mapping[str, Any] | None = None,
    ) -> uuid.UUID:
        """``ctx.spawn``: the child is admitted atomically with its step."""
        fields.play_name(play)
        fields.priority(priority)
        options = RunOptions.checked(
            max_attempts=max_attempts,
            retry=retry,
            timeout=timeout,
            start_by=start_by,
            meta=meta,
            budget=budget,
        )
        ref = self._steps.ref(key or f"$spawn:{play}", None)
        spawned: children.Spawned = await self._run(
            calls.RunSpawn(ref.step_key, play, dict(params or {}), options, priority)
        )
        return spawned.run_id

    async def wait_for_run(self, run_id: uuid.UUID | str, *, timeout: float | None = None) -> Any:
        """``ctx.wait_for_run``: the outcome is recorded as a step, replayed by a later attempt."""
        rid = uuid.UUID(str(run_id))
        if timeout is not None:
            _check_seconds(timeout, "timeout")
        now = await self.now()
        deadline_iso = await self._steps.checkpoint(
            f"$run-deadline:{rid}",
            lambda: None if timeout is None else (now + timedelta(seconds=timeout)).isoformat(),
        )
        deadline = datetime.fromisoformat(deadline_iso) if deadline_iso else None
        ref = self._steps.ref(f"$run:{rid}", None)
        claim = await self._steps.claim(ref)
        if claim.outcome == receipts.ClaimOutcome.REPLAY:
            return _child_outcome(rid, claim.result)
        child: children.Child = await self._run(calls.RunGet(rid))
        if child.terminal:
            outcome: dict[str, Any] = {
                "state": child.state,
                "result": child.result,
                "error": child.error,
            }
        elif deadline is not None and await self.now() >= deadline:
            outcome = {"state": None, "timed_out": True}
        else:
            raise Suspend(deadline, event=children.ended_event(rid))
        done = await self._run(calls.ReceiptComplete(ref, outcome))
        return _child_outcome(rid, done)


def _child_outcome(run_id: uuid.UUID, recorded: Any) -> Any:
    data = recorded if isinstance(recorded, dict) else {}
    if data.get("timed_out"):
        raise WaitTimedOut(run_id)
    state = str(data.get("state"))
    if state != "succeeded":
        raise ChildFailed(run_id, state, data.get("error"))
    return data.get("result")


def _event_result(name: str, recorded: Any) -> EventResult:
    data = recorded if isinstance(recorded, dict) else {}
    return EventResult(name=name, received=bool(data.get("received")), payload=data.get("payload"))


def check_event_name(name: object) -> None:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > EVENT_NAME_MAX
        or not name.isprintable()
    ):
        raise InvalidField(
            f"invalid event name {name!r:.80}",
            field="event",
            rule=f"1 to {EVENT_NAME_MAX} printable characters",
            fix="use a short name such as 'payment-received' or 'order:42:paid'",
        )


def _check_seconds(value: object, field: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (0 <= float(value) < 10 * 365 * 86400):  # type: ignore[arg-type]
        raise InvalidField(
            f"{field} is {value!r:.80}",
            field=field,
            rule="a finite number of seconds, 0 or more",
            fix=f"pass {field} in seconds, e.g. 60",
        )
