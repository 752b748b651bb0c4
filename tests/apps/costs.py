"""Plays that pay for their work, for the budget tests (``tests/e2e/test_budgets.py``).

Run the worker with ``--app tests.apps.costs:registry`` and ``COSTS_DB_URL`` naming the
test's database: every paid call is recorded there (``cost_calls``: run, key, attempt)
through a connection of the play's own, before its receipt is written, so the test sees
each execution, including one whose attempt died before its receipt.

- ``metered``: the run's input rows, page by page; each row a row step (``row:<key>``)
  that reserves 1 credit (``ctx.reserve_steps``), makes its paid call, charges 1 credit
  (``ctx.charge(..., step=)``) and is recorded with its page (``ctx.complete_steps``).
  When the budget has room for part of a page only, that part runs; the next reservation
  pauses the run.
- ``small``: ``params["steps"]`` steps, each ``ctx.step(..., cost=1)`` whose body makes
  its paid call, sleeps ``params["delay_s"]`` and charges 1 credit.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from worker.context import RunContext
from worker.plays import Fatal, Registry

registry = Registry()
URL_ENV = "COSTS_DB_URL"

COSTS_DDL = """
CREATE TABLE IF NOT EXISTS cost_calls (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id  uuid NOT NULL,
    key     text NOT NULL,
    attempt integer NOT NULL
)
"""


async def paid_calls(ctx: RunContext, keys: list[str]) -> None:
    """The paid calls of ``keys``: recorded in the test's database, as a provider would."""
    url = os.environ.get(URL_ENV)
    if not url:
        raise Fatal(f"{URL_ENV} is not set: the paid calls are recorded in that database")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as own:
        await own.execute(
            "INSERT INTO cost_calls (run_id, key, attempt) "
            "SELECT %s, k, %s FROM unnest(%s::text[]) AS k",
            (ctx.run_id, ctx.attempt, keys),
        )


@registry.play("metered")
async def metered(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    paid = replayed = 0
    async for page in ctx.input_pages():
        keys = [f"row:{key}" for key, _ in page]
        done = await ctx.steps_done(keys)
        replayed += len(done)
        todo = [k for k in keys if k not in done]
        while todo:
            go = await ctx.reserve_steps(todo, cost=1)  # pauses the run when none fits
            await paid_calls(ctx, go)
            for key in go:
                ctx.charge(1, provider="meter", step=key)
            await ctx.complete_steps([(key, {"paid": key}) for key in go])
            paid += len(go)
            todo = todo[len(go) :]
    return {"paid": paid, "replayed": replayed}


@registry.play("small")
async def small(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    delay = float(params.get("delay_s") or 0)

    def call(key: str) -> Any:
        async def body() -> dict[str, str]:
            await paid_calls(ctx, [key])
            await asyncio.sleep(delay)
            ctx.charge(1, provider="meter")
            return {"paid": key}

        return body

    results = [await ctx.step(f"s{i}", call(f"s{i}"), cost=1) for i in range(params["steps"])]
    return {"steps": len(results)}
