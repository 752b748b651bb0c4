"""Per-org fairness on a lane (sql/migrations/0016): the claim interleaves orgs, the org
with the fewest runs in flight first, priority still first of all; a lane's per-org cap is
never exceeded by a claim; one org alone is taken as before, oldest first."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg

from queues import admission, lanes, outcomes, runs
from tests.attempts import PLAY, T0

Conn = psycopg.AsyncConnection[Any]
RELEASE = "fair"


async def admit(conn: Conn, org: str, n: int, *, priority: int = 0) -> list[Any]:
    await lanes.prepare(conn, RELEASE)
    return [
        (
            await admission.submit(
                conn,
                admission.Submission(play=PLAY, release=RELEASE, org=org, priority=priority),
            )
        ).run_id
        for _ in range(n)
    ]


async def claim(conn: Conn, limit: int, *, worker: str = "w1") -> list[str]:
    """Claim up to ``limit`` runs; the orgs of those claimed, in claim order (the order of
    their attempts' ledger events is the order they were taken, not needed: counts)."""
    got = await runs.claim(
        conn,
        lanes=[lanes.lane_name(RELEASE)],
        worker_id=worker,
        limit=limit,
        plays=[PLAY],
        now=T0,
    )
    return [str(c.org) for c in got if c.claimed]


async def finish(conn: Conn, org: str, n: int) -> None:
    """``n`` running runs of ``org`` succeed (a slot frees)."""
    cur = await conn.execute(
        "SELECT id, attempt, lease_owner FROM wq_runs WHERE lane = %s AND org = %s"
        " AND state = 'running' ORDER BY id LIMIT %s",
        (lanes.lane_name(RELEASE), org, n),
    )
    for run_id, attempt, owner in await cur.fetchall():
        await runs.finish(
            conn, worker_id=owner, finishes=[outcomes.succeeded(run_id, attempt, None)]
        )


async def test_a_small_org_is_not_stuck_behind_a_large_backlog(conn: Conn) -> None:
    await admit(conn, "a-large", 200)
    assert Counter(await claim(conn, 8)) == {"a-large": 8}  # one org: oldest first
    await admit(conn, "b-small", 10)
    # B has nothing in flight, A has 8: B's runs go first until they are even.
    assert Counter(await claim(conn, 4)) == {"b-small": 4}
    await finish(conn, "a-large", 6)
    # A 2 in flight, B 4: A's turns come first until they are even, then they alternate.
    assert Counter(await claim(conn, 6)) == {"a-large": 4, "b-small": 2}
    await finish(conn, "b-small", 6)
    # B's last four go first (B has none in flight, A six): not behind A's 186 left.
    assert Counter(await claim(conn, 4)) == {"b-small": 4}


async def test_priority_comes_before_the_interleaving(conn: Conn) -> None:
    await admit(conn, "a", 5)
    await admit(conn, "b", 1, priority=5)
    await admit(conn, "c", 5)
    first = await claim(conn, 1)
    assert first == ["b"]
    assert Counter(await claim(conn, 4)) == {"a": 2, "c": 2}


async def test_a_per_org_cap_is_never_exceeded_by_a_claim(conn: Conn) -> None:
    await admit(conn, "a", 20)
    await admit(conn, "b", 20)
    await lanes.set_policy(conn, RELEASE, org_concurrency=3)
    assert Counter(await claim(conn, 10)) == {"a": 3, "b": 3}
    assert await claim(conn, 10, worker="w2") == []  # both at their cap
    await finish(conn, "a", 2)
    assert Counter(await claim(conn, 10, worker="w2")) == {"a": 2}
    cur = await conn.execute(
        "SELECT org, count(*) FROM wq_runs WHERE state = 'running' GROUP BY org ORDER BY org"
    )
    assert await cur.fetchall() == [("a", 3), ("b", 3)]


async def test_one_org_is_taken_oldest_first_as_before(conn: Conn) -> None:
    ids = await admit(conn, "solo", 6)
    got = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=3, plays=[PLAY], now=T0
    )
    assert sorted(c.run_id for c in got) == sorted(ids[:3])
    later = T0 + timedelta(seconds=1)
    got = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=10, plays=[PLAY], now=later
    )
    assert sorted(c.run_id for c in got) == sorted(ids[3:])


async def jobs_read(conn: Conn) -> int:
    """Rows of procrastinate_jobs this transaction has read so far: by sequential scans,
    and by index scans (heap rows fetched), from the transaction's own table counters."""
    cur = await conn.execute(
        "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
        " WHERE relid = 'procrastinate_jobs'::regclass"
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def test_the_fair_take_reads_a_bounded_part_of_the_backlog_with_stale_statistics(
    conn: Conn,
) -> None:
    """A queue table's statistics are stale by nature. Analyzed while the lane was drained
    (every job 'succeeded'), they say no job is waiting, so every index on waiting jobs
    looks empty: the fair take's first version then joined its ranked candidates back to
    the jobs as a nested loop over every waiting job, re-ranking (and re-walking each org)
    for each, O(backlog^2): 20 to 30 s per claim behind 10,000 jobs in
    tests/integration/test_fairness_runtime.py, until autovacuum analyzed again. The take
    must read about the orgs times the limit, whatever the statistics (no time measured:
    the rows read, from the transaction's own counters)."""
    lane = lanes.lane_name(RELEASE)
    await lanes.prepare(conn, RELEASE)
    await admission.submit_many(
        conn, [admission.Submission(play=PLAY, release=RELEASE, org="drained") for _ in range(60)]
    )
    while await claim(conn, 8):  # one org: the lane drains, every job settles
        await finish(conn, "drained", 8)
    await conn.execute("ANALYZE procrastinate_jobs, wq_runs")  # nothing waits
    backlog = [admission.Submission(play=PLAY, release=RELEASE, org="a") for _ in range(3000)]
    for start in range(0, len(backlog), 1000):
        await admission.submit_many(conn, backlog[start : start + 1000])
    await admission.submit_many(
        conn, [admission.Submission(play=PLAY, release=RELEASE, org="b") for _ in range(20)]
    )

    before = await jobs_read(conn)
    cur = await conn.execute(
        "SELECT count(*) FROM wq_transport_take(%s, 8, NULL, %s)", ([lane], T0)
    )
    row = await cur.fetchone()
    read = await jobs_read(conn) - before
    assert row is not None and row[0] == 8
    # The 8 taken, the heads of 2 orgs' walks (8 each) and their probes: tens of rows, not
    # the 3,020 waiting (the first version read millions here).
    assert read <= 100, f"the fair take read {read} rows of procrastinate_jobs"

    # And it still takes the right jobs: B's share next to A's backlog.
    assert Counter(await claim(conn, 8)) == {"a": 4, "b": 4}
