"""The ``worker`` command line: thin wrappers over ``queues`` and the runtime.

Errors the project raises on purpose print as ``error[CODE]: message`` and exit 2 for bad
input, 1 for other failures; never a traceback for an expected failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import psycopg
from click.core import ParameterSource

from queues import admission, inputs, lanes, migrations, runs
from queues import metrics as metrics_mod
from queues.errors import InvalidField, WorkerError, translate
from worker import config, db, demo_run, embedded, logs, observe, plays, recovery, runtime

T = TypeVar("T")


class State:
    def __init__(self, database_url: str | None, home: Path | None) -> None:
        self.explicit_url = database_url
        self.home = home
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            self._url = config.resolve_url(self.explicit_url, home=self.home)
        return self._url


pass_state = click.make_pass_decorator(State)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


Conn = psycopg.AsyncConnection[Any]


def connected(state: State, go: Callable[[Conn], Awaitable[int]]) -> NoReturn:
    """Run ``go`` on one autocommit connection to the database and exit with its code."""

    async def main() -> int:
        conn = await db.connect(state.url, autocommit=True)
        async with conn:
            return await go(conn)

    sys.exit(asyncio.run(main()))


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str, sort_keys=True))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--database-url",
    help="Postgres URL (default: $DATABASE_URL, else the embedded database).",
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="WORKER_HOME",
    help="Directory of the embedded database (default: $WORKER_HOME or a per-user dir).",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Minimum level of log lines.",
)
@click.option("--json-logs/--console-logs", default=None, help="Force the log format.")
@click.pass_context
def cli(
    ctx: click.Context,
    database_url: str | None,
    home: Path | None,
    log_level: str,
    json_logs: bool | None,
) -> None:
    """A durable, release-pinned task-queue worker on Postgres."""
    logs.configure(level=log_level, json=json_logs)
    ctx.obj = State(database_url, home)


@cli.command()
@click.option("--check", is_flag=True, help="Only report pending migrations; exit 1 if any.")
@pass_state
def migrate(state: State, check: bool) -> None:
    """Apply procrastinate's schema and ours (the only command that runs DDL)."""

    async def go(conn: Conn) -> int:
        if check:
            todo = await migrations.pending(conn)
            if todo:
                click.echo(f"pending migrations ({len(todo)}):")
                for name in todo:
                    click.echo(f"  {name}")
                return 1
            contract = migrations.code_contract()
            click.echo(
                f"schema is current: version {contract.version} (checksum {contract.checksum})"
            )
            return 0
        report = await migrations.migrate(conn)
        click.echo(
            f"applied {len(report.applied)} migration(s); schema contract version "
            f"{report.contract.version} (checksum {report.contract.checksum})"
        )
        for name in report.applied:
            click.echo(f"  {name}")
        return 0

    connected(state, go)


@cli.group("db")
def db_group() -> None:
    """Manage the embedded Postgres (used when no database URL is set)."""


@db_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def db_status(state: State, as_json: bool) -> None:
    """Say whether the embedded server runs, and where."""
    status = embedded.status(state.home)
    data = {
        "running": status.running,
        "pid": status.pid,
        "port": status.port,
        "datadir": str(status.datadir),
        "major_version": status.major_version,
        "url": status.url,
    }
    if as_json:
        emit_json(data)
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


@db_group.command("url")
@pass_state
def db_url(state: State) -> None:
    """Print the embedded server's URL, starting it if needed."""
    click.echo(embedded.ensure_running(state.home).url())


@db_group.command("stop")
@pass_state
def db_stop(state: State) -> None:
    """Stop the embedded server."""
    stopped = embedded.stop(state.home)
    click.echo("stopped" if stopped else "not running")


# ---- scheduler --------------------------------------------------------------------------


def release_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--release",
        default=None,
        help="Release (lane) to use (default: $WORKER_RELEASE, a platform commit, or dev).",
    )(f)


def parse_run_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidField(
            f"{value!r} is not a run id",
            field="RUN",
            rule="a UUID as printed by `worker submit`",
            fix="copy the id from `worker runs list`",
        ) from None


