"""The projectors' channel (migration 0033): a statement NOTIFYs ``wq_outbox`` only when it
wrote outbox rows, on real committing connections.

Notifications are counted up to a sentinel NOTIFY sent after the statement under test
committed: a session receives notifications in commit order, so everything the statement
sent has arrived when the sentinel does.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from queues import admission, lanes, ledger
from tests.workers import connect
from worker import projector

Conn = psycopg.AsyncConnection[Any]
RELEASE = "outbox-channel"
SENTINEL = "sentinel"
DEADLINE_S = 10.0


async def heard(listener: Conn, writer: Conn) -> list[str]:
    """The channels ``listener`` heard before a sentinel sent now on the projectors' one."""
    await writer.execute("SELECT pg_notify(%s, %s)", (projector.CHANNEL, SENTINEL))
    channels: list[str] = []
    async for note in listener.notifies(timeout=DEADLINE_S):
        if note.channel == projector.CHANNEL and note.payload == SENTINEL:
            return channels
        channels.append(note.channel)
    raise AssertionError(f"no sentinel within {DEADLINE_S} s: {channels}")


async def note(writer: Conn, run_ids: list[uuid.UUID]) -> None:
    await writer.execute(
        "INSERT INTO wq_events (run_id, kind, data) SELECT unnest(%s::uuid[]), 'run_note', '{}'",
        (run_ids,),
    )


async def test_only_a_statement_that_wrote_outbox_rows_notifies_the_projectors(
    db_url: str,
) -> None:
    async with connect(db_url) as listener, connect(db_url) as writer:
        await lanes.prepare(writer, RELEASE)
        subs = [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(3)]
        run_ids = [a.run_id for a in await admission.submit_many(writer, subs)]
        await listener.execute(f"LISTEN {projector.CHANNEL}")
        await listener.execute("LISTEN wq_run_events")
        # No HTTP sink (the built-in progress sink writes no outbox rows): the ledger's
        # listeners hear the append, the projectors do not.
        await note(writer, run_ids)
        assert await heard(listener, writer) == ["wq_run_events"]

        await ledger.add_sink(writer, "hook", "https://hooks.example/events")
        await note(writer, run_ids)  # three events, three outbox rows: one notification
        assert sorted(await heard(listener, writer)) == ["wq_outbox", "wq_run_events"]
        cur = await writer.execute("SELECT count(*) FROM wq_outbox WHERE sink = 'hook'")
        assert await cur.fetchone() == (3,)

        await ledger.disable_sink(writer, "hook")
        await note(writer, run_ids)
        assert await heard(listener, writer) == ["wq_run_events"]
