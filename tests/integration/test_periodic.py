"""A periodic play with three workers of two releases: one run per tick, each admitted by
one of them on its own lane; after a downtime the missed ticks are admitted once, as the
latest of them."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import psycopg

from queues import schedules
from tests.apps.periodic import registry
from tests.workers import eventually, fetch, running_worker


async def ticks(url: str) -> list[tuple[datetime, str, dict[str, Any], dict[str, Any]]]:
    rows = await fetch(
        url,
        "SELECT (meta ->> 'tick')::timestamptz, lane, meta, params FROM wq_runs"
        " WHERE play = 'tick' ORDER BY 1",
    )
    return [(t, str(lane), meta, params) for t, lane, meta, params in rows]


async def test_three_workers_admit_one_run_per_tick(db_url: str) -> None:
    async with (
        running_worker(db_url, registry, release="p1", concurrency=2),
        running_worker(db_url, registry, release="p1", concurrency=2),
        running_worker(db_url, registry, release="p2", concurrency=2),
    ):

        async def four() -> bool:
            return len(await ticks(db_url)) >= 4

        await eventually(four, timeout=30)
    admitted = await ticks(db_url)
    times = [t for t, *_ in admitted]
    # One run per tick: consecutive seconds, none twice, none skipped.
    assert times == [times[0] + timedelta(seconds=i) for i in range(len(times))]
    assert {lane for _, lane, _, _ in admitted} <= {"r-p1", "r-p2"}
    assert all(meta["missed_ticks"] == 0 for _, _, meta, _ in admitted)
    assert {(params["report"],) for *_, params in admitted} == {("daily",)}
    keys = await fetch(db_url, "SELECT idempotency_key, org FROM wq_runs WHERE play = 'tick'")
    assert sorted(keys) == sorted((schedules.tick_key("tick", t), "acme") for t in times)
    [schedule] = await _schedules(db_url)
    assert (schedule.source, schedule.missed_ticks) == ("app", 0)

    # Downtime: no worker for three seconds, then one starts again.
    before = len(admitted)
    await asyncio.sleep(3.2)
    async with running_worker(db_url, registry, release="p2", concurrency=2):

        async def caught_up() -> bool:
            return len(await ticks(db_url)) > before

        await eventually(caught_up, timeout=30)
    after = await ticks(db_url)
    first_back = after[before]
    assert first_back[2]["missed_ticks"] >= 2  # the ticks missed, admitted as this one
    gap = (first_back[0] - times[-1]).total_seconds()
    assert gap >= 3  # nothing was admitted for the missed ticks themselves
    assert len({t for t, *_ in after}) == len(after)


async def _schedules(url: str) -> list[schedules.Schedule]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await schedules.list_schedules(conn)
