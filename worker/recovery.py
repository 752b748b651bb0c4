"""The recovery process: when and where ``queues.recovery.run_once`` runs.

Three ways in, one pass underneath:

- ``worker recover --every 60s`` (the Procfile's ``recovery`` process): ``recover_forever``,
  an interval with jitter, one ``recovery_pass`` log line per pass, and a prompt next pass
  while a part keeps filling its batch;
- ``worker recover --once``: one pass, printed (or ``--json``);
- a procrastinate periodic task (``make_procrastinate_app``) on the ``wq-maintenance``
  queue, deferred once per minute however many workers run the deferrer: procrastinate's
  ``procrastinate_periodic_defers`` unique (task, periodic id, tick) keeps one job a tick.

Passes are safe to run at the same time from several hosts (SKIP LOCKED), so the three
can coexist. ``worker queues adopt`` is the operator's explicit move of a lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

import click
import procrastinate
import psycopg
import structlog

from queues import lanes, migrations, recovery
from queues.errors import DatabaseUnreachable, InvalidField
from worker import db

log = structlog.get_logger("worker.recovery")

MAINTENANCE_QUEUE = "wq-maintenance"
PERIODIC_ID = "wq-recovery"
TASK_NAME = "wq.recovery"
JITTER = 0.1  # each interval is every_s * (1 +- JITTER), so hosts drift apart
_DURATION = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class _HasUrl(Protocol):
    """What the commands need of the CLI's ``State`` (``ctx.obj``)."""

    @property
    def url(self) -> str: ...


def parse_duration(text: str, *, field: str = "--every") -> float:
    """Seconds in ``60s``, ``5m``, ``1h``, ``500ms`` or a bare number of seconds."""
    match = _DURATION.match(text)
    seconds = float(match["n"]) * _UNIT_S[match["unit"] or "s"] if match else 0.0
    if seconds <= 0:
        raise InvalidField(
            f"invalid duration {text!r}",
            field=field,
            rule="a positive number with an optional unit: ms, s (the default), m or h",
            fix=f"pass e.g. {field} 60s, {field} 5m or {field} 1h",
        )
    return seconds


def jittered(every_s: float, *, rng: random.Random | None = None) -> float:
    return every_s * (rng or random).uniform(1 - JITTER, 1 + JITTER)


def _log_pass(report: recovery.RecoveryReport, duration_ms: float) -> None:
    log.info(
        "recovery_pass",
        duration_ms=round(duration_ms, 3),
        saturated=report.saturated,
        reprepared=list(report.reprepared),
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
) -> recovery.RecoveryReport:
    """One pass on a fresh connection, after verifying the schema contract."""
    conn = await db.connect(url, autocommit=True)
    async with conn:
        await migrations.verify_contract(conn, url=url)
        started = asyncio.get_running_loop().time()
        report = await recovery.run_once(conn, batch=batch, stranded_after_s=stranded_after_s)
        _log_pass(report, (asyncio.get_running_loop().time() - started) * 1000)
    return report


async def recover_forever(
    url: str,
    every_s: float,
    stop_event: asyncio.Event,
    *,
    batch: int = recovery.DEFAULT_BATCH,
    stranded_after_s: float = recovery.DEFAULT_STRANDED_AFTER_S,
    on_pass: Callable[[recovery.RecoveryReport], None] | None = None,
    rng: random.Random | None = None,
) -> int:
    """Run passes every ``every_s`` (with jitter) until ``stop_event``; returns the passes.

    A pass that filled a batch is followed at once by another. A database error is logged
    and the connection replaced at the next pass; a schema mismatch is raised (loudly).
    """
    passes = 0
    conn: psycopg.AsyncConnection[Any] | None = None
    loop = asyncio.get_running_loop()
    try:
        while not stop_event.is_set():
            delay = jittered(every_s, rng=rng)
            try:
                if conn is None or conn.closed:
                    conn = await db.connect(url, autocommit=True)
                    await migrations.verify_contract(conn, url=url)
                started = loop.time()
                report = await recovery.run_once(
                    conn, batch=batch, stranded_after_s=stranded_after_s
                )
                passes += 1
                _log_pass(report, (loop.time() - started) * 1000)
                if on_pass is not None:
                    on_pass(report)
                if report.saturated:
                    delay = 0.0
            except (psycopg.Error, DatabaseUnreachable) as exc:
                # Postgres restarting, a killed backend: retry at the next pass.
                log.warning("recovery_pass_failed", error=repr(exc), retry_in_s=round(delay, 1))
                if conn is not None:
                    await conn.close()
                conn = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), delay)
    finally:
        if conn is not None:
            await conn.close()
    return passes


# ---- procrastinate periodic task ----------------------------------------------------------


def make_procrastinate_app(url: str) -> procrastinate.App:
    """A procrastinate app whose periodic task runs one recovery pass every minute.

    Run it with ``app.run_worker_async(queues=[MAINTENANCE_QUEUE], ...)`` inside
    ``app.open_async()``: its worker defers the tick (once per tick across all workers)
    and executes the job.
    """
    # A short pool timeout: while the database is away the maintenance worker must fail
    # fast (and be restarted by the worker's loop), never hold the worker's shutdown.
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=url, timeout=5.0, kwargs={"connect_timeout": 5}
        )
    )

    @app.periodic(cron="* * * * *", periodic_id=PERIODIC_ID)
    @app.task(name=TASK_NAME, queue=MAINTENANCE_QUEUE)
    async def recovery_tick(timestamp: int) -> dict[str, int]:
        report = await recover_once(url)
        log.info("recovery_tick", tick=timestamp)
        return report.counts()

    return app


