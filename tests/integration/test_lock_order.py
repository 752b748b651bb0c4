"""Lock order on wq_runs between the worker's heartbeat and its batched finish.

Both write the same worker's running runs: the heartbeat renews every live lease in one
statement, the finish loop writes a batch of outcomes in one statement. The finish locks
its runs in id order; the heartbeat used to lock them in the order its UPDATE's join
produced them, so a heartbeat holding a later run and waiting for an earlier one, while a
finish held the earlier one and waited for the later one, was a deadlock ("deadlock
detected ... while locking tuple ... in relation wq_runs", seen in submit+drain
benchmarks). Both now lock in id order.

The interleaving is made with real connections and locks held on purpose: three runs
s1 < s2 < s3 of one worker; a third connection holds s3. The heartbeat is sent the leases
in the order s2, s3, s1 (the order an unordered join follows); the finish writes s1 and s2.
Unordered, the heartbeat took s2 and waited for s3; the finish took s1 and waited for s2;
once s3 was let go the heartbeat asked for s1: a deadlock. Ordered, the heartbeat holds
s1 and s2 while it waits for s3, and the finish waits for it, holding nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from queues import outcomes, runs
from queues.outcomes import FinishStatus
from tests import attempts
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
DEADLINE_S = 10.0
ROUNDS = 8


async def wait_until_blocked(observer: Conn, pid: int, task: asyncio.Task[Any]) -> None:
    """Poll pg_stat_activity until backend ``pid`` waits on a lock (deadline-bounded)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert not task.done(), f"the waiter did not block: {task!r}"
        cur = await observer.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}
        )
        row = await cur.fetchone()
        if row is not None and row[0] == "Lock":
            return
        assert time.monotonic() < deadline, f"backend {pid} never waited on a lock: {row}"
        await asyncio.sleep(0.01)


async def locked_by_other(observer: Conn, run_id: Any) -> bool:
    """Whether another transaction holds a lock on the run's row that excludes ours."""
    try:
        async with observer.transaction():
            await observer.execute(
                "SELECT 1 FROM wq_runs WHERE id = %(id)s FOR NO KEY UPDATE NOWAIT", {"id": run_id}
            )
    except psycopg.errors.LockNotAvailable:
        return True
    return False


async def test_heartbeat_and_batched_finish_lock_runs_in_one_order(db_url: str) -> None:
    async with (
        connect(db_url) as setup,
        connect(db_url) as holder,
        connect(db_url) as beat,
        connect(db_url) as finisher,
        connect(db_url) as observer,
    ):
        # The order an unordered statement locks in is its plan's: the leases' order, or
        # an index's over random run ids, which is the id order only by chance. Each round
        # has new runs, so an unordered heartbeat deadlocks (or is seen holding s2 but not
        # s1) in one of them (about every other round: eight miss it 1 time in 256).
        for _ in range(ROUNDS):
            await one_round(setup, holder, beat, finisher, observer)


async def one_round(setup: Conn, holder: Conn, beat: Conn, finisher: Conn, observer: Conn) -> None:
    started = [await attempts.start(setup) for _ in range(3)]
    by_id = sorted(started, key=lambda a: a.run_id)
    s1, s2, s3 = by_id
    assert {a.fence.owner for a in by_id} == {"w1"}

    async with holder.transaction():
        await holder.execute("SELECT 1 FROM wq_runs WHERE id = %(id)s FOR SHARE", {"id": s3.run_id})

        leases = [(a.run_id, a.fence.attempt) for a in (s2, s3, s1)]
        heartbeat = asyncio.create_task(runs.heartbeat(beat, worker_id="w1", leases=leases))
        await wait_until_blocked(observer, beat.info.backend_pid, heartbeat)
        # Ordered: it holds the runs before s3 and nothing after; it waits for s3.
        assert await locked_by_other(observer, s1.run_id)
        assert await locked_by_other(observer, s2.run_id)

        finishes = [outcomes.succeeded(a.run_id, a.fence.attempt, {"n": 1}) for a in (s1, s2)]
        finish = asyncio.create_task(runs.finish(finisher, worker_id="w1", finishes=finishes))
        await wait_until_blocked(observer, finisher.info.backend_pid, finish)
    # The holder let s3 go: the heartbeat completes, then the finish; no deadlock.
    renewed = await asyncio.wait_for(heartbeat, DEADLINE_S)
    statuses = await asyncio.wait_for(finish, DEADLINE_S)

    assert {r.run_id for r in renewed} == {a.run_id for a in by_id}
    assert statuses == {(a.run_id, a.fence.attempt): FinishStatus.APPLIED for a in (s1, s2)}
