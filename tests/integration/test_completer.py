"""The completer (``worker.completer``): a worker's final writes batched into one fenced
statement, each answered with its own status; and the inline one a test uses."""

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
from worker.completer import BatchCompleter, InlineCompleter
from worker.outage import Downtime


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
