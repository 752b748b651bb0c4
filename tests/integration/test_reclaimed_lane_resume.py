"""Runs that outlive their lane's drain and reclaim: they are served, and the lane stays
closed to admissions (admission-only or lazy local preparation alike) until an operator
reopens it.

- a run handed back mid-way, then its lane force-reclaimed: a worker of the release still
  serves it; the resumed run keeps its write intent, finds its finished rows terminal and
  pays no step twice;
- a hand-back *after* a forced reclaim (a job spawned on a reclaimed lane): reported
  stranded while no worker serves the lane, and finished once an operator adopts it;
- a sleeper across drain, reclaim and its wake.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from queues import admission, lanes, recovery, runs
from queues.errors import LaneReclaimed
from tests.apps.durable import SIDE_EFFECTS_DDL, registry
from tests.workers import eventually, fetch, run_state, running_worker, submit


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
    monkeypatch.setenv("TEST_SIDE_EFFECTS_URL", db_url)  # the plays' own database
    return db_url


async def assert_closed_to_admissions(url: str, release: str) -> None:
    """Refused by an admission-only caller and by a local one (whose lazy preparation must
    not reopen the lane), with nothing written; the lane is still closed after."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        before = await fetch(url, "SELECT count(*) FROM wq_runs")
        sub = admission.Submission(play="paid-rows", release=release)
        for admitter in (admission.Admitter(admission_only=True), admission.Admitter()):
            with pytest.raises(LaneReclaimed):
                await admitter.submit(conn, sub)
        assert await fetch(url, "SELECT count(*) FROM wq_runs") == before
        lane = await lanes.get(conn, lanes.lane_name(release))
        assert lane is not None and lane.state == "reclaimed"


async def until(url: str, run_id: uuid.UUID, state: str) -> None:
    async def reached() -> bool:
        return await run_state(url, run_id) == state

    await eventually(reached, timeout=30)


async def test_a_handed_back_run_on_a_reclaimed_lane_resumes_with_its_intent(url: str) -> None:
    rows = [(f"r{i:04d}", {"i": i}) for i in range(400)]
    run_id = await submit(
        url, "paid-rows", {"chunk": 20, "chunk_delay_s": 0.05}, release="old", inputs=rows
    )

    # Attempt 1 gets part-way, then its worker shuts down and hands the run back.
    async with running_worker(url, registry, release="old", grace_s=0.0):

        async def part_done() -> bool:
            ((done,),) = await fetch(url, "SELECT rows_done FROM wq_runs WHERE id = %s", (run_id,))
            return 100 <= done < 400

        await eventually(part_done, timeout=30)
    assert await run_state(url, run_id) == "queued"
    ((done_before, version, job_id),) = await fetch(
        url,
        "SELECT r.rows_done, i.write_version, r.job_id FROM wq_runs r "
        "JOIN wq_write_intents i ON i.run_id = r.id WHERE r.id = %s",
        (run_id,),
    )

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        # The deploy's cutover retires the lane with the run still on it.
        report = await lanes.reclaim(conn, "old", force=True)
        assert report.unfinished == 1
        # The run keeps its waiting job; recovery has nothing to respawn, reopens nothing.
        passed = await recovery.run_once(conn)
        assert passed.respawned == () and passed.closed_lanes == ()
    assert await fetch(
        url, "SELECT status::text FROM procrastinate_jobs WHERE id = %s", (job_id,)
    ) == [("todo",)]
    await assert_closed_to_admissions(url, "old")

    # A worker of the release still serves its historic runs.
    async with running_worker(url, registry, release="old"):
        await until(url, run_id, "succeeded")
        await assert_closed_to_admissions(url, "old")

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result["write_version"] == version  # the same durable intent
    assert run.result["terminal"] >= done_before  # finished rows came back terminal
    assert run.rows_done == 400
    effects = await fetch(
        url,
        "SELECT key, count(*) FROM test_side_effects WHERE run_id = %s GROUP BY key",
        (run_id,),
    )
    # Only the chunk in flight at the hand-back may repeat; no completed step ran again.
    assert len(effects) == 400 and all(n <= 2 for _, n in effects)
    assert sum(1 for _, n in effects if n == 2) <= 20
    ((reexecuted,),) = await fetch(
        url,
        "SELECT count(*) FROM test_side_effects s JOIN wq_receipts r "
        "ON r.scope = 'run:' || s.run_id AND r.step_key = s.key "
        "WHERE s.run_id = %s AND r.status = 'completed' AND r.completed_at < s.at",
        (run_id,),
    )
    assert reexecuted == 0


async def test_a_hand_back_after_a_forced_reclaim_is_stranded_until_adopted(url: str) -> None:
    rows = [(f"r{i:03d}", {"i": i}) for i in range(200)]
    run_id = await submit(
        url, "paid-rows", {"chunk": 10, "chunk_delay_s": 0.05}, release="gone", inputs=rows
    )
    async with running_worker(url, registry, release="gone", grace_s=0.0):
        await until(url, run_id, "running")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            assert (await lanes.reclaim(conn, "gone", force=True)).unfinished == 1
        # The worker stops: it hands the run back, onto its own (reclaimed) lane.
    assert await run_state(url, run_id) == "queued"
    ((job_lane, job_status),) = await fetch(
        url,
        "SELECT j.queue_name, j.status::text FROM wq_runs r JOIN procrastinate_jobs j"
        " ON j.id = r.job_id WHERE r.id = %s",
        (run_id,),
    )
    assert (job_lane, job_status) == ("r-gone", "todo")
    await assert_closed_to_admissions(url, "gone")

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        # No worker serves the lane: the run is not lost, it is reported stranded.
        report = await recovery.run_once(conn, stranded_after_s=0)
        stranded = {s.lane: s for s in report.stranded}
        assert stranded["r-gone"].runs == 1 and stranded["r-gone"].lane_state == "reclaimed"
        # The operator moves it to the current release.
        assert await recovery.adopt(conn, from_release="gone", to_release="next") == 1
    async with running_worker(url, registry, release="next"):
        await until(url, run_id, "succeeded")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        assert run.rows_done == 200 and run.lane == "r-next"
        assert (await lanes.get(conn, "r-gone")).state == "reclaimed"  # type: ignore[union-attr]


async def test_a_sleeper_across_drain_reclaim_and_its_wake(url: str) -> None:
    async with running_worker(url, registry, release="nap") as worker:
        run_id = await submit(url, "sleeper", {"seconds": 1.5}, release="nap")
        await until(url, run_id, "sleeping")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await lanes.drain(conn, "nap")
            assert (await lanes.reclaim(conn, "nap", force=True)).unfinished == 1
            # Recovery passes while it sleeps change nothing about the lane.
            await recovery.run_once(conn)
        await assert_closed_to_admissions(url, "nap")
        # It wakes on its reclaimed lane and the release's worker finishes it.
        await until(url, run_id, "succeeded")

        # Its final write commits before the attempt counts it: the worker that ran it.
        async def counted() -> bool:
            return worker.stats["succeeded"] == 1

        await eventually(counted, timeout=10)
        await assert_closed_to_admissions(url, "nap")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        outcomes = [a.outcome for a in await runs.attempts(conn, run_id)]
    assert outcomes == ["suspended", "succeeded"]
