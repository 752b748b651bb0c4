"""A periodic play for ``tests/integration/test_periodic.py``: ``tick`` runs every second
(``@registry.play(..., every="1s")``), declared by every worker of the app at its start."""

from __future__ import annotations

from typing import Any

from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


@registry.play("tick", every="1s", params={"report": "daily"}, org="acme")
async def tick(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"meta": ctx.meta, "params": params}
