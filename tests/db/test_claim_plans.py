"""The claim's cost does not grow with the history of runs: with thousands of runs in the
tables (analyzed after them, or before them, as after a burst of admissions), no statement
of a claim, including those inside the transport's take function, reads a whole table of
runs or jobs, or the whole backlog. A claim takes a handful of jobs; a plan that hashes
every run ever admitted made each claim cost O(history) (migration 0020).

The plans are read with auto_explain, sent to this session as messages (nested statements
included), in the test's rolled-back transaction. A step's record (one prepared statement per
step) keeps to its keys under the generic plan too. Nothing here measures time."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, outcomes, receipts, runs
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
    # Their stored events (wq_events holds what no state row does: steps, play events).
    await conn.execute(
        "INSERT INTO wq_events (run_id, kind, data) SELECT id, 'app.note', '{}' FROM wq_runs"
    )
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
    takes = [p for p in plans if "v_ids := ARRAY(" in p]
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
            receipts.StepRef(
                org=attempts.ORG,
                play=attempts.PLAY,
                scope=scope,
                step_key=f"step{i}",
                fence=a.fence,
            ),
            result=i,
        )
        assert done.outcome is receipts.ClaimOutcome.EXECUTE
    await conn.execute("RESET client_min_messages")
    recorded = [p for p in plans if "wq_receipts" in p and "Insert" in p]
    assert len(recorded) == 3
    scans = [p for p in recorded if re.search(r"Seq Scan on (wq_receipts|wq_runs)", p)]
    assert scans == [], "\n\n".join(scans)


async def finished_history(conn: Conn, history: int) -> None:
    """``history`` admissions on the lane, all but ten finished (with their jobs, attempts
    and events), analyzed: a worker's database a while after its first runs."""
    await lanes.prepare(conn, RELEASE)
    await admission.submit_many(
        conn,
        [admission.Submission(play="p", params={"i": i}, release=RELEASE) for i in range(history)],
    )
    await conn.execute(
        "UPDATE wq_runs SET state = 'succeeded', attempt = 1, job_id = NULL, finished_at = now()"
        " WHERE id IN (SELECT id FROM wq_runs ORDER BY id LIMIT %s)",
        (history - 10,),
    )
    await conn.execute(
        "UPDATE procrastinate_jobs j SET status = 'succeeded'"
        " WHERE NOT EXISTS (SELECT 1 FROM wq_runs r WHERE r.job_id = j.id)"
    )
    await conn.execute(
        "INSERT INTO wq_attempts (run_id, attempt, worker_id, outcome, finished_at)"
        " SELECT id, 1, 'w0', 'succeeded', now() FROM wq_runs WHERE state = 'succeeded'"
    )
    await conn.execute(
        "INSERT INTO wq_events (run_id, attempt, kind, data)"
        " SELECT id, 1, k, '{}' FROM wq_runs, unnest(ARRAY['attempt_started', 'run_succeeded'])"
        " AS k WHERE state = 'succeeded' ORDER BY id"
    )
    await conn.execute("ANALYZE wq_runs, procrastinate_jobs, wq_events, wq_attempts")


@contextlib.contextmanager
def prepared_at_once(conn: Conn) -> Iterator[None]:
    """Statements prepared on their first execution: under ``force_generic_plan``, the plan
    a worker's session settles on."""
    conn.prepare_threshold = 0
    try:
        yield
    finally:
        conn.prepare_threshold = 5


@pytest.mark.parametrize("history", [300, 1000, 3000])
async def test_a_claim_under_its_generic_plan_finds_its_runs_by_key(
    conn: Conn, history: int
) -> None:
    """A worker's claim is one prepared statement, and Postgres settles on its generic plan
    (made once for any batch: it guesses 16 taken jobs and a default share of runs in a
    claimable state). Joined to the taken jobs only, the runs were read by a whole scan of
    wq_runs, twice per claim (the claimed runs and the ones failed at once), whenever that
    looked cheaper than 16 key probes: on a database of up to a few thousand runs. In paired
    blocks of one-run claims on a database growing to 8,000 runs, a claim took 5.1 ms at p50
    that way and 1.7 ms by key. The runs are found through the primary key at any size."""
    await finished_history(conn, history)
    plans = await explained(conn, "plan_cache_mode = force_generic_plan")
    with prepared_at_once(conn):
        claimed = await runs.claim(
            conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=1, plays=["p"]
        )
    await conn.execute("RESET client_min_messages")
    assert [c.claimed for c in claimed] == [True]
    claim = [p for p in plans if "WITH taken AS" in p]
    assert claim, plans
    scans = [p for p in claim if re.search(r"Seq Scan on wq_runs", p)]
    assert scans == [], "\n\n".join(scans)


@pytest.mark.parametrize("history", [300, 1000, 3000])
async def test_a_finish_under_its_generic_plan_finds_its_rows_by_key(
    conn: Conn, history: int
) -> None:
    """The finish, like the claim, is one prepared statement per batch: under its generic
    plan no statement of it (the transport's settle and spawn included) reads a whole table
    of runs, jobs, attempts or events."""
    await finished_history(conn, history)
    claimed = await runs.claim(
        conn, lanes=[lanes.lane_name(RELEASE)], worker_id="w1", limit=3, plays=["p"]
    )
    done = [c for c in claimed if c.claimed]
    assert len(done) == 3
    plans = await explained(
        conn, "plan_cache_mode = force_generic_plan", "auto_explain.log_nested_statements = on"
    )
    finishes = [
        outcomes.succeeded(done[0].run_id, done[0].attempt or 0, {"ok": 1}),
        outcomes.timed_out(done[1].run_id, done[1].attempt or 0, None),
        outcomes.handed_back(done[2].run_id, done[2].attempt or 0),
    ]
    with prepared_at_once(conn):
        statuses = await runs.finish(conn, worker_id="w1", finishes=finishes)
    await conn.execute("RESET client_min_messages")
    assert [s.applied for s in statuses.values()] == [True, True, True]
    assert any("WITH input AS" in p for p in plans), plans
    scans = [
        p
        for p in plans
        if re.search(r"Seq Scan on (wq_runs|procrastinate_jobs|wq_attempts|wq_events)\b", p)
    ]
    assert scans == [], "\n\n".join(scans)
