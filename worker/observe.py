"""Watching runs: live follow with a progress bar, and waiting for a terminal state.

Both LISTEN on ``wq_run_events`` (every ledger append NOTIFYs it), so a terminal write
reaches a waiter at once; a slow poll covers a dropped connection's lost notifications.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psycopg

from queues import runs
from worker import db

POLL_S = 2.0


def run_dict(run: runs.Run) -> dict[str, Any]:
    data = asdict(run)
    data["id"] = str(run.id)
    return data


def progress_bar(done: int, total: int, width: int = 30) -> str:
    if total <= 0:
        return ""
    filled = int(width * min(done, total) / total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} rows"


async def _notified(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, timeout: float) -> None:
    """Return at the next ledger notification for ``run_id``, or after ``timeout``."""
    key = str(run_id)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async for note in conn.notifies():
                if key in note.payload:
                    return


async def wait_terminal(
    url: str, run_id: uuid.UUID, *, timeout: float | None = None
) -> runs.Run | None:
    """The run once terminal, or None when ``timeout`` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    listener = await db.connect(url, autocommit=True)
    async with listener:
        await listener.execute("LISTEN wq_run_events")
        while True:
            run = await runs.get(listener, run_id)
            if run.terminal:
                return run
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                return None
            await _notified(listener, run_id, left)


async def follow(url: str, run_id: uuid.UUID, echo: Callable[[str], None]) -> int:
    """Print a run's ledger and progress live until it is terminal; exit code by state."""
    listener = await db.connect(url, autocommit=True)
    last_event = 0
    last_bar = ""
    async with listener:
        await listener.execute("LISTEN wq_run_events")
        while True:
            for event in await runs.events(listener, run_id, after=last_event):
                last_event = event.id
                detail = json.dumps(event.data, sort_keys=True, default=str) if event.data else ""
                attempt = event.attempt or "-"
                echo(f"{event.at:%H:%M:%S} {event.kind:<18} attempt={attempt} {detail}")
            run = await runs.get(listener, run_id)
            bar = progress_bar(run.rows_done, run.rows_total)
            if bar and bar != last_bar:
                echo(f"  {bar}")
                last_bar = bar
            if run.terminal:
                echo(f"run {run.id} {run.state}")
                return {"succeeded": 0, "failed": 1, "cancelled": 3}.get(run.state, 1)
            await _notified(listener, run_id, 0.5)
