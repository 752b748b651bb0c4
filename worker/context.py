"""The run context a play receives: steps, sheets, sleep, events, cancellation hooks.

Every write made through it carries the attempt's fence (:class:`queues.fence.Fence`),
checked in the statement that writes. A play that learns its attempt is stale
(``StaleAttempt``, ``SheetSuperseded``) must stop; the runtime turns that into a
``superseded`` attempt with no final write.

Synchronous step bodies run in a worker thread, so a blocking call (a model load, a
``requests`` call) never stalls the event loop; the lease is renewed by a heartbeat
thread of its own even when the loop is blocked anyway.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import structlog

from queues import calls, costs, fields, receipts, runs, sheets
from queues.fence import Fence
from worker.contract import Transport, WireSender, typed
from worker.endings import Suspend
from worker.sheet import Sheet
from worker.steps import Steps
from worker.waits import (
    EVENT_NAME_MAX,
    HAND_BACK_AFTER_S,
    LIMIT_BUSY_MAX_S,
    LIMIT_BUSY_POLL_S,
    ChildFailed,
    EventResult,
    Permit,
    Waits,
    WaitTimedOut,
    check_event_name,
)

__all__ = [
    "EVENT_NAME_MAX",
    "HAND_BACK_AFTER_S",
    "LIMIT_BUSY_MAX_S",
    "LIMIT_BUSY_POLL_S",
    "STEP_LEASE_S",
    "ChildFailed",
    "CleanupFn",
    "EventResult",
    "Permit",
    "RunContext",
    "RunInfo",
    "Sheet",
    "Suspend",
    "WaitTimedOut",
]

STEP_LEASE_S = receipts.STEP_LEASE_S
T = TypeVar("T")

CleanupFn = Callable[["RunContext"], Awaitable[None]]  # a cancel hook (``ctx.on_cancel``)


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: uuid.UUID
    attempt: int
    org: str
    play: str
    lane: str
    release: str
    worker_id: str
    created_at: datetime  # the run's admission: a wait sees events emitted since
    meta: Mapping[str, Any] | None = None  # the run's metadata (queues.options)
    resumed: bool = False  # the attempt before was cut short (runs.Claimed.resumed)

    @property
    def fence(self) -> Fence:
        return Fence(self.run_id, self.attempt, self.worker_id)

    @classmethod
    def of_claim(cls, c: runs.Claimed, worker_id: str) -> RunInfo:
        """The attempt ``worker_id`` claimed (a usable row: :func:`queues.runs.unusable`)."""
        assert c.attempt is not None and c.org and c.play and c.lane and c.release
        assert c.created_at is not None
        return cls(
            c.run_id,
            c.attempt,
            c.org,
            c.play,
            c.lane,
            c.release,
            worker_id,
            c.created_at,
            meta=c.meta,
            resumed=bool(c.resumed),
        )


class RunContext:
    """What a play may do to run state: steps, sheets, events, sleep, cancel hooks.

    It holds no raw connection for the play: every call is a named runtime action
    (:mod:`queues.operations`) sent through its transport, fenced by the attempt. In
    process, the transport calls the same dispatch the gateway serves, with the attempt's
    claims; in a sandbox, it posts to the gateway with the attempt's tokens. A play that
    needs its own database work opens a connection its app configures itself (its own URL,
    its own role), never the worker's. In-process plays are trusted code all the same
    (they share the worker's process); untrusted plays run sandboxed.
    """

    def __init__(self, info: RunInfo, params: dict[str, Any], transport: Transport | WireSender):
        self.info = info
        self.params = params
        self._transport = typed(transport)
        self._cleanups: list[CleanupFn] = []
        self._sheets: dict[str, Sheet] = {}
        self.cancel_requested = False
        self._log: Any = None

    # The attempt's fence, steps and waits are made at first use: most attempts of a
    # trivial play use none of them, and each is a record or two per run.

    @functools.cached_property
    def fence(self) -> Fence:
        """The attempt's fence, carried by every write it makes."""
        return self.info.fence

    @functools.cached_property
    def _steps(self) -> Steps:
        return Steps(self.info, self._run)

    @functools.cached_property
    def _waits(self) -> Waits:
        return Waits(self.info, self._run, self._steps, lambda: self.log)

    @property
    def log(self) -> Any:
        """The play's logger, bound to its run, attempt and play (made at first use: most
        attempts never log, and binding costs a twentieth of a trivial one)."""
        if self._log is None:
            info = self.info
            self._log = structlog.get_logger("worker.play").bind(
                run_id=str(info.run_id), attempt=info.attempt, play=info.play
            )
        return self._log

    @property
    def run_id(self) -> uuid.UUID:
        return self.info.run_id

    @property
    def attempt(self) -> int:
        return self.info.attempt

    @property
    def meta(self) -> dict[str, Any]:
        """The run's metadata (``Submission.meta``, ``worker submit --meta``); empty if none."""
        return dict(self.info.meta or {})

    def on_cancel(self, hook: CleanupFn) -> None:
        """Register a cleanup coroutine run before the final ``cancelled`` write."""
        self._cleanups.append(hook)

    @property
    def cleanups(self) -> Sequence[CleanupFn]:
        return tuple(self._cleanups)

    @property
    def current_step(self) -> str | None:
        """The step whose body is running now (for lag reports), or None."""
        steps = self._made_steps()
        return steps.current_step if steps is not None else None

    @property
    def duplicate_suspects(self) -> int:
        """Steps executed (not replayed) that the attempt before, cut short, may have been
        in the middle of: the first execution of a resumed attempt."""
        steps = self._made_steps()
        return steps.duplicate_suspects if steps is not None else 0

    def _made_steps(self) -> Steps | None:
        """The attempt's steps if it has used them (reading them makes none)."""
        made: Steps | None = self.__dict__.get("_steps")
        return made

    async def _run(self, call: calls.Call[T]) -> T:
        return await self._transport.run(call)

    # ---- steps ------------------------------------------------------------------------

    def idempotency_key(self, name: str, *, scope: str | None = None) -> str:
        """The key to hand a paid call's provider (an ``Idempotency-Key`` header) for step
        ``name`` (as recorded: ``'charge'``, ``'charge#2'``, or a row's step key): the same
        in every attempt of the run, so a call retried after a crash is deduplicated by the
        provider; different in every other run, org and play; shared by the runs of a named
        ``scope``, as the step's receipt is. In a step's body, :attr:`step_idempotency_key`
        is its own."""
        return self._steps.idempotency_key(name, scope)

    @property
    def step_idempotency_key(self) -> str:
        """The idempotency key of the step whose body is running (:meth:`idempotency_key`)."""
        if self._steps.current_step is None:
            raise RuntimeError(
                "step_idempotency_key is read inside a step's body (ctx.step); elsewhere "
                "use ctx.idempotency_key(name)"
            )
        return self.idempotency_key(self._steps.current_step, scope=self._steps.step_scope)

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        scope: str | None = None,
        limit: str | None = None,
        cost: float | Mapping[str, float] | None = None,
    ) -> Any:
        """Run ``fn(*args)`` at most once to completion per scope; replay its result.

        A coroutine function is awaited on the event loop; any other callable runs in a
        worker thread (so blocking code never stalls the loop or its heartbeats). With
        ``limit``, the body runs holding a permit of that shared limit (:meth:`limit`); a
        replayed step takes none. With ``cost`` (an estimate: credits, or ``{unit:
        amount}``), the estimate is reserved against the run's budgets before the body
        runs; a budget it does not fit in pauses the run (:mod:`queues.costs`). What the
        body says it cost (:meth:`charge`) is recorded with the step's receipt.
        """
        return await self._steps.step(
            name, fn, args, scope=scope, limit=limit, hold=self.limit, cost=cost
        )

    def charge(
        self,
        amount: float,
        unit: str = costs.DEFAULT_UNIT,
        *,
        provider: str | None = None,
        step: str | None = None,
        scope: str | None = None,
    ) -> None:
        """Say what a paid call cost: ``amount`` of ``unit`` from ``provider``. Inside a
        step's body (:meth:`step`), it is recorded with that step's receipt, by the same
        write: once, never again when the step replays, and not at all if the attempt turns
        out stale. For a row of a rows page, name the row's step key (``step=``): it is
        recorded with the page that completes that row (:meth:`complete_steps`). Elsewhere
        it raises ``ChargeOutsideStep``. A charge counts against every budget of the run in
        its unit."""
        self._steps.charge(costs.Charge.checked(amount, unit, provider), step=step, scope=scope)

    async def reserve_steps(
        self,
        keys: Sequence[str],
        *,
        cost: float | Mapping[str, float],
        scope: str | None = None,
    ) -> list[str]:
        """Reserve the estimate ``cost`` for each row step of ``keys`` (a page, before its
        paid calls) against the run's budgets: returns the keys that may run, in order (all,
        or as many as the budgets have room for). When none fits the run pauses (a budget
        is spent: it resumes when the budget is raised or its period rolls over) or waits
        for the reservations of other steps in flight."""
        return await self._steps.reserve_page(keys, cost, scope)

    async def skip(self, name: str, *, scope: str | None = None) -> bool:
        """Record that the play decided not to execute step ``name``: later attempts replay
        it as skipped (``step`` returns None). Returns False if it had already completed."""
        return await self._steps.skip(name, scope)

    async def steps_done(self, keys: Sequence[str], *, scope: str | None = None) -> dict[str, Any]:
        """Completed results of a page of row-step keys, in one round trip."""
        return await self._steps.done(keys, scope)

    async def complete_steps(
        self, results: Sequence[tuple[str, Any]], *, scope: str | None = None
    ) -> receipts.PageCompletion:
        """Record a page of row-step results in one round trip, fenced by the attempt."""
        return await self._steps.complete_page(results, scope)

    # ---- input and sheets -------------------------------------------------------------

    async def input_pages(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The rows given at submit, page by page (never the whole input at once)."""
        page = 0
        while True:
            rows: list[tuple[str, Any]] | None = await self._run(calls.InputPage(page))
            if rows is None:
                return
            yield [(str(key), value) for key, value in rows]
            page += 1

    def sheet(self, name: str) -> Sheet:
        """This attempt's handle on sheet ``name`` (one per sheet, so the attempt's write
        version is carried from page to page). Names are normalised as they are stored
        (:func:`queues.sheets.sheet_name`): ``"Leads"`` and ``"leads"`` are one sheet."""
        name = sheets.sheet_name(name, "name")
        if name not in self._sheets:
            self._sheets[name] = Sheet(self._run, self.run_id, name)
        return self._sheets[name]

    # ---- the ledger -------------------------------------------------------------------

    async def log_event(self, kind: str, data: dict[str, Any] | None = None) -> bool:
        """Append a ``play.<kind>`` event to the run's ledger (a keyed delivery with the
        run-ledger credential: a retried attempt that reaches the same call appends
        nothing twice). Returns whether this call appended it."""
        check_event_name(kind)
        key = receipts.step_key(f"$ledger:{kind}", self._steps.seen)
        delivered: calls.Delivered = await self._run(
            calls.AppendRunEvents(
                key=f"{self.info.run_id}:{key}",
                owner=self.info.worker_id,
                kinds_data=[(f"play.{kind}", data or {})],
            )
        )
        return bool(delivered.appended)

    # ---- time, sleep, events ----------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        """Suspend the run durably for ``seconds``; it leaves the worker meanwhile."""
        await self._waits.sleep(seconds)

    async def sleep_until(self, when: datetime) -> None:
        """Suspend the run durably until ``when`` (a timezone-aware datetime)."""
        await self._waits.sleep_until(when)

    async def wait_for_event(self, name: str, *, timeout: float | None = None) -> EventResult:
        """Wait durably for an event of this run's org; returns what happened.

        The latest emit of ``name`` in the run's org since the run was admitted wakes it
        (an emit racing the wait is never lost). With ``timeout`` (seconds, durable across
        attempts) a wait that sees no emit in time returns ``timed_out``. The outcome is
        recorded, so a later attempt replays the same result.
        """
        return await self._waits.wait_for_event(name, timeout=timeout)

    async def emit(self, name: str, payload: Any = None) -> int:
        """Emit an event of this run's org (fenced: a stale attempt's emit is refused).

        Recorded as a step, so a retried attempt does not emit again once it has; returns
        how many waiting runs it woke (0 on a replay).
        """
        return await self._waits.emit(name, payload)

    # ---- rate limits ------------------------------------------------------------------

    def limit(
        self, key: str, *, hand_back_after: float = HAND_BACK_AFTER_S
    ) -> AbstractAsyncContextManager[Permit]:
        """Hold one permit of the shared limit ``key`` (``worker limits set``) for the block
        (``async with ctx.limit("clearbit") as permit:``; ``permit.at`` is the database's
        time of the grant).

        Waiting for it never holds the lease hostage: the heartbeat goes on meanwhile, and
        once the wait would pass ``hand_back_after`` seconds in all, the run is handed back
        durably (it sleeps until the permit should be due, leaving its worker slot free,
        and re-enters the play then; completed steps replay). A permit under a concurrency
        cap is released when the block ends; one of a stopped attempt stops counting when
        its attempt does.
        """
        return self._waits.limit(key, hand_back_after=hand_back_after)

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
        """Admit a child run of ``play`` with ``params``, atomically with this step (named
        ``key``, default ``$spawn:<play>``, ordinal-suffixed like any step): a retry of
        this run replays the step and gets the same child; it never spawns a second. The
        child runs on this run's lane and release, in its org, with its own options (the
        lane's policy otherwise; ``budget``: its own budget, as ``Submission.budget``).
        Returns the child's run id."""
        return await self._waits.spawn(
            play,
            params,
            key=key,
            priority=priority,
            max_attempts=max_attempts,
            retry=retry,
            timeout=timeout,
            start_by=start_by,
            meta=meta,
            budget=budget,
        )

    async def wait_for_run(self, run_id: uuid.UUID | str, *, timeout: float | None = None) -> Any:
        """Wait durably for a child run (``ctx.spawn``'s id) to end: returns its result, or
        raises :class:`ChildFailed` (it failed or was cancelled). Meanwhile this run leaves
        the worker (it sleeps until the child's end wakes it). With ``timeout`` (seconds,
        durable across attempts) a child still running at the deadline raises
        :class:`WaitTimedOut`. The outcome is recorded: a later attempt replays it."""
        return await self._waits.wait_for_run(run_id, timeout=timeout)
