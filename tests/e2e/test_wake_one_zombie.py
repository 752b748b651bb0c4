"""The zombie test of one wake per new job (migration 0032), with a real worker process.

A worker process that is waiting for work is SIGSTOPped past its lane's lease: its LISTEN
session, and its liveness lock, live on, so it stays in the set of waiting workers and
spawns keep choosing it in its turn. The runs woken for it in vain are taken by the other
worker's poll (every second), never lost and never run twice; after SIGCONT the paused
worker reads the wakes it slept through (its claims find nothing) and takes its turns
again. Its own row is all it writes to the set: nothing of an attempt's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psycopg

from queues import lanes
from tests.apps.plays import registry
from tests.workers import eventually, fetch, running_worker, submit, worker_process

LEASE_S = 4.0
PICKUP_S = 3.0  # a poll (1 s) or two, not a lease


def start_worker(url: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    return worker_process(url, tmp_path / "worker-a.log", "--app", "tests.apps.plays:registry")


async def waiting_worker(url: str, pid: int) -> str | None:
    """The worker of process ``pid`` once it waits for work and holds its liveness lock (its
    LISTEN session, where its own wakes arrive, is up: its claims begin beside it)."""
    rows = await fetch(
        url,
        "SELECT id FROM wq_workers WHERE pid = %s AND waiting_since IS NOT NULL"
        " AND stopped_at IS NULL AND liveness_key IS NOT NULL",
        (pid,),
    )
    return str(rows[0][0]) if rows else None


async def run_by(url: str, run_id: uuid.UUID) -> str | None:
    """The worker whose attempt finished the run, once it succeeded."""
    rows = await fetch(
        url,
        "SELECT a.worker_id FROM wq_runs r JOIN wq_attempts a ON a.run_id = r.id"
        " WHERE r.id = %s AND r.state = 'succeeded'",
        (run_id,),
    )
    return str(rows[0][0]) if rows else None


async def finished_by(url: str, run_id: uuid.UUID) -> str:
    return await eventually(lambda: run_by(url, run_id), timeout=PICKUP_S)


async def test_a_paused_waiting_worker_delays_runs_by_a_poll_and_takes_turns_again(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=LEASE_S, heartbeat_s=1.0)
    a = start_worker(db_url, tmp_path)
    try:
        paused = await eventually(lambda: waiting_worker(db_url, a.pid), timeout=30)
        async with running_worker(db_url, registry, release="t") as b:
            live = b.s.worker_id
            await eventually(lambda: waiting_worker(db_url, os.getpid()), timeout=10)

            a.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            slept: list[uuid.UUID] = []
            for i in range(6):  # about half of them the paused one's turn
                run_id = await submit(db_url, "echo", {"i": i}, release="t")
                assert await finished_by(db_url, run_id) == live
                slept.append(run_id)
            assert await waiting_worker(db_url, a.pid) == paused  # still waiting, as it is
            await asyncio.sleep(max(0.0, stopped + LEASE_S + 1 - time.monotonic()))
            a.send_signal(signal.SIGCONT)  # paused past the lease

            woke: list[str] = []
            for i in range(6):
                run_id = await submit(db_url, "echo", {"i": 10 + i}, release="t")
                woke.append(await finished_by(db_url, run_id))
            assert set(woke) == {paused, live}  # turns again
    finally:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=30)
    attempts = await fetch(
        db_url,
        "SELECT attempt, worker_id, outcome::text FROM wq_attempts WHERE run_id = ANY (%s)",
        (slept,),
    )
    assert sorted(attempts) == [(1, live, "succeeded")] * 6  # each once, by the live worker
