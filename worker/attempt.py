"""One attempt: run the play (or only its cleanup) and turn how it ended into a final write.

The runtime owns the when (claiming, the final write's batching, stops); this module owns
what an attempt's end means, through the one outcome policy in :mod:`queues.outcomes`:

- the play returned: ``succeeded`` (or a non-retryable failure if the result is not JSON);
- the play raised: an interruption when the database went away under it (retried
  promptly, not charged), a failure otherwise (``Fatal`` and refused input are final);
- it suspended (sleep, event wait): ``suspended``;
- the runtime stopped it: a cancel runs the cleanup hooks and writes ``cancelled``; a
  lost lease writes nothing (the rescuer or a newer attempt owns the run); a hand-back
  returns the run to its lane without spending anything;
- a fence refused one of its writes: nothing more is written (a newer attempt owns it).

A cleanup-only attempt (a run whose lease lapsed with a cancel pending) runs the play's
cancel hooks and writes ``cancelled``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import structlog

from queues import outcomes, runs, tracing
from queues.authority import AttemptTokens
from queues.errors import FenceError
from queues.outcomes import Finish, FinishStatus
from worker import instruments, sandbox
from worker.context import RunContext, Suspend
from worker.endings import Fatal, budget, is_fatal, past_deadline, success, until_deadline
from worker.plays import Play
from worker.sandbox import Launcher

log = structlog.get_logger("worker.attempt")

# A cancel hook that runs longer than this is abandoned (logged) so the final write is made.
CLEANUP_HOOK_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Ended:
    """How an attempt ended: its final write, if any, and an event to suspend on."""

    finish: Finish | None  # None: stale, nothing to write
    event: str | None = None  # suspend on this event: written under the event's lock


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """Where a sandboxed attempt runs: its app, the gateway (a Unix socket), its attempt's
    tokens, and the worker's sandbox launcher."""

    app: str
    gateway_url: str
    tokens: AttemptTokens
    launcher: Launcher
    max_outage_s: float  # how long the sandbox's calls absorb a blip (worker.contract)


async def run(
    c: runs.Claimed,
    ctx: RunContext,
    play: Play | None,
    *,
    stop_reason: Callable[[], str | None],
    sandbox_spec: SandboxSpec | None = None,
) -> Ended:
    """Execute one attempt of a claimed run and decide its final write, in a ``wq.attempt``
    span that continues the trace its submitter stored with the run, and measured
    (:mod:`worker.instruments`)."""
    instruments.picked_up(c)
    started = time.perf_counter()
    attributes = tracing.run_attributes(
        run_id=c.run_id, attempt=c.attempt, play=c.play, lane=c.lane
    ) | ({"wq.cleanup": True} if c.cleanup else {})
    parent = tracing.attempt_parent(c.authority)
    with tracing.span("wq.attempt", attributes=attributes, parent=parent) as span:
        ended = await _run(c, ctx, play, stop_reason=stop_reason, sandbox_spec=sandbox_spec)
        outcome = str(ended.finish.outcome) if ended.finish else str(outcomes.Outcome.SUPERSEDED)
        tracing.annotate(span, outcome=outcome)
        error = ended.finish.error if ended.finish else None
        if error and outcome in (outcomes.Outcome.FAILED, outcomes.Outcome.INTERRUPTED):
            tracing.failed(span, f"{error.get('type')}: {error.get('message')}")
    instruments.attempt_finished(c, outcome, time.perf_counter() - started)
    return ended


