"""What a worker does when a heartbeat comes back without one of its leases."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from queues import runs
from worker.heartbeat import Beat
from worker.plays import Registry
from worker.runtime import Settings, Worker
from worker.slots import Live


def claimed(run_id: uuid.UUID) -> runs.Claimed:
    fields: dict[str, Any] = {name: None for name in runs.Claimed.__dataclass_fields__}
    return runs.Claimed(**fields | {"claimed": True, "run_id": run_id, "attempt": 1, "job_id": 1})


@pytest.mark.parametrize("finishing", [False, True], ids=["running", "finishing"])
async def test_a_missing_renewal_stops_a_running_play_and_quietly_ends_a_finishing_ones(
    finishing: bool,
) -> None:
    """A running play is stopped and the loss is logged. A play that returned is only
    no longer renewed: its fenced final write, already sent, decides (with batched
    completion the renewal is missing whenever it raced that write's commit)."""
    worker = Worker(
        Settings(
            url="postgresql://127.0.0.1:1/unused",
            release="lease-test",
            registry=Registry(),
            concurrency=2,
            install_signals=False,
        )
    )
    run_id = uuid.uuid4()
    task = asyncio.create_task(asyncio.sleep(60))
    live = Live(
        claimed(run_id), ctx=SimpleNamespace(cancel_requested=False), task=task, finishing=finishing
    )  # type: ignore[arg-type]
    worker.slots.live[run_id] = live
    kept = uuid.uuid4()  # another attempt's lease, renewed: untouched
    other = Live(
        claimed(kept),
        ctx=SimpleNamespace(cancel_requested=False),
        task=asyncio.create_task(asyncio.sleep(60)),
    )  # type: ignore[arg-type]
    worker.slots.live[kept] = other
    renewed = runs.Renewed(run_id=kept, attempt=1, lease_expires_at=None, cancel=False)  # type: ignore[arg-type]
    with capture_logs() as logs:
        worker.leases.on_beat(Beat(sent=((run_id, 1), (kept, 1)), renewed=(renewed,)))
        worker.leases.on_beat(Beat(sent=((run_id, 1),), renewed=()))  # a second miss: once only
    await asyncio.sleep(0)
    assert live.stop_reason == "lease_lost"
    assert task.cancelled() is not finishing
    assert [e["event"] for e in logs if e["event"] == "lease_lost"] == (
        [] if finishing else ["lease_lost"]
    )
    assert other.stop_reason is None and not other.task.done()
    for t in (task, other.task):
        t.cancel()
