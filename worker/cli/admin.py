"""Administration: the migration gate, the embedded database, metrics and the demo."""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import Any

import click

from queues import metrics as metrics_mod
from queues import migrations, totals
from queues.errors import InvalidField
from worker import config, db, embedded, metrics_http
from worker.cli.common import (
    Conn,
    Duration,
    State,
    actor,
    connected,
    emit_json,
    json_option,
    pass_state,
    run,
)

# What ends `worker migrate --hold`: a supervisor's stop.
HOLD_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@click.command()
@click.option(
    "--check",
    is_flag=True,
    help="Only report the pending steps, their kind (expand or contract) and what blocks "
    "each contract step; exit 1 if anything is pending.",
)
@click.option(
    "--contract",
    "want_contract",
    is_flag=True,
    help="Apply the pending contract steps too, or fail (CONTRACT_BLOCKED_BY_LANES) while "
    "lanes of older releases still need what they remove. Without it, a blocked contract "
    "step is deferred with a warning and the command exits 0.",
)
@click.option(
    "--force",
    is_flag=True,
    help="With --contract: apply contract steps over their blockers (needs --reason; "
    "recorded in the audit trail). The older lanes' runs may then fail.",
)
@click.option("--reason", default=None, help="Why a forced contract step is safe (audited).")
@click.option(
    "--hold",
    is_flag=True,
    help="After migrating, stay up until SIGTERM or SIGINT, then exit 0 (for process "
    "managers that stop every process when one exits, such as honcho).",
)
@json_option
@pass_state
def migrate(
    state: State,
    check: bool,
    want_contract: bool,
    force: bool,
    reason: str | None,
    hold: bool,
    as_json: bool,
) -> None:
    """Bring procrastinate's schema and ours forward (the only command that runs DDL).

    Expand steps are applied at once. A contract step waits while lanes of older releases
    have unfinished runs or live workers: it is deferred (exit 0, with a warning naming
    them) and the next `worker migrate` applies it once they are gone. Run by a release
    older than the database, it applies nothing while the database still serves that
    release, and refuses (SCHEMA_WINDOW_CLOSED) once a contract step left it behind.
    """
    if check and hold:
        raise InvalidField(
            "--check and --hold given together",
            field="--hold",
            rule="--hold follows a migration, --check applies none",
            fix="drop one of them",
        )
    if force and not want_contract:
        raise InvalidField(
            "--force without --contract",
            field="--force",
            rule="--force overrides the blockers of contract steps, which --contract asks for",
            fix="pass --contract --force --reason TEXT",
        )
    if force and not (reason and reason.strip()):
        raise InvalidField(
            "--force without --reason",
            field="--reason",
            rule="a forced contract step is audited with who and why",
            fix="say why the older lanes may lose what the step removes: --reason TEXT",
        )
    if check and want_contract:
        raise InvalidField(
            "--check and --contract given together",
            field="--contract",
            rule="--check applies nothing; it already reports the contract steps",
            fix="drop one of them",
        )
    if hold:
        # Blocked before any work, so a signal that arrives while migrating is not lost:
        # it ends the hold as soon as the migration is done.
        signal.pthread_sigmask(signal.SIG_BLOCK, HOLD_SIGNALS)

    async def go(conn: Conn) -> int:
        procrastinate = migrations.installed_procrastinate()
        contract = migrations.code_contract()
        schema = migrations.code_schema()
        data: dict[str, Any] = {
            "release": migrations.code_release(),
            "schema_version": schema.version,
            "contract_version": contract.version,
            "contract_checksum": contract.checksum,
            "procrastinate_package": procrastinate.package,
        }
        if check:
            return _check(await migrations.plan(conn), data, as_json)
        report = await migrations.migrate(
            conn, contract=want_contract, force=force, actor=actor(), reason=reason
        )
        state.enable_embedded_logins()
        data |= {
            "applied": list(report.applied),
            "deferred": list(report.deferred),
            "blocked_by": [dataclasses.asdict(b) for b in report.blocked_by],
            "forced": report.forced,
            "newer": list(report.newer),
            "newer_release": report.newer_release,
            "database_contract_version": report.contract.version,
            "database_contract_checksum": report.contract.checksum,
            "procrastinate_schema": report.procrastinate_version,
        }
        if report.deferred:
            blocked = migrations.blocked_error(report.deferred[0], report.blocked_by, [])
            click.echo(f"warning[{blocked.code}]: {blocked.render()}", err=True)
        if as_json:
            emit_json(data)
            return 0
        if report.newer:
            click.echo(
                f"nothing to apply: the database is at a newer release's schema (version "
                f"{report.contract.version}, release {report.newer_release or '?'}; "
                f"{len(report.newer)} migration(s) newer than this code), which still serves "
                f"this release ({migrations.code_release()}, schema {schema.version})"
            )
            return 0
        click.echo(
            f"applied {len(report.applied)} migration(s); schema contract version "
            f"{report.contract.version} (checksum {report.contract.checksum}); procrastinate "
            f"schema {report.procrastinate_version} (procrastinate {procrastinate.package})"
        )
        for name in report.applied:
            click.echo(f"  {name}")
        if report.deferred:
            click.echo(f"deferred ({len(report.deferred)}), waiting for older lanes:")
            for name in report.deferred:
                click.echo(f"  {name}")
        if report.forced:
            click.echo("contract step(s) forced over their blockers (audited)")
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


def _check(plan: migrations.Plan, data: dict[str, Any], as_json: bool) -> int:
    """`worker migrate --check`: the pending steps, their kinds and blockers; 1 if any."""
    todo = plan.steps
    data |= {
        # The names, as before the window (tools read this list); the steps with their
        # kinds and blockers beside it.
        "pending": [step.name for step in todo],
        "steps": [
            {
                "name": step.name,
                "kind": step.kind,
                "blocked_by": [b.lane for b in step.blocked_by],
                "blockers": [dataclasses.asdict(b) for b in step.blocked_by],
            }
            for step in todo
        ],
        "current": not todo,
        "newer": list(plan.newer),
        "newer_release": plan.recorded.release if plan.recorded else None,
        "floor": plan.recorded.floor if plan.recorded else 0,
    }
    data["procrastinate_schema"] = migrations.installed_procrastinate().version
    if as_json:
        emit_json(data)
    elif todo:
        click.echo(f"pending migrations ({len(todo)}):")
        waits = False
        for step in todo:
            if step.blocked_by:
                waits = True
                lanes_text = "; ".join(b.describe() for b in step.blocked_by)
                click.echo(f"  {step.name} [{step.kind}] blocked by {lanes_text}")
            elif waits and step.kind == migrations.CONTRACT:
                click.echo(f"  {step.name} [{step.kind}] waits with the step before it")
            else:
                click.echo(f"  {step.name} [{step.kind}]")
    elif plan.newer:
        click.echo(
            f"nothing to apply: the database is at a newer release's schema (release "
            f"{data['newer_release'] or '?'}; {len(plan.newer)} migration(s) newer than this "
            f"code), which still serves this release (schema {data['schema_version']})"
        )
    else:
        click.echo(
            f"schema is current: version {data['contract_version']} (checksum "
            f"{data['contract_checksum']}); procrastinate schema {data['procrastinate_schema']} "
            f"(procrastinate {data['procrastinate_package']})"
        )
    return 1 if todo else 0


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
    from worker import demo_run  # it imports the whole runtime: the other commands here don't

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
