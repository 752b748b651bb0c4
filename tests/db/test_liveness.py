"""Worker liveness (migration 0024): a worker whose session ended is gone, and its leases
are rescued before they lapse; a worker whose session lives, or that never recorded a
liveness lock, or that beat recently, or whose last beat predates the server, is not.

Each test has a database of its own (``db_url``): the lock is held by a second session,
which must see the worker's committed row. The leases are claimed at ``T0`` (2030), so
``now = T0 + 10 s`` is inside the lease and long after every real heartbeat.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import lanes, recovery, runs
from queues.queries import q
from tests import attempts
from tests.attempts import RELEASE, T0
from tests.workers import eventually

Conn = psycopg.AsyncConnection[Any]
WORKER = "host:1:liveness"
INSIDE_LEASE = T0 + timedelta(seconds=10)


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[Conn]:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        yield c


async def register(conn: Conn, worker: str = WORKER) -> None:
    await runs.register_worker(
        conn,
        worker_id=worker,
        lanes=[lanes.lane_name(RELEASE)],
        release=RELEASE,
        host=socket.gethostname(),
        pid=os.getpid(),
    )


async def gone(conn: Conn, worker: str, at: Any) -> bool:
    cur = await conn.execute("SELECT wq_worker_gone(%s, %s)", (worker, at))
    row = await cur.fetchone()
    assert row is not None
    return bool(row[0])


async def session_ended(conn: Conn, at: Any = INSIDE_LEASE) -> None:
    """Wait until the worker counts as gone at ``at``: the server ends a closed session,
    and frees its liveness lock, just after the client's close (under load, a few ms)."""
    await eventually(lambda: gone(conn, WORKER, at), timeout=10)


async def state(conn: Conn, run_id: Any) -> tuple[str, int, str | None]:
    cur = await conn.execute(
        "SELECT state::text, attempt, lease_owner FROM wq_runs WHERE id = %s", (run_id,)
    )
    row = await cur.fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), row[2]


async def test_a_worker_is_gone_once_its_session_ends(conn: Conn, db_url: str) -> None:
    await register(conn)
    assert not await gone(conn, WORKER, INSIDE_LEASE)  # no lock recorded: never gone
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as session:
        await runs.hold_liveness(session, WORKER)
        assert not await gone(conn, WORKER, INSIDE_LEASE)  # its session holds the lock
        await runs.hold_liveness(session, WORKER)  # a reconnect takes it again: no deadlock
        assert not await gone(conn, WORKER, INSIDE_LEASE)
    await session_ended(conn)
    assert not await gone(conn, "someone-else", INSIDE_LEASE)  # no such worker


async def test_a_recent_beat_or_one_before_the_server_started_is_not_gone(
    conn: Conn, db_url: str
) -> None:
    await register(conn)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as session:
        await runs.hold_liveness(session, WORKER)
    cur = await conn.execute("SELECT now()")
    row = await cur.fetchone()
    assert row is not None
    now = row[0]
    # It beat just now (registration): silent for less than 10 s, so reconnecting.
    assert not await gone(conn, WORKER, now)
    await session_ended(conn, now + timedelta(seconds=11))
    # Its last beat came before the server started: a database restart, not a death.
    await conn.execute(
        "UPDATE wq_workers SET heartbeat_at = pg_postmaster_start_time() - interval '1 s'"
        " WHERE id = %s",
        (WORKER,),
    )
    assert not await gone(conn, WORKER, now + timedelta(hours=1))


async def test_a_gone_workers_leases_are_rescued_before_they_lapse(conn: Conn, db_url: str) -> None:
    await register(conn)
    other = "host:2:alive"
    await register(conn, other)
    async with (
        await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mine,
        await psycopg.AsyncConnection.connect(db_url, autocommit=True) as theirs,
    ):
        await runs.hold_liveness(mine, WORKER)
        await runs.hold_liveness(theirs, other)
        dying = await attempts.start(conn, worker=WORKER)
        living = await attempts.start(conn, worker=other)
        assert dying.lapses_at > INSIDE_LEASE
        assert await recovery.rescue_gone(conn, now=INSIDE_LEASE) == []
        await mine.close()  # the worker is killed: its session ends
        await session_ended(conn)

        rescued = await recovery.rescue_gone(conn, now=INSIDE_LEASE)
        assert [(r.run_id, r.attempt, r.state) for r in rescued] == [(dying.run_id, 1, "queued")]
        assert await state(conn, dying.run_id) == ("queued", 1, None)
        assert await state(conn, living.run_id) == ("running", 1, other)
        cur = await conn.execute(
            "SELECT outcome::text, error ->> 'code' FROM wq_attempts WHERE run_id = %s",
            (dying.run_id,),
        )
        assert await cur.fetchall() == [("lease_expired", "LEASE_EXPIRED")]
        # The pass's own rule is the same one: nothing left for it inside the lease.
        report = await recovery.run_once(conn, now=INSIDE_LEASE)
        assert report.expired == ()


async def test_the_rescue_is_fenced_by_the_owner_coming_back(conn: Conn, db_url: str) -> None:
    """Between the pick and the apply the owner's session takes its lock again: the apply,
    which asks the same rule under the row lock, writes nothing."""
    await register(conn)
    attempt = await attempts.start(conn, worker=WORKER)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as session:
        await runs.hold_liveness(session, WORKER)
    args = {
        "now": INSIDE_LEASE,
        "run_ids": [attempt.run_id],
        "attempts": [1],
        "states": ["queued"],
        "spawn": [True],
        "delays": [0.0],
        "codes": ["LEASE_EXPIRED"],
        "whys": [None],
    }
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as back:
        await runs.hold_liveness(back, WORKER)
        async with conn.transaction():
            cur = await conn.execute(q("recovery_expired_apply"), args)
            assert await cur.fetchall() == []
        assert await state(conn, attempt.run_id) == ("running", 1, WORKER)
    await session_ended(conn)
    async with conn.transaction():
        cur = await conn.execute(q("recovery_expired_apply"), args)
        assert len(await cur.fetchall()) == 1
    assert await state(conn, attempt.run_id) == ("queued", 1, None)