async def run_periodic_worker(url: str, stop_event: asyncio.Event) -> None:
    """Serve the ``wq-maintenance`` queue (and defer its periodic tick) until stopped."""
    app = make_procrastinate_app(url)
    async with app.open_async():
        task = asyncio.create_task(
            app.run_worker_async(
                queues=[MAINTENANCE_QUEUE],
                concurrency=1,
                install_signal_handlers=False,
                name="wq-maintenance",
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
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ---- CLI ----------------------------------------------------------------------------------


def _echo_report(report: recovery.RecoveryReport) -> None:
    c = report.counts()
    click.echo(
        f"lease expired: {c['lease_expired']} (retried {c['retried']}, failed {c['failed']}, "
        f"cancelled {c['cancelled']})"
    )
    click.echo(
        f"respawned: {c['respawned']} (orphans {c['orphans']}, due sleepers "
        f"{c['due_sleepers']}, woken waiters {c['woken_waiters']})"
    )
    if report.reprepared:
        click.echo(f"lanes re-prepared: {', '.join(report.reprepared)}")
    click.echo(f"retention: deleted {c['deleted_runs']} run(s), {c['deleted_jobs']} job(s)")
    if report.saturated:
        click.echo("more work is waiting: run again (a batch was full)")
    if not report.stranded:
        click.echo("stranded: none")
    for s in report.stranded:
        click.echo(
            f"stranded: lane {s.lane} ({s.lane_state}) has {s.runs} unfinished run(s), "
            f"{s.runnable} runnable, oldest waiting {s.oldest_wait_s:.0f}s and no live worker; "
            f"start `worker start --release {s.release}` or move them with "
            f"`worker queues adopt {s.release} NEW_RELEASE`"
        )


@click.command("recover")
@click.option("--once", is_flag=True, help="Run one pass and exit (the default).")
@click.option(
    "--every",
    "every",
    default=None,
    metavar="DURATION",
    help="Run a pass every DURATION (e.g. 60s, 5m, 1h) until SIGTERM.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=recovery.DEFAULT_BATCH,
    show_default=True,
    help="Runs per part per pass.",
)
@click.option(
    "--stranded-after",
    "stranded_after",
    default="60s",
    show_default=True,
    metavar="DURATION",
    help="Report a lane once a run waited this long on it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one line per pass).")
@click.pass_obj
def recover_command(
    state: _HasUrl,
    once: bool,
    every: str | None,
    batch: int,
    stranded_after: str,
    as_json: bool,
) -> None:
    """Rescue lapsed leases and orphaned runs, clean up, report stranded lanes."""
    if once and every is not None:
        raise InvalidField(
            "--once and --every both given",
            field="--every",
            rule="one pass (--once) or a loop (--every DURATION)",
            fix="drop one of them",
        )
    after_s = parse_duration(stranded_after, field="--stranded-after")

    def show(report: recovery.RecoveryReport) -> None:
        if as_json:
            click.echo(json.dumps(report.as_dict(), default=str, sort_keys=True))
        else:
            _echo_report(report)

    if every is None:
        show(asyncio.run(recover_once(state.url, batch=batch, stranded_after_s=after_s)))
        sys.exit(0)
    every_s = parse_duration(every)

    async def loop() -> int:
        stop = asyncio.Event()
        running = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                running.add_signal_handler(sig, stop.set)
        log.info("recovery_started", every_s=every_s, batch=batch)
        passes = await recover_forever(
            state.url,
            every_s,
            stop,
            batch=batch,
            stranded_after_s=after_s,
            on_pass=show if as_json else None,
        )
        log.info("recovery_stopped", passes=passes)
        return 0

    sys.exit(asyncio.run(loop()))


@click.command("adopt")
@click.argument("from_release", metavar="FROM_RELEASE")
@click.argument("to_release", metavar="TO_RELEASE")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def adopt_command(state: _HasUrl, from_release: str, to_release: str, as_json: bool) -> None:
    """Move FROM_RELEASE's unfinished runs to TO_RELEASE's lane (explicit, never automatic)."""
    lanes.validate_release(from_release, field="FROM_RELEASE")
    lanes.validate_release(to_release, field="TO_RELEASE")

    async def go() -> int:
        conn = await db.connect(state.url, autocommit=True)
        async with conn:
            await migrations.verify_contract(conn, url=state.url)
            return await recovery.adopt(conn, from_release=from_release, to_release=to_release)

    moved = asyncio.run(go())
    from_lane, to_lane = lanes.lane_name(from_release), lanes.lane_name(to_release)
    log.info("lane_adopted", from_lane=from_lane, to_lane=to_lane, runs=moved)
    if as_json:
        click.echo(
            json.dumps({"from_lane": from_lane, "to_lane": to_lane, "moved": moved}, sort_keys=True)
        )
    else:
        click.echo(
            f"moved {moved} unfinished run(s) from lane {from_lane} to {to_lane}; "
            f"a worker of release {to_release} runs them"
        )
    sys.exit(0)
