"""Sheet races with real connections: every path that loses a race loses it safely.

Each test uses a fresh database (``db_url``) and commits. Every run is a real one
(admitted and claimed, ``tests/attempts.py``); a stale attempt is made by the real
recovery pass. Races are either raced for real (``asyncio.gather`` over separate
connections) or staged: one transaction holds its locks on purpose, the other is
observed waiting in ``pg_stat_activity``, then the first commits.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from queues import recovery, sheets
from queues.errors import SheetSuperseded, StaleAttempt
from queues.fence import Fence
from queues.sheets import Disposition, RowCompletion, StaleReason
from tests import attempts
from tests.attempts import Attempt
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
ORG = "acme"
PLAY = "enrich"
SHEET = "companies"
DEADLINE_S = 10.0


async def start(conn: Conn, **kw: Any) -> Attempt:
    """A real run of the org's play, admitted and claimed (attempt 1, worker w1)."""
    return await attempts.start(conn, org=ORG, play=PLAY, **kw)


def page(*keys: str) -> list[tuple[str, sheets.JSON]]:
    return [(key, {"n": key}) for key in keys]


async def scalar(conn: Conn, sql: Any, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def sheet_rows(conn: Conn) -> list[tuple[Any, ...]]:
    """Every row of the sheet: key, owning run, version, status, output, writing attempt."""
    cur = await conn.execute(
        "SELECT row_key, run_id, write_version, status::text, output, attempt"
        " FROM wq_sheet_rows WHERE org = %(org)s AND sheet = %(sheet)s ORDER BY row_key",
        {"org": ORG, "sheet": SHEET},
    )
    return list(await cur.fetchall())


async def blocked_on_a_lock(observer: Conn, waiter: Conn, task: asyncio.Task[Any]) -> None:
    """Poll until ``waiter``'s backend waits on a lock (or fail if its task ended first)."""
    pid = waiter.info.backend_pid
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert not task.done(), "the waiter did not block"
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


async def reclaim(conn: Conn, rescued: Attempt) -> Attempt:
    """A real second claim of a rescued run, by worker w2 (its attempt + 1)."""
    return await attempts.claim(
        conn,
        worker="w2",
        plays=(PLAY,),
        now=rescued.lapses_at + timedelta(minutes=10),  # past any retry backoff
        run_id=rescued.run_id,
    )


def past_lease(a: Attempt) -> datetime:
    """A recovery pass's clock, just after the attempt's lease lapsed."""
    return a.lapses_at + timedelta(seconds=1)


async def test_32_concurrent_first_admissions_agree_on_one_version(db_url: str) -> None:
    async with connect(db_url) as setup:
        a = await start(setup)
        run_id = a.run_id
        conns = [await psycopg.AsyncConnection.connect(db_url, autocommit=True) for _ in range(32)]
        try:
            results = await asyncio.gather(
                *(
                    sheets.admit_page(
                        c,
                        org=ORG,
                        sheet=SHEET,
                        fence=a.fence,
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
        assert all(r.stable_intent for r in results)
        assert await scalar(setup, "SELECT count(*) FROM wq_write_intents") == 1
        assert await scalar(setup, "SELECT write_version FROM wq_write_intents") == version
        # Exactly one admitter inserted each row; everyone else saw it current.
        dispositions = Counter(row.disposition for r in results for row in r.rows)
        assert dispositions == {Disposition.ADMITTED: 3, Disposition.ALREADY_CURRENT: 93}
        assert await sheet_rows(setup) == [
            (key, run_id, version, "pending", None, 1) for key in ("a", "b", "c")
        ]
        assert await sheets.progress(setup, run_id) == (3, 0)
        assert await attempts.refusals(setup, run_id) == []


async def test_a_lost_intent_race_rereads_the_winner(db_url: str) -> None:
    async with connect(db_url) as winner, connect(db_url) as loser, connect(db_url) as observer:
        a = await start(observer)
        async with winner.transaction():
            won = await sheets.admit_page(
                winner, org=ORG, sheet=SHEET, fence=a.fence, rows=page("a"), stable_intent=True
            )
            # The loser's intent statement waits on the run row the winner holds (the fence,
            # FOR NO KEY UPDATE); its snapshot predates the winner's uncommitted intent, so
            # its insert-if-absent loses once the winner commits and it must re-read.
            task = asyncio.create_task(
                sheets.admit_page(
                    loser, org=ORG, sheet=SHEET, fence=a.fence, rows=page("a"), stable_intent=True
                )
            )
            await blocked_on_a_lock(observer, loser, task)
        lost = await asyncio.wait_for(task, DEADLINE_S)

        assert lost.write_version == won.write_version
        assert won.keys(Disposition.ADMITTED) == ("a",)
        assert lost.keys(Disposition.ALREADY_CURRENT) == ("a",)
        assert await scalar(observer, "SELECT count(*) FROM wq_write_intents") == 1
        assert await sheets.progress(observer, a.run_id) == (1, 0)


async def test_a_completion_racing_a_readmission_reports_the_newer_version(db_url: str) -> None:
    async with connect(db_url) as newer, connect(db_url) as writer, connect(db_url) as observer:
        old = await start(observer)
        v1 = await sheets.admit_page(
            observer, org=ORG, sheet=SHEET, fence=old.fence, rows=page("a", "b"), stable_intent=True
        )
        new = await start(observer)
        async with newer.transaction():
            v2 = await sheets.admit_page(
                newer,
                org=ORG,
                sheet=SHEET,
                fence=new.fence,
                rows=page("a", "b"),
                stable_intent=True,
            )
            assert v2.write_version > v1.write_version
            assert v2.keys(Disposition.READMITTED) == ("a", "b")
            # The old run's writer read v1 in its snapshot, then waits on the row locks.
            task = asyncio.create_task(
                sheets.complete_rows(
                    writer,
                    org=ORG,
                    sheet=SHEET,
                    fence=old.fence,
                    write_version=v1.write_version,
                    completions=[RowCompletion("a", {"late": True}), RowCompletion("b", 1)],
                )
            )
            await blocked_on_a_lock(observer, writer, task)
        result = await asyncio.wait_for(task, DEADLINE_S)

        assert result.committed == ()
        assert not result.attempt_stale  # the old attempt still owns its run: rows moved on
        assert [(s.key, s.reason, s.current_version) for s in result.stale] == [
            ("a", StaleReason.NEWER_WRITE_VERSION, v2.write_version),
            ("b", StaleReason.NEWER_WRITE_VERSION, v2.write_version),
        ]
        assert await sheet_rows(observer) == [
            (key, new.run_id, v2.write_version, "pending", None, 1) for key in ("a", "b")
        ]
        assert await sheets.progress(observer, old.run_id) == (2, 0)
        assert await sheets.progress(observer, new.run_id) == (2, 0)


async def test_an_admission_racing_a_completion_sees_the_row_terminal(db_url: str) -> None:
    async with connect(db_url) as writer, connect(db_url) as admitter, connect(db_url) as observer:
        old = await start(observer)
        v1 = await sheets.admit_page(
            observer, org=ORG, sheet=SHEET, fence=old.fence, rows=page("a", "b"), stable_intent=True
        )
        new = await start(observer)
        async with writer.transaction():
            done = await sheets.complete_rows(
                writer,
                org=ORG,
                sheet=SHEET,
                fence=old.fence,
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
                    fence=new.fence,
                    rows=page("a", "b"),
                    stable_intent=True,
                )
            )
            await blocked_on_a_lock(observer, admitter, task)
        admitted = await asyncio.wait_for(task, DEADLINE_S)

        assert admitted.keys(Disposition.ALREADY_TERMINAL) == ("a",)
        assert admitted.keys(Disposition.READMITTED) == ("b",)
        row = await (
            await observer.execute(
                "SELECT run_id, status::text, output FROM wq_sheet_rows WHERE row_key = 'a'"
            )
        ).fetchone()
        assert row == (old.run_id, "done", {"score": 1})
        assert await sheets.progress(observer, old.run_id) == (2, 1)
        assert await sheets.progress(observer, new.run_id) == (1, 0)


# ---- the attempt fence against a real rescue --------------------------------------------


async def test_a_completion_queued_behind_a_rescue_in_flight_is_refused(db_url: str) -> None:
    """The rescue holds the run row; attempt 1's completion (the same write version as
    attempt 2 will have: a stable intent) waits for it, re-reads the run row once the
    rescue committed, and is refused by the attempt fence (``stale_attempt``): nothing is
    written."""
    async with connect(db_url) as writer, connect(db_url) as rescuer, connect(db_url) as observer:
        old = await start(writer)
        v1 = await sheets.admit_page(
            writer, org=ORG, sheet=SHEET, fence=old.fence, rows=page("a", "b"), stable_intent=True
        )
        # The pass runs inside a transaction we hold open: its rescue is in flight.
        async with rescuer.transaction():
            report = await recovery.run_once(rescuer, now=past_lease(old))
            assert [(r.run_id, r.attempt, r.state) for r in report.expired] == [
                (old.run_id, 1, "queued")
            ]
            task = asyncio.create_task(
                sheets.complete_rows(
                    writer,
                    org=ORG,
                    sheet=SHEET,
                    fence=old.fence,
                    write_version=v1.write_version,
                    completions=[RowCompletion("a", {"by": 1}), RowCompletion("b", {"by": 1})],
                )
            )
            await blocked_on_a_lock(observer, writer, task)
        with pytest.raises(SheetSuperseded, match="must stop") as raised:
            await asyncio.wait_for(task, DEADLINE_S)
        assert raised.value.counts == {"newer_write_version": 2}
        assert raised.value.fence_reason == "stale_attempt"
        assert await sheet_rows(observer) == [
            (key, old.run_id, v1.write_version, "pending", None, 1) for key in ("a", "b")
        ]
        assert await sheets.progress(observer, old.run_id) == (2, 0)
        assert await attempts.refusals(observer, old.run_id) == [(1, "rows", 2)]

        # Attempt 2 reuses the intent and is the only writer of the rows.
        new = await reclaim(rescuer, old)
        assert new.fence == Fence(old.run_id, 2, "w2")
        again = await sheets.admit_page(
            writer, org=ORG, sheet=SHEET, fence=new.fence, rows=page("a", "b"), stable_intent=True
        )
        assert again.write_version == v1.write_version
        done = await sheets.complete_rows(
            writer,
            org=ORG,
            sheet=SHEET,
            fence=new.fence,
            write_version=again.write_version,
            completions=[RowCompletion("a", {"by": 2}), RowCompletion("b", {"by": 2})],
        )
        assert done.committed == ("a", "b") and not done.stale
        assert await sheet_rows(observer) == [
            (key, old.run_id, v1.write_version, "done", {"by": 2}, 2) for key in ("a", "b")
        ]


async def test_a_rescue_pass_skips_a_run_whose_sheet_write_is_in_flight(db_url: str) -> None:
    """The completion holds the run row (FOR NO KEY UPDATE) until it commits; the recovery
    pass picks lapsed runs FOR UPDATE SKIP LOCKED, so it leaves the run alone instead of
    rescuing it under the write. The next pass rescues it, and the rows the write finished
    stay finished for attempt 2."""
    async with connect(db_url) as writer, connect(db_url) as rescuer, connect(db_url) as observer:
        old = await start(writer)
        v1 = await sheets.admit_page(
            writer, org=ORG, sheet=SHEET, fence=old.fence, rows=page("a", "b"), stable_intent=True
        )
        async with writer.transaction():
            done = await sheets.complete_rows(
                writer,
                org=ORG,
                sheet=SHEET,
                fence=old.fence,
                write_version=v1.write_version,
                completions=[RowCompletion("a", {"by": 1})],
            )
            assert done.committed == ("a",)
            # A pass that waited for the write would hang here: it commits only after.
            report = await asyncio.wait_for(
                recovery.run_once(rescuer, now=past_lease(old)), DEADLINE_S
            )
            assert report.expired == ()
            assert (await attempts.run_row(observer, old.run_id))["state"] == "running"
        rescued = await attempts.rescue(rescuer, old)
        assert [(r.run_id, r.state) for r in rescued.expired] == [(old.run_id, "queued")]
        new = await reclaim(rescuer, old)
        again = await sheets.admit_page(
            writer, org=ORG, sheet=SHEET, fence=new.fence, rows=page("a", "b"), stable_intent=True
        )
        assert again.write_version == v1.write_version
        assert again.keys(Disposition.ALREADY_TERMINAL) == ("a",)
        assert again.keys(Disposition.ALREADY_CURRENT) == ("b",)
        assert await sheet_rows(observer) == [
            ("a", old.run_id, v1.write_version, "done", {"by": 1}, 1),
            ("b", old.run_id, v1.write_version, "pending", None, 1),
        ]
        assert await sheets.progress(observer, old.run_id) == (2, 1)
        assert await attempts.refusals(observer, old.run_id) == []


async def test_a_legacy_page_queued_behind_a_rescue_in_flight_is_refused(db_url: str) -> None:
    """A legacy attempt passes the version it minted on its first page back for its later
    pages; only the row statement checks the fence then. Queued behind a rescue in flight,
    such a page is refused once the rescue commits, and admits nothing."""
    async with connect(db_url) as writer, connect(db_url) as rescuer, connect(db_url) as observer:
        old = await start(writer)
        first = await sheets.admit_page(
            writer, org=ORG, sheet=SHEET, fence=old.fence, rows=page("a")
        )
        assert not first.stable_intent and first.keys(Disposition.ADMITTED) == ("a",)
        async with rescuer.transaction():
            report = await recovery.run_once(rescuer, now=past_lease(old))
            assert [r.run_id for r in report.expired] == [old.run_id]
            task = asyncio.create_task(
                sheets.admit_page(
                    writer,
                    org=ORG,
                    sheet=SHEET,
                    fence=old.fence,
                    rows=page("b"),
                    write_version=first.write_version,
                )
            )
            await blocked_on_a_lock(observer, writer, task)
        with pytest.raises(StaleAttempt, match=f"run {old.run_id} attempt 1 cannot admit"):
            await asyncio.wait_for(task, DEADLINE_S)
        assert await sheet_rows(observer) == [
            ("a", old.run_id, first.write_version, "pending", None, 1)
        ]
        assert await sheets.progress(observer, old.run_id) == (1, 0)
        assert await attempts.refusals(observer, old.run_id) == [(1, "admission", 1)]
