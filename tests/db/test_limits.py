"""Shared rate limits (queues/limits.py) in one rolled-back transaction, time controlled
through ``now``: the GCRA rate and its burst, the concurrency cap over live attempts only,
per-org buckets, definitions and the sweep of dead holds."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import limits
from queues.errors import InvalidField, LimitUnknown
from tests import attempts

Conn = psycopg.AsyncConnection[Any]


async def test_a_rate_grants_one_permit_per_interval_and_says_how_long_to_wait(conn: Conn) -> None:
    await limits.set_limit(conn, "api", rate="10/s")
    a = await attempts.start(conn)
    t0 = a.now
    first = await limits.acquire(conn, key="api", hold="1", fence=a.fence, now=t0)
    assert first.granted and not first.held and first.at == t0
    early = await limits.acquire(
        conn, key="api", hold="2", fence=a.fence, now=t0 + timedelta(milliseconds=40)
    )
    assert not early.granted and not early.busy
    assert early.wait_s == pytest.approx(0.06, abs=1e-6)
    on_time = await limits.acquire(
        conn, key="api", hold="3", fence=a.fence, now=t0 + timedelta(milliseconds=100)
    )
    assert on_time.granted
    # Ten permits a second, never more: a second of requests every 10 ms gets ten.
    granted = []
    for step in range(100):
        at = t0 + timedelta(seconds=1, milliseconds=10 * step)
        got = await limits.acquire(conn, key="api", hold=f"x{step}", fence=a.fence, now=at)
        if got.granted:
            granted.append(at)
    assert len(granted) == 10
    assert all(b - a >= timedelta(milliseconds=100) for a, b in itertools.pairwise(granted))


async def test_a_burst_lets_that_many_go_at_once_after_a_quiet_spell(conn: Conn) -> None:
    await limits.set_limit(conn, "api", rate="1/s", burst=3)
    a = await attempts.start(conn)
    at = a.now
    got = [
        (await limits.acquire(conn, key="api", hold=str(i), fence=a.fence, now=at)).granted
        for i in range(4)
    ]
    assert got == [True, True, True, False]


async def test_a_concurrency_cap_counts_the_holds_of_live_attempts_only(conn: Conn) -> None:
    await limits.set_limit(conn, "crm", concurrency=2)
    one = await attempts.start(conn, worker="w1")
    two = await attempts.start(conn, worker="w2")
    three = await attempts.start(conn, worker="w3")
    now = one.now + timedelta(seconds=1)
    assert (await limits.acquire(conn, key="crm", hold="a", fence=one.fence, now=now)).held
    assert (await limits.acquire(conn, key="crm", hold="b", fence=two.fence, now=now)).held
    busy = await limits.acquire(conn, key="crm", hold="c", fence=three.fence, now=now)
    assert not busy.granted and busy.busy and busy.wait_s is None
    assert [limit.holding for limit in await limits.list_limits(conn)] == [2]
    assert await limits.release(conn, hold="a", fence=one.fence)
    assert not await limits.release(conn, hold="a", fence=one.fence)  # released once
    assert (await limits.acquire(conn, key="crm", hold="c", fence=three.fence, now=now)).held
    # Past its lease a holder is dead: its permit stops counting, the sweep deletes it.
    later = two.lapses_at + timedelta(seconds=1)
    four = await attempts.start(conn, worker="w4", now=later)
    assert (await limits.acquire(conn, key="crm", hold="d", fence=four.fence, now=later)).held
    assert await limits.sweep(conn, now=later) == 2  # two's and three's, lapsed by then
    cur = await conn.execute("SELECT hold FROM wq_limit_holds ORDER BY hold")
    assert await cur.fetchall() == [("d",)]


async def test_a_per_org_limit_keeps_one_bucket_per_org(conn: Conn) -> None:
    await limits.set_limit(conn, "plan", concurrency=1, per_org=True)
    acme = await attempts.start(conn, org="acme")
    acme2 = await attempts.start(conn, org="acme", worker="w2")
    globex = await attempts.start(conn, org="globex", worker="w3")
    now = acme.now + timedelta(seconds=1)
    assert (await limits.acquire(conn, key="plan", hold="a", fence=acme.fence, now=now)).granted
    assert (await limits.acquire(conn, key="plan", hold="g", fence=globex.fence, now=now)).granted
    assert not (
        await limits.acquire(conn, key="plan", hold="a2", fence=acme2.fence, now=now)
    ).granted
    cur = await conn.execute("SELECT key, org FROM wq_limit_buckets ORDER BY org")
    assert await cur.fetchall() == [("plan", "acme"), ("plan", "globex")]


async def test_an_unknown_limit_is_refused_with_the_nearest_name(conn: Conn) -> None:
    await limits.set_limit(conn, "clearbit", rate="10/s")
    a = await attempts.start(conn)
    with pytest.raises(LimitUnknown, match="did you mean 'clearbit'"):
        await limits.acquire(conn, key="clearbt", hold="1", fence=a.fence)
    assert await limits.delete_limit(conn, "clearbit")
    assert not await limits.delete_limit(conn, "clearbit")
    with pytest.raises(LimitUnknown):
        await limits.acquire(conn, key="clearbit", hold="1", fence=a.fence)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"rate": "10/x"}, "--rate"),
        ({"rate": "0/s"}, "--rate"),
        ({"rate": "ten"}, "--rate"),
        ({}, "--rate"),
        ({"concurrency": "0"}, "--concurrency"),
        ({"burst": "3"}, "--burst"),
        ({"rate": "1/s", "burst": "-1"}, "--burst"),
    ],
)
async def test_a_bad_definition_names_its_flag_and_writes_nothing(
    conn: Conn, values: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidField) as raised:
        await limits.set_limit(conn, "api", **values)
    assert raised.value.field == field
    assert await limits.list_limits(conn) == []


async def test_a_redefinition_keeps_the_buckets_state(conn: Conn) -> None:
    first = await limits.set_limit(conn, "api", rate="1/m", actor="cli:test")
    assert (first.rate, first.rate_per_s, first.burst) == ("1/m", pytest.approx(1 / 60), 1)
    a = await attempts.start(conn)
    assert (await limits.acquire(conn, key="api", hold="1", fence=a.fence, now=a.now)).granted
    again = await limits.set_limit(conn, "api", rate="2/m")
    assert again.created_at == first.created_at
    # The grant under 1/m holds its minute: the next, at 2/m, comes 30 s after that.
    refused = await limits.acquire(conn, key="api", hold="2", fence=a.fence, now=a.now)
    assert not refused.granted and refused.wait_s == pytest.approx(60.0)
