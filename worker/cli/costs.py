"""What paid work cost and what it may spend: ``worker costs`` and ``worker budgets ...``.

Thin commands over :mod:`queues.costs` (the model: docs/explanation/costs.md).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import click

from queues import costs, fields, migrations
from queues.errors import InvalidField
from worker.cli.common import (
    Conn,
    State,
    actor,
    connected,
    emit_json,
    iso,
    json_option,
    parse_run_id,
    pass_state,
    printable,
)
from worker.output import amount

# ---- worker costs -------------------------------------------------------------------------


def parse_since(value: str, *, field: str = "--since", now: datetime | None = None) -> datetime:
    """``--since``: a duration back from now (``7d``, ``12h``) or an ISO 8601 date or time
    (``2026-12-01``, ``2026-12-01T08:00:00+01:00``; without an offset it is UTC)."""
    try:
        at = datetime.fromisoformat(value.strip())
    except ValueError:
        pass
    else:
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    try:
        seconds = fields.duration(value, field=field, maximum=20 * 365 * 86400.0)
    except InvalidField:
        raise InvalidField(
            f"{fields.shown(value)} is neither a duration nor a date",
            field=field,
            rule="a duration back from now (7d, 12h) or an ISO 8601 date or time",
            fix="pass e.g. 7d or 2026-12-01",
        ) from None
    return (now or datetime.now(UTC)) - timedelta(seconds=seconds)


def parse_by(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--by`` given once per dimension or comma-separated, each one of :data:`GROUPS`."""
    by: list[str] = []
    for value in values:
        for part in value.split(","):
            name = part.strip()
            if name not in costs.GROUPS:
                raise InvalidField(
                    f"cannot group costs by {fields.shown(name)}",
                    field="--by",
                    rule=f"any of {', '.join(costs.GROUPS)}",
                    fix="e.g. --by provider or --by org,day",
                )
            if name not in by:
                by.append(name)
    return tuple(by)


def spent_text(found: list[costs.Cost]) -> str:
    """A run's charges summed per unit, each with its providers: ``12 credits (clearbit 10,
    openai 2)``."""
    parts = []
    for unit in dict.fromkeys(c.unit for c in found):
        mine = [c for c in found if c.unit == unit]
        total = sum((c.amount for c in mine), Decimal(0))
        split = ", ".join(
            f"{printable(c.provider) if c.provider is not None else '(none)'} {amount(c.amount)}"
            for c in mine
        )
        parts.append(f"{amount(total)} {unit} ({split})")
    return "; ".join(parts)


def cost_columns(by: tuple[str, ...], cost: costs.Cost) -> list[str]:
    shown: dict[str, Any] = {
        "run": cost.run_id,
        "org": cost.org,
        "play": cost.play,
        "provider": cost.provider if cost.provider is not None else "(none)",
        "day": cost.day,
    }
    return [printable(shown[g]) for g in by]


