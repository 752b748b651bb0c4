"""Plays for the zombie tests (``tests/e2e/test_zombies.py``): a worker SIGSTOPped at a
chosen point of a run, rescued past its lease, and continued after a newer attempt
finished the run.

Run the worker with ``--app tests.apps.zombie:registry`` and ``ZOMBIE_DB_URL`` naming the
test's database. Everything the plays record for the test (marks, hook executions) goes
through connections of their own opened from ``ZOMBIE_DB_URL``, never the worker's; their
fenced writes (sheet rows, step receipts, the final write) go through the run context.

The ``zombie`` play admits ``rows`` rows to a sheet under the run's stable write intent,
records a step (``enrich``) and one row step per row (``complete_steps``), each charging
1 credit (``ctx.charge``), completes the rows and returns; every output carries the
writing attempt (``by``, ``writer``) so a late write of attempt 1 would be visible.
``params["point"]`` picks where attempt 1 meets the test (a *rendezvous*: it writes the
mark ``<point>`` and waits until the test releases it; attempt 2 never stops there):

- ``step``: inside the body of the ``enrich`` step;
- ``receipts``: after the step receipts were recorded, before the rows are completed;
- ``rows``: after the rows were completed, before the play returns;
- ``cancel``: the play waits (mark ``awaiting-cancel``) until a cancel stops it; its cancel
  hook meets the test at ``hook``;
- ``spawn``: after the step receipts were recorded, right before ``ctx.spawn`` admits a
  child run (play ``zombie_child``) under the step key ``child:<attempt>``; a key of each
  attempt, so that neither the child's idempotency key nor the step's receipt (both shared
  by every attempt with a stable key) could keep attempt 1's child out: only the fence;
- ``limit``: after the step receipts were recorded, right before ``ctx.limit`` asks for a
  permit of the shared limit :data:`LIMIT` (the test defines it); inside the block the
  play reads the run's permits (``wq_limit_holds``, through its own connection) and
  returns them with the grant's time (``permit``);
- ``limit-held``: as ``limit``, but attempt 1 meets the test inside the block, holding
  its permit (its late write is the permit's release, then the rows' completion);
- ``budget``: after the permits' point, right before a step (``paid``) that reserves its
  estimate of 1 credit against the run's budgets (the test defines one for the org).

A rendezvous does not give up when the runtime stops the attempt (the watchdog after a
refused lease renewal): it records ``<point>:stopped`` and waits on for the release, like
code that does not notice it was told to stop. So the zombie's next write really reaches
the database after the test released it, and the fence has to refuse it.

The cancel hook records ``hook:started`` and ``hook:finished`` (the hook ran to
completion). In attempt 1 it waits at the ``hook`` rendezvous and, if the runtime stopped
it there, reports the interruption as a failure (``hook:interrupted``) instead of
finishing. In a later attempt (the cleanup-only attempt) it runs for two heartbeats of its
worker (it waits until the run's lease was renewed twice), as a real cleanup (deleting a
sandbox over the network) outlasts a heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import psycopg

from queues import sheets
from worker.context import RunContext
from worker.plays import Fatal, Registry

registry = Registry()

T = TypeVar("T")
URL_ENV = "ZOMBIE_DB_URL"
POLL_S = 0.02
HOOK_RENEWALS = 2  # a later attempt's cleanup hook outlasts this many lease renewals
HOOK_DEADLINE_S = 30.0
LIMIT = "zombie"  # the shared limit of the ``limit`` points (defined by the test)
LIMIT_POINTS = ("limit", "limit-held")

ZOMBIE_DDL = """
CREATE TABLE IF NOT EXISTS zombie_marks (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id  uuid NOT NULL,
    attempt integer NOT NULL,
    mark    text NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS zombie_releases (
    run_id  uuid NOT NULL,
    point   text NOT NULL,
    PRIMARY KEY (run_id, point)
)
"""


def _url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        raise Fatal(f"{URL_ENV} is not set: the zombie plays record marks in that database")
    return url


async def _connect() -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(_url(), autocommit=True)


async def _through_stops(work: Awaitable[T]) -> tuple[T, bool]:
    """Await ``work`` to its end even when this task is cancelled meanwhile (every cancel
    is absorbed: the task goes on); returns its result and whether a cancel came."""
    inner = asyncio.ensure_future(work)
    stopped = False
    while True:
        try:
            return await asyncio.shield(inner), stopped
        except asyncio.CancelledError:
            if inner.cancelled():
                raise
            stopped = True
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()


async def _insert_mark(run_id: uuid.UUID, attempt: int, mark: str) -> None:
    async with await _connect() as own:
        await own.execute(
            "INSERT INTO zombie_marks (run_id, attempt, mark) VALUES (%s, %s, %s)",
            (run_id, attempt, mark),
        )


async def mark(ctx: RunContext, name: str) -> None:
    """Record ``name`` for this run and attempt."""
    await _insert_mark(ctx.run_id, ctx.attempt, name)


async def _released(run_id: uuid.UUID, point: str) -> None:
    async with await _connect() as own:
        while True:
            cur = await own.execute(
                "SELECT 1 FROM zombie_releases WHERE run_id = %s AND point = %s",
                (run_id, point),
            )
            if await cur.fetchone() is not None:
                return
            await asyncio.sleep(POLL_S)


async def rendezvous(ctx: RunContext, point: str) -> bool:
    """Attempt 1 only: mark ``point``, then wait until the test releases it, through any
    stop the runtime orders meanwhile (marked ``<point>:stopped``). Returns whether the
    attempt was stopped while it waited."""
    if ctx.attempt != 1:
        return False
    # The test may pause the worker as soon as the mark is committed, while this task is
    # still closing the mark's connection; a stop that lands there is noted like one that
    # lands in the wait.
    _, stopped = await _through_stops(mark(ctx, point))
    if stopped:
        await _through_stops(_insert_mark(ctx.run_id, ctx.attempt, f"{point}:stopped"))
    waiting = asyncio.ensure_future(_released(ctx.run_id, point))
    while True:
        try:
            await asyncio.shield(waiting)
            return stopped
        except asyncio.CancelledError:
            if waiting.cancelled():
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            if not stopped:
                stopped = True
                # Recorded through any further stop: the test waits for this mark.
                await _through_stops(_insert_mark(ctx.run_id, ctx.attempt, f"{point}:stopped"))


async def _lease_renewed(run_id: uuid.UUID, times: int) -> None:
    """Wait until the run's lease was renewed ``times`` times after this call began."""
    async with await _connect() as own:
        seen: list[Any] = []
        async with asyncio.timeout(HOOK_DEADLINE_S):
            while len(seen) <= times:
                cur = await own.execute(
                    "SELECT lease_expires_at FROM wq_runs WHERE id = %s", (run_id,)
                )
                row = await cur.fetchone()
                expires = row[0] if row is not None else None
                if expires is not None and (not seen or expires > seen[-1]):
                    seen.append(expires)
                await asyncio.sleep(POLL_S)


async def cleanup_hook(ctx: RunContext) -> None:
    await mark(ctx, "hook:started")
    if ctx.attempt == 1:
        if await rendezvous(ctx, "hook"):
            await mark(ctx, "hook:interrupted")
            raise RuntimeError("cleanup interrupted: the runtime stopped this attempt")
    else:
        await _lease_renewed(ctx.run_id, HOOK_RENEWALS)
    await mark(ctx, "hook:finished")


async def _holds(run_id: uuid.UUID) -> list[list[Any]]:
    """The run's permits (``wq_limit_holds``): ``[attempt, hold]`` each, by hold."""
    async with await _connect() as own:
        cur = await own.execute(
            "SELECT attempt, hold FROM wq_limit_holds WHERE run_id = %s ORDER BY hold", (run_id,)
        )
        return [[int(attempt), str(hold)] for attempt, hold in await cur.fetchall()]


async def _spawn_child(ctx: RunContext) -> str:
    await rendezvous(ctx, "spawn")
    child = await ctx.spawn(
        "zombie_child", {"parent_attempt": ctx.attempt}, key=f"child:{ctx.attempt}"
    )
    return str(child)


async def _paid_step(ctx: RunContext) -> Any:
    """The ``budget`` point: a step that reserves its estimate against the run's budgets
    first (attempt 1 meets the test right before asking)."""
    await rendezvous(ctx, "budget")

    async def call() -> dict[str, int]:
        ctx.charge(1, provider="zombie")
        return {"by": ctx.attempt}

    return await ctx.step("paid", call, cost=1)


async def _take_permit(ctx: RunContext, point: str) -> dict[str, Any]:
    if point == "limit":
        await rendezvous(ctx, "limit")
    async with ctx.limit(LIMIT) as permit:
        held = await _holds(ctx.run_id)
        if point == "limit-held":
            await rendezvous(ctx, "limit-held")
    return {"at": permit.at.isoformat(), "holds": held, "attempt": ctx.attempt}


@registry.play("zombie_child")
async def zombie_child(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """The child run of the ``spawn`` point: it reports which parent attempt spawned it."""
    return {"parent_attempt": params["parent_attempt"], "attempt": ctx.attempt}


def row_output(score: Any, attempt: int) -> dict[str, Any]:
    return {"score": score, "writer": attempt}


@registry.play("zombie", on_cancel=cleanup_hook)
async def zombie(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    point = str(params["point"])
    n = int(params.get("rows", 5))
    sheet = ctx.sheet(str(params.get("sheet", "zombie")))
    rows = [(f"r{i:03d}", {"i": i}) for i in range(n)]
    admission = await sheet.admit(rows, stable_intent=True)
    open_keys = [
        r.key
        for r in admission.rows
        if r.disposition
        in (
            sheets.Disposition.ADMITTED,
            sheets.Disposition.READMITTED,
            sheets.Disposition.ALREADY_CURRENT,
        )
    ]

    async def enrich() -> dict[str, Any]:
        ctx.charge(1, provider="zombie")  # recorded only with the receipt of this attempt
        if point == "step":
            await rendezvous(ctx, "step")
        return {"by": ctx.attempt}

    enriched = await ctx.step("enrich", enrich)
    keys = [f"row:{key}" for key in open_keys]
    done = await ctx.steps_done(keys)
    fresh = [(k, {"v": k, "by": ctx.attempt}) for k in keys if k not in done]
    for k, _ in fresh:
        ctx.charge(1, provider="zombie", step=k)
    if fresh:
        await ctx.complete_steps(fresh)
    scores = {**done, **dict(fresh)}
    if point == "receipts":
        await rendezvous(ctx, "receipts")
    child = await _spawn_child(ctx) if point == "spawn" else None
    permit = await _take_permit(ctx, point) if point in LIMIT_POINTS else None
    paid = await _paid_step(ctx) if point == "budget" else None
    if point == "cancel" and ctx.attempt == 1:
        await mark(ctx, "awaiting-cancel")
        await asyncio.Event().wait()  # until the cancel stops the play (its hook runs)
    if open_keys:
        await sheet.complete(
            [
                sheets.RowCompletion(key=k, output=row_output(scores[f"row:{k}"], ctx.attempt))
                for k in open_keys
            ],
            raise_on_superseded=True,
        )
    if point == "rows":
        await rendezvous(ctx, "rows")
    return {
        "attempt": ctx.attempt,
        "enriched": enriched,
        "completed": len(open_keys),
        "terminal": n - len(open_keys),
        "write_version": sheet.write_version,
        "child": child,
        "permit": permit,
        "paid": paid,
    }
