"""Runs: wait for, follow, cancel, list and show them, and emit the events they wait for
(``worker submit`` admits them: :mod:`worker.cli.submit`)."""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

import click

from queues import children, costs, fields, lanes, migrations, operator, outcomes, runs
from queues import options as run_options
from queues.errors import ExitCode, InvalidField
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
    max_outage_option,
    parse_run_id,
    pass_state,
    run,
)
from worker.cli.costs import spent_text
from worker.cli.ops import retry_command
from worker.output import printable


def timeout_needs_wait(timeout: float | None, wait: bool, *, flag: str = "--timeout") -> None:
    """Refuse a time limit on waiting (``flag``) given without --wait."""
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


async def wait_result(
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
    timeout_needs_wait(timeout, wait)
    if wait:
        url = state.url_for(config.Purpose.READ)
        sys.exit(run(wait_result(url, rid, timeout, as_json, max_outage)))

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
        spent = await costs.costs(conn, by=("provider",), run_id=rid)
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
                | {"costs": [_cost_dict(c) for c in spent]}
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
        if run_.wait_reason is not None:
            click.echo(f"  {'paused:':<9} {run_.wait_reason} ({_paused_fix(run_)})")
        if spent:
            click.echo(f"  {'spent:':<9} {spent_text(spent)}")
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


def _cost_dict(cost: costs.Cost) -> dict[str, Any]:
    found = cost.as_dict()
    return {key: found[key] for key in ("provider", "unit", "amount", "charges")}


def _paused_fix(run_: runs.Run) -> str:
    return (
        f"resumes when a budget of org {printable(run_.org)} or of this run has room: "
        "worker budgets list"
    )


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
