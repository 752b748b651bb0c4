"""A periodic play with three workers of two releases: one run per tick, each admitted by
one of them on its own lane; after a downtime the missed ticks are admitted once, as the
latest of them.

A tick is due every second, and a worker looks about once a second: on a loaded machine a
pass can come after the next tick, which is then admitted as the latest of the ticks missed
(that is the feature, not a fault). So the test asserts the accounting, which holds however
late the passes come: each tick is admitted once or counted as missed by the next run
admitted, never both, never neither."""

from __future__ import annotations

import itertools
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
    # One run per tick: none twice, none skipped without being counted as missed.
    _assert_accounted(admitted)
    assert {lane for _, lane, _, _ in admitted} <= {"r-p1", "r-p2"}
    assert {(params["report"],) for *_, params in admitted} == {("daily",)}
    keys = await fetch(db_url, "SELECT idempotency_key, org FROM wq_runs WHERE play = 'tick'")
    assert sorted(keys) == sorted((schedules.tick_key("tick", t), "acme") for t in times)
    [schedule] = await _schedules(db_url)
    missed = sum(meta["missed_ticks"] for _, _, meta, _ in admitted)
    assert (schedule.source, schedule.missed_ticks) == ("app", missed)

    # Downtime: no worker until the database's clock is two ticks past the schedule's
    # next one (so at least two ticks pass unadmitted), then one starts again.
    async def two_ticks_missed() -> bool:
        [(passed,)] = await fetch(
            db_url,
            "SELECT now() >= next_at + interval '2 seconds' FROM wq_schedules WHERE name = 'tick'",
        )
        return bool(passed)

    await eventually(two_ticks_missed, timeout=30)
    before = len(admitted)
    async with running_worker(db_url, registry, release="p2", concurrency=2):

        async def caught_up() -> bool:
            return len(await ticks(db_url)) > before

        await eventually(caught_up, timeout=30)
    after = await ticks(db_url)
    assert after[:before] == admitted
    first_back = after[before]
    assert first_back[2]["missed_ticks"] >= 2  # the ticks missed, admitted as this one
    gap = (first_back[0] - times[-1]).total_seconds()
    assert gap >= 3  # nothing was admitted for the missed ticks themselves
    _assert_accounted(after)
    [schedule] = await _schedules(db_url)
    assert schedule.missed_ticks == sum(meta["missed_ticks"] for _, _, meta, _ in after)


def _assert_accounted(admitted: list[tuple[datetime, str, dict[str, Any], dict[str, Any]]]) -> None:
    """Each run admitted is one tick (``meta.tick``), and the seconds between two runs in a
    row are that run's tick and the ticks it says it stands for (``missed_ticks``): none
    twice, none lost."""
    for (earlier, *_), (later, _, meta, _) in itertools.pairwise(admitted):
        assert later - earlier == timedelta(seconds=1 + meta["missed_ticks"]), admitted


async def _schedules(url: str) -> list[schedules.Schedule]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await schedules.list_schedules(conn)
