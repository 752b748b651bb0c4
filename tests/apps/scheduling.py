"""Plays for the tests of issue 14's features: per-run options, shared rate limits, child
runs (``tests/integration/test_scheduling_*.py``, ``tests/e2e/test_rate_limit.py``,
``tests/e2e/test_child_kill.py``).

What a play records for its test (permit times, hold intervals, marks) goes into the test's
database through a connection of its own (``SCHEDULING_TEST_URL``), never the worker's:
``permits`` holds one row per permit (``at``: the database's time of the grant, as
``ctx.limit`` reports it; ``started``/``ended``: the play's own clock readings of the
database inside the permit's block). ``marks`` and ``releases`` are a rendezvous, as in
``tests/apps/zombie.py``: attempt 1 of ``parent`` with ``rendezvous`` set marks
``spawned`` after its spawn and waits there until the test releases it (or kills it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from queues import lanes
from worker.context import ChildFailed, RunContext, WaitTimedOut
from worker.plays import Fatal, Registry

registry = Registry()

URL_ENV = "SCHEDULING_TEST_URL"
DDL = """
CREATE TABLE IF NOT EXISTS permits (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id  uuid NOT NULL,
    key     text NOT NULL,
    at      timestamptz NOT NULL,
    started timestamptz,
    ended   timestamptz
);
CREATE TABLE IF NOT EXISTS marks (
    run_id  uuid NOT NULL,
    attempt integer NOT NULL,
    mark    text NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS releases (run_id uuid PRIMARY KEY)
"""


async def prepare(url: str, release: str) -> None:
    """Create the tables these plays record into and prepare ``release``'s lane."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(DDL)
        await lanes.prepare(conn, release)


async def _own() -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(os.environ[URL_ENV], autocommit=True)


async def mark(ctx: RunContext, name: str) -> None:
    async with await _own() as own:
        await own.execute(
            "INSERT INTO marks (run_id, attempt, mark) VALUES (%s, %s, %s)",
            (ctx.run_id, ctx.attempt, name),
        )


@registry.play("limited")
async def limited(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Takes ``n`` permits of ``key``, one after the other; records each grant's time."""
    async with await _own() as own:
        for _ in range(int(params.get("n", 1))):
            async with ctx.limit(params["key"]) as permit:
                await own.execute(
                    "INSERT INTO permits (run_id, key, at) VALUES (%s, %s, %s)",
                    (ctx.run_id, permit.key, permit.at),
                )
    return {"permits": int(params.get("n", 1))}


@registry.play("capped")
async def capped(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Holds one permit of ``key`` for ``hold`` seconds; records the interval it held it,
    read from the database's clock inside the block (within the real hold)."""
    async with await _own() as own:
        async with ctx.limit(params["key"], hand_back_after=float(params.get("hand_back", 30))):
            cur = await own.execute("SELECT clock_timestamp()")
            started = (await cur.fetchone() or [None])[0]
            await asyncio.sleep(float(params.get("hold", 0.1)))
            cur = await own.execute("SELECT clock_timestamp()")
            ended = (await cur.fetchone() or [None])[0]
        await own.execute(
            "INSERT INTO permits (run_id, key, at, started, ended) VALUES (%s, %s, %s, %s, %s)",
            (ctx.run_id, params["key"], started, started, ended),
        )
    return {"attempt": ctx.attempt}


@registry.play("parent")
async def parent(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Spawns a ``child`` and waits for it; reports what it got."""
    child = await ctx.spawn(
        "child",
        {
            "value": params.get("value", 21),
            "fail": params.get("fail", False),
            "sleep": params.get("child_sleep", 0.2),
        },
        max_attempts=3,  # a child whose worker is killed is retried (a failure is Fatal)
        retry="fixed:0s",
        meta={"by": "parent"},
    )
    if params.get("rendezvous") and ctx.attempt == 1:
        await mark(ctx, "spawned")
        async with await _own() as own:
            while True:  # until the test releases it, or kills its worker
                cur = await own.execute("SELECT 1 FROM releases WHERE run_id = %s", (ctx.run_id,))
                if await cur.fetchone():
                    break
                await asyncio.sleep(0.02)
    try:
        result = await ctx.wait_for_run(child, timeout=params.get("timeout"))
    except ChildFailed as failed:
        return {"child": str(child), "failed": failed.state, "attempt": ctx.attempt}
    except WaitTimedOut:
        return {"child": str(child), "timed_out": True, "attempt": ctx.attempt}
    return {"child": str(child), "result": result, "attempt": ctx.attempt}


@registry.play("child")
async def child(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(float(params.get("sleep", 0.2)))
    if params.get("fail"):
        raise Fatal("the child fails on purpose")
    return {"doubled": int(params["value"]) * 2, "meta": ctx.meta}


@registry.play("slow")
async def slow(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Sleeps ``seconds`` in the worker (a run timeout stops it), or durably (``durable``)."""
    if params.get("durable"):
        await ctx.sleep(float(params["seconds"]))
    else:
        await asyncio.sleep(float(params["seconds"]))
    return {"slept": params["seconds"]}


@registry.play("flaky")
async def flaky(ctx: RunContext, params: dict[str, Any]) -> None:
    raise RuntimeError(f"attempt {ctx.attempt} fails")


@registry.play("quick")
async def quick(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(float(params.get("seconds", 0.05)))
    return {"org": ctx.info.org}
