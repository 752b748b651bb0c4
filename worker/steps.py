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
from typing import Any

from queues import fields, receipts, tracing
from queues.errors import OperationRefused
from worker import instruments

Call = Callable[..., Awaitable[Any]]  # a transport's call: (action, payload, **kw) -> answer
Hold = Callable[[str], AbstractAsyncContextManager[Any]]  # a limit's permit (ctx.limit)

BUSY_POLL_S = 0.5  # a step another run's live claim holds is asked for again after this


class Steps:
    """One attempt's steps: decide each, run its body, record its receipt."""

    def __init__(self, info: Any, call: Call) -> None:
        self.info = info
        self._call = call
        self.seen: dict[str, int] = {}
        # The run scope's receipts that settled before this attempt (loaded at its first
        # step; None until then, or when too many to hold: then every step claims first).
        self._settled: dict[str, Any] | None = None
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

    def ref(self, name: str, scope: str | None) -> dict[str, Any]:
        """The receipt reference of the next step called ``name`` (ordinal suffixed)."""
        ref: dict[str, Any] = {"stepKey": receipts.step_key(name, self.seen)}
        if scope is not None:
            receipts.Scope.named(scope)  # refused here, before anything is sent
            ref["scope"] = scope
        return ref

    async def claim(self, ref: dict[str, Any]) -> dict[str, Any]:
        """Claim a step's receipt; wait while another run's live claim holds it."""
        while True:
            claim: dict[str, Any] = await self._call("runtime_receipt_claim", dict(ref))
            if claim["outcome"] != receipts.ClaimOutcome.BUSY:
                return claim
            await asyncio.sleep(BUSY_POLL_S)  # another live attempt holds the step's lease

    async def begin(self, ref: dict[str, Any]) -> dict[str, Any]:
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
        return await self.claim(ref)

    async def complete(self, ref: dict[str, Any], claim: dict[str, Any], value: Any) -> Any:
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
        ) | {"wq.step": ref["stepKey"]}
        # A child of the attempt's span: one trace from the submit through every step.
        with tracing.span("wq.step", attributes=attributes) as span:
            claim = await self.begin(ref)
            tracing.annotate(span, step_outcome=str(claim["outcome"]))
            if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
                return claim["result"]
            if claim["outcome"] == receipts.ClaimOutcome.SKIPPED:
                return None
            if limit is None:
                return await self._execute(ref, claim, fn, args)
            async with hold(limit):
                return await self._execute(ref, claim, fn, args)

    async def _execute(
        self, ref: dict[str, Any], claim: dict[str, Any], fn: Callable[..., Any], args: Any
    ) -> Any:
        """Run a claimed step's body and record its receipt (completed or failed)."""
        self.current_step, self.step_scope = ref["stepKey"], ref.get("scope")
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
                claim = await self.claim(ref)
            if claim["outcome"] == receipts.ClaimOutcome.EXECUTE:
                await self._call("runtime_receipt_fail", {**ref, "error": error})
            raise
        finally:
            self.current_step = self.step_scope = None
        instruments.step_finished(self.info.play, "completed", time.perf_counter() - started)
        self._suspects(1)
        # The value as stored (tuples become lists): a replay returns the same thing.
        return await self.complete(ref, claim, value)

    async def checkpoint(self, name: str, value: Callable[[], Any]) -> Any:
        """A step of the runtime's own whose value is cheap to compute (no thread)."""
        ref = self.ref(name, None)
        claim = await self.begin(ref)
        if claim["outcome"] == receipts.ClaimOutcome.REPLAY:
            return claim["result"]
        return await self.complete(ref, claim, value())

    async def skip(self, name: str, scope: str | None) -> bool:
        ref = self.ref(name, scope)
        claim = await self.claim(ref)
        if claim["outcome"] != receipts.ClaimOutcome.EXECUTE:
            return bool(claim["outcome"] == receipts.ClaimOutcome.SKIPPED)
        await self._call("runtime_receipt_skip", ref)
        return True

    async def done(self, keys: Sequence[str], scope: str | None) -> dict[str, Any]:
        payload: dict[str, Any] = {"keys": list(keys)}
        if scope is not None:
            payload["scope"] = scope
        found: dict[str, Any] = (await self._call("runtime_receipts_lookup", payload))["results"]
        return found

    async def complete_page(
        self, results: Sequence[tuple[str, Any]], scope: str | None
    ) -> receipts.PageCompletion:
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
