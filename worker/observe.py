"""Watching runs: live follow with a progress bar, and waiting for a terminal state.

Both LISTEN on ``wq_run_events`` (every ledger append NOTIFYs it; a claim's through its
worker's announcement, :mod:`worker.producer`), so a terminal write reaches a waiter at
once; a slow poll covers a dropped connection's lost notifications.
Both ride out a lost database (a restart, a failover) for up to ``max_outage_s``: they
reconnect, LISTEN again and read the run again, and go on where they were
(:func:`worker.outage.riding`); past it they raise ``DATABASE_LOST`` (exit 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import psycopg

from queues import ledger, runs
from queues.errors import ExitCode
from worker import db
from worker.outage import MAX_OUTAGE_S, Outage, riding
from worker.output import EXIT_BY_STATE, printable, to_json
from worker.progress import RowProgress

POLL_S = 2.0  # the fallback poll; WORKER_OBSERVE_POLL_S overrides it


def poll_s() -> float:
    """How often a waiter re-reads the run when no notification came (a dropped LISTEN
    connection loses notifications; the poll covers that)."""
    try:
        value = float(os.environ.get("WORKER_OBSERVE_POLL_S", POLL_S))
    except ValueError:
        return POLL_S
    return value if 0 < value < 86400 else POLL_S


def run_dict(run: runs.Run) -> dict[str, Any]:
    data = asdict(run)
    data["id"] = str(run.id)
    return data


async def notified(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, timeout: float) -> None:
    """Return at the next ledger notification for ``run_id`` (its id among the payload's
    run ids, migration 0026), or after ``timeout``."""
    key = str(run_id)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async for note in conn.notifies():
                if key in note.payload:
                    return


async def wait_terminal(
    url: str,
    run_id: uuid.UUID,
    *,
    timeout: float | None = None,
    max_outage_s: float = MAX_OUTAGE_S,
) -> runs.Run | None:
    """The run once terminal, or None when ``timeout`` seconds pass first (also while the
    database is away)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outage = Outage("result", limit_s=max_outage_s)

    async def wait(listener: psycopg.AsyncConnection[Any]) -> runs.Run | None:
        if db.listens():  # not through a transaction pooler: there, the poll alone
            await listener.execute("LISTEN wq_run_events")
        while True:
            run = await runs.get(listener, run_id)
            outage.ok()
            if run.terminal:
                return run
            every = poll_s()
            left = every if deadline is None else min(every, deadline - time.monotonic())
            if left <= 0:
                return None
            await notified(listener, run_id, left)

    return await riding(url, wait, outage, until=deadline, application="wq-result")


async def follow(
    url: str,
    run_id: uuid.UUID,
    echo: Callable[[str], None] | None = None,
    *,
    as_json: bool = False,
    max_outage_s: float = MAX_OUTAGE_S,
) -> int:
    """Print a run's ledger and its row progress live until it is terminal; returns the exit
    code of its final state. ``as_json``: one JSON object per line (events, progress, end).
    After a lost connection it goes on from the last event it printed."""
    last_event = 0
    last_counts = (-1, -1)
    progress = RowProgress(echo=echo)
    say = progress.echo
    outage = Outage("observe", limit_s=max_outage_s)

    async def watch(listener: psycopg.AsyncConnection[Any]) -> int:
        nonlocal last_event, last_counts
        if db.listens():  # not through a transaction pooler: there, the poll alone
            await listener.execute("LISTEN wq_run_events")
        while True:
            # The run before its events: a run read terminal committed its last events
            # with that state, so the read after it has them all (read the other way
            # round, a run that ended between the two reads lost its last lines).
            run = await runs.get(listener, run_id)
            outage.ok()
            for event in await runs.events(listener, run_id, after=last_event):
                last_event = event.seq
                if as_json:
                    say(to_json({"event": ledger.event_json(event)}))
                    continue
                detail = json.dumps(event.data, sort_keys=True, default=str) if event.data else ""
                attempt = event.attempt or "-"
                kind = printable(event.kind)
                say(f"{event.at.isoformat()} {kind:<18} attempt={attempt} {detail}")
            counts = await ledger.progress_counts(listener, run)
            if counts != last_counts and counts[1] > 0:
                last_counts = counts
                if as_json:
                    say(to_json({"progress": {"done": counts[0], "total": counts[1]}}))
                else:
                    progress.update(*counts)
            if run.terminal:
                progress.close()
                if as_json:
                    say(to_json({"run": run_dict(run)}))
                else:
                    say(f"run {run.id} {run.state}")
                return int(EXIT_BY_STATE.get(run.state, ExitCode.FAILED))
            await notified(listener, run_id, 0.5)

    try:
        code = await riding(url, watch, outage, application="wq-observe")
        assert code is not None  # riding gives None only at an `until`
        return code
    finally:
        progress.close()