async def _run(
    c: runs.Claimed,
    ctx: RunContext,
    play: Play | None,
    *,
    stop_reason: Callable[[], str | None],
    sandbox_spec: SandboxSpec | None = None,
) -> Ended:
    assert c.attempt is not None
    if not c.cleanup and past_deadline(c):
        # Past its timeout before this attempt began (it woke at its deadline, or a retry
        # came late): failed without running anything.
        return Ended(outcomes.timed_out(c.run_id, c.attempt, c.timeout_at))
    if play is not None and play.sandboxed and sandbox_spec is not None:
        ended = await sandbox.run_attempt(
            c,
            ctx.info,
            app=sandbox_spec.app,
            gateway_url=sandbox_spec.gateway_url,
            tokens=sandbox_spec.tokens,
            stop_reason=stop_reason,
            launcher=sandbox_spec.launcher,
            max_outage_s=sandbox_spec.max_outage_s,
            resources=play.resources,
        )
        if stop_reason() == "timeout" and not isinstance(ended, tuple) and ended is not None:
            # Stopped at the run's timeout: its cleanup hooks ran in the sandbox (as for a
            # cancel); the run fails.
            return Ended(outcomes.timed_out(c.run_id, c.attempt, c.timeout_at))
        if isinstance(ended, tuple):
            return Ended(until_deadline(c, ended[0]), event=ended[1])
        return Ended(None if ended is None else until_deadline(c, ended))
    if c.cleanup:
        return Ended(await cleanup(c, ctx, play))
    try:
        if play is None:  # the claim only takes plays this worker has
            raise Fatal(f"play {c.play!r} is not registered in this worker")
        result = await play.fn(ctx, ctx.params)
        return Ended(success(c, result))
    except asyncio.CancelledError:
        reason = stop_reason() or "handback"
        if reason == "cancel":
            return Ended(await cleanup(c, ctx, play))
        if reason == "timeout":
            # The run's timeout: stopped like a cancel (its cleanup hooks run), then failed.
            await cleanup(c, ctx, play)
            return Ended(outcomes.timed_out(c.run_id, c.attempt, c.timeout_at))
        if reason == "lease_lost":
            return Ended(None)  # a newer attempt or the rescuer owns the run: no write at all
        return Ended(outcomes.handed_back(c.run_id, c.attempt))
    except Suspend as suspend:
        final = outcomes.suspended(
            c.run_id, c.attempt, wake_at=suspend.wake_at, wait_event=suspend.event
        )
        return Ended(until_deadline(c, final), event=suspend.event)
    except FenceError as exc:
        log.warning("attempt_fenced", error_code=exc.code, error=exc.message)
        return Ended(None)
    except Exception as exc:
        final = outcomes.after_exception(
            c.run_id, c.attempt, exc, budget(c), now=datetime.now(UTC), fatal=is_fatal(exc)
        )
        level = "warning" if final.state == outcomes.RunState.QUEUED else "error"
        getattr(log, level)(
            "attempt_raised",
            play=c.play,
            outcome=str(final.outcome),
            next_state=str(final.state),
            error=repr(exc)[:500],
            exc_info=final.outcome is not outcomes.Outcome.INTERRUPTED,
        )
        return Ended(final)


Write = Callable[[Finish], Awaitable[FinishStatus]]
Connection = Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]


async def settle(
    c: runs.Claimed,
    ctx: RunContext,
    play: Play | None,
    ended: Ended,
    *,
    write: Write,
    connection: Connection,
) -> tuple[Finish | None, FinishStatus | None]:
    """Make the attempt's final write from how it ended; the write made and its status
    (both None: stale, nothing to write). ``write`` makes a final write (the runtime's
    batch, or a statement of its own); ``connection`` lends one for a suspension on an
    event, written under the event's lock, which hands the run straight back when the event
    came meanwhile. A cancel pending at the write runs the cleanup hooks, then writes
    ``cancelled`` (a cancel is final)."""
    final = ended.finish
    if final is None:
        return None, None
    status = await _write_final(
        c, ctx.info.worker_id, final, ended.event, write=write, connection=connection
    )
    if status is FinishStatus.CANCEL_PENDING:
        final = await cleanup(c, ctx, play)
        status = await write(final)
    return final, status


async def _write_final(
    c: runs.Claimed,
    worker_id: str,
    final: Finish,
    event: str | None,
    *,
    write: Write,
    connection: Connection,
) -> FinishStatus:
    if event is None:
        return await write(final)
    assert c.attempt is not None and c.org and c.created_at
    async with connection() as conn:
        emitted, status = await runs.suspend_for_event(
            conn,
            worker_id=worker_id,
            finish_=final,
            org=c.org,
            event=event,
            since=c.created_at,
        )
    if emitted:
        # Emitted meanwhile: hand the run straight back so it re-enters and reads it.
        return await write(outcomes.handed_back(c.run_id, c.attempt))
    assert status is not None
    return status


async def cleanup(c: runs.Claimed, ctx: RunContext, play: Play | None) -> Finish:
    """Run the cancel hooks (the play's, then the ones the attempt registered), each
    bounded; then the final ``cancelled`` write. A failing hook is logged, never fatal."""
    assert c.attempt is not None
    hooks = [*(play.on_cancel if play else ()), *ctx.cleanups]
    for hook in hooks:
        try:
            async with asyncio.timeout(CLEANUP_HOOK_TIMEOUT_S):
                await hook(ctx)
        except Exception as exc:
            log.warning("cleanup_hook_failed", play=c.play, error=repr(exc)[:500])
    return outcomes.cancelled(c.run_id, c.attempt, "cancel requested")
