"""One NOTIFY wakes one claimer (migration 0032), with real workers on real connections.

The workers here poll once a minute (``poll_s``), so a run is picked up within the test's
deadlines only by a wake: a lost one fails the test instead of hiding behind a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from queues import admission, lanes, runs, transport
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
from worker.runtime import Settings, Worker

RELEASE = "wake"
NO_POLL_S = 60.0
PICKUP_S = 5.0  # far below the poll: only a wake picks a run up in time

registry = Registry()
gate: dict[str, asyncio.Event] = {}  # the `hold` play's, made in each test's event loop


@registry.play("echo")
async def echo(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"worker": ctx.info.worker_id}


@registry.play("hold")
async def hold(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await gate["hold"].wait()
    return {"worker": ctx.info.worker_id}


@contextlib.asynccontextmanager
async def worker(url: str, name: str, **settings: Any) -> AsyncIterator[Worker]:
    """A worker of this module's lane that polls once a minute unless told otherwise
    (``settings``: more of its :class:`Settings`). However the block ends (a failed
    assertion too), the held plays are let go before it stops."""
    given: dict[str, Any] = {"concurrency": 10, "grace_s": 10.0, "poll_s": NO_POLL_S}
    async with running_worker(
        url, registry, release=RELEASE, worker_id=f"{name}:{uuid.uuid4().hex[:8]}",
        **(given | settings),
    ) as w:  # fmt: skip
        try:
            yield w
        finally:
            for held in gate.values():
                held.set()


async def done(url: str, run_id: uuid.UUID) -> str:
    await eventually(lambda: _succeeded(url, run_id), timeout=PICKUP_S)
    rows = await fetch(url, "SELECT worker_id FROM wq_attempts WHERE run_id = %s", (run_id,))
    [(by,)] = rows
    return str(by)


async def _succeeded(url: str, run_id: uuid.UUID) -> bool:
    return await run_state(url, run_id) == "succeeded"


async def test_idle_workers_take_turns_and_each_run_costs_one_wake(db_url: str) -> None:
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with (
        worker(db_url, "a") as a,
        worker(db_url, "b") as b,
        worker(db_url, "c") as c,
    ):
        ws = [a, b, c]
        await eventually(lambda: _all_waiting(db_url, ws), timeout=PICKUP_S)
        before = sum(w.stats["claims"] for w in ws)
        ran: Counter[str] = Counter()
        runs = 12
        for i in range(runs):
            run_id = await submit(db_url, "echo", {"i": i}, release=RELEASE)
            ran[await done(db_url, run_id)] += 1
            # Its worker's claim after the attempt ended (for a slot freed) has landed.
            await eventually(lambda: _all_waiting(db_url, ws), timeout=PICKUP_S)
        claims = sum(w.stats["claims"] for w in ws) - before
        # Per run: the woken worker's claim (plus, at most once per worker, the claim it
        # makes once its LISTEN session is up, which can land after all were seen
        # waiting). Woken by a broadcast, every idle worker claimed for each run, and the
        # one that ran it claimed again when its attempt ended: 3 + 1 per run.
        assert runs <= claims <= runs + len(ws), claims
        # Each spawn woke the next waiting worker: they took turns.
        assert sorted(ran.values()) == [runs // 3] * 3, ran


async def _all_waiting(url: str, ws: list[Worker]) -> bool:
    return all([await waiting_for_work(url, w) for w in ws])


async def test_a_woken_worker_with_no_room_passes_the_wake_on(db_url: str) -> None:
    gate["hold"] = asyncio.Event()
    await submit(db_url, "echo", release=RELEASE)
    async with worker(db_url, "full", concurrency=1) as full:
        held = await submit(db_url, "hold", release=RELEASE)
        await eventually(lambda: _running(db_url, held), timeout=PICKUP_S)
        async with worker(db_url, "idle") as idle:
            await eventually(lambda: waiting_for_work(db_url, idle), timeout=PICKUP_S)
            # A spawn that read the set before `full`'s claim (which filled its only slot)
            # committed: it sees `full` waiting, and `idle` not (say it was claiming).
            run_id = await admit_seeing(
                db_url,
                waiting=[full.s.worker_id],
                not_waiting=[idle.s.worker_id],
            )
            assert await done(db_url, run_id) == idle.s.worker_id
            # (Once more, when its claim after the first run's attempt took `held` before
            # the wake for `held` was read.)
            assert full.stats["wakes_passed_on"] >= 1
            gate["hold"].set()
            assert await done(db_url, held) == full.s.worker_id


async def _running(url: str, run_id: uuid.UUID) -> bool:
    return await run_state(url, run_id) == "running"


async def test_a_stopping_worker_is_not_woken_for_new_runs(db_url: str) -> None:
    gate["hold"] = asyncio.Event()
    await submit(db_url, "echo", release=RELEASE)
    async with worker(db_url, "stopping", grace_s=30.0) as stopping:
        held = await submit(db_url, "hold", release=RELEASE)
        await eventually(lambda: _running(db_url, held), timeout=PICKUP_S)
        async with worker(db_url, "stays") as stays:
            await eventually(lambda: waiting_for_work(db_url, stays), timeout=PICKUP_S)
            both = await fetch(
                db_url, "SELECT id FROM wq_workers WHERE waiting_since IS NOT NULL ORDER BY id"
            )
            # either may be woken
            assert both == sorted([(stopping.s.worker_id,), (stays.s.worker_id,)])
            stopping.stop()  # drains: waits for its held run
            await eventually(lambda: _left(db_url, stopping), timeout=PICKUP_S)
            run_id = await submit(db_url, "echo", release=RELEASE)
            assert await done(db_url, run_id) == stays.s.worker_id
            gate["hold"].set()
            assert await done(db_url, held) == stopping.s.worker_id


async def _left(url: str, w: Worker) -> bool:
    return not await waiting_for_work(url, w)


async def test_a_paused_worker_woken_in_vain_delays_a_run_by_one_poll_at_most(
    db_url: str,
) -> None:
    """A worker frozen with its session open (SIGSTOP, a frozen VM) still holds its liveness
    lock and keeps waiting: a spawn may wake it and nobody else. The other idle workers'
    polls (every ``poll_s``, 1 s by default) pick the run up."""
    await submit(db_url, "echo", release=RELEASE)
    async with connect(db_url) as conn, connect(db_url) as session:
        frozen = f"frozen:{uuid.uuid4().hex[:8]}"
        await runs.register_worker(
            conn, worker_id=frozen, lanes=[lanes.lane_name(RELEASE)], release=RELEASE,
            host="elsewhere", pid=1,
        )  # fmt: skip
        channel = await runs.hold_liveness(session, frozen)
        await transport.listen_wake(session, channel)
        async with worker(db_url, "polls", poll_s=Settings.poll_s) as w:
            assert w.s.poll_s == 1.0  # the default
            await eventually(lambda: waiting_for_work(db_url, w), timeout=PICKUP_S)
            # Its turn: the spawn sees the frozen worker waiting and the other one not (its
            # poll may be claiming right then).
            run_id = await admit_seeing(db_url, waiting=[frozen], not_waiting=[w.s.worker_id])
            note = await anext(session.notifies(timeout=PICKUP_S))
            assert note.channel == channel  # the frozen worker was the one woken
            assert await done(db_url, run_id) == w.s.worker_id  # by its poll
            rows = await fetch(
                db_url,
                "SELECT extract(epoch FROM r.started_at - r.created_at) FROM wq_runs r"
                " WHERE r.id = %s",
                (run_id,),
            )
            assert rows[0][0] < 3 * w.s.poll_s  # a poll or two, not a lease or a minute


async def admit_seeing(url: str, *, waiting: list[str], not_waiting: list[str]) -> uuid.UUID:
    """Admit an `echo` run whose spawn sees exactly ``waiting`` waiting: set in the
    admission's own transaction, so no claim in between changes what the spawn reads."""
    async with connect(url) as conn, conn.transaction():
        await conn.execute(
            "UPDATE wq_workers SET waiting_since = CASE WHEN id = ANY (%s) THEN now() END"
            " WHERE id = ANY (%s)",
            (waiting, waiting + not_waiting),
        )
        admitted = await admission.submit(
            conn, admission.Submission(play="echo", params={}, release=RELEASE)
        )
    return admitted.run_id


