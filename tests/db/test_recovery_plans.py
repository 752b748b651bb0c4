"""The recovery pass reads what it needs with stale statistics (migration 0021).

A queue table's statistics are stale by nature. Analyzed while a lane was empty (every job
finished), they say no job is 'todo' or 'doing': every partial index on those statuses
looks empty and free to read in full. The orphan pick then joined each queued run to a full
read of the live jobs (O(runs^2): 10-14 s per pass at 10,000 runs). Each test builds that
state in its rolled-back transaction and counts the rows read, from the transaction's own
table counters (no time is measured)."""

from __future__ import annotations

from typing import Any

import psycopg

from queues import admission, lanes, recovery, transport
from queues.queries import q

Conn = psycopg.AsyncConnection[Any]
RELEASE = "stale"
PLAY = "p"
BACKLOG = 3000


async def rows_read(conn: Conn) -> dict[str, int]:
    """Rows this transaction has read so far, per table: by sequential scans, and by index
    scans (heap rows fetched)."""
    cur = await conn.execute(
        "SELECT relname::text, seq_tup_read + coalesce(idx_tup_fetch, 0)"
        " FROM pg_stat_xact_user_tables"
        " WHERE relname IN ('procrastinate_jobs', 'procrastinate_events', 'wq_runs', 'wq_events')"
    )
    return {name: int(n) for name, n in await cur.fetchall()}


async def read_since(conn: Conn, before: dict[str, int]) -> dict[str, int]:
    after = await rows_read(conn)
    return {name: after[name] - before.get(name, 0) for name in after}


async def drained_and_analyzed(conn: Conn) -> None:
    """A lane whose every job finished, analyzed in that state: the statistics say no job
    waits or runs. The history is written as finished jobs outright: jobs claimed and
    finished in this transaction's savepoints would leave their earlier versions ('todo',
    'doing') visible to its ANALYZE."""
    await lanes.prepare(conn, RELEASE)
    await conn.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args, status)"
        " SELECT %s, 'wq.run', '{}', 'succeeded' FROM generate_series(1, 200)",
        (lanes.lane_name(RELEASE),),
    )
    await conn.execute("ANALYZE procrastinate_jobs, wq_runs, wq_events")


async def backlog_behind_stale_statistics(conn: Conn) -> list[admission.Admitted]:
    """BACKLOG runs admitted after the lane was analyzed drained."""
    await drained_and_analyzed(conn)
    backlog = [admission.Submission(play=PLAY, release=RELEASE, org="a") for _ in range(BACKLOG)]
    admitted: list[admission.Admitted] = []
    for start in range(0, BACKLOG, 1000):
        admitted += await admission.submit_many(conn, backlog[start : start + 1000])
    return admitted


async def test_the_orphan_pass_reads_one_job_per_waiting_run_with_stale_statistics(
    conn: Conn,
) -> None:
    admitted = await backlog_behind_stale_statistics(conn)
    # Five of them lost their jobs (cancelled under them): orphans to respawn.
    orphans = admitted[-5:]
    cur = await conn.execute("SELECT wq_transport_stop(%s)", ([a.job_id for a in orphans],))
    assert await cur.fetchone() == (5,)

    before = await rows_read(conn)
    respawned, cancelled, _, seen = await recovery.respawn_orphans(conn, batch=100)
    read = await read_since(conn, before)
    assert sorted(r.run_id for r in respawned) == sorted(a.run_id for a in orphans)
    assert cancelled == [] and seen == 5
    # One probe of a job per waiting run looked at, and the batch's own: about 3,000 rows,
    # not the 4.5M of a read of every live job per queued run.
    assert read["procrastinate_jobs"] <= BACKLOG + 50, read
    # The waiting runs are read at most once by each of the pass's three statements (the
    # pick, the apply and the cancels; which index serves them depends on the statistics):
    # linear in the backlog, never a read per run.
    assert read["wq_runs"] <= 3 * (BACKLOG + 5) + 100, read

    # A second pass finds nothing, at the same cost.
    before = await rows_read(conn)
    assert (await recovery.respawn_orphans(conn, batch=100))[3] == 0
    read = await read_since(conn, before)
    assert read["procrastinate_jobs"] <= BACKLOG + 50, read


