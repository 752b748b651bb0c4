"""Batch admission (``submit_many``, one ``wq_submit_many`` statement), in one rolled-back
transaction per test: N runs, each idempotent, in the batch's order; atomic refusals."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queues import admission, lanes
from queues.admission import Submission
from queues.errors import IdempotencyConflict, InvalidField, LaneDraining, LaneNotPrepared

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
async def tx(conn: Conn) -> AsyncIterator[Conn]:
    await conn.execute("SELECT 1")  # open the outer (rolled-back) transaction
    yield conn


def release() -> str:
    return "m" + uuid.uuid4().hex[:10]


async def counts(conn: Conn, lane: str) -> tuple[int, int, int]:
    """Runs, waiting jobs and run_created events of a lane."""
    cur = await conn.execute(
        "SELECT (SELECT count(*) FROM wq_runs WHERE lane = %(l)s),"
        " (SELECT count(*) FROM wq_transport_jobs() WHERE lane = %(l)s AND waiting),"
        " (SELECT count(*) FROM wq_ledger e JOIN wq_runs r ON r.id = e.run_id"
        "   WHERE r.lane = %(l)s AND e.kind = 'run_created')",
        {"l": lane},
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def test_a_batch_admits_every_run_with_its_job_and_event_in_order(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    subs = [Submission(play="noop", params={"i": i}, release=rel, priority=i % 2) for i in range(5)]
    admitted = await admission.submit_many(tx, subs)
    assert [a.created for a in admitted] == [True] * 5
    assert all(a.job_id is not None and a.lane == lanes.lane_name(rel) for a in admitted)
    assert await counts(tx, lanes.lane_name(rel)) == (5, 5, 5)
    cur = await tx.execute(
        "SELECT params FROM wq_runs WHERE id = ANY(%(ids)s) ORDER BY array_position(%(ids)s, id)",
        {"ids": [a.run_id for a in admitted]},
    )
    assert [row[0] for row in await cur.fetchall()] == [{"i": i} for i in range(5)]
    cur = await tx.execute(
        "SELECT authority ->> 'run' FROM wq_runs WHERE id = %(id)s",
        {"id": admitted[0].run_id},
    )
    row = await cur.fetchone()
    assert row is not None and row[0] == str(admitted[0].run_id)


async def test_values_that_text_arrays_would_escape_arrive_intact(tx: Conn) -> None:
    """The batch's arrays go in binary: quotes, backslashes, braces, commas, NULL-looking
    text, non-ASCII and empty strings arrive as sent, in every column."""
    rel = release()
    await lanes.prepare(tx, rel)
    awkward = ['"quoted"', "back\\slash", "{braces}", "a,b", "NULL", "caf\u00e9 \u2603", ""]
    subs = [
        Submission(
            play="noop",
            params={"v": v, "nested": {"list": [v, None, 1.5]}},
            release=rel,
            org=f"org{i}",
            idempotency_key=f'k"{i},{{}}\\',
        )
        for i, v in enumerate(awkward)
    ]
    admitted = await admission.submit_many(tx, subs, authority={"note": 'a "b" \\ c'})
    cur = await tx.execute(
        "SELECT params, org, idempotency_key, authority ->> 'note' FROM wq_runs"
        " WHERE id = ANY(%(ids)s) ORDER BY array_position(%(ids)s, id)",
        {"ids": [a.run_id for a in admitted]},
    )
    rows = await cur.fetchall()
    assert [r[0] for r in rows] == [dict(s.params) for s in subs]
    assert [(r[1], r[2]) for r in rows] == [(s.org, s.idempotency_key) for s in subs]
    assert {r[3] for r in rows} == {'a "b" \\ c'}
    again = await admission.submit_many(tx, subs)  # the keys match exactly
    assert [a.run_id for a in again] == [a.run_id for a in admitted]
    assert not any(a.created for a in again)


async def test_a_runs_first_event_is_seq_1_and_cannot_be_written_twice(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    admitted = await admission.submit_many(tx, [Submission(play="noop", release=rel)] * 3)
    cur = await tx.execute(
        "SELECT kind, seq FROM wq_ledger WHERE run_id = ANY(%s)", ([a.run_id for a in admitted],)
    )
    assert sorted(await cur.fetchall()) == [("run_created", 1)] * 3
    # A second run_created is seq 1 again, which the run row stands for: it is not stored
    # (migration 0041), and the ledger still shows one.
    await tx.execute(
        "INSERT INTO wq_events (run_id, kind, data) VALUES (%s, 'run_created', '{}')",
        (admitted[0].run_id,),
    )
    cur = await tx.execute(
        "SELECT kind, seq FROM wq_ledger WHERE run_id = %s", (admitted[0].run_id,)
    )
    assert await cur.fetchall() == [("run_created", 1)]


async def test_a_retried_batch_answers_with_the_same_runs(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    subs = [Submission(play="noop", release=rel, idempotency_key=f"k{i}") for i in range(3)]
    first = await admission.submit_many(tx, subs)
    # One new key among the retried ones: only that one is created.
    again = await admission.submit_many(
        tx, [*subs, Submission(play="noop", release=rel, idempotency_key="k3")]
    )
    assert [a.created for a in again] == [False, False, False, True]
    assert [a.run_id for a in again[:3]] == [a.run_id for a in first]
    assert all(a.job_id is None for a in again[:3])
    assert await counts(tx, lanes.lane_name(rel)) == (4, 4, 4)


async def test_one_key_twice_in_a_batch_admits_one_run(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    sub = Submission(play="noop", release=rel, idempotency_key="same")
    a, b = await admission.submit_many(tx, [sub, sub])
    assert (a.created, b.created) == (True, False)
    assert a.run_id == b.run_id
    assert await counts(tx, lanes.lane_name(rel)) == (1, 1, 1)


async def test_a_key_reused_for_another_request_refuses_the_whole_batch(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    await admission.submit_many(tx, [Submission(play="noop", release=rel, idempotency_key="k")])
    with pytest.raises(IdempotencyConflict):
        await admission.submit_many(
            tx,
            [
                Submission(play="noop", release=rel, params={"new": 1}),
                Submission(play="noop", release=rel, params={"other": 1}, idempotency_key="k"),
            ],
        )
    assert await counts(tx, lanes.lane_name(rel)) == (1, 1, 1)


async def test_a_lane_that_does_not_admit_refuses_the_batch_and_writes_nothing(
    tx: Conn,
) -> None:
    open_, missing = release(), release()
    await lanes.prepare(tx, open_)
    with pytest.raises(LaneNotPrepared) as refused:
        await admission.submit_many(
            tx, [Submission(play="noop", release=open_), Submission(play="noop", release=missing)]
        )
    assert missing in str(refused.value)
    assert await counts(tx, lanes.lane_name(open_)) == (0, 0, 0)


async def test_a_retry_on_a_draining_lane_answers_and_a_new_run_is_refused(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    sub = Submission(play="noop", release=rel, idempotency_key="before-drain")
    (first,) = await admission.submit_many(tx, [sub])
    await tx.execute(
        "UPDATE wq_lanes SET state = 'draining' WHERE name = %(l)s", {"l": lanes.lane_name(rel)}
    )
    (again,) = await admission.submit_many(tx, [sub])
    assert (again.run_id, again.created) == (first.run_id, False)
    with pytest.raises(LaneDraining):
        await admission.submit_many(tx, [sub, Submission(play="noop", release=rel)])
    assert await counts(tx, lanes.lane_name(rel)) == (1, 1, 1)


async def test_every_submission_is_checked_before_anything_is_sent(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    with pytest.raises(InvalidField):
        await admission.submit_many(
            tx, [Submission(play="noop", release=rel), Submission(play="no such", release=rel)]
        )
    assert await admission.submit_many(tx, []) == []
    assert await counts(tx, lanes.lane_name(rel)) == (0, 0, 0)
