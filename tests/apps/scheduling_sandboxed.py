"""A sandboxed play using issue 14's run context through the runtime gateway: a permit of
a shared limit, a child run it spawns and waits for (``worker start --app
tests.apps.scheduling_sandboxed:registry``)."""

from __future__ import annotations

import asyncio
from typing import Any

from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


@registry.play("sandboxed-parent", sandboxed=True, may_spawn=["plain-child"], limits=["sbx"])
async def sandboxed_parent(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    async with ctx.limit("sbx") as permit:
        granted = permit.at.isoformat()
    child = await ctx.spawn("plain-child", {"value": 3}, max_attempts=2, meta=ctx.meta)
    result = await ctx.wait_for_run(child)
    return {"granted": granted, "child": str(child), "result": result}


@registry.play("plain-child")
async def plain_child(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"tripled": int(params["value"]) * 3, "meta": ctx.meta}


@registry.play("sandboxed-keys", sandboxed=True)
async def sandboxed_keys(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """The idempotency keys a sandboxed play hands its providers (tests/integration/
    test_idempotency_keys.py compares them with the worker's)."""

    def in_body() -> str:
        return ctx.step_idempotency_key

    return {"named": ctx.idempotency_key("charge"), "in_step": await ctx.step("charge", in_body)}


@registry.play("sandboxed-many-steps", sandboxed=True)
async def sandboxed_many_steps(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Steps one after another, paced, so a cut of the database's connections lands
    between two of them (tests/integration/test_blips.py)."""

    async def one(i: int) -> int:
        await asyncio.sleep(0.02)
        return i

    done = [await ctx.step(f"s{i}", one, i) for i in range(int(params["steps"]))]
    return {"steps": len(done), "attempt": ctx.attempt}
