"""The worker's side of the fence, with a real in-process worker and real Postgres.

- Cancel is final: a success or failure reported after a cancel request becomes
  ``cancelled`` after the cleanup hooks ran; a cancel that the attempt did not hear before
  it suspended on an event still ends the run; a cancel with a lapsed lease runs the
  cleanup once, in a cleanup-only attempt; a repeated cancel is harmless.
- Blocking code cannot starve the heartbeat: a synchronous step body runs in a thread, and
  even code that blocks the event loop keeps its lease (and is reported as loop lag).
- Interrupted is not failed: an attempt whose database connection is killed is retried
  without spending the retry budget.

Interleavings are forced, never left to timing: a final write is held at a gate, the
worker's claims are held at one, or the worker is made deaf to a cancel, and the test
moves on only once the database (or the worker) shows the state it needs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from queues import lanes, recovery, runs
from queues.outcomes import Finish, FinishStatus
from tests import ledgers
from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker.context import RunContext
from worker.plays import Registry
from worker.runtime import Worker

Conn = psycopg.AsyncConnection[Any]

# The lease of the blocking-code tests: blocking code runs for a multiple of it, so an
# unrenewed lease would lapse under it. A renewal every eighth of it leaves the heartbeat
# thread most of a TTL of slack on a loaded machine (and a refused renewal is heard soon).
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.25

HOOKS_DDL = """
CREATE TABLE IF NOT EXISTS test_hooks (
    run_id  uuid NOT NULL,
    attempt integer NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS test_paid (
    run_id  uuid NOT NULL,
    key     text NOT NULL,
    attempt integer NOT NULL
)
"""


@pytest.fixture
async def url(db_url: str) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(HOOKS_DDL)
    return db_url


def plays(url: str) -> Registry:
    """Plays that record their side effects through their own connection (as an app's
    plays would), never the worker's."""
    registry = Registry()

    async def record_hook(ctx: RunContext) -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as own:
            await own.execute(
                "INSERT INTO test_hooks (run_id, attempt) VALUES (%s, %s)",
                (ctx.run_id, ctx.attempt),
            )

    @registry.play("quick", on_cancel=record_hook)
    async def quick(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("fail"):
            raise RuntimeError("late failure")
        return {"done": ctx.attempt}

    @registry.play("wait-forever", on_cancel=record_hook)
    async def wait_forever(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        got = await ctx.wait_for_event("never-comes")
        return {"received": got.received}

    @registry.play("hang", on_cancel=record_hook)
    async def hang(ctx: RunContext, params: dict[str, Any]) -> None:
        await asyncio.Event().wait()

    def paid_call(run_id: uuid.UUID, attempt: int, seconds: float) -> dict[str, Any]:
        time.sleep(seconds)  # a blocking client library
        with psycopg.connect(url, autocommit=True) as own:
            own.execute(
                "INSERT INTO test_paid (run_id, key, attempt) VALUES (%s, 'model', %s)",
                (run_id, attempt),
            )
        return {"paid_by": attempt}

    @registry.play("blocking-step")
    async def blocking_step(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        # A plain (synchronous) function: the step runs it in a worker thread.
        paid = await ctx.step("load-model", paid_call, ctx.run_id, ctx.attempt, params["s"])
        return {"paid": paid, "attempt": ctx.attempt}

    @registry.play("blocks-the-loop")
    async def blocks_the_loop(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        time.sleep(params["s"])  # wrong, but it happens: the event loop itself is blocked
        return {"attempt": ctx.attempt}

    @registry.play("loses-its-connection")
    async def loses_its_connection(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        if ctx.attempt == 1:
            # The database kills this play's connection under it (an administrator's
            # pg_terminate_backend, a failover): psycopg raises AdminShutdown.
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as own:
                await own.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return {"attempt": ctx.attempt}

    return registry


async def hooks(url: str, run_id: uuid.UUID) -> list[int]:
    rows = await fetch(
        url, "SELECT attempt FROM test_hooks WHERE run_id = %s ORDER BY at", (run_id,)
    )
    return [int(a) for (a,) in rows]


async def outcomes_of(url: str, run_id: uuid.UUID) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return [a.outcome for a in await runs.attempts(conn, run_id)]


async def cancel(url: str, run_id: uuid.UUID, **kw: Any) -> runs.CancelResult:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await runs.cancel(conn, run_id, **kw)


def hold_final_writes(worker: Worker) -> asyncio.Event:
    """Hold every final write of the worker at a gate (the play is done, its write waits)."""
    gate = asyncio.Event()
    original = worker.completer.write

    async def held(final: Finish) -> FinishStatus:
        await gate.wait()
        return await original(final)

    worker.completer.write = held  # type: ignore[method-assign]
    return gate


def deaf_to_cancel(worker: Worker) -> None:
    """The worker never hears a cancel (a lost NOTIFY and a missed heartbeat flag): only
    the fenced final write can learn of it."""
    original = worker.leases.stop

    def stop_run(live: Any, reason: str) -> None:
        if reason != "cancel":
            original(live, reason)

    worker.leases.stop = stop_run  # type: ignore[method-assign]


# ---- cancel is final ----------------------------------------------------------------------


@pytest.mark.parametrize("fail", [False, True], ids=["late-success", "late-failure"])
async def test_an_outcome_reported_after_a_cancel_becomes_cancelled(url: str, fail: bool) -> None:
    async with running_worker(url, plays(url)) as worker:
        gate = hold_final_writes(worker)
        run_id = await submit(url, "quick", {"fail": fail})

        async def finishing() -> bool:
            live = worker.slots.live.get(run_id)
            return live is not None and live.finishing

        await eventually(finishing)  # the play returned (or raised); its write waits
        asked = await cancel(url, run_id, reason="too late?")
        assert (asked.before, asked.after) == ("running", "running")
        gate.set()
        assert await eventually(lambda: _terminal(url, run_id)) == "cancelled"
    assert await hooks(url, run_id) == [1]  # the cleanup ran, once, before the final write
    assert await outcomes_of(url, run_id) == ["cancelled"]
    ((hook_at, finished_at),) = await fetch(
        url,
        "SELECT (SELECT max(at) FROM test_hooks WHERE run_id = %(r)s), finished_at"
        " FROM wq_runs WHERE id = %(r)s",
        {"r": run_id},
    )
    assert hook_at < finished_at


async def test_a_cancel_unheard_before_an_event_wait_still_ends_the_run(url: str) -> None:
    registry = plays(url)
    gate = asyncio.Event()

    async def record_hook(ctx: RunContext) -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as own:
            await own.execute(
                "INSERT INTO test_hooks (run_id, attempt) VALUES (%s, %s)",
                (ctx.run_id, ctx.attempt),
            )

    @registry.play("gated-wait", on_cancel=record_hook)
    async def gated_wait(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        await gate.wait()
        got = await ctx.wait_for_event("never-comes")  # no timeout
        return {"received": got.received}

    async with running_worker(url, registry) as worker:
        deaf_to_cancel(worker)
        run_id = await submit(url, "gated-wait")
        await eventually(lambda: _is(url, run_id, "running"))
        # The cancel lands while the play is on its way to the wait; the worker does not
        # hear it. The suspension is refused (a cancel is pending), the hooks run, and the
        # run ends cancelled: it is not left sleeping for good.
        asked = await cancel(url, run_id, reason="stop waiting")
        assert (asked.before, asked.after) == ("running", "running")
        gate.set()
        assert await eventually(lambda: _terminal(url, run_id)) == "cancelled"
    assert await hooks(url, run_id) == [1]
    assert await outcomes_of(url, run_id) == ["cancelled"]
    kinds = await ledgers.kinds(url, run_id)
    assert "run_waiting" not in kinds  # the refused suspension wrote nothing
    # A second cancel of the finished run changes nothing.
    again = await cancel(url, run_id)
    assert (again.before, again.changed) == ("cancelled", False)


async def test_a_forced_cancel_ends_a_hanging_run_and_fences_its_attempt(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", heartbeat_s=HEARTBEAT_S)  # the refusal comes sooner
    async with running_worker(url, plays(url)) as worker:
        deaf_to_cancel(worker)
        run_id = await submit(url, "hang")
        await eventually(lambda: _is(url, run_id, "running"))
        await cancel(url, run_id)  # unheard: the play hangs on
        forced = await cancel(url, run_id, force=True)
        assert (forced.before, forced.after) == ("running", "cancelled")

        async def stopped() -> bool:
            return run_id not in worker.slots.live  # its next heartbeat was refused

        await eventually(stopped)
    assert await hooks(url, run_id) == []  # forced: no cleanup
    assert await outcomes_of(url, run_id) == ["cancelled"]
    assert await run_state(url, run_id) == "cancelled"


async def test_a_sleeping_waiter_is_cancelled_at_once_and_a_second_cancel_is_harmless(
    url: str,
) -> None:
    async with running_worker(url, plays(url)):
        run_id = await submit(url, "wait-forever")
        await eventually(lambda: _is(url, run_id, "sleeping"))
        first = await cancel(url, run_id)
        second = await cancel(url, run_id)
    assert (first.before, first.after, first.changed) == ("sleeping", "cancelled", True)
    assert (second.before, second.after, second.changed) == ("cancelled", "cancelled", False)
    assert await outcomes_of(url, run_id) == ["suspended"]


class ClaimGate:
    """Holds every claim of the worker (:func:`queues.runs.claim`, the runtime's one call
    to claim) while closed; a claim under way when it closes is waited for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = asyncio.Event()
        self.opened.set()
        self.under_way = 0
        real_claim = runs.claim

        async def claim(conn: Any, **kwargs: Any) -> Any:
            while not self.opened.is_set():  # (woken, it may have closed again meanwhile)
                await self.opened.wait()
            self.under_way += 1
            try:
                return await real_claim(conn, **kwargs)
            finally:
                self.under_way -= 1

        monkeypatch.setattr(runs, "claim", claim)

    async def close(self) -> None:
        """Close it; return once no claim is under way."""
        self.opened.clear()

        async def idle() -> bool:
            return self.under_way == 0

        await eventually(idle, interval=0.01)

    def open(self) -> None:
        self.opened.set()


@pytest.mark.slow
async def test_a_cancel_with_a_lapsed_lease_runs_the_cleanup_once(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=3.0, heartbeat_s=0.5)
    registry = plays(url)
    claims = ClaimGate(monkeypatch)
    async with running_worker(url, registry) as first:
        deaf_to_cancel(first)
        run_id = await submit(url, "hang")
        await eventually(lambda: _is(url, run_id, "running"))
        await cancel(url, run_id, reason="stop")
        await cancel(url, run_id, reason="stop again")  # repeated: harmless
        # The attempt's worker "dies": its lease lapses (as if the worker had been silent
        # past it) and a pass at the database clock takes it, in one transaction, so no
        # renewal of the live worker lands in between (the renewal waits for the run's row,
        # then finds attempt 1 closed). The run gets a cleanup-only attempt, due at once;
        # the first worker claims it only once its attempt 1 was stopped unwritten (its
        # renewal refused), as a worker that had really been silent would have dropped it.
        await claims.close()
        async with (
            await psycopg.AsyncConnection.connect(url, autocommit=True) as conn,
            conn.transaction(),
        ):
            await conn.execute(
                "UPDATE wq_runs SET lease_expires_at = now() - interval '1 second'"
                " WHERE id = %s AND state = 'running' AND attempt = 1",
                (run_id,),
            )
            report = await recovery.run_once(conn)
        assert [(r.run_id, r.state) for r in report.expired] == [(run_id, "queued")]

        async def attempt_1_stopped() -> bool:
            return run_id not in first.slots.live

        await eventually(attempt_1_stopped)
        claims.open()
        assert await eventually(lambda: _terminal(url, run_id)) == "cancelled"
    assert await outcomes_of(url, run_id) == ["lease_expired", "cancelled"]
    assert await hooks(url, run_id) == [2]  # once, by the cleanup-only attempt
    kinds = await ledgers.kinds(url, run_id)
    assert "cleanup_started" in kinds and kinds[-1] == "run_cancelled"


# ---- blocking code -------------------------------------------------------------------------


async def test_a_blocking_step_longer_than_the_lease_runs_once_and_is_recorded_once(
    url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=LEASE_TTL_S, heartbeat_s=HEARTBEAT_S)
    async with running_worker(url, plays(url)):
        run_id = await submit(url, "blocking-step", {"s": 2 * LEASE_TTL_S})
        # Recovery passes keep running while the step blocks (several within the second
        # TTL of the step, when an unrenewed lease would have lapsed): none may rescue it.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:

            async def done_without_rescue() -> str | None:
                report = await recovery.run_once(conn)
                assert report.expired == (), "a blocking step cost its run the lease"
                return await _terminal(url, run_id)

            assert await eventually(done_without_rescue, timeout=30, interval=0.25) == "succeeded"
    assert await fetch(url, "SELECT attempt FROM test_paid WHERE run_id = %s", (run_id,)) == [(1,)]
    receipts_ = await fetch(
        url,
        "SELECT status::text, owner_attempt FROM wq_receipts WHERE scope = %s",
        (f"run:{run_id}",),
    )
    assert receipts_ == [("completed", 1)]
    assert await outcomes_of(url, run_id) == ["succeeded"]


async def test_code_that_blocks_the_event_loop_keeps_its_lease_and_is_reported(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=LEASE_TTL_S, heartbeat_s=HEARTBEAT_S)
    with capture_logs() as logs:
        async with running_worker(url, plays(url)):
            # Blocked well past the lease (and past the lag warning's second).
            run_id = await submit(url, "blocks-the-loop", {"s": 1.75 * LEASE_TTL_S})
            assert await eventually(lambda: _terminal(url, run_id), timeout=30) == "succeeded"
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                assert (await recovery.run_once(conn)).expired == ()
    assert await outcomes_of(url, run_id) == ["succeeded"]  # never rescued, one attempt
    blocked = [e for e in logs if e["event"] == "event_loop_blocked"]
    assert blocked and blocked[0]["log_level"] == "warning"
    assert any(r["play"] == "blocks-the-loop" for r in blocked[0]["running"])
    assert any(e["event"] == "event_loop_unblocked" for e in logs)


# ---- interruptions -------------------------------------------------------------------------


async def test_a_killed_connection_interrupts_the_attempt_without_spending_the_budget(
    url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        # One attempt allowed: a failure would end the run. An interruption must not.
        await lanes.set_policy(conn, "t", retry_max_attempts=1)
    # The retry is due about a second after the interruption, with no wake-up: a short
    # poll claims it soon after.
    async with running_worker(url, plays(url), poll_s=0.2):
        run_id = await submit(url, "loses-its-connection")
        assert await eventually(lambda: _terminal(url, run_id), timeout=20) == "succeeded"
    assert await outcomes_of(url, run_id) == ["interrupted", "succeeded"]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    assert run.result == {"attempt": 2}
    kinds = await ledgers.kinds(url, run_id)
    assert "run_interrupted" in kinds and "retry_scheduled" not in kinds


async def _terminal(url: str, run_id: uuid.UUID) -> str | None:
    state = await run_state(url, run_id)
    return state if state in {"succeeded", "failed", "cancelled"} else None


async def _is(url: str, run_id: uuid.UUID, state: str) -> bool:
    return await run_state(url, run_id) == state
