"""Notifications once per statement, procrastinate's job history only where it is read
(migration 0026), a claim's started attempts announced (notified and folded into the
progress sink) by its worker instead of its statement (migrations 0040, 0041), on real
committing connections.

Notifications are counted up to a sentinel NOTIFY sent after the statement under test
committed: Postgres delivers a session's notifications in commit order, so everything the
statement sent has arrived when the sentinel does (no sleep, no guessed quiet period).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from queues import admission, lanes, ledger, outcomes, runs, transport
from queues.outcomes import FinishStatus
from tests.workers import eventually, running_worker
from worker import producer
from worker.context import RunContext
from worker.plays import Registry

Conn = psycopg.AsyncConnection[Any]
RELEASE = "notify-once"
LANE = lanes.lane_name(RELEASE)
ANY_QUEUE = "procrastinate_any_queue_v1"
RUN_EVENTS = "wq_run_events"
SENTINEL = "sentinel"
DEADLINE_S = 10.0


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def until_sentinel(listener: Conn, writer: Conn, channel: str) -> list[psycopg.Notify]:
    """Every notification that arrived before a sentinel sent now on ``channel``."""
    await writer.execute("SELECT pg_notify(%s, %s)", (channel, SENTINEL))
    notes: list[psycopg.Notify] = []
    async for note in listener.notifies(timeout=DEADLINE_S):
        if note.channel == channel and note.payload == SENTINEL:
            return notes
        notes.append(note)
    raise AssertionError(f"the sentinel did not arrive within {DEADLINE_S} s: {notes}")


async def new_job_ids(conn: Conn, n: int) -> list[int]:
    cur = await conn.execute(
        "SELECT array_agg(wq_transport_next_id()) FROM generate_series(1, %s)", (n,)
    )
    row = await cur.fetchone()
    assert row is not None
    return list(row[0])


async def admit(conn: Conn, n: int) -> list[admission.Admitted]:
    """``n`` runs of play ``p`` on the test's lane, admitted in one statement."""
    await lanes.prepare(conn, RELEASE)
    subs = [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(n)]
    return await admission.submit_many(conn, subs)


async def test_a_spawn_and_a_release_wake_each_lane_once(db_url: str) -> None:
    async with connect(db_url) as listener, connect(db_url) as writer:
        await transport.listen(listener, [LANE])
        await listener.execute(f"LISTEN {ANY_QUEUE}")
        ids = await new_job_ids(writer, 5)
        await writer.execute(
            "SELECT wq_transport_spawn(%s, %s, %s)", (ids, [LANE] * 5, [uuid.uuid4()] * 5)
        )
        notes = await until_sentinel(listener, writer, ANY_QUEUE)
        # One wake for the lane, none on the any-queue channel (no procrastinate worker
        # serves a lane), where procrastinate's row trigger sent ten.
        assert [n.channel for n in notes] == [transport.lane_channel(LANE)]

        cur = await writer.execute(
            "SELECT count(*) FROM wq_transport_take(%s, %s, NULL)", ([LANE], 3)
        )
        assert await cur.fetchone() == (3,)
        taken = await (
            await writer.execute(
                "SELECT id FROM wq_transport_jobs() WHERE id = ANY (%s) AND status = 'doing'",
                (ids,),
            )
        ).fetchall()
        cur = await writer.execute(
            "SELECT wq_transport_release(%s)", ([job_id for (job_id,) in taken],)
        )
        assert await cur.fetchone() == (3,)  # still the number handed back
        notes = await until_sentinel(listener, writer, ANY_QUEUE)
        assert [n.channel for n in notes] == [transport.lane_channel(LANE)]


