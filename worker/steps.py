"""The mechanics of a run's durable steps, behind ``ctx.step`` and its kin.

A step is decided (replayed, skipped or executed), its body run, and its receipt written,
each write carrying the attempt's fence. :class:`Steps` also keeps the attempt's ordinal
keys (``name#2``), the receipts that settled before the attempt started, the step running
now, and the count of executed steps a cut-short attempt before may already have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from queues import calls, fields, receipts, tracing
from queues.errors import OperationRefused
from queues.receipts import ClaimOutcome, StepRef
from worker import instruments

T = TypeVar("T")
Run = Callable[[calls.Call[Any]], Awaitable[Any]]  # a transport's run (typed call -> answer)
Hold = Callable[[str], AbstractAsyncContextManager[Any]]  # a limit's permit (ctx.limit)

BUSY_POLL_S = 0.5  # a step another run's live claim holds is asked for again after this


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

    async def complete(self, ref: StepRef, decided: Decision, value: Any) -> Any:
        """Record an executed step's result; returns it as stored (what a replay returns)."""
        if not decided.deferred:
            return await self._run(calls.ReceiptComplete(ref, value))
        recorded: receipts.Claim = await self._run(calls.ReceiptRecord(ref, value))
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
    ) -> Any:
        """``ctx.step``: decide the step, then run its body (holding ``limit``'s permit
        through ``hold`` when given) and record it, inside the step's span."""
        if limit is not None:
            fields.limit_key(limit, field="limit")
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
        """Run a claimed step's body and record its receipt (completed or failed)."""
        self.current_step, self.step_scope = ref.step_key, scope
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
                await self._run(calls.ReceiptFail(ref, error))
            raise
        finally:
            self.current_step = self.step_scope = None
        instruments.step_finished(self.info.play, "completed", time.perf_counter() - started)
        self._suspects(1)
        # The value as stored (tuples become lists): a replay returns the same thing.
        return await self.complete(ref, decided, value)

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
        page: receipts.PageCompletion = await self._run(
            calls.ReceiptsComplete(self.scope(scope), list(results))
        )
        self._suspects(len(page.completed))
        return page

    def _suspects(self, executed: int) -> None:
        """Count the first steps a resumed attempt executed as duplicate suspects: the
        attempt before was cut short, perhaps in their middle (an upper bound)."""
        if self._suspect and executed:
            self._suspect = False
            self.duplicate_suspects += executed
            instruments.duplicate_suspects(self.info.play, executed)
