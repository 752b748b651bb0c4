"""The claim's cost does not grow with the history of runs: with thousands of runs in the
tables (analyzed after them, or before them, as after a burst of admissions), no statement
of a claim, including those inside the transport's take function, reads a whole table of
runs or jobs, or the whole backlog. A claim takes a handful of jobs; a plan that hashes
every run ever admitted made each claim cost O(history) (migration 0020).

The plans are read with auto_explain, sent to this session as messages (nested statements
included), in the test's rolled-back transaction. A step's record (one prepared statement per
step) keeps to its keys under the generic plan too. Nothing here measures time."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, receipts, runs
from tests import attempts

Conn = psycopg.AsyncConnection[Any]
RELEASE = "plans"
HISTORY = 3000
GROWING = ("wq_runs", "procrastinate_jobs", "wq_events")


async def explained(conn: Conn, *settings: str) -> list[str]:
    """From now on in the test's transaction, every plan (auto_explain, as notices) goes to
    the list returned; ``settings`` are set for the transaction too."""
    plans: list[str] = []
    conn.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    await conn.execute("LOAD 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_level = notice",
        "client_min_messages = notice",
        *settings,
    ):
        await conn.execute(f"SET LOCAL {setting}")
    return plans


async def plans_of_a_claim(conn: Conn, limit: int, orgs: int, *, stale: bool = False) -> list[str]:
    """The plans of one claim after HISTORY admissions; ``stale``: analyzed before them (the
    statistics say no run is queued, as after a burst of admissions)."""
    await lanes.prepare(conn, RELEASE)
    if stale:
        await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events")
    subs = [
        admission.Submission(play="p", params={"i": i}, release=RELEASE, org=f"o{i % orgs}")
        for i in range(HISTORY)
    ]
    for start in range(0, HISTORY, 1000):
        await admission.submit_many(conn, subs[start : start + 1000])
    if not stale:
        await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events")
    plans = await explained(conn, "auto_explain.log_nested_statements = on")
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=limit, plays=["p"]
    )
    await conn.execute("RESET client_min_messages")
    assert len([c for c in claimed if c.claimed]) == limit
    return plans


@pytest.mark.parametrize("stale", [False, True], ids=["analyzed", "stale"])
@pytest.mark.parametrize("orgs", [1, 3])  # the take's one-org path, and its fair path
@pytest.mark.parametrize("limit", [1, 8, 64])
async def test_no_statement_of_a_claim_reads_the_whole_history(
    conn: Conn, limit: int, orgs: int, stale: bool
) -> None:
    plans = await plans_of_a_claim(conn, limit, orgs, stale=stale)
    assert any("wq_transport_take" in p for p in plans)  # the outer claim was explained
    scans = sorted(
        {
            m.group(1)
            for p in plans
            for m in re.finditer(r"Seq Scan on (\w+)", p)
            if m.group(1) in GROWING
        }
    )
    assert scans == [], "\n\n".join(p for p in plans if "Seq Scan" in p)
    # procrastinate's (priority, id) index spans every lane: a walk of it reads other
    # lanes' jobs, so the take walks its lane's own part of wq_jobs_lane_*_todo_idx.
    walks = [p for p in plans if "procrastinate_jobs_priority_idx_v1" in p]
    assert walks == [], "\n\n".join(walks)
    # Nor procrastinate's queue_name index: it holds the lane's whole history and backlog,
    # in no useful order, and an incremental sort of it read every waiting job of the lane
    # per claim (the generic plan guessed a lane of a few dozen jobs; migration 0025).
    walks = [p for p in plans if "procrastinate_jobs_queue_name_idx_v1" in p]
    assert walks == [], "\n\n".join(walks)
    # The claimed runs are found by key: through the index of unfinished runs, a claim read
    # the whole backlog when the statistics said it was small. (The fair take reads it for
    # the lane's running runs, which are few.)
    backlog = [
        p
        for p in plans
        if "WITH taken AS" in p and re.search(r"Scan (using|on) wq_runs_lane_unfinished_idx", p)
    ]
    assert backlog == [], "\n\n".join(backlog)


async def test_a_large_analyzed_backlog_is_walked_in_its_lanes_order(conn: Conn) -> None:
    """With 20,000 waiting jobs analyzed, the take's plan (generic: made once for any lane,
    so it guesses a lane of a few dozen jobs) read procrastinate's queue_name index and
    sorted the lane's whole backlog incrementally, on every claim: a drain of 20,000 runs
    at concurrency 10 went at 480 runs/s where 5,000 went at 1,200 (migration 0025)."""
    await lanes.prepare(conn, RELEASE)
    for start in range(0, 20_000, 5_000):
        await admission.submit_many(
            conn,
            [
                admission.Submission(play="p", params={"i": i}, release=RELEASE)
                for i in range(start, start + 5_000)
            ],
        )
    await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events")
    plans = await explained(conn, "auto_explain.log_nested_statements = on")
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=10, plays=["p"]
    )
    await conn.execute("RESET client_min_messages")
    assert len([c for c in claimed if c.claimed]) == 10
    takes = [p for p in plans if "WITH picked AS" in p]
    assert takes, plans
    assert all("wq_jobs_lane_todo_idx" in p for p in takes), "\n\n".join(takes)
    bad = [
        p for p in takes if "procrastinate_jobs_queue_name_idx_v1" in p or "Incremental Sort" in p
    ]
    assert bad == [], "\n\n".join(bad)


async def test_a_steps_record_keeps_to_its_keys_under_a_generic_plan(conn: Conn) -> None:
    """receipts.record runs the page statement prepared (one key): its generic plan, the one
    Postgres settles on after five executions, reads the step's receipt and run by key."""
    a = await attempts.start(conn)
    await lanes.prepare(conn, RELEASE)
    subs = [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(1000)]
    await admission.submit_many(conn, subs)
    await conn.execute(
        "INSERT INTO wq_receipts (org, play, scope, step_key, status, owner_run, owner_attempt,"
        " result, completed_at)"
        " SELECT %s, %s, 'run:' || gen_random_uuid(), 's' || i, 'completed', %s, 1, '1', now()"
        " FROM generate_series(1, %s) AS i",
        (attempts.ORG, attempts.PLAY, a.run_id, HISTORY),
    )
    await conn.execute("ANALYZE wq_receipts, wq_runs")
    plans = await explained(conn, "plan_cache_mode = force_generic_plan")
    scope = receipts.Scope.of_run(a.run_id)
    for i in range(3):
        done = await receipts.record(
            conn,
            org=attempts.ORG,
            play=attempts.PLAY,
            scope=scope,
            step_key=f"step{i}",
            fence=a.fence,
            result=i,
        )
        assert done.outcome is receipts.ClaimOutcome.EXECUTE
    await conn.execute("RESET client_min_messages")
    recorded = [p for p in plans if "wq_receipts" in p and "Insert" in p]
    assert len(recorded) == 3
    scans = [p for p in recorded if re.search(r"Seq Scan on (wq_receipts|wq_runs)", p)]
    assert scans == [], "\n\n".join(scans)


