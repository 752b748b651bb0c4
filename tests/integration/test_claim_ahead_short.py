"""Claiming ahead for short plays, the default mode's own (``Settings.claim_ahead_under_s``).

With ``prefetch`` 0, a worker whose last ``concurrency`` plays each returned within the
bound (50 ms by default) also claims up to four times ``concurrency`` runs ahead; a longer play
ends that at once; a run still waiting for a slot after 20 times the bound goes back to its
lane (a hand-back: no retry spent), where another worker takes it. Each test records what
every claim asked for (``limit``) through the real claim, against a real database.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, recovery, runs
from tests.apps.prefetch import EXECUTING, STARTS_DDL, registry
from tests.workers import eventually, fetch, running_worker, submit
from worker.context import RunContext
from worker.plays import Registry
from worker.runtime import Worker

# A worker stopping with plays still held (their runs go back to their lane after the
# grace): nothing of these tests happens then.
SHORT_GRACE_S = 0.5
HOLD_UNDER_S = 0.1  # the claim-ahead bound of the hold tests: a hold of 2 s


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``limit`` of every claim the workers make (the real claim runs)."""
    asked: list[int] = []
    real_claim = runs.claim

    async def recorded(conn: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["limit"])
        return await real_claim(conn, **kwargs)

    monkeypatch.setattr(runs, "claim", recorded)
    return asked


async def prepare(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", url)
    monkeypatch.setitem(EXECUTING, "max", 0)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(STARTS_DDL)
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=300.0, heartbeat_s=1.0)


