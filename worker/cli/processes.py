"""The long-running processes: the worker, the recovery loop and the runtime gateway.

These log at INFO by default (they are services); every other command is quiet unless
``-v`` is given. Each first hands its secrets off (:func:`worker.config.hand_off_secrets`):
started with a database URL or the token secret in its environment, it re-executes
itself without them, so its ``/proc/PID/environ`` holds no password and no secret."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import structlog
from psycopg_pool import AsyncConnectionPool

from queues import lanes, migrations, operations, recovery
from queues.errors import InvalidField
from worker import (
    config,
    connections,
    db,
    gateway,
    metrics_http,
    producer,
    projector,
    runtime,
    slots,
    stopping,
)
from worker import recovery as worker_recovery
from worker.cli.common import (
    Duration,
    State,
    emit_json,
    json_option,
    load_app,
    max_outage_option,
    pass_state,
    run,
)
from worker.outage import Downtime

log = structlog.get_logger("worker.cli")


def wait_for_schema_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--wait-for-schema DURATION``, shared by ``worker start`` and ``worker recover``."""
    return click.option(
        "--wait-for-schema",
        "wait_for_schema",
        type=Duration(),
        default=None,
        help="While the database is behind this release's schema, wait up to DURATION "
        "(e.g. 60s) for the migration gate instead of refusing at once.",
    )(f)


def metrics_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--metrics-port`` and ``--metrics-host``, shared by ``worker start`` and ``recover``."""
    f = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        help="Interface /metrics binds (0.0.0.0 for a scraper on another host).",
    )(f)
    return click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port).",
    )(f)


def _wait_for_schema(url: str, timeout_s: float) -> None:
    """Wait for this release's schema (``--wait-for-schema``). A stop signal meanwhile
    ends the process at once with exit 0: nothing was started, and a supervisor that stops
    the whole system before the migration finished (honcho on Ctrl-C) sees a clean stop,
    not a death by SIGTERM."""

    async def wait() -> bool:
        stop = asyncio.Event()
        stopping.on_stop_signals(stop.set)
        waiting = asyncio.ensure_future(db.wait_for_contract(url, timeout_s=timeout_s))
        stopped = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if waiting in done:
            waiting.result()  # the mismatch, when the wait gave up
            return True
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        return False

    if not run(wait()):
        log.info("schema_wait_stopped")
        sys.exit(0)


# ---- worker start ------------------------------------------------------------------------------


@click.command()
@click.option(
    "--release",
    default=None,
    help="Release (lane) to serve (default: $WORKER_RELEASE, a platform commit, or dev).",
)
@click.option("--app", "app", default=None, help="module:attribute of your play Registry.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    default=None,
    help="Runs at once (default: the lane's policy).",
)
@click.option("--adopt", multiple=True, help="Also consume this release's lane (repeatable).")
@click.option(
    "--prefetch",
    type=click.IntRange(0, runtime.PREFETCH_MAX),
    default=0,
    show_default=True,
    envvar="WORKER_PREFETCH",
    help="The high-throughput mode: claim up to N runs ahead into a local queue beyond "
    "the free slots ($WORKER_PREFETCH). For short runs: a run claimed ahead is leased, "
    "and its timeout counts, from its claim. docs/explanation/execution.md.",
)
@click.option(
    "--claim-ahead-under",
    "claim_ahead_under",
    type=Duration(maximum=runtime.CLAIM_AHEAD_UNDER_MAX_S, zero=True),
    default=runtime.CLAIM_AHEAD_UNDER_S,
    show_default=True,
    envvar="WORKER_CLAIM_AHEAD_UNDER",
    help="With --prefetch 0: while plays return within this duration, also claim up to "
    f"{slots.AHEAD_PER_SLOT} times --concurrency runs ahead; one waiting over "
    f"{producer.AHEAD_HOLD_FACTOR} times this goes back to the lane "
    "($WORKER_CLAIM_AHEAD_UNDER; 0: never). docs/explanation/execution.md.",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write this file once the worker is ready.",
)
@click.option(
    "--max-outage",
    type=Duration(minimum=1, maximum=86400),
    default="60s",
    show_default=True,
    help="Ride out a lost database (a restart, a failover to a standby) this long: every "
    "loop reconnects and running plays' calls are sent again; past it, stop at once and "
    "exit 6 (DATABASE_LOST) for the supervisor to restart the worker.",
)
@click.option(
    "--grace",
    type=Duration(maximum=3600, zero=True),
    default="4s",
    show_default=True,
    help="How long running attempts get to finish on SIGTERM before hand-back; the "
    "worker exits within it (and a second more for the hand-backs while the database "
    "answers; in an outage, none).",
)
@click.option(
    "--gateway-url",
    default=None,
    metavar="URL",
    help="The runtime gateway sandboxed plays call, a Unix socket: unix:/path/to/socket "
    "(`worker gateway --socket PATH`; a sandbox has no network). Default: one served by "
    "this worker on a private socket.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 100_000),
    default=None,
    envvar=connections.MAX_CONNECTIONS_VARIABLE,
    help="Cap this worker's database connections, all parts together (default: "
    "concurrency + 9; $WORKER_MAX_CONNECTIONS). docs/explanation/scaling.md.",
)
@click.option(
    "--listen-url",
    default=None,
    metavar="URL",
    help="LISTEN for new runs and cancels on this URL, a direct or session-mode one "
    "(default: $WORKER_LISTEN_URL, else the database URL unless it is a transaction "
    "pooler: then the worker polls every second).",
)
@click.option(
    "--pool-mode",
    type=click.Choice([m.value for m in config.PoolMode]),
    default=None,
    help="transaction: the database URL goes through PgBouncer in transaction mode (no "
    "prepared statements, no LISTEN on it). Default: $WORKER_POOL_MODE, else session.",
)
@wait_for_schema_option
@metrics_options
@pass_state
def start(
    state: State,
    release: str | None,
    app: str | None,
    concurrency: int | None,
    adopt: tuple[str, ...],
    prefetch: int,
    claim_ahead_under: float,
    ready_file: Path | None,
    max_outage: float,
    grace: float,
    gateway_url: str | None,
    max_connections: int | None,
    listen_url: str | None,
    pool_mode: str | None,
    wait_for_schema: float | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Verify the schema, prepare the lane, report ready, then execute runs."""
    stopping.latch()  # a stop while starting up is a clean stop (worker.stopping)
    config.hand_off_secrets()
    rel = lanes.validate_release(
        config.default_release() if release is None else release, field="--release"
    )
    mode = config.PoolMode(pool_mode) if pool_mode else config.pool_mode()
    listen = (
        config.validate_url(listen_url, source="--listen-url")
        if listen_url
        else config.listen_url()
    )
    connections.check_cap(
        max_connections, listening=listen is not None or mode is config.PoolMode.SESSION
    )
    adopted = tuple(lanes.validate_release(other, field="--adopt") for other in adopt)
    registry = load_app(app)
    if wait_for_schema is not None:
        _wait_for_schema(state.url, wait_for_schema)
    secret = (
        config.token_secret(state.explicit_url, home=state.home) if registry.sandboxed() else None
    )
    settings = runtime.Settings(
        url=state.url,
        release=rel,
        registry=registry,
        concurrency=concurrency,
        adopt=adopted,
        ready_file=ready_file,
        grace_s=grace,
        max_outage_s=max_outage,
        token_secret=secret,
        gateway_url=gateway_url,
        max_connections=max_connections,
        listen_url=listen,
        pool_mode=mode,
        prefetch=prefetch,
        claim_ahead_under_s=claim_ahead_under,
        sandbox_hidden=(state.home,) if state.home is not None else (),
    )
    # The worker has its URL: its plays inherit no database credentials from it.
    config.scrub_worker_urls()
    with metrics_http.serving(state.url, metrics_port, metrics_host):
        code = run(runtime.serve(settings))
    sys.exit(code)


