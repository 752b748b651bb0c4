"""The mechanics of a run's durable steps, behind ``ctx.step`` and its kin.

A step is decided (replayed, skipped or executed), its estimate reserved against the run's
budgets, its body run, and its receipt written with what it cost, each write carrying the
attempt's fence. :class:`Steps` also keeps the attempt's ordinal keys (``name#2``), the
receipts that settled before the attempt started, the step running now, the charges of row
steps waiting for their page, and the count of executed steps a cut-short attempt before
may already have run.

Budgets (:mod:`queues.costs`): a step that declares an estimate (``cost=``) reserves it
before its body runs; one that declares none reserves nothing until a step of the attempt
recorded charges, and from then on reserves 0 before each (refused once a budget is
spent). An attempt that learns no budget applies to its run reserves nothing more. A
reservation refused because a budget is spent pauses the run (:class:`Suspend` on the
budget's wait event); one refused only by other steps' reservations in flight waits for
them in the worker, and hands the run back past :data:`BUDGET_WAIT_MAX_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import structlog

from queues import calls, costs, fields, receipts, tracing
from queues.errors import ChargeOutsideStep, OperationRefused
from queues.receipts import ClaimOutcome, StepRef
from worker import instruments
from worker.endings import Suspend

log = structlog.get_logger("worker.steps")

T = TypeVar("T")
Run = Callable[[calls.Call[Any]], Awaitable[Any]]  # a transport's run (typed call -> answer)
Hold = Callable[[str], AbstractAsyncContextManager[Any]]  # a limit's permit (ctx.limit)

BUSY_POLL_S = 0.5  # a step another run's live claim holds is asked for again after this
# A reservation refused only by other steps' reservations in flight is asked again after
# this, doubling up to the max; past BUDGET_WAIT_MAX_S in all the run is handed back.
BUDGET_POLL_S = 0.05
BUDGET_POLL_MAX_S = 1.0
BUDGET_WAIT_MAX_S = 30.0

# The charges of the step whose body runs in this context (ctx.charge's target): set by
# the step around its body, copied into the thread a synchronous body runs in.
_STEP_CHARGES: contextvars.ContextVar[list[costs.Charge] | None] = contextvars.ContextVar(
    "wq_step_charges", default=None
)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with a step: its claim, and whether it was decided without one (a step of
    the run's own scope that settled nowhere yet: executed, then recorded in one call)."""

    claim: receipts.Claim
    deferred: bool = False


