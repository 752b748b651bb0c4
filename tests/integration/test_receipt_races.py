"""Races on one step between real connections that commit.

A claimed receipt is an execution lock: however two attempts interleave, the step's side
effect happens once. Locks are held on purpose and the waiter is seen waiting in
pg_stat_activity (polled with a deadline) before the holder lets go.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest

from queues import receipts
from queues.errors import StaleAttempt
from queues.receipts import JSON, ClaimOutcome, Scope

Conn = psycopg.AsyncConnection[Any]
LEASE = 30.0
SCOPE = Scope.named("shared")
DEADLINE_S = 10.0


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def setup(conn: Conn) -> None:
    await conn.execute(
        "INSERT INTO wq_lanes (name, release) VALUES ('r-test', 'test') ON CONFLICT DO NOTHING"
    )
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS side_effects ("
        " step_key text NOT NULL, run_id uuid NOT NULL, attempt integer NOT NULL)"
    )


async def make_run(conn: Conn, *, attempt: int = 1) -> uuid.UUID:
    run_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO wq_runs (id, org, play, release, lane, state, attempt, lease_owner,"
        " lease_expires_at) VALUES (%(id)s, 'org', 'play', 'test', 'r-test', 'running',"
        " %(attempt)s, 'w1', now() + interval '30 seconds')",
        {"id": run_id, "attempt": attempt},
    )
    return run_id


def ref(run_id: uuid.UUID, attempt: int, key: str, scope: Scope = SCOPE) -> dict[str, Any]:
    return {
        "org": "org",
        "play": "play",
        "scope": scope,
        "step_key": key,
        "run_id": run_id,
        "attempt": attempt,
    }


async def executions(conn: Conn, key: str) -> list[tuple[uuid.UUID, int]]:
    cur = await conn.execute(
        "SELECT run_id, attempt FROM side_effects WHERE step_key = %(k)s", {"k": key}
    )
    return [(row[0], row[1]) for row in await cur.fetchall()]


async def run_step(conn: Conn, run_id: uuid.UUID, attempt: int, key: str) -> tuple[str, JSON]:
    """What ctx.step does: claim (committed), execute once, record; or replay; or wait."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        claim = await receipts.claim(conn, **ref(run_id, attempt, key), lease_s=LEASE)
        if claim.outcome is ClaimOutcome.EXECUTE:
            await conn.execute(
                "INSERT INTO side_effects (step_key, run_id, attempt) VALUES (%(k)s, %(r)s, %(a)s)",
                {"k": key, "r": run_id, "a": attempt},
            )
            result = {"by": str(run_id)}
            return "execute", await receipts.complete(
                conn, **ref(run_id, attempt, key), result=result
            )
        if claim.outcome is ClaimOutcome.REPLAY:
            return "replay", claim.result
        assert claim.outcome is ClaimOutcome.BUSY, claim
        assert time.monotonic() < deadline, f"step {key!r} stayed busy"
        await asyncio.sleep(0.01)  # poll the holder's claim, under the deadline


