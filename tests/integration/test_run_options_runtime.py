"""Per-run options through a real worker: a run's maximum of attempts and its timeout
override its lane's (both ways), a timed-out run is stopped and failed with its own code,
a durable sleep past the timeout wakes at the deadline to fail, and the metadata reaches
the play."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, runs
from tests.apps.scheduling import DDL, URL_ENV, registry
from tests.workers import eventually, running_worker

RELEASE = "opts"


@pytest.fixture
async def url(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(DDL)
        await lanes.prepare(conn, RELEASE)
        # The lane's policy: five attempts without backoff, a run timeout of 30 s.
        await lanes.set_policy(
            conn, RELEASE, retry_max_attempts=5, retry_base_s=0.0, run_timeout_s=30.0
        )
    monkeypatch.setenv(URL_ENV, db_url)
    return db_url


async def submit(url: str, play: str, params: dict[str, Any], **options: Any) -> uuid.UUID:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn,
            admission.Submission(play=play, params=params, release=RELEASE, **options),
        )
    return admitted.run_id


async def ended(url: str, run_id: uuid.UUID) -> runs.Run | None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = await runs.get(conn, run_id)
    return run if run.terminal else None


async def outcomes_of(url: str, run_id: uuid.UUID) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return [a.outcome for a in await runs.attempts(conn, run_id)]


async def test_a_runs_max_attempts_overrides_its_lanes(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE):
        own = await submit(url, "flaky", {}, max_attempts=2)
        lanes_ = await submit(url, "flaky", {})
        never = await submit(url, "flaky", {}, retry="none", max_attempts=9)
        for run_id in (own, lanes_, never):
            await eventually(lambda run_id=run_id: ended(url, run_id), timeout=30)
    assert await outcomes_of(url, own) == ["failed"] * 2
    assert await outcomes_of(url, lanes_) == ["failed"] * 5
    assert await outcomes_of(url, never) == ["failed"]  # `none`: the first failure is final


async def test_a_runs_timeout_overrides_its_lanes_both_ways(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE):
        short = await submit(url, "slow", {"seconds": 30}, timeout=0.5)
        run = await eventually(lambda: ended(url, short), timeout=20)
        assert run.state == "failed" and run.error["code"] == "RUN_TIMED_OUT"
        assert await outcomes_of(url, short) == ["failed"]  # stopped, never retried
        assert run.finished_at is not None and run.started_at is not None
        assert 0.4 < (run.finished_at - run.started_at).total_seconds() < 10
        # A lane whose runs time out after 0.5 s, and a run that may take 30.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await lanes.set_policy(conn, RELEASE, run_timeout_s=0.5)
        by_lane = await submit(url, "slow", {"seconds": 2})
        longer = await submit(url, "slow", {"seconds": 1}, timeout=30)
        assert (await eventually(lambda: ended(url, by_lane), timeout=20)).state == "failed"
        assert (await eventually(lambda: ended(url, longer), timeout=20)).state == "succeeded"


async def test_a_sleep_past_the_timeout_wakes_at_the_deadline_to_fail(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE):
        run_id = await submit(url, "slow", {"seconds": 3600, "durable": True}, timeout=1)
        run = await eventually(lambda: ended(url, run_id), timeout=20)
    assert run.state == "failed" and run.error["code"] == "RUN_TIMED_OUT"
    # Attempt 1 slept (woken at the deadline, not in an hour); attempt 2 failed at once.
    assert await outcomes_of(url, run_id) == ["suspended", "failed"]


async def test_the_play_sees_its_runs_metadata(url: str) -> None:
    async with running_worker(url, registry, release=RELEASE):
        run_id = await submit(url, "parent", {"value": 5}, meta={"trace": "t-1"})
        run = await eventually(lambda: ended(url, run_id), timeout=20)
    assert run.state == "succeeded"
    # The child got the metadata its parent gave it.
    assert run.result["result"] == {"doubled": 10, "meta": {"by": "parent"}}
