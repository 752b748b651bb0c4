"""Periodic plays (queues/schedules.py) with time controlled through ``now``: one run per
tick under the tick's key, missed ticks admitted once as the latest, a lane that does not
admit leaves the tick to another release, declarations and operators' schedules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from queues import lanes, options, runs, schedules
from queues.errors import InvalidField
from queues.schedules import Timing

Conn = psycopg.AsyncConnection[Any]
T0 = datetime(2030, 1, 1, tzinfo=UTC)
PLAY = "digest"


@pytest.fixture(autouse=True)
async def _lanes(conn: Conn) -> None:
    await lanes.prepare(conn, "a")
    await lanes.prepare(conn, "b")


async def _runs(conn: Conn) -> list[tuple[str, str, Any]]:
    cur = await conn.execute(
        "SELECT idempotency_key, lane, params FROM wq_runs WHERE play = %s ORDER BY created_at,"
        " idempotency_key",
        (PLAY,),
    )
    return [(str(k), str(lane), p) for k, lane, p in await cur.fetchall()]


async def test_each_tick_is_admitted_once_on_the_admitting_workers_lane(conn: Conn) -> None:
    assert await schedules.declare(
        conn,
        name="hourly",
        play=PLAY,
        params={"n": 1},
        org="acme",
        timing=Timing.checked(cron="0 * * * *"),
        now=T0 + timedelta(minutes=10),
    )
    nothing = await schedules.admit_due(
        conn, release="a", plays=[PLAY], now=T0 + timedelta(minutes=59)
    )
    assert nothing.ticked == () and nothing.next_due == T0 + timedelta(hours=1)
    tick = T0 + timedelta(hours=1)
    done = await schedules.admit_due(
        conn, release="b", plays=[PLAY], now=tick + timedelta(seconds=2)
    )
    [ticked] = done.ticked
    assert (ticked.tick, ticked.created, ticked.missed) == (tick, True, 0)
    assert ticked.next_at == T0 + timedelta(hours=2)
    # Another worker (another release) looking at the same time admits nothing more.
    again = await schedules.admit_due(
        conn, release="a", plays=[PLAY], now=tick + timedelta(seconds=3)
    )
    assert again.ticked == ()
    assert await _runs(conn) == [(schedules.tick_key("hourly", tick), "r-b", {"n": 1})]
    assert ticked.run_id is not None
    run = await runs.get(conn, ticked.run_id)
    assert run.org == "acme"
    shown = await options.shown(conn, ticked.run_id)
    assert shown is not None and shown.meta == {
        "schedule": "hourly",
        "tick": tick.isoformat(),
        "missed_ticks": 0,
    }


async def test_ticks_missed_while_nothing_ran_are_admitted_once(conn: Conn) -> None:
    await schedules.declare(
        conn,
        name="every-minute",
        play=PLAY,
        params={},
        org="default",
        timing=Timing.checked(every="60s"),
        now=T0,
    )
    back = T0 + timedelta(hours=3, seconds=30)  # three hours of downtime
    [ticked] = (await schedules.admit_due(conn, release="a", plays=[PLAY], now=back)).ticked
    assert ticked.tick == T0 + timedelta(hours=3)
    assert ticked.missed == 179  # T0+1m .. T0+2h59m stood for by the one admitted
    assert ticked.next_at == T0 + timedelta(hours=3, minutes=1)
    assert len(await _runs(conn)) == 1
    [schedule] = await schedules.list_schedules(conn)
    assert (schedule.missed_ticks, schedule.last_tick, schedule.last_release) == (
        179,
        ticked.tick,
        "a",
    )


async def test_a_lane_that_does_not_admit_leaves_the_tick_to_another_release(
    conn: Conn,
) -> None:
    await schedules.declare(
        conn, name="s", play=PLAY, params={}, org="default", timing=Timing(every_s=60), now=T0
    )
    await lanes.drain(conn, "a")
    at = T0 + timedelta(minutes=1)
    draining = await schedules.admit_due(conn, release="a", plays=[PLAY], now=at)
    assert draining.ticked == () and draining.skipped == ("s",)
    [ticked] = (await schedules.admit_due(conn, release="b", plays=[PLAY], now=at)).ticked
    assert ticked.created and [lane for _, lane, _ in await _runs(conn)] == ["r-b"]


async def test_a_worker_only_admits_schedules_of_its_plays(conn: Conn) -> None:
    await schedules.declare(
        conn, name="s", play=PLAY, params={}, org="default", timing=Timing(every_s=60), now=T0
    )
    other = await schedules.admit_due(
        conn, release="a", plays=["other"], now=T0 + timedelta(hours=1)
    )
    assert other.ticked == () and other.next_due is None


async def test_a_redeclaration_keeps_its_next_tick_and_a_changed_timing_restarts(
    conn: Conn,
) -> None:
    timing = Timing(every_s=3600)
    await schedules.declare(
        conn, name="s", play=PLAY, params={}, org="default", timing=timing, now=T0
    )
    await schedules.declare(
        conn,
        name="s",
        play=PLAY,
        params={"v": 2},
        org="default",
        timing=timing,
        now=T0 + timedelta(minutes=30),
    )
    [same] = await schedules.list_schedules(conn)
    assert (same.next_at, same.params) == (T0 + timedelta(hours=1), {"v": 2})
    await schedules.declare(
        conn,
        name="s",
        play=PLAY,
        params={},
        org="default",
        timing=Timing(every_s=60),
        now=T0 + timedelta(minutes=30, seconds=10),
    )
    [changed] = await schedules.list_schedules(conn)
    assert changed.next_at == T0 + timedelta(minutes=31)


async def test_operators_and_apps_do_not_take_each_others_names(conn: Conn) -> None:
    added = await schedules.add(
        conn, "nightly", play=PLAY, timing=Timing.checked(cron="0 3 * * *"), actor="cli:x", now=T0
    )
    assert (added.source, added.next_at, added.updated_by) == (
        "cli",
        T0 + timedelta(hours=3),
        "cli:x",
    )
    assert not await schedules.declare(
        conn, name="nightly", play="other", params={}, org="default", timing=Timing(every_s=60)
    )
    await schedules.declare(
        conn, name="app-one", play=PLAY, params={}, org="default", timing=Timing(every_s=60)
    )
    with pytest.raises(InvalidField, match="declared by an app"):
        await schedules.add(conn, "app-one", play=PLAY, timing=Timing(every_s=60))
    assert await schedules.delete(conn, "nightly") == "cli"
    assert await schedules.delete(conn, "nightly") is None


@pytest.mark.parametrize(
    ("timing", "field"),
    [
        ({}, "--cron"),
        ({"cron": "0 * * * *", "every": "1h"}, "--cron"),
        ({"cron": "61 * * * *"}, "--cron"),
        ({"cron": "* * *"}, "--cron"),
        ({"every": "500ms"}, "--every"),
        ({"every": "soon"}, "--every"),
    ],
)
def test_a_bad_timing_is_refused(timing: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidField) as raised:
        Timing.checked(**timing)
    assert raised.value.field == field


def test_ticks_of_a_cron_with_seconds_and_of_an_interval() -> None:
    ten_s = Timing.checked(cron="*/10 * * * * *")
    at = T0 + timedelta(seconds=25)
    assert (ten_s.latest(at), ten_s.after(at)) == (
        T0 + timedelta(seconds=20),
        T0 + timedelta(seconds=30),
    )
    assert ten_s.latest(T0 + timedelta(seconds=30)) == T0 + timedelta(seconds=30)
    assert ten_s.between(T0, T0 + timedelta(minutes=1)) == 6
    hourly = Timing.checked(every="1h")
    assert hourly.latest(at) == T0 and hourly.after(T0) == T0 + timedelta(hours=1)
