"""A blip is absorbed inside the attempt (docs/design.md, section 11c): a connection the
database cuts under a running attempt (an administrator's pg_terminate_backend, a
failover, a pooler's reconnect) costs the play nothing but time. Its ``ctx`` calls are
sent again on a new connection; the attempt goes on, its paid step runs once, and the run
succeeds in one attempt.

What is not absorbed (a call that is not repeatable, an outage past ``max_outage_s``) is
``tests/unit/test_absorbing.py``'s.

Interleavings are forced with gates, not timing: the play holds inside its step (or
between two calls) until the test has cut every connection of the worker and seen them
gone.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from queues import lanes
from tests.integration.test_runtime_fence import HOOKS_DDL
from tests.workers import eventually, fetch, run_state, running_worker, submit
from worker import instruments
from worker.context import RunContext
from worker.plays import Registry, load_registry


@pytest.fixture
async def url(db_url: str) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(HOOKS_DDL)  # test_paid among them
        await lanes.prepare(conn, "t")
    return db_url


class Gates:
    """The play tells it reached a point (``reached``) and waits until the test opens it."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()

    async def hold(self) -> None:
        self.reached.set()
        await self.opened.wait()


def plays(url: str, gates: Gates) -> Registry:
    registry = Registry()

    async def pay(ctx: RunContext, key: str) -> str:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as own:
            await own.execute(
                "INSERT INTO test_paid (run_id, key, attempt) VALUES (%s, %s, %s)",
                (ctx.run_id, key, ctx.attempt),
            )
        return key

    @registry.play("paid-through-a-blip")
    async def paid_through_a_blip(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        async def charge() -> str:
            paid = await pay(ctx, "charge")
            await gates.hold()  # the connections are cut here; the receipt comes next
            return paid

        first = await ctx.step("charge", charge)
        second = await ctx.step("after", pay, ctx, "after")
        return {"steps": [first, second], "attempt": ctx.attempt}

    return registry


async def cut_every_connection(url: str) -> int:
    """Terminate every other backend of the test's database (the worker's pool, its
    heartbeat, its LISTEN session) and wait until they are gone."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT coalesce(array_agg(pid), '{}') FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            "   AND backend_type = 'client backend'"
        )
        row = await cur.fetchone()
        assert row is not None
        pids: list[int] = list(row[0])
        await conn.execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) AS p", (pids,))

        async def gone() -> bool:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            )
            left = await cur.fetchone()
            return left is not None and left[0] == 0

        await eventually(gone, timeout=10)
        return len(pids)


async def outcomes_of(url: str, run_id: uuid.UUID) -> list[str]:
    rows = await fetch(
        url, "SELECT outcome FROM wq_attempts WHERE run_id = %s ORDER BY attempt", (run_id,)
    )
    return [str(o) for (o,) in rows]


async def paid(url: str, run_id: uuid.UUID) -> list[tuple[str, int]]:
    rows = await fetch(
        url, "SELECT key, attempt FROM test_paid WHERE run_id = %s ORDER BY key", (run_id,)
    )
    return [(str(k), int(a)) for k, a in rows]


async def test_a_cut_connection_under_a_step_costs_the_attempt_nothing(url: str) -> None:
    gates = Gates()
    with capture_logs() as logs:
        async with running_worker(url, plays(url, gates)):
            run_id = await submit(url, "paid-through-a-blip")
            await asyncio.wait_for(gates.reached.wait(), timeout=30)
            assert await cut_every_connection(url) >= 1  # the attempt's own among them
            gates.opened.set()

            async def ended() -> bool:
                return await run_state(url, run_id) in ("succeeded", "failed", "queued")

            await eventually(ended, timeout=30)
            assert await run_state(url, run_id) == "succeeded"
    # One attempt; each paid call made once; the receipt's write went through the blip.
    assert await outcomes_of(url, run_id) == ["succeeded"]
    assert await paid(url, run_id) == [("after", 1), ("charge", 1)]
    absorbed = [e for e in logs if e["event"] == "call_absorbed"]
    assert absorbed, [e["event"] for e in logs]
    assert absorbed[0]["action"] == "runtime_receipt_record"


async def test_a_sandboxed_play_rides_a_cut_through_the_gateway(url: str) -> None:
    """The same through the gateway: its call meets a dead pooled connection, answers
    DATABASE_UNREACHABLE (checking its pool), and the sandbox sends the call again."""
    registry = load_registry("tests.apps.scheduling_sandboxed:registry")
    before = absorbed_total()
    steps = 60
    async with running_worker(url, registry, token_secret=b"s" * 48):
        run_id = await submit(url, "sandboxed-many-steps", {"steps": steps})

        async def under_way() -> bool:
            rows = await fetch(
                url,
                "SELECT count(*) FROM wq_receipts WHERE owner_run = %s AND status = 'completed'",
                (run_id,),
            )
            return int(rows[0][0]) >= 10

        await eventually(under_way, timeout=60, interval=0.05)
        assert await cut_every_connection(url) >= 1

        async def ended() -> bool:
            return await run_state(url, run_id) in ("succeeded", "failed", "queued")

        await eventually(ended, timeout=60)
        assert await run_state(url, run_id) == "succeeded"
    assert await outcomes_of(url, run_id) == ["succeeded"]
    receipts = await fetch(url, "SELECT count(*) FROM wq_receipts WHERE owner_run = %s", (run_id,))
    assert int(receipts[0][0]) == steps
    assert absorbed_total() > before  # the sandbox reported the calls it sent again


def absorbed_total() -> float:
    return sum(
        sample.value
        for metric in instruments.ABSORBED_CALLS.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
