"""Helpers for tests that run a worker in-process or poll the database."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from queues import admission, lanes
from worker.plays import Registry
from worker.runtime import CLAIM_AHEAD_UNDER_S, Settings, Worker

T = TypeVar("T")


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """An autocommit connection of its own, closed when the block ends."""
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


READY_S = 30.0  # how long an in-process worker may take to start, on a loaded machine


@contextlib.asynccontextmanager
async def running_worker(
    url: str,
    registry: Registry,
    *,
    release: str = "t",
    concurrency: int = 8,
    grace_s: float = 2.0,
    token_secret: bytes | None = None,
    prefetch: int = 0,
    claim_ahead_under_s: float = CLAIM_AHEAD_UNDER_S,
    **settings: Any,
) -> AsyncIterator[Worker]:
    """A worker consuming ``release``'s lane in this event loop until the block ends
    (``settings``: more of its :class:`Settings`, such as ``poll_s``). Its start and its
    stop are bounded (:data:`READY_S`, the grace plus 30 s): a test that fails never hangs
    its session."""
    worker = Worker(
        Settings(
            url=url,
            release=release,
            registry=registry,
            concurrency=concurrency,
            grace_s=grace_s,
            install_signals=False,
            token_secret=token_secret,
            prefetch=prefetch,
            claim_ahead_under_s=claim_ahead_under_s,
            **settings,
        )
    )
    serving = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED, timeout=READY_S)
    if serving.done():
        ready.cancel()
        raise RuntimeError(f"worker exited before ready: {serving.result()!r}")
    if not ready.done():
        ready.cancel()
        worker.stop()
        await asyncio.wait_for(serving, timeout=grace_s + 30)
        raise AssertionError(f"worker {worker.s.worker_id} not ready within {READY_S} s")
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(serving, timeout=grace_s + 30)


def together(*calls: Callable[[], T]) -> list[T]:
    """The results of ``calls`` run at once, each in a thread (independent commands that
    wait on processes and the database); the first failure is raised once all are done."""
    with ThreadPoolExecutor(len(calls)) as pool:
        running = [pool.submit(call) for call in calls]
    return [r.result() for r in running]


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, timeout: float = 15.0, interval: float = 0.05
) -> T:
    """Poll ``probe`` until it returns a truthy value; fail with the last value at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


async def submit(
    url: str,
    play: str,
    params: dict[str, Any] | None = None,
    *,
    release: str = "t",
    org: str = "default",
    inputs: list[tuple[str, Any]] | None = None,
) -> uuid.UUID:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await lanes.prepare(conn, release)
        admitted = await admission.submit(
            conn,
            admission.Submission(play=play, params=params or {}, release=release, org=org),
            inputs=inputs,
        )
    return admitted.run_id


async def run_state(url: str, run_id: uuid.UUID) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT state::text FROM wq_runs WHERE id = %s", (run_id,))
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def waiting_for_work(url: str, worker: Worker) -> bool:
    """Whether ``worker`` is in the set of workers waiting for work (its last claim came
    back short: a spawn may wake it on its own channel, migration 0032)."""
    rows = await fetch(
        url, "SELECT waiting_since FROM wq_workers WHERE id = %s", (worker.s.worker_id,)
    )
    return bool(rows) and rows[0][0] is not None


async def fetch(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(query, params)  # type: ignore[arg-type]
        return await cur.fetchall()


ROOT = Path(__file__).resolve().parents[1]
WORKER_COMMAND = str(Path(sys.executable).parent / "worker")


def worker_process(url: str, log: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    """A real ``worker start --release t ARGS`` process on ``url`` (``env``: more
    variables), its output in ``log``."""
    with open(log, "wb") as out:  # the process keeps its own copy
        return subprocess.Popen(
            [WORKER_COMMAND, "start", "--release", "t", *args],
            env=dict(os.environ, WORKER_DATABASE_URL=url, PYTHONPATH=str(ROOT), **env),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@contextlib.asynccontextmanager
async def login_users(url: str, roles: Sequence[str]) -> AsyncIterator[dict[str, str]]:
    """A login user in each of the group ``roles`` (``wq_worker``, ``wq_admission``,
    ``wq_reader``), made as a deployment makes them (``CREATE ROLE ... LOGIN IN ROLE``);
    URLs by role. Dropped when the block ends."""
    made: dict[str, str] = {}
    names: list[str] = []
    params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    async with connect(url) as admin:
        for role in roles:
            name = f"t_{role}_{uuid.uuid4().hex[:8]}"
            password = secrets.token_urlsafe(16)
            await admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(name), sql.Literal(password), sql.Identifier(role)
                )
            )
            names.append(name)
            made[role] = make_conninfo(**(params | {"user": name, "password": password}))
    try:
        yield made
    finally:
        async with connect(url) as admin:
            for name in names:
                # Sessions of the role must be gone before it can be dropped.
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (name,),
                )
                with contextlib.suppress(psycopg.Error):
                    await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


ROOT = Path(__file__).resolve().parents[1]
WORKER_COMMAND = str(Path(sys.executable).parent / "worker")


def durable_worker(
    url: str, ready: Path, *, concurrency: int = 2, args: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """A ``worker start`` process on lane ``t`` serving ``tests.apps.durable``, whose plays
    count their side effects in the same database; ``ready`` is its ready file."""
    env = dict(os.environ, WORKER_DATABASE_URL=url, TEST_SIDE_EFFECTS_URL=url, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [
            *(WORKER_COMMAND, "start", "--release", "t", "--app", "tests.apps.durable:registry"),
            *("--concurrency", str(concurrency), "--ready-file", str(ready), *args),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
