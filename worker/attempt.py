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
from typing import Any

import psycopg
import structlog

from queues import costs, outcomes, runs, tracing
from queues.authority import AttemptTokens
from queues.errors import FenceError
from queues.outcomes import Finish, FinishStatus
from worker import instruments, sandbox
from worker.context import RunContext, Suspend
from worker.endings import (
    Ended,
    Ending,
    Fatal,
    Fenced,
    Raised,
    Returned,
    Stopped,
    Suspended,
    final,
    is_fatal,
    past_deadline,
)
from worker.plays import Play
from worker.sandbox import Launcher

log = structlog.get_logger("worker.attempt")

# A cancel hook that runs longer than this is abandoned (logged) so the final write is made.
CLEANUP_HOOK_TIMEOUT_S = 60.0


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
    ending = await _execute(c, ctx, play, stop_reason=stop_reason, sandbox_spec=sandbox_spec)
    ended = final(c, ending)
    inside = sandboxed(play, sandbox_spec) or None  # logged only when true
    if isinstance(ending, Fenced):
        log.warning(
            "attempt_fenced", error_code=ending.code, error=ending.message, sandboxed=inside
        )
    elif isinstance(ending, Raised) and ended.finish is not None:
        level = "warning" if ended.finish.state == outcomes.RunState.QUEUED else "error"
        getattr(log, level)(
            "attempt_raised",
            play=c.play,
            sandboxed=inside,
            outcome=str(ended.finish.outcome),
            next_state=str(ended.finish.state),
            error=f"{ending.error.get('type')}: {ending.error.get('message')}"[:500],
            # An interruption is not the play's fault: no traceback.
            traceback=None if ending.interrupted else ending.error.get("traceback"),
        )
    return ended


def _writes_nothing_or_waits(ending: Ending) -> bool:
    """Fenced, a lost lease, or a wait for an event: what a timeout does not turn into a
    timed-out failure (its wait wakes it by its deadline: worker.endings.until_deadline)."""
    if isinstance(ending, Fenced):
        return True
    if isinstance(ending, Stopped):
        return ending.reason == "lease_lost"
    return isinstance(ending, Suspended) and ending.event is not None


def sandboxed(play: Play | None, sandbox_spec: SandboxSpec | None) -> bool:
    """Whether the attempt runs in a sandbox."""
    return play is not None and play.sandboxed and sandbox_spec is not None


async def _execute(
    c: runs.Claimed,
    ctx: RunContext,
    play: Play | None,
    *,
    stop_reason: Callable[[], str | None],
    sandbox_spec: SandboxSpec | None = None,
) -> Ending:
    """Run the attempt with the executor it needs; how it ended."""
    if not c.cleanup and past_deadline(c):
        # Past its timeout before this attempt began (it woke at its deadline, or a retry
        # came late): failed without running anything.
        return Stopped("timeout")
    if sandboxed(play, sandbox_spec):
        assert play is not None and sandbox_spec is not None
        ending = await sandbox.run_attempt(
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
        if stop_reason() == "timeout" and not _writes_nothing_or_waits(ending):
            # Stopped at the run's timeout: its cleanup hooks ran in the sandbox (as for a
            # cancel); the run fails.
            return Stopped("timeout")
        return ending
    if c.cleanup:
        await run_hooks(c, ctx, play)
        return Stopped("cancel")
    try:
        if play is None:  # the claim only takes plays this worker has
            raise Fatal(f"play {c.play!r} is not registered in this worker")
        return Returned(await play.fn(ctx, ctx.params))
    except asyncio.CancelledError:
        reason = stop_reason() or "handback"
        if reason in ("cancel", "timeout"):
            # A cancel, or the run's timeout: stopped like a cancel (its hooks run).
            await run_hooks(c, ctx, play)
            return Stopped("cancel" if reason == "cancel" else "timeout")
        if reason == "lease_lost":
            return Stopped("lease_lost")
        return Stopped("handback")
    except Suspend as suspend:
        return Suspended(suspend.wake_at, suspend.event)
    except FenceError as exc:
        return Fenced(exc.code, exc.message)
    except Exception as exc:
        return Raised(
            outcomes.error_of(exc), fatal=is_fatal(exc), interrupted=outcomes.is_interruption(exc)
        )


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
    epoch = costs.paused_epoch(event)
    if epoch is not None:
        # Paused on a budget: written only while no budget of the org was written since the
        # refusal; otherwise the run goes straight back to ask again.
        async with connection() as conn:
            paused = await costs.pause(
                conn, worker_id=worker_id, finish_=final, org=c.org, epoch=epoch
            )
        if paused is None:
            return await write(outcomes.handed_back(c.run_id, c.attempt))
        return paused
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
    """Run the cancel hooks, then the final ``cancelled`` write."""
    await run_hooks(c, ctx, play)
    cancelled = final(c, Stopped("cancel")).finish
    assert cancelled is not None
    return cancelled


async def run_hooks(c: runs.Claimed, ctx: RunContext, play: Play | None) -> None:
    """Run the cancel hooks (the play's, then the ones the attempt registered), each
    bounded. A failing hook is logged, never fatal."""
    hooks = [*(play.on_cancel if play else ()), *ctx.cleanups]
    for hook in hooks:
        try:
            async with asyncio.timeout(CLEANUP_HOOK_TIMEOUT_S):
                await hook(ctx)
        except Exception as exc:
            log.warning("cleanup_hook_failed", play=c.play, error=repr(exc)[:500])
