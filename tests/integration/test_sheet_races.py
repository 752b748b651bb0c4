"""Sheet races with real connections: every path that loses a race loses it safely.

Each test uses a fresh database (``db_url``) and commits. Races are either raced for real
(``asyncio.gather`` over separate connections) or staged: one transaction holds its locks
on purpose, the other is observed waiting in ``pg_stat_activity``, then the first commits.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from uuid import UUID, uuid4

import psycopg

from queues import sheets
from queues.sheets import Disposition, RowCompletion, StaleReason

Conn = psycopg.AsyncConnection[Any]
T = TypeVar("T")
ORG = "acme"
SHEET = "companies"


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def make_run(conn: Conn) -> UUID:
    run_id = uuid4()
    await conn.execute(
        "INSERT INTO wq_lanes (name, release) VALUES ('r-test', 'test') ON CONFLICT DO NOTHING"
    )
    await conn.execute(
        "INSERT INTO wq_runs (id, org, play, release, lane, state, attempt, lease_owner,"
        " lease_expires_at) VALUES (%(id)s, %(org)s, 'enrich', 'test', 'r-test', 'running', 1,"
        " 'w1', now() + interval '30 seconds')",
        {"id": run_id, "org": ORG},
    )
    return run_id


def page(*keys: str) -> list[tuple[str, sheets.JSON]]:
    return [(key, {"n": key}) for key in keys]


async def scalar(conn: Conn, sql: Any, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def blocked_on_a_lock(observer: Conn, waiter: Conn, task: Awaitable[T]) -> None:
    """Poll until ``waiter``'s backend waits on a lock (or fail if its task ended first)."""
    pid = waiter.info.backend_pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert not (isinstance(task, asyncio.Task) and task.done()), "the waiter did not block"
        waiting = await scalar(
            observer,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE pid = %(pid)s AND wait_event_type = 'Lock'",
            {"pid": pid},
        )
        if waiting:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited on a lock")


async def test_32_concurrent_first_admissions_agree_on_one_version(db_url: str) -> None:
    async with connect(db_url) as setup:
        run_id = await make_run(setup)
        conns = [await psycopg.AsyncConnection.connect(db_url, autocommit=True) for _ in range(32)]
        try:
            results = await asyncio.gather(
                *(
                    sheets.admit_page(
                        c,
                        org=ORG,
                        sheet=SHEET,
                        run_id=run_id,
                        rows=page("a", "b", "c"),
                        stable_intent=True,
                    )
                    for c in conns
                )
            )
        finally:
            for c in conns:
                await c.close()

        versions = {r.write_version for r in results}
        assert len(versions) == 1
        (version,) = versions
        assert await scalar(setup, "SELECT count(*) FROM wq_write_intents") == 1
        assert await scalar(setup, "SELECT write_version FROM wq_write_intents") == version
        # Exactly one admitter inserted each row; everyone else saw it current.
        dispositions = Counter(row.disposition for r in results for row in r.rows)
        assert dispositions == {Disposition.ADMITTED: 3, Disposition.ALREADY_CURRENT: 93}
        assert (
            await scalar(
                setup,
                "SELECT count(*) FROM wq_sheet_rows WHERE write_version = %(v)s AND run_id = %(r)s",
                {"v": version, "r": run_id},
            )
            == 3
        )
        assert await sheets.progress(setup, run_id) == (3, 0)


async def test_a_lost_intent_race_rereads_the_winner(db_url: str) -> None:
    async with connect(db_url) as winner, connect(db_url) as loser, connect(db_url) as observer:
        run_id = await make_run(observer)
        async with winner.transaction():
            won = await sheets.admit_page(
                winner, org=ORG, sheet=SHEET, run_id=run_id, rows=page("a"), stable_intent=True
            )
            # The loser's insert-if-absent now waits for the winner's uncommitted intent.
            task = asyncio.create_task(
                sheets.admit_page(
                    loser, org=ORG, sheet=SHEET, run_id=run_id, rows=page("a"), stable_intent=True
                )
            )
            await blocked_on_a_lock(observer, loser, task)
        lost = await task

        assert lost.write_version == won.write_version
        assert lost.keys(Disposition.ALREADY_CURRENT) == ("a",)
        assert await scalar(observer, "SELECT count(*) FROM wq_write_intents") == 1


async def test_a_completion_racing_a_readmission_reports_the_newer_version(db_url: str) -> None:
    async with connect(db_url) as newer, connect(db_url) as writer, connect(db_url) as observer:
        old = await make_run(observer)
        v1 = await sheets.admit_page(
            observer, org=ORG, sheet=SHEET, run_id=old, rows=page("a", "b"), stable_intent=True
        )
        new = await make_run(observer)
        async with newer.transaction():
            v2 = await sheets.admit_page(
                newer, org=ORG, sheet=SHEET, run_id=new, rows=page("a", "b"), stable_intent=True
            )
            # The old run's writer read v1 in its snapshot, then waits on the row locks.
            task = asyncio.create_task(
                sheets.complete_rows(
                    writer,
                    org=ORG,
                    sheet=SHEET,
                    run_id=old,
                    write_version=v1.write_version,
                    completions=[RowCompletion("a", {"late": True}), RowCompletion("b", 1)],
                )
            )
            await blocked_on_a_lock(observer, writer, task)
        result = await task

        assert result.committed == ()
        assert [(s.key, s.reason, s.current_version) for s in result.stale] == [
            ("a", StaleReason.NEWER_WRITE_VERSION, v2.write_version),
            ("b", StaleReason.NEWER_WRITE_VERSION, v2.write_version),
        ]
        assert (
            await scalar(observer, "SELECT count(*) FROM wq_sheet_rows WHERE output IS NOT NULL")
            == 0
        )
        assert await sheets.progress(observer, old) == (2, 0)


async def test_an_admission_racing_a_completion_sees_the_row_terminal(db_url: str) -> None:
    async with connect(db_url) as writer, connect(db_url) as admitter, connect(db_url) as observer:
        old = await make_run(observer)
        v1 = await sheets.admit_page(
            observer, org=ORG, sheet=SHEET, run_id=old, rows=page("a", "b"), stable_intent=True
        )
        new = await make_run(observer)
        async with writer.transaction():
            done = await sheets.complete_rows(
                writer,
                org=ORG,
                sheet=SHEET,
                run_id=old,
                write_version=v1.write_version,
                completions=[RowCompletion("a", {"score": 1})],
            )
            assert done.committed == ("a",)
            # The new run's admission saw "a" pending in its snapshot; it waits on the lock.
            task = asyncio.create_task(
                sheets.admit_page(
                    admitter,
                    org=ORG,
                    sheet=SHEET,
                    run_id=new,
                    rows=page("a", "b"),
                    stable_intent=True,
                )
            )
            await blocked_on_a_lock(observer, admitter, task)
        admitted = await task

        assert admitted.keys(Disposition.ALREADY_TERMINAL) == ("a",)
        assert admitted.keys(Disposition.READMITTED) == ("b",)
        row = await (
            await observer.execute(
                "SELECT run_id, status::text, output FROM wq_sheet_rows WHERE row_key = 'a'"
            )
        ).fetchone()
        assert row == (old, "done", {"score": 1})
        assert await sheets.progress(observer, new) == (1, 0)
