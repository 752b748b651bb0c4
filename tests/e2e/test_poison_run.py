"""A run that kills every worker it lands on (docs/design.md, section 11c): a worker's death
is an interruption, not a failure, so a crash storm never fails a healthy run; but three
deaths in a row with nothing settled, on three workers, make a poison run, which fails
with ``RUN_KILLS_WORKERS`` while the other runs on the lane keep flowing.

Real worker processes: the ``kills-its-worker`` play SIGKILLs the process it runs in; the
test restarts a worker after each death, as a supervisor would, and runs recovery passes.
What is counted is the lapses, not how each is noticed, so the lane's timers are short: a
2 s lease (a dead worker's run is rescued when it lapses, before the 10 s of silence the
liveness rule waits for) and no retry backoff, so a death costs about a lease and a
worker's start, which overlap. The defaults a lane gets are asserted first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg
import pytest

from queues import lanes, outcomes, recovery
from tests.apps.durable import SIDE_EFFECTS_DDL
from tests.workers import durable_worker, eventually, fetch, submit


@pytest.mark.slow
async def test_a_run_that_kills_its_workers_fails_and_the_lane_keeps_flowing(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
        lane = await lanes.prepare(conn, "t")
        # What a lane gets unless told: a 30 s lease renewed every 5 s, a 2 s first retry.
        assert (lane.lease_ttl_s, lane.heartbeat_s, lane.retry_base_s) == (30.0, 5.0, 2.0)
        await lanes.set_policy(conn, "t", lease_ttl_s=2.0, heartbeat_s=0.5, retry_base_s=0.0)
    poison = await submit(db_url, "kills-its-worker", {}, release="t")
    healthy = [await submit(db_url, "sleeper", {"seconds": 0.2}, release="t") for _ in range(6)]

    def start(ready: Path) -> subprocess.Popen[bytes]:
        return durable_worker(db_url, ready, concurrency=4, args=("--grace", "1"))

    workers: list[subprocess.Popen[bytes]] = []
    try:
        workers.append(start(tmp_path / "w0.ready"))

        async def supervise() -> None:
            # A supervisor's part: a worker that died is replaced; and the recovery cron's.
            if workers[-1].poll() is not None:
                workers.append(start(tmp_path / f"w{len(workers)}.ready"))
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
                await recovery.run_once(conn)

        async def poison_ended() -> str | None:
            await supervise()
            ((state,),) = await fetch(
                db_url, "SELECT state::text FROM wq_runs WHERE id = %s", (poison,)
            )
            return state if state in ("failed", "succeeded") else None

        assert await eventually(poison_ended, timeout=120, interval=0.3) == "failed"

        async def healthy_done() -> bool:
            await supervise()
            rows = await fetch(
                db_url,
                "SELECT count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'succeeded'",
                (healthy,),
            )
            return int(rows[0][0]) == len(healthy)

        deaths = len(workers) - 1
        await eventually(healthy_done, timeout=60, interval=0.3)
        assert len(workers) - 1 == deaths  # no worker died after the poison run failed
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)

    ((error,),) = await fetch(db_url, "SELECT error FROM wq_runs WHERE id = %s", (poison,))
    assert error["code"] == outcomes.RUN_KILLS_WORKERS
    assert "the run kills its workers" in error["message"]
    rows = await fetch(
        db_url,
        "SELECT outcome::text, worker_id FROM wq_attempts WHERE run_id = %s ORDER BY attempt",
        (poison,),
    )
    # Attempt 1 completed a step before it killed its worker; the attempts after it
    # settled nothing: the bound, or a few more while a healthy run died with it each
    # time (then neither is blamed, and the two are retried apart). Every death was its.
    bound = 1 + outcomes.KILLS_WORKERS_AFTER
    assert [o for o, _ in rows] == ["lease_expired"] * len(rows)
    assert bound <= len(rows) <= bound + 3, rows
    assert len({w for _, w in rows}) == len(rows)
    assert deaths == len(rows)
    dying = await fetch(
        db_url, "SELECT count(*) FROM test_side_effects WHERE run_id = %s", (poison,)
    )
    assert int(dying[0][0]) == len(rows)
