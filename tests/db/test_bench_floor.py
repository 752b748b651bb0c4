"""The design's floor (bench/floor.py) does the writes it claims to: a baseline that did less
would make a target look out of reach when it is not, and one without the fence would
flatter the floor. Real committing connections on a migrated database."""

from __future__ import annotations

import argparse
from typing import Any

import psycopg
import pytest

from bench.common import BenchError, scalar
from bench.floor import FINISH, Floor

Conn = psycopg.AsyncConnection[Any]


async def floor_on(url: str) -> Floor:
    floor = Floor(url, argparse.Namespace(tuned_prefetch=16))
    await floor.setup()
    return floor


# The lifecycle events the floor's state rows stand for (docs/design.md, 11b), in order.
LEDGER = """
SELECT run, seq, kind FROM (
    SELECT id AS run, 1::bigint AS seq, 'run_created' AS kind FROM f_runs
    UNION ALL
    SELECT run_id, start_seq, 'attempt_started' FROM f_attempts
    UNION ALL
    SELECT run_id, end_seq, end_kind FROM f_attempts WHERE end_seq IS NOT NULL) e
"""


async def counts(conn: Conn) -> dict[str, Any]:
    cur = await conn.execute(
        "SELECT (SELECT count(*) FROM f_runs),"
        " (SELECT count(*) FROM procrastinate_jobs WHERE queue_name = 'floor'),"
        f" (SELECT array_agg(kind ORDER BY run, seq) FROM ({LEDGER}) l),"
        " (SELECT count(*) FROM f_attempts)"
    )
    runs, jobs, kinds, attempts = await cur.fetchone() or ()
    return {"runs": runs, "jobs": jobs, "events": kinds or [], "attempts": attempts}


async def test_admission_writes_run_and_job_only_on_a_prepared_lane(db_url: str) -> None:
    floor = await floor_on(db_url)
    try:
        await floor.submit_batch(3, 2)
        assert await counts(floor.conn) == {
            "runs": 3,
            "jobs": 3,
            "events": ["run_created"] * 3,
            "attempts": 0,
        }
        # Every run points at its own job, which names the run.
        assert (
            await scalar(
                floor.conn,
                "SELECT count(*) FROM f_runs r JOIN procrastinate_jobs j ON j.id = r.job_id"
                " WHERE (j.args ->> 'run_id')::uuid = r.id AND j.status = 'todo'",
            )
            == 3
        )
        await floor.conn.execute("UPDATE f_lanes SET state = 'draining'")
        await floor.submit_one(2)
        assert (await counts(floor.conn))["runs"] == 3  # nothing written
    finally:
        await floor.close()


async def test_the_final_write_is_fenced_by_attempt_and_owner(db_url: str) -> None:
    floor = await floor_on(db_url)
    try:
        await floor.submit_one(1)
        (run_id, attempt, params), *rest = await floor._claim(floor.conn, 5, "w1")
        assert rest == [] and attempt == 1 and params == {"i": 0}
        assert (await counts(floor.conn))["events"] == ["run_created", "attempt_started"]
        for ids, attempts, worker in (([run_id], [2], "w1"), ([run_id], [1], "w2")):
            params_ = {"ids": ids, "attempts": attempts, "worker": worker}
            assert await scalar(floor.conn, FINISH, params_) == 0  # a stale or foreign write
        with pytest.raises(BenchError, match="wrote 0 of 1 runs"):
            await floor._finish(floor.conn, [(run_id, 2, params)], "w1")
        assert await floor._finish(floor.conn, [(run_id, 1, params)], "w1") == 1
        cur = await floor.conn.execute(
            "SELECT r.state, a.outcome, j.status FROM f_runs r"
            " JOIN f_attempts a ON a.run_id = r.id JOIN procrastinate_jobs j ON j.id = r.job_id"
        )
        assert await cur.fetchall() == [("succeeded", "succeeded", "succeeded")]
        assert (await counts(floor.conn))["events"][-1] == "run_succeeded"
        cur = await floor.conn.execute(f"SELECT seq, kind FROM ({LEDGER}) l ORDER BY seq")
        assert await cur.fetchall() == [
            (1, "run_created"),
            (2, "attempt_started"),
            (3, "run_succeeded"),
        ]
        assert await scalar(floor.conn, "SELECT ledger_seq FROM f_runs") == 3
        assert await scalar(floor.conn, FINISH, params_ | {"worker": "w1"}) == 0  # once only
    finally:
        await floor.close()


async def test_a_drain_runs_every_run_once(db_url: str) -> None:
    floor = await floor_on(db_url)
    try:
        seconds = await floor.drain(200, 4, analyze=True, tuned=False)
        assert seconds > 0
        cur = await floor.conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'succeeded' AND attempt = 1), count(*)"
            " FROM f_runs"
        )
        assert await cur.fetchone() == (200, 200)
        got = await counts(floor.conn)
        assert (got["runs"], got["jobs"], got["attempts"]) == (200, 200, 200)
        kinds = await floor.conn.execute(f"SELECT kind, count(*) FROM ({LEDGER}) l GROUP BY 1")
        assert dict(await kinds.fetchall()) == {
            "run_created": 200,
            "attempt_started": 200,
            "run_succeeded": 200,
        }
    finally:
        await floor.close()


async def test_a_pickup_starts_every_run_it_hears_of(db_url: str) -> None:
    floor = await floor_on(db_url)
    try:
        latencies = await floor.pickup(5, 0.01, 10)
        # From the submit call's return: the claim's answer may be handled first (the
        # submitter and the listener share this process's loop), so a latency may be < 0.
        assert len(latencies) == 5 and all(-1 < s < 5 for s in latencies)
        cur = await floor.conn.execute("SELECT state, count(*) FROM f_runs GROUP BY 1")
        assert await cur.fetchall() == [("succeeded", 5)]
    finally:
        await floor.close()
