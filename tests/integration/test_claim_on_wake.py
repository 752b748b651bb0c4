"""A wake that comes while the claim loop waits is claimed by the LISTEN loop itself, in the
turn that read it; claims stay one at a time, never take more than there is room for, put
off the claim loop's poll, and a stop hands back whatever such a claim took. Real workers
on real connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import random
import uuid
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from psycopg import sql

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
from worker.runtime import Worker

RELEASE = "onwake"
NO_POLL_S = 3600.0  # no poll within a test, however slow the machine
CLOCK_SLACK_S = 0.001  # the event loop runs a timer up to its clock's resolution early

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
    """A worker of this module's lane that does not poll unless told otherwise."""
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


async def _quiet(w: Worker) -> bool:
    """Whether the claim loop waits for work with no wake pending and no claim under way:
    a wake now is claimed by the LISTEN loop."""
    return w.producer.idle and not w.wake.is_set() and not w.producer.claim_lock.locked()


async def settled(url: str, w: Worker) -> None:
    """Wait until the LISTEN loop has claimed a run for a wake, then until the claim loop is
    quiet again (:func:`_quiet`). A worker is ready before its LISTEN session is up; the
    session's start sets the wake (for jobs spawned before it listened), and until that
    wake's claim is behind it a spawn's wake may go to the claim loop instead. A claim on
    wake proves the session listens and its start's wake has been claimed."""

    async def claimed_on_wake() -> bool:
        await eventually(lambda: _quiet(w))
        before = w.stats["claims_on_wake"]
        run_id = await submit(url, "echo", release=RELEASE)
        await eventually(functools.partial(_succeeded, url, run_id))
        return w.stats["claims_on_wake"] > before

    try:
        await eventually(claimed_on_wake, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"the LISTEN loop claimed no run for a wake: {w.stats}") from exc
    await eventually(lambda: _quiet(w))


async def test_a_wake_is_claimed_by_the_listen_loop(db_url: str) -> None:
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with worker(db_url) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        await settled(db_url, w)
        before = dict(w.stats)
        runs = 6
        for i in range(runs):
            run_id = await submit(db_url, "echo", {"i": i}, release=RELEASE)
            # The worker does not poll: only the wake can have picked it up.
            await eventually(functools.partial(_succeeded, db_url, run_id))
            assert await _attempts(db_url, run_id) == 1
        # Each run was one claim, made by the LISTEN loop; the claim loop made none.
        assert w.stats["claims_on_wake"] - before["claims_on_wake"] == runs, w.stats
        assert w.stats["claims"] - before["claims"] == runs, w.stats
        assert w.stats["claims_empty"] == before["claims_empty"], w.stats


async def test_a_poll_due_during_a_claim_on_wake_does_not_stop_the_listen_loop(
    db_url: str,
) -> None:
    """The claim loop's poll can come due while the LISTEN loop's claim is under way (a slow
    claim, a busy machine): asyncio then holds that poll as expiring, cancelling the claim
    loop's wait, and refuses to move it. The claim on wake must leave it be (the claim loop
    claims next), not raise: a raise ended the LISTEN loop and with it the worker.

    The state is made exactly: a poll whose timer has fired, its waiter not yet resumed."""
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with worker(db_url) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        await settled(db_url, w)

        async def waiter() -> None:
            async with poll:
                await asyncio.Event().wait()

        poll = asyncio.timeout(NO_POLL_S)
        parked = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the waiter entered its timeout
        poll._on_timeout()  # the timer fires: expiring, the waiter's cancel not yet run
        assert poll.expired()

        async def looked() -> tuple[int, int]:
            return 0, 1  # a claim that found nothing

        real_poll, real_claim = w.producer.poll, w.producer.claim
        w.producer.poll, w.producer.claim = poll, looked  # type: ignore[method-assign]
        try:
            assert await w.producer.claim_woken()
        finally:
            w.producer.poll, w.producer.claim = real_poll, real_claim  # type: ignore[method-assign]
        with contextlib.suppress(TimeoutError):
            await parked
        # The worker still claims on wake.
        before = w.stats["claims_on_wake"]
        run_id = await submit(db_url, "echo", release=RELEASE)
        await eventually(functools.partial(_succeeded, db_url, run_id))
        assert w.stats["claims_on_wake"] > before, w.stats


@dataclass(frozen=True, slots=True)
class Claim:
    """One claim statement of a worker, timed on its event loop's clock."""

    on_wake: bool  # made by the LISTEN loop (the claim loop was waiting for work)
    woken: bool  # the wake event was set as it began (else a claim loop's claim is a poll)
    began: float
    ended: float
    got: int
    want: int


def record_claims(w: Worker) -> list[Claim]:
    """The claims ``w`` makes from now on, in the order they end (claims are one at a
    time, so that is also the order they begin)."""
    made: list[Claim] = []
    original = w.producer.claim

    async def claim() -> tuple[int, int]:
        clock = asyncio.get_running_loop().time
        on_wake, woken, began = w.producer.idle, w.wake.is_set(), clock()
        got, want = await original()
        if want:
            made.append(Claim(on_wake, woken, began, clock(), got, want))
        return got, want

    w.producer.claim = claim  # type: ignore[method-assign]
    return made


