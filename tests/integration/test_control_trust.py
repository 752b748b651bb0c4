"""The control plane trusts no one it should not: a control message is a wake, never an
order.

Anyone who can connect can NOTIFY any channel, whatever their role. A worker that hears a
cancel on the control channel reads the run's durable cancel request (written by
``worker cancel``, which only the worker role and the owner can) before it stops anything:
a NOTIFY sent as the reader, the admission or even the worker role stops nothing, and a
real ``worker cancel`` still stops its run within seconds, with an audit row naming who
asked.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from psycopg import sql

from tests.workers import (
    ROOT,
    connect,
    eventually,
    fetch,
    login_users,
    run_state,
    running_worker,
    submit,
)
from worker.context import RunContext
from worker.plays import Registry
from worker.runtime import Worker

WORKER = str(Path(sys.executable).parent / "worker")
ROLES = ("wq_reader", "wq_admission", "wq_worker")


def plays() -> tuple[Registry, asyncio.Event, asyncio.Event]:
    """A play that holds until released, and the events of its start and its release."""
    registry = Registry()
    started, release = asyncio.Event(), asyncio.Event()

    @registry.play("hold")
    async def hold(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        started.set()
        await release.wait()
        return {"held": True}

    @registry.play("forever")
    async def forever(ctx: RunContext, params: dict[str, Any]) -> None:
        await asyncio.sleep(3600)

    return registry, started, release


async def notify_cancel(url: str, run_id: uuid.UUID) -> None:
    """A cancel message on the control channel, as whoever ``url`` logs in as."""
    message = json.dumps({"cancel": str(run_id)})
    async with connect(url) as conn:
        await conn.execute(sql.SQL("NOTIFY wq_control, {}").format(sql.Literal(message)))


def live(worker: Worker, run_id: uuid.UUID) -> bool:
    attempt = worker.slots.live.get(run_id)
    return attempt is not None and attempt.stop_reason is None and not attempt.task.done()


async def test_a_notify_from_any_role_stops_nothing_and_a_real_cancel_does(db_url: str) -> None:
    registry, started, release = plays()
    async with login_users(db_url, ROLES) as urls, running_worker(db_url, registry) as worker:
        run_id = await submit(db_url, "hold")
        await asyncio.wait_for(started.wait(), timeout=15)
        for role in ROLES:
            checked = worker.stats["control_checks"]
            await notify_cancel(urls[role], run_id)
            # The worker heard it and read the run's request (there is none): nothing stops.
            await eventually(lambda c=checked: _above(worker, "control_checks", c))
            assert live(worker, run_id), role
            assert await run_state(db_url, run_id) == "running", role
        release.set()
        await eventually(lambda: _state_is(db_url, run_id, "succeeded"))
        assert await fetch(
            db_url, "SELECT cancel_requested_at FROM wq_runs WHERE id = %s", (run_id,)
        ) == [(None,)]

        victim = await submit(db_url, "forever")
        await eventually(lambda: _live_async(worker, victim))
        proc = await asyncio.create_subprocess_exec(
            WORKER,
            "cancel",
            str(victim),
            "--reason",
            "wrong list",
            env=dict(os.environ, WORKER_DATABASE_URL=db_url, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, (out, err)
        await eventually(lambda: _state_is(db_url, victim, "cancelled"), timeout=10)
    audit = await fetch(
        db_url, "SELECT actor, action FROM wq_operator_actions WHERE run_id = %s", (victim,)
    )
    assert len(audit) == 1 and audit[0][1] == "cancel" and audit[0][0].startswith("cli")
    assert await fetch(
        db_url, "SELECT count(*) FROM wq_operator_actions WHERE run_id = %s", (run_id,)
    ) == [(0,)]


async def _above(worker: Worker, stat: str, value: int) -> bool:
    return worker.stats[stat] > value


async def _live_async(worker: Worker, run_id: uuid.UUID) -> bool:
    return live(worker, run_id)


async def _state_is(url: str, run_id: uuid.UUID, state: str) -> bool:
    return await run_state(url, run_id) == state
