"""`worker observe` (``worker.observe.follow``) prints every line of a run that ends while it
reads: the run's state is read before its ledger, so a run read terminal has all its events
in the read that follows."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, runs
from worker import observe

RELEASE = "obsrace"


async def test_a_run_that_ends_between_the_reads_still_prints_its_last_events(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as writer:
        await lanes.prepare(writer, RELEASE)
        admitted = await admission.submit(writer, admission.Submission(play="p", release=RELEASE))
        read_events = runs.events
        ended = False

        async def events_then_the_run_ends(
            conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, **kw: Any
        ) -> Any:
            """The ledger as it is now; then the run ends (its state and its last event in
            one transaction, as every final write does) before the follower reads on."""
            nonlocal ended
            found = await read_events(conn, run_id, **kw)
            if not ended:
                ended = True
                async with writer.transaction():
                    await writer.execute(
                        "UPDATE wq_runs SET state = 'cancelled', finished_at = now(),"
                        " job_id = NULL WHERE id = %s",
                        (run_id,),
                    )
                    await writer.execute(
                        "INSERT INTO wq_events (run_id, kind, data)"
                        " VALUES (%s, 'run_cancelled', '{}')",
                        (run_id,),
                    )
            return found

        monkeypatch.setattr(runs, "events", events_then_the_run_ends)
        lines: list[str] = []
        await asyncio.wait_for(observe.follow(db_url, admitted.run_id, lines.append), 10)
    kinds = [line.split()[1] for line in lines[:-1] if not line.startswith(" ")]
    assert kinds == ["run_created", "run_cancelled"], lines
    assert lines[-1] == f"run {admitted.run_id} cancelled"