@cli.command()
@release_option
@click.option("--app", "app", default=None, help="module:attribute of your play Registry.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    default=None,
    help="Runs at once (default: the lane's policy).",
)
@click.option("--adopt", multiple=True, help="Also consume this release's lane (repeatable).")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write this file once the worker is ready.",
)
@click.option(
    "--max-outage",
    type=click.FloatRange(1, 86400),
    default=60.0,
    show_default=True,
    help="Exit non-zero when the database stays unreachable this many seconds.",
)
@click.option(
    "--grace",
    type=click.FloatRange(0, 3600),
    default=20.0,
    show_default=True,
    help="Seconds running attempts get to finish on SIGTERM before hand-back.",
)
@pass_state
def start(
    state: State,
    release: str | None,
    app: str | None,
    concurrency: int | None,
    adopt: tuple[str, ...],
    ready_file: Path | None,
    max_outage: float,
    grace: float,
) -> None:
    """Verify the schema, prepare the lane, report ready, then execute runs."""
    rel = lanes.validate_release(release or config.default_release())
    for other in adopt:
        lanes.validate_release(other, field="--adopt")
    settings = runtime.Settings(
        url=state.url,
        release=rel,
        registry=plays.load_app(app),
        concurrency=concurrency,
        adopt=adopt,
        ready_file=ready_file,
        grace_s=grace,
        max_outage_s=max_outage,
    )
    sys.exit(run(runtime.serve(settings)))


def _read_params(params: str | None, params_file: Path | None) -> dict[str, Any]:
    if params and params_file:
        raise InvalidField(
            "both --params and --params-file given",
            field="--params",
            rule="one source of params",
            fix="pass only one of them",
        )
    text, source = (params, "--params") if params else (None, "--params-file")
    if params_file is not None:
        raw = params_file.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise InvalidField(
                f"--params-file {params_file.name} is not UTF-8 (line {line})",
                field="--params-file",
                rule="a UTF-8 JSON file",
                fix="re-save the file as UTF-8",
            ) from exc
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidField(
            f"{source} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            field=source,
            rule="a JSON object",
            fix="fix the JSON (quote keys and strings)",
        ) from exc
    admission.encode_params(value)
    result: dict[str, Any] = value
    return result


@cli.command()
@click.argument("play_name", metavar="PLAY")
@click.option("--params", default=None, help="Params as a JSON object.")
@click.option(
    "--params-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Read params from a JSON file.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Input rows: a .csv (with header) or .jsonl file.",
)
@release_option
@click.option("--org", default="default", show_default=True, help="Organisation of the run.")
@click.option("--idempotency-key", default=None, help="Key that makes the submit idempotent.")
@click.option(
    "--app",
    "app",
    default=None,
    help="module:attribute of your play Registry, to refuse unknown plays before writing.",
)
@click.option("--wait", is_flag=True, help="Wait for the run to finish.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def submit(
    state: State,
    play_name: str,
    params: str | None,
    params_file: Path | None,
    input_path: Path | None,
    release: str | None,
    org: str,
    idempotency_key: str | None,
    app: str | None,
    wait: bool,
    as_json: bool,
) -> None:
    """Admit a run of PLAY (one atomic transaction)."""
    only = config.admission_only()
    sub = admission.Submission(
        play=play_name,
        params=_read_params(params, params_file),
        release=lanes.validate_release(release or config.default_release()),
        org=org,
        idempotency_key=idempotency_key,
    )
    # Every check of the input happens before anything is written.
    rows = inputs.read_rows(input_path) if input_path else None
    # The plays are known here only when the app is named (--app or WORKER_APP); otherwise
    # the worker refuses an unknown play (without burning an attempt).
    named_app = app or os.environ.get("WORKER_APP")
    known = plays.load_app(app).names() if named_app and not only else None

    async def go(conn: Conn) -> int:
        admitted = await admission.Admitter(admission_only=only).submit(
            conn, sub, url=state.url, known_plays=known, inputs=rows
        )
        data: dict[str, Any] = {
            "run_id": str(admitted.run_id),
            "created": admitted.created,
            "lane": admitted.lane,
        }
        if not wait:
            if as_json:
                emit_json(data)
            else:
                verb = "admitted" if admitted.created else "already admitted"
                click.echo(f"{verb} run {admitted.run_id} on lane {admitted.lane}")
            return 0
        return await _wait_result(state.url, admitted.run_id, None, as_json)

    connected(state, go)


EXIT_BY_STATE = {"succeeded": 0, "failed": 1, "cancelled": 3}


async def _wait_result(url: str, run_id: uuid.UUID, timeout: float | None, as_json: bool) -> int:
    run_ = await observe.wait_terminal(url, run_id, timeout=timeout)
    if run_ is None:
        click.echo(f"timed out waiting for run {run_id}", err=True)
        return 4
    if as_json:
        emit_json(observe.run_dict(run_))
    else:
        click.echo(f"run {run_.id} {run_.state}")
        if run_.result is not None:
            click.echo(f"result: {json.dumps(run_.result, sort_keys=True)}")
        if run_.error is not None:
            click.echo(f"error: {json.dumps(run_.error, sort_keys=True)}")
    return EXIT_BY_STATE.get(run_.state, 1)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--wait", is_flag=True, help="Block until the run is terminal.")