async def test_a_statement_appending_to_many_runs_notifies_once_per_200_runs(
    db_url: str,
) -> None:
    async with connect(db_url) as listener, connect(db_url) as writer:
        await listener.execute(f"LISTEN {RUN_EVENTS}")
        admitted = await admit(writer, 450)  # 450 run_created, one statement
        notes = await until_sentinel(listener, writer, RUN_EVENTS)
        assert len(notes) == 3
        assert all(len(n.payload.encode()) < 8000 for n in notes)
        named = [run_id for n in notes for run_id in n.payload.split(",")]
        assert sorted(named) == sorted(str(a.run_id) for a in admitted)  # each once

        # One event of one run: its id alone.
        await writer.execute(
            "INSERT INTO wq_events (run_id, kind, data) VALUES (%s, 'run_note', '{}')",
            (admitted[7].run_id,),
        )
        notes = await until_sentinel(listener, writer, RUN_EVENTS)
        assert [n.payload for n in notes] == [str(admitted[7].run_id)]

        # A statement that appends nothing (a claim that found no job) sends nothing.
        await writer.execute(
            "INSERT INTO wq_events (run_id, kind, data)"
            " SELECT id, 'run_note', '{}' FROM wq_runs WHERE false"
        )
        assert await until_sentinel(listener, writer, RUN_EVENTS) == []


async def events_of(conn: Conn, job_id: int) -> list[str]:
    cur = await conn.execute(
        "SELECT type::text FROM procrastinate_events WHERE job_id = %s ORDER BY id", (job_id,)
    )
    return [t for (t,) in await cur.fetchall()]


async def test_a_runs_job_keeps_only_its_terminal_event_and_other_tasks_keep_all(
    db_url: str,
) -> None:
    async with connect(db_url) as conn:
        [done, handed, other] = await new_job_ids(conn, 3)
        await conn.execute(
            "SELECT wq_transport_spawn(%s, %s, %s)",
            ([done, handed], [LANE, LANE], [uuid.uuid4(), uuid.uuid4()]),
        )
        await conn.execute(
            "INSERT INTO procrastinate_jobs (id, queue_name, task_name, args)"
            " VALUES (%s, 'wq-maintenance', 'other.task', '{}')",
            (other,),
        )
        await conn.execute("SELECT count(*) FROM wq_transport_take(%s, 2, NULL)", ([LANE],))
        await conn.execute("SELECT wq_transport_release(%s)", ([handed],))
        await conn.execute("SELECT wq_transport_settle(%s, %s)", ([done], [True]))
        await conn.execute("UPDATE procrastinate_jobs SET status = 'doing' WHERE id = %s", (other,))
        await conn.execute(
            "UPDATE procrastinate_jobs SET status = 'succeeded' WHERE id = %s", (other,)
        )
        assert await events_of(conn, done) == ["succeeded"]  # what prune reads
        assert await events_of(conn, handed) == []  # waiting again: no terminal status yet
        assert await events_of(conn, other) == ["deferred", "started", "succeeded"]