async def admit(url: str, subs: list[tuple[str, dict[str, Any]]]) -> list[uuid.UUID]:
    """One batch admission, in this order (the claim takes them in it)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        admitted = await admission.submit_many(
            conn, [admission.Submission(play=p, params=a, release="t") for p, a in subs]
        )
    return [a.run_id for a in admitted]


async def succeeded(url: str, n: int) -> None:
    async def done() -> bool:
        rows = await fetch(url, "SELECT count(*) FROM wq_runs WHERE state = 'succeeded'")
        return rows[0][0] == n

    await eventually(done, timeout=60)


class HoldGate:
    """Holds the end of a worker's hold (:meth:`Worker._expire_ahead`, which the hold's
    timer calls with the runs it claimed ahead) until :meth:`open`: the hold then acts
    when its timer fired and the gate is open, whichever comes last. Install it before
    the claim whose hold it is to gate."""

    def __init__(self, worker: Worker) -> None:
        self.opened = asyncio.Event()
        self.waiting: set[asyncio.Task[None]] = set()
        end_of_hold = worker.producer.expire_ahead

        def held(run_ids: set[uuid.UUID]) -> None:
            async def at_the_gate() -> None:
                await self.opened.wait()
                end_of_hold(run_ids)

            task = asyncio.create_task(at_the_gate())
            self.waiting.add(task)
            task.add_done_callback(self.waiting.discard)

        worker.producer.expire_ahead = held  # type: ignore[method-assign]

    def open(self) -> None:
        self.opened.set()

    def __enter__(self) -> HoldGate:
        return self

    def __exit__(self, *exc: object) -> None:
        """Drop what still waits (a test that failed before it opened the gate)."""
        for task in self.waiting:
            task.cancel()


def holding_worker(url: str) -> contextlib.AbstractAsyncContextManager[Worker]:
    """A worker at concurrency 2 that claims ahead under HOLD_UNDER_S (so its hold is 20
    times that) and stops with a short grace."""
    return running_worker(
        url,
        registry,
        release="t",
        concurrency=2,
        claim_ahead_under_s=HOLD_UNDER_S,
        grace_s=SHORT_GRACE_S,
    )


async def two_held_and_four_ahead(url: str, a: Worker, hold_s: float) -> list[uuid.UUID]:
    """Two short plays (so ``a``, at concurrency 2, claims ahead), then two plays that hold
    both slots and four short ones, admitted at once: one claim takes all six, the short
    ones ahead. Their run ids, held first."""
    await admit(url, [("counted", {"i": i}) for i in range(2)])
    await succeeded(url, 2)
    subs = [("held", {"hold_s": hold_s, "i": i}) for i in range(2)]
    subs += [("counted", {"i": 10 + i}) for i in range(4)]
    run_ids = await admit(url, subs)

    async def all_claimed() -> bool:
        return len(a.slots.ahead) == 4 and len(a.slots.live) == 2

    await eventually(all_claimed, timeout=10, interval=0.01)
    return run_ids


async def all_succeeded(url: str, run_ids: list[uuid.UUID], timeout: float) -> None:
    async def done() -> bool:
        rows = await fetch(
            url,
            "SELECT count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'succeeded'",
            (run_ids,),
        )
        return rows[0][0] == len(run_ids)

    await eventually(done, timeout=timeout)


async def attempts_of(url: str, run_ids: list[uuid.UUID]) -> list[tuple[int, str, str]]:
    rows = await fetch(
        url,
        "SELECT attempt, worker_id, outcome::text FROM wq_attempts WHERE run_id = ANY(%s)",
        (run_ids,),
    )
    return sorted((int(a), str(w), str(o)) for a, w, o in rows)


async def test_short_plays_are_claimed_ahead_and_each_runs_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch, limits: list[int]
) -> None:
    await prepare(db_url, monkeypatch)
    run_ids = await admit(db_url, [("counted", {"i": i}) for i in range(80)])
    async with running_worker(db_url, registry, release="t", concurrency=2) as worker:
        await succeeded(db_url, 80)
    # The first claim is for the free slots; once two plays returned within the bound,
    # claims ask for the free slots and up to eight runs ahead.
    assert limits[0] == 2
    assert 2 < max(limits) <= 2 + 8
    assert EXECUTING["max"] == 2  # never more plays than slots
    assert await attempts_of(db_url, run_ids) == [(1, worker.s.worker_id, "succeeded")] * 80
    assert worker.stats["ahead_expired"] == 0


@pytest.mark.parametrize(
    ("sleep_s", "under_s"),
    [(0.08, 0.05), (0.005, 0.0)],
    ids=["plays-longer-than-the-bound", "claiming-ahead-off"],
)
async def test_otherwise_claims_are_for_free_slots_only(
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    limits: list[int],
    sleep_s: float,
    under_s: float,
) -> None:
    await prepare(db_url, monkeypatch)
    await admit(db_url, [("counted", {"i": i, "sleep_s": sleep_s}) for i in range(16)])
    async with running_worker(
        db_url, registry, release="t", concurrency=2, claim_ahead_under_s=under_s
    ):
        await succeeded(db_url, 16)
    assert limits and max(limits) <= 2


async def test_a_long_play_ends_claiming_ahead_at_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch, limits: list[int]
) -> None:
    await prepare(db_url, monkeypatch)
    async with running_worker(db_url, registry, release="t", concurrency=2) as worker:
        await admit(db_url, [("counted", {"i": i}) for i in range(4)])
        await succeeded(db_url, 4)
        assert worker.slots.prefetch() == 8
        await admit(db_url, [("counted", {"i": 10, "sleep_s": 0.2})])
        await succeeded(db_url, 5)
        assert worker.slots.prefetch() == 0
        del limits[:]
        await admit(db_url, [("counted", {"i": 20 + i}) for i in range(3)])
        await succeeded(db_url, 8)
    # The next claim is for the free slots only; two short plays later, ahead again.
    assert limits[0] == 2


async def test_runs_claimed_ahead_wait_at_most_the_hold_then_another_worker_runs_them(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plays turn long while runs wait ahead: after 20 times the bound (here 0.1 s, so
    2 s) they go back to the lane, another worker runs them at once, and the first worker
    claims only for free slots from then on (no claiming them back)."""
    await prepare(db_url, monkeypatch)
    async with holding_worker(db_url) as a:
        run_ids = await two_held_and_four_ahead(db_url, a, hold_s=10.0)
        held, ahead = run_ids[:2], run_ids[2:]
        claimed_at = asyncio.get_running_loop().time()
        async with running_worker(
            db_url, registry, release="t", concurrency=4, claim_ahead_under_s=0.0
        ) as b:
            await all_succeeded(db_url, ahead, timeout=8)
            waited = asyncio.get_running_loop().time() - claimed_at
            assert 20 * HOLD_UNDER_S - 0.1 <= waited < 20 * HOLD_UNDER_S + 3
            assert a.stats["ahead_expired"] == 4
            assert a.slots.prefetch() == 0
            assert await attempts_of(db_url, ahead) == sorted(
                [(1, a.s.worker_id, "handed_back"), (2, b.s.worker_id, "succeeded")] * 4
            )
            # The held plays kept their slots and their first attempt.
            rows = await fetch(
                db_url,
                "SELECT state::text, attempt, lease_owner FROM wq_runs WHERE id = ANY(%s)",
                (held,),
            )
            assert rows == [("running", 1, a.s.worker_id)] * 2


