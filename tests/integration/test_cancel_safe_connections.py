"""A long-lived connection is closed however its task ends, also when a cancel lands while
the task is on its way out.

psycopg's ``async with conn`` commits (or rolls back) before it closes, and that commit
may yield to the event loop even when it has nothing to send: psycopg yields whenever the
loop has been busy for a few milliseconds (``psycopg.waiting.MAX_BUSY_TIME``). A worker's
shutdown sets its stop event and then cancels its loops; a loop that saw the stop and was
committing on its way out took the cancel there and never closed its connection, which
then stayed open until garbage collection (a ResourceWarning under load). The test makes
psycopg yield at every finished wait, as a loaded machine does, and lands the cancel at
each point of the way out in turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import psycopg.waiting
import pytest

from tests.workers import eventually, fetch
from worker import db, projector

Conn = psycopg.AsyncConnection[Any]


async def _open(url: str, application: str) -> int:
    (count,) = (
        await fetch(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (application + "%",),
        )
    )[0]
    return int(count)


async def _cancel_after(task: asyncio.Task[Any], ticks: int) -> None:
    """Cancel ``task`` after ``ticks`` turns of the loop, and wait until it has ended."""
    for _ in range(ticks):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("ticks", range(6))
async def test_a_projector_stopped_and_cancelled_at_once_closes_its_connection(
    db_url: str, monkeypatch: pytest.MonkeyPatch, ticks: int
) -> None:
    monkeypatch.setattr(psycopg.waiting, "MAX_BUSY_TIME", 0.0)
    made: list[Conn] = []
    connect = db.connect

    async def recorded(*args: Any, **kwargs: Any) -> Conn:
        conn = await connect(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(db, "connect", recorded)
    stop = asyncio.Event()
    owner = f"cancel-safe-{ticks}"
    task = projector.start(db_url, stop, owner=owner, listen=False)

    async def connected() -> bool:
        # The connect returned: the server lists a backend (with its application name)
        # before the client's handshake has finished.
        return len(made) == 1 and await _open(db_url, f"wq-projector {owner}") == 1

    await eventually(connected)
    # The worker's shutdown: the stop first, the cancel a few loop turns later.
    stop.set()
    await _cancel_after(task, ticks)
    # Closed at once, not when the garbage collector finds the connections.
    assert len(made) == 1 and all(conn.closed for conn in made)

    async def none_open() -> bool:
        return await _open(db_url, f"wq-projector {owner}") == 0

    await eventually(none_open)


@pytest.mark.parametrize("ticks", range(3))
async def test_a_session_is_closed_when_a_cancel_lands_on_its_way_out(
    db_url: str, monkeypatch: pytest.MonkeyPatch, ticks: int
) -> None:
    monkeypatch.setattr(psycopg.waiting, "MAX_BUSY_TIME", 0.0)
    leaving = asyncio.Event()
    held: list[Conn] = []

    async def body() -> None:
        async with db.session(db_url, application="wq-cancel-safe") as conn:
            held.append(conn)
            await conn.execute("SELECT 1")
            leaving.set()  # the block ends here: this task runs on until it yields

    task = asyncio.create_task(body())
    await leaving.wait()  # the task is on its way out (or out)
    await _cancel_after(task, ticks)
    assert held and held[0].closed
