"""Lanes (release queues): list, prepare, reopen, drain, reclaim, adopt."""

from __future__ import annotations

import click
import structlog

from queues import lanes, migrations, operator, recovery
from worker import config
from worker.cli.common import Conn, State, actor, connected, emit_json, json_option, pass_state
from worker.cli.ops import set_policy_command
from worker.output import iso, printable

log = structlog.get_logger("worker.cli")


@click.group("queues")
def queues_group() -> None:
    """Lanes (release queues): list, prepare, reopen, drain, reclaim, adopt."""


@queues_group.command("list")
@json_option
@pass_state
def queues_list(state: State, as_json: bool) -> None:
    """Every lane with its state, unfinished runs, live and stale workers.

    A worker is live while its heartbeat is fresh (within three of the lane's heartbeat
    intervals); one that stopped heartbeating without stopping (killed, hung, cut off) is
    stale, with the time of its last heartbeat, for an hour."""

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
                        "stale_workers": s.stale_workers,
                        "stale_since": s.stale_since,
                    }
                    for s in found
                ]
            )
        else:
            for s in found:
                stale = (
                    f" stale_workers={s.stale_workers} (last heartbeat {iso(s.stale_since)})"
                    if s.stale_workers and s.stale_since is not None
                    else ""
                )
                click.echo(
                    f"{printable(s.name):<24} {s.state:<10} unfinished={s.unfinished:<6} "
                    f"live_workers={s.live_workers}{stale}"
                )
        return 0

    connected(state, go, config.Purpose.READ)


def _show_lane(lane: lanes.Lane, as_json: bool) -> None:
    if as_json:
        emit_json({"lane": lane.name, "release": lane.release, "state": lane.state})
    else:
        click.echo(f"lane {lane.name} {lane.state}")


@queues_group.command("prepare")
@click.argument("release")
@json_option
@pass_state
def queues_prepare(state: State, release: str, as_json: bool) -> None:
    """Prepare RELEASE's lane (idempotent; registry rows only; never reopens a lane)."""
    checked = lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        lane = await lanes.prepare(conn, checked, own=False)
        _show_lane(lane, as_json)
        if lane.state != lanes.LaneState.PREPARED:
            click.echo(
                f"it admits no new runs; `worker queues reopen {release}` opens it again",
                err=True,
            )
        return 0

    connected(state, go)


@queues_group.command("reopen")
@click.argument("release")
@json_option
@pass_state
def queues_reopen(state: State, release: str, as_json: bool) -> None:
    """Reopen a draining or reclaimed lane to admissions (an operator's explicit act)."""
    checked = lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        _show_lane(await lanes.reopen(conn, checked), as_json)
        return 0

    connected(state, go)


@queues_group.command("drain")
@click.argument("release")
@json_option
@pass_state
def queues_drain(state: State, release: str, as_json: bool) -> None:
    """Stop admissions to RELEASE's lane while its workers finish."""
    checked = lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        _show_lane(await operator.drain(conn, checked, actor=actor()), as_json)
        return 0

    connected(state, go)


@queues_group.command("reclaim")
@click.argument("release")
@click.option("--force", is_flag=True, help="Reclaim even with unfinished runs.")
@json_option
@pass_state
def queues_reclaim(state: State, release: str, force: bool, as_json: bool) -> None:
    """Retire RELEASE's lane after a cutover."""
    checked = lanes.validate_release(release, field="RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        rep = await operator.reclaim(conn, checked, force=force, actor=actor())
        if as_json:
            emit_json({"lane": rep.lane, "was": rep.was, "unfinished": rep.unfinished})
            return 0
        left = (
            f"; {rep.unfinished} unfinished run(s) stay on it: a worker of {release} serves "
            f"them, else recovery reports them stranded (`worker queues adopt {release} NEW`)"
            if rep.unfinished
            else ""
        )
        click.echo(f"lane {rep.lane} reclaimed (was {rep.was}){left}")
        return 0

    connected(state, go)


@queues_group.command("adopt")
@click.argument("from_release", metavar="FROM_RELEASE")
@click.argument("to_release", metavar="TO_RELEASE")
@json_option
@pass_state
def queues_adopt(state: State, from_release: str, to_release: str, as_json: bool) -> None:
    """Move FROM_RELEASE's unfinished runs to TO_RELEASE's lane (explicit, never automatic)."""
    source = lanes.validate_release(from_release, field="FROM_RELEASE")
    target = lanes.validate_release(to_release, field="TO_RELEASE")

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        moved = await recovery.adopt(conn, from_release=source, to_release=target)
        from_lane, to_lane = lanes.lane_name(source), lanes.lane_name(target)
        log.info("lane_adopted", from_lane=from_lane, to_lane=to_lane, runs=moved)
        if as_json:
            emit_json({"from_lane": from_lane, "to_lane": to_lane, "moved": moved})
        else:
            click.echo(
                f"moved {moved} unfinished run(s) from lane {from_lane} to {to_lane}; "
                f"a worker of release {to_release} runs them"
            )
        return 0

    connected(state, go)


queues_group.add_command(set_policy_command)
