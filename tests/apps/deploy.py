"""Plays for the rolling-deploy test: each records which release the worker that executed
it was started with (``DEPLOY_RELEASE``, set per worker process by the test)."""

from __future__ import annotations

import os
from typing import Any

from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


def executed_by() -> str:
    return os.environ.get("DEPLOY_RELEASE", "?")


@registry.play("work")
async def work(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"executed_by": executed_by(), "run_release": ctx.info.release}


@registry.play("nap")
async def nap(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Waits durably for an event (it leaves its worker), then reports who resumed it."""
    before = await ctx.step("before", executed_by)
    got = await ctx.wait_for_event(str(params.get("event", "go")))
    return {
        "slept_on": before,
        "executed_by": executed_by(),
        "run_release": ctx.info.release,
        "woken": got.received,
    }
