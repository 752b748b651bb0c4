"""Plays for the scale-out tests (PgBouncer, the connection budget, a host cut off).

``worker start --app tests.apps.hosts:registry`` (with the repository root on
``PYTHONPATH``), or in-process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from queues import sheets
from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


@registry.play("io")
async def io(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """An IO-bound run: waits (an API call), then records one step."""
    await asyncio.sleep(float(params.get("sleep_s", 0.05)))

    async def paid() -> str:
        return "paid"

    return {"step": await ctx.step("call", paid), "worker": ctx.info.worker_id}


@registry.play("busy")
async def busy(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Many statements of each kind on the worker's connections (steps, a sheet page
    admitted and completed, an event), so psycopg would prepare them server-side after
    five executions on one connection if it were allowed to."""
    total = 0
    for i in range(int(params.get("steps", 8))):

        async def step(n: int = i) -> int:
            return n

        total += await ctx.step(f"s{i}", step)
    sheet = ctx.sheet(f"rows-{ctx.run_id}")
    rows = [(f"k{i}", {"n": i}) for i in range(int(params.get("rows", 5)))]
    await sheet.admit(rows, stable_intent=True)
    done = await sheet.complete([sheets.RowCompletion(key=k, output=v) for k, v in rows])
    await ctx.emit("busy-done", {"run": str(ctx.run_id)})
    return {"total": total, "committed": len(done.committed), "worker": ctx.info.worker_id}


@registry.play("late-writer")
async def late_writer(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Records a step, waits ``sleep_s`` (the host may be cut off meanwhile), then returns.

    On the worker named by ``hold_on`` it also waits until the file ``hold_until`` exists,
    sleep and wait through every stop the runtime orders meanwhile (its lease lapsed while
    the host was cut off), like code that does not notice it was told to stop: its final
    write is sent once the test has brought the link back, so it reaches the database,
    late, every time.
    """

    async def first() -> str:
        return "first"

    async def body(hold: Path | None) -> None:
        await ctx.step("first", first)
        await asyncio.sleep(float(params.get("sleep_s", 2.0)))
        if hold is not None:
            async with asyncio.timeout(120):
                while not hold.exists():
                    await asyncio.sleep(0.05)

    hold_until = params.get("hold_until")
    if hold_until and ctx.info.worker_id == params.get("hold_on"):
        # The step may be in flight when the link goes: its error, if any, is the late
        # write then (the attempt's failure), sent once the link is back.
        await _through_stops(body(Path(str(hold_until))))
    else:
        await body(None)
    return {"attempt": ctx.attempt, "worker": ctx.info.worker_id}


async def _through_stops(work: Awaitable[None]) -> None:
    """Await ``work`` to its end, absorbing every cancel of this task meanwhile."""
    inner = asyncio.ensure_future(work)
    while True:
        try:
            await asyncio.shield(inner)
            return
        except asyncio.CancelledError:
            if inner.cancelled():
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