async def test_a_follower_wakes_on_its_runs_id_in_a_statements_payload(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``worker events --follow`` and ``observe.notified`` find their run among the run
    ids of one notification. The poll is an hour, so only the notification can wake
    them."""
    from worker import observe
    from worker.cli import ledger as cli_ledger

    monkeypatch.setenv("WORKER_OBSERVE_POLL_S", "3600")
    async with connect(db_url) as writer:
        admitted = await admit(writer, 3)
        mine = admitted[1].run_id
        lines: list[str] = []
        following = asyncio.create_task(
            cli_ledger.print_events(db_url, mine, follow=True, as_json=False, echo=lines.append)
        )
        async with connect(db_url) as listener:
            await listener.execute(f"LISTEN {RUN_EVENTS}")
            waiting = asyncio.create_task(observe.notified(listener, mine, 3600))
            await eventually(lambda: _printed(lines, "run_created"), timeout=DEADLINE_S)
            # One statement cancels all three queued runs: one notification names them.
            cur = await writer.execute(
                "UPDATE wq_runs SET state = 'cancelled', finished_at = now(), job_id = NULL"
                " WHERE id = ANY (%s) RETURNING id",
                ([a.run_id for a in admitted],),
            )
            assert len(await cur.fetchall()) == 3
            await writer.execute(
                "INSERT INTO wq_events (run_id, kind, data)"
                " SELECT unnest(%s::uuid[]), 'run_cancelled', '{}'",
                ([a.run_id for a in admitted],),
            )
            await asyncio.wait_for(waiting, DEADLINE_S)
        assert await asyncio.wait_for(following, DEADLINE_S) == 0
    assert "run_cancelled" in lines[-1]


async def _printed(lines: list[str], kind: str) -> bool:
    return any(kind in line for line in lines)


async def test_a_claim_notifies_nothing_and_its_announcement_names_its_runs(
    db_url: str,
) -> None:
    async with connect(db_url) as listener, connect(db_url) as writer:
        await listener.execute(f"LISTEN {RUN_EVENTS}")
        admitted = await admit(writer, 3)
        assert len(await until_sentinel(listener, writer, RUN_EVENTS)) == 1  # run_created
        claimed = await runs.claim(writer, lanes=[LANE], worker_id="w1", limit=5, plays=["p"])
        assert sorted(c.run_id for c in claimed if c.claimed) == sorted(a.run_id for a in admitted)
        # The attempts started (their ledgers show attempt_started), and nobody was told.
        assert await until_sentinel(listener, writer, RUN_EVENTS) == []
        # Nor folded into the progress sink (admission folds nothing: no row yet).
        assert [await ledger.progress(writer, a.run_id) for a in admitted] == [None] * 3
        await runs.announce(writer, [c.run_id for c in claimed])
        notes = await until_sentinel(listener, writer, RUN_EVENTS)
        assert [sorted(n.payload.split(",")) for n in notes] == [
            sorted(str(a.run_id) for a in admitted)
        ]
        # The announcement folded each start, from the attempt row that stands for it.
        for a in admitted:
            seen = await ledger.progress(writer, a.run_id)
            assert seen is not None
            assert (seen.state, seen.attempt, seen.last_event_seq) == ("running", 1, 2)
            assert not seen.behind

        # A late announcement (the run ended meanwhile) moves nothing back.
        first = next(c for c in claimed if c.claimed)
        await writer.execute(
            "UPDATE wq_runs SET state = 'succeeded', finished_at = now(), lease_owner = NULL,"
            " job_id = NULL WHERE id = %s",
            (first.run_id,),
        )
        await writer.execute(
            "INSERT INTO wq_events (run_id, attempt, kind, data)"
            " VALUES (%s, 1, 'run_succeeded', '{}')",
            (first.run_id,),
        )
        await runs.announce(writer, [first.run_id])
        seen = await ledger.progress(writer, first.run_id)
        assert seen is not None and (seen.state, seen.last_event_seq) == ("succeeded", 3)


async def test_with_an_http_sink_the_claim_delivers_and_folds_its_starts_itself(
    db_url: str,
) -> None:
    """A delivery is never deferred to the announcement (a worker may die first): with an
    HTTP sink that wants the start, the claim's statement writes its delivery and folds
    it; the announcement then writes nothing twice."""
    async with connect(db_url) as writer:
        await lanes.prepare(writer, RELEASE)
        await ledger.add_sink(writer, "crm", "https://crm.example/hook", ["attempt_started"])
        sub = admission.Submission(play="p", params={}, release=RELEASE)
        run_id = (await admission.submit(writer, sub)).run_id
        [claimed] = await runs.claim(writer, lanes=[LANE], worker_id="w1", limit=1, plays=["p"])
        assert claimed.claimed

        async def deliveries() -> list[tuple[int, str]]:
            cur = await writer.execute(
                "SELECT seq, sink FROM wq_outbox WHERE run_id = %s ORDER BY seq", (run_id,)
            )
            return [(seq, sink) for seq, sink in await cur.fetchall()]

        assert await deliveries() == [(2, "crm")]
        seen = await ledger.progress(writer, run_id)
        assert seen is not None and (seen.state, seen.last_event_seq) == ("running", 2)
        await runs.announce(writer, [run_id])
        assert await deliveries() == [(2, "crm")]


async def test_an_announcement_and_a_finish_of_its_runs_do_not_deadlock(db_url: str) -> None:
    """A finish holds a run's row and folds into its progress row; an announcement of that
    run and an earlier one runs meanwhile. The announcement takes the run rows first, so
    it waits for the finish holding nothing the finish needs. (Folding first, it wrote both
    progress rows, then waited for the run's row in its foreign key check while the finish
    waited for the progress row it had written: a deadlock, one of them failed.)"""
    async with (
        connect(db_url) as setup,
        connect(db_url) as announcing,
        await psycopg.AsyncConnection.connect(db_url) as finishing,
    ):
        await admit(setup, 2)
        claimed = await runs.claim(setup, lanes=[LANE], worker_id="w1", limit=2, plays=["p"])
        first, last = sorted(c.run_id for c in claimed if c.claimed)

        # The finish's transaction holds the later run's row.
        await finishing.execute("SELECT 1 FROM wq_runs WHERE id = %s FOR UPDATE", (last,))
        announcement = asyncio.create_task(runs.announce(announcing, [first, last]))
        pid = announcing.pgconn.backend_pid

        async def blocked() -> bool:
            cur = await setup.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            row = await cur.fetchone()
            return bool(row and row[0])

        await eventually(blocked, timeout=DEADLINE_S)
        statuses = await runs.finish(
            finishing, worker_id="w1", finishes=[outcomes.succeeded(last, 1, {})]
        )
        assert list(statuses.values()) == [FinishStatus.APPLIED]
        await finishing.commit()
        await asyncio.wait_for(announcement, DEADLINE_S)

        states = [await ledger.progress(setup, run_id) for run_id in (first, last)]
        assert [(p.state, p.attempt) for p in states if p is not None] == [
            ("running", 1),
            ("succeeded", 1),
        ]


registry = Registry()
held: dict[str, asyncio.Event] = {}  # the `held` play waits on it (made in the test's loop)
started: dict[str, asyncio.Event] = {}


@registry.play("quick")
async def quick(ctx: RunContext, params: dict[str, Any]) -> None:
    return None


@registry.play("held")
async def held_play(ctx: RunContext, params: dict[str, Any]) -> None:
    started["held"].set()
    await held["held"].wait()


@registry.play("gated")
async def gated(ctx: RunContext, params: dict[str, Any]) -> None:
    started[params["gate"]].set()
    await held[params["gate"]].wait()


def naming(notes: list[psycopg.Notify], run_id: uuid.UUID) -> int:
    return sum(str(run_id) in n.payload.split(",") for n in notes)


async def test_a_worker_announces_a_run_still_playing_and_not_one_that_ended(
    db_url: str,
) -> None:
    """A run whose play returned before the announcement is due is named by its final
    write's notification alone; one still playing is announced once, while it plays."""
    held["held"], started["held"] = asyncio.Event(), asyncio.Event()
    release = "announce"
    async with (
        connect(db_url) as listener,
        connect(db_url) as writer,
        running_worker(db_url, registry, release=release) as w,
    ):
        await listener.execute(f"LISTEN {RUN_EVENTS}")

        async def quiet() -> bool:  # the announcement came due and, if any, was sent
            return w.producer.unannounced == {} and not w.producer.background

        try:
            sub = admission.Submission(play="quick", params={}, release=release)
            done = (await admission.submit(writer, sub)).run_id

            async def succeeded() -> bool:
                return (await runs.get(writer, done)).state == "succeeded"

            await eventually(succeeded)
            await eventually(quiet)  # claimed, so the announcement was planned and came due
            assert w.stats["announced"] == 0
            # run_created, then the final write: the claim's own statement said nothing.
            assert naming(await until_sentinel(listener, writer, RUN_EVENTS), done) == 2

            sub = admission.Submission(play="held", params={}, release=release)
            playing = (await admission.submit(writer, sub)).run_id
            await asyncio.wait_for(started["held"].wait(), DEADLINE_S)

            async def announced() -> bool:
                return w.stats["announced"] == 1

            await eventually(announced)
            await eventually(quiet)
            # run_created and the announcement, while the play still waits.
            assert naming(await until_sentinel(listener, writer, RUN_EVENTS), playing) == 2
            # The progress sink: the quick run's final write folded it, the announcement
            # the playing one's start.
            ended = await ledger.progress(writer, done)
            assert ended is not None and ended.state == "succeeded"
            seen = await ledger.progress(writer, playing)
            assert seen is not None and (seen.state, seen.attempt) == ("running", 1)
            assert not held["held"].is_set()
        finally:
            held["held"].set()


async def test_a_refused_announcement_is_dropped_and_the_run_goes_on(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An announcement is a hint: one the database refuses is logged and dropped (the
    listeners' poll covers it); the claimed run plays and ends as ever."""
    refused: list[list[uuid.UUID]] = []

    async def refuse(conn: Conn, run_ids: list[uuid.UUID]) -> None:
        refused.append(list(run_ids))
        raise psycopg.errors.InsufficientPrivilege("permission denied for function")

    monkeypatch.setattr(producer.runs, "announce", refuse)
    held["held"], started["held"] = asyncio.Event(), asyncio.Event()
    release = "announce-refused"
    async with connect(db_url) as writer, running_worker(db_url, registry, release=release) as w:
        try:
            with capture_logs() as logs:
                sub = admission.Submission(play="held", params={}, release=release)
                run_id = (await admission.submit(writer, sub)).run_id
                await asyncio.wait_for(started["held"].wait(), DEADLINE_S)

                async def tried() -> bool:
                    return bool(refused) and not w.producer.background

                await eventually(tried)
            assert refused == [[run_id]] and w.stats["announced"] == 0
            # Handled in the announcing task (not left to the loop as never retrieved).
            failed = [line for line in logs if line["event"] == "announce_failed"]
            assert [line["runs"] for line in failed] == [1], logs
        finally:
            held["held"].set()

        async def succeeded() -> bool:
            return (await runs.get(writer, run_id)).state == "succeeded"

        await eventually(succeeded)


async def test_a_run_claimed_ahead_is_announced_once_it_plays(db_url: str) -> None:
    """A run waiting in the local queue has not started playing: it is looked at again at
    each announcement and announced (named, its start folded) once it plays."""
    for gate in ("first", "second"):
        held[gate], started[gate] = asyncio.Event(), asyncio.Event()
    release = "announce-ahead"
    async with (
        connect(db_url) as writer,
        running_worker(db_url, registry, release=release, concurrency=1, prefetch=2) as w,
    ):
        try:
            first = await admission.submit(
                writer,
                admission.Submission(play="gated", params={"gate": "first"}, release=release),
            )
            await asyncio.wait_for(started["first"].wait(), DEADLINE_S)
            second = await admission.submit(
                writer,
                admission.Submission(play="gated", params={"gate": "second"}, release=release),
            )

            async def claimed_ahead() -> bool:
                return any(c.run_id == second.run_id for c in w.producer.slots.ahead)

            await eventually(claimed_ahead)

            def announced(n: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return w.stats["announced"] == n and not w.producer.background

                return check

            await eventually(announced(1))
            # Past two more announcements' times, the run still waits ahead, unannounced.
            await asyncio.sleep(3 * producer.ANNOUNCE_AFTER_S)
            assert w.stats["announced"] == 1
            assert second.run_id in w.producer.unannounced
            assert (await runs.get(writer, second.run_id)).state == "running"  # leased
            assert await ledger.progress(writer, second.run_id) is None
            seen = await ledger.progress(writer, first.run_id)
            assert seen is not None and seen.state == "running"

            held["first"].set()
            await asyncio.wait_for(started["second"].wait(), DEADLINE_S)
            await eventually(announced(2))
            seen = await ledger.progress(writer, second.run_id)
            assert seen is not None and (seen.state, seen.attempt) == ("running", 1)
        finally:
            held["first"].set()
            held["second"].set()