async def wait_until_blocked(observer: Conn, pid: int) -> None:
    """Poll pg_stat_activity until backend `pid` waits on a lock; fail at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        cur = await observer.execute(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %(pid)s",
            {"pid": pid},
        )
        row = await cur.fetchone()
        if row is not None and row[0] == "Lock":
            return
        assert time.monotonic() < deadline, f"backend {pid} never waited on a lock: {row}"
        await asyncio.sleep(0.01)


async def test_two_runs_racing_one_step_execute_it_once(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        run_a, run_b = await make_run(a), await make_run(a)
        for i in range(25):
            key = f"race#{i}"
            outcomes = await asyncio.gather(run_step(a, run_a, 1, key), run_step(b, run_b, 1, key))
            assert sorted(kind for kind, _ in outcomes) == ["execute", "replay"]
            assert outcomes[0][1] == outcomes[1][1]  # both see the one recorded result
            assert len(await executions(a, key)) == 1


async def test_concurrent_claims_give_one_execute_and_one_busy(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        run_a, run_b = await make_run(a), await make_run(a)
        for i in range(25):
            key = f"claim#{i}"
            claims = await asyncio.gather(
                receipts.claim(a, **ref(run_a, 1, key), lease_s=LEASE),
                receipts.claim(b, **ref(run_b, 1, key), lease_s=LEASE),
            )
            assert sorted(c.outcome for c in claims) == [ClaimOutcome.BUSY, ClaimOutcome.EXECUTE]
            winner = next(c for c in claims if c.outcome is ClaimOutcome.EXECUTE)
            loser = next(c for c in claims if c.outcome is ClaimOutcome.BUSY)
            assert loser.owner_run == winner.owner_run
            assert loser.lease_expires_at == winner.lease_expires_at


async def test_stale_and_current_attempt_racing_execute_once(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        run_id = await make_run(a, attempt=2)  # attempt 1 is a zombie that lost its lease
        for i in range(10):
            key = f"zombie#{i}"
            outcomes = await asyncio.gather(
                run_step(a, run_id, 1, key), run_step(b, run_id, 2, key), return_exceptions=True
            )
            assert isinstance(outcomes[0], StaleAttempt)
            assert outcomes[1] == ("execute", {"by": str(run_id)})
            assert await executions(a, key) == [(run_id, 2)]


@pytest.mark.parametrize("existing", ["absent", "failed"])
async def test_claim_waits_for_a_holder_in_an_open_transaction_then_replays(
    db_url: str, existing: str
) -> None:
    key = "charge"
    async with connect(db_url) as a, connect(db_url) as b, connect(db_url) as observer:
        await setup(a)
        run_a, run_b = await make_run(a), await make_run(a)
        if existing == "failed":  # a committed row: B waits on its row lock, not an insert
            await receipts.claim(a, **ref(run_b, 1, key), lease_s=LEASE)
            await receipts.fail(a, **ref(run_b, 1, key), error={"type": "Boom"})

        async with a.transaction():
            held = await receipts.claim(a, **ref(run_a, 1, key), lease_s=LEASE)
            assert held.outcome is ClaimOutcome.EXECUTE
            await a.execute(
                "INSERT INTO side_effects (step_key, run_id, attempt) VALUES (%(k)s, %(r)s, 1)",
                {"k": key, "r": run_a},
            )
            await receipts.complete(a, **ref(run_a, 1, key), result={"charged": 10})

            waiter = asyncio.create_task(receipts.claim(b, **ref(run_b, 1, key), lease_s=LEASE))
            await wait_until_blocked(observer, b.info.backend_pid)
            assert not waiter.done()
        # A committed: B's claim wakes up and sees the completed receipt.
        claim = await asyncio.wait_for(waiter, DEADLINE_S)
        assert claim.outcome is ClaimOutcome.REPLAY
        assert claim.result == {"charged": 10}
        assert await executions(a, key) == [(run_a, 1)]


async def test_attempt_bump_waits_for_a_receipt_write_in_flight(db_url: str) -> None:
    """The fence holds the run row FOR SHARE: a rescue waits, then the write is seen."""
    async with connect(db_url) as a, connect(db_url) as rescuer, connect(db_url) as observer:
        await setup(a)
        run_id = await make_run(a)
        scope = Scope.of_run(run_id)
        await receipts.claim(a, **ref(run_id, 1, "s", scope), lease_s=LEASE)
        async with a.transaction():
            await receipts.complete(a, **ref(run_id, 1, "s", scope), result="done")
            bump = asyncio.create_task(
                rescuer.execute(
                    "UPDATE wq_runs SET attempt = attempt + 1 WHERE id = %(id)s", {"id": run_id}
                )
            )
            await wait_until_blocked(observer, rescuer.info.backend_pid)
        await asyncio.wait_for(bump, DEADLINE_S)
        replay = await receipts.claim(a, **ref(run_id, 2, "s", scope), lease_s=LEASE)
        assert (replay.outcome, replay.result) == (ClaimOutcome.REPLAY, "done")


async def test_receipt_write_queued_behind_an_attempt_bump_is_refused(db_url: str) -> None:
    """The other order: the rescue holds the run row; the stale write waits, then fails."""
    async with connect(db_url) as a, connect(db_url) as rescuer, connect(db_url) as observer:
        await setup(a)
        run_id = await make_run(a)
        scope = Scope.of_run(run_id)
        await receipts.claim(a, **ref(run_id, 1, "s", scope), lease_s=LEASE)
        async with rescuer.transaction():
            await rescuer.execute(
                "UPDATE wq_runs SET attempt = attempt + 1 WHERE id = %(id)s", {"id": run_id}
            )
            write = asyncio.create_task(
                receipts.complete(a, **ref(run_id, 1, "s", scope), result="stale")
            )
            await wait_until_blocked(observer, a.info.backend_pid)
        with pytest.raises(StaleAttempt, match="now at attempt 2"):
            await asyncio.wait_for(write, DEADLINE_S)
        found = await receipts.get(a, org="org", play="play", scope=scope, step_key="s")
        assert found is not None and found.result is None and found.status == "claimed"
