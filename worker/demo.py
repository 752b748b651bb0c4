"""The built-in plays: ``noop`` (benchmarks) and ``enrich`` (the demo, on sheets and steps)."""

from __future__ import annotations

import asyncio
import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

from queues import sheets
from worker.context import RunContext
from worker.plays import Registry

demo_plays = Registry(spec="worker.demo:demo_plays")
SAMPLE = "companies.csv"


def sample_path() -> Path:
    return Path(str(resources.files("worker") / "data" / SAMPLE))


@demo_plays.play("noop")
async def noop(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Does nothing: the trivial run of the benchmarks."""
    return {"ok": True}


def score(row: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for a paid enrichment API: deterministic, so replays are checkable."""
    digest = hashlib.sha256(str(row.get("domain", row)).encode()).digest()
    employees = int(row.get("employees") or 0)
    tier = "enterprise" if employees >= 5000 else "mid-market" if employees >= 200 else "smb"
    return {"score": digest[0] % 100, "tier": tier, "country": row.get("country")}


@demo_plays.play("enrich")
async def enrich(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit the run's input rows to a sheet page by page, enrich each row once, complete.

    Each page: admit under the run's stable write intent; look up which rows' steps a
    previous attempt already paid for; pay (one batched step write) for the rest; complete
    the page's rows, fenced by the write version. A resumed run redoes no paid step.
    """
    sheet = ctx.sheet(str(params.get("sheet") or f"enrich-{ctx.run_id}"))
    delay = float(params.get("page_delay_s") or 0)
    counts = {"rows": 0, "enriched": 0, "replayed": 0, "already_terminal": 0}
    async for page in ctx.input_pages():
        admission = await sheet.admit(page, stable_intent=True)
        open_keys = (
            set(admission.keys(sheets.Disposition.ADMITTED))
            | set(admission.keys(sheets.Disposition.READMITTED))
            | set(admission.keys(sheets.Disposition.ALREADY_CURRENT))
        )
        counts["rows"] += len(page)
        counts["already_terminal"] += len(page) - len(open_keys)
        todo = [(key, row) for key, row in page if key in open_keys]
        paid = await ctx.steps_done([f"enrich:{key}" for key, _ in todo])
        fresh = [(key, score(row)) for key, row in todo if f"enrich:{key}" not in paid]
        if fresh:
            await ctx.complete_steps([(f"enrich:{key}", out) for key, out in fresh])
        outputs = {key: paid[f"enrich:{key}"] for key, _ in todo if f"enrich:{key}" in paid}
        outputs.update(dict(fresh))
        counts["enriched"] += len(fresh)
        counts["replayed"] += len(todo) - len(fresh)
        if todo:
            await sheet.complete(
                [sheets.RowCompletion(key=key, output=outputs[key]) for key, _ in todo],
                raise_on_superseded=True,  # another run owns these rows: stop this one
            )
        if delay:
            await asyncio.sleep(delay)
    return counts | {"write_version": sheet.write_version}


# What `worker demo` runs: the demo plays, plus the same enrich play sandboxed (it runs in
# a child process that holds no database URL or secret, only the runtime gateway's address
# and its attempt's tokens). Kept apart from `demo_plays`, which a worker started without
# --app serves and which therefore needs no token secret.
demo_with_sandbox = demo_plays.merged(Registry(spec="worker.demo:demo_with_sandbox"))
demo_with_sandbox.play("enrich-sandboxed", sandboxed=True)(enrich)
