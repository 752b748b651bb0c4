"""Test plays for subprocess workers: ``worker start --app tests.apps.plays:registry``.

Run the subprocess with ``PYTHONPATH`` holding the repository root so ``tests`` imports.
"""

from __future__ import annotations

import asyncio
from typing import Any

from worker.context import RunContext
from worker.plays import Registry

registry = Registry()

SLOW_S = 30.0


@registry.play("slow")
async def slow(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Blocks for 30 s on its first attempt (long enough to be handed back); later ones return.
    Its ledger says when the play began (``play.began``): a run's state is ``running`` from
    its claim, before the play itself runs."""
    await ctx.log_event("began")
    if ctx.attempt <= 1:
        await asyncio.sleep(float(params.get("seconds", SLOW_S)))
    return {"attempt": ctx.attempt, "worker": ctx.info.worker_id}


@registry.play("echo")
async def echo(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Returns its params and attempt."""
    return {"params": params, "attempt": ctx.attempt}


@registry.play("boom")
async def boom(ctx: RunContext, params: dict[str, Any]) -> None:
    """Always fails (a retryable error)."""
    raise RuntimeError(f"boom on attempt {ctx.attempt}")


@registry.play("unstorable")
async def unstorable(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Returns a value Postgres cannot store (NUL, a lone surrogate or NaN, per params)."""
    kind = params.get("kind", "nul")
    value: Any = {"nul": "a\x00b", "surrogate": "\ud800", "nan": float("nan")}[kind]
    return {"value": value}
