"""The run context a play receives: steps, sheets, sleep, events, cancellation hooks.

Every write made through it carries the attempt number (the fence). A play that learns
its attempt is stale (``StaleAttempt``, ``SheetSuperseded``) must stop; the runtime turns
that into a ``superseded`` attempt with no final write.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool

from queues import receipts, runs, sheets
from worker.plays import CleanupFn, Fatal

STEP_LEASE_S = 60.0


class Suspend(BaseException):
    """Raised inside a play to leave the worker durably (sleep or event wait).

    A BaseException so that a play's ``except Exception`` cannot swallow it.
    """

    def __init__(self, wake_at: datetime | None, event: str | None = None) -> None:
        super().__init__(wake_at, event)
        self.wake_at = wake_at
        self.event = event


class EventTimeout(Fatal, TimeoutError):
    """``wait_for_event`` reached its timeout before the event was emitted.

    Not retried when uncaught: the deadline is durable, so a retry would time out again.
    """


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: uuid.UUID
    attempt: int
    org: str
    play: str
    lane: str
    release: str
    worker_id: str


class RunContext:
    def __init__(self, info: RunInfo, params: dict[str, Any], pool: AsyncConnectionPool[Any]):
        self.info = info
        self.params = params
        self._pool = pool
        self._seen: dict[str, int] = {}
        self._cleanups: list[CleanupFn] = []
        self.cancel_requested = False
        self.log = structlog.get_logger("worker.play").bind(
            run_id=str(info.run_id), attempt=info.attempt, play=info.play
        )

    @property
    def run_id(self) -> uuid.UUID:
        return self.info.run_id

    @property
    def attempt(self) -> int:
        return self.info.attempt

    def connection(self) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]:
        """A pooled connection for the play's own queries (autocommit)."""
        return self._pool.connection()

    def on_cancel(self, hook: CleanupFn) -> None:
        """Register a cleanup coroutine run before the final ``cancelled`` write."""
        self._cleanups.append(hook)

    @property
    def cleanups(self) -> Sequence[CleanupFn]:
        return tuple(self._cleanups)

    def _ref(self, name: str, scope: str | None) -> dict[str, Any]:
        """The receipt reference of the next step called ``name`` (ordinal suffixed)."""
        return {
            "org": self.info.org,
            "play": self.info.play,
            "scope": self._scope(scope),
            "step_key": receipts.step_key(name, self._seen),
            "run_id": self.info.run_id,
            "attempt": self.info.attempt,
        }

    def _scope(self, scope: str | None) -> receipts.Scope:
        if scope is None:
            return receipts.Scope.of_run(self.info.run_id)
        return receipts.Scope.named(scope)

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        scope: str | None = None,
    ) -> Any:
        """Run ``fn(*args)`` at most once to completion per scope; replay its result."""
        ref = self._ref(name, scope)
        while True:
            async with self._pool.connection() as conn:
                claim = await receipts.claim(conn, **ref, lease_s=STEP_LEASE_S)
            if claim.outcome is receipts.ClaimOutcome.REPLAY:
                return claim.result
            if claim.outcome is receipts.ClaimOutcome.SKIPPED:
                return None
            if claim.outcome is receipts.ClaimOutcome.EXECUTE:
                break
            await asyncio.sleep(0.5)  # BUSY: another live attempt holds the step's lease
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
            async with self._pool.connection() as conn:
                await receipts.fail(conn, **ref, error=error)
            raise
        async with self._pool.connection() as conn:
            # The value as stored (tuples become lists): a replay returns the same thing.
            return await receipts.complete(conn, **ref, result=value)

    async def skip(self, name: str, *, scope: str | None = None) -> bool:
        """Record that the play decided not to execute step ``name``: later attempts replay
        it as skipped (``step`` returns None). Returns False if it had already completed."""
        ref = self._ref(name, scope)
        async with self._pool.connection() as conn:
            claim = await receipts.claim(conn, **ref, lease_s=STEP_LEASE_S)
            if claim.outcome is not receipts.ClaimOutcome.EXECUTE:
                return claim.outcome is receipts.ClaimOutcome.SKIPPED
            await receipts.skip(conn, **ref)
        return True

    async def steps_done(self, keys: Sequence[str], *, scope: str | None = None) -> dict[str, Any]:
        """Completed results of a page of row-step keys, in one round trip."""
        async with self._pool.connection() as conn:
            return await receipts.lookup_many(
                conn, org=self.info.org, play=self.info.play, scope=self._scope(scope), keys=keys
            )

    async def complete_steps(
        self, results: Sequence[tuple[str, Any]], *, scope: str | None = None
    ) -> receipts.PageCompletion:
        """Record a page of row-step results in one round trip, fenced by the attempt."""
        async with self._pool.connection() as conn:
            return await receipts.complete_many(
                conn,
                org=self.info.org,
                play=self.info.play,
                scope=self._scope(scope),
                run_id=self.info.run_id,
                attempt=self.info.attempt,
                results=results,
            )

    async def input_pages(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The rows given at submit, page by page (never the whole input at once)."""
        page = 0
        while True:
            async with self._pool.connection() as conn:
                rows = await runs.input_page(conn, self.info.run_id, page)
            if rows is None:
                return
            yield rows
            page += 1

    def sheet(self, name: str) -> Sheet:
        return Sheet(self, name)

    async def _now(self) -> datetime:
        async with self._pool.connection() as conn:
            cur = await conn.execute("SELECT now()")
            row = await cur.fetchone()
        assert row is not None
        value: datetime = row[0]
        return value

    async def sleep(self, seconds: float) -> None:
        """Suspend the run durably for ``seconds``; it leaves the worker meanwhile."""
        now = await self._now()
        wake_iso = await self.step("$sleep", (now + timedelta(seconds=seconds)).isoformat)
        wake_at = datetime.fromisoformat(wake_iso)
        if await self._now() >= wake_at:
            return
        raise Suspend(wake_at)

    async def wait_for_event(self, name: str, *, timeout: float | None = None) -> Any:
        """Wait durably for an event; the first emit wins and its payload is returned."""
        now = await self._now()
        deadline_iso = await self.step(
            f"$event-deadline:{name}",
            lambda: None if timeout is None else (now + timedelta(seconds=timeout)).isoformat(),
        )
        deadline = datetime.fromisoformat(deadline_iso) if deadline_iso else None
        async with self._pool.connection() as conn:
            found, payload = await runs.emitted_payload(conn, name)
        if found:
            return payload
        if deadline is not None and await self._now() >= deadline:
            raise EventTimeout(f"event {name!r} was not emitted before {deadline.isoformat()}")
        raise Suspend(deadline, event=name)


class Sheet:
    """A play's handle on one sheet: admit pages under the run's write intent, complete rows."""

    def __init__(self, ctx: RunContext, name: str) -> None:
        self.ctx = ctx
        self.name = name
        self.write_version: int | None = None

    async def admit(
        self, rows: Sequence[tuple[str, Any]], *, stable_intent: bool = True
    ) -> sheets.AdmitResult:
        async with self.ctx.connection() as conn:
            result = await sheets.admit_page(
                conn,
                org=self.ctx.info.org,
                sheet=self.name,
                run_id=self.ctx.info.run_id,
                rows=rows,
                write_version=self.write_version if stable_intent else None,
                stable_intent=stable_intent,
            )
        self.write_version = result.write_version
        return result

    async def complete(
        self, completions: Sequence[sheets.RowCompletion], *, raise_on_superseded: bool = True
    ) -> sheets.CompletionResult:
        async with self.ctx.connection() as conn:
            return await sheets.complete_rows(
                conn,
                org=self.ctx.info.org,
                sheet=self.name,
                run_id=self.ctx.info.run_id,
                write_version=self.write_version,
                completions=completions,
                raise_on_superseded=raise_on_superseded,
            )