# ---- worker recover ----------------------------------------------------------------------------


def _echo_report(report: recovery.RecoveryReport) -> None:
    c = report.counts()
    click.echo(
        f"lease expired: {c['lease_expired']} (retried {c['retried']}, failed {c['failed']}, "
        f"cancelled {c['cancelled']})"
    )
    click.echo(
        f"respawned: {c['respawned']} (orphans {c['orphans']}, cleanups {c['cleanups']}, "
        f"due sleepers {c['due_sleepers']}, woken waiters {c['woken_waiters']})"
    )
    if report.closed_lanes:
        click.echo(f"served on closed lanes (not reopened): {', '.join(report.closed_lanes)}")
    click.echo(
        f"retention: deleted {c['deleted_runs']} run(s), {c['deleted_jobs']} job(s), "
        f"{c['deleted_events']} event(s)"
    )
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
    type=Duration(),
    default=None,
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
    type=Duration(),
    default="60s",
    show_default=True,
    help="Report a lane once a run waited this long on it.",
)
@click.option(
    "--event-retention",
    "event_retention",
    type=Duration(),
    default="7d",
    show_default=True,
    help="Delete emitted events (and the refused-write log) older than this.",
)
@max_outage_option("With --every: ")
@json_option
@wait_for_schema_option
@metrics_options
@pass_state
def recover_command(
    state: State,
    once: bool,
    every: float | None,
    batch: int,
    stranded_after: float,
    event_retention: float,
    max_outage: float,
    as_json: bool,
    wait_for_schema: float | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Rescue lapsed leases and orphaned runs, clean up, report stranded lanes.

    With --every, a lost database (a restart, a failover) is ridden out for up to
    --max-outage (the pass runs again as soon as it answers), then the process exits 6
    (DATABASE_LOST)."""
    config.hand_off_secrets()
    if once and every is not None:
        raise InvalidField(
            "--once and --every both given",
            field="--every",
            rule="one pass (--once) or a loop (--every DURATION)",
            fix="drop one of them",
        )
    if metrics_port is not None and every is None:
        raise InvalidField(
            "--metrics-port given for a single pass",
            field="--metrics-port",
            rule="metrics are served by a process that stays up: --every DURATION",
            fix="add --every 60s, or drop --metrics-port",
        )
    if every is not None:
        stopping.latch()  # a service: a stop while it starts up is a clean stop
    if wait_for_schema is not None:
        _wait_for_schema(state.url, wait_for_schema)

    def show(report: recovery.RecoveryReport) -> None:
        if as_json:
            emit_json(report.as_dict())
        else:
            _echo_report(report)

    if every is None:
        show(
            run(
                worker_recovery.recover_once(
                    state.url,
                    batch=batch,
                    stranded_after_s=stranded_after,
                    event_retention_s=event_retention,
                )
            )
        )
        sys.exit(0)

    async def loop(every_s: float) -> int:
        stop = asyncio.Event()
        stopping.on_stop_signals(stop.set)
        log.info("recovery_started", every_s=every_s, batch=batch, max_outage_s=max_outage)
        # One account of an outage for the passes and the projector: past --max-outage
        # the process stops and exits 6 (worker.outage).
        downtime = Downtime(max_outage, on_lost=lambda _lost: stop.set())
        # The ledger's outbox, alongside.
        projecting = projector.start(state.url, stop, downtime=downtime)
        try:
            passes = await worker_recovery.recover_forever(
                state.url,
                every_s,
                stop,
                batch=batch,
                stranded_after_s=stranded_after,
                event_retention_s=event_retention,
                on_pass=show if as_json else None,
                downtime=downtime,
            )
        finally:
            stop.set()
            await projecting
            if downtime.lost is not None:
                log.error("recovery_database_lost", error=downtime.lost.message)
        if downtime.lost is not None:
            raise downtime.lost
        log.info("recovery_stopped", passes=passes)
        return 0

    with metrics_http.serving(state.url, metrics_port, metrics_host):
        code = run(loop(every))
    sys.exit(code)


# ---- worker gateway ----------------------------------------------------------------------------


@click.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=8085, show_default=True)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Serve on this Unix socket instead of a TCP port (what sandboxes reach: pass "
    "`worker start --gateway-url unix:PATH`).",
)
@click.option(
    "--without-action",
    "without",
    multiple=True,
    metavar="ACTION",
    help="Do not serve ACTION (repeatable): pins an older receiver during a rollout.",
)
@pass_state
def gateway_command(
    state: State, host: str, port: int, socket_path: Path | None, without: tuple[str, ...]
) -> None:
    """Serve the runtime gateway: POST /runtime with an attempt token (sandboxed plays)."""
    stopping.latch()
    config.hand_off_secrets()
    unknown = sorted(set(without) - operations.SERVED_ACTIONS)
    if unknown:
        raise InvalidField(
            f"unknown action(s) {', '.join(unknown)}",
            field="--without-action",
            rule=f"one of {', '.join(sorted(operations.SERVED_ACTIONS))}",
            fix="name an action this release serves",
        )
    secret = config.token_secret(state.explicit_url, home=state.home)
    url = state.url_for(config.Purpose.WORKER)
    served = operations.SERVED_ACTIONS - set(without)

    async def serve() -> int:
        stop = asyncio.Event()
        stopping.on_stop_signals(stop.set)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=10,
            open=False,
            kwargs={"autocommit": True, **db.connect_kwargs(url, application="wq-gateway")},
        )
        await pool.open(wait=True, timeout=30)
        try:
            async with db.session(url) as conn:
                await migrations.verify_contract(conn)
            served_app = gateway.Served(
                gateway.make_app(pool, secret=secret, served=served),
                host=host,
                port=port,
                uds=str(socket_path.absolute()) if socket_path is not None else None,
            )
            at = await served_app.start()
            log.info("gateway_ready", url=at, actions=len(served))
            click.echo(f"gateway serving on {at}", err=True)
            await stop.wait()
            await served_app.stop()
        finally:
            await pool.close()
        return 0

    sys.exit(run(serve()))
