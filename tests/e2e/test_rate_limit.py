"""A rate limit of 40/s shared by two `worker start` processes: 200 permits take at least
4.9 s, and no one-second window holds more than 40 of them (read from the permit times the
plays recorded: the database's time of each grant). The rate is high enough that the two
processes contend for nearly every permit, and the test lasts about 5 s (the limit's own
pace)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import admission, lanes
from tests.apps.scheduling import DDL, URL_ENV
from tests.e2e.test_cli_scheduler import REPO, WORKER, cli, cli_env, eventually
from tests.workers import fetch

APP = "tests.apps.scheduling:registry"
RELEASE = "rl"
RUNS, PERMITS_EACH = 20, 10
RATE = 40  # permits per second


@contextlib.asynccontextmanager
async def worker(
    db_url: str, tmp_path: Path, name: str, *, app: str = APP, release: str = RELEASE
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A `worker start` process of ``app`` that reported ready; killed on the way out."""
    ready = tmp_path / f"{name}.ready"
    with (tmp_path / f"{name}.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            WORKER,
            "--json-logs",
            "start",
            "--release",
            release,
            "--app",
            app,
            "--ready-file",
            str(ready),
            "--grace",
            "1",
            cwd=REPO,
            env=cli_env(db_url, **{URL_ENV: db_url}),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:

        async def is_ready() -> bool:
            assert proc.returncode is None, (tmp_path / f"{name}.log").read_text()
            with contextlib.suppress(OSError, ValueError):
                return bool(json.loads(ready.read_text())["worker_id"])
            return False

        await eventually(is_ready, f"worker {name}", timeout=60)
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def submit(url: str, play: str, params: dict[str, Any], release: str) -> uuid.UUID:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn, admission.Submission(play=play, params=params, release=release)
        )
    return admitted.run_id


@pytest.mark.slow
async def test_a_rate_shared_by_two_worker_processes_is_never_exceeded(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(DDL)
        await lanes.prepare(conn, RELEASE)
    done = await cli(db_url, "limits", "set", "api", "--rate", f"{RATE}/s")
    assert done.code == 0, done.err
    async with worker(db_url, tmp_path, "a"), worker(db_url, tmp_path, "b"):
        ids = [
            await submit(db_url, "limited", {"key": "api", "n": PERMITS_EACH}, RELEASE)
            for _ in range(RUNS)
        ]

        async def finished() -> bool:
            rows = await fetch(
                db_url,
                "SELECT count(*) FROM wq_runs WHERE id = ANY (%s) AND state = 'succeeded'",
                (ids,),
            )
            return int(rows[0][0]) == RUNS

        await eventually(finished, "every run to succeed", timeout=120)
    times = [at for (at,) in await fetch(db_url, "SELECT at FROM permits ORDER BY at")]
    assert len(times) == RUNS * PERMITS_EACH == 200
    assert times[-1] - times[0] >= timedelta(seconds=(len(times) - 1) / RATE)
    # Every one-second window [t, t + 1 s) starting at a permit holds at most RATE.
    end = 0
    for start, moment in enumerate(times):
        while end < len(times) and times[end] < moment + timedelta(seconds=1):
            end += 1
        assert end - start <= RATE, (moment, times[start:end])
    workers = await fetch(
        db_url, "SELECT count(DISTINCT worker_id) FROM wq_attempts WHERE run_id = ANY (%s)", (ids,)
    )
    assert workers == [(2,)]  # both processes took permits of the one limit
    listed = await cli(db_url, "limits", "list", "--json")
    assert listed.code == 0, listed.err
    assert [(x["key"], x["rate"], x["holding"]) for x in json.loads(listed.out)] == [
        ("api", f"{RATE}/s", 0)
    ]
