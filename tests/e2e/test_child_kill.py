"""A parent and its child survive a SIGKILL of the worker between the spawn and the wait:
worker A runs the parent's attempt 1, which spawns its child (the step's receipt and the
child are one transaction) and stops at a rendezvous; A is killed there. Once A's lease
lapsed, the recovery pass retries the parent; worker B runs attempt 2, whose spawn replays
its receipt (the same child, no second one), waits for the child durably and gets its
result."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psycopg

from queues import lanes
from tests import ledgers
from tests.apps.scheduling import DDL
from tests.e2e.test_cli_scheduler import cli, eventually
from tests.e2e.test_rate_limit import submit, worker
from tests.workers import fetch

RELEASE = "kill"


async def test_a_parent_killed_between_spawn_and_wait_ends_with_exactly_one_child(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(DDL)
        await lanes.prepare(conn, RELEASE)
        # A short lease, retries without backoff: the rescue comes quickly.
        await lanes.set_policy(conn, RELEASE, lease_ttl_s=2.0, heartbeat_s=0.5, retry_base_s=0.0)
    async with worker(db_url, tmp_path, "a", release=RELEASE) as a:
        parent = await submit(
            db_url, "parent", {"rendezvous": True, "value": 7, "child_sleep": 0.5}, RELEASE
        )

        async def spawned() -> bool:
            rows = await fetch(
                db_url,
                "SELECT count(*) FROM marks WHERE run_id = %s AND mark = 'spawned'",
                (parent,),
            )
            return int(rows[0][0]) == 1

        await eventually(spawned, "attempt 1 to spawn its child")
        os.killpg(a.pid, signal.SIGKILL)
        await a.wait()
    [(child,)] = await fetch(db_url, "SELECT id FROM wq_runs WHERE parent_id = %s", (parent,))

    async def rescued() -> bool:
        done = await cli(db_url, "recover", "--once", "--json")
        assert done.code == 0, done.err
        report = json.loads(done.out)
        return any(r["run_id"] == str(parent) for r in report["expired"])

    await eventually(rescued, "the recovery pass to rescue the parent", timeout=60)
    async with worker(db_url, tmp_path, "b", release=RELEASE):

        async def ended() -> tuple[str, dict[str, object]] | None:
            rows = await fetch(
                db_url, "SELECT state::text, result FROM wq_runs WHERE id = %s", (parent,)
            )
            state, result = rows[0]
            if state in ("succeeded", "failed", "cancelled"):
                return str(state), result
            # The child ran on A (and lapsed with it) or waits for B: recovery retries it.
            await cli(db_url, "recover", "--once")
            return None

        state, result = await eventually(ended, "the parent to end", timeout=90)
    assert state == "succeeded", result
    children = await fetch(
        db_url, "SELECT id, state::text FROM wq_runs WHERE parent_id = %s", (parent,)
    )
    assert children == [(child, "succeeded")]  # exactly one child, the first attempt's
    assert result["child"] == str(child)
    assert result["result"] == {"doubled": 14, "meta": {"by": "parent"}}
    assert int(str(result["attempt"])) >= 2
    assert len(await ledgers.events(db_url, parent, "child_spawned")) == 1
