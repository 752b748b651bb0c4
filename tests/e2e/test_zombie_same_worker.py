"""A zombie of the same worker id: only the attempt number fences its late writes.

The zombie tests (``tests/e2e/test_zombies.py``) give worker A and worker B ids of their
own, and B has ended the run before A writes; a fence that checked only the lease owner,
or only the run's state, would refuse A's writes there too. Here both processes run under
one fixed worker id (``Settings.worker_id``: a deployment may give each worker slot a
name of its own, which a restarted process takes again), and A's late writes reach the
database while B still runs the run under that id. The run is then ``running``, its lease
owner is A's id too, and its write version is the one A admitted its rows under (the
run's stable write intent): only the attempt number tells A's writes from B's.

1. Worker A (a real worker process, its id fixed) runs attempt 1 of a ``same_worker`` run:
   it admits its rows, records a step, and meets the test at a rendezvous (``meet``).
2. A is SIGSTOPped past its lease; a real recovery pass (``worker recover --once``) closes
   attempt 1 (``lease_expired``) and queues the run.
3. Worker B, a new process with the same worker id, claims the run as attempt 2 and holds
   it running at a rendezvous of its own (``hold``), its lease renewed.
4. SIGCONT A: its watchdog stops the attempt (no renewal for longer than the lease); the
   rendezvous notes the stop and goes on once released, like code that does not notice it
   was told to stop. A completes its rows, records a step and returns: three writes, each
   refused by the attempt fence (``wq_refusals`` rows of attempt 1: ``rows``, ``receipt``,
   ``final``), and nothing of the run changed.
5. B is released and ends the run: every row, the step and the result are attempt 2's.

Run as a module (``python -m tests.e2e.test_zombie_same_worker WORKER_ID READY_FILE``),
this file is the worker process: the plays below, under the fixed id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg

from queues import lanes, sheets
from queues.errors import FenceError
from tests.apps.zombie import URL_ENV, ZOMBIE_DDL, mark, rendezvous
from tests.e2e.test_zombies import (
    TERMINAL,
    Worker,
    diagnose,
    eventually,
    lease_lapsed,
    one,
    recover,
    refusals,
    snapshot,
    spawned,
    stop,
    wait_mark,
)
from tests.workers import submit
from worker import logs, runtime
from worker.context import RunContext
from worker.plays import Registry

registry = Registry()

PLAY = "same_worker"
RELEASE = "same"
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.5
ROWS = 4
ROW_KEYS = [f"r{i:03d}" for i in range(ROWS)]
POLL_S = 0.02
OPEN = (
    sheets.Disposition.ADMITTED,
    sheets.Disposition.READMITTED,
    sheets.Disposition.ALREADY_CURRENT,
)


# ---- the play (runs in the worker processes) ---------------------------------------------


async def hold(ctx: RunContext, point: str) -> None:
    """A later attempt's rendezvous: mark ``point`` and wait until the test releases it,
    so the attempt stays live (its lease renewed) meanwhile."""
    await mark(ctx, point)
    async with await psycopg.AsyncConnection.connect(os.environ[URL_ENV], autocommit=True) as own:
        while True:
            cur = await own.execute(
                "SELECT 1 FROM zombie_releases WHERE run_id = %s AND point = %s",
                (ctx.run_id, point),
            )
            if await cur.fetchone() is not None:
                return
            await asyncio.sleep(POLL_S)


@registry.play(PLAY)
async def same_worker(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Admit rows under the run's stable write intent and record a step; meet the test
    (attempt 1 at ``meet``, a later attempt at ``hold``); then complete the rows, record a
    second step and return, each write carrying the attempt that made it. A refused write
    is noted and the play goes on, so each of its writes reaches the database."""
    sheet = ctx.sheet("same_worker")
    admitted = await sheet.admit(
        [(key, {"i": i}) for i, key in enumerate(ROW_KEYS)], stable_intent=True
    )
    open_keys = [r.key for r in admitted.rows if r.disposition in OPEN]

    async def enrich() -> dict[str, Any]:
        return {"by": ctx.attempt}

    enriched = await ctx.step("enrich", enrich)
    if ctx.attempt == 1:
        await rendezvous(ctx, "meet")
    else:
        await hold(ctx, "hold")
    fenced: list[str] = []
    completions = [sheets.RowCompletion(key=k, output={"writer": ctx.attempt}) for k in open_keys]
    try:
        await sheet.complete(completions)
    except FenceError as exc:
        fenced.append(exc.code)

    async def late() -> dict[str, Any]:
        return {"by": ctx.attempt}

    try:
        await ctx.step("late", late)
    except FenceError as exc:
        fenced.append(exc.code)
    return {
        "attempt": ctx.attempt,
        "enriched": enriched,
        "completed": len(open_keys),
        "fenced": fenced,
        "write_version": sheet.write_version,
    }


def main() -> int:
    """The worker process: serve the lane with the plays above under a fixed worker id
    (argv: the id, the ready file), JSON log lines on stderr."""
    worker_id, ready = sys.argv[1], Path(sys.argv[2])
    logs.configure(level="INFO", json=True)
    settings = runtime.Settings(
        url=os.environ["WORKER_DATABASE_URL"],
        release=RELEASE,
        registry=registry,
        grace_s=1.0,
        ready_file=ready,
        worker_id=worker_id,
    )
    return asyncio.run(runtime.serve(settings))


