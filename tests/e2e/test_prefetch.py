"""Claiming ahead (``prefetch``) and worker liveness, with real worker processes.

A worker with ``--prefetch N`` claims up to N runs beyond its free slots into a local
queue: each is leased from its claim, so a worker killed with runs claimed ahead must not
leave them until their leases lapse. Its LISTEN session holds its liveness lock (migration
0024); once the session is gone and the worker has been silent for 10 s, any live
worker's peer check (every heartbeat period) rescues its leases. The lanes here have a
300 s lease, so a rescue inside the test's deadlines cannot be the lease's.

The paused-worker test is the zombie test of this path: a SIGSTOPped worker keeps its
session and its lock, so however long it is silent, nobody rescues its runs, and after
SIGCONT it finishes them itself, each in its first attempt.

Both tests age the worker's last beat past those 10 s (:func:`age_last_beat`) instead of
waiting them out: its process is killed or stopped, so nothing else writes the beat, and
the database tells a silent worker from a recent one by that beat alone (the 10 s bound
itself is tests/db/test_liveness.py's). What the processes do is what they did: the
session of a killed one ends, a stopped one's lives, and a live worker's own peer checks
decide.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queues import lanes, recovery
from tests.apps.prefetch import EXECUTING, STARTS_DDL, registry
from tests.workers import eventually, fetch, running_worker, submit, worker_process

LONG_LEASE_S = 300.0


async def prepare(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(STARTS_DDL)
        await lanes.prepare(conn, "t")
        await lanes.set_policy(conn, "t", lease_ttl_s=LONG_LEASE_S, heartbeat_s=1.0)


def start_worker(
    url: str, tmp_path: Path, *, concurrency: int, prefetch: int
) -> subprocess.Popen[bytes]:
    return worker_process(
        url,
        tmp_path / "worker-a.log",
        "--app",
        "tests.apps.prefetch:registry",
        "--concurrency",
        str(concurrency),
        "--prefetch",
        str(prefetch),
        PREFETCH_DB_URL=url,
    )


async def submit_held(url: str, n: int, hold_s: float) -> list[uuid.UUID]:
    return [await submit(url, "held", {"hold_s": hold_s, "i": i}) for i in range(n)]


async def submit_batch(url: str, play: str, n: int) -> None:
    """``n`` runs of ``play`` in one batch admission."""
    from queues import admission

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await admission.submit_many(
            conn,
            [admission.Submission(play=play, params={"i": i}, release="t") for i in range(n)],
        )


async def owners(url: str, run_ids: list[uuid.UUID]) -> dict[str, int]:
    """Running runs of ``run_ids`` per lease owner (attempt 1 only)."""
    rows = await fetch(
        url,
        "SELECT lease_owner, count(*) FROM wq_runs WHERE id = ANY(%s) AND state = 'running'"
        " AND attempt = 1 GROUP BY lease_owner",
        (run_ids,),
    )
    return {str(owner): int(n) for owner, n in rows}


async def starts(url: str) -> list[tuple[uuid.UUID, int, int]]:
    rows = await fetch(url, "SELECT run_id, attempt, pid FROM test_prefetch_starts")
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


async def wait_succeeded(url: str, n: int) -> None:
    """Wait until ``n`` runs (every run of the test's database) have succeeded."""

    async def done() -> bool:
        rows = await fetch(url, "SELECT count(*) FROM wq_runs WHERE state = 'succeeded'")
        return rows[0][0] == n

    await eventually(done, timeout=60)


async def age_last_beat(url: str, worker_id: str) -> None:
    """Move ``worker_id``'s last heartbeat back past the 10 s of silence after which a
    worker whose liveness lock nobody holds is gone (migration 0024), as if its process
    had been silent that long. Never to before the server started: a beat from before it
    is a restart's, never gone (then the rest of the silence is waited out for real). The
    process must be killed or stopped, so it beats no more. A stopped one could hold its
    row in an open transaction: then the row is left to age in real time."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        try:
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '2s'")
                await conn.execute(
                    "UPDATE wq_workers SET heartbeat_at = greatest("
                    " heartbeat_at - interval '11 seconds',"
                    " pg_postmaster_start_time() + interval '1 millisecond') WHERE id = %s",
                    (worker_id,),
                )
        except psycopg.errors.LockNotAvailable:
            pass


async def claimed_by_one_worker(url: str, run_ids: list[uuid.UUID], started: int) -> str:
    """Wait until one worker holds every run (``started`` of them running, the rest ahead)
    and has recorded its liveness lock; returns its id. A worker's claims begin beside its
    LISTEN session, which takes the lock: one killed or stopped before it recorded the key
    is left to its leases (migration 0024), which is not what these tests are about."""

    async def all_claimed() -> str | None:
        held = await owners(url, run_ids)
        whole = len(held) == 1 and sum(held.values()) == len(run_ids)
        if whole and len(await starts(url)) == started:
            [owner] = held
            rows = await fetch(url, "SELECT liveness_key FROM wq_workers WHERE id = %s", (owner,))
            return owner if rows and rows[0][0] is not None else None
        return None

    return await eventually(all_claimed, timeout=30)


@pytest.mark.slow
async def test_runs_claimed_ahead_by_a_killed_worker_are_rescued_within_seconds(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    await prepare(db_url)
    run_ids = await submit_held(db_url, 12, hold_s=600)
    a = start_worker(db_url, tmp_path, concurrency=2, prefetch=10)
    try:
        owner = await claimed_by_one_worker(db_url, run_ids, started=2)
        ((key,),) = await fetch(
            db_url, "SELECT liveness_key FROM wq_workers WHERE id = %s", (owner,)
        )
        assert key is not None  # A holds its liveness lock
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
    # Ten runs A claimed ahead never started; two did.
    assert sorted(attempt for _, attempt, _ in await starts(db_url)) == [1, 1]
    await age_last_beat(db_url, owner)

    async with running_worker(db_url, registry, release="t", concurrency=12):
        # Within a minute of the kill, on 300 s leases: the owner was gone, not its lease.
        await wait_succeeded(db_url, len(run_ids))

    attempts = await fetch(
        db_url,
        "SELECT run_id, attempt, worker_id, outcome::text, finished_at,"
        " (error ->> 'lease_expires_at')::timestamptz FROM wq_attempts WHERE run_id = ANY(%s)",
        (run_ids,),
    )
    first = [a for a in attempts if a[1] == 1]
    second = [a for a in attempts if a[1] == 2]
    assert len(first) == len(second) == 12
    assert {(a[2], a[3]) for a in first} == {(owner, "lease_expired")}
    assert all(a[4] < a[5] for a in first)  # closed while its lease was still valid
    assert {a[3] for a in second} == {"succeeded"}
    assert owner not in {a[2] for a in second}
    # Every run started its second attempt here; none ran twice in attempt 2.
    in_b = [s for s in await starts(db_url) if s[1] == 2]
    assert sorted(s[0] for s in in_b) == sorted(run_ids)
    assert {s[2] for s in in_b} == {os.getpid()}


@pytest.mark.slow
async def test_a_paused_worker_keeps_its_runs_however_long_it_is_silent(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    # Every peer check B makes: when it began, and what it rescued.
    checks: list[tuple[float, list[recovery.Rescued]]] = []
    rescue_gone = recovery.rescue_gone

    async def peer_check(conn: Any, **kwargs: Any) -> list[recovery.Rescued]:
        began = time.monotonic()
        rescued = await rescue_gone(conn, **kwargs)
        checks.append((began, rescued))
        return rescued

    monkeypatch.setattr(recovery, "rescue_gone", peer_check)
    await prepare(db_url)
    run_ids = await submit_held(db_url, 6, hold_s=2)
    a = start_worker(db_url, tmp_path, concurrency=2, prefetch=4)
    try:
        owner = await claimed_by_one_worker(db_url, run_ids, started=2)
        a.send_signal(signal.SIGSTOP)
        async with running_worker(db_url, registry, release="t", concurrency=6):
            await age_last_beat(db_url, owner)

            async def silent_past_gone() -> bool:
                # The rule that makes a worker gone (migration 0024), but for its lock.
                rows = await fetch(
                    db_url,
                    "SELECT heartbeat_at < now() - interval '10 seconds'"
                    " AND heartbeat_at > pg_postmaster_start_time()"
                    " AND liveness_key IS NOT NULL FROM wq_workers WHERE id = %s",
                    (owner,),
                )
                return bool(rows[0][0])

            # Silent past the 10 s a gone worker needs: only A's session, which holds its
            # lock, keeps its runs its own. A peer check of B's that began after that is
            # the one that would rescue them (A does not change while it is stopped, so
            # one such check asks what any later one would).
            await eventually(silent_past_gone, timeout=40, interval=0.2)
            silent_since = time.monotonic()

            async def checked_since() -> bool:
                return any(began > silent_since for began, _ in checks)

            await eventually(checked_since, timeout=30, interval=0.1)
            assert [rescued for _, rescued in checks] == [[]] * len(checks)
            assert await owners(db_url, run_ids) == {owner: 6}
            a.send_signal(signal.SIGCONT)

            await wait_succeeded(db_url, len(run_ids))
    finally:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=30)
    attempts = await fetch(
        db_url,
        "SELECT attempt, worker_id, outcome::text FROM wq_attempts WHERE run_id = ANY(%s)",
        (run_ids,),
    )
    assert sorted(attempts) == [(1, owner, "succeeded")] * 6
    assert {pid for _, _, pid in await starts(db_url)} == {a.pid}


async def test_a_stopping_worker_hands_back_the_runs_it_claimed_ahead(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    await prepare(db_url)
    run_ids = await submit_held(db_url, 5, hold_s=600)
    async with running_worker(
        db_url, registry, release="t", concurrency=1, prefetch=4, grace_s=0.5
    ) as worker:

        async def claimed_all() -> bool:
            return sum((await owners(db_url, run_ids)).values()) == 5

        await eventually(claimed_all)
        assert len(worker.slots.ahead) == 4 and len(worker.slots.live) == 1
    rows = await fetch(
        db_url,
        "SELECT r.state::text, r.attempt, a.outcome::text, r.job_id IS NOT NULL"
        " FROM wq_runs r JOIN wq_attempts a ON a.run_id = r.id WHERE r.id = ANY(%s)",
        (run_ids,),
    )
    # All five are back in their lane with a new job; a hand-back spends no retry.
    assert sorted(rows) == [("queued", 1, "handed_back", True)] * 5
    assert len(await starts(db_url)) == 1  # only the running one ever started


async def test_a_prefetching_worker_drains_every_run_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    await prepare(db_url)
    await submit_batch(db_url, "held", 300)
    async with running_worker(db_url, registry, release="t", concurrency=4, prefetch=16):
        await wait_succeeded(db_url, 300)
    rows: list[Any] = await fetch(
        db_url, "SELECT count(*), count(DISTINCT run_id), max(attempt) FROM wq_attempts"
    )
    assert rows == [(300, 300, 1)]
    assert len(await starts(db_url)) == 300


async def test_with_batched_completion_at_most_concurrency_plays_execute_at_once(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot is freed when its play returns (its final write goes out with the next
    batch), so more attempts than slots may be finishing, but never more plays than slots
    execute at once."""
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    monkeypatch.setitem(EXECUTING, "max", 0)
    await prepare(db_url)
    await submit_batch(db_url, "counted", 120)
    async with running_worker(db_url, registry, release="t", concurrency=3, prefetch=12):
        await wait_succeeded(db_url, 120)
    assert EXECUTING["max"] == 3


@pytest.mark.parametrize("prefetch", [0, 3])
async def test_finishing_attempts_past_their_allowance_hold_slots(
    db_url: str, monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    """While final writes are held up (a slow database), a worker starts plays for its
    slots and for its finishing allowance (concurrency + prefetch attempts whose play
    returned), then no more: finishing attempts cannot pile up. Then every run ends once."""
    concurrency = 2
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    monkeypatch.setitem(EXECUTING, "started", 0)
    await prepare(db_url)
    await submit_batch(db_url, "counted", 30)
    from queues import runs

    real_finish = runs.finish
    release = asyncio.Event()

    async def held_finish(conn: Any, **kwargs: Any) -> Any:
        await release.wait()
        return await real_finish(conn, **kwargs)

    monkeypatch.setattr(runs, "finish", held_finish)
    cap = concurrency + (concurrency + prefetch)  # running + finishing allowance
    async with running_worker(
        db_url,
        registry,
        release="t",
        concurrency=concurrency,
        prefetch=prefetch,
        claim_ahead_under_s=0.0,  # prefetch 0: claims for free slots only
    ):

        async def at_cap() -> bool:
            return EXECUTING["started"] >= cap

        await eventually(at_cap, timeout=20)
        await asyncio.sleep(1.0)  # time for claims and starts that must not come
        assert EXECUTING["started"] == cap
        release.set()
        await wait_succeeded(db_url, 30)
    assert EXECUTING["started"] == 30


@pytest.mark.parametrize("prefetch", [0, 4])
async def test_a_claim_under_way_when_the_stop_comes_is_handed_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    """The stop comes while a claim is on its way: the runs it claims start nowhere and
    go back to their lane before the worker stops (not when their leases lapse)."""
    monkeypatch.setenv("PREFETCH_DB_URL", db_url)
    await prepare(db_url)
    run_ids = await submit_held(db_url, 3, hold_s=600)
    from queues import runs

    real_claim = runs.claim
    entered, release = asyncio.Event(), asyncio.Event()

    async def held_claim(conn: Any, **kwargs: Any) -> Any:
        entered.set()
        await release.wait()
        return await real_claim(conn, **kwargs)

    monkeypatch.setattr(runs, "claim", held_claim)
    async with running_worker(
        db_url, registry, release="t", concurrency=2, prefetch=prefetch, grace_s=0.5
    ) as worker:
        await asyncio.wait_for(entered.wait(), 10)
        worker.stop()
        release.set()
    rows = await fetch(
        db_url,
        "SELECT r.state::text, a.outcome::text FROM wq_runs r"
        " LEFT JOIN wq_attempts a ON a.run_id = r.id WHERE r.id = ANY(%s)",
        (run_ids,),
    )
    claimed = min(3, 2 + prefetch)  # the claim asked for the free slots and the queue's room
    assert sorted(rows, key=str) == sorted(
        [("queued", "handed_back")] * claimed + [("queued", None)] * (3 - claimed), key=str
    )
    assert await starts(db_url) == []