async def test_a_stop_hands_back_runs_claimed_ahead_for_short_plays(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await prepare(db_url, monkeypatch)
    async with running_worker(db_url, registry, release="t", concurrency=1, grace_s=0.5) as worker:
        await submit(db_url, "counted", {"i": 0})
        await succeeded(db_url, 1)
        run_ids = await admit(
            db_url, [("held", {"hold_s": 600.0, "i": 1})] + [("counted", {"i": i}) for i in (2, 3)]
        )

        async def claimed() -> bool:
            return len(worker.slots.ahead) == 2 and len(worker.slots.live) == 1

        await eventually(claimed, timeout=10, interval=0.01)
    rows = await fetch(
        db_url,
        "SELECT r.state::text, a.outcome::text FROM wq_runs r"
        " JOIN wq_attempts a ON a.run_id = r.id WHERE r.id = ANY(%s)",
        (run_ids,),
    )
    # All three back in their lane at once: the two ahead never started, the held one
    # was handed back when the grace ended.
    assert sorted(rows) == [("queued", "handed_back")] * 3
    assert worker.stats["ahead_expired"] == 0  # the drain, not the hold, handed them back


async def test_the_holds_hand_back_of_runs_whose_leases_were_taken_is_refused(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence of the hold's write: while runs wait ahead, their leases lapse and are
    rescued by a recovery pass, and another worker ends them in attempt 2.
    When the hold ends, the first worker hands back attempt 1 of each: refused by the
    finish statement (a ``final`` refusal each), and nothing of attempt 2 changes. The
    hold's end is held at a gate until attempt 2 ended (:class:`HoldGate`): the order is
    forced, not left to the hold outlasting the rescue and the other worker."""
    await prepare(db_url, monkeypatch)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.set_policy(conn, "t", lease_ttl_s=600.0, heartbeat_s=1.0)
    async with holding_worker(db_url) as a:
        with HoldGate(a) as gate:
            run_ids = await two_held_and_four_ahead(db_url, a, hold_s=30.0)
            ahead = run_ids[2:]
            # Which comes first after a pause, the heartbeat's report of the lost leases (the
            # runs are dropped, nothing written; the held plays are stopped and their slots
            # start the four) or the hold's end, is a race: the heartbeat stops watching all
            # six here, so the hold acts, and its write meets the fence.
            assert a.heartbeat is not None
            for run_id in run_ids:
                a.heartbeat.untrack(run_id)
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
                # The leases lapse (as if the worker had been silent past them), and a pass
                # at the database clock rescues them.
                await conn.execute(
                    "UPDATE wq_runs SET lease_expires_at = now() - interval '1 second'"
                    " WHERE id = ANY(%s)",
                    (run_ids,),
                )
                report = await recovery.run_once(conn)
            assert report.counts()["lease_expired"] == 6
            async with running_worker(
                db_url, registry, release="t", concurrency=4, claim_ahead_under_s=0.0
            ) as b:
                await all_succeeded(db_url, ahead, timeout=4)
                assert len(a.slots.ahead) == 4 and a.stats["ahead_expired"] == 0  # the hold is on
                before = await attempts_of(db_url, ahead)
                assert before == sorted(
                    [(1, a.s.worker_id, "lease_expired"), (2, b.s.worker_id, "succeeded")] * 4
                )
                gate.open()  # the hold ends (once its timer fired)

                async def refused() -> bool:
                    rows = await fetch(
                        db_url,
                        "SELECT count(*) FROM wq_refusals WHERE run_id = ANY(%s) AND attempt = 1"
                        " AND kind = 'final' AND worker_id = %s",
                        (ahead, a.s.worker_id),
                    )
                    return rows[0][0] == 4

                await eventually(refused, timeout=10)
                assert a.stats["ahead_expired"] == 4
                assert await attempts_of(db_url, ahead) == before
                rows = await fetch(
                    db_url,
                    "SELECT DISTINCT state::text, attempt FROM wq_runs WHERE id = ANY(%s)",
                    (ahead,),
                )
                assert rows == [("succeeded", 2)]


async def test_no_run_is_claimed_ahead_while_a_play_under_way_is_past_the_bound(
    db_url: str, monkeypatch: pytest.MonkeyPatch, limits: list[int]
) -> None:
    """A long play holding a slot (the oldest attempt under way, past the bound) stops
    claiming ahead before it returns: short runs go through the other slot, one claim each
    for the free slot, none waiting behind the long play."""
    await prepare(db_url, monkeypatch)
    released = asyncio.Event()
    long_play = Registry()

    @long_play.play("long")
    async def long(ctx: RunContext, params: dict[str, Any]) -> None:
        await released.wait()  # under way until the test is done with the short runs

    plays = registry.merged(long_play)
    async with running_worker(db_url, plays, release="t", concurrency=2) as worker:
        await admit(db_url, [("counted", {"i": i}) for i in range(2)])
        await succeeded(db_url, 2)
        assert worker.slots.prefetch() == 8
        await admit(db_url, [("long", {"i": 9})])

        async def long_under_way() -> bool:
            return len(worker.slots.live) == 1 and worker.slots.prefetch() == 0

        await eventually(long_under_way, timeout=10)
        del limits[:]
        await admit(db_url, [("counted", {"i": 10 + i}) for i in range(4)])
        await succeeded(db_url, 6)
        assert limits and max(limits) == 1

        # A short run's final write lands before its attempt leaves `live` (it is then
        # `finishing`): what is left once they are gone is the long play, nothing ahead.
        async def only_the_long_play() -> bool:
            return len(worker.slots.live) == 1 and not worker.slots.ahead

        await eventually(only_the_long_play, timeout=10)
        released.set()
        await succeeded(db_url, 7)
    assert worker.stats["ahead_expired"] == 0
