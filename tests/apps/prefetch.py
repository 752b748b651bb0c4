"""Plays for the claim-ahead and liveness tests (``tests/e2e/test_prefetch.py``).

``PREFETCH_DB_URL`` names the test's database. ``held`` records each start (a row of
``test_prefetch_starts``: run, attempt, worker process) through a connection of its own,
then, in attempt 1, waits ``params["hold_s"]`` seconds; a later attempt returns at once.
So the test knows which runs a worker really started and which it only claimed ahead.

``counted`` (in-process workers only) counts the plays executing at once in
:data:`EXECUTING`: a slot is held from a play's start until it returns.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from worker.context import RunContext
from worker.plays import Registry

registry = Registry()

STARTS_DDL = """
CREATE TABLE IF NOT EXISTS test_prefetch_starts (
    run_id  uuid NOT NULL,
    attempt int NOT NULL,
    pid     int NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


@registry.play("held")
async def held(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(
        os.environ["PREFETCH_DB_URL"], autocommit=True
    ) as conn:
        await conn.execute(
            "INSERT INTO test_prefetch_starts (run_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.info.run_id, ctx.info.attempt, os.getpid()),
        )
    if ctx.info.attempt == 1:
        await asyncio.sleep(float(params.get("hold_s", 0)))
    return {"attempt": ctx.info.attempt}


EXECUTING = {"now": 0, "max": 0, "started": 0}


@registry.play("counted")
async def counted(ctx: RunContext, params: dict[str, Any]) -> None:
    EXECUTING["started"] += 1
    EXECUTING["now"] += 1
    EXECUTING["max"] = max(EXECUTING["max"], EXECUTING["now"])
    try:
        await asyncio.sleep(float(params.get("sleep_s", 0.005)))
    finally:
        EXECUTING["now"] -= 1