class Steps:
    """One attempt's steps: decide each, run its body, record its receipt."""

    def __init__(self, info: Any, run: Run) -> None:
        self.info = info
        self._run = run
        self.seen: dict[str, int] = {}
        # The run scope's receipts that settled before this attempt (loaded at its first
        # step; None until then, or when too many to hold: then every step claims first).
        self._settled: dict[str, tuple[receipts.ReceiptStatus, Any]] | None = None
        self._settled_loaded = False
        self.current_step: str | None = None  # the step executing now (for lag reports)
        self.step_scope: str | None = None  # its scope's name, when not the run's
        # Steps executed (not replayed) that the attempt before may have been in the
        # middle of when it was cut short: the first execution of a resumed attempt.
        self.duplicate_suspects = 0
        self._suspect = bool(info.resumed)
        # Charges of row steps (ctx.charge(..., step=key)), by (scope, step key), until the
        # page that completes the row carries them.
        self.row_charges: dict[tuple[str, str], list[costs.Charge]] = {}
        self._charged = False  # a step of this attempt recorded charges: check budgets
        self._unbudgeted = False  # no budget applies to the run: reserve nothing more

    def idempotency_key(self, name: str, scope: str | None) -> str:
        where = (
            receipts.Scope.of_run(self.info.run_id)
            if scope is None
            else receipts.Scope.named(scope)
        )
        return receipts.idempotency_key(self.info.org, self.info.play, where, name)

    def scope(self, scope: str | None) -> receipts.Scope:
        """A step's scope: the run's own, or a named one (refused here, before anything is
        sent, when its name is not one)."""
        if scope is None:
            return receipts.Scope.of_run(self.info.run_id)
        return receipts.Scope.named(scope)

    def ref(self, name: str, scope: str | None) -> StepRef:
        """The receipt reference of the next step called ``name`` (ordinal suffixed)."""
        key = receipts.step_key(name, self.seen)
        info = self.info
        return StepRef(info.org, info.play, self.scope(scope), key, info.fence)

    async def claim(self, ref: StepRef) -> receipts.Claim:
        """Claim a step's receipt; wait while another run's live claim holds it."""
        while True:
            claim: receipts.Claim = await self._run(calls.ReceiptClaim(ref))
            if claim.outcome != ClaimOutcome.BUSY:
                return claim
            await asyncio.sleep(BUSY_POLL_S)  # another live attempt holds the step's lease

    async def begin(self, ref: StepRef) -> Decision:
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
        if ref.scope == receipts.Scope.of_run(self.info.run_id):
            if not self._settled_loaded:
                self._settled_loaded = True
                with contextlib.suppress(OperationRefused):  # an older gateway: claim each
                    got: receipts.Settled = await self._run(calls.ReceiptsSettled(ref.scope))
                    self._settled = got.receipts if got.complete else None
            if self._settled is not None:
                known = self._settled.get(ref.step_key)
                if known is None:
                    return Decision(receipts.Claim(ClaimOutcome.EXECUTE, ref.step_key), True)
                status, result = known
                outcome = (
                    ClaimOutcome.REPLAY
                    if status == receipts.ReceiptStatus.COMPLETED
                    else ClaimOutcome.SKIPPED
                )
                return Decision(receipts.Claim(outcome, ref.step_key, result=result))
        return Decision(await self.claim(ref))

    async def complete(
        self, ref: StepRef, decided: Decision, value: Any, charges: Sequence[costs.Charge] = ()
    ) -> Any:
        """Record an executed step's result with its charges; returns the result as stored
        (what a replay returns)."""
        self._charged = self._charged or bool(charges)
        if not decided.deferred:
            return await self._run(calls.ReceiptComplete(ref, value, tuple(charges)))
        recorded: receipts.Claim = await self._run(calls.ReceiptRecord(ref, value, tuple(charges)))
        if recorded.outcome == ClaimOutcome.BUSY:
            # Only another run's live claim is busy, and none is ever in this run's scope.
            raise RuntimeError(f"step {ref.step_key!r} of the run's own scope is held")
        return recorded.result

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        *,
        scope: str | None,
        limit: str | None,
        hold: Hold,
        cost: object = None,
    ) -> Any:
        """``ctx.step``: decide the step, reserve its estimate (``cost``), then run its body
        (holding ``limit``'s permit through ``hold`` when given) and record it with its
        charges, inside the step's span."""
        if limit is not None:
            fields.limit_key(limit, field="limit")
        estimate = None if cost is None else costs.estimate_of(cost)
        ref = self.ref(name, scope)
        info = self.info
        attributes = tracing.run_attributes(
            run_id=info.run_id, attempt=info.attempt, play=info.play, lane=info.lane
        ) | {"wq.step": ref.step_key}
        # A child of the attempt's span: one trace from the submit through every step.
        with tracing.span("wq.step", attributes=attributes) as span:
            decided = await self.begin(ref)
            outcome = decided.claim.outcome
            tracing.annotate(span, step_outcome=str(outcome))
            if outcome == ClaimOutcome.REPLAY:
                return decided.claim.result
            if outcome == ClaimOutcome.SKIPPED:
                return None
            if estimate is not None or self._charged:
                await self.reserve(ref.scope, [ref.step_key], estimate or {})
            if limit is None:
                return await self._execute(ref, scope, decided, fn, args)
            async with hold(limit):
                return await self._execute(ref, scope, decided, fn, args)

    async def _execute(
        self,
        ref: StepRef,
        scope: str | None,
        decided: Decision,
        fn: Callable[..., Any],
        args: Any,
    ) -> Any:
        """Run a claimed step's body and record its receipt (completed or failed) with what
        the body charged (``ctx.charge``)."""
        self.current_step, self.step_scope = ref.step_key, scope
        charged: list[costs.Charge] = []
        token = _STEP_CHARGES.set(charged)
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
            claim = decided.claim
            if decided.deferred:
                # A failure is recorded against a claim: take it now (ours, under the lease).
                claim = await self.claim(ref)
            if claim.outcome == ClaimOutcome.EXECUTE:
                # A failed call may have been billed: its charges go with the failure.
                self._charged = self._charged or bool(charged)
                await self._run(calls.ReceiptFail(ref, error, tuple(charged)))
            raise
        finally:
            _STEP_CHARGES.reset(token)
            self.current_step = self.step_scope = None
        instruments.step_finished(self.info.play, "completed", time.perf_counter() - started)
        self._suspects(1)
        # The value as stored (tuples become lists): a replay returns the same thing.
        return await self.complete(ref, decided, value, charged)

    async def checkpoint(self, name: str, value: Callable[[], Any]) -> Any:
        """A step of the runtime's own whose value is cheap to compute (no thread)."""
        ref = self.ref(name, None)
        decided = await self.begin(ref)
        if decided.claim.outcome == ClaimOutcome.REPLAY:
            return decided.claim.result
        return await self.complete(ref, decided, value())

    async def skip(self, name: str, scope: str | None) -> bool:
        ref = self.ref(name, scope)
        claim = await self.claim(ref)
        if claim.outcome != ClaimOutcome.EXECUTE:
            return bool(claim.outcome == ClaimOutcome.SKIPPED)
        await self._run(calls.ReceiptSkip(ref))
        return True

    async def done(self, keys: Sequence[str], scope: str | None) -> dict[str, Any]:
        found: dict[str, Any] = await self._run(calls.ReceiptsLookup(self.scope(scope), list(keys)))
        return found

    async def complete_page(
        self, results: Sequence[tuple[str, Any]], scope: str | None
    ) -> receipts.PageCompletion:
        """Record a page of row steps with the charges their rows made (``ctx.charge(...,
        step=key)``); a row's charges are recorded only if this page completes its row."""
        where = self.scope(scope)
        charges = {
            key: found
            for key, _ in results
            if (found := self.row_charges.pop((where.key, key), None)) is not None
        }
        self._charged = self._charged or bool(charges)
        page: receipts.PageCompletion = await self._run(
            calls.ReceiptsComplete(where, list(results), charges)
        )
        self._suspects(len(page.completed))
        return page

    # ---- costs -------------------------------------------------------------------------

    def charge(self, charge: costs.Charge, *, step: str | None, scope: str | None) -> None:
        """``ctx.charge``: add to the running step's charges, or to those of row step
        ``step`` (recorded with the page that completes its row)."""
        if step is None:
            running = _STEP_CHARGES.get()
            if running is None:
                raise ChargeOutsideStep(
                    f"ctx.charge({costs.number(charge.amount)}, unit={charge.unit!r}) was "
                    "called outside a step: no receipt would record it",
                    field="step",
                    rule="a charge is recorded with a step's receipt: call it inside the body "
                    "of ctx.step, or name the row step whose page will record it",
                    fix="move the paid call into ctx.step(...), or pass "
                    "ctx.charge(..., step=row_step_key) before ctx.complete_steps",
                )
            running.append(charge)
            return
        key = fields.text(step, field="step", max_len=receipts.MAX_KEY, what="step key")
        self.row_charges.setdefault((self.scope(scope).key, key), []).append(charge)

    async def reserve_page(self, keys: Sequence[str], cost: object, scope: str | None) -> list[str]:
        """``ctx.reserve_steps``: reserve ``cost`` for each row step, as many as fit in
        order; the keys that may run (a prefix). None fit: the run waits or pauses."""
        estimate = costs.estimate_of(cost)
        keys = list(keys)
        if not keys:
            return []
        granted = await self.reserve(self.scope(scope), keys, estimate)
        return keys[:granted]

    async def reserve(
        self, scope: receipts.Scope, keys: list[str], estimate: costs.Estimate
    ) -> int:
        """Reserve ``estimate`` for each key against the run's budgets; how many of the keys
        (in order) may run, at least one. None fitting: wait for the reservations in flight,
        hand the run back past :data:`BUDGET_WAIT_MAX_S`, or pause it when a budget is spent
        (each raises :class:`Suspend`)."""
        if self._unbudgeted:
            return len(keys)
        waited, delay = 0.0, BUDGET_POLL_S
        while True:
            got: costs.Reservation = await self._run(calls.BudgetReserve(scope, keys, estimate))
            if got.budgets == 0:
                self._unbudgeted = True  # no budget applies: this attempt checks no more
            if got.granted > 0:
                return got.granted
            if got.exhausted:
                log.info(
                    "budget_exhausted",
                    step=keys[0],
                    budget_id=got.budget_id,
                    wake_at=got.wake_at.isoformat() if got.wake_at else None,
                )
                raise Suspend(got.wake_at, event=costs.wait_event(got.epoch))
            if waited + delay > BUDGET_WAIT_MAX_S:
                now: datetime = await self._run(calls.Now())
                log.info("budget_wait_handed_back", step=keys[0], waited_s=round(waited, 3))
                raise Suspend(now + timedelta(seconds=BUDGET_POLL_MAX_S))
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, BUDGET_POLL_MAX_S)

    def _suspects(self, executed: int) -> None:
        """Count the first steps a resumed attempt executed as duplicate suspects: the
        attempt before was cut short, perhaps in their middle (an upper bound)."""
        if self._suspect and executed:
            self._suspect = False
            self.duplicate_suspects += executed
            instruments.duplicate_suspects(self.info.play, executed)
