"""Durable sleep and events through a real worker: suspension leaves the worker, the run
is re-spawned when due or emitted, completed steps replay, and no wake-up is lost."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import runs
from queues.outcomes import Finish, FinishStatus
from queues.queries import q
from tests import ledgers
from tests.apps.durable import SIDE_EFFECTS_DDL, registry
from tests.workers import eventually, fetch, run_state, running_worker, submit


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SIDE_EFFECTS_DDL)
    monkeypatch.setenv("TEST_SIDE_EFFECTS_URL", db_url)  # the plays' own database
    return db_url


async def side_effects(url: str, run_id: uuid.UUID) -> dict[str, int]:
    rows = await fetch(
        url, "SELECT key, count(*) FROM test_side_effects WHERE run_id = %s GROUP BY key", (run_id,)
    )
    return {str(k): int(n) for k, n in rows}


async def terminal(url: str, run_id: uuid.UUID) -> str | None:
    state = await run_state(url, run_id)
    return state if state in {"succeeded", "failed", "cancelled"} else None


async def test_sleep_leaves_the_worker_and_resumes_after_its_due_time(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "sleeper", {"seconds": 0.6})
        await eventually(lambda: _is(url, run_id, "sleeping"))
        assert await terminal(url, run_id) is None
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    (slept,) = await ledgers.events(url, run_id, "run_sleeping")
    woke = await ledgers.events(url, run_id, "attempt_started")
    slept_at, woke_at = slept.at, max(e.at for e in woke)
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


async def emit(url: str, name: str, payload: object, *, org: str = "default") -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return (await runs.emit(conn, org=org, name=name, payload=payload)).woken


async def test_an_emit_after_admission_but_before_the_wait_is_seen_without_sleeping(
    url: str,
) -> None:
    # The run is admitted before any worker runs; the event comes before its play waits.
    run_id = await submit(url, "waiter", {"event": "early"})
    assert await emit(url, "early", {"n": 1}) == 0  # nobody waits yet
    assert await emit(url, "early", {"n": 2}) == 0  # the latest emit is kept
    async with running_worker(url, registry):
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    assert await side_effects(url, run_id) == {"woke": 1}
    assert "run_waiting" not in await ledgers.kinds(url, run_id)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert (await runs.get(conn, run_id)).result == {"received": True, "payload": {"n": 2}}


async def test_an_emit_before_the_run_was_admitted_is_not_seen(url: str) -> None:
    assert await emit(url, "stale-news", {"old": True}) == 0
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "stale-news"})
        await eventually(lambda: _is(url, run_id, "sleeping"))
        assert await emit(url, "stale-news", {"old": False}) == 1
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result == {"received": True, "payload": {"old": False}}


async def test_wait_before_emit_wakes_exactly_once(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "late"})
        await eventually(lambda: _is(url, run_id, "sleeping"))
        woken = await emit(url, "late", {"ok": True})
        again = await emit(url, "late", {"ok": True})
        assert (woken, again) == (1, 0)  # a woken waiter is not woken twice
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    assert await side_effects(url, run_id) == {"woke": 1}
    log = await ledgers.kinds(url, run_id)
    assert log.count("event_received") == 1 and log.count("run_waiting") == 1


async def test_an_emit_wakes_only_its_own_orgs_waiters(url: str) -> None:
    async with running_worker(url, registry):
        ours = await submit(url, "waiter", {"event": "payment-received"}, org="acme")
        theirs = await submit(url, "waiter", {"event": "payment-received"}, org="globex")
        await eventually(lambda: _is(url, ours, "sleeping"))
        await eventually(lambda: _is(url, theirs, "sleeping"))
        assert await emit(url, "payment-received", {"amount": 10}, org="acme") == 1
        assert await eventually(lambda: terminal(url, ours)) == "succeeded"
        # The other org's waiter is still asleep, and wakes on its own org's emit only.
        assert await run_state(url, theirs) == "sleeping"
        assert await emit(url, "payment-received", {"amount": 99}, org="globex") == 1
        assert await eventually(lambda: terminal(url, theirs)) == "succeeded"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert (await runs.get(conn, ours)).result["payload"] == {"amount": 10}
        assert (await runs.get(conn, theirs)).result["payload"] == {"amount": 99}


async def test_an_emit_between_the_check_and_the_suspension_is_not_lost(url: str) -> None:
    """The interleaving that loses wake-ups elsewhere, forced: the play has checked that the
    event is not there and is suspending; the emit commits before the suspension can take
    the event's lock. The suspension re-checks under the lock and hands the run back."""
    org, name = "default", "interleaved"
    async with await psycopg.AsyncConnection.connect(url) as holder:
        # Hold the event's lock: the worker's suspension will queue behind it.
        await holder.execute(q("event_lock"), {"org": org, "name": name})
        async with running_worker(url, registry):
            run_id = await submit(url, "waiter", {"event": name})
            await eventually(lambda: _advisory_waiters(url))
            # The emit, in the holder's transaction (the lock is re-entrant for it).
            cur = await holder.execute(
                q("event_emit"),
                {
                    "org": org,
                    "name": name,
                    "payload": Jsonb({"raced": True}),
                    "run_id": None,
                    "attempt": None,
                    "owner": None,
                },
            )
            assert await cur.fetchone() == (True, 0, None, None)  # not suspended yet: 0 woken
            await holder.commit()
            assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result == {"received": True, "payload": {"raced": True}}
    assert "run_waiting" not in await ledgers.kinds(url, run_id)  # the suspension was never written
    assert await side_effects(url, run_id) == {"woke": 1}


