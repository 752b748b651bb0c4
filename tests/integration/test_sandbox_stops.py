"""A sandboxed attempt is stopped through its control channel (a line on the sandbox's
stdin, not a signal: the play runs in a PID namespace of its own): a cancel runs its cleanup
hooks in the sandbox and ends the run cancelled; a worker that stops hands its run back at
once. Real bubblewrap (missing, these fail with the reason)."""

from __future__ import annotations

import time
import uuid

import psycopg

from queues import operator, runs
from tests import ledgers
from tests.workers import eventually, fetch, running_worker, submit
from worker.plays import load_registry

SECRET = b"s" * 48
RELEASE = "sbx-stop"


async def _event(db_url: str, run_id: uuid.UUID, kind: str) -> bool:
    return bool(await ledgers.events(db_url, run_id, kind))


async def test_a_cancel_runs_the_cleanup_hooks_in_the_sandbox(db_url: str) -> None:
    registry = load_registry("tests.apps.sandboxed:registry")
    async with running_worker(db_url, registry, release=RELEASE, token_secret=SECRET):
        run_id = await submit(db_url, "sandboxed-waits", release=RELEASE)
        await eventually(lambda: _event(db_url, run_id, "play.waiting"), timeout=60)
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            await operator.cancel(conn, run_id, actor="cli:test")

        async def ended() -> runs.Run | None:
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
                run = await runs.get(conn, run_id)
            return run if run.terminal else None

        run = await eventually(ended, timeout=30)
    assert run.state == "cancelled", run
    assert await _event(db_url, run_id, "play.cleanup_ran")


async def test_a_stopping_worker_hands_a_sandboxed_run_back_at_once(db_url: str) -> None:
    registry = load_registry("tests.apps.sandboxed:registry")
    async with running_worker(db_url, registry, release=RELEASE, token_secret=SECRET, grace_s=0.5):
        run_id = await submit(db_url, "sandboxed-waits", release=RELEASE)
        await eventually(lambda: _event(db_url, run_id, "play.waiting"), timeout=60)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 15  # not the cleanup hooks' 70 s bound
    [(state, attempt)] = await fetch(
        db_url, "SELECT state::text, attempt FROM wq_runs WHERE id = %s", (run_id,)
    )
    assert (state, attempt) == ("queued", 1)
    assert not await _event(db_url, run_id, "play.cleanup_ran")
