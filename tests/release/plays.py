"""The plays of the release smoke scenario (``--app tests.release.plays:registry``).

They use only the play API every release keeps (``ctx.step``, ``ctx.input_pages``,
``ctx.sheet``), so a later release can run an earlier release's copy of them. A play that
is given a ``trace`` directory in its params appends one JSON line per step execution to
``<trace>/<run id>.jsonl`` (``start`` and ``done``, with the attempt and the worker's pid):
the scenario reads it to tell which worker ran a step and that no completed step ran
again after a crash.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from queues import sheets
from worker.context import RunContext
from worker.plays import Fatal, Registry

registry = Registry()

GATE_POLL_S = 0.05
GATE_MAX_S = 60.0  # a gate never opened fails its run after this long
ROWS_DEFAULT = 20


def _trace(ctx: RunContext, params: dict[str, Any], step: str, event: str) -> None:
    folder = params.get("trace")
    if not folder:
        return
    line = json.dumps(
        {
            "step": step,
            "event": event,
            "attempt": ctx.attempt,
            "pid": os.getpid(),
            "worker": ctx.info.worker_id,
        }
    )
    # One short line per write, opened for appending: lines from two workers never mix.
    with open(Path(folder) / f"{ctx.run_id}.jsonl", "a", encoding="utf-8") as out:
        out.write(line + "\n")


async def _wait_for_gate(params: dict[str, Any]) -> None:
    """Wait in short sleeps (a cancel or a stop interrupts any of them) for the file
    ``<trace>/<gate>`` to exist."""
    gate = Path(str(params["trace"])) / str(params["gate"])
    limit = float(params.get("max_s", GATE_MAX_S))
    deadline = time.monotonic() + limit
    while not gate.exists():
        if time.monotonic() > deadline:
            raise Fatal(f"gate {gate} was not opened within {limit:g} s")
        await asyncio.sleep(GATE_POLL_S)


@registry.play("steps")
async def steps(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """``count`` steps (default 3) named s0, s1, ...; the step numbered ``gate_at``, if
    given, first waits for the file ``<trace>/<gate>``. Returns every step's result."""
    count = int(params.get("count", 3))
    gate_at = params.get("gate_at")
    results: list[Any] = []
    for index in range(count):
        name = f"s{index}"

        async def body(name: str = name, index: int = index) -> str:
            _trace(ctx, params, name, "start")
            if gate_at is not None and index == int(gate_at):
                await _wait_for_gate(params)
            _trace(ctx, params, name, "done")
            return f"{name}:ok"

        results.append(await ctx.step(name, body))
    return {
        "steps": results,
        "attempt": ctx.attempt,
        "release": ctx.info.release,
        "worker": ctx.info.worker_id,
    }


@registry.play("rows")
async def rows(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit rows to a sheet of the run's own (``params.sheet``, default ``rows-<run id>``:
    rows of one key in one sheet belong to one run at a time) and complete each one (its
    output: its ``i`` doubled). The rows are the run's input (``worker submit --input``),
    else ``count`` (default 20) made up here."""
    sheet = ctx.sheet(str(params.get("sheet") or f"rows-{ctx.run_id}"))
    pages = [page async for page in ctx.input_pages()]
    if not pages:
        count = int(params.get("count", ROWS_DEFAULT))
        pages = [[(f"r{i:03d}", {"i": i}) for i in range(count)]]
    admitted = done = 0
    for page in pages:
        await sheet.admit(page, stable_intent=True)
        admitted += len(page)
        completed = await sheet.complete(
            [sheets.RowCompletion(key, {"doubled": 2 * int(row.get("i", 0))}) for key, row in page],
            raise_on_superseded=True,
        )
        done += len(completed.committed)
    return {"admitted": admitted, "done": done, "attempt": ctx.attempt}
