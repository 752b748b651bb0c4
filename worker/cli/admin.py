"""Administration: the migration gate, the embedded database, metrics and the demo."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from queues import metrics as metrics_mod
from queues import migrations, totals
from queues.errors import InvalidField
from worker import config, db, demo_run, embedded, metrics_http
from worker.cli.common import (
    Conn,
    Duration,
    State,
    connected,
    emit_json,
    json_option,
    pass_state,
    run,
)

# What ends `worker migrate --hold`: a supervisor's stop.
HOLD_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@click.command()
@click.option("--check", is_flag=True, help="Only report pending migrations; exit 1 if any.")
@click.option(
    "--hold",
    is_flag=True,
    help="After migrating, stay up until SIGTERM or SIGINT, then exit 0 (for process "
    "managers that stop every process when one exits, such as honcho).",
)
@json_option
@pass_state
def migrate(state: State, check: bool, hold: bool, as_json: bool) -> None:
    """Bring procrastinate's schema and ours forward (the only command that runs DDL)."""
    if check and hold:
        raise InvalidField(
            "--check and --hold given together",
            field="--hold",
            rule="--hold follows a migration, --check applies none",
            fix="drop one of them",
        )
    if hold:
        # Blocked before any work, so a signal that arrives while migrating is not lost:
        # it ends the hold as soon as the migration is done.
        signal.pthread_sigmask(signal.SIG_BLOCK, HOLD_SIGNALS)

    async def go(conn: Conn) -> int:
        procrastinate = migrations.installed_procrastinate()
        contract = migrations.code_contract()
        data: dict[str, Any] = {
            "contract_version": contract.version,
            "contract_checksum": contract.checksum,
            "procrastinate_package": procrastinate.package,
        }
        if check:
            todo = await migrations.pending(conn)
            data |= {"pending": list(todo), "current": not todo}
            data["procrastinate_schema"] = procrastinate.version
            if as_json:
                emit_json(data)
            elif todo:
                click.echo(f"pending migrations ({len(todo)}):")
                for name in todo:
                    click.echo(f"  {name}")
            else:
                click.echo(
                    f"schema is current: version {contract.version} (checksum "
                    f"{contract.checksum}); procrastinate schema {procrastinate.version} "
                    f"(procrastinate {procrastinate.package})"
                )
            return 1 if todo else 0
        report = await migrations.migrate(conn)
        state.enable_embedded_logins()
        data |= {
            "applied": list(report.applied),
            "contract_version": report.contract.version,
            "contract_checksum": report.contract.checksum,
            "procrastinate_schema": report.procrastinate_version,
        }
        if as_json:
            emit_json(data)
            return 0
        click.echo(
            f"applied {len(report.applied)} migration(s); schema contract version "
            f"{report.contract.version} (checksum {report.contract.checksum}); procrastinate "
            f"schema {report.procrastinate_version} (procrastinate {procrastinate.package})"
        )
        for name in report.applied:
            click.echo(f"  {name}")
        return 0

    if not hold:
        connected(state, go, config.Purpose.MIGRATE)

    # Held: migrate on one connection, close it, then wait for the stop signal.
    async def migrate_once() -> int:
        async with db.session(state.url_for(config.Purpose.MIGRATE)) as conn:
            return await go(conn)

    run(migrate_once())
    click.echo("migration gate done; holding until SIGTERM or SIGINT", err=as_json)
    sys.stdout.flush()
    received = signal.sigwait(HOLD_SIGNALS)
    click.echo(f"migration gate stopped ({signal.Signals(received).name})", err=as_json)
    sys.exit(0)


@click.group("db")
def db_group() -> None:
    """Manage the embedded Postgres (used when no database URL is set)."""


@db_group.command("status")
@json_option
@pass_state
def db_status(state: State, as_json: bool) -> None:
    """Say whether the embedded server runs, and where (the URL without its password)."""
    status = embedded.status(state.home)
    data = {
        "running": status.running,
        "pid": status.pid,
        "port": status.port,
        "datadir": str(status.datadir),
        "major_version": status.major_version,
        "url": config.redact(status.url) if status.url else None,
        "secret_file": str(status.secret_file),
    }
    if as_json:
        emit_json(data)
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