async def test_the_batch_statements_probe_their_runs_jobs_with_stale_statistics(
    conn: Conn,
) -> None:
    """The apply statements of a batch read the batch's jobs, not every live job per run."""
    admitted = await backlog_behind_stale_statistics(conn)
    ids = [a.run_id for a in admitted[-100:]]  # all with live jobs: nothing to do

    before = await rows_read(conn)
    cur = await conn.execute(q("recovery_respawn_apply"), {"now": None, "run_ids": ids})
    assert await cur.fetchall() == []
    cur = await conn.execute(q("recovery_cancel_orphans"), {"now": None, "run_ids": ids})
    assert await cur.fetchall() == []
    read = await read_since(conn, before)
    assert read["procrastinate_jobs"] <= 2 * len(ids), read


async def test_retention_reads_only_what_may_have_expired(conn: Conn) -> None:
    """A pass over a history of finished runs, none past its lane's retention, reads none
    of them: the walk of the finished-runs index stops at the latest cutoff of any lane."""
    admitted = await backlog_behind_stale_statistics(conn)
    await conn.execute(
        "UPDATE wq_runs SET state = 'succeeded', finished_at = now(), job_id = NULL"
        " WHERE id = ANY (%s)",
        ([a.run_id for a in admitted],),
    )
    await conn.execute("ANALYZE wq_runs")
    before = await rows_read(conn)
    cur = await conn.execute(q("recovery_retention_runs"), {"now": None, "batch": 100})
    assert await cur.fetchall() == []
    read = await read_since(conn, before)
    assert read["wq_runs"] <= 10, read


async def test_job_retention_reads_only_what_may_have_expired(conn: Conn) -> None:
    """A pass over a history of finished jobs, none past its lane's retention, reads none
    of them (migration 0028): the walk of the terminal events stops at the latest cutoff of
    any lane. Before, it read every finished job and its newest event, once a minute."""
    await lanes.prepare(conn, RELEASE)
    await conn.execute(
        "WITH jobs AS (INSERT INTO procrastinate_jobs (queue_name, task_name, args, status)"
        "              SELECT %s, 'wq.run', '{}', 'succeeded' FROM generate_series(1, %s)"
        "              RETURNING id)"
        " INSERT INTO procrastinate_events (job_id, type) SELECT id, 'succeeded' FROM jobs",
        (lanes.lane_name(RELEASE), BACKLOG),
    )
    await conn.execute("ANALYZE procrastinate_jobs, procrastinate_events")

    async def prune(now: str | None) -> tuple[int, dict[str, int]]:
        before = await rows_read(conn)
        cur = await conn.execute(
            q("recovery_retention_jobs"),
            {"now": now, "batch": 100, "maintenance": transport.MAINTENANCE_QUEUE},
        )
        deleted = len(await cur.fetchall())
        return deleted, await read_since(conn, before)

    deleted, read = await prune(None)
    assert deleted == 0
    assert read["procrastinate_jobs"] <= 10 and read["procrastinate_events"] <= 10, read

    # A pass a year on finds every job due: it deletes one batch and reads about that batch
    # (each job's terminal event by the walk, its newest event, and its events again as
    # they go with it; the job by the walk and by the delete).
    cur = await conn.execute("SELECT (now() + interval '400 days')::text")
    row = await cur.fetchone()
    assert row is not None
    deleted, read = await prune(row[0])
    assert deleted == 100
    assert read["procrastinate_jobs"] <= 2 * 100 + 10, read
    assert read["procrastinate_events"] <= 3 * 100 + 10, read
