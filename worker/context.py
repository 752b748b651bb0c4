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

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog

from queues import children, fields, receipts, runs, sheets, tracing
from queues.errors import InvalidField, OperationRefused
from queues.fence import Fence
from queues.options import RunOptions
from worker import instruments
from worker.contract import Transport
from worker.endings import Fatal

STEP_LEASE_S = receipts.STEP_LEASE_S
EVENT_NAME_MAX = 200

CleanupFn = Callable[["RunContext"], Awaitable[None]]  # a cancel hook (``ctx.on_cancel``)


class Suspend(BaseException):
    """Raised inside a play to leave the worker durably (sleep or event wait).

    A BaseException so that a play's ``except Exception`` cannot swallow it.
    """

    def __init__(self, wake_at: datetime | None, event: str | None = None) -> None:
        super().__init__(wake_at, event)
        self.wake_at = wake_at
        self.event = event


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

    def __init__(self, info: RunInfo, params: dict[str, Any], transport: Transport):
        self.info = info
        self.params = params
        self.fence = info.fence
        self._transport = transport
        self._seen: dict[str, int] = {}
        # The run scope's receipts that settled before this attempt (loaded at its first
        # step; None until then, or when too many to hold: then every step claims first).
        self._settled: dict[str, Any] | None = None
        self._settled_loaded = False
        self._cleanups: list[CleanupFn] = []
        self._sheets: dict[str, Sheet] = {}
        self._holds = 0  # permits of shared limits taken by this attempt (their names)
        self.cancel_requested = False
        self.current_step: str | None = None  # the step executing now (for lag reports)
        self._step_scope: str | None = None  # its scope's name, when not the run's
        self._log: Any = None
        # Steps executed (not replayed) that the attempt before may have been in the
        # middle of when it was cut short: the first execution of a resumed attempt.
        self.duplicate_suspects = 0
        self._suspect = info.resumed

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

    async def _call(self, action: str, payload: dict[str, Any], **kw: Any) -> Any:
        return await self._transport.call(action, payload, **kw)

    # ---- steps ------------------------------------------------------------------------

    def idempotency_key(self, name: str, *, scope: str | None = None) -> str:
        """The key to hand a paid call's provider (an ``Idempotency-Key`` header) for step
        ``name`` (as recorded: ``'charge'``, ``'charge#2'``, or a row's step key): the same
        in every attempt of the run, so a call retried after a crash is deduplicated by the
        provider; different in every other run, org and play; shared by the runs of a named
        ``scope``, as the step's receipt is. In a step's body, :attr:`step_idempotency_key`
        is its own."""
        where = (
            receipts.Scope.of_run(self.info.run_id)
            if scope is None
            else receipts.Scope.named(scope)
        )
        return receipts.idempotency_key(self.info.org, self.info.play, where, name)

    @property
    def step_idempotency_key(self) -> str:
        """The idempotency key of the step whose body is running (:meth:`idempotency_key`)."""
        if self.current_step is None:
            raise RuntimeError(
                "step_idempotency_key is read inside a step's body (ctx.step); elsewhere "
                "use ctx.idempotency_key(name)"
            )
        return self.idempotency_key(self.current_step, scope=self._step_scope)

    def _ref(self, name: str, scope: str | None) -> dict[str, Any]:
        """The receipt reference of the next step called ``name`` (ordinal suffixed)."""
        ref: dict[str, Any] = {"stepKey": receipts.step_key(name, self._seen)}
        if scope is not None:
            receipts.Scope.named(scope)  # refused here, before anything is sent
            ref["scope"] = scope
        return ref

    async def _claim(self, ref: dict[str, Any]) -> dict[str, Any]:
        """Claim a step's receipt; wait while another run's live claim holds it."""
        while True:
            claim: dict[str, Any] = await self._call("runtime_receipt_claim", dict(ref))
            if claim["outcome"] != receipts.ClaimOutcome.BUSY:
                return claim
            await asyncio.sleep(0.5)  # another live attempt holds the step's lease

    async def _begin(self, ref: dict[str, Any]) -> dict[str, Any]:
        """Decide a step: replay it, skip it, or execute it (``deferred``: not yet claimed).

        A step in the run's own scope is not claimed before it runs. Its claim would keep
        out only other attempts of this run, and the run's lease already does: a newer
        attempt exists only after the durable run claim moved the lease, and every write of
        an older one is then refused by the fence (a claim would not stop it running either:
        a newer attempt takes over its run's earlier claims). What the claim also told, that
        the step settled earlier, the attempt learns once, at its first step, from the
        receipts settled before it started; no other attempt can settle one after that.
        The step then costs one round trip and one durable commit (``runtime_receipt_record``,
        claim-and-complete in one fenced statement) instead of two. A named scope keeps its
        claim: there it keeps other runs out, until the step settles or the lease lapses.
        """
        if "scope" not in ref:
            if not self._settled_loaded:
                self._settled_loaded = True
                with contextlib.suppress(OperationRefused):  # an older gateway: claim each
                    got = await self._call("runtime_receipts_settled", {})
                    self._settled = got["receipts"] if got["complete"] else None
            if self._settled is not None:
                known = self._settled.get(ref["stepKey"])
                if known is None:
                    return {"outcome": receipts.ClaimOutcome.EXECUTE, "deferred": True}
                outcome = (
                    receipts.ClaimOutcome.REPLAY
                    if known["status"] == receipts.ReceiptStatus.COMPLETED
                    else receipts.ClaimOutcome.SKIPPED
                )
                return {"outcome": outcome, "result": known["result"]}
        return await self._claim(ref)

    async def _complete(self, ref: dict[str, Any], claim: dict[str, Any], value: Any) -> Any:
        """Record an executed step's result; returns it as stored (what a replay returns)."""
        if not claim.get("deferred"):
            done = await self._call("runtime_receipt_complete", {**ref, "result": value})
            return done["result"]
        recorded = await self._call("runtime_receipt_record", {**ref, "result": value})
        if recorded["outcome"] == receipts.ClaimOutcome.BUSY:
            # Only another run's live claim is busy, and none is ever in this run's scope.
            raise RuntimeError(f"step {ref['stepKey']!r} of the run's own scope is held")
        return recorded["result"]

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        scope: str | None = None,
        limit: str | None = None,
    ) -> Any:
        """Run ``fn(*args)`` at most once to completion per scope; replay its result.

        A coroutine function is awaited on the event loop; any other callable runs in a
        worker thread (so blocking code never stalls the loop or its heartbeats). With
        ``limit``, the body runs holding a permit of that shared limit (:meth:`limit`); a
        replayed step takes none.
        """
        if limit is not None:
            fields.limit_key(limit, field="limit")
        ref = self._ref(name, scope)
        info = self.info
        attributes = tracing.run_attributes(
            run_id=info.run_id, attempt=info.attempt, play=info.play, lane=info.lane
        ) | {"wq.step": ref["stepKey"]}
        # A child of the attempt's span: one trace from the submit through every step.
        with tracing.span("wq.step", attributes=attributes) as span:
            claim = await self._begin(ref)
            tracing.annotate(span, step_outcome=str(claim["outcome"]))
            if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
                return claim["result"]
            if claim["outcome"] == receipts.ClaimOutcome.SKIPPED:
                return None
            if limit is None:
                return await self._execute(ref, claim, fn, args)
            async with self.limit(limit):
                return await self._execute(ref, claim, fn, args)

    async def _execute(
        self, ref: dict[str, Any], claim: dict[str, Any], fn: Callable[..., Any], args: Any
    ) -> Any:
        """Run a claimed step's body and record its receipt (completed or failed)."""
        self.current_step, self._step_scope = ref["stepKey"], ref.get("scope")
        started = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args)
            else:
                value = await asyncio.to_thread(fn, *args)
                if inspect.isawaitable(value):
                    value = await value
        except Exception as exc:
            instruments.step_finished(self.info.play, "failed", time.perf_counter() - started)
            error = {"type": type(exc).__name__, "message": str(exc)}
            if claim.get("deferred"):
                # A failure is recorded against a claim: take it now (ours, under the lease).
                claim = await self._claim(ref)
            if claim["outcome"] == receipts.ClaimOutcome.EXECUTE:
                await self._call("runtime_receipt_fail", {**ref, "error": error})
            raise
        finally:
            self.current_step = self._step_scope = None
        instruments.step_finished(self.info.play, "completed", time.perf_counter() - started)
        self._suspects(1)
        # The value as stored (tuples become lists): a replay returns the same thing.
        return await self._complete(ref, claim, value)

    async def _checkpoint(self, name: str, value: Callable[[], Any]) -> Any:
        """A step of the runtime's own whose value is cheap to compute (no thread)."""
        ref = self._ref(name, None)
        claim = await self._begin(ref)
        if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
            return claim["result"]
        return await self._complete(ref, claim, value())

    async def skip(self, name: str, *, scope: str | None = None) -> bool:
        """Record that the play decided not to execute step ``name``: later attempts replay
        it as skipped (``step`` returns None). Returns False if it had already completed."""
        ref = self._ref(name, scope)
        claim = await self._claim(ref)
        if claim["outcome"] != receipts.ClaimOutcome.EXECUTE:
            return bool(claim["outcome"] == receipts.ClaimOutcome.SKIPPED)
        await self._call("runtime_receipt_skip", ref)
        return True

    async def steps_done(self, keys: Sequence[str], *, scope: str | None = None) -> dict[str, Any]:
        """Completed results of a page of row-step keys, in one round trip."""
        payload: dict[str, Any] = {"keys": list(keys)}
        if scope is not None:
            payload["scope"] = scope
        found: dict[str, Any] = (await self._call("runtime_receipts_lookup", payload))["results"]
        return found

    async def complete_steps(
        self, results: Sequence[tuple[str, Any]], *, scope: str | None = None
    ) -> receipts.PageCompletion:
        """Record a page of row-step results in one round trip, fenced by the attempt."""
        payload: dict[str, Any] = {"results": [[key, value] for key, value in results]}
        if scope is not None:
            payload["scope"] = scope
        page = await self._call("runtime_receipts_complete", payload)
        self._suspects(len(page["completed"]))
        return receipts.PageCompletion(
            completed=page["completed"], already=page["already"], busy=page["busy"]
        )

    def _suspects(self, executed: int) -> None:
        """Count the first steps a resumed attempt executed as duplicate suspects: the
        attempt before was cut short, perhaps in their middle (an upper bound)."""
        if self._suspect and executed:
            self._suspect = False
            self.duplicate_suspects += executed
            instruments.duplicate_suspects(self.info.play, executed)

    # ---- input and sheets -------------------------------------------------------------

    async def input_pages(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """The rows given at submit, page by page (never the whole input at once)."""
        page = 0
        while True:
            rows = (await self._call("runtime_input_page", {"page": page}))["rows"]
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
            self._sheets[name] = Sheet(self, name)
        return self._sheets[name]

    # ---- the ledger -------------------------------------------------------------------

    async def log_event(self, kind: str, data: dict[str, Any] | None = None) -> bool:
        """Append a ``play.<kind>`` event to the run's ledger (a keyed delivery with the
        run-ledger credential: a retried attempt that reaches the same call appends
        nothing twice). Returns whether this call appended it."""
        _check_event_name(kind)
        key = receipts.step_key(f"$ledger:{kind}", self._seen)
        answer = await self._call(
            "append_run_events",
            {"events": [{"kind": f"play.{kind}", "data": data or {}}]},
            idempotency_key=f"{self.info.run_id}:{key}",
        )
        return bool(answer["appended"])

    # ---- time, sleep, events ----------------------------------------------------------

    async def _now(self) -> datetime:
        return datetime.fromisoformat((await self._call("runtime_now", {}))["now"])

    async def sleep(self, seconds: float) -> None:
        """Suspend the run durably for ``seconds``; it leaves the worker meanwhile."""
        _check_seconds(seconds, "seconds")
        now = await self._now()
        await self._sleep_until_recorded((now + timedelta(seconds=seconds)).isoformat)

    async def sleep_until(self, when: datetime) -> None:
        """Suspend the run durably until ``when`` (a timezone-aware datetime)."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise InvalidField(
                f"sleep_until needs a timezone-aware datetime, got {when!r:.80}",
                field="when",
                rule="a datetime with a tzinfo",
                fix="pass e.g. datetime(2027, 1, 1, tzinfo=UTC)",
            )
        await self._sleep_until_recorded(when.isoformat)

    async def _sleep_until_recorded(self, wake: Callable[[], str]) -> None:
        wake_at = datetime.fromisoformat(await self._checkpoint("$sleep", wake))
        if await self._now() >= wake_at:
            return
        raise Suspend(wake_at)

    async def wait_for_event(self, name: str, *, timeout: float | None = None) -> EventResult:
        """Wait durably for an event of this run's org; returns what happened.

        The latest emit of ``name`` in the run's org since the run was admitted wakes it
        (an emit racing the wait is never lost). With ``timeout`` (seconds, durable across
        attempts) a wait that sees no emit in time returns ``timed_out``. The outcome is
        recorded, so a later attempt replays the same result.
        """
        _check_event_name(name)
        if timeout is not None:
            _check_seconds(timeout, "timeout")
        now = await self._now()
        deadline_iso = await self._checkpoint(
            f"$event-deadline:{name}",
            lambda: None if timeout is None else (now + timedelta(seconds=timeout)).isoformat(),
        )
        deadline = datetime.fromisoformat(deadline_iso) if deadline_iso else None
        ref = self._ref(f"$event:{name}", None)
        claim = await self._claim(ref)
        if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
            return _event_result(name, claim["result"])
        got = await self._call("runtime_event_get", {"name": name})
        if got["found"]:
            outcome: dict[str, Any] | None = {"received": True, "payload": got["payload"]}
        elif deadline is not None and await self._now() >= deadline:
            outcome = {"received": False}
        else:
            outcome = None
        if outcome is not None:
            done = await self._call("runtime_receipt_complete", {**ref, "result": outcome})
            return _event_result(name, done["result"])
        raise Suspend(deadline, event=name)

    async def emit(self, name: str, payload: Any = None) -> int:
        """Emit an event of this run's org (fenced: a stale attempt's emit is refused).

        Recorded as a step, so a retried attempt does not emit again once it has; returns
        how many waiting runs it woke (0 on a replay).
        """
        _check_event_name(name)
        ref = self._ref(f"$emit:{name}", None)
        claim = await self._claim(ref)
        if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
            return 0
        emitted = await self._call("runtime_event_emit", {"name": name, "payload": payload})
        await self._call("runtime_receipt_complete", {**ref, "result": emitted})
        return int(emitted["woken"])

    # ---- rate limits ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def limit(
        self, key: str, *, hand_back_after: float = HAND_BACK_AFTER_S
    ) -> AsyncIterator[Permit]:
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
        fields.limit_key(key, field="key")
        _check_seconds(hand_back_after, "hand_back_after")
        self._holds += 1
        hold = f"{self.attempt}:{self._holds}:{key}"
        waited = 0.0
        backoff = LIMIT_BUSY_POLL_S
        while True:
            permit: dict[str, Any] = await self._call(
                "runtime_limit_acquire", {"key": key, "hold": hold}
            )
            if permit["granted"]:
                break
            if permit["waitSeconds"] is not None:
                wait = float(permit["waitSeconds"])
            else:  # at its concurrency cap: ask again, backing off
                wait, backoff = backoff, min(backoff * 2, LIMIT_BUSY_MAX_S)
            if waited + wait > hand_back_after:
                now = await self._now()
                self.log.info("limit_wait_handed_back", key=key, waited_s=round(waited, 3))
                raise Suspend(now + timedelta(seconds=max(wait, LIMIT_BUSY_MAX_S)))
            await asyncio.sleep(wait)
            waited += wait
        try:
            yield Permit(key=key, at=datetime.fromisoformat(permit["at"]), waited_s=waited)
        finally:
            if permit["held"]:
                # A stale attempt's release is refused (and its permit stopped counting).
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._call("runtime_limit_release", {"hold": hold}))

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
    ) -> uuid.UUID:
        """Admit a child run of ``play`` with ``params``, atomically with this step (named
        ``key``, default ``$spawn:<play>``, ordinal-suffixed like any step): a retry of
        this run replays the step and gets the same child; it never spawns a second. The
        child runs on this run's lane and release, in its org, with its own options (the
        lane's policy otherwise). Returns the child's run id."""
        fields.play_name(play)
        fields.priority(priority)
        options = RunOptions.checked(
            max_attempts=max_attempts, retry=retry, timeout=timeout, start_by=start_by, meta=meta
        )
        wire: dict[str, Any] = {
            k: v
            for k, v in {
                "max_attempts": options.max_attempts,
                "retry": str(options.retry) if options.retry else None,
                "timeout": options.timeout_s,
                "start_by": options.start_by.isoformat() if options.start_by else None,
                "meta": options.meta,
            }.items()
            if v is not None
        }
        ref = self._ref(key or f"$spawn:{play}", None)
        got = await self._call(
            "runtime_run_spawn",
            {
                "stepKey": ref["stepKey"],
                "play": play,
                "params": dict(params or {}),
                "options": wire,
                "priority": priority,
            },
        )
        return uuid.UUID(got["runId"])

    async def wait_for_run(self, run_id: uuid.UUID | str, *, timeout: float | None = None) -> Any:
        """Wait durably for a child run (``ctx.spawn``'s id) to end: returns its result, or
        raises :class:`ChildFailed` (it failed or was cancelled). Meanwhile this run leaves
        the worker (it sleeps until the child's end wakes it). With ``timeout`` (seconds,
        durable across attempts) a child still running at the deadline raises
        :class:`WaitTimedOut`. The outcome is recorded: a later attempt replays it."""
        rid = uuid.UUID(str(run_id))
        if timeout is not None:
            _check_seconds(timeout, "timeout")
        now = await self._now()
        deadline_iso = await self._checkpoint(
            f"$run-deadline:{rid}",
            lambda: None if timeout is None else (now + timedelta(seconds=timeout)).isoformat(),
        )
        deadline = datetime.fromisoformat(deadline_iso) if deadline_iso else None
        ref = self._ref(f"$run:{rid}", None)
        claim = await self._claim(ref)
        if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
            return _child_outcome(rid, claim["result"])
        child = await self._call("runtime_run_get", {"childId": str(rid)})
        if child["terminal"]:
            outcome: dict[str, Any] = {
                "state": child["state"],
                "result": child["result"],
                "error": child["error"],
            }
        elif deadline is not None and await self._now() >= deadline:
            outcome = {"state": None, "timed_out": True}
        else:
            raise Suspend(deadline, event=children.ended_event(rid))
        done = await self._call("runtime_receipt_complete", {**ref, "result": outcome})
        return _child_outcome(rid, done["result"])


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


def _check_event_name(name: object) -> None:
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


class Sheet:
    """A play's handle on one sheet: admit pages under a write version, complete rows.

    The stable write intent is opt-in, as in the reference runtime: with
    ``stable_intent=True`` every page, attempt and wake of the run reuses the run's durable
    write intent (``runtime_sheet_start_with_intent``). Without it an admission is legacy
    (``runtime_sheet_start``): it mints a version on the attempt's first page and reuses it
    for the attempt's later pages, so an attempt never supersedes its own earlier pages.
    """

    def __init__(self, ctx: RunContext, name: str) -> None:
        self.ctx = ctx
        self.name = name
        self.write_version: int | None = None

    async def admit(
        self,
        rows: Sequence[tuple[str, Any]],
        *,
        stable_intent: bool = False,
        pending_rerun_admission: bool = True,
    ) -> sheets.AdmitResult:
        """Admit a page of ``(key, input)`` rows. ``stable_intent`` opts in to the run's
        durable write intent; ``pending_rerun_admission=False`` leaves rows pending under
        an older admission to it (``left_pending``) instead of re-admitting them.

        The opt-in travels as the action's name and a rerun admission is the receiver's
        default, so neither flag is sent unless it changes something: a receiver of the
        previous release, which refuses fields it does not define, serves these pages."""
        action = "runtime_sheet_start_with_intent" if stable_intent else "runtime_sheet_start"
        payload: dict[str, Any] = {
            "tableNamespace": self.name,
            "rows": [{"key": key, "input": value} for key, value in rows],
        }
        if self.write_version is not None:
            payload["writeVersion"] = self.write_version
        if not pending_rerun_admission:
            payload["pendingRerunAdmission"] = False
        result = sheets.AdmitResult.from_wire(await self.ctx._call(action, payload))
        self.write_version = result.write_version
        return result

    async def complete(
        self, completions: Sequence[sheets.RowCompletion], *, raise_on_superseded: bool = False
    ) -> sheets.CompletionResult:
        """Complete a page of rows. Stale rows are reported, not raised, unless the writer
        asks (``raise_on_superseded=True`` or ``result.raise_if_superseded(...)``); the
        receiver's stop signal (``supersededKeys``: the attempt fence refused the page)
        always raises ``SheetSuperseded``, the attempt must stop."""
        payload: dict[str, Any] = {
            "tableNamespace": self.name,
            "rows": [
                {"key": c.key, "output": c.output, "status": str(c.status)} for c in completions
            ],
        }
        if self.write_version is not None:
            payload["writeVersion"] = self.write_version
        result = sheets.CompletionResult.from_wire(
            await self.ctx._call("runtime_sheet_complete_map_rows", payload)
        )
        result.raise_if_stopped(sheet=self.name, run_id=self.ctx.run_id)
        if raise_on_superseded:
            result.raise_if_superseded(sheet=self.name, run_id=self.ctx.run_id)
        return result
