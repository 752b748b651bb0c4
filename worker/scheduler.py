"""Periodic plays in a worker: declare the app's schedules at start, admit due ticks.

:mod:`queues.schedules` owns what a tick is and how it is admitted once; this module owns
when: each worker whose release has a scheduled play looks about once a second (sooner
when a tick is due sooner, at most :data:`IDLE_S` apart while nothing is scheduled), on a
pooled connection for one short transaction. A failure is logged and tried again; it never
stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from queues import schedules
from worker.plays import Registry

log = structlog.get_logger("worker.scheduler")

POLL_S = 1.0  # a due tick is admitted within about this long
IDLE_S = 5.0  # while no schedule of this worker's plays is near, look this often
MIN_S = 0.05


async def declare(conn: psycopg.AsyncConnection[Any], registry: Registry) -> None:
    """Upsert the schedules the app declares (``@registry.play(..., cron=...)``)."""
    for play in registry.periodic():
        periodic = play.periodic
        assert periodic is not None
        taken = await schedules.declare(
            conn,
            name=periodic.name,
            play=play.name,
            params=periodic.params,
            org=periodic.org,
            timing=periodic.timing,
        )
        if not taken:
            log.warning(
                "schedule_name_taken",
                schedule=periodic.name,
                play=play.name,
                detail="an operator's schedule (worker schedules add) has this name; the "
                "app's declaration is not applied",
            )


def _delay(next_due: datetime | None, now: datetime) -> float:
    if next_due is None:
        return IDLE_S
    left = (next_due - now).total_seconds()
    if left <= 0:  # due, but another worker holds it, or this lane does not admit
        return POLL_S
    # A little jitter, so that workers do not all look at the same instant.
    return min(IDLE_S, max(MIN_S, left)) + random.uniform(0, MIN_S)


async def run(
    pool: AsyncConnectionPool[Any], *, release: str, plays: Iterable[str], stopping: asyncio.Event
) -> None:
    """Admit due ticks of ``plays`` (the worker's app) on ``release``'s lane until
    ``stopping`` is set."""
    names = sorted(plays)
    while not stopping.is_set():
        delay = POLL_S
        try:
            async with pool.connection() as conn:
                done = await schedules.admit_due(conn, release=release, plays=names)
            for tick in done.ticked:
                log.info(
                    "schedule_ticked",
                    schedule=tick.name,
                    tick=tick.tick.isoformat(),
                    run_id=str(tick.run_id) if tick.run_id else None,
                    created=tick.created,
                    missed_ticks=tick.missed,
                    next_at=tick.next_at.isoformat(),
                )
            delay = _delay(done.next_due, done.now)
        except (psycopg.Error, PoolTimeout) as exc:
            log.warning("schedule_pass_failed", error=repr(exc)[:300])
        except Exception as exc:  # a scheduling bug must not stop the worker's runs
            log.error("schedule_pass_failed", error=repr(exc)[:300])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
