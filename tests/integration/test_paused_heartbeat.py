"""A worker paused right after its heartbeat's reply holds no lock.

A worker can be paused at any instruction: SIGSTOP, a frozen VM, a thread the scheduler
does not run for a while. Its heartbeat renewed the leases inside a transaction of its
own (BEGIN, the renewal, COMMIT: three round trips), so a worker paused between the
renewal's reply and its COMMIT kept its runs' rows locked for as long as it stayed
paused. Its leases lapsed all the same, but the recovery pass picks lapsed leases
``FOR UPDATE SKIP LOCKED``: it skipped the run at every pass, no retry job was spawned,
and the run stayed ``running`` under a dead lease until the worker woke up (seen as
``tests/e2e/test_zombies.py`` timing out waiting for the run to end, once in a loaded
CI run). The renewal is now one statement on the autocommit connection, committed by the
server before it answers, so there is no such moment.

The pause is made deterministic: the heartbeat's connection gets a cursor that, after
each statement's reply, runs the check a paused worker must pass, from other
connections, before the heartbeat goes on.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import pq

from queues import recovery, runs
from tests import attempts
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]


def pausing(conn: Conn, check: Any) -> None:
    """Make every statement on ``conn`` await ``check()`` right after its reply: the
    moment a worker paused after the reply would be stopped at."""

    class Paused(psycopg.AsyncCursor[Any]):
        async def execute(self, *args: Any, **kwargs: Any) -> Any:
            result = await super().execute(*args, **kwargs)
            await check()
            return result

    conn.cursor_factory = Paused


async def test_a_worker_paused_after_a_renewal_holds_no_lock(db_url: str) -> None:
    async with connect(db_url) as setup, connect(db_url) as beat, connect(db_url) as other:
        started = await attempts.start(setup)
        owner, attempt = started.fence.owner, started.fence.attempt
        seen: list[tuple[pq.TransactionStatus, list[Any]]] = []

        async def paused() -> None:
            # The renewal (at T0) is answered; the worker stops here. Past the renewed
            # lease, a recovery pass must be able to rescue the run.
            report = await recovery.run_once(other, now=started.lapses_at + timedelta(seconds=1))
            seen.append((beat.info.transaction_status, [r.run_id for r in report.expired]))

        pausing(beat, paused)
        renewed = await runs.heartbeat(
            beat, worker_id=owner, leases=[(started.run_id, attempt)], now=attempts.T0
        )

    assert [(r.run_id, r.attempt) for r in renewed] == [(started.run_id, attempt)]
    # Nothing was left open by the paused heartbeat, and the rescue was not skipped.
    assert seen == [(pq.TransactionStatus.IDLE, [started.run_id])]


async def test_a_worker_paused_after_marking_itself_alive_holds_no_lock(db_url: str) -> None:
    async with connect(db_url) as setup, connect(db_url) as beat:
        await runs.register_worker(
            setup, worker_id="w1", lanes=["r-fence"], release="fence", host="h", pid=os.getpid()
        )
        seen: list[pq.TransactionStatus] = []

        async def paused() -> None:
            seen.append(beat.info.transaction_status)

        pausing(beat, paused)
        await runs.worker_heartbeat(beat, "w1")

    assert seen == [pq.TransactionStatus.IDLE]
