"""The transport seam on real, committing connections: NOTIFY channels and SKIP LOCKED.

Each test gets a fresh clone of the migrated template (``db_url``). Locks are held on
purpose; notifications are awaited with a deadline, never a sleep.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from queues import transport

Conn = psycopg.AsyncConnection[Any]
LANE = "r-seam"
OTHER = "r-seam-other"
DEADLINE_S = 10.0


@asynccontextmanager
async def connect(url: str, *, autocommit: bool = True) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=autocommit)
    try:
        yield conn
    finally:
        await conn.close()


async def spawn(conn: Conn, lane: str, n: int) -> list[int]:
    cur = await conn.execute(
        "SELECT array_agg(wq_transport_next_id()) FROM generate_series(1, %s)", (n,)
    )
    row = await cur.fetchone()
    assert row is not None
    ids: list[int] = row[0]
    await conn.execute(
        "SELECT wq_transport_spawn(%s, %s, %s)", (ids, [lane] * n, [uuid.uuid4()] * n)
    )
    return ids


async def take(conn: Conn, limit: int) -> set[int]:
    cur = await conn.execute("SELECT job_id FROM wq_transport_take(%s, %s, NULL)", ([LANE], limit))
    return {row[0] for row in await cur.fetchall()}


async def next_note(listener: Conn) -> psycopg.Notify:
    async for note in listener.notifies(timeout=DEADLINE_S, stop_after=1):
        return note
    raise AssertionError(f"no notification within {DEADLINE_S} s")


async def test_a_spawn_wakes_its_lane_and_a_cancel_request_reaches_the_control_channel(
    db_url: str,
) -> None:
    async with connect(db_url) as listener, connect(db_url) as writer:
        await transport.listen(listener, [LANE])
        await spawn(writer, OTHER, 1)  # another lane's job wakes nobody here
        [job_id] = await spawn(writer, LANE, 1)
        note = await next_note(listener)
        assert note.channel == transport.lane_channel(LANE)
        # A delivery sent back to the lane wakes its workers the same way.
        assert await take(writer, 1) == {job_id}
        await writer.execute("SELECT wq_transport_release(%s)", ([job_id],))
        note = await next_note(listener)
        assert note.channel == transport.lane_channel(LANE)

        run_id = uuid.uuid4()
        await writer.execute("SELECT wq_transport_notify_cancel(%s)", (run_id,))
        note = await next_note(listener)
        assert note.channel == transport.CONTROL_CHANNEL
        assert transport.cancel_request(note.payload) == run_id


async def test_concurrent_takers_get_different_jobs(db_url: str) -> None:
    async with (
        connect(db_url) as setup,
        connect(db_url, autocommit=False) as first,
        connect(db_url, autocommit=False) as second,
    ):
        ids = await spawn(setup, LANE, 4)
        assert await take(first, 2) == set(ids[:2])
        # The first taker's transaction is open: its jobs are skipped, not waited for.
        assert await take(second, 4) == set(ids[2:])
        await second.rollback()
        await first.rollback()
        assert await take(second, 4) == set(ids)
        await second.rollback()


async def test_withdraw_skips_a_waiting_job_a_claimer_holds(db_url: str) -> None:
    async with connect(db_url) as setup, connect(db_url, autocommit=False) as claimer:
        held, free = await spawn(setup, LANE, 2)
        # A claim in flight holds the todo job's row (as wq_transport_take's pick does).
        await claimer.execute("SELECT id FROM procrastinate_jobs WHERE id = %s FOR UPDATE", (held,))
        withdraw = "SELECT wq_transport_withdraw(%s)"
        cur = await setup.execute(withdraw, ([held, free],))
        assert await cur.fetchone() == (1,)
        await claimer.rollback()
        cur = await setup.execute(withdraw, ([held, free],))
        assert await cur.fetchone() == (1,)
        cur = await setup.execute(
            "SELECT status FROM wq_transport_jobs() WHERE id = ANY (%s)", ([held, free],)
        )
        assert await cur.fetchall() == [("cancelled",), ("cancelled",)]
