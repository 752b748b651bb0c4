"""Runs: admit, wait, follow, cancel, list and show them, and emit the events they wait for."""

from __future__ import annotations

import json
import os
import stat
import sys
import uuid
from pathlib import Path
from typing import Any

import click

from queues import admission, children, fields, inputs, lanes, migrations, operator, outcomes, runs
from queues import options as run_options
from queues.errors import ExitCode, InputError, InvalidField, PayloadTooLarge
from queues.options import RunOptions
from worker import config, observe
from worker.cli.common import (
    Conn,
    Duration,
    State,
    actor,
    connected,
    emit_json,
    exit_code_of,
    iso,
    json_option,
    load_app,
    max_outage_option,
    parse_run_id,
    pass_state,
    release_option,
    run,
)
from worker.cli.ops import retry_command
from worker.output import printable

# ---- submit -----------------------------------------------------------------------------------


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
        raw = _read_small_file(params_file, "--params-file", fields.MAX_PARAMS_BYTES)
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
    value = fields.decode(text, field=source)
    admission.encode_params(value)
    result: dict[str, Any] = value
    return result


def _read_small_file(path: Path, field: str, limit: int) -> bytes:
    """A small regular file's bytes, refused (never read to exhaustion) otherwise."""
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise InvalidField(
                    f"{path} is not a regular file",
                    field=field,
                    rule="a regular file",
                    fix="write the JSON to a file first",
                )
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise InvalidField(
            f"cannot read {path}: {exc.strerror or exc}",
            field=field,
            rule="a readable regular file",
            fix="check the path and its permissions",
        ) from exc
    if len(raw) > limit:
        raise PayloadTooLarge(  # as the API and the database answer a value over its size
            f"{path} is larger than {limit} bytes",
            field=field,
            rule=f"at most {limit} bytes",
            fix="pass large inputs as sheet rows (--input) instead",
        )
    return raw


RUNS_FIELDS = frozenset({"play", "params", "release", "org", "idempotency_key", "priority"})
RUNS_BATCH = 1000  # submissions per wq_submit_many statement from --runs
RUNS_MAX = 200_000  # lines one --runs file may hold
RUNS_MAX_BYTES = 64 * 1024 * 1024


def _read_runs(
    path: Path, *, release: str, org: str, known: frozenset[str] | None
) -> list[admission.Submission]:
    """The submissions of a --runs JSONL file, every line checked before anything is sent.

    One JSON object a line: ``play`` (required), ``params``, ``release`` (default
    --release), ``org`` (default --org), ``idempotency_key``, ``priority``. An unknown field
    is refused, never ignored. Blank lines are skipped.
    """
    subs: list[admission.Submission] = []
    size = 0
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below; the stat check needs the handle)
    except OSError as exc:
        raise InvalidField(
            f"cannot read {path}: {exc.strerror or exc}",
            field="--runs",
            rule="a readable regular file",
            fix="check the path and its permissions",
        ) from exc
    with fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise InvalidField(
                f"{path} is not a regular file",
                field="--runs",
                rule="a regular JSONL file",
                fix="write the submissions to a file first",
            )
        for number, raw in enumerate(fh, start=1):
            size += len(raw)
            if size > RUNS_MAX_BYTES or len(subs) >= RUNS_MAX:
                raise InvalidField(
                    f"{path} holds more than {RUNS_MAX} submissions or {RUNS_MAX_BYTES} bytes",
                    field="--runs",
                    rule=f"at most {RUNS_MAX} lines and {RUNS_MAX_BYTES} bytes",
                    fix="split the file",
                )
            where = f"--runs line {number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise InvalidField(
                    f"{where} is not UTF-8",
                    field="--runs",
                    rule="a UTF-8 JSONL file",
                    fix="re-save the file as UTF-8",
                ) from exc
            if not line:
                continue
            item = fields.decode(line, field="--runs", what=where)
            if not isinstance(item, dict) or "play" not in item:
                raise InvalidField(
                    f"{where} is not a JSON object with a play",
                    field="--runs",
                    rule='one object a line, such as {"play": "enrich", "params": {}}',
                    fix="fix that line",
                )
            unknown = sorted(set(item) - RUNS_FIELDS)
            if unknown:
                raise InvalidField(
                    f"{where} has unknown fields {', '.join(unknown)}",
                    field="--runs",
                    rule=f"only {', '.join(sorted(RUNS_FIELDS))}",
                    fix="remove them (a newer client's fields are refused, never ignored)",
                )
            sub = admission.Submission(
                play=item["play"],
                params=item.get("params") or {},
                release=lanes.validate_release(item.get("release", release), field=where),
                org=item.get("org", org),
                idempotency_key=item.get("idempotency_key"),
                priority=item.get("priority", 0),
            )
            try:
                admission.validate(sub, known)
                admission.encode_params(sub.params)
            except InputError as exc:  # the same error, naming the line
                raise type(exc)(
                    f"{where}: {exc.message}", field=exc.field, rule=exc.rule, fix=exc.fix
                ) from exc
            subs.append(sub)
    return subs