@click.command("costs")
@click.option("--run", "run_id", default=None, metavar="RUN", help="Only this run's charges.")
@click.option("--org", default=None, help="Only this org's charges.")
@click.option("--play", default=None, help="Only this play's charges.")
@click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="Only charges since: a duration back from now (7d) or an ISO 8601 date or time.",
)
@click.option(
    "--by",
    "by",
    multiple=True,
    metavar="GROUP",
    help="Sum per run, org, play, provider or day (UTC); repeat or comma-separate "
    "(default: per provider with --run, else per org). Always per unit.",
)
@click.option("--limit", type=click.IntRange(1, 100000), default=1000, show_default=True)
@json_option
@pass_state
def costs_command(
    state: State,
    run_id: str | None,
    org: str | None,
    play: str | None,
    since: str | None,
    by: tuple[str, ...],
    limit: int,
    as_json: bool,
) -> None:
    """What the recorded charges add up to, per unit: each charge was recorded once, with
    the receipt of the step that made it."""
    rid = parse_run_id(run_id, field="--run") if run_id is not None else None
    checked_org = fields.org(org, field="--org") if org is not None else None
    checked_play = fields.play_name(play, field="--play") if play is not None else None
    start = parse_since(since) if since is not None else None
    groups = parse_by(by) or (("provider",) if rid is not None else ("org",))

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        found = await costs.costs(
            conn,
            by=groups,
            run_id=rid,
            org=checked_org,
            play=checked_play,
            since=start,
            limit=limit,
        )
        if as_json:
            emit_json(
                [
                    {g: row[g] for g in (*_keys(groups), "unit", "amount", "charges")}
                    for row in (c.as_dict() for c in found)
                ]
            )
            return 0
        if not found:
            click.echo("no charges recorded" + (f" since {iso(start)}" if start else ""))
            return 0
        header = [*groups, "unit", "amount", "charges"]
        lines = [
            [*cost_columns(groups, c), c.unit, amount(c.amount), str(c.charges)] for c in found
        ]
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        for line in [header, *lines]:
            click.echo(
                "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            )
        return 0

    connected(state, go)


def _keys(groups: tuple[str, ...]) -> list[str]:
    return ["run_id" if g == "run" else g for g in groups]


# ---- worker budgets -----------------------------------------------------------------------


@click.group("budgets")
def budgets_group() -> None:
    """Budgets: what an org, an org's play or one run may spend in a unit per period."""


def _target(
    org: str | None, play: str | None, run_id: str | None
) -> tuple[str | None, str | None, Any]:
    """The budget's owner as given on the command line, each flag checked by its rule."""
    return (
        fields.org(org, field="--org") if org is not None else None,
        fields.play_name(play, field="--play") if play is not None else None,
        parse_run_id(run_id, field="--run") if run_id is not None else None,
    )


def _target_options(f: Any) -> Any:
    for option in reversed(
        [
            click.option("--org", default=None, help="The org whose budget this is."),
            click.option("--play", default=None, help="Only this play of the org."),
            click.option(
                "--run", "run_id", default=None, metavar="RUN", help="One run's own budget."
            ),
            click.option("--unit", default=costs.DEFAULT_UNIT, show_default=True),
        ]
    ):
        f = option(f)
    return f


@budgets_group.command("set")
@_target_options
@click.option("--limit", "limit", required=True, metavar="AMOUNT", help="At most this much.")
@click.option(
    "--period",
    type=click.Choice(list(costs.PERIODS)),
    default="none",
    show_default=True,
    help="Per UTC day, per UTC month, or in all.",
)
@json_option
@pass_state
def budgets_set(
    state: State,
    org: str | None,
    play: str | None,
    run_id: str | None,
    unit: str,
    limit: str,
    period: str,
    as_json: bool,
) -> None:
    """Define (or redefine) a budget; the runs it paused resume at once when it has room."""
    org, play, rid = _target(org, play, run_id)
    checked = costs.check_amount(limit, field="--limit")
    costs.check_unit(unit, field="--unit")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        budget = await costs.set_budget(
            conn,
            limit=checked,
            org=org,
            play=play,
            run_id=rid,
            unit=unit,
            period=period,
            actor=actor(),
        )
        if as_json:
            emit_json(budget.as_dict())
        else:
            click.echo(f"budget {_whose(budget)}: {_describe(budget)}")
        return 0

    connected(state, go)


@budgets_group.command("list")
@click.option("--org", default=None, help="Only this org's budgets.")
@json_option
@pass_state
def budgets_list(state: State, org: str | None, as_json: bool) -> None:
    """Every budget with what it spent this period and what live steps hold against it."""
    checked_org = fields.org(org, field="--org") if org is not None else None

    async def go(conn: Conn) -> int:
        found = await costs.list_budgets(conn, org=checked_org)
        if as_json:
            emit_json([b.as_dict() for b in found])
        elif not found:
            click.echo("no budgets (define one: worker budgets set --org ORG --limit 100)")
        else:
            for budget in found:
                click.echo(f"{_whose(budget):<48} {_describe(budget)}")
        return 0

    connected(state, go)


@budgets_group.command("delete")
@_target_options
@json_option
@pass_state
def budgets_delete(
    state: State, org: str | None, play: str | None, run_id: str | None, unit: str, as_json: bool
) -> None:
    """Delete a budget (the runs it paused resume)."""
    org, play, rid = _target(org, play, run_id)
    costs.check_unit(unit, field="--unit")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        deleted = await costs.delete_budget(conn, org=org, play=play, run_id=rid, unit=unit)
        whose = f"run {rid}" if rid else f"org {org}" + (f" play {play}" if play else "")
        if as_json:
            emit_json({"org": org, "play": play, "run_id": rid, "unit": unit, "deleted": deleted})
        else:
            click.echo(
                f"budget of {printable(whose)} in {unit} deleted"
                if deleted
                else f"no budget of {printable(whose)} in {unit}: nothing deleted"
            )
        return 0

    connected(state, go)


def _whose(budget: costs.Budget) -> str:
    if budget.run_id is not None:
        return f"run {budget.run_id}"
    return printable(f"org {budget.org}" + (f" play {budget.play}" if budget.play else ""))


def _describe(budget: costs.Budget) -> str:
    per = {"day": " per day", "month": " per month"}.get(budget.period, "")
    text = (
        f"{amount(budget.spent)} of {amount(budget.limit_amount)} {budget.unit}{per} spent, "
        f"{amount(budget.reserved)} reserved"
    )
    if budget.exhausted:
        text += ", exhausted"
    if budget.period_end is not None:
        text += f", rolls over {iso(budget.period_end)}"
    return text
