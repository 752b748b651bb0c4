"""Shared rate limits and periodic plays: ``worker limits ...`` and ``worker schedules ...``."""

from __future__ import annotations

import json
from typing import Any

import click

from queues import fields, limits, migrations, schedules
from queues.errors import InvalidField
from worker.cli.common import (
    Conn,
    State,
    actor,
    connected,
    emit_json,
    iso,
    json_option,
    pass_state,
    printable,
)

# ---- worker limits ------------------------------------------------------------------------------


@click.group("limits")
def limits_group() -> None:
    """Rate limits shared by every worker: a rate, a burst, a concurrency cap."""


@limits_group.command("set")
@click.argument("key", metavar="KEY")
@click.option("--rate", default=None, metavar="N/UNIT", help="Permits per s, m, h or d: 10/s.")
@click.option(
    "--burst",
    default=None,
    metavar="N",
    help="Permits granted at once after a quiet spell (default 1: never above the rate).",
)
@click.option("--concurrency", default=None, metavar="N", help="Permits held at once, at most.")
@click.option(
    "--per-org",
    is_flag=True,
    help="One bucket per org of the acquiring run (a customer's plan), not one shared.",
)
@json_option
@pass_state
def limits_set(
    state: State,
    key: str,
    rate: str | None,
    burst: str | None,
    concurrency: str | None,
    per_org: bool,
    as_json: bool,
) -> None:
    """Define (or redefine) the limit KEY; plays take permits with ctx.limit(KEY)."""
    limits.check(key, rate=rate, burst=burst, concurrency=concurrency)  # before connecting

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        limit = await limits.set_limit(
            conn,
            key,
            rate=rate,
            burst=burst,
            concurrency=concurrency,
            per_org=per_org,
            actor=actor(),
        )
        if as_json:
            emit_json(limit.as_dict())
        else:
            click.echo(f"limit {limit.key}: {_describe(limit)}")
        return 0

    connected(state, go)


def _describe(limit: limits.Limit) -> str:
    parts = []
    if limit.rate:
        parts.append(f"rate {limit.rate}" + (f" (burst {limit.burst})" if limit.burst > 1 else ""))
    if limit.concurrency is not None:
        parts.append(f"at most {limit.concurrency} at once")
    if limit.per_org:
        parts.append("per org")
    return ", ".join(parts)


@limits_group.command("list")
@json_option
@pass_state
def limits_list(state: State, as_json: bool) -> None:
    """Every limit, with the permits held now."""

    async def go(conn: Conn) -> int:
        found = await limits.list_limits(conn)
        if as_json:
            emit_json([limit.as_dict() for limit in found])
        elif not found:
            click.echo("no limits (define one: worker limits set KEY --rate 10/s)")
        else:
            for limit in found:
                click.echo(
                    f"{printable(limit.key):<24} {_describe(limit):<40} holding={limit.holding}  "
                    f"updated {iso(limit.updated_at)}"
                )
        return 0

    connected(state, go)


@limits_group.command("delete")
@click.argument("key", metavar="KEY")
@json_option
@pass_state
def limits_delete(state: State, key: str, as_json: bool) -> None:
    """Delete the limit KEY (a play asking for it afterwards fails: LIMIT_UNKNOWN)."""
    fields.limit_key(key)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        deleted = await limits.delete_limit(conn, key)
        if as_json:
            emit_json({"key": key, "deleted": deleted})
        else:
            click.echo(f"limit {key} deleted" if deleted else f"no limit {key}: nothing deleted")
        return 0

    connected(state, go)


# ---- worker schedules ---------------------------------------------------------------------------


@click.group("schedules")
def schedules_group() -> None:
    """Periodic plays: one run per tick, admitted once however many workers run."""


def _schedule_dict(s: schedules.Schedule) -> dict[str, Any]:
    return {
        "name": s.name,
        "play": s.play,
        "params": s.params,
        "org": s.org,
        "timing": str(s.timing),
        "cron": s.cron,
        "every_s": s.every_s,
        "source": s.source,
        "enabled": s.enabled,
        "next_at": s.next_at,
        "last_tick": s.last_tick,
        "last_run_id": str(s.last_run_id) if s.last_run_id else None,
        "last_release": s.last_release,
        "missed_ticks": s.missed_ticks,
        "updated_by": s.updated_by,
    }


@schedules_group.command("list")
@json_option
@pass_state
def schedules_list(state: State, as_json: bool) -> None:
    """Every schedule: its play, timing, next tick and last admitted run."""

    async def go(conn: Conn) -> int:
        found = await schedules.list_schedules(conn)
        if as_json:
            emit_json([_schedule_dict(s) for s in found])
        elif not found:
            click.echo("no schedules (add one: worker schedules add NAME --play P --every 1h)")
        else:
            for s in found:
                last = f"last {iso(s.last_tick)} run {s.last_run_id}" if s.last_tick else "never"
                click.echo(
                    f"{printable(s.name):<24} {printable(s.play):<16} {s.timing!s:<20} "
                    f"{s.source:<3}  "
                    f"next {iso(s.next_at)}  {last}"
                )
        return 0

    connected(state, go)


@schedules_group.command("add")
@click.argument("name", metavar="NAME")
@click.option("--play", "play", required=True, help="The play to run at each tick.")
@click.option("--cron", default=None, help="A cron expression, UTC ('0 * * * *': hourly).")
@click.option("--every", default=None, metavar="DURATION", help="Or a fixed interval (1h).")
@click.option("--params", default=None, help="Params of each run, a JSON object.")
@click.option("--org", default="default", show_default=True, help="Org of each run.")
@json_option
@pass_state
def schedules_add(
    state: State,
    name: str,
    play: str,
    cron: str | None,
    every: str | None,
    params: str | None,
    org: str,
    as_json: bool,
) -> None:
    """Add (or change) the schedule NAME: its first tick is the first after now."""
    fields.schedule_name(name)
    fields.play_name(play, field="--play")
    fields.org(org, field="--org")
    timing = schedules.Timing.checked(cron=cron, every=every)
    value = fields.decode(params, field="--params") if params else {}
    if not isinstance(value, dict):
        raise InvalidField(
            "--params must be a JSON object",
            field="--params",
            rule='a JSON object such as {"limit": 10}',
            fix="wrap the value in an object",
        )
    fields.encode(value, field="--params", max_bytes=fields.MAX_PARAMS_BYTES)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        added = await schedules.add(
            conn, name, play=play, params=value, org=org, timing=timing, actor=actor()
        )
        if as_json:
            emit_json(_schedule_dict(added))
        else:
            click.echo(
                f"schedule {added.name}: {added.play} {added.timing}; next tick "
                f"{iso(added.next_at)} (params {json.dumps(added.params, sort_keys=True)})"
            )
        return 0

    connected(state, go)


@schedules_group.command("delete")
@click.argument("name", metavar="NAME")
@json_option
@pass_state
def schedules_delete(state: State, name: str, as_json: bool) -> None:
    """Delete the schedule NAME (the runs it admitted stay). An app's schedule comes back
    at its workers' next start unless the app drops it."""
    fields.schedule_name(name)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        source = await schedules.delete(conn, name)
        if as_json:
            emit_json({"name": name, "deleted": source is not None, "source": source})
        elif source is None:
            click.echo(f"no schedule {name}: nothing deleted")
        else:
            note = " (declared by an app: its workers declare it again at start)"
            click.echo(f"schedule {name} deleted" + (note if source == "app" else ""))
        return 0

    connected(state, go)