@click.option("--timeout", type=click.FloatRange(0), default=None, help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def result(state: State, run_id: str, wait: bool, timeout: float | None, as_json: bool) -> None:
    """Print a run's result; exit 0 succeeded, 1 failed, 3 cancelled, 4 timed out."""
    rid = parse_run_id(run_id)
    if wait:
        sys.exit(run(_wait_result(state.url, rid, timeout, as_json)))

    async def go(conn: Conn) -> int:
        run_ = await runs.get(conn, rid)
        if as_json:
            emit_json(observe.run_dict(run_))
        else:
            click.echo(f"run {run_.id} {run_.state}")
            if run_.result is not None:
                click.echo(f"result: {json.dumps(run_.result, sort_keys=True)}")
        return EXIT_BY_STATE.get(run_.state, 5)

    connected(state, go)


@cli.command("observe")
@click.argument("run_id", metavar="RUN")
@pass_state
def observe_cmd(state: State, run_id: str) -> None:
    """Follow a run's state and ledger live until it is terminal."""
    sys.exit(run(observe.follow(state.url, parse_run_id(run_id), click.echo)))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--reason", default=None, help="Why (recorded on the run).")
@pass_state
def cancel(state: State, run_id: str, reason: str | None) -> None:
    """Cancel a run (idempotent; a finished run is left as it is)."""
    rid = parse_run_id(run_id)

    async def go(conn: Conn) -> int:
        res = await runs.cancel(conn, rid, reason=reason)
        if not res.changed:
            click.echo(
                f"run {rid} is {res.before}: nothing to cancel"
                if res.before in {"succeeded", "failed", "cancelled"}
                else f"run {rid}: cancellation already requested"
            )
        elif res.after == "cancelled":
            click.echo(f"run {rid} cancelled (was {res.before})")
        else:
            click.echo(f"run {rid}: cancellation requested; the running attempt stops shortly")
        return 0

    connected(state, go)


@cli.command()
@click.argument("event")
@click.option("--payload", default=None, help="JSON payload.")
@pass_state
def emit(state: State, event: str, payload: str | None) -> None:
    """Emit EVENT: the first emit wins and wakes the runs waiting for it."""
    try:
        value = json.loads(payload) if payload else None
    except json.JSONDecodeError as exc:
        raise InvalidField(
            f"--payload is not valid JSON: {exc.msg}",
            field="--payload",
            rule="JSON",
            fix="fix the JSON",
        ) from exc

    async def go(conn: Conn) -> int:
        res = await runs.emit(conn, event, value)
        click.echo(
            f"event {event!r} "
            + (
                f"emitted; woke {res.woken} run(s)"
                if res.first
                else "was already emitted (first emit wins)"
            )
        )
        return 0

    connected(state, go)


@cli.group("runs")
def runs_group() -> None:
    """List and show runs."""


@runs_group.command("list")
@click.option(
    "--state",
    "state_",
    type=click.Choice([s.value for s in runs.RunState]),
    default=None,
    help="Only runs in this state.",
)
@click.option("--release", default=None, help="Only runs of this release.")
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def runs_list(
    state: State, state_: str | None, release: str | None, limit: int, as_json: bool
) -> None:
    """Recent runs, newest first."""
    lane = lanes.lane_name(release) if release else None

    async def go(conn: Conn) -> int:
        found = await runs.list_runs(conn, state=state_, lane=lane, limit=limit)
        if as_json:
            emit_json([observe.run_dict(r) for r in found])
        else:
            for r in found:
                click.echo(
                    f"{r.id}  {r.state:<9}  {r.play:<16} {r.lane:<16} attempt={r.attempt}"
                    f"  rows={r.rows_done}/{r.rows_total}  {r.created_at:%Y-%m-%d %H:%M:%S}"
                )
        return 0

    connected(state, go)


@runs_group.command("show")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def runs_show(state: State, run_id: str, as_json: bool) -> None:
    """One run with its attempts and ledger."""
    rid = parse_run_id(run_id)

    async def go(conn: Conn) -> int:
        run_ = await runs.get(conn, rid)
        tries = await runs.attempts(conn, rid)
        ledger = await runs.events(conn, rid)
        data = observe.run_dict(run_) | {
            "attempts": [
                {
                    "attempt": a.attempt,
                    "worker": a.worker_id,
                    "outcome": a.outcome,
                    "error": a.error,
                    "started_at": a.started_at,
                    "finished_at": a.finished_at,
                }
                for a in tries
            ],
            "events": [
                {"id": e.id, "kind": e.kind, "attempt": e.attempt, "data": e.data, "at": e.at}
                for e in ledger
            ],
        }
        if as_json:
            emit_json(data)
        else:
            click.echo(json.dumps(data, indent=2, default=str, sort_keys=True))
        return 0

    connected(state, go)


@cli.group("queues")
def queues_group() -> None:
    """Lanes (release queues): list, prepare, drain, reclaim."""


@queues_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_state
def queues_list(state: State, as_json: bool) -> None:
    """Every lane with its state, unfinished runs and live workers."""

    async def go(conn: Conn) -> int:
        found = await lanes.list_lanes(conn)
        if as_json:
            emit_json(
                [
                    {
                        "lane": s.name,
                        "release": s.release,
                        "state": s.state,
                        "unfinished": s.unfinished,
                        "live_workers": s.live_workers,
                    }
                    for s in found
                ]
            )
        else:
            for s in found:
                click.echo(
                    f"{s.name:<24} {s.state:<10} unfinished={s.unfinished:<6} "
                    f"live_workers={s.live_workers}"
                )
        return 0

    connected(state, go)


@queues_group.command("prepare")
@click.argument("release")
@pass_state
def queues_prepare(state: State, release: str) -> None:
    """Prepare RELEASE's lane (idempotent; registry rows only)."""
    lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn, url=state.url)
        lane = await lanes.prepare(conn, release)
        click.echo(f"lane {lane.name} {lane.state}")
        return 0

    connected(state, go)


