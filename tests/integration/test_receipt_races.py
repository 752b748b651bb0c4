"""Races on one step between real connections that commit.

A claimed receipt is an execution lock: however two attempts interleave, the step's side
effect happens once. Every run is a real one (admitted and claimed, ``tests/attempts.py``)
and a stale attempt is made by the real recovery pass and a real second claim. Locks are
held on purpose and the waiter is seen waiting in pg_stat_activity (polled with a deadline)
before the holder lets go; nothing sleeps to wait for a state.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from queues import receipts, recovery
from queues.errors import StaleAttempt
from queues.fence import Fence
from queues.receipts import JSON, ClaimOutcome, ReceiptStatus, Scope
from tests import attempts
from tests.attempts import ORG, PLAY, Attempt
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
LEASE = 30.0
SCOPE = Scope.named("shared")
DEADLINE_S = 10.0


async def setup(conn: Conn) -> None:
    """The table a step's side effect writes to (one row per execution)."""
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS side_effects ("
        " step_key text NOT NULL, run_id uuid NOT NULL, attempt integer NOT NULL)"
    )


def ref(fence: Fence, key: str, scope: Scope = SCOPE) -> dict[str, Any]:
    return {"org": ORG, "play": PLAY, "scope": scope, "step_key": key, "fence": fence}


async def executions(conn: Conn, key: str) -> list[tuple[uuid.UUID, int]]:
    cur = await conn.execute(
        "SELECT run_id, attempt FROM side_effects WHERE step_key = %(k)s", {"k": key}
    )
    return [(row[0], row[1]) for row in await cur.fetchall()]


async def run_step(conn: Conn, fence: Fence, key: str) -> tuple[str, JSON]:
    """What ctx.step does: claim (committed), execute once, record; or replay; or wait."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        claim = await receipts.claim(conn, receipts.StepRef(**ref(fence, key)), lease_s=LEASE)
        if claim.outcome is ClaimOutcome.EXECUTE:
            await conn.execute(
                "INSERT INTO side_effects (step_key, run_id, attempt) VALUES (%(k)s, %(r)s, %(a)s)",
                {"k": key, "r": fence.run_id, "a": fence.attempt},
            )
            result = {"by": str(fence.run_id)}
            return "execute", await receipts.complete(
                conn, receipts.StepRef(**ref(fence, key)), result=result
            )
        if claim.outcome is ClaimOutcome.REPLAY:
            return "replay", claim.result
        assert claim.outcome is ClaimOutcome.BUSY, claim
        assert time.monotonic() < deadline, f"step {key!r} stayed busy"
        await asyncio.sleep(0.01)  # poll the holder's claim, under the deadline


async def wait_until_blocked(
    observer: Conn, pid: int, task: asyncio.Task[Any] | None = None
) -> None:
    """Poll pg_stat_activity until backend `pid` waits on a lock; fail at the deadline, or
    as soon as the waiter's task ended (it did not block)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert task is None or not task.done(), "the waiter did not block"
        cur = await observer.execute(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %(pid)s",
            {"pid": pid},
        )
        row = await cur.fetchone()
        if row is not None and row[0] == "Lock":
            return
        assert time.monotonic() < deadline, f"backend {pid} never waited on a lock: {row}"
        await asyncio.sleep(0.01)


def past_lease(a: Attempt) -> datetime:
    """A recovery pass's clock, just after the attempt's lease lapsed."""
    return a.lapses_at + timedelta(seconds=1)


