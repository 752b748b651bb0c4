"""One NOTIFY wakes one claimer (migration 0032), on real committing connections.

Each worker here is what a worker process has: a registered row, a session that holds its
liveness lock and LISTENs on its lanes' channel and on its own wake channel, and claims on
another connection. Notifications are counted up to a sentinel NOTIFY sent after the
statement under test committed: a session receives notifications in commit order, so
everything the statement sent has arrived when the sentinel does.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from queues import admission, lanes, runs, transport
from tests.workers import eventually

Conn = psycopg.AsyncConnection[Any]
RELEASE = "wake-one"
LANE = lanes.lane_name(RELEASE)
PLAY = "p"
SENTINEL = "wq_test_sentinel"
DEADLINE_S = 10.0


@dataclass
class Claimer:
    """A worker as the database sees it: its row, its LISTEN session, its claims."""

    id: str
    channel: str
    session: Conn  # holds the liveness lock; LISTENs
    conn: Conn  # claims

    async def claim(self, limit: int = 10) -> int:
        claimed = await runs.claim(
            self.conn, lanes=[LANE], worker_id=self.id, limit=limit, plays=[PLAY]
        )
        return sum(c.claimed for c in claimed)

    async def heard(self, writer: Conn) -> list[str]:
        """The channels of the notifications this worker heard, up to a sentinel sent now
        (the lane's channel or its own)."""
        await writer.execute("SELECT pg_notify(%s, %s)", (SENTINEL, self.id))
        heard: list[str] = []
        async for note in self.session.notifies(timeout=DEADLINE_S):
            if note.channel == SENTINEL:
                if note.payload == self.id:
                    return heard
                continue  # another worker's sentinel
            heard.append("own" if note.channel == self.channel else note.channel)
        raise AssertionError(f"{self.id}: no sentinel within {DEADLINE_S} s: {heard}")


async def connect(url: str) -> Conn:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


@asynccontextmanager
async def claimer(url: str, stack: AsyncExitStack, name: str) -> AsyncIterator[Claimer]:
    conn = await stack.enter_async_context(await connect(url))
    session = await connect(url)
    try:
        await runs.register_worker(
            conn, worker_id=name, lanes=[LANE], release=RELEASE,
            host=socket.gethostname(), pid=os.getpid(),
        )  # fmt: skip
        await transport.listen(session, [LANE])
        channel = await runs.hold_liveness(session, name)
        await transport.listen_wake(session, channel)
        await session.execute(f"LISTEN {SENTINEL}")
        yield Claimer(name, channel, session, conn)
    finally:
        await session.close()


@asynccontextmanager
async def claimers(url: str, *names: str) -> AsyncIterator[list[Claimer]]:
    async with AsyncExitStack() as stack:
        made = [await stack.enter_async_context(claimer(url, stack, n)) for n in names]
        yield made


async def waiting_since(conn: Conn, worker: str) -> datetime | None:
    cur = await conn.execute("SELECT waiting_since FROM wq_workers WHERE id = %s", (worker,))
    row = await cur.fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


async def pass_on(conn: Conn, worker: str) -> int:
    """What a woken worker with no room does (worker.runtime): leave the set, then wake."""
    await runs.stop_waiting(conn, worker)
    return await transport.wake(conn, [LANE])


async def admit(conn: Conn, n: int = 1) -> None:
    subs = [admission.Submission(play=PLAY, params={"i": i}, release=RELEASE) for i in range(n)]
    if n == 1:
        await admission.submit(conn, subs[0])
    else:
        await admission.submit_many(conn, subs)


async def test_claims_keep_the_set_of_waiting_workers(db_url: str) -> None:
    async with await connect(db_url) as writer, claimers(db_url, "w:set") as [w]:
        await lanes.prepare(writer, RELEASE)
        assert await waiting_since(writer, w.id) is None  # registered: not waiting yet

        assert await w.claim() == 0  # found nothing: waits
        joined = await waiting_since(writer, w.id)
        assert joined is not None
        assert await w.claim() == 0  # nothing again: nothing written
        assert await waiting_since(writer, w.id) == joined
        await admit(writer)
        assert await w.claim() == 1  # took some, not all it asked for: still waiting,
        assert await waiting_since(writer, w.id) == joined  # nothing written

        await admit(writer, 3)
        assert await w.claim(limit=2) == 2  # took all it asked for: not waiting
        assert await waiting_since(writer, w.id) is None
        assert await w.claim(limit=2) == 1  # the third: waits again
        assert await waiting_since(writer, w.id) is not None

        await runs.stop_waiting(writer, w.id)  # a stopping worker
        assert await waiting_since(writer, w.id) is None
        assert await w.claim() == 0
        await runs.worker_stopped(writer, w.id)  # and a stopped one
        assert await waiting_since(writer, w.id) is None


async def test_a_spawn_wakes_waiting_workers_alone_and_in_turns(db_url: str) -> None:
    async with await connect(db_url) as writer, claimers(db_url, "w:a", "w:b", "w:c") as ws:
        a, b, c = ws
        await lanes.prepare(writer, RELEASE)
        for w in ws:
            assert await w.claim() == 0

        # One job each time: one worker woken, on its own channel, nobody else; three
        # spawns, three different workers.
        woken: list[Claimer] = []
        for _ in range(3):
            await admit(writer)
            heard = [await w.heard(writer) for w in ws]
            assert sorted(heard) == [[], [], ["own"]], heard
            [chosen] = [w for w, h in zip(ws, heard, strict=True) if h]
            woken.append(chosen)
            assert await chosen.claim() == 1  # finds its run; still waiting
        assert sorted(w.id for w in woken) == sorted(w.id for w in ws)

        await admit(writer, 2)  # two jobs: two workers
        heard = [await w.heard(writer) for w in ws]
        assert sorted(heard) == [[], ["own"], ["own"]], heard
        for w, h in zip(ws, heard, strict=True):
            if h:
                assert await w.claim(limit=1) == 1  # took all it asked for: not waiting
        [still] = [w for w, h in zip(ws, heard, strict=True) if not h]
        await admit(writer)  # one waits now
        assert [await w.heard(writer) for w in ws] == [["own"] if w is still else [] for w in ws]
        assert await still.claim(limit=1) == 1  # nobody waits now
        assert await b.claim() == 0  # b does

        # A job sent back to its lane (a dropped delivery whose run waits for it) wakes
        # the same way.
        [(job_id,)] = await (
            await writer.execute(
                "SELECT job_id FROM wq_runs WHERE state = 'running'"
                " ORDER BY started_at DESC LIMIT 1"
            )
        ).fetchall()
        assert await (
            await writer.execute("SELECT wq_transport_release(%s)", ([job_id],))
        ).fetchone() == (1,)
        assert [await w.heard(writer) for w in ws] == [[], ["own"], []]

        # A worker passing a wake on (its slots filled meanwhile) stops waiting; another
        # waiting worker is woken, never itself.
        assert await c.claim() == 0  # waiting: b, c
        assert await pass_on(writer, b.id) == 1
        assert [await w.heard(writer) for w in ws] == [[], [], ["own"]]
        assert await waiting_since(writer, b.id) is None
        assert await a.claim() == 0  # a waits too
        assert await pass_on(writer, c.id) == 1  # b is not waiting
        assert [await w.heard(writer) for w in ws] == [["own"], [], []]


async def test_a_gone_worker_is_passed_over(db_url: str) -> None:
    async with await connect(db_url) as writer, claimers(db_url, "w:gone", "w:live") as ws:
        gone, live = ws
        await lanes.prepare(writer, RELEASE)
        assert await gone.claim() == 0
        assert await live.claim() == 0  # both wait
        await gone.session.close()  # killed: its LISTEN session, and its lock, end

        async def lock_free() -> bool:
            cur = await writer.execute(
                "SELECT pg_try_advisory_xact_lock_shared(liveness_key) FROM wq_workers"
                " WHERE id = %s",
                (gone.id,),
            )
            row = await cur.fetchone()
            return row is not None and bool(row[0])

        await eventually(lock_free, timeout=DEADLINE_S)
        assert await waiting_since(writer, gone.id) is not None  # still waiting ...
        for _ in range(2):  # (whichever one's turn it is)
            await admit(writer)
            assert await live.heard(writer) == ["own"]  # ... but nobody would hear it
        assert await waiting_since(writer, gone.id) is None  # found gone: out of the set


async def test_with_nobody_waiting_the_lane_is_broadcast(db_url: str) -> None:
    async with await connect(db_url) as writer, claimers(db_url, "w:x", "w:y") as ws:
        await lanes.prepare(writer, RELEASE)
        await admit(writer)  # neither has claimed yet: not waiting
        assert [await w.heard(writer) for w in ws] == [[transport.lane_channel(LANE)]] * 2
        assert await transport.wake(writer, [LANE]) == 0  # broadcast again
        assert [await w.heard(writer) for w in ws] == [[transport.lane_channel(LANE)]] * 2


async def test_a_spawn_racing_a_claim_that_finds_nothing_loses_no_wake(db_url: str) -> None:
    """The claim's snapshot misses the run, and the spawn cannot see the worker join the
    set (not committed yet): the spawn broadcasts, and the worker hears it."""
    async with await connect(db_url) as writer, claimers(db_url, "w:race") as [w]:
        await lanes.prepare(writer, RELEASE)
        async with w.conn.transaction():
            assert await w.claim() == 0  # its snapshot: no run yet; waits, uncommitted
            await admit(writer)  # committed before the claim: sees nobody waiting
        assert await waiting_since(writer, w.id) is not None  # the claim has committed
        assert await w.heard(writer) == [transport.lane_channel(LANE)]
        assert await w.claim() == 1  # woken, it finds the run