@queues_group.command("drain")
@click.argument("release")
@pass_state
def queues_drain(state: State, release: str) -> None:
    """Stop admissions to RELEASE's lane while its workers finish."""
    lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        lane = await lanes.drain(conn, release)
        click.echo(f"lane {lane.name} {lane.state}")
        return 0

    connected(state, go)


@queues_group.command("reclaim")
@click.argument("release")
@click.option("--force", is_flag=True, help="Reclaim even with unfinished runs.")
@pass_state
def queues_reclaim(state: State, release: str, force: bool) -> None:
    """Retire RELEASE's lane after a cutover."""
    lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        rep = await lanes.reclaim(conn, release, force=force)
        click.echo(
            f"lane {rep.lane} reclaimed (was {rep.was}; {rep.unfinished} unfinished "
            f"run(s); {rep.jobs_cancelled} waiting job(s) cancelled)"
        )
        return 0

    connected(state, go)


@cli.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "prometheus"]),
    default="text",
    show_default=True,
)
@click.option(
    "--window",
    type=click.FloatRange(1),
    default=3600.0,
    show_default=True,
    help="Seconds of attempt history for the rescue and stale-write counts.",
)
@pass_state
def metrics(state: State, fmt: str, window: float) -> None:
    """Queue depth, live workers, lease rescues, stale writes refused, stranded runs."""

    async def go(conn: Conn) -> int:
        found = await metrics_mod.collect(conn, window_s=window)
        if fmt == "json":
            emit_json(found.as_dict())
        elif fmt == "prometheus":
            click.echo(found.prometheus(), nl=False)
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
                f"{a.succeeded_attempts}, handed back {a.handed_back}"
            )
            for s in found.stranded:
                click.echo(f"stranded: {s.lane} {s.runs} run(s), oldest {s.oldest_wait_s:.0f}s")
        return 0

    connected(state, go)


@cli.command()
@click.option(
    "--rows",
    type=click.IntRange(1, 3000),
    default=3000,
    show_default=True,
    help="How many sample rows to enrich.",
)
@click.pass_context
def demo(ctx: click.Context, rows: int) -> None:
    """Migrate, start a worker, enrich a bundled sample live, summarise, shut down."""
    state = ctx.find_object(State)
    assert state is not None
    if ctx.find_root().get_parameter_source("log_level") is ParameterSource.DEFAULT:
        logs.quiet()  # the demo's own lines tell the story; --log-level INFO shows all
    sys.exit(run(demo_run.run_demo(state.url, rows=rows, echo=click.echo)))


cli.add_command(recovery.recover_command)
queues_group.add_command(recovery.adopt_command)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="worker", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error[USAGE_INVALID]: {exc.format_message()}", err=True)
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            click.echo(f"See `{exc.ctx.command_path} --help`.", err=True)
        sys.exit(2)
    except WorkerError as exc:
        report(exc)
        sys.exit(exc.exit_code)
    except psycopg.Error as exc:
        # The last boundary: a database error is reported, never a traceback.
        mapped = translate(exc)
        if mapped is not None:
            report(mapped)
            sys.exit(mapped.exit_code)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        click.echo(f"error[DATABASE_ERROR]: {first}", err=True)
        sys.exit(1)
    except embedded.EmbeddedPostgresError as exc:
        click.echo(f"error[{exc.code}]: {exc}", err=True)
        sys.exit(1)


def report(exc: WorkerError) -> None:
    click.echo(f"error[{exc.code}]: {exc.render()}", err=True)
