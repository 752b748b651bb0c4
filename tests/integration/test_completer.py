"""The completer (``worker.completer``): a worker's final writes batched into one fenced
statement, each answered with its own status (a burst of them in one statement); and the
inline one a test uses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from queues.outcomes import FinishStatus, succeeded
from tests import attempts
from tests.workers import eventually, fetch, running_worker, submit
from worker.completer import BatchCompleter, InlineCompleter
from worker.context import RunContext
from worker.outage import Downtime
from worker.plays import Registry

registry = Registry()
GATES: dict[str, asyncio.Event] = {}  # the test's gate, made in its own event loop


@registry.play("gated")
async def gated(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await GATES["open"].wait()
    return {"i": params["i"]}


async def setup(db_url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(db_url, autocommit=True)


async def succeeded_in_time(db_url: str, run_id: Any, within_s: float = 10.0) -> None:
    """Wait (bounded) for the run's final write to have committed."""
    deadline = time.monotonic() + within_s
    async with await setup(db_url) as conn:
        while True:
            cur = await conn.execute("SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
            if await cur.fetchone() == ("succeeded",):
                return
            assert time.monotonic() < deadline, "the cancelled caller's write was never made"
            await asyncio.sleep(0.02)


async def test_a_batch_answers_each_write_with_its_own_status(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        stale = await attempts.start(conn)
        await attempts.supersede(conn, stale)  # its lease rescued, the run claimed again
        live = await attempts.start(conn, now=attempts.T0 + timedelta(hours=1))
    async with AsyncConnectionPool(db_url, min_size=1, max_size=1, open=False) as pool:

        @contextlib.asynccontextmanager
        async def connection() -> AsyncIterator[Any]:
            async with pool.connection() as conn:
                yield conn

        completer = BatchCompleter(connection, "w1", Downtime(5.0))
        writes = [
            completer.queue(succeeded(a.run_id, a.fence.attempt, {"n": 1})) for a in (live, stale)
        ]
        await completer.flush()  # one batch, both writes
        assert [w.result() for w in writes] == [FinishStatus.APPLIED, FinishStatus.REFUSED]
        # A write whose caller is cancelled is still made (and answered when asked again).
        async with await setup(db_url) as conn:
            later = await attempts.start(conn)
        running = asyncio.ensure_future(completer.run())
        try:
            final = succeeded(later.run_id, later.fence.attempt, {"n": 2})
            caller = asyncio.ensure_future(completer.write(final))
            await asyncio.sleep(0)  # queued
            caller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await caller
            await succeeded_in_time(db_url, later.run_id)
            assert await completer.write(final) is FinishStatus.REPLAYED
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


async def test_inline_writes_each_in_a_statement_of_its_own(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        a = await attempts.start(conn)
        completer = InlineCompleter(conn, "w1")
        final = succeeded(a.run_id, a.fence.attempt, None)
        assert await completer.write(final) is FinishStatus.APPLIED
        assert await completer.queue(final) is FinishStatus.REPLAYED


async def test_a_burst_of_finishes_goes_in_one_statement(db_url: str) -> None:
    """Three plays return together and the three runs claimed ahead start in their slots
    and return at once: the six final writes are one statement (every attempt row a
    statement finishes carries its transaction's time, so one time is one statement)."""
    GATES["open"] = asyncio.Event()
    runs = [await submit(db_url, "gated", {"i": i}) for i in range(6)]
    async with running_worker(db_url, registry, concurrency=3, prefetch=3) as worker:

        async def claimed_ahead() -> bool:
            return len(worker.slots.live) == 3 and len(worker.slots.ahead) == 3

        await eventually(claimed_ahead)
        GATES["open"].set()

        async def finished() -> bool:
            rows = await fetch(
                db_url,
                "SELECT count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'succeeded'",
                (runs,),
            )
            return int(rows[0][0]) == len(runs)

        await eventually(finished)
    rows = await fetch(
        db_url,
        "SELECT count(*), count(DISTINCT finished_at) FROM wq_attempts WHERE run_id = ANY(%s)",
        (runs,),
    )
    assert rows == [(6, 1)]
