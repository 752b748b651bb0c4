"""The claim on a worker's own autocommit connection: one statement, committed without
waiting for its WAL flush, and a drop (rare) as a second statement.

Real connections and committed rows: the claim behaves differently on a connection of its
own (its statement is its transaction) than inside a caller's transaction (one transaction
for both statements, and a durable commit, the caller's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, outcomes, runs
from queues.queries import q

Conn = psycopg.AsyncConnection[Any]
RELEASE = "own"
PLAY = "p"


@pytest.fixture
async def own(db_url: str) -> AsyncIterator[Conn]:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        yield conn


async def status(conn: Conn, job_id: int) -> str:
    cur = await conn.execute("SELECT status FROM wq_transport_jobs() WHERE id = %s", (job_id,))
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def test_a_duplicate_delivery_is_dropped_by_a_second_statement(own: Conn) -> None:
    admitted = await admission.submit(own, admission.Submission(play=PLAY, release=RELEASE))
    run = await runs.get(own, admitted.run_id)
    assert run.job_id is not None
    # A second job for the run (as a respawn leaves when the first turns up after all).
    cur = await own.execute(
        "SELECT wq_transport_spawn(ARRAY[id], ARRAY[%s], ARRAY[%s::uuid], ARRAY[NULL::timestamptz])"
        " , id FROM (SELECT wq_transport_next_id() AS id) n",
        (lanes.lane_name(RELEASE), admitted.run_id),
    )
    row = await cur.fetchone()
    assert row is not None
    duplicate = int(row[1])
    got = await runs.claim(
        own, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=5, plays=[PLAY]
    )
    assert sorted((c.claimed, c.job_id) for c in got) == [(False, duplicate), (True, run.job_id)]
    assert own.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # all committed
    assert await status(own, duplicate) == "succeeded"  # acknowledged
    assert await status(own, run.job_id) == "doing"  # the live attempt's delivery
    assert (await runs.get(own, admitted.run_id)).state == "running"


async def setting_after_claim(conn: Conn, *, lazy: bool) -> str:
    """The claim statement inside a rolled-back transaction; the commit setting it leaves."""
    async with conn.transaction(force_rollback=True):
        await conn.execute(
            q("run_claim_batch"),
            {
                "lanes": [lanes.lane_name(RELEASE)],
                "limit": 1,
                "plays": [PLAY],
                "worker": "w1",
                "procrastinate_worker": None,
                "now": None,
                "lazy": lazy,
            },
        )
        cur = await conn.execute("SHOW synchronous_commit")
        row = await cur.fetchone()
        assert row is not None
        return str(row[0])


async def test_only_a_claim_that_is_its_own_transaction_commits_lazily(own: Conn) -> None:
    await admission.submit(own, admission.Submission(play=PLAY, release=RELEASE))
    assert await setting_after_claim(own, lazy=True) == "off"
    cur = await own.execute("SHOW synchronous_commit")
    assert await cur.fetchone() == ("on",)  # for that transaction only
    assert await setting_after_claim(own, lazy=False) == "on"
    # queues.runs.claim asks for it only on an idle autocommit connection.
    async with own.transaction():
        got = await runs.claim(
            own, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=1, plays=[PLAY]
        )
        assert [c.claimed for c in got] == [True]
        cur = await own.execute("SHOW synchronous_commit")
        assert await cur.fetchone() == ("on",)


def traced(conn: Conn, path: Any) -> Any:
    """Trace what this client sends on ``conn`` (libpq's protocol trace) into ``path``."""
    handle = open(path, "w")  # noqa: SIM115 - closed by the caller after untrace
    conn.pgconn.trace(handle.fileno())
    conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
    return handle


async def test_a_claim_and_a_finish_send_no_begin_or_commit(own: Conn, tmp_path: Any) -> None:
    """On its own connection each is one statement the server commits as it answers: no
    transaction stays open between round trips for a paused worker to keep."""
    await admission.submit(own, admission.Submission(play=PLAY, release=RELEASE))
    handle = traced(own, tmp_path / "trace")
    try:
        [c] = await runs.claim(
            own, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=1, plays=[PLAY]
        )
        assert c.claimed and c.attempt is not None
        done = await runs.finish(
            own, worker_id="w1", finishes=[outcomes.succeeded(c.run_id, c.attempt, {"ok": 1})]
        )
    finally:
        own.pgconn.untrace()
        handle.close()
    assert done == {(c.run_id, c.attempt): outcomes.FinishStatus.APPLIED}
    # The messages this client sent: their type is the third field of an "F" line.
    sent = [
        line.split("\t")[2]
        for line in (tmp_path / "trace").read_text().splitlines()
        if line.startswith("F\t")
    ]
    assert "Query" not in sent, sent  # BEGIN and COMMIT go as simple queries
    assert sent.count("Execute") == 2, sent