# ---- the test ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def worker(db_url: str, tmp_path: Path, name: str, worker_id: str) -> AsyncIterator[Worker]:
    """A worker process (its own session) under ``worker_id`` that reported ready; stopped
    on the way out whatever happened (:func:`tests.e2e.test_zombies.stop`)."""
    ready = tmp_path / f"{name}.ready"
    command = [sys.executable, "-m", "tests.e2e.test_zombie_same_worker", worker_id, str(ready)]
    async with spawned(db_url, tmp_path, name, command, ready) as w:
        yield w


async def release(url: str, run_id: uuid.UUID, point: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO zombie_releases (run_id, point) VALUES (%s, %s)", (run_id, point)
        )


async def standing(url: str, run_id: uuid.UUID) -> dict[str, list[tuple[Any, ...]]]:
    """Everything of the run an attempt's writes could change (:func:`snapshot`), but the
    run row without its lease's expiry and ``updated_at``: B's heartbeats renew the lease
    while it holds attempt 2."""
    state = await snapshot(url, run_id)
    state["run"] = [row[:5] + row[6:11] for row in state["run"]]
    return state


async def test_a_zombie_of_the_same_worker_id_is_fenced_by_its_attempt_number(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(ZOMBIE_DDL)
        await lanes.prepare(conn, RELEASE)
        await lanes.set_policy(
            conn,
            RELEASE,
            lease_ttl_s=LEASE_TTL_S,
            heartbeat_s=HEARTBEAT_S,
            retry_base_s=0.0,
            retry_jitter=0.0,
        )
    worker_id = f"slot-0-{uuid.uuid4().hex[:6]}"
    async with worker(db_url, tmp_path, "a", worker_id) as a:
        run_id = await submit(db_url, PLAY, release=RELEASE)
        await wait_mark(db_url, run_id, "meet")
        a.signal(signal.SIGSTOP)

        async def a_stopped() -> bool:
            return a.state() == "T"

        await eventually(a_stopped, "worker A to be stopped")

        async def lapsed() -> bool:
            return await lease_lapsed(db_url, run_id)

        await eventually(lapsed, "attempt 1's lease to lapse")
        rescue = await recover(db_url)
        async with worker(db_url, tmp_path, "b", worker_id) as b:
            await wait_mark(db_url, run_id, "hold", attempt=2)
            # B holds attempt 2, live, under the very id that held attempt 1.
            before = await standing(db_url, run_id)
            assert await refusals(db_url, run_id) == []

            # A goes on: its watchdog stops the attempt (the rendezvous notes it and waits
            # on); then it is released and writes.
            a.signal(signal.SIGCONT)
            await wait_mark(db_url, run_id, "meet:stopped")
            await release(db_url, run_id, "meet")

            async def a_finished() -> list[dict[str, Any]]:
                return a.events("attempt_finished", run_id, 1)

            await eventually(a_finished, "worker A to finish its attempt")
            refused = await refusals(db_url, run_id)
            after = await standing(db_url, run_id)

            await release(db_url, run_id, "hold")

            async def ended() -> str | None:
                state = await one(
                    db_url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,)
                )
                return state if state in TERMINAL else None

            try:
                await eventually(ended, "worker B to end the run")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{await diagnose(db_url, run_id, a, b)}") from None
            final = await snapshot(db_url, run_id)
            exits = {"b": await stop(b)}
        exits["a"] = await stop(a)

    # One id for both processes: the fence had nothing but the attempt number to go by.
    assert a.worker_id == b.worker_id == worker_id
    (rescued,) = [e for e in rescue["expired"] if e["run_id"] == str(run_id)]
    assert rescued["attempt"] == 1 and rescued["state"] == "queued"
    run_state, run_attempt, _, _, lease_owner = before["run"][0][:5]
    assert (run_state, run_attempt, lease_owner) == ("running", 2, worker_id)
    assert [(n, outcome, wid) for n, outcome, wid, _, _ in before["attempts"]] == [
        (1, "lease_expired", worker_id),
        (2, "running", worker_id),
    ]
    ((_, intent),) = before["intents"]
    assert {version for _, _, _, version, _, _ in before["rows"]} == {intent}

    # A's three late writes reached the database and were refused, as attempt 1's ...
    assert refused == [(1, "rows", ROWS), (1, "receipt", 1), (1, "final", 1)]
    # ... and changed nothing of the run attempt 2 was running.
    assert after == before
    assert a.events("lease_lost", run_id, 1)
    (finished,) = a.events("attempt_finished", run_id, 1)
    assert finished["outcome"] == "superseded" and finished["final_write"] == "refused"

    # B ended the run: every row, the late step and the result are attempt 2's. What stands
    # of attempt 1 it wrote before its close: its admission (the run's write intent) and
    # its `enrich` step, which B replayed.
    state, attempt, result = final["run"][0][:3]
    assert (state, attempt) == ("succeeded", 2)
    assert result == {
        "attempt": 2,
        "enriched": {"by": 1},
        "completed": ROWS,
        "fenced": [],
        "write_version": intent,
    }
    rows = {key: (status, n, output) for key, status, n, _, output, _ in final["rows"]}
    assert rows == {key: ("done", 2, {"writer": 2}) for key in ROW_KEYS}
    receipts = {key: (status, owner, value) for key, status, owner, value, _ in final["receipts"]}
    assert receipts == {
        "enrich": ("completed", 1, {"by": 1}),
        "late": ("completed", 2, {"by": 2}),
    }
    assert [(n, outcome, wid) for n, outcome, wid, _, _ in final["attempts"]] == [
        (1, "lease_expired", worker_id),
        (2, "succeeded", worker_id),
    ]
    assert await refusals(db_url, run_id) == refused  # B's own writes were all accepted
    assert exits == {"a": 0, "b": 0}


if __name__ == "__main__":
    sys.exit(main())
