"""The completer: where an attempt's final write is made, fenced (``runs.finish``).

:class:`BatchCompleter` is a worker's: the final writes of its attempts wait for the next
batch, written in one statement (a play whose write is queued has freed its slot already;
the writes of a burst, queued in one turn of the event loop and the next, share a batch),
and a batch that meets a database outage is sent again until the outage passes the
worker's limit (:mod:`worker.outage`); a retried write that had been applied comes back
``replayed``. :class:`InlineCompleter` makes each write in a statement of its own on one
connection (a test's transaction, :mod:`worker.testing`). Both answer each write with its
status.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import psycopg

from queues import runs
from queues.errors import DatabaseLost
from queues.outcomes import Finish, FinishStatus
from worker.attempt import Connection
from worker.outage import TRANSIENT, Downtime, Outage


class Completer(Protocol):
    def queue(self, final: Finish) -> asyncio.Future[FinishStatus]:
        """Put ``final`` in the next write; its status once written."""
        ...

    async def write(self, final: Finish) -> FinishStatus:
        """Write ``final``; its status. A cancel of the caller does not cancel the write."""
        ...


class BatchCompleter:
    """A worker's final writes, batched: :meth:`run` writes whatever is queued, one batch
    at a time, until cancelled; :meth:`flush` writes what is queued now (a stop's drain)."""

    def __init__(self, connection: Connection, worker_id: str, downtime: Downtime) -> None:
        self._connection = connection
        self._worker_id = worker_id
        self._downtime = downtime
        self._queued: list[tuple[Finish, asyncio.Future[FinishStatus]]] = []
        self._ready = asyncio.Event()

    def queue(self, final: Finish) -> asyncio.Future[FinishStatus]:
        future: asyncio.Future[FinishStatus] = asyncio.get_running_loop().create_future()
        self._queued.append((final, future))
        self._ready.set()
        return future

    async def write(self, final: Finish) -> FinishStatus:
        # No shield needed: a cancel of the caller cancels this future, never the write,
        # which stays in the batch and is made all the same (flush answers only the
        # futures still waiting).
        return await self.queue(final)

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            # A burst's writes come from attempts the loop has ready now: plays that
            # returned together, and the runs claimed ahead that started in their slots
            # and returned at once. One turn of the loop lets them queue, so the burst goes
            # in one statement, not in the first write's and one after it.
            await asyncio.sleep(0)
            await self.flush()

    async def flush(self) -> None:
        """Write every queued final write in one fenced statement; send it again while the
        database is away. Past the outage limit each write's future gets
        :class:`DatabaseLost`, and so does the caller."""
        self._ready.clear()
        batch, self._queued = self._queued, []
        if not batch:
            return
        outage = Outage("finish", self._downtime)
        while True:
            try:
                async with self._connection() as conn:
                    statuses = await runs.finish(
                        conn, worker_id=self._worker_id, finishes=[f for f, _ in batch]
                    )
                break
            except TRANSIENT as exc:
                try:
                    await outage.failed(exc)
                except DatabaseLost as lost:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(lost)
                    raise
        outage.ok()
        for final, future in batch:
            if not future.done():
                future.set_result(statuses[(final.run_id, final.attempt)])


class InlineCompleter:
    """Each final write in a statement of its own on ``conn``, at once."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], worker_id: str) -> None:
        self._conn = conn
        self._worker_id = worker_id

    def queue(self, final: Finish) -> asyncio.Future[FinishStatus]:
        return asyncio.ensure_future(self.write(final))

    async def write(self, final: Finish) -> FinishStatus:
        statuses = await runs.finish(self._conn, worker_id=self._worker_id, finishes=[final])
        return statuses[(final.run_id, final.attempt)]