async def _advisory_waiters(url: str) -> bool:
    rows = await fetch(
        url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return int(rows[0][0]) > 0


async def test_many_waits_and_emits_at_once_all_wake(url: str) -> None:
    """A bounded stress of emits racing waits (the forced interleaving is the test above)."""
    run_ids: list[uuid.UUID] = []
    async with running_worker(url, registry, concurrency=16):

        async def round_(i: int) -> None:
            run_id = await submit(url, "waiter", {"event": f"race-{i}"})
            run_ids.append(run_id)
            await emit(url, f"race-{i}", {"i": i})

        await asyncio.gather(*(round_(i) for i in range(20)))

        async def all_done() -> bool:
            states = [await terminal(url, r) for r in run_ids]
            return all(s == "succeeded" for s in states)

        await eventually(all_done, timeout=30)
    for run_id in run_ids:
        assert await side_effects(url, run_id) == {"woke": 1}


async def test_a_timed_out_wait_is_a_result_the_play_handles(url: str) -> None:
    async with running_worker(url, registry):
        run_id = await submit(url, "waiter", {"event": "never", "timeout": 0.3})
        assert await eventually(lambda: terminal(url, run_id)) == "succeeded"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result == {"received": False, "payload": None}
    assert await side_effects(url, run_id) == {"timed_out": 1}


async def test_heartbeat_keeps_a_long_attempt_leased(url: str) -> None:
    """An attempt longer than its lease TTL is renewed: recovery passes run while it runs
    find nothing to rescue, and the lease in the database moves forward past its first
    expiry. Without renewals the first pass after that expiry would rescue it."""
    from queues import lanes, recovery
    from tests.apps.plays import registry as plays

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=2.0, heartbeat_s=0.5)
    async with running_worker(url, plays) as worker:
        run_id = await submit(url, "slow", {"seconds": 4.0})
        await eventually(lambda: _is(url, run_id, "running"))
        ((first,),) = await fetch(
            url, "SELECT lease_expires_at FROM wq_runs WHERE id = %s", (run_id,)
        )

        async def renewed_past_first_expiry() -> bool:
            ((now, lease, state),) = await fetch(
                url,
                "SELECT clock_timestamp(), lease_expires_at, state::text FROM wq_runs"
                " WHERE id = %s",
                (run_id,),
            )
            return state == "running" and now > first and lease > now

        await eventually(renewed_past_first_expiry, timeout=10)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            report = await recovery.run_once(conn)  # the real clock: past the first expiry
        assert report.expired == ()
        assert await eventually(lambda: terminal(url, run_id), timeout=20) == "succeeded"
        assert not worker.stopping.is_set()  # no loop crashed
        assert worker.heartbeat is not None and worker.heartbeat.beats >= 3
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    assert run.result["attempt"] == 1
    assert [a.outcome for a in attempts] == ["succeeded"]


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

        async def attempt_live() -> bool:
            # The claim is visible once committed, a moment before the worker has read its
            # answer and started the attempt.
            return run_id in worker.slots.live

        await eventually(attempt_live, timeout=5)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute("SELECT now()")
            row = await cur.fetchone()
            assert row is not None
            report = await recovery.run_once(conn, now=row[0] + timedelta(seconds=10))
        assert [r.run_id for r in report.expired] == [run_id]

        async def attempt_stopped() -> bool:
            return run_id not in worker.slots.live

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
        original = worker.completer.write

        async def held(final: Finish) -> FinishStatus:
            await gate.wait()  # the final write is under way when the stop comes
            return await original(final)

        worker.completer.write = held  # type: ignore[method-assign]
        run_id = await submit(url, "echo", {"x": 1})

        async def finishing() -> bool:
            live = worker.slots.live.get(run_id)
            return live is not None and live.finishing

        await eventually(finishing)
        asyncio.get_running_loop().call_later(0.3, gate.set)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
        attempts = await runs.attempts(conn, run_id)
    assert run.state == "succeeded"
    assert [a.outcome for a in attempts] == ["succeeded"]
