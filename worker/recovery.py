"""The recovery process: when and where ``queues.recovery.run_once`` runs.

Three ways in, one pass underneath:

- ``worker recover --every 60s`` (the Procfile's ``recovery`` process): ``recover_forever``,
  an interval with jitter, one ``recovery_pass`` log line per pass, and a prompt next pass
  while a part keeps filling its batch;
- ``worker recover --once``: one pass, printed (or ``--json``);
- a procrastinate periodic task (``make_procrastinate_app``) on the ``wq-maintenance``
  queue, deferred once per minute however many workers run the deferrer: procrastinate
  keeps one periodic job per (task, periodic id, tick). Its names are the transport's
  (:mod:`queues.transport`).

Passes are safe to run at the same time from several hosts (SKIP LOCKED), so the three
can coexist. ``worker queues adopt`` is the operator's explicit move of a lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

import procrastinate
import psycopg
import structlog

from queues import migrations, recovery, transport
from queues.errors import DatabaseLost, DatabaseUnreachable
from worker import connections, db
from worker.blips import is_blip
from worker.config import PoolMode
from worker.outage import MAX_OUTAGE_S, Downtime, Outage

log = structlog.get_logger("worker.recovery")

MAINTENANCE_QUEUE = transport.MAINTENANCE_QUEUE
PERIODIC_ID = transport.RECOVERY_PERIODIC_ID
TASK_NAME = transport.RECOVERY_TASK
JITTER = 0.1  # each interval is every_s * (1 +- JITTER), so hosts drift apart
POOL_TIMEOUT_S = 5.0  # the maintenance worker's wait for its one pooled connection


def jittered(every_s: float, *, rng: random.Random | None = None) -> float:
    return every_s * (rng or random).uniform(1 - JITTER, 1 + JITTER)


def _log_pass(report: recovery.RecoveryReport, duration_ms: float) -> None:
    log.info(
        "recovery_pass",
        duration_ms=round(duration_ms, 3),
        saturated=report.saturated,
        closed_lanes=list(report.closed_lanes),
        **report.counts(),
    )
    for lane in report.stranded:
        log.warning(
            "lane_stranded",
            lane=lane.lane,
            release=lane.release,
            lane_state=lane.lane_state,
            runs=lane.runs,
            runnable=lane.runnable,
            oldest_wait_s=round(lane.oldest_wait_s, 1),
        )


async def recover_once(
    url: str,
    *,
    batch: int = recovery.DEFAULT_BATCH,
    stranded_after_s: float = recovery.DEFAULT_STRANDED_AFTER_S,
    event_retention_s: float = recovery.DEFAULT_EVENT_RETENTION_S,
    mode: PoolMode | None = None,
    application: str | None = None,
) -> recovery.RecoveryReport:
    """One pass on a fresh connection, after verifying the schema contract."""
    async with db.session(url, mode=mode, application=application) as conn:
        await migrations.verify_contract(conn)
        started = asyncio.get_running_loop().time()
        report = await recovery.run_once(
            conn,
            batch=batch,
            stranded_after_s=stranded_after_s,
            event_retention_s=event_retention_s,
        )
        _log_pass(report, (asyncio.get_running_loop().time() - started) * 1000)
    return report


async def recover_forever(
    url: str,
    every_s: float,
    stop_event: asyncio.Event,
    *,
    batch: int = recovery.DEFAULT_BATCH,
    stranded_after_s: float = recovery.DEFAULT_STRANDED_AFTER_S,
    event_retention_s: float = recovery.DEFAULT_EVENT_RETENTION_S,
    on_pass: Callable[[recovery.RecoveryReport], None] | None = None,
    rng: random.Random | None = None,
    max_outage_s: float = MAX_OUTAGE_S,
    downtime: Downtime | None = None,
) -> int:
    """Run passes every ``every_s`` (with jitter) until ``stop_event``; returns the passes.

    A pass that filled a batch is followed at once by another. A lost connection (a
    restart, a failover) is an outage: the pass is tried again on a new connection,
    backing off from 0.1 s to 2 s, as soon as the database answers, and an outage longer
    than ``max_outage_s`` (or the process's ``downtime``, shared with its projector)
    raises :class:`~queues.errors.DatabaseLost`. Another database error is logged and the
    pass tried again at the next interval; a schema mismatch is raised (loudly).
    """
    passes = 0
    conn: psycopg.AsyncConnection[Any] | None = None
    loop = asyncio.get_running_loop()
    outage = Outage("recovery", downtime, limit_s=max_outage_s, stop=stop_event)
    try:
        while not stop_event.is_set():
            delay = jittered(every_s, rng=rng)
            try:
                if conn is None or conn.closed:
                    async with outage.bounded():
                        conn = await db.connect(url, autocommit=True)
                    await migrations.verify_contract(conn)
                started = loop.time()
                report = await recovery.run_once(
                    conn,
                    batch=batch,
                    stranded_after_s=stranded_after_s,
                    event_retention_s=event_retention_s,
                )
                outage.ok()
                passes += 1
                _log_pass(report, (loop.time() - started) * 1000)
                if on_pass is not None:
                    on_pass(report)
                if report.saturated:
                    delay = 0.0
            except DatabaseLost:
                raise
            except (psycopg.Error, DatabaseUnreachable) as exc:
                if conn is not None:
                    await conn.close()
                conn = None
                if is_blip(exc):
                    await outage.failed(exc)  # then the pass again, on a new connection
                    continue
                log.warning("recovery_pass_failed", error=repr(exc), retry_in_s=round(delay, 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), delay)
    finally:
        if conn is not None:
            await conn.close()
    return passes


# ---- procrastinate periodic task ----------------------------------------------------------


def make_procrastinate_app(
    url: str,
    *,
    mode: PoolMode | None = None,
    owner: str | None = None,
    pool_timeout_s: float = POOL_TIMEOUT_S,
) -> procrastinate.App:
    """A procrastinate app whose periodic task runs one recovery pass every minute.

    Run it with ``app.run_worker_async(queues=[MAINTENANCE_QUEUE], ...)`` inside
    ``app.open_async()``: its worker defers the tick (once per tick across all workers)
    and executes the job. Its pool is one connection (the worker's connection budget,
    :mod:`worker.connections`), with the process's connection settings (no prepared
    statements behind a transaction pooler).
    """
    # A short pool timeout: while the database is away the maintenance worker must fail
    # fast (and be restarted by the worker's loop), never hold the worker's shutdown (its
    # stop unregisters its worker: a worker passes a timeout within its grace).
    application = f"wq-maintenance {owner}" if owner else "wq-maintenance"
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=url,
            timeout=pool_timeout_s,
            min_size=connections.MAINTENANCE_POOL,
            max_size=connections.MAINTENANCE_POOL,
            kwargs=db.connect_kwargs(url, mode=mode, application=application),
        )
    )

    @app.periodic(cron="* * * * *", periodic_id=PERIODIC_ID)
    @app.task(name=TASK_NAME, queue=MAINTENANCE_QUEUE)
    async def recovery_tick(timestamp: int) -> dict[str, int]:
        report = await recover_once(url, mode=mode, application=application)
        log.info("recovery_tick", tick=timestamp)
        return report.counts()

    return app


async def run_periodic_worker(
    url: str,
    stop_event: asyncio.Event,
    *,
    mode: PoolMode | None = None,
    owner: str | None = None,
    pool_timeout_s: float = POOL_TIMEOUT_S,
) -> None:
    """Serve the ``wq-maintenance`` queue (and defer its periodic tick) until stopped.

    procrastinate's worker polls (every 5 s) instead of LISTENing: its tick comes once a
    minute, and a LISTEN would need a session of its own (none through a transaction
    pooler), one more connection per worker.
    """
    app = make_procrastinate_app(url, mode=mode, owner=owner, pool_timeout_s=pool_timeout_s)
    async with app.open_async():
        task = asyncio.create_task(
            app.run_worker_async(
                queues=[MAINTENANCE_QUEUE],
                concurrency=1,
                install_signal_handlers=False,
                name="wq-maintenance",
                listen_notify=False,
            ),
            name="wq-maintenance",
        )
        stop = asyncio.create_task(stop_event.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when we are cancelled: procrastinate must finish its shutdown (it
            # unregisters its worker) before the app closes.
            stop.cancel()
            task.cancel()  # procrastinate stops gracefully on cancel (finishes a pass)
            await _outlive_cancel(task)


async def _outlive_cancel(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end, even when this coroutine is cancelled meanwhile (the
    cancel is raised once it ended); its own failure is raised as awaiting it would.

    Awaiting the task directly would pass a cancel of ours on to it: cancelled a second
    time while stopping, procrastinate's worker cancels its job loop in the middle of a
    wait and leaves that wait's tasks pending (asyncio logged "Task was destroyed but it
    is pending!" at every worker shutdown), and the app's pool would close under its
    unfinished shutdown."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    with contextlib.suppress(asyncio.CancelledError):  # the cancel it was asked to stop by
        task.result()  # its own failure goes on, as awaiting it would


async def maintain(
    url: str, stop_event: asyncio.Event, *, mode: PoolMode, owner: str, grace_s: float
) -> None:
    """A worker's maintenance service: the recovery pass served as procrastinate's
    periodic task (one per tick however many workers run), restarted after a failure and
    never fatal to the worker."""
    while not stop_event.is_set():
        try:
            await run_periodic_worker(
                url,
                stop_event,
                mode=mode,
                owner=owner,
                # Its stop (procrastinate unregisters its worker) waits for a pooled
                # connection at most this long: within the grace, in an outage too.
                pool_timeout_s=min(POOL_TIMEOUT_S, max(0.5, grace_s / 2)),
            )
        except Exception as exc:  # a maintenance failure must not stop execution
            log.warning("maintenance_failed", error=repr(exc)[:300])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), 5.0)
