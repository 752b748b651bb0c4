"""Child runs through a real worker: a parent spawns a child and waits durably (it leaves
the worker while the child runs), gets its result or its failure, times out on its own
deadline; cancelling a parent cancels its children."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from queues import admission, children, operator, recovery, runs
from tests import ledgers
from tests.apps.scheduling import URL_ENV, prepare, registry
from tests.workers import eventually, fetch, running_worker

RELEASE = "kids"


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    await prepare(db_url, RELEASE)
    monkeypatch.setenv(URL_ENV, db_url)
    return db_url


async def submit(url: str, play: str, params: dict[str, Any]) -> uuid.UUID:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn, admission.Submission(play=play, params=params, release=RELEASE)
        )
    return admitted.run_id


async def ended(url: str, run_id: uuid.UUID) -> runs.Run | None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    return run if run.terminal else None


async def children_of(url: str, run_id: uuid.UUID) -> list[tuple[uuid.UUID, str]]:
    rows = await fetch(
        url, "SELECT id, state::text FROM wq_runs WHERE parent_id = %s ORDER BY id", (run_id,)
    )
    return [(r[0], str(r[1])) for r in rows]


async def test_a_parent_waits_durably_for_its_childs_result(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE, concurrency=4):
        parent = await submit(url, "parent", {"value": 4})
        run = await eventually(lambda: ended(url, parent), timeout=30)
    [(child, state)] = await children_of(url, parent)
    assert state == "succeeded"
    assert run.state == "succeeded"
    assert run.result == {
        "child": str(child),
        "result": {"doubled": 8, "meta": {"by": "parent"}},
        "attempt": 2,  # it slept while the child ran, and was woken by its end
    }
    kinds = await ledgers.kinds(url, parent)
    assert "child_spawned" in kinds and "run_waiting" in kinds and "event_received" in kinds


async def test_a_childs_failure_is_raised_in_its_parent(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE, concurrency=4):
        parent = await submit(url, "parent", {"fail": True})
        run = await eventually(lambda: ended(url, parent), timeout=30)
    [(child, state)] = await children_of(url, parent)
    assert state == "failed"
    assert run.result == {"child": str(child), "failed": "failed", "attempt": 2}


async def test_a_wait_past_its_timeout_raises_and_the_child_goes_on(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE, concurrency=4):
        parent = await submit(url, "parent", {"timeout": 0.2, "value": 1, "child_sleep": 2})
        run = await eventually(lambda: ended(url, parent), timeout=30)
        assert run.result["timed_out"] is True
        [(child, state)] = await children_of(url, parent)
        assert state == "running"
        assert (await eventually(lambda: ended(url, child), timeout=30)).state == "succeeded"


async def test_cancelling_a_parent_cancels_its_children(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE, concurrency=4):
        parent = await submit(url, "parent", {"rendezvous": True, "child_sleep": 60})

        async def spawned() -> list[tuple[uuid.UUID, str]] | None:
            kids = await children_of(url, parent)
            return kids if kids and kids[0][1] == "running" else None

        [(child, _)] = await eventually(spawned, timeout=30)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            result = await operator.cancel(conn, parent, actor="cli:test", reason="wrong list")
        assert (result.before, result.changed) == ("running", True)
        assert (await eventually(lambda: ended(url, parent), timeout=30)).state == "cancelled"
        run = await eventually(lambda: ended(url, child), timeout=30)
    assert run.state == "cancelled"
    assert run.cancel_reason == f"parent run {parent} was cancelled"


async def test_the_recovery_pass_cancels_children_a_cancel_did_not_reach(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE, concurrency=4):
        parent = await submit(url, "parent", {"rendezvous": True, "child_sleep": 60})
        await eventually(lambda: children_of(url, parent), timeout=30)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            # The bare statement, and the child read before it commits: the worker's own
            # recovery tick may run any time after, and cancel the child itself.
            async with conn.transaction():
                await runs.cancel(conn, parent, reason="no cascade")
                [(child, state)] = await (
                    await conn.execute(
                        "SELECT id, state::text FROM wq_runs WHERE parent_id = %s", (parent,)
                    )
                ).fetchall()
            assert state in ("queued", "running")
            report = await recovery.run_once(conn)
            if not report.children_cancelled:
                # The worker serves the same pass once a minute; its tick got there first.
                [(reason,)] = await (
                    await conn.execute("SELECT cancel_reason FROM wq_runs WHERE id = %s", (child,))
                ).fetchall()
                assert reason == children.parent_cancelled(parent)
            else:
                assert report.children_cancelled == (child,)
        run = await eventually(lambda: ended(url, child), timeout=30)
    assert run.state == "cancelled"
    assert run.cancel_reason == f"parent run {parent} was cancelled"