async def test_on_an_org_capped_lane_an_attempts_end_claims_the_org_s_next_run(
    db_url: str,
) -> None:
    """No spawn announces that an org fell below its cap: the worker whose attempt ended
    claims again at once (the claim said its lane caps orgs)."""
    gate["hold"] = asyncio.Event()
    await submit(db_url, "echo", release=RELEASE)
    async with connect(db_url) as conn:
        await conn.execute(
            "UPDATE wq_lanes SET org_concurrency = 1 WHERE name = %s", (lanes.lane_name(RELEASE),)
        )
    async with worker(db_url, "capped") as w:
        first = await submit(db_url, "hold", release=RELEASE, org="acme")
        await eventually(lambda: _running(db_url, first), timeout=PICKUP_S)
        empty = w.stats["claims_empty"]
        second = await submit(db_url, "echo", release=RELEASE, org="acme")
        # Woken for it, the worker claims and finds acme at its cap: nothing taken.
        await eventually(lambda: _claimed_nothing_since(w, empty), timeout=PICKUP_S)
        assert await run_state(db_url, second) == "queued"
        gate["hold"].set()
        assert await done(db_url, first) == w.s.worker_id
        assert await done(db_url, second) == w.s.worker_id  # not at the next poll


async def _claimed_nothing_since(w: Worker, since: int) -> bool:
    return w.stats["claims_empty"] > since
