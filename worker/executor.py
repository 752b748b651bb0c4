"""The executor: one attempt from its start to its final write, whichever way it ends.

It builds the attempt's context and transport (the in-process gateway dispatch, absorbing
blips), runs it with :func:`worker.attempt.run` (in-process, or in a sandbox with the
attempt's own tokens), arms the run's timeout, and makes the final write through the
completer (:func:`worker.attempt.settle`). A play that returns frees its slot before its
final write lands (batched completion). It stops an attempt when told why
(:meth:`Executor.stop`); a claimed row no worker can use fails its run instead of the
worker. Whatever happens, the attempt's slot, connection and lease tracking are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from queues import authority, outcomes, runs
from queues.outcomes import FinishStatus
from worker import attempt, instruments, sandbox
from worker.completer import Completer
from worker.context import RunContext, RunInfo
from worker.contract import (
    Absorbing,
    LocalTransport,
    PoolCheck,
    gateway_origin,
    in_process_claims,
)
from worker.heartbeat import Heartbeat
from worker.plays import Registry
from worker.producer import retrieved
from worker.slots import Live, Slots

log = structlog.get_logger("worker.executor")


def stop(live: Live, reason: str, *, untrack: Callable[[uuid.UUID], None] | None) -> None:
    """Stop a live attempt (``cancel``, ``timeout``, ``lease_lost``, ``handback``): its
    task is cancelled and the executor decides its end by the reason; a lost lease is no
    longer renewed (``untrack``). An attempt whose play is done is left to its fenced final
    write."""
    if live.finishing:
        if reason == "lease_lost":
            live.stop_reason = reason  # stop renewing; the final write is fenced anyway
        return  # the play is done; its fenced final write decides
    live.stop_reason = reason
    live.ctx.cancel_requested = reason == "cancel"
    if reason == "lease_lost" and untrack is not None:
        untrack(live.claimed.run_id)
    live.task.cancel()


class Executor:
    def __init__(
        self,
        *,
        pool: Any,
        pool_check: PoolCheck | None,
        hold: bool,
        heartbeat: Heartbeat,
        completer: Completer,
        slots: Slots,
        stats: dict[str, int],
        registry: Registry,
        worker_id: str,
        max_outage_s: float,
        token_secret: bytes | None,
        token_ttl_s: float,
        gateway_url: str | None,
        sandboxes: sandbox.Launcher | None,
        freed: Callable[[], None],
        org_capped: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._pool_check = pool_check
        self._hold = hold  # attempts keep their connection between calls (worker.contract)
        self._heartbeat = heartbeat
        self._completer = completer
        self.slots = slots
        self._stats = stats
        self._registry = registry
        self._worker_id = worker_id
        self._max_outage_s = max_outage_s
        self._token_secret = token_secret
        self._token_ttl_s = token_ttl_s
        self._gateway_url = gateway_url
        self._sandboxes = sandboxes
        self._freed = freed  # a slot is free: start the next run claimed ahead, claim again
        self._org_capped = org_capped  # a slot is free on a lane capped per org
        self.transports: set[LocalTransport] = set()  # of attempts not closed yet

    def stop(self, live: Live, reason: str) -> None:
        """Stop a live attempt (:func:`stop`)."""
        stop(live, reason, untrack=self._heartbeat.untrack)

    def start(self, c: runs.Claimed) -> None:
        problem = runs.unusable(c)
        if problem is not None:
            self._fail_unusable(c, problem)
            return
        info = RunInfo.of_claim(c, self._worker_id)
        transport = LocalTransport(
            self._pool,
            functools.partial(in_process_claims, c, self._worker_id),
            hold=self._hold,
        )
        # A blip (a lost connection) is absorbed inside the attempt: its repeatable calls
        # are sent again until answered or the outage passes max_outage_s.
        absorbing = Absorbing(
            transport,
            max_outage_s=self._max_outage_s,
            on_absorbed=instruments.absorbed,
            before_retry=self._pool_check,
        )
        ctx = RunContext(info, dict(c.params or {}), absorbing)
        self.transports.add(transport)
        self._stats["claimed"] += 1
        # Its lease is renewed from its claim on (the producer tracks what it claims).
        task = asyncio.create_task(self._execute(c, ctx, transport), name=f"run:{c.run_id}")
        # A cleanup-only attempt is the cancel: the pending request its heartbeats report
        # must not stop the hooks it runs.
        self.slots.live[c.run_id] = Live(c, ctx, task, stop_reason="cancel" if c.cleanup else None)
        self._arm_timeout(self.slots.live[c.run_id])

    def _fail_unusable(self, c: runs.Claimed, problem: str) -> None:
        """A claimed run whose row this worker cannot use (:func:`queues.runs.unusable`):
        its play never runs; the run fails with ``RUN_ROW_INVALID`` through the fenced final
        write (its lease renewed until it lands), and the worker goes on."""
        assert c.attempt is not None
        log.error("run_row_invalid", run_id=str(c.run_id), attempt=c.attempt, problem=problem)
        self._stats["row_invalid"] += 1
        heartbeat = self._heartbeat

        def written(future: asyncio.Future[FinishStatus]) -> None:
            heartbeat.untrack(c.run_id)
            retrieved(future)

        self._completer.queue(outcomes.row_invalid(c.run_id, c.attempt, problem)).add_done_callback(
            written
        )

    def _arm_timeout(self, live: Live) -> None:
        """Stop the attempt at its run's timeout (queues.options), measured from the claim's
        database time, so the worker's clock does not matter."""
        c = live.claimed
        if c.cleanup or c.timeout_at is None or (claimed_at := c.claimed_at) is None:
            return  # most runs have no timeout: nothing to arm, nothing to compute
        left = (c.timeout_at - claimed_at).total_seconds()
        live.timer = asyncio.get_running_loop().call_later(
            max(0.0, left), self._time_out, c.run_id, c.attempt
        )

    def _time_out(self, run_id: uuid.UUID, attempt_no: int | None) -> None:
        live = self.slots.live.get(run_id)
        if live is not None and live.claimed.attempt == attempt_no and live.stop_reason is None:
            log.warning("run_timed_out", run_id=str(run_id), attempt=attempt_no)
            self.stop(live, "timeout")

    async def _execute(self, c: runs.Claimed, ctx: RunContext, transport: LocalTransport) -> None:
        """One attempt; whatever happens, its slot and its connection are freed and the
        worker can drain."""
        try:
            await self._attempt(c, ctx, transport)
        except asyncio.CancelledError:
            # Stopped while its cleanup hooks ran (its lease was lost): nothing is written.
            log.warning(
                "attempt_finished",
                run_id=str(c.run_id),
                attempt=c.attempt,
                play=c.play,
                outcome=str(outcomes.Outcome.SUPERSEDED),
                final_write="none",
                stopped_in="cleanup",
            )
            raise
        except Exception as exc:  # the final write itself failed (the database is gone)
            log.error("attempt_final_write_failed", run_id=str(c.run_id), error=repr(exc)[:300])
        finally:
            try:
                with contextlib.suppress(Exception):  # the pool checks what it gets back
                    await transport.aclose()
                self.transports.discard(transport)
            finally:  # also when a cancel arrives during the close
                self._heartbeat.untrack(c.run_id)
                live = self.slots.live.pop(c.run_id, None)
                if live is not None and live.finishing:
                    self.slots.returned -= 1
                if live is not None and live.timer is not None:
                    live.timer.cancel()
                self._freed()  # the next run claimed ahead takes the slot at once
            # A slot is free. On a lane that caps the runs per org (wq_lanes.org_concurrency)
            # a claim that came back short because an org was at its cap may now fill:
            # claim again now, not at the next poll. Elsewhere a new job is announced by its
            # spawn (migration 0032), and a claim now would find nothing (one per run at
            # low load).
            if c.org_capped:
                self._org_capped()

    def _stop_reason(self, run_id: uuid.UUID) -> str | None:
        live = self.slots.live.get(run_id)
        return live.stop_reason if live is not None else "handback"

    async def _attempt(self, c: runs.Claimed, ctx: RunContext, transport: LocalTransport) -> None:
        structlog.contextvars.bind_contextvars(run_id=str(c.run_id), attempt=c.attempt, lane=c.lane)
        started = time.perf_counter()
        play = self._registry.get(c.play or "")
        spec = self._sandbox_spec(c) if play is not None and play.sandboxed else None
        ended = await attempt.run(
            c, ctx, play, stop_reason=lambda: self._stop_reason(c.run_id), sandbox_spec=spec
        )
        self.slots.played(time.perf_counter() - started)
        live = self.slots.live.get(c.run_id)
        if live is not None:
            live.finishing = True  # a hand-back must not interrupt the final write
            self.slots.returned += 1
            # Batched completion: the play has returned, so its slot is free; its final
            # write goes out with the finish loop's next batch, and its held connection
            # goes back to the pool first.
            await transport.aclose()
            self._freed()
        final, status = await attempt.settle(
            c, ctx, play, ended, write=self._completer.write, connection=self._pool.connection
        )
        applied = status is not None and status.applied
        outcome = final.outcome if final is not None and applied else outcomes.Outcome.SUPERSEDED
        if not applied:
            self._stats["stale"] += 1
        elif final is not None and final.state in (outcomes.RunState.SUCCEEDED,):
            self._stats["succeeded"] += 1
        elif final is not None and final.state == outcomes.RunState.FAILED:
            self._stats["failed"] += 1
        elif final is not None and final.outcome is outcomes.Outcome.INTERRUPTED:
            self._stats["interrupted"] += 1
        log.info(
            "attempt_finished",
            play=c.play,
            cleanup=bool(c.cleanup),
            outcome=str(outcome),
            run_state=str(final.state) if final is not None and applied else None,
            final_write=str(status) if status is not None else "none",
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def _sandbox_spec(self, c: runs.Claimed) -> attempt.SandboxSpec:
        """A sandboxed attempt's two tokens, minted from its run's authority."""
        assert c.attempt is not None and self._token_secret is not None
        assert self._gateway_url is not None and self._registry.spec is not None
        assert self._sandboxes is not None
        play = self._registry.get(c.play or "")
        tokens = authority.mint_attempt(
            c.descriptor,
            attempt=c.attempt,
            owner=self._worker_id,
            secret=self._token_secret,
            ttl_s=self._token_ttl_s,
            # Least authority: only the plays and rate-limit keys the play declared.
            may_spawn=play.may_spawn if play is not None else (),
            may_limit=play.limits if play is not None else (),
            origin=gateway_origin(self._gateway_url),
        )
        return attempt.SandboxSpec(
            self._registry.spec,
            self._gateway_url,
            tokens,
            self._sandboxes,
            max_outage_s=self._max_outage_s,
        )