async def test_two_runs_racing_one_step_execute_it_once(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        run_a, run_b = await attempts.start(a), await attempts.start(a)
        for i in range(25):
            key = f"race#{i}"
            outcomes = await asyncio.gather(
                run_step(a, run_a.fence, key), run_step(b, run_b.fence, key)
            )
            assert sorted(kind for kind, _ in outcomes) == ["execute", "replay"]
            assert outcomes[0][1] == outcomes[1][1]  # both see the one recorded result
            executed = await executions(a, key)
            assert len(executed) == 1
            assert outcomes[0][1] == {"by": str(executed[0][0])}  # the executor's result


async def test_concurrent_claims_give_one_execute_and_one_busy(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        run_a, run_b = await attempts.start(a), await attempts.start(a)
        for i in range(25):
            key = f"claim#{i}"
            claims = await asyncio.gather(
                receipts.claim(a, receipts.StepRef(**ref(run_a.fence, key)), lease_s=LEASE),
                receipts.claim(b, receipts.StepRef(**ref(run_b.fence, key)), lease_s=LEASE),
            )
            assert sorted(c.outcome for c in claims) == [ClaimOutcome.BUSY, ClaimOutcome.EXECUTE]
            winner = next(c for c in claims if c.outcome is ClaimOutcome.EXECUTE)
            loser = next(c for c in claims if c.outcome is ClaimOutcome.BUSY)
            assert loser.owner_run == winner.owner_run
            assert loser.lease_expires_at == winner.lease_expires_at


async def test_stale_and_current_attempt_racing_execute_once(db_url: str) -> None:
    async with connect(db_url) as a, connect(db_url) as b:
        await setup(a)
        zombie = await attempts.start(a)  # attempt 1 lapses, is rescued, and w2 claims 2
        live = await attempts.supersede(a, zombie)
        run_id = live.run_id
        for i in range(10):
            key = f"zombie#{i}"
            outcomes = await asyncio.gather(
                run_step(a, zombie.fence, key),
                run_step(b, live.fence, key),
                return_exceptions=True,
            )
            assert isinstance(outcomes[0], StaleAttempt)
            assert outcomes[1] == ("execute", {"by": str(run_id)})
            assert await executions(a, key) == [(run_id, 2)]
        assert await attempts.refusals(a, run_id) == [(1, "receipt", 1)] * 10


@pytest.mark.parametrize("existing", ["absent", "failed"])
async def test_claim_waits_for_a_holder_in_an_open_transaction_then_replays(
    db_url: str, existing: str
) -> None:
    key = "charge"
    async with connect(db_url) as a, connect(db_url) as b, connect(db_url) as observer:
        await setup(a)
        run_a, run_b = await attempts.start(a), await attempts.start(a)
        if existing == "failed":  # a committed row: B waits on its row lock, not an insert
            await receipts.claim(a, receipts.StepRef(**ref(run_b.fence, key)), lease_s=LEASE)
            await receipts.fail(
                a, receipts.StepRef(**ref(run_b.fence, key)), error={"type": "Boom"}
            )

        async with a.transaction():
            held = await receipts.claim(a, receipts.StepRef(**ref(run_a.fence, key)), lease_s=LEASE)
            assert held.outcome is ClaimOutcome.EXECUTE
            await a.execute(
                "INSERT INTO side_effects (step_key, run_id, attempt) VALUES (%(k)s, %(r)s, 1)",
                {"k": key, "r": run_a.run_id},
            )
            await receipts.complete(
                a, receipts.StepRef(**ref(run_a.fence, key)), result={"charged": 10}
            )

            waiter = asyncio.create_task(
                receipts.claim(b, receipts.StepRef(**ref(run_b.fence, key)), lease_s=LEASE)
            )
            await wait_until_blocked(observer, b.info.backend_pid, waiter)
            assert not waiter.done()
        # A committed: B's claim wakes up and sees the completed receipt.
        claim = await asyncio.wait_for(waiter, DEADLINE_S)
        assert claim.outcome is ClaimOutcome.REPLAY
        assert claim.result == {"charged": 10}
        assert (claim.owner_run, claim.owner_attempt) == (run_a.run_id, 1)
        assert await executions(a, key) == [(run_a.run_id, 1)]


async def test_a_rescue_pass_skips_a_run_whose_receipt_write_is_in_flight(db_url: str) -> None:
    """The write holds the run row FOR SHARE until it commits. The recovery pass picks
    lapsed runs FOR UPDATE SKIP LOCKED, so it does not wait for the write: it leaves the
    run alone (the rescue cannot land under the write) and the next pass, after the write
    committed, rescues it; the next attempt then replays what the write recorded."""
    async with connect(db_url) as a, connect(db_url) as rescuer, connect(db_url) as observer:
        await setup(a)
        old = await attempts.start(a)
        scope = Scope.of_run(old.run_id)
        await receipts.claim(a, receipts.StepRef(**ref(old.fence, "s", scope)), lease_s=LEASE)
        async with a.transaction():
            await receipts.complete(
                a, receipts.StepRef(**ref(old.fence, "s", scope)), result="done"
            )
            # The lease lapsed, but the write is in flight: a pass now rescues nothing. (A
            # pass that waited for the write would hang here: the write commits only after.)
            report = await asyncio.wait_for(
                recovery.run_once(rescuer, now=past_lease(old)), DEADLINE_S
            )
            assert report.expired == ()
            assert await attempts.run_row(observer, old.run_id) == {
                "state": "running",
                "attempt": 1,
                "lease_owner": "w1",
                "cancel": False,
            }
            unseen = await receipts.get(observer, org=ORG, play=PLAY, scope=scope, step_key="s")
            assert unseen is not None and unseen.status is ReceiptStatus.CLAIMED
        # The write committed; the next pass rescues the run and w2 claims attempt 2.
        rescued = await attempts.rescue(rescuer, old)
        assert [(r.run_id, r.attempt, r.state) for r in rescued.expired] == [
            (old.run_id, 1, "queued")
        ]
        new = await attempts.claim(
            rescuer, worker="w2", now=old.lapses_at + timedelta(minutes=10), run_id=old.run_id
        )
        assert new.fence == Fence(old.run_id, 2, "w2")
        replay = await receipts.claim(
            a, receipts.StepRef(**ref(new.fence, "s", scope)), lease_s=LEASE
        )
        assert (replay.outcome, replay.result) == (ClaimOutcome.REPLAY, "done")
        assert (replay.owner_run, replay.owner_attempt) == (old.run_id, 1)
        assert await attempts.refusals(a, old.run_id) == []


async def test_receipt_write_queued_behind_a_rescue_in_flight_is_refused(db_url: str) -> None:
    """The other order: the rescue holds the run row (FOR UPDATE, then its UPDATE); the
    stale write waits for it, re-reads the run row after the rescue committed, and is
    refused: the run is queued, attempt 1 no longer owns it."""
    async with connect(db_url) as a, connect(db_url) as rescuer, connect(db_url) as observer:
        await setup(a)
        old = await attempts.start(a)
        scope = Scope.of_run(old.run_id)
        await receipts.claim(a, receipts.StepRef(**ref(old.fence, "s", scope)), lease_s=LEASE)
        # The pass runs inside a transaction we hold open: its rescue is in flight.
        async with rescuer.transaction():
            report = await recovery.run_once(rescuer, now=past_lease(old))
            assert [(r.run_id, r.attempt, r.state) for r in report.expired] == [
                (old.run_id, 1, "queued")
            ]
            write = asyncio.create_task(
                receipts.complete(a, receipts.StepRef(**ref(old.fence, "s", scope)), result="stale")
            )
            await wait_until_blocked(observer, a.info.backend_pid, write)
            assert not write.done()
        with pytest.raises(StaleAttempt, match=r"now at attempt 1 \(queued\)"):
            await asyncio.wait_for(write, DEADLINE_S)
        found = await receipts.get(a, org=ORG, play=PLAY, scope=scope, step_key="s")
        assert found is not None
        assert (found.status, found.owner_attempt, found.result) == (
            ReceiptStatus.CLAIMED,
            1,
            None,
        )
        assert await attempts.refusals(a, old.run_id) == [(1, "receipt", 1)]
        # The next attempt takes the step over; only its write stands.
        new = await attempts.claim(
            rescuer, worker="w2", now=old.lapses_at + timedelta(minutes=10), run_id=old.run_id
        )
        taken = await receipts.claim(
            a, receipts.StepRef(**ref(new.fence, "s", scope)), lease_s=LEASE
        )
        assert taken.outcome is ClaimOutcome.EXECUTE
        await receipts.complete(a, receipts.StepRef(**ref(new.fence, "s", scope)), result="fresh")
        done = await receipts.get(a, org=ORG, play=PLAY, scope=scope, step_key="s")
        assert done is not None
        assert (done.status, done.owner_attempt, done.result) == (
            ReceiptStatus.COMPLETED,
            2,
            "fresh",
        )