@pytest.mark.parametrize("history", [300, 1000, 3000])
async def test_a_claim_under_its_generic_plan_finds_its_runs_by_key(
    conn: Conn, history: int
) -> None:
    """A worker's claim is one prepared statement, and Postgres settles on its generic plan
    (made once for any batch, so it guesses 16 taken jobs and a default share of runs in
    a claimable state). With a history of a few thousand runs, the cheapest-looking plan
    for that guess read the whole wq_runs table per claim, twice (the claimed runs and the
    ones failed at once): a claim of one run took 2.4 ms at 1,100 runs and 6 ms later, where
    finding them by key took 1.35 ms. The runs of the taken jobs are found through the
    primary key at any size of history."""
    await lanes.prepare(conn, RELEASE)
    subs = [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(history)]
    await admission.submit_many(conn, subs)
    # Most of the history is finished, as in a worker's database.
    await conn.execute(
        "UPDATE wq_runs SET state = 'succeeded', job_id = NULL, finished_at = now()"
        " WHERE id IN (SELECT id FROM wq_runs ORDER BY id LIMIT %s)",
        (history - 10,),
    )
    await conn.execute(
        "UPDATE procrastinate_jobs j SET status = 'succeeded'"
        " WHERE NOT EXISTS (SELECT 1 FROM wq_runs r WHERE r.job_id = j.id)"
    )
    await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events")
    plans = await explained(conn, "plan_cache_mode = force_generic_plan")
    conn.prepare_threshold = 0  # prepared at once: the plan a worker's session settles on
    try:
        claimed = await runs.claim(
            conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=1, plays=["p"]
        )
    finally:
        conn.prepare_threshold = 5
    await conn.execute("RESET client_min_messages")
    assert [c.claimed for c in claimed] == [True]
    claim = [p for p in plans if "WITH taken AS" in p]
    assert claim, plans
    scans = [p for p in claim if re.search(r"Seq Scan on wq_runs", p)]
    assert scans == [], "\n\n".join(scans)
