"""``worker events`` (a run's ledger, followed live) and ``worker sinks`` (the outbox's
consumers): thin commands over :mod:`queues.ledger`."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import click
import psycopg

from queues import ledger, runs
from worker import config, db, observe
from worker.cli.common import (
    State,
    connected,
    emit_json,
    json_option,
    max_outage_option,
    parse_run_id,
    pass_state,
    run,
    to_json,
)
from worker.outage import MAX_OUTAGE_S, Outage, riding
from worker.output import printable

Conn = psycopg.AsyncConnection[Any]


def _line(event: runs.Event, as_json: bool) -> str:
    if as_json:
        return to_json(ledger.event_json(event))
    data = json.dumps(event.data, default=str, sort_keys=True) if event.data else ""
    attempt = event.attempt if event.attempt is not None else "-"
    kind = printable(event.kind)
    return f"{event.seq:>5}  {event.at.isoformat()}  {kind:<18} attempt={attempt}  {data}"


async def print_events(
    url: str,
    run_id: uuid.UUID,
    *,
    follow: bool,
    as_json: bool,
    echo: Callable[[str], None],
    max_outage_s: float = MAX_OUTAGE_S,
) -> int:
    """Print a run's ledger; with ``follow``, keep printing until the run is terminal and
    every event before its end is printed (LISTEN, and a poll for lost notifications),
    riding out a lost database for up to ``max_outage_s`` (worker.outage): it goes on from
    the last event printed."""
    last = 0
    outage = Outage("events", limit_s=max_outage_s)

    async def read(conn: Conn) -> int:
        nonlocal last
        if follow and db.listens():  # through a transaction pooler: the poll alone
            await conn.execute("LISTEN wq_run_events")
        while True:
            # The run first, then its events: once the run is seen terminal, the events
            # read next include every one committed before its end (seq is commit order).
            run = await runs.get(conn, run_id)
            outage.ok()
            for event in await runs.events(conn, run_id, after=last):
                last = event.seq
                echo(_line(event, as_json))
            if not follow or run.terminal:
                return 0
            await observe.notified(conn, run_id, observe.poll_s())

    code = await riding(url, read, outage, application="wq-events")
    assert code is not None  # riding gives None only at an `until`
    return code


@click.command("events")
@click.argument("run_id", metavar="RUN")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until the run ends.")
@max_outage_option("With --follow: ")
@json_option
@pass_state
def events_command(
    state: State, run_id: str, follow: bool, max_outage: float, as_json: bool
) -> None:
    """Print RUN's ledger: seq, time (ISO 8601), kind, attempt, data (--json: a line each).

    With --follow it rides out a lost database (a restart, a failover) for up to
    --max-outage, going on from the last event printed, then exits 6 (DATABASE_LOST)."""
    rid = parse_run_id(run_id)
    url = state.url_for(config.Purpose.READ)
    printing = print_events(
        url, rid, follow=follow, as_json=as_json, echo=click.echo, max_outage_s=max_outage
    )
    sys.exit(run(printing))


# ---- sinks ---------------------------------------------------------------------------------


@click.group("sinks")
def sinks_group() -> None:
    """Consumers of the run ledger: the built-in progress sink and HTTP endpoints."""


def _on_worker_connection(state: State, go: Callable[[Conn], Awaitable[int]]) -> None:
    """Run ``go`` with the worker role (sinks are the workers' configuration) and exit."""
    connected(state, go, config.Purpose.WORKER)


@sinks_group.command("add")
@click.argument("name")
@click.option("--url", required=True, help="Where each event is POSTed as JSON.")
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    metavar="KIND",
    help="Deliver only events of this kind (repeatable); without it, every kind.",
)
@json_option
@pass_state
def sinks_add(state: State, name: str, url: str, kinds: tuple[str, ...], as_json: bool) -> None:
    """Add an HTTP sink NAME (or point it at a new URL and enable it again).

    It gets every event appended from now on (only those of the --kind given), with the
    header Idempotency-Key: <run_id>:<seq> (the same on a retried delivery: dedupe on it)."""
    ledger.validate_sink_name(name)
    ledger.validate_sink_url(url)
    wanted = ledger.validate_sink_kinds(kinds)

    async def go(conn: Conn) -> int:
        changed = await ledger.add_sink(conn, name, url, wanted)
        if as_json:
            emit_json(
                {
                    "sink": changed.name,
                    "created": changed.created,
                    "url": ledger.redact_url(url),
                    "kinds": changed.kinds,
                }
            )
            return 0
        verb = "added" if changed.created else "updated and enabled"
        only = f" (kinds: {', '.join(changed.kinds)})" if changed.kinds else ""
        click.echo(f"sink {changed.name} {verb}: {ledger.redact_url(url)}{printable(only)}")
        return 0

    _on_worker_connection(state, go)


@sinks_group.command("list")
@json_option
@pass_state
def sinks_list(state: State, as_json: bool) -> None:
    """Every sink with its pending and failing deliveries."""

    async def go(conn: Conn) -> int:
        found = await ledger.list_sinks(conn)
        if as_json:
            emit_json([s.as_dict() for s in found])
            return 0
        for s in found:
            shown = s.as_dict()
            click.echo(
                f"{printable(s.name):<24} {s.kind:<8} "
                f"{'enabled' if s.enabled else 'disabled':<8} "
                f"pending={s.pending} failing={s.failing} "
                f"{'kinds=' + ','.join(s.kinds) + ' ' if s.kinds else ''}"
                f"oldest_pending={s.oldest_pending_s:.0f}s {printable(shown['url'] or '')}".rstrip()
            )
            if s.last_error:  # what an endpoint answered: not ours to print raw
                click.echo(f"  last error: {printable(s.last_error)}")
        return 0

    _on_worker_connection(state, go)


@sinks_group.command("disable")
@click.argument("name")
@json_option
@pass_state
def sinks_disable(state: State, name: str, as_json: bool) -> None:
    """Stop delivering to NAME: new events skip it; its pending deliveries wait until
    `worker sinks add NAME --url URL` enables it again."""

    async def go(conn: Conn) -> int:
        changed = await ledger.disable_sink(conn, name)
        if as_json:
            emit_json({"sink": changed.name, "enabled": False})
        else:
            click.echo(f"sink {changed.name} disabled")
        return 0

    _on_worker_connection(state, go)