def _submit_runs(
    state: State,
    path: Path,
    *,
    release: str,
    org: str,
    known: frozenset[str] | None,
    as_json: bool,
) -> None:
    """``worker submit --runs FILE``: the file's runs in statements of RUNS_BATCH."""
    subs = _read_runs(path, release=release, org=org, known=known)
    only = config.admission_only()
    purpose = config.Purpose.ADMISSION if only else config.Purpose.WORKER

    async def go(conn: Conn) -> int:
        admitter = admission.Admitter(admission_only=only)
        admitted: list[admission.Admitted] = []
        for start in range(0, len(subs), RUNS_BATCH):
            batch = subs[start : start + RUNS_BATCH]
            admitted += await admitter.submit_many(conn, batch, known_plays=known)
        if as_json:
            emit_json(
                {
                    "runs": [
                        {"run_id": str(a.run_id), "created": a.created, "lane": a.lane}
                        for a in admitted
                    ]
                }
            )
        else:
            created = sum(a.created for a in admitted)
            click.echo(
                f"admitted {created} runs ({len(admitted) - created} already admitted) "
                f"on lanes {', '.join(sorted({a.lane for a in admitted})) or '(none)'}"
            )
        return 0

    connected(state, go, purpose)


@click.command()
@click.argument("play_name", metavar="PLAY", required=False)
@click.option(
    "--runs",
    "runs_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Admit a batch instead of PLAY: a JSONL file, one object a line (play, params, "
    "release, org, idempotency_key, priority), 1,000 runs a statement, each idempotent.",
)
@click.option("--params", default=None, help="Params as a JSON object.")
@click.option(
    "--params-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Read params from a JSON file.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Input rows: a .csv (with header) or .jsonl file, read as a stream.",
)
@release_option
@click.option("--org", default="default", show_default=True, help="Organisation of the run.")
@click.option(
    "--idempotency-key",
    default=None,
    help="Key that makes the submit idempotent: send a submit that exited 6 again with the "
    "same key (it admits one run however often it is sent).",
)
@click.option(
    "--app",
    "app",
    default=None,
    help="module:attribute of your play Registry, to refuse unknown plays before writing.",
)
@click.option("--wait", is_flag=True, help="Wait for the run to finish.")
@click.option(
    "--wait-timeout",
    type=Duration(),
    default=None,
    help="With --wait: give up waiting after DURATION (exit 4; the run goes on).",
)
@max_outage_option("With --wait, once admitted: ")
@click.option(
    "--max-attempts",
    default=None,
    metavar="N",
    help="Failed attempts this run may spend (default: its lane's policy).",
)
@click.option(
    "--retry",
    default=None,
    metavar="POLICY",
    help="This run's retry policy: none, fixed:30s, or "
    "exponential:base=2s,factor=2,cap=5m,jitter=0.1 (default: its lane's).",
)
@click.option(
    "--timeout",
    "run_timeout",
    default=None,
    metavar="DURATION",
    help="The run's timeout from its first start, over every attempt and sleep: past it "
    "the run is stopped and failed (RUN_TIMED_OUT). Default: its lane's (--run-timeout).",
)
@click.option(
    "--start-by",
    default=None,
    metavar="TIME|DURATION",
    help="Claim deadline: a run not started by then is failed (START_DEADLINE_PASSED), "
    "never run late; an ISO 8601 time with its offset, or a duration from now (10m).",
)
@click.option(
    "--priority",
    default=None,
    metavar="N",
    help="Higher runs first within its lane (default 0).",
)
@click.option("--meta", default=None, metavar="JSON", help="A small JSON object kept with the run.")
@json_option
@pass_state
def submit(
    state: State,
    play_name: str | None,
    runs_path: Path | None,
    params: str | None,
    params_file: Path | None,
    input_path: Path | None,
    release: str | None,
    org: str,
    idempotency_key: str | None,
    app: str | None,
    wait: bool,
    wait_timeout: float | None,
    max_outage: float,
    max_attempts: str | None,
    retry: str | None,
    run_timeout: str | None,
    start_by: str | None,
    priority: str | None,
    meta: str | None,
    as_json: bool,
) -> None:
    """Admit a run of PLAY (one atomic statement), or the runs of a --runs file.

    A submit that meets a lost database (a restart, a failover under way) exits 6
    (DATABASE_UNREACHABLE) and may or may not have been admitted: send it again with the
    same --idempotency-key (docs/how-to/high-availability.md)."""
    _timeout_needs_wait(wait_timeout, wait, flag="--wait-timeout")
    if wait and run_timeout is not None and wait_timeout is None:
        click.echo(
            "note: --timeout is the run's own timeout (it fails past it); to stop waiting "
            "after a while, use --wait-timeout",
            err=True,
        )
    options = RunOptions.checked(
        max_attempts=max_attempts,
        retry=retry,
        timeout=run_timeout,
        start_by=start_by,
        meta=None if meta is None else fields.decode(meta, field="--meta"),
        names={
            "max_attempts": "--max-attempts",
            "retry": "--retry",
            "timeout": "--timeout",
            "start_by": "--start-by",
            "meta": "--meta",
        },
    )
    checked_priority = 0 if priority is None else fields.priority(priority, field="--priority")
    named_app = app or os.environ.get("WORKER_APP")
    if runs_path is not None:
        given = [
            flag
            for flag, value in (
                ("PLAY", play_name),
                ("--params", params),
                ("--params-file", params_file),
                ("--input", input_path),
                ("--idempotency-key", idempotency_key),
                ("--wait", wait or None),
                ("--max-attempts", max_attempts),
                ("--retry", retry),
                ("--timeout", run_timeout),
                ("--start-by", start_by),
                ("--priority", priority),
                ("--meta", meta),
            )
            if value is not None
        ]
        if given:
            raise InvalidField(
                f"--runs with {', '.join(given)}",
                field="--runs",
                rule="a --runs file carries each run's play, params and key",
                fix="put them in the file's lines, or submit one run without --runs",
            )
        _submit_runs(
            state,
            runs_path,
            release=lanes.validate_release(
                config.default_release() if release is None else release, field="--release"
            ),
            org=org,
            known=load_app(named_app).names() if named_app else None,
            as_json=as_json,
        )
        return
    if play_name is None:
        raise InvalidField(
            "no PLAY given",
            field="PLAY",
            rule="the name of a play, or --runs FILE",
            fix="worker submit PLAY [--params JSON], or worker submit --runs runs.jsonl",
        )
    only = config.admission_only()
    sub = admission.Submission(
        play=play_name,
        params=_read_params(params, params_file),
        release=lanes.validate_release(
            config.default_release() if release is None else release, field="--release"
        ),
        org=org,
        idempotency_key=idempotency_key,
        priority=checked_priority,
        max_attempts=options.max_attempts,
        retry=options.retry,
        timeout=options.timeout_s,
        start_by=options.start_by,
        meta=options.meta,
    )
    # The plays are known here only when the app is named (--app or WORKER_APP); otherwise
    # the worker refuses an unknown play (without burning an attempt). Admission-only mode
    # loads it too: importing the app is how a serverless caller refuses a typo early.
    known = load_app(named_app).names() if named_app else None
    admission.validate(sub, known)
    # Every check of the input happens before anything is written; the rows are streamed.
    rows = inputs.read_pages(input_path) if input_path else None

    # Admission-only: the admission role, which can do nothing but admit. A local caller
    # prepares the lane lazily, which takes the worker role.
    purpose = config.Purpose.ADMISSION if only else config.Purpose.WORKER

    async def go(conn: Conn) -> int:
        admitted = await admission.Admitter(admission_only=only).submit(
            conn, sub, known_plays=known, inputs=rows
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
                click.echo(f"{verb} run {admitted.run_id} on lane {printable(admitted.lane)}")
            return 0
        return await _wait_result(
            state.url_for(config.Purpose.READ), admitted.run_id, wait_timeout, as_json, max_outage
        )

    connected(state, go, purpose)


def _timeout_needs_wait(timeout: float | None, wait: bool, *, flag: str = "--timeout") -> None:
    if timeout is not None and not wait:
        raise InvalidField(
            f"{flag} without --wait",
            field=flag,
            rule="a time limit on waiting",
            fix=f"add --wait, or drop {flag}",
        )


def _show_run(run_: runs.Run, as_json: bool) -> None:
    if as_json:
        emit_json(observe.run_dict(run_))
        return
    click.echo(f"run {run_.id} {run_.state}")
    if run_.result is not None:
        click.echo(f"result: {json.dumps(run_.result, sort_keys=True)}")
    if run_.error is not None:
        shown = without_traceback(run_.error)  # `worker runs show` prints it
        click.echo(f"error: {json.dumps(shown, sort_keys=True)}")


async def _wait_result(
    url: str, run_id: uuid.UUID, timeout: float | None, as_json: bool, max_outage: float
) -> int:
    run_ = await observe.wait_terminal(url, run_id, timeout=timeout, max_outage_s=max_outage)
    if run_ is None:
        click.echo(f"timed out waiting for run {run_id}; it goes on", err=True)
        return ExitCode.TIMED_OUT
    _show_run(run_, as_json)
    return exit_code_of(run_.state)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--wait", is_flag=True, help="Block until the run is terminal.")
@click.option("--timeout", type=Duration(), default=None, help="With --wait: give up after.")
@max_outage_option("With --wait: ")
@json_option
@pass_state
def result(
    state: State, run_id: str, wait: bool, timeout: float | None, max_outage: float, as_json: bool
) -> None:
    """Print a run's result; the exit status says how it ended (docs/reference/errors.md):
    0 succeeded, 1 failed, 3 cancelled, 4 gave up waiting, 5 not finished yet.

    With --wait it rides out a lost database (a restart, a failover) for up to
    --max-outage, then exits 6 (DATABASE_LOST)."""
    rid = parse_run_id(run_id)
    _timeout_needs_wait(timeout, wait)
    if wait:
        url = state.url_for(config.Purpose.READ)
        sys.exit(run(_wait_result(url, rid, timeout, as_json, max_outage)))

    async def go(conn: Conn) -> int:
        run_ = await runs.get(conn, rid)
        _show_run(run_, as_json)
        return exit_code_of(run_.state)

    connected(state, go, config.Purpose.READ)


@click.command("observe")
@click.argument("run_id", metavar="RUN")
@max_outage_option()
@json_option
@pass_state
def observe_cmd(state: State, run_id: str, max_outage: float, as_json: bool) -> None:
    """Follow a run's ledger and row progress live until it is terminal.

    It rides out a lost database (a restart, a failover) for up to --max-outage, going on
    from the last event printed, then exits 6 (DATABASE_LOST)."""
    rid = parse_run_id(run_id)
    url = state.url_for(config.Purpose.READ)
    sys.exit(run(observe.follow(url, rid, as_json=as_json, max_outage_s=max_outage)))


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--reason", default=None, help="Why (recorded on the run).")
@click.option(
    "--force",
    is_flag=True,
    help="Cancel at once in any state, without waiting for the cleanup hooks.",
)
@json_option
@pass_state
def cancel(state: State, run_id: str, reason: str | None, force: bool, as_json: bool) -> None:
    """Cancel a run (idempotent; a finished run is left as it is)."""
    rid = parse_run_id(run_id)
    if reason is not None:
        fields.text(reason, field="--reason", max_len=1000, what="reason")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        res = await operator.cancel(conn, rid, reason=reason, force=force, actor=actor())
        if as_json:
            emit_json(
                {
                    "run_id": str(rid),
                    "before": res.before,
                    "after": res.after,
                    "changed": res.changed,
                }
            )
        elif res.after == "cancelled":
            click.echo(f"run {rid} cancelled (was {res.before})")
        elif res.before in {"succeeded", "failed", "cancelled"}:
            click.echo(f"run {rid} is {res.before}: nothing to cancel")
        elif res.changed:
            click.echo(
                f"run {rid}: cancellation requested; the running attempt runs its cleanup "
                "hooks and stops shortly"
            )
        else:
            click.echo(
                f"run {rid}: cancellation already requested; it ends after its cleanup "
                "(`--force` cancels at once, without it)"
            )
        return 0

    connected(state, go)


@click.command()
@click.argument("event")
@click.option("--payload", default=None, help="JSON payload.")
@click.option("--org", default="default", show_default=True, help="The org whose runs wait.")
@json_option
@pass_state
def emit(state: State, event: str, payload: str | None, org: str, as_json: bool) -> None:
    """Emit EVENT in ORG: wakes that org's runs waiting for it (the latest emit is kept)."""
    fields.event_name(event, field="EVENT")
    fields.org(org, field="--org")
    value = fields.decode(payload, field="--payload") if payload else None
    if payload:
        fields.encode(value, field="--payload", max_bytes=fields.MAX_PAYLOAD_BYTES)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        res = await runs.emit(conn, org=org, name=event, payload=value)
        if as_json:
            emit_json({"event": event, "org": org, "woken": res.woken})
        else:
            click.echo(f"event {event!r} emitted in org {org!r}; woke {res.woken} run(s)")
        return 0

    connected(state, go)


# ---- runs list / show -------------------------------------------------------------------------


@click.group("runs")
def runs_group() -> None:
    """List and show runs."""


@runs_group.command("list")
@click.option(
    "--state",
    "state_",
    type=click.Choice([s.value for s in outcomes.RunState]),
    default=None,
    help="Only runs in this state.",
)
@click.option("--release", default=None, help="Only runs of this release.")
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@json_option
@pass_state
def runs_list(
    state: State, state_: str | None, release: str | None, limit: int, as_json: bool
) -> None:
    """Recent runs, newest first."""
    lane = lanes.lane_name(lanes.validate_release(release, field="--release")) if release else None

    async def go(conn: Conn) -> int:
        found = await runs.list_runs(conn, state=state_, lane=lane, limit=limit)
        if as_json:
            emit_json([observe.run_dict(r) for r in found])
        else:
            for r in found:
                click.echo(
                    f"{r.id}  {r.state:<9}  {printable(r.play):<16} {printable(r.lane):<16} "
                    f"attempt={r.attempt}  rows={r.rows_done}/{r.rows_total}  {iso(r.created_at)}"
                )
        return 0

    connected(state, go, config.Purpose.READ)


@runs_group.command("show")
@click.argument("run_id", metavar="RUN")
@json_option
@pass_state
def runs_show(state: State, run_id: str, as_json: bool) -> None:
    """One run with its attempts and ledger."""
    rid = parse_run_id(run_id)

    async def go(conn: Conn) -> int:
        run_ = await runs.get(conn, rid)
        tries = await runs.attempts(conn, rid)
        ledger = await runs.events(conn, rid)
        own = await run_options.shown(conn, rid)
        kids = await children.list_children(conn, rid) if own and own.children else []
        if as_json:
            emit_json(
                observe.run_dict(run_)
                | {"options": own.as_dict() if own else None}
                | {
                    "children": [
                        {
                            "run_id": str(k.id),
                            "play": k.play,
                            "state": k.state,
                            "created_at": k.created_at,
                            "finished_at": k.finished_at,
                        }
                        for k in kids
                    ]
                }
                | {
                    "attempts": [_attempt_dict(a) for a in tries],
                    "events": [
                        {
                            "id": e.id,
                            "seq": e.seq,
                            "kind": e.kind,
                            "attempt": e.attempt,
                            "data": e.data,
                            "at": e.at,
                        }
                        for e in ledger
                    ],
                }
            )
            return 0
        click.echo(f"run {run_.id}  {run_.state}")
        for label, value in (
            ("play", printable(run_.play)),
            ("org", printable(run_.org)),
            ("lane", printable(run_.lane)),
            ("attempt", run_.attempt),
            ("rows", f"{run_.rows_done}/{run_.rows_total}"),
            ("created", iso(run_.created_at)),
            ("params", json.dumps(run_.params, sort_keys=True)),
        ):
            click.echo(f"  {label + ':':<9} {value}")
        for label, value in _option_lines(own):
            click.echo(f"  {label + ':':<9} {printable(value)}")
        if run_.result is not None:
            click.echo(f"  {'result:':<9} {json.dumps(run_.result, sort_keys=True)}")
        if run_.error is not None:
            shown = without_traceback(run_.error)
            click.echo(f"  {'error:':<9} {json.dumps(shown, sort_keys=True)}")
            for line in traceback_lines(run_.error):
                click.echo(f"  {line}")
        if kids:
            click.echo("children:")
            for k in kids:
                click.echo(f"  {k.id}  {k.state:<9}  {printable(k.play):<16} {iso(k.created_at)}")
        click.echo("attempts:")
        for a in tries:
            ended = iso(a.finished_at) or "-"
            error = (
                f"  {printable(a.error.get('type'))}: {printable(a.error.get('message'))}"
                if a.error
                else ""
            )
            click.echo(
                f"  {a.attempt:>3}  {a.outcome or 'running':<12} {printable(a.worker_id)}  "
                f"{iso(a.started_at)} -> {ended}{error}"
            )
        click.echo("events:")
        for e in ledger:
            data = json.dumps(e.data, sort_keys=True, default=str) if e.data else ""
            click.echo(f"  {e.seq:>5}  {iso(e.at)}  {printable(e.kind):<18} {data}")
        return 0

    connected(state, go, config.Purpose.READ)


def _option_lines(own: run_options.Shown | None) -> list[tuple[str, str]]:
    """A run's own options as `runs show` prints them (none: its lane's policy)."""
    if own is None:
        return []
    retry = own.retry
    found = [
        ("meta", json.dumps(own.meta, sort_keys=True) if own.meta is not None else None),
        ("max tries", str(own.max_attempts) if own.max_attempts is not None else None),
        ("retry", str(retry) if retry is not None else None),
        (
            "timeout",
            fields.human_duration(own.timeout_s) if own.timeout_s is not None else None,
        ),
        ("start by", iso(own.start_by) if own.start_by is not None else None),
        ("parent", str(own.parent_id) if own.parent_id else None),
    ]
    return [(label, value) for label, value in found if value is not None]


def _attempt_dict(a: runs.Attempt) -> dict[str, Any]:
    return {
        "attempt": a.attempt,
        "worker": a.worker_id,
        "outcome": a.outcome,
        "error": a.error,
        "started_at": a.started_at,
        "finished_at": a.finished_at,
    }


def traceback_lines(error: Any, *, title: str = "traceback") -> list[str]:
    """A stored error's traceback as lines for ``worker runs show`` (none without one)."""
    stack = error.get("traceback") if isinstance(error, dict) else None
    if not isinstance(stack, str) or not stack:
        return []
    # Split on newlines only (splitlines also splits on other separators, which printable
    # escapes), each line made safe to print: a play wrote the exception's message.
    lines = stack.rstrip("\n").split("\n")
    return [f"{title}:", *("  " + printable(line, lines=True) for line in lines)]


def without_traceback(error: Any) -> Any:
    """The error as shown on one line (the traceback is printed on its own)."""
    if isinstance(error, dict) and "traceback" in error:
        return {k: v for k, v in error.items() if k != "traceback"}
    return error


runs_group.add_command(retry_command)
