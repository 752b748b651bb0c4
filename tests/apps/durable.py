"""Plays for the durable-execution tests (steps, sleep, events, crash and resume).

Side effects are counted in ``test_side_effects``, so a test can prove a completed step
never ran again. Like any app's plays, they write their own data through a connection the
app configures itself (``TEST_SIDE_EFFECTS_URL``), never through the worker's.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable
from typing import Any, TypeVar

import psycopg

from queues import sheets
from queues.errors import FenceError
from tests import providers
from worker.context import RunContext, Sheet
from worker.plays import Registry

registry = Registry()

T = TypeVar("T")

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


class Stops:
    """How a ``paid-rows`` attempt meets a stop of the runtime's (its task cancelled: the
    watchdog, when the worker finds its leases gone) and a refusal of the fence's.

    By default it ends at either, as plays do. A worker stopped past its lease (a zombie:
    SIGSTOP, then SIGCONT) finds out the moment it wakes, and its watchdog stops the
    attempts before their next writes, so none of them would reach the database. With
    ``through`` the play is code that notices neither: each chunk and each wait runs on to
    its end through a stop, and a refused write (``FenceError``) ends only the chunk in
    hand, the play going on with the next. So every write it has left reaches the database
    late, from the one in hand to the final write, each for the fence to refuse. Except
    the paid call: it checks first (as a client given a cancellation token would) and a
    stopped attempt pays nothing and ends there, so a zombie never pays again for what its
    run's newer attempt paid.
    """

    def __init__(self, through: bool) -> None:
        self.through = through
        self.stopped = False

    async def carry(self, work: Awaitable[T]) -> T:
        """Await ``work``; with ``through``, to its end whatever stop comes meanwhile."""
        if not self.through:
            return await work
        inner = asyncio.ensure_future(work)
        while True:
            try:
                return await asyncio.shield(inner)
            except asyncio.CancelledError:
                if inner.cancelled():  # stopped before paying: the attempt ends here
                    raise
                self.stopped = True
                task = asyncio.current_task()
                assert task is not None
                task.uncancel()

    def before_paying(self) -> None:
        if self.stopped:
            raise asyncio.CancelledError("stopped: a stopped attempt pays nothing")


@registry.play("paid-rows")
async def paid_rows(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit input rows in chunks; one paid side effect per row, recorded as a step.

    Per chunk: already paid rows come back from receipts; each new row's side effect is
    recorded before its receipt (so a crash between the two re-runs only in-flight rows).
    ``complete_delay_s`` waits between recording a chunk's receipts and completing its
    rows (the outputs come from a slower call), ``chunk_delay_s`` after each chunk.

    ``through_stops`` makes it a zombie's play (the chaos suite's): see :class:`Stops`.
    ``hold_at`` (a row's position in the input, a chunk's first) makes attempt 1 wait for
    good in that chunk once its side effects and receipts are recorded and before its rows
    are completed: where a kill leaves rows that must come back from their receipts.
    """
    sheet = ctx.sheet(str(params.get("sheet", f"s-{ctx.run_id}")))
    delay = float(params.get("chunk_delay_s", 0))
    complete_delay = float(params.get("complete_delay_s", 0))
    chunk = int(params.get("chunk", 1000))
    stops = Stops(bool(params.get("through_stops", False)))
    hold_at = params.get("hold_at") if ctx.attempt == 1 else None
    stats = {"paid": 0, "replayed": 0, "terminal": 0}
    pages = ctx.input_pages()
    offset = 0
    while (page := await stops.carry(anext(pages, None))) is not None:
        for start in range(0, len(page), chunk):
            rows = page[start : start + chunk]
            hold = hold_at is not None and offset + start == int(hold_at)
            try:
                await stops.carry(_paid_chunk(ctx, sheet, rows, stats, stops, complete_delay, hold))
            except FenceError:
                if not stops.through:
                    raise
            if delay:
                await stops.carry(asyncio.sleep(delay))
        offset += len(page)
    return stats | {"write_version": sheet.write_version, "attempt": ctx.attempt}


async def _paid_chunk(
    ctx: RunContext,
    sheet: Sheet,
    rows: list[tuple[str, Any]],
    stats: dict[str, int],
    stops: Stops,
    complete_delay: float,
    hold: bool = False,
) -> None:
    admission = await sheet.admit(rows, stable_intent=True)
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
        stops.before_paying()
        provider = os.environ.get("TEST_PROVIDER")
        if provider:  # the paid call, keyed: a provider charges a row once (bench.chaos)
            run = str(ctx.run_id)
            for k in fresh:
                key = ctx.idempotency_key(k)
                await asyncio.to_thread(providers.charge, provider, key, run, 1, k)
        async with await psycopg.AsyncConnection.connect(own_database(), autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO test_side_effects (run_id, key, attempt) "
                "SELECT %s, k, %s FROM unnest(%s::text[]) AS k",
                (ctx.run_id, ctx.attempt, fresh),
            )
        await ctx.complete_steps([(k, {"v": k}) for k in fresh])
    stats["paid"] += len(fresh)
    stats["replayed"] += len(keys) - len(fresh)
    if hold:
        await asyncio.Event().wait()  # until the attempt is killed
    if keys:
        if complete_delay:
            await asyncio.sleep(complete_delay)
        await sheet.complete(
            [sheets.RowCompletion(key=k.removeprefix("row:"), output={"v": k}) for k in keys]
        )


@registry.play("kills-its-worker")
async def kills_its_worker(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """A poison run: its first attempt completes a step, then every attempt takes down the
    process it runs in (as a play that exhausts the host's memory does)."""
    await ctx.step("setup", lambda: "ready")
    await side_effect(ctx, "dying")
    os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(60)  # not reached
    return {}


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
