"""A sandboxed play (no database credentials; everything through the runtime gateway with
its attempt's tokens) takes a permit of a shared limit, spawns a child and waits for it:
the new actions are served by the same dispatch as in-process plays."""

from __future__ import annotations

import psycopg

from queues import admission, lanes, limits, runs
from tests.workers import eventually, fetch, running_worker
from worker.plays import load_registry

SECRET = b"s" * 48
RELEASE = "sbxk"


async def test_a_sandboxed_play_takes_a_permit_and_waits_for_its_child(db_url: str) -> None:
    registry = load_registry("tests.apps.scheduling_sandboxed:registry")
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        await limits.set_limit(conn, "sbx", rate="100/s", concurrency=1)
        parent = (
            await admission.submit(
                conn,
                admission.Submission(
                    play="sandboxed-parent", release=RELEASE, meta={"from": "sandbox"}
                ),
            )
        ).run_id
    async with running_worker(db_url, registry, release=RELEASE, token_secret=SECRET):

        async def ended() -> runs.Run | None:
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
                run = await runs.get(conn, parent)
            return run if run.terminal else None

        run = await eventually(ended, timeout=60)
    assert run.state == "succeeded", run.error
    [(child, state)] = await fetch(
        db_url, "SELECT id::text, state::text FROM wq_runs WHERE parent_id = %s", (parent,)
    )
    assert state == "succeeded" and run.result["child"] == child
    assert run.result["result"] == {"tripled": 9, "meta": {"from": "sandbox"}}
    assert await fetch(db_url, "SELECT count(*) FROM wq_limit_holds") == [(0,)]  # released
