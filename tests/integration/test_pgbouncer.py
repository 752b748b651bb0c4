"""Workers and admission through a real PgBouncer (Debian's package, started here) in
transaction mode, and the connection budget.

PgBouncer 1.18 (Debian 12) routes each transaction to any server connection and knows
nothing of protocol-level prepared statements, so a worker that prepared a statement, kept
session state or LISTENed through it would fail or hang here. The pool is kept small (3
server connections) so consecutive transactions of one client really move between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from bench import hosts
from queues import admission, lanes, migrations
from queues import runs as runs_q
from queues.errors import InvalidField, MigrationFailed
from tests.apps.hosts import registry
from tests.workers import eventually, fetch
from worker import connections, db
from worker.config import PoolMode
from worker.runtime import Settings, Worker

RELEASE = "pgb"
POOL_SIZE = 3  # PgBouncer's server connections per database alias (the bouncer fixture)
OWN = "pgb-test"  # the application_name of the test's own direct connections to the server


def _credentials(url: str) -> dict[str, str]:
    params = conninfo_to_dict(url)
    return {str(params["user"]): str(params["password"])}


@pytest.fixture
def bouncer(db_url: str) -> Iterator[hosts.PgBouncer]:
    with hosts.pgbouncer(db_url, users=_credentials(db_url), pool_size=POOL_SIZE) as running:
        yield running


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[Worker]:
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        raise RuntimeError(f"worker exited before ready: {task.result()!r}")
    try:
        yield worker
    finally:
        worker.stop()
        assert await asyncio.wait_for(task, 30) == 0


def settings(url: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "url": url,
        "release": RELEASE,
        "registry": registry,
        "concurrency": 8,
        "grace_s": 2.0,
        "install_signals": False,
    }
    return Settings(**(base | overrides))


async def states(url: str, ids: list[uuid.UUID]) -> dict[str, int]:
    rows = await fetch(
        url,
        "SELECT state::text, count(*) FROM wq_runs WHERE id = ANY(%s) GROUP BY 1",
        (ids,),
    )
    return {str(state): int(n) for state, n in rows}


def all_succeeded(url: str, ids: list[uuid.UUID]) -> Callable[[], Any]:
    async def probe() -> bool:
        return (await states(url, ids)).get("succeeded") == len(ids)

    return probe


@contextlib.asynccontextmanager
async def connection_peaks(direct: str, worker: Worker) -> AsyncIterator[dict[str, int]]:
    """Sample, until the block ends: the connections the server has on the test's database
    besides the test's own (``direct`` names them :data:`OWN`), seen in the server's
    ``pg_stat_activity``, and the connections in the worker's own pool. Yields the peak of
    each (``server``, ``worker``), updated as it samples."""
    peaks = {"server": 0, "worker": 0}
    pool = worker.pool
    assert pool is not None

    async def sample() -> None:
        async with await psycopg.AsyncConnection.connect(direct, autocommit=True) as mon:
            while True:
                cur = await mon.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND backend_type = 'client backend' AND application_name <> %s",
                    (OWN,),
                )
                row = await cur.fetchone()
                peaks["server"] = max(peaks["server"], int(row[0]) if row else 0)
                peaks["worker"] = max(peaks["worker"], pool.get_stats()["pool_size"])
                await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        yield peaks
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


async def admit_through(pool_url: str, play: str, n: int, **params: Any) -> list[uuid.UUID]:
    """Admission-only submits from a pool through the pooler: each submit takes a
    connection only once it holds a permit, for its one statement."""
    tag = uuid.uuid4().hex[:8]
    admitter = admission.Admitter(max_concurrent=4, admission_only=True)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pool_url,
        min_size=1,
        max_size=4,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": None},
    )
    await pool.open(wait=True)
    try:
        admitted = await asyncio.gather(
            *(
                admitter.submit(
                    pool,
                    admission.Submission(
                        play=play, params=params, release=RELEASE, idempotency_key=f"{tag}-{i}"
                    ),
                )
                for i in range(n)
            )
        )
    finally:
        await pool.close()
    return [a.run_id for a in admitted]


async def test_worker_and_admission_through_pgbouncer_transaction_mode(
    db_url: str, bouncer: hosts.PgBouncer
) -> None:
    pooled = bouncer.url(db_url)
    direct = make_conninfo(db_url, application_name=OWN)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
    worker_settings = settings(
        pooled, pool_mode=PoolMode.TRANSACTION, listen_url=bouncer.url(db_url, session=True)
    )
    async with serving(worker_settings) as worker:
        assert worker.budget is not None and worker.budget.listen == 1
        # From here on the test's own connections to the server are named OWN: every other
        # session of the database is one PgBouncer opened.
        async with connection_peaks(direct, worker) as peaks:
            ids = await admit_through(pooled, "busy", 24, steps=8, rows=5)
            await eventually(all_succeeded(direct, ids), timeout=60)
            # A cancel reaches the running attempt through the LISTEN session.
            [slow] = await admit_through(pooled, "io", 1, sleep_s=60)
            await eventually(lambda: _state_is(direct, slow, "running"), timeout=20)
            async with await db.connect(pooled, autocommit=True, mode=PoolMode.TRANSACTION) as conn:
                await runs_q.cancel(conn, slow, reason="test")
            await eventually(lambda: _state_is(direct, slow, "cancelled"), timeout=10)
        assert worker.stats["succeeded"] == 24
    # Every write went through the fence and was accepted: nothing refused, every row done.
    assert await fetch(db_url, "SELECT count(*) FROM wq_refusals") == [(0,)]
    assert await fetch(db_url, "SELECT count(*) FROM wq_sheet_rows WHERE status = 'pending'") == [
        (0,)
    ]
    # Postgres saw PgBouncer's pool (its server connections) and the session alias's
    # LISTEN session, never the worker's own connection count: the worker's pool alone
    # held more connections (to PgBouncer) than the server ever had from everyone.
    assert 0 < peaks["server"] <= POOL_SIZE + worker.budget.listen
    assert peaks["worker"] > peaks["server"]
    assert "prepared statement" not in bouncer.log()


async def _state_is(url: str, run_id: uuid.UUID, state: str) -> bool:
    rows = await fetch(url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
    return bool(rows) and rows[0][0] == state


async def test_polling_fallback_without_a_listen_url(db_url: str, bouncer: hosts.PgBouncer) -> None:
    """Behind a transaction pooler with no listen URL the worker polls: no LISTEN goes
    through the pooler, new runs are still picked up (within the poll interval), and a
    cancel arrives with the heartbeat."""
    pooled = bouncer.url(db_url)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
    async with serving(settings(pooled, pool_mode=PoolMode.TRANSACTION, poll_s=0.2)) as worker:
        assert worker.budget is not None and worker.budget.listen == 0
        assert worker.listen_url is None
        ids = await admit_through(pooled, "io", 12)
        await eventually(all_succeeded(db_url, ids), timeout=30)
        [slow] = await admit_through(pooled, "io", 1, sleep_s=60)
        await eventually(lambda: _state_is(db_url, slow, "running"), timeout=20)
        async with await db.connect(pooled, autocommit=True, mode=PoolMode.TRANSACTION) as conn:
            await runs_q.cancel(conn, slow, reason="test")
        await eventually(lambda: _state_is(db_url, slow, "cancelled"), timeout=15)
        listening = await fetch(
            db_url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query ILIKE 'LISTEN%%'",
        )
        assert listening == [(0,)]


async def test_migrate_through_a_transaction_pooler_is_refused(
    pg_admin_url: str, empty_db: Callable[[], Any]
) -> None:
    """The migration gate's advisory lock needs a session: through PgBouncer in
    transaction mode (two server connections used in turn) it refuses, releases its lock,
    and a direct migrate goes through at once."""
    url = await empty_db()
    with hosts.pgbouncer(
        url,
        users=_credentials(url),
        pool_size=2,
        settings={"server_round_robin": 1, "min_pool_size": 2},
    ) as running:
        pooled = running.url(url)
        # Two transactions at once: PgBouncer opens both server connections.
        async with (
            await psycopg.AsyncConnection.connect(pooled, prepare_threshold=None) as a,
            await psycopg.AsyncConnection.connect(pooled, prepare_threshold=None) as b,
        ):
            await a.execute("SELECT 1")
            await b.execute("SELECT 1")
        async with await psycopg.AsyncConnection.connect(
            pooled, autocommit=True, prepare_threshold=None
        ) as conn:
            with pytest.raises(MigrationFailed) as refused:
                await migrations.migrate(conn)
        assert refused.value.code == "MIGRATION_NEEDS_SESSION"
        assert "WORKER_MIGRATE_DATABASE_URL" in refused.value.render()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        async with asyncio.timeout(30):  # the lock did not stay behind
            report = await migrations.migrate(conn)
    assert report.applied


async def test_the_connection_budget_holds(db_url: str) -> None:
    """Concurrency 24 on a cap of 12 connections: every connection the worker opens is
    named after it, and there are never more than 12; the IO-bound runs all finish."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
    cap = 12
    async with serving(settings(db_url, concurrency=24, max_connections=cap)) as worker:
        assert worker.budget is not None
        assert worker.budget.total == cap
        assert worker.budget.pool == cap - connections.fixed(listening=True)
        name = f"% {worker.s.worker_id}"
        peak = 0

        async def sample() -> None:
            nonlocal peak
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mon:
                while True:
                    cur = await mon.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                        (name,),
                    )
                    row = await cur.fetchone()
                    peak = max(peak, int(row[0]) if row else 0)
                    await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            ids = [await _submit(db_url, "io", {"sleep_s": 0.05}, key=f"io-{i}") for i in range(96)]
            await eventually(all_succeeded(db_url, ids), timeout=60)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    assert 0 < peak <= cap, peak


async def _submit(url: str, play: str, params: dict[str, Any], *, key: str) -> uuid.UUID:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit(
            conn,
            admission.Submission(play=play, params=params, release=RELEASE, idempotency_key=key),
        )
    return admitted.run_id


def test_a_cap_below_the_minimum_is_refused() -> None:
    with pytest.raises(InvalidField) as refused:
        connections.plan(16, listening=True, cap=connections.minimum(listening=True) - 1)
    assert refused.value.code == "CONNECTION_BUDGET_TOO_SMALL"
    assert "heartbeat" in (refused.value.rule or "")
    polling = connections.plan(16, listening=False, cap=connections.minimum(listening=False))
    assert polling.pool == connections.POOL_MIN and polling.listen == 0
    assert connections.plan(16, listening=True).total == 16 + 3 + 5


def test_the_cli_refuses_a_cap_below_the_minimum_before_connecting() -> None:
    env = dict(os.environ, WORKER_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    env.pop("WORKER_MAX_CONNECTIONS", None)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "worker"), "start", "--max-connections", "7"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "error[CONNECTION_BUDGET_TOO_SMALL]" in done.stderr
    assert "at least 8" in done.stderr
