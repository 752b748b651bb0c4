"""The worker process: claim, execute, heartbeat, finish; shut down gracefully.

procrastinate is the transport: runs are procrastinate jobs on the lane (a procrastinate
queue), inserted by admission, woken by procrastinate's NOTIFY channel for the lane. The
worker claims jobs in batches (one statement claims up to N jobs and starts N attempts)
and writes finished attempts in batches (one fenced statement finishes N runs and their
jobs), which is where it gains on one-job-at-a-time fetching.

Loops here own the when; ``queues`` owns the what.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from queues import admission, lanes, migrations, receipts, runs
from queues.errors import FenceError, WorkerError
from worker import db, recovery
from worker.context import STEP_LEASE_S, RunContext, RunInfo, Suspend
from worker.plays import Fatal, Registry

log = structlog.get_logger("worker.runtime")

POLL_INTERVAL_S = 1.0
CLAIM_BATCH_MAX = 64


@dataclass
class Settings:
    url: str
    release: str
    registry: Registry
    concurrency: int | None = None  # None: the lane's policy
    adopt: tuple[str, ...] = ()  # extra releases whose lanes this worker also consumes
    ready_file: Path | None = None
    grace_s: float = 20.0
    max_outage_s: float = 60.0  # exit non-zero when the database is gone for this long
    install_signals: bool = True  # False when embedded in another program (tests, demo)
    worker_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    )


class DatabaseLost(Exception):
    """The database stayed unreachable past ``max_outage_s``: exit so a supervisor restarts."""


TRANSIENT = (psycopg.OperationalError, PoolTimeout)


class _Outage:
    """How long the database has been failing, for one loop; backs off between tries."""

    def __init__(self, name: str, limit_s: float) -> None:
        self.name = name
        self.limit_s = limit_s
        self.since: float | None = None
        self.delay = 0.1

    def ok(self) -> None:
        if self.since is not None:
            log.info(
                "database_reconnected",
                loop=self.name,
                outage_s=round(time.monotonic() - self.since, 2),
            )
        self.since = None
        self.delay = 0.1

    async def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        down = now - self.since
        log.warning(
            "database_unavailable",
            loop=self.name,
            error=str(exc).strip()[:300],
            down_s=round(down, 2),
        )
        if down > self.limit_s:
            raise DatabaseLost(f"database unreachable for {down:.0f}s ({self.name})") from exc
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 2.0)


@dataclass
class _Live:
    claimed: runs.Claimed
    ctx: RunContext
    task: asyncio.Task[None]
    stop_reason: str | None = None  # cancel | lease_lost | handback
    finishing: bool = False  # the play is done; its final write is under way


class Worker:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.lane_names = [lanes.lane_name(r) for r in (settings.release, *settings.adopt)]
        self.live: dict[uuid.UUID, _Live] = {}
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self.wake = asyncio.Event()
        self.capacity = asyncio.Event()
        self._finishes: list[tuple[runs.Finish, asyncio.Future[bool]]] = []
        self._finish_ready = asyncio.Event()
        self._last_renewal = time.monotonic()
        self._signals = 0
        self.procrastinate_id: int | None = None
        self.lane: lanes.Lane | None = None
        self.pool: AsyncConnectionPool[Any] | None = None
        self.stats = {"claimed": 0, "succeeded": 0, "failed": 0, "stale": 0, "dropped": 0}

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        await self._startup()
        assert self.s.concurrency is not None
        self.pool = AsyncConnectionPool(
            self.s.url,
            min_size=2,
            # Every running attempt can hold one connection, plus the claim, finish,
            # heartbeat and maintenance loops.
            max_size=self.s.concurrency + 4,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": 5},
            # A getconn that cannot be served soon is an outage, not a queue: fail fast so
            # the loops' outage accounting (and max_outage_s) sees it.
            timeout=min(5.0, self.s.max_outage_s / 2),
        )
        await self.pool.open(wait=True, timeout=30)
        try:
            return await self._serve()
        finally:
            await self.pool.close()

    async def _startup(self) -> None:
        """Verify the contract, prepare the lanes (before reporting ready), register."""
        conn = await db.connect(self.s.url, autocommit=True)
        async with conn:
            await migrations.verify_contract(conn, url=self.s.url)
            # The worker owns preparation: its lane is prepared before it reports ready.
            for release in (self.s.release, *self.s.adopt):
                await admission.ensure_lane(conn, url=self.s.url, release=release)
            self.lane = await lanes.get(conn, lanes.lane_name(self.s.release))
            assert self.lane is not None
            self.procrastinate_id = await runs.register_worker(
                conn,
                worker_id=self.s.worker_id,
                lanes=self.lane_names,
                release=self.s.release,
                host=socket.gethostname(),
                pid=os.getpid(),
            )
        if self.s.concurrency is None:
            self.s.concurrency = self.lane.concurrency
        structlog.contextvars.bind_contextvars(worker_id=self.s.worker_id)

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if self.s.install_signals else ():
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        tasks = [
            asyncio.create_task(self._claim_loop(), name="claim"),
            asyncio.create_task(self._finish_loop(), name="finish"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._notify_loop(), name="listen"),
            asyncio.create_task(self._maintenance_loop(), name="maintenance"),
        ]
        if self.s.ready_file is not None:
            self.s.ready_file.write_text(
                json.dumps({"worker_id": self.s.worker_id, "lanes": self.lane_names})
            )
        log.info(
            "worker_ready",
            lanes=self.lane_names,
            release=self.s.release,
            concurrency=self.s.concurrency,
        )
        self.ready.set()
        exit_code = 0
        stop_wait = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stop_wait and task.exception() is not None:
                log.error("worker_loop_crashed", loop=task.get_name(), error=repr(task.exception()))
                exit_code = 1
        self.stopping.set()
        await self._drain()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert self.pool is not None
        with contextlib.suppress(psycopg.Error):
            async with self.pool.connection() as conn:
                await runs.worker_stopped(conn, self.s.worker_id)
        log.info("worker_stopped", **self.stats)
        return exit_code

    def request_stop(self) -> None:
        """The signal handler: the first signal stops gracefully, a second exits at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("worker_exit_now", reason="second signal")
            os._exit(1)
        self.stop()

    def stop(self) -> None:
        """Stop claiming; running attempts get the grace period, then are handed back."""
        log.info("worker_stopping", grace_s=self.s.grace_s, running=len(self.live))
        self.stopping.set()
        self.wake.set()

    async def _drain(self) -> None:
        """Let running attempts finish within the grace period, then hand the rest back."""
        deadline = time.monotonic() + self.s.grace_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for live in list(self.live.values()):
            if not live.finishing:
                live.stop_reason = "handback"
                live.task.cancel()
        tasks = [live.task for live in self.live.values()]
        if tasks:
            # Hand-backs and final writes need the database; do not wait past the outage
            # limit for them (the leases lapse and recovery takes over).
            _, pending = await asyncio.wait(tasks, timeout=self.s.max_outage_s + 5)
            if pending:
                log.error("shutdown_abandoned_attempts", count=len(pending))
        await self._flush()

    # ---- loops --------------------------------------------------------------------------

    async def _listen(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(self.s.url, autocommit=True, connect_timeout=5)
        for lane in self.lane_names:
            await conn.execute(
                psycopg.sql.SQL("LISTEN {}").format(
                    psycopg.sql.Identifier(f"procrastinate_queue_v1#{lane}")
                )
            )
        await conn.execute("LISTEN wq_control")
        return conn

    async def _notify_loop(self) -> None:
        """LISTEN for the lanes' jobs and for control messages; reconnect when cut off."""
        outage = _Outage("listen", self.s.max_outage_s)
        while True:
            try:
                conn = await self._listen()
            except TRANSIENT as exc:
                await outage.failed(exc)
                continue
            outage.ok()
            self.wake.set()  # anything inserted while we were not listening
            try:
                async with conn:
                    async for note in conn.notifies():
                        if note.channel == "wq_control":
                            self._control(note.payload)
                        else:
                            self.wake.set()
            except TRANSIENT as exc:
                await outage.failed(exc)

    async def _maintenance_loop(self) -> None:
        """Serve the recovery pass as procrastinate's periodic task (one per tick however
        many workers run); restarted after a failure, never fatal to the worker."""
        while not self.stopping.is_set():
            try:
                await recovery.run_periodic_worker(self.s.url, self.stopping)
            except Exception as exc:  # a maintenance failure must not stop execution
                log.warning("maintenance_failed", error=repr(exc)[:300])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 5.0)

    def _control(self, payload: str) -> None:
        try:
            message = json.loads(payload)
            run_id = uuid.UUID(str(message.get("cancel")))
        except (ValueError, TypeError, AttributeError):
            return
        live = self.live.get(run_id)
        if live is not None and live.stop_reason is None:
            self._stop_run(live, "cancel")

    def _stop_run(self, live: _Live, reason: str) -> None:
        if live.finishing:
            return  # the play is done; its fenced final write decides
        live.stop_reason = reason
        live.ctx.cancel_requested = reason == "cancel"
        live.task.cancel()

    async def _claim_loop(self) -> None:
        assert self.pool is not None and self.s.concurrency is not None
        plays = sorted(self.s.registry.names())
        outage = _Outage("claim", self.s.max_outage_s)
        while not self.stopping.is_set():
            free = self.s.concurrency - len(self.live)
            if free <= 0:
                self.capacity.clear()
                await self.capacity.wait()
                continue
            self.wake.clear()
            try:
                async with self.pool.connection() as conn:
                    claimed = await runs.claim(
                        conn,
                        lanes=self.lane_names,
                        worker_id=self.s.worker_id,
                        limit=min(free, CLAIM_BATCH_MAX),
                        plays=plays,
                        procrastinate_worker=self.procrastinate_id,
                    )
            except TRANSIENT as exc:
                await outage.failed(exc)
                continue
            outage.ok()
            got = 0
            for c in claimed:
                if c.claimed:
                    self._start(c)
                    got += 1
                else:
                    self.stats["dropped"] += 1
                    log.info("delivery_dropped", run_id=str(c.run_id), job_id=c.job_id)
            if got < min(free, CLAIM_BATCH_MAX) and not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_INTERVAL_S)

    def _start(self, c: runs.Claimed) -> None:
        assert self.pool is not None
        assert c.attempt is not None and c.org and c.play and c.lane and c.release
        info = RunInfo(c.run_id, c.attempt, c.org, c.play, c.lane, c.release, self.s.worker_id)
        ctx = RunContext(info, dict(c.params or {}), self.pool)
        self.stats["claimed"] += 1
        task = asyncio.create_task(self._execute(c, ctx), name=f"run:{c.run_id}")
        self.live[c.run_id] = _Live(c, ctx, task)

    async def _execute(self, c: runs.Claimed, ctx: RunContext) -> None:
        """One attempt; whatever happens, its slot is freed and the worker can drain."""
        try:
            await self._attempt(c, ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the final write itself failed (the database is gone)
            log.error("attempt_final_write_failed", run_id=str(c.run_id), error=repr(exc)[:300])
        finally:
            self.live.pop(c.run_id, None)
            self.capacity.set()

    async def _attempt(self, c: runs.Claimed, ctx: RunContext) -> None:
        structlog.contextvars.bind_contextvars(run_id=str(c.run_id), attempt=c.attempt, lane=c.lane)
        started = time.perf_counter()
        assert c.attempt is not None
        play = self.s.registry.get(c.play or "")
        final: runs.Finish | None
        written: bool | None = None  # set when the final write was made in-line
        try:
            assert play is not None  # the claim only takes plays this worker has
            result = await play.fn(ctx, ctx.params)
            final = self._success(c, result)
        except asyncio.CancelledError:
            final = await self._stopped(c, ctx)
        except Suspend as suspend:
            final = runs.suspended(
                c.run_id, c.attempt, wake_at=suspend.wake_at, wait_event=suspend.event
            )
            if suspend.event is not None:
                final, written = await self._suspend_for_event(c, final, suspend.event)
        except FenceError as exc:
            log.warning("attempt_fenced", error_code=exc.code, error=exc.message)
            final = None
            assert self.pool is not None
            async with self.pool.connection() as conn:
                await runs.mark_superseded(conn, c.run_id, c.attempt)
        except Exception as exc:
            error = _error_of(exc)
            final = runs.failed(
                c.run_id,
                c.attempt,
                error,
                c.retry,
                now=datetime.now(UTC),
                failure=(c.failures or 0) + 1,
                retryable=not isinstance(exc, Fatal | WorkerError),
            )
        applied = True
        live = self.live.get(c.run_id)
        if live is not None:
            live.finishing = True  # a hand-back must not interrupt the final write
        if written is not None:
            applied = written
        elif final is not None:
            applied = await self._submit_finish(final)
        outcome = final.outcome if final is not None else runs.Outcome.SUPERSEDED
        if not applied:
            self.stats["stale"] += 1
            outcome = runs.Outcome.SUPERSEDED
        elif final is not None and final.state == runs.RunState.SUCCEEDED:
            self.stats["succeeded"] += 1
        elif final is not None and final.state == runs.RunState.FAILED:
            self.stats["failed"] += 1
        log.info(
            "attempt_finished",
            play=c.play,
            outcome=str(outcome),
            run_state=str(final.state) if final is not None and applied else None,
            final_write="applied" if applied and final is not None else "refused",
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def _success(self, c: runs.Claimed, result: Any) -> runs.Finish:
        assert c.attempt is not None
        try:
            json.dumps(result)
        except (TypeError, ValueError) as exc:
            return runs.failed(
                c.run_id,
                c.attempt,
                {"type": "ResultNotJSON", "message": f"the play's result is not JSON: {exc}"},
                c.retry,
                now=datetime.now(UTC),
                failure=(c.failures or 0) + 1,
                retryable=False,
            )
        return runs.succeeded(c.run_id, c.attempt, result)

    async def _stopped(self, c: runs.Claimed, ctx: RunContext) -> runs.Finish | None:
        assert c.attempt is not None
        live = self.live.get(c.run_id)
        reason = live.stop_reason if live is not None else "handback"
        if reason == "cancel":
            # Cleanup hooks run before the final write (the play's sandboxes, etc.).
            play = self.s.registry.get(c.play or "")
            hooks = [*(play.on_cancel if play else ()), *ctx.cleanups]
            for hook in hooks:
                try:
                    await hook(ctx)
                except Exception as exc:
                    log.warning("cleanup_hook_failed", error=repr(exc))
            return runs.cancelled(c.run_id, c.attempt, "cancel requested")
        if reason == "lease_lost":
            return None  # a newer attempt or the rescuer owns the run: no write at all
        return runs.handed_back(c.run_id, c.attempt)

    async def _suspend_for_event(
        self, c: runs.Claimed, final: runs.Finish, event: str
    ) -> tuple[runs.Finish, bool | None]:
        """Suspend on an event under its lock; returns the final write and whether it was
        already made (None: not yet, the caller submits it)."""
        assert self.pool is not None and c.attempt is not None
        async with self.pool.connection() as conn:
            emitted, applied = await runs.suspend_for_event(
                conn, worker_id=self.s.worker_id, finish_=final, event=event
            )
        if emitted:
            # Emitted meanwhile: hand the run straight back so it re-enters and reads it.
            return runs.handed_back(c.run_id, c.attempt), None
        return final, applied

    async def _submit_finish(self, final: runs.Finish) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._finishes.append((final, future))
        self._finish_ready.set()
        return await asyncio.shield(future)

    async def _finish_loop(self) -> None:
        while True:
            await self._finish_ready.wait()
            await self._flush()

    async def _flush(self) -> None:
        """Write every pending final outcome in one fenced statement; retry while the
        database is away (a replay of an applied write is refused by the fence, harmlessly).
        """
        self._finish_ready.clear()
        batch, self._finishes = self._finishes, []
        if not batch:
            return
        assert self.pool is not None
        outage = _Outage("finish", self.s.max_outage_s)
        while True:
            try:
                async with self.pool.connection() as conn:
                    applied = await runs.finish(
                        conn, worker_id=self.s.worker_id, finishes=[f for f, _ in batch]
                    )
                break
            except TRANSIENT as exc:
                try:
                    await outage.failed(exc)
                except DatabaseLost as lost:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(lost)
                    raise
        outage.ok()
        for final, future in batch:
            if not future.done():
                future.set_result((final.run_id, final.attempt) in applied)

    async def _heartbeat_loop(self) -> None:
        assert self.pool is not None and self.lane is not None
        period = min(self.lane.heartbeat_s, 2.0)
        ttl = self.lane.lease_ttl_s
        while True:
            await asyncio.sleep(period)
            leases = [
                (run_id, live.claimed.attempt or 0)
                for run_id, live in self.live.items()
                if live.stop_reason is None
            ]
            try:
                async with self.pool.connection(timeout=period) as conn:
                    renewed = await runs.heartbeat(conn, worker_id=self.s.worker_id, leases=leases)
                    await receipts.extend_for_attempts(
                        conn,
                        leases=[(r.run_id, r.attempt) for r in renewed],
                        lease_s=STEP_LEASE_S,
                    )
                    await runs.worker_heartbeat(conn, self.s.worker_id)
            except (*TRANSIENT, TimeoutError) as exc:
                silent = time.monotonic() - self._last_renewal
                log.warning("heartbeat_failed", error=repr(exc), silent_s=round(silent, 1))
                if silent > ttl:
                    # The watchdog: without renewals past the TTL our leases are gone.
                    self._lose(self.live.values())
                continue
            self._last_renewal = time.monotonic()
            kept = {r.run_id: r for r in renewed}
            lost = [
                live
                for (run_id, _), live in zip(
                    leases, [self.live.get(r) for r, _ in leases], strict=True
                )
                if live is not None and run_id not in kept
            ]
            self._lose(lost)
            for renewal in renewed:
                live = self.live.get(renewal.run_id)
                if renewal.cancel and live is not None and live.stop_reason is None:
                    self._stop_run(live, "cancel")

    def _lose(self, lost: Iterable[_Live]) -> None:
        for live in list(lost):
            if live.stop_reason is None:
                log.warning(
                    "lease_lost", run_id=str(live.claimed.run_id), attempt=live.claimed.attempt
                )
                self._stop_run(live, "lease_lost")


def _error_of(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "code": getattr(exc, "code", None),
    }


async def serve(settings: Settings) -> int:
    try:
        return await Worker(settings).run()
    except WorkerError:
        raise
    except (*TRANSIENT, DatabaseLost) as exc:
        log.error("worker_database_lost", error=str(exc))
        return 1
