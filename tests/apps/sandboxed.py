"""Sandboxed test plays: ``worker start --app tests.apps.sandboxed:registry``.

They run in a child process that holds no database URL or secret; everything goes through
the runtime gateway with the attempt's tokens.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from queues import sheets
from worker.context import RunContext
from worker.plays import Registry

registry = Registry()

CREDENTIAL_NAMES = ("DATABASE_URL", "SECRET", "PASSWORD", "PGPASSWORD", "WORKER_HOME")


@registry.play("sandboxed-sheet", sandboxed=True)
async def sandboxed_sheet(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit the input rows to a sheet, pay one step per row, complete the rows."""
    sheet = ctx.sheet(str(params.get("sheet") or f"sandbox-{ctx.run_id}"))
    done = 0
    async for page in ctx.input_pages():
        admitted = await sheet.admit(page, stable_intent=True)
        open_keys = set(admitted.keys(sheets.Disposition.ADMITTED)) | set(
            admitted.keys(sheets.Disposition.ALREADY_CURRENT)
        )
        todo = [(key, row) for key, row in page if key in open_keys]
        paid = await ctx.steps_done([f"row:{key}" for key, _ in todo])
        fresh = [
            (f"row:{key}", {"n": row["n"] * 2}) for key, row in todo if f"row:{key}" not in paid
        ]
        if fresh:
            await ctx.complete_steps(fresh)
        outputs = dict(paid) | dict(fresh)
        result = await sheet.complete(
            [sheets.RowCompletion(key, outputs[f"row:{key}"]) for key, _ in todo],
            raise_on_superseded=True,
        )
        done += len(result.committed)
    total = await ctx.step("total", lambda: done)
    await ctx.log_event("sandbox_done", {"rows": total})
    return {
        "rows": total,
        "pid": os.getpid(),
        "environment": sorted(os.environ),
        "credentials_seen": sorted(
            name for name in os.environ if any(c in name for c in CREDENTIAL_NAMES)
        ),
    }


@registry.play("sandboxed-fails", sandboxed=True)
async def sandboxed_fails(ctx: RunContext, params: dict[str, Any]) -> None:
    raise RuntimeError(f"sandboxed failure on attempt {ctx.attempt}")


async def _note_cancel(ctx: RunContext) -> None:
    await ctx.log_event("cleanup_ran", {"attempt": ctx.attempt})


@registry.play("sandboxed-waits", sandboxed=True, on_cancel=_note_cancel)
async def sandboxed_waits(ctx: RunContext, params: dict[str, Any]) -> None:
    """Says it started, then waits until it is stopped (a cancel, a hand-back)."""
    await ctx.log_event("waiting", {"attempt": ctx.attempt})
    await asyncio.sleep(3600)