async def test_claims_on_wake_put_off_the_poll(db_url: str) -> None:
    """A claim the LISTEN loop made has just looked for work: the claim loop's poll comes a
    period after it, as after a claim of its own (without the reschedule, a worker woken
    every 0.1 s and polling every second would make an empty claim every second).

    Runs are admitted one after another for two periods, then the test waits for the poll
    that follows them. Whatever the load, a poll never begins within a period of the end
    of the claim before it; and the settling claim on wake fell within the claim loop's
    first wait, so a poll timed from that wait's start alone breaks the rule."""
    poll_s = 1.0
    await submit(db_url, "echo", release=RELEASE)  # prepares the lane; a first run
    async with worker(db_url, poll_s=poll_s) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        made = record_claims(w)
        await settled(db_url, w)
        clock = asyncio.get_running_loop().time
        until = clock() + 2 * poll_s
        admitted: list[uuid.UUID] = []
        while clock() < until:
            run_id = await submit(db_url, "echo", {"i": len(admitted)}, release=RELEASE)
            admitted.append(run_id)
            await eventually(functools.partial(_succeeded, db_url, run_id))
        last = len(made)

        async def polled() -> bool:
            return any(not c.on_wake for c in made[last:])

        await eventually(polled)
    assert any(c.on_wake for c in made), made
    for earlier, later in itertools.pairwise(made):
        if later.on_wake or later.woken or earlier.got >= earlier.want:
            continue  # not a poll: claimed for a wake, or at once after a full claim
        assert later.began - earlier.ended >= poll_s - CLOCK_SLACK_S, (earlier, later, made)
    rows = await fetch(
        db_url,
        "SELECT count(*), count(DISTINCT run_id) FROM wq_attempts WHERE run_id = ANY(%s)",
        (admitted,),
    )
    assert rows == [(len(admitted), len(admitted))]


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
                seen.append(len(w.slots.live) + len(w.slots.ahead))
                await asyncio.sleep(0.005)

        watching = asyncio.create_task(watch())
        try:
            await asyncio.gather(*(admit(k) for k in range(4)))

            async def full() -> bool:
                return await _running(db_url, w) == slots

            await eventually(full)
            await wakes_read(db_url, w)  # every wake the bursts sent met full slots
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


async def wakes_read(url: str, w: Worker) -> None:
    """Wait until the LISTEN loop has read every notification sent before this call: a
    control message naming a run of ``w``'s (with no cancel request, so it stops nothing)
    is sent, and ``w`` looks the run up once it reads the message. Notifications come in
    the order they were committed, and the LISTEN loop reads the next one only once it is
    done with the one before (a claim on wake included)."""
    run_id = next(iter(w.slots.live))
    checks = w.stats["control_checks"]
    async with connect(url) as conn:
        await conn.execute(
            sql.SQL("NOTIFY {}, {}").format(
                sql.Identifier(transport.CONTROL_CHANNEL),
                sql.Literal(json.dumps({"cancel": str(run_id)})),
            )
        )

    async def looked_up() -> bool:
        return w.stats["control_checks"] > checks

    await eventually(looked_up)


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
            await settled(db_url, w)  # the submit's wake is claimed by the LISTEN loop
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


async def test_a_slot_freed_while_a_wake_is_passed_on_is_seen(
    db_url: str, monkeypatch: Any
) -> None:
    """The claim loop, its slots full and a wake for this worker alone pending, passes the
    wake on (a round trip); a play that returns and a final write that lands during that
    round trip free the slot. The loop must see the slot: it once cleared the signal after
    the round trip and then waited for another that never came (the worker claimed nothing
    more until stopped; only a poll, or another run ending, woke it)."""
    gate["hold"] = asyncio.Event()
    async with connect(db_url) as conn:
        await lanes.prepare(conn, RELEASE)
    async with worker(db_url, concurrency=1) as w:
        await eventually(lambda: waiting_for_work(db_url, w))
        held = await submit(db_url, "hold", release=RELEASE)

        async def holding() -> bool:
            return held in w.slots.live

        await eventually(holding)  # the one slot is taken
        real = runs.stop_waiting

        async def stop_waiting(conn: Any, worker_id: str) -> None:
            # The pass-on's round trip: the held play returns and its attempt ends meanwhile.
            gate["hold"].set()

            async def over() -> bool:
                return held not in w.slots.live

            await eventually(over)
            await real(conn, worker_id)

        monkeypatch.setattr(runs, "stop_waiting", stop_waiting)
        w.producer.targeted = True  # a wake for this worker alone came, with no room for it
        w.capacity.set()  # the claim loop looks again: no room, so it passes the wake on
        after = await submit(db_url, "echo", release=RELEASE)
        await eventually(functools.partial(_succeeded, db_url, after), timeout=10)


async def test_a_listening_worker_claims_once_it_holds_its_liveness_lock(
    db_url: str, monkeypatch: Any
) -> None:
    """Its LISTEN session holds the worker's liveness lock; a worker killed before it took
    the lock is not known gone, so runs it had claimed waited for their leases to lapse.
    The first claim now waits for the lock: however long the session takes to get it (here
    up to 2 s, a claim given every chance to go first), no run is claimed before."""
    async with connect(db_url) as conn:
        await lanes.prepare(conn, RELEASE)
    queued = await submit(db_url, "echo", release=RELEASE)
    real = runs.hold_liveness
    attempts_before_lock: list[int] = []

    async def hold_liveness(conn: Any, worker_id: str) -> str:
        async def claimed() -> bool:
            return await _attempts(db_url, queued) > 0

        with contextlib.suppress(AssertionError):
            await eventually(claimed, timeout=2)
        attempts_before_lock.append(await _attempts(db_url, queued))
        return await real(conn, worker_id)

    monkeypatch.setattr(runs, "hold_liveness", hold_liveness)
    async with worker(db_url):
        await eventually(functools.partial(_succeeded, db_url, queued), timeout=10)
    assert attempts_before_lock[:1] == [0]
