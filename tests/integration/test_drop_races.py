"""A claim's drop that arrives late, on real committing connections.

A claim returns a delivery it cannot start as dropped, and a second statement (job_drop)
settles it: a run whose play the release lacks is failed there. Between the two the
claimer may stall (paused, its process frozen, its statement waiting on a lock) while
recovery gives the run a new job (migration 0022). The drop's write to the run is fenced
in its own statement by the run's job, and Postgres re-checks that predicate on the row's
newest version when the drop's statement was waiting for the row: the late drop writes
nothing to the run, and the run fails once, by the claim of its new job.

The stall is made deterministic: the test holds the run's row lock, so the claimer's drop
waits for it (seen in pg_stat_activity); the same transaction runs recovery, then commits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from queues import admission, lanes, recovery, runs
from tests.workers import eventually

Conn = psycopg.AsyncConnection[Any]
RELEASE = "drop-races"


async def test_a_drop_waiting_while_recovery_respawns_the_run_writes_nothing_to_it(
    db_url: str,
) -> None:
    async with (
        await psycopg.AsyncConnection.connect(db_url, autocommit=True) as holder,
        await psycopg.AsyncConnection.connect(db_url, autocommit=True) as claimer,
    ):
        await lanes.prepare(holder, RELEASE)
        lane = lanes.lane_name(RELEASE)
        admitted = await admission.submit(
            holder, admission.Submission(play="gone", release=RELEASE)
        )
        cur = await claimer.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        claimer_pid = row[0]

        async with holder.transaction():
            await holder.execute(
                "SELECT 1 FROM wq_runs WHERE id = %s FOR UPDATE", (admitted.run_id,)
            )
            claim = asyncio.create_task(
                runs.claim(claimer, lanes=[lane], worker_id="w1", limit=10, plays=["p"])
            )

            async def drop_waits() -> bool:
                # Inside a transaction the activity view is read once: read it afresh.
                await holder.execute("SELECT pg_stat_clear_snapshot()")
                cur = await holder.execute(
                    "SELECT wait_event_type = 'Lock' AND query LIKE %s"
                    " FROM pg_stat_activity WHERE pid = %s",
                    ("WITH delivery AS%", claimer_pid),  # job_drop's start
                )
                found = await cur.fetchone()
                return bool(found and found[0])

            await eventually(drop_waits, timeout=10)
            # The claim committed its take: the job is delivered, the run still waits for it.
            report = await recovery.run_once(holder)
            [respawned] = report.respawned
            assert (respawned.run_id, respawned.old_job_status) == (admitted.run_id, "doing")
        # The holder committed: the waiting drop goes on, against the run's new version.
        dropped = await asyncio.wait_for(claim, 10)
        assert [(c.claimed, c.job_id) for c in dropped] == [(False, admitted.job_id)]

        run = await runs.get(holder, admitted.run_id)
        assert (run.state, run.job_id, run.error) == ("queued", respawned.job_id, None)
        kinds = [e.kind for e in await runs.events(holder, admitted.run_id)]
        assert kinds == ["run_created", "respawned"]

        # The late drop's snapshot still showed the run waiting for the old job, so it sent
        # that job back to the lane (migration 0022: harmless). The next claim takes both
        # and drops both: the old one as a duplicate, the run's own one failing the run,
        # once.
        again = await runs.claim(claimer, lanes=[lane], worker_id="w1", limit=10, plays=["p"])
        assert sorted((c.claimed, c.job_id) for c in again) == sorted(
            [(False, admitted.job_id), (False, respawned.job_id)]
        )
        run = await runs.get(holder, admitted.run_id)
        assert run.state == "failed" and run.error is not None
        assert run.error["code"] == "PLAY_UNKNOWN"
        kinds = [e.kind for e in await runs.events(holder, admitted.run_id)]
        assert kinds == ["run_created", "respawned", "run_failed"]
