"""Durable sleep and events through a real worker: suspension leaves the worker, the run
is re-spawned when due or emitted, completed steps replay, and no wake-up is lost."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from queues import runs
from tests.apps.durable import SIDE_EFFECTS_DDL, registry
from tests.workers import eventually, fetch, run_state, running_worker, submit


@pytest.fixture
async def url(db_url: str) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
    return db_url


async def side_effects(url: str, run_id: uuid.UUID) -> dict[str, int]:
    rows = await fetch(
        url, "SELECT key, count(*) FROM test_side_effects WHERE run_id = %s GROUP BY key", (run_id,)
    )
    return {str(k): int(n) for k, n in rows}


async def terminal(url: str, run_id: uuid.UUID) -> str | None:
    state = await run_state(url, run_id)
    return state if state in {"succeeded", "failed", "cancelled"} else None


async def kinds(url: str, run_id: uuid.UUID) -> list[str]:
    rows = await fetch(url, "SELECT kind FROM wq_events WHERE run_id = %s ORDER BY id", (run_id,))
    return [str(k) for (k,) in rows]


async def test_sleep_leaves_the_worker_and_resumes_after_its_due_time(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "sleeper", {"seconds": 0.6})
        await eventually(lambda: _is(url, run_id, "sleeping"))
        assert await terminal(url, run_id) is None
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    ((slept_at, woke_at),) = await fetch(
        url,
        "SELECT (SELECT at FROM wq_events WHERE run_id = %(r)s AND kind = 'run_sleeping'),"
        "       (SELECT max(at) FROM wq_events WHERE run_id = %(r)s AND kind = 'attempt_started')",
        {"r": run_id},
    )
    assert (woke_at - slept_at).total_seconds() >= 0.5
    # The step before the sleep ran once; the second attempt replayed it from its receipt.
    assert await side_effects(url, run_id) == {"before": 1, "after": 1}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    assert run.result == {"first": "b", "second": "a", "attempt": 2}
    assert [a.outcome for a in attempts] == ["suspended", "succeeded"]


async def _is(url: str, run_id: uuid.UUID, state: str) -> bool:
    return await run_state(url, run_id) == state


async def test_emit_before_wait_wakes_exactly_once_without_sleeping(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        first = await runs.emit(conn, "early", {"n": 1})
        again = await runs.emit(conn, "early", {"n": 2})
    assert first.first and not again.first  # first emit wins
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "early"})
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    assert await side_effects(url, run_id) == {"woke": 1}
    assert "run_waiting" not in await kinds(url, run_id)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert (await runs.get(conn, run_id)).result == {"payload": {"n": 1}}


async def test_wait_before_emit_wakes_exactly_once(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "late"})
        await eventually(lambda: _is(url, run_id, "sleeping"))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            emitted = await runs.emit(conn, "late", {"ok": True})
            again = await runs.emit(conn, "late", {"ok": False})
        assert emitted.woken == 1 and again.woken == 0
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    assert await side_effects(url, run_id) == {"woke": 1}
    log = await kinds(url, run_id)
    assert log.count("event_received") == 1 and log.count("run_waiting") == 1


async def test_emit_racing_wait_never_loses_a_wake_up(url: str) -> None:
    """Each round submits a waiter and emits its event at the same moment: all finish."""
    run_ids: list[uuid.UUID] = []
    async with running_worker(url, registry, concurrency=16):

        async def round_(i: int) -> None:
            name = f"race-{i}"
            run_id = await submit(url, "waiter", {"event": name})
            run_ids.append(run_id)
            await asyncio.sleep(0.01 * (i % 5))
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await runs.emit(conn, name, {"i": i})

        await asyncio.gather(*(round_(i) for i in range(20)))

        async def all_done() -> bool:
            states = [await terminal(url, r) for r in run_ids]
            return all(s == "succeeded" for s in states)

        await eventually(all_done, timeout=30)
    for run_id in run_ids:
        assert await side_effects(url, run_id) == {"woke": 1}


async def test_wait_times_out_durably(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "never", "timeout": 0.3})
        assert await eventually(lambda: terminal(url, run_id)) in {"failed", "succeeded"}
        state = await run_state(url, run_id)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert state == "failed" or run.error is not None
    assert run.error is not None and run.error["type"] == "EventTimeout"


async def test_heartbeat_keeps_a_long_attempt_leased(url: str) -> None:
    """An attempt longer than several heartbeats keeps its lease and finishes as attempt 1."""
    from tests.apps.plays import registry as plays

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        from queues import lanes

        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=2.0, heartbeat_s=0.5)
    async with running_worker(url, plays) as worker:
        run_id = await submit(url, "slow", {"seconds": 3.5})
        await eventually(lambda: _is(url, run_id, "running"))
        ((first,),) = await fetch(
            url, "SELECT lease_expires_at FROM wq_runs WHERE id = %s", (run_id,)
        )
        assert await eventually(lambda: terminal(url, run_id), timeout=20) == "succeeded"
        assert not worker.stopping.is_set()  # no loop crashed
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    assert run.result["attempt"] == 1
    assert [a.outcome for a in attempts] == ["succeeded"]
    # The lease was renewed past its first expiry while the attempt ran.
    assert run.finished_at is not None and run.finished_at > first


async def test_a_skipped_step_replays_as_skipped_and_never_runs(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        from queues import lanes

        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", retry_base_s=0.0)
    async with running_worker(url, registry):
        run_id = await submit(url, "skipper")
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        cur = await conn.execute(
            "SELECT status::text FROM wq_receipts WHERE scope = %s", (f"run:{run_id}",)
        )
        statuses = [s for (s,) in await cur.fetchall()]
    assert run.result == {"replayed": None}
    assert statuses == ["skipped"]
    assert await side_effects(url, run_id) == {}


async def test_watchdog_stops_an_attempt_whose_lease_was_rescued(url: str) -> None:
    """Recovery rescues the lease of a live attempt (as it would after a long stall); the
    next heartbeat is refused and the worker stops the attempt at once, writing nothing."""
    from datetime import timedelta

    from queues import lanes, recovery
    from tests.apps.plays import registry as plays

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=2.0, heartbeat_s=0.5)
    async with running_worker(url, plays) as worker:
        run_id = await submit(url, "slow", {"seconds": 60})
        await eventually(lambda: _is(url, run_id, "running"))
        assert run_id in worker.live
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute("SELECT now()")
            row = await cur.fetchone()
            assert row is not None
            report = await recovery.run_once(conn, now=row[0] + timedelta(seconds=10))
        assert [r.run_id for r in report.expired] == [run_id]

        async def attempt_stopped() -> bool:
            return run_id not in worker.live

        await eventually(attempt_stopped, timeout=5)  # not the play's 60 s
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    # The rescued attempt wrote nothing after the rescue: the run waits for attempt 2.
    assert (run.state, run.attempt, run.result) == ("queued", 1, None)
    assert [a.outcome for a in attempts] == ["lease_expired"]


async def test_shutdown_does_not_interrupt_a_final_write_under_way(url: str) -> None:
    """A run whose play is done when the worker stops keeps its final write (no hand-back,
    no hang): the shutdown waits for it instead of cancelling it."""
    from tests.apps.plays import registry as plays

    gate = asyncio.Event()
    async with running_worker(url, plays, grace_s=0.0) as worker:
        original = worker._submit_finish

        async def held(final: runs.Finish) -> bool:
            await gate.wait()  # the final write is under way when the stop comes
            return await original(final)

        worker._submit_finish = held  # type: ignore[method-assign]
        run_id = await submit(url, "echo", {"x": 1})

        async def finishing() -> bool:
            live = worker.live.get(run_id)
            return live is not None and live.finishing

        await eventually(finishing)
        asyncio.get_running_loop().call_later(0.3, gate.set)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    assert run.state == "succeeded"
    assert [a.outcome for a in attempts] == ["succeeded"]
