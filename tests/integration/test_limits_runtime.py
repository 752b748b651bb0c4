"""Shared limits through real workers: a concurrency cap over two workers is never
exceeded (read from the intervals the plays recorded inside their permits), and a wait
longer than the play allows hands the run back durably instead of holding its slot."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from queues import admission, limits, runs
from tests.apps.scheduling import URL_ENV, prepare, registry
from tests.workers import eventually, fetch, running_worker

RELEASE = "limits"


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    await prepare(db_url, RELEASE)
    monkeypatch.setenv(URL_ENV, db_url)
    return db_url


async def submit(url: str, play: str, params: dict[str, Any], n: int) -> list[uuid.UUID]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return [
            (
                await admission.submit(
                    conn, admission.Submission(play=play, params=params, release=RELEASE)
                )
            ).run_id
            for _ in range(n)
        ]


async def all_ended(url: str, ids: list[uuid.UUID]) -> bool:
    rows = await fetch(
        url,
        "SELECT count(*) FROM wq_runs WHERE id = ANY (%s) AND state IN ('succeeded', 'failed')",
        (ids,),
    )
    return int(rows[0][0]) == len(ids)


def most_at_once(intervals: list[tuple[Any, Any]]) -> int:
    """The largest number of intervals that overlap at one instant."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    held = most = 0
    for _, step in points:  # an end sorts before a start at the same instant
        held += step
        most = max(most, held)
    return most


async def test_a_concurrency_cap_is_never_exceeded_across_workers(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await limits.set_limit(conn, "crm", concurrency=3)
    ids = await submit(url, "capped", {"key": "crm", "hold": 0.05}, 40)
    async with (
        running_worker(url, registry, release=RELEASE, concurrency=8),
        running_worker(url, registry, release=RELEASE, concurrency=8),
    ):
        await eventually(lambda: all_ended(url, ids), timeout=60)
    intervals = await fetch(url, "SELECT started, ended FROM permits WHERE key = 'crm'")
    assert len(intervals) == 40
    # 16 slots for 40 runs and a cap of 3: the cap was reached, and never passed.
    assert most_at_once(intervals) == 3
    assert (await fetch(url, "SELECT count(*) FROM wq_limit_holds"))[0][0] == 0  # released


async def test_a_long_wait_hands_the_run_back_instead_of_holding_its_slot(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await limits.set_limit(conn, "one", concurrency=1)
    holder = await submit(url, "capped", {"key": "one", "hold": 1.5}, 1)
    async with running_worker(url, registry, release=RELEASE, concurrency=4):

        async def holding() -> bool:
            rows = await fetch(url, "SELECT count(*) FROM wq_limit_holds")
            return int(rows[0][0]) == 1

        await eventually(holding, timeout=30)
        waiter = await submit(url, "capped", {"key": "one", "hold": 0, "hand_back": 0.2}, 1)

        async def asleep() -> bool:
            rows = await fetch(url, "SELECT state::text FROM wq_runs WHERE id = %s", (waiter[0],))
            return rows[0][0] == "sleeping"

        await eventually(asleep, timeout=30)  # handed back: its slot is free meanwhile
        await eventually(lambda: all_ended(url, holder + waiter), timeout=30)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        attempts = await runs.attempts(conn, waiter[0])
        run = await runs.get(conn, waiter[0])
    assert run.state == "succeeded"
    assert attempts[0].outcome == "suspended" and attempts[-1].outcome == "succeeded"
