"""A run whose lane was reclaimed mid-way: recovery re-prepares the run's original lane,
re-spawns it, and the resumed run keeps its write intent, finds its finished rows already
terminal and pays no step twice."""

from __future__ import annotations

import psycopg

from queues import lanes, recovery, runs
from tests.apps.durable import SIDE_EFFECTS_DDL, registry
from tests.workers import eventually, fetch, run_state, running_worker, submit


async def test_reclaimed_lane_is_reprepared_and_the_run_resumes_with_its_intent(
    db_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
    rows = [(f"r{i:04d}", {"i": i}) for i in range(400)]
    run_id = await submit(
        db_url, "paid-rows", {"chunk": 20, "chunk_delay_s": 0.05}, release="old", inputs=rows
    )

    # Attempt 1 gets part-way, then its worker shuts down and hands the run back.
    async with running_worker(db_url, registry, release="old", grace_s=0.0):

        async def part_done() -> bool:
            ((done,),) = await fetch(
                db_url, "SELECT rows_done FROM wq_runs WHERE id = %s", (run_id,)
            )
            return 100 <= done < 400

        await eventually(part_done, timeout=30)
    assert await run_state(db_url, run_id) == "queued"
    ((done_before, version),) = await fetch(
        db_url,
        "SELECT r.rows_done, i.write_version FROM wq_runs r "
        "JOIN wq_write_intents i ON i.run_id = r.id WHERE r.id = %s",
        (run_id,),
    )

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        # The deploy's cutover retires the lane with the run still on it.
        report = await lanes.reclaim(conn, "old", force=True)
        assert report.unfinished == 1 and report.jobs_cancelled == 1
        passed = await recovery.run_once(conn)
        assert passed.reprepared == ("r-old",)
        assert [r.run_id for r in passed.respawned] == [run_id]
        lane = await lanes.get(conn, "r-old")
        assert lane is not None and lane.state == "prepared"

    async with running_worker(db_url, registry, release="old"):

        async def succeeded() -> bool:
            return await run_state(db_url, run_id) == "succeeded"

        await eventually(succeeded, timeout=30)

    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result["write_version"] == version  # the same durable intent
    assert run.result["terminal"] >= done_before  # finished rows came back terminal
    assert run.rows_done == 400
    effects = await fetch(
        db_url,
        "SELECT key, count(*) FROM test_side_effects WHERE run_id = %s GROUP BY key",
        (run_id,),
    )
    # Only the chunk in flight at the hand-back may repeat; no completed step ran again.
    assert len(effects) == 400 and all(n <= 2 for _, n in effects)
    assert sum(1 for _, n in effects if n == 2) <= 20
    ((reexecuted,),) = await fetch(
        db_url,
        "SELECT count(*) FROM test_side_effects s JOIN wq_receipts r "
        "ON r.scope = 'run:' || s.run_id AND r.step_key = s.key "
        "WHERE s.run_id = %s AND r.status = 'completed' AND r.completed_at < s.at",
        (run_id,),
    )
    assert reexecuted == 0
