"""A wake that comes while the claim loop waits is claimed by the LISTEN loop itself, in the
turn that read it; claims stay one at a time, never take more than there is room for, put
off the claim loop's poll, and a stop hands back whatever such a claim took. Real workers
on real connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import uuid
from contextlib import AbstractAsyncContextManager
from typing import Any

from queues import admission, lanes, runs
from tests.workers import (
    connect,
    eventually,
    fetch,
    run_state,
    running_worker,
    submit,
    waiting_for_work,
)
from worker.context import RunContext
from worker.plays import Registry
from worker.runtime import Worker

RELEASE = "onwake"
NO_POLL_S = 60.0

registry = Registry()
gate: dict[str, asyncio.Event] = {}  # the `hold` play's, made in each test's event loop


@registry.play("echo")
async def echo(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"i": params.get("i")}


@registry.play("hold")
async def hold(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await gate["hold"].wait()
    return {"i": params.get("i")}


def worker(url: str, **overrides: Any) -> AbstractAsyncContextManager[Worker]:
    """A worker of this module's lane that polls once a minute unless told otherwise."""
    given: dict[str, Any] = {
        "concurrency": 10,
        "grace_s": 10.0,
        "poll_s": NO_POLL_S,
        "worker_id": f"onwake:{uuid.uuid4().hex[:8]}",
    }
    return running_worker(url, registry, release=RELEASE, **(given | overrides))


async def _attempts(url: str, run_id: uuid.UUID) -> int:
    rows = await fetch(url, "SELECT count(*) FROM wq_attempts WHERE run_id = %s", (run_id,))
    return int(rows[0][0])


async def test_a_wake_is_claimed_by_the_listen_loop(db_url: str) -> None:
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with worker(db_url) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        await asyncio.sleep(0.2)  # its claim loop is back in its wait
        before = dict(w.stats)
        runs = 6
        for i in range(runs):
            run_id = await submit(db_url, "echo", {"i": i}, release=RELEASE)
            # Far below the poll (a minute): only the wake picked it up.
            await eventually(functools.partial(_succeeded, db_url, run_id), timeout=5)
            assert await _attempts(db_url, run_id) == 1
        # Each run was one claim, made by the LISTEN loop; the claim loop made none.
        assert w.stats["claims_on_wake"] - before["claims_on_wake"] == runs, w.stats
        assert w.stats["claims"] - before["claims"] == runs, w.stats
        assert w.stats["claims_empty"] == before["claims_empty"], w.stats


async def test_claims_on_wake_put_off_the_poll(db_url: str) -> None:
    """A claim the LISTEN loop made has just looked for work: the claim loop's poll comes a
    period after it, as after a claim of its own. Runs admitted every 0.1 s to a worker
    polling every second make no empty claim (without the reschedule: one a second)."""
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with worker(db_url, poll_s=1.0) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        await asyncio.sleep(0.2)  # its claim loop is back in its wait
        first = await submit(db_url, "echo", {"i": -1}, release=RELEASE)
        await eventually(lambda: _succeeded(db_url, first), timeout=5)
        before = dict(w.stats)
        admitted = []
        for i in range(30):
            admitted.append(await submit(db_url, "echo", {"i": i}, release=RELEASE))
            await asyncio.sleep(0.1)

        async def all_done() -> bool:
            return all([await _succeeded(db_url, r) for r in admitted])

        await eventually(all_done, timeout=10)
        assert w.stats["claims_empty"] == before["claims_empty"], w.stats
        assert w.stats["claims"] - before["claims"] == 30, w.stats


async def _succeeded(url: str, run_id: uuid.UUID) -> bool:
    return await run_state(url, run_id) == "succeeded"


async def _running(url: str, w: Worker) -> int:
    rows = await fetch(
        url,
        "SELECT count(*) FROM wq_runs WHERE state = 'running' AND lease_owner = %s",
        (w.s.worker_id,),
    )
    return int(rows[0][0])


async def test_two_claimers_never_take_more_than_the_free_slots(db_url: str) -> None:
    """The claim loop polls every 20 ms (its claims race the LISTEN loop's) while runs are
    admitted in bursts from several connections: the runs leased to the worker never
    exceed its slots, and none is claimed ahead or handed back."""
    gate["hold"] = asyncio.Event()
    slots = 2
    async with connect(db_url) as conn:
        await lanes.prepare(conn, RELEASE)
    async with worker(db_url, concurrency=slots, poll_s=0.02, claim_ahead_under_s=0.0) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        run_ids: list[uuid.UUID] = []

        async def admit(k: int) -> None:
            async with connect(db_url) as conn:
                for j in range(4):
                    admitted = await admission.submit(
                        conn,
                        admission.Submission(
                            play="hold", params={"i": k * 10 + j}, release=RELEASE
                        ),
                    )
                    run_ids.append(admitted.run_id)

        seen: list[int] = []

        async def watch() -> None:
            while True:
                seen.append(await _running(db_url, w))
                seen.append(len(w.live) + len(w.ahead))
                await asyncio.sleep(0.005)

        watching = asyncio.create_task(watch())
        try:
            await asyncio.gather(*(admit(k) for k in range(4)))
            await eventually(lambda: _running(db_url, w))
            await asyncio.sleep(0.3)  # many polls and wakes against full slots
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        # While every play held its slot. (Once they return, finishing attempts may
        # outnumber the slots until the batched final write: they hold none.)
        assert max(seen) == slots, seen
        gate["hold"].set()

        async def all_done() -> bool:
            states = [await run_state(db_url, r) for r in run_ids]
            return all(s == "succeeded" for s in states)

        await eventually(all_done, timeout=30)
        assert w.stats["ahead_expired"] == 0
        rows = await fetch(
            db_url,
            "SELECT count(*), count(DISTINCT run_id) FROM wq_attempts WHERE run_id = ANY(%s)",
            (run_ids,),
        )
        assert rows == [(16, 16)]  # one attempt each: nothing was handed back


async def test_a_stop_hands_back_what_a_claim_on_wake_took(db_url: str) -> None:
    """Stops right after a submit, at random points around the LISTEN loop's claim: the
    run ends up run or back in its lane, never leased to the stopped worker."""
    gate["hold"] = asyncio.Event()  # never set: a started run is handed back at the stop
    async with connect(db_url) as conn:
        await lanes.prepare(conn, RELEASE)
    rng = random.Random(7)
    for _ in range(20):
        async with worker(db_url, concurrency=1, grace_s=0.2) as w:
            await eventually(lambda: waiting_for_work(db_url, w))
            await asyncio.sleep(0.05)
            run_id = await submit(db_url, "hold", release=RELEASE)
            await asyncio.sleep(rng.uniform(0, 0.002))
        # The block's exit stopped the worker and waited for it.
        rows = await fetch(
            db_url,
            "SELECT r.state::text, r.lease_owner, j.status::text"
            "  FROM wq_runs r LEFT JOIN procrastinate_jobs j ON j.id = r.job_id"
            " WHERE r.id = %s",
            (run_id,),
        )
        [(state, owner, job)] = rows
        # Never started (the stop came first) or handed back: queued, its job waiting.
        assert (state, owner, job) == ("queued", None, "todo"), rows
        async with connect(db_url) as conn:  # leave the lane empty for the next round
            cancelled = await runs.cancel(conn, run_id, reason="test round over")
            assert cancelled.after == "cancelled"
