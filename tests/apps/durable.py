"""Plays for the durable-execution tests (steps, sleep, events, crash and resume).

Side effects are counted in ``test_side_effects``, so a test can prove a completed step
never ran again. Like any app's plays, they write their own data through a connection the
app configures itself (``TEST_SIDE_EFFECTS_URL``), never through the worker's.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from queues import sheets
from worker.context import RunContext, Sheet
from worker.plays import Registry

registry = Registry()

SIDE_EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS test_side_effects (
    run_id  uuid NOT NULL,
    key     text NOT NULL,
    attempt integer NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def own_database() -> str:
    """The app's own database (a play holds no connection of the worker's)."""
    return os.environ["TEST_SIDE_EFFECTS_URL"]


async def side_effect(ctx: RunContext, key: str) -> None:
    async with await psycopg.AsyncConnection.connect(own_database(), autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO test_side_effects (run_id, key, attempt) VALUES (%s, %s, %s)",
            (ctx.run_id, key, ctx.attempt),
        )


@registry.play("sleeper")
async def sleeper(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """A step, a durable sleep, another step."""

    async def before() -> str:
        await side_effect(ctx, "before")
        return "b"

    async def after() -> str:
        await side_effect(ctx, "after")
        return "a"

    first = await ctx.step("before", before)
    await ctx.sleep(float(params.get("seconds", 0.5)))
    second = await ctx.step("after", after)
    return {"first": first, "second": second, "attempt": ctx.attempt}


@registry.play("waiter")
async def waiter(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Waits for an event, then records one side effect."""
    got = await ctx.wait_for_event(str(params["event"]), timeout=params.get("timeout"))

    async def woke() -> None:
        await side_effect(ctx, "woke" if got.received else "timed_out")

    await ctx.step("woke", woke)
    return {"received": got.received, "payload": got.payload}


@registry.play("paid-rows")
async def paid_rows(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit input rows in chunks; one paid side effect per row, recorded as a step.

    Per chunk: already paid rows come back from receipts; each new row's side effect is
    recorded before its receipt (so a crash between the two re-runs only in-flight rows).
    """
    sheet = ctx.sheet(str(params.get("sheet", f"s-{ctx.run_id}")))
    delay = float(params.get("chunk_delay_s", 0))
    chunk = int(params.get("chunk", 1000))
    stats = {"paid": 0, "replayed": 0, "terminal": 0}
    async for page in ctx.input_pages():
        for start in range(0, len(page), chunk):
            await _paid_chunk(ctx, sheet, page[start : start + chunk], stats)
            if delay:
                await asyncio.sleep(delay)
    return stats | {"write_version": sheet.write_version, "attempt": ctx.attempt}


async def _paid_chunk(
    ctx: RunContext, sheet: Sheet, rows: list[tuple[str, Any]], stats: dict[str, int]
) -> None:
    admission = await sheet.admit(rows)
    open_keys = {
        r.key
        for r in admission.rows
        if r.disposition
        in (
            sheets.Disposition.ADMITTED,
            sheets.Disposition.READMITTED,
            sheets.Disposition.ALREADY_CURRENT,
        )
    }
    stats["terminal"] += len(rows) - len(open_keys)
    keys = [f"row:{key}" for key, _ in rows if key in open_keys]
    paid = await ctx.steps_done(keys)
    fresh = [k for k in keys if k not in paid]
    if fresh:
        async with await psycopg.AsyncConnection.connect(own_database(), autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO test_side_effects (run_id, key, attempt) "
                "SELECT %s, k, %s FROM unnest(%s::text[]) AS k",
                (ctx.run_id, ctx.attempt, fresh),
            )
        await ctx.complete_steps([(k, {"v": k}) for k in fresh])
    stats["paid"] += len(fresh)
    stats["replayed"] += len(keys) - len(fresh)
    if keys:
        await sheet.complete(
            [sheets.RowCompletion(key=k.removeprefix("row:"), output={"v": k}) for k in keys]
        )


@registry.play("skipper")
async def skipper(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Attempt 1 skips a step and fails; attempt 2 reaches the same step, which replays
    as skipped (None) without running."""

    async def paid() -> str:
        await side_effect(ctx, "optional")
        return "ran"

    if ctx.attempt == 1:
        assert await ctx.skip("optional")
        raise RuntimeError("fail once after the skip")
    return {"replayed": await ctx.step("optional", paid)}