ROLE_CHOICES = {
    "worker": config.Purpose.WORKER,
    "admission": config.Purpose.ADMISSION,
    "reader": config.Purpose.READ,
    "owner": config.Purpose.MIGRATE,
}


@db_group.command("url")
@click.option(
    "--role",
    type=click.Choice(sorted(ROLE_CHOICES)),
    default="worker",
    show_default=True,
    help="Whose URL: worker (workers, operator actions), admission (admits only), reader "
    "(read only), owner (the superuser: `worker migrate` only).",
)
@json_option
@pass_state
def db_url(state: State, role: str, as_json: bool) -> None:
    """Print an embedded server URL with its password, starting the server if needed.

    The roles log in once `worker migrate` has run."""
    server = embedded.ensure_running(state.home)
    url = server.url(role=config.EMBEDDED_ROLES[ROLE_CHOICES[role]])
    if as_json:
        emit_json({"role": role, "url": url})
    else:
        click.echo(url)


@db_group.command("stop")
@json_option
@pass_state
def db_stop(state: State, as_json: bool) -> None:
    """Stop the embedded server."""
    stopped = embedded.stop(state.home)
    if as_json:
        emit_json({"stopped": stopped})
    else:
        click.echo("stopped" if stopped else "not running")


@click.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "prometheus"]),
    default="text",
    show_default=True,
    help="Output format (--json is the same as --format json).",
)
@click.option(
    "--window",
    type=Duration(minimum=1, maximum=30 * 86400),
    default="1h",
    show_default=True,
    help="Attempt history for the rescue and stale-write counts.",
)
@json_option
@pass_state
def metrics(state: State, fmt: str, window: float, as_json: bool) -> None:
    """Queue depth, live workers, lease rescues, stale writes refused, stranded runs."""
    if as_json:
        fmt = "json"

    async def go(conn: Conn) -> int:
        found = await metrics_mod.collect(conn, window_s=window)
        if fmt == "json":
            emit_json(found.as_dict())
        elif fmt == "prometheus":
            # The families /metrics serves from the database, with HELP and TYPE.
            click.echo(metrics_http.exposition(await totals.read(conn), found), nl=False)
        else:
            for m in found.lanes:
                click.echo(
                    f"{m.lane:<24} {m.lane_state:<10} queued={m.queued} running={m.running} "
                    f"sleeping={m.sleeping} due_jobs={m.due_jobs} workers={m.live_workers} "
                    f"oldest_due_wait={m.oldest_due_wait_s:.1f}s"
                )
            a = found.attempts
            click.echo(
                f"last {window:g}s: lease rescues {a.lease_rescues}, stale writes refused "
                f"{a.stale_writes_refused}, failed {a.failed_attempts}, succeeded "
                f"{a.succeeded_attempts}, handed back {a.handed_back}, interrupted "
                f"{a.interrupted_attempts}"
            )
            for r in found.refusals:
                click.echo(f"  refused {r.kind}: {r.writes} write(s), {r.rows} row(s)")
            for s in found.stranded:
                click.echo(f"stranded: {s.lane} {s.runs} run(s), oldest {s.oldest_wait_s:.0f}s")
        return 0

    connected(state, go, config.Purpose.READ)


@click.command()
@click.option(
    "--rows",
    type=click.IntRange(1, 3000),
    default=3000,
    show_default=True,
    help="How many sample rows to enrich.",
)
@pass_state
def demo(state: State, rows: int) -> None:
    """Migrate, start a worker, enrich a bundled sample live, summarise, shut down."""
    sys.exit(
        run(
            demo_run.run_demo(
                state.url_for,
                rows=rows,
                echo=click.echo,
                token_secret=config.token_secret(state.explicit_url, home=state.home),
                after_migrate=state.enable_embedded_logins,
            )
        )
    )

