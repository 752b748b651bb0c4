"""The recovery pass against real Postgres, each test in one rolled-back transaction.

Time is controlled through ``now``: runs are claimed at T0 with the real claim statement
and the pass runs at T0 + TTL + 1s, so no test sleeps for a lease to lapse.
Each test checks what the pass wrote, and what it must not have touched.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import admission, lanes, migrations, outcomes, receipts, recovery, runs, transport
from queues.errors import InvalidField, LaneReclaimed
from queues.fence import Fence
from queues.lanes import RetryPolicy
from queues.outcomes import FinishStatus
from queues.queries import q

Conn = psycopg.AsyncConnection[Any]
# Near the real clock: procrastinate stamps its job events with the database's now(), and
# the job retention reads them, so a far-off T0 would make every job look ancient.
T0 = datetime.now(UTC).replace(microsecond=0)
TTL = 30.0
PLAY = "p"


async def lane(conn: Conn, release: str = "rec", **policy: Any) -> str:
    prepared = await lanes.prepare(conn, release)
    if policy:
        sets = ", ".join(f"{key} = %({key})s" for key in policy)
        await conn.execute(
            f"UPDATE wq_lanes SET {sets} WHERE name = %(name)s",  # test-only, fixed keys
            {**policy, "name": prepared.name},
        )
    return prepared.name


async def submit(conn: Conn, release: str = "rec") -> uuid.UUID:
    admitted = await admission.submit(conn, admission.Submission(play=PLAY, release=release))
    return admitted.run_id


async def claim(
    conn: Conn, lane_name: str, *, now: datetime = T0, worker: str = "w1"
) -> list[runs.Claimed]:
    got = await runs.claim(
        conn, lanes=[lane_name], worker_id=worker, limit=100, plays=[PLAY], now=now
    )
    return [c for c in got if c.claimed]


async def one(conn: Conn, sql: str, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params or {})
    row = await cur.fetchone()
    assert row is not None, sql
    return row[0] if len(row) == 1 else row


async def run_jobs(conn: Conn, run_id: uuid.UUID) -> list[tuple[int, str, str, datetime | None]]:
    cur = await conn.execute(
        "SELECT id, status::text, queue_name, scheduled_at FROM procrastinate_jobs"
        " WHERE args ->> 'run_id' = %(id)s ORDER BY id",
        {"id": str(run_id)},
    )
    return [(r[0], r[1], r[2], r[3]) for r in await cur.fetchall()]


async def event_kinds(conn: Conn, run_id: uuid.UUID) -> list[str]:
    return [e.kind for e in await runs.events(conn, run_id)]


async def heartbeat(conn: Conn, run_id: uuid.UUID, attempt: int, *, now: datetime) -> list[Any]:
    """The worker's lease renewal (the run_heartbeat statement); returns the renewed runs."""
    cur = await conn.execute(
        q("run_heartbeat"),
        {"worker": "w1", "run_ids": [run_id], "attempts": [attempt], "now": now},
    )
    return [row[0] for row in await cur.fetchall()]


# ---- expired leases ---------------------------------------------------------------------


async def test_an_expired_lease_is_retried_promptly_on_a_new_job(conn: Conn) -> None:
    # A lapse is an interruption (its worker died), not a failure: no backoff.
    name = await lane(conn, lease_ttl_s=TTL, retry_base_s=10, retry_jitter=0, retry_max_attempts=3)
    dead, alive = await submit(conn), await submit(conn)
    await claim(conn, name)
    # `alive` renews its lease at T0 + 20s; `dead` does not.
    assert await heartbeat(conn, alive, 1, now=T0 + timedelta(seconds=20)) == [alive]
    old_job = (await runs.get(conn, dead)).job_id
    at = T0 + timedelta(seconds=TTL + 1)

    report = await recovery.run_once(conn, now=at)

    assert [(r.run_id, r.attempt, r.state) for r in report.expired] == [(dead, 1, "queued")]
    retry_at = report.expired[0].retry_at
    delay = outcomes.INTERRUPTION_DELAY_S
    assert retry_at is not None
    assert at + timedelta(seconds=delay * 0.5) <= retry_at <= at + timedelta(seconds=delay * 1.5)
    run = await runs.get(conn, dead)
    assert (run.state, run.attempt, run.lease_owner, run.available_at) == (
        "queued",
        1,
        None,
        retry_at,
    )
    assert run.error["code"] == "LEASE_EXPIRED"
    assert run.job_id == report.expired[0].job_id != old_job
    assert await run_jobs(conn, dead) == [
        (old_job, "failed", name, None),
        (run.job_id, "todo", name, retry_at),
    ]
    assert [(a.attempt, a.outcome) for a in await runs.attempts(conn, dead)] == [
        (1, "lease_expired")
    ]
    assert "lease_expired" in await event_kinds(conn, dead)
    assert (await runs.get(conn, alive)).state == "running"
    assert report.respawned == ()  # the retry job is live: no orphan for pass 2

    # The dead attempt is fenced: its heartbeat and its final write are refused.
    assert await heartbeat(conn, dead, 1, now=at) == []
    late = [outcomes.succeeded(dead, 1, {"late": True})]
    assert await runs.finish(conn, worker_id="w1", finishes=late) == {
        (dead, 1): FinishStatus.REFUSED
    }
    # A second pass at the same time finds nothing more to do.
    again = await recovery.run_once(conn, now=at)
    assert again.expired == () and again.respawned == ()
    # The retry job is due at retry_at, and its claim starts attempt 2.
    assert await claim(conn, name, now=retry_at - timedelta(seconds=1)) == []
    [second] = await claim(conn, name, now=retry_at)
    assert (second.run_id, second.attempt, second.job_id) == (dead, 2, run.job_id)
    assert second.resumed is True


async def test_a_lapse_spends_no_retry_budget(conn: Conn) -> None:
    name = await lane(conn, lease_ttl_s=TTL, retry_max_attempts=1)
    run_id = await submit(conn)
    await claim(conn, name)
    at = T0 + timedelta(seconds=TTL + 1)

    report = await recovery.run_once(conn, now=at)

    # One attempt allowed, and its worker died: the run is retried all the same.
    assert [(r.run_id, r.state) for r in report.expired] == [(run_id, "queued")]
    run = await runs.get(conn, run_id)
    assert run.error["code"] == "LEASE_EXPIRED"
    assert [a.outcome for a in await runs.attempts(conn, run_id)] == ["lease_expired"]


async def test_only_failed_attempts_spend_the_retry_budget(conn: Conn) -> None:
    name = await lane(conn, lease_ttl_s=TTL, retry_base_s=10, retry_jitter=0, retry_max_attempts=2)
    napper, failer = await submit(conn), await submit(conn)
    await claim(conn, name)
    # Attempt 1: `napper` went to sleep (not a failure); `failer` raised (a failure).
    policy = RetryPolicy(max_attempts=2, base_s=10, jitter=0)
    applied = await runs.finish(
        conn,
        worker_id="w1",
        finishes=[
            outcomes.suspended(napper, 1, wake_at=T0, wait_event=None),
            outcomes.failed(
                failer, 1, {"type": "Boom"}, policy, now=T0 - timedelta(seconds=10), failure=1
            ),
        ],
    )
    assert applied == {(napper, 1): FinishStatus.APPLIED, (failer, 1): FinishStatus.APPLIED}
    assert {c.run_id for c in await claim(conn, name)} == {napper, failer}  # attempts 2
    at = T0 + timedelta(seconds=TTL + 1)

    report = await recovery.run_once(conn, now=at)

    # Both lapse at attempt 2: neither lapse is a failure, so `failer` (1 of 2 spent) is
    # retried like `napper`, and the claim of attempt 3 counts its one failure only.
    assert {r.run_id: (r.attempt, r.state) for r in report.expired} == {
        napper: (2, "queued"),
        failer: (2, "queued"),
    }
    # (Died together with nothing settled, they are retried apart: both due within 5 s.)
    third = {c.run_id: c for c in await claim(conn, name, now=at + timedelta(seconds=5))}
    assert (third[napper].attempt, third[napper].failures) == (3, 0)
    assert (third[failer].attempt, third[failer].failures) == (3, 1)
    # Each resumes an attempt that was cut short (its steps in flight may run again).
    assert third[napper].resumed is True and third[failer].resumed is True


async def lapse_on(conn: Conn, name: str, worker: str, at: datetime) -> recovery.RecoveryReport:
    """Claim the lane's run as ``worker`` at ``at`` and let its lease lapse."""
    assert await claim(conn, name, now=at, worker=worker)
    return await recovery.run_once(conn, now=at + timedelta(seconds=TTL + 1))


async def test_a_run_that_kills_its_workers_fails_with_its_own_code(conn: Conn) -> None:
    name = await lane(conn, lease_ttl_s=TTL)
    run_id = await submit(conn)
    at = T0
    for n, worker in enumerate(("w1", "w2"), start=1):
        report = await lapse_on(conn, name, worker, at)
        assert [r.state for r in report.expired] == ["queued"], n
        at += timedelta(seconds=TTL + 5)
    report = await lapse_on(conn, name, "w3", at)  # the third worker it took down

    assert [(r.run_id, r.state, r.job_id) for r in report.expired] == [(run_id, "failed", None)]
    run = await runs.get(conn, run_id)
    assert run.state == "failed"
    assert run.error["code"] == outcomes.RUN_KILLS_WORKERS == "RUN_KILLS_WORKERS"
    assert "3 attempts in a row lost their workers (3 workers)" in run.error["message"]
    assert "worker retry" in run.error["message"]
    assert [a.outcome for a in await runs.attempts(conn, run_id)] == ["lease_expired"] * 3


async def test_runs_that_die_together_are_retried_apart_and_blamed_only_alone(
    conn: Conn,
) -> None:
    # `poison` and `bystander` are claimed together three times and die together each
    # time: either may be the cause, so neither is blamed; and from the second time on
    # they are retried apart, at least a second between them.
    name = await lane(conn, lease_ttl_s=TTL)
    poison, bystander = await submit(conn), await submit(conn)
    at = T0
    last: dict[uuid.UUID, datetime] = {}
    for worker in ("w1", "w2", "w3"):
        got = await claim(conn, name, now=at, worker=worker)
        assert {c.run_id for c in got} == {poison, bystander}
        report = await recovery.run_once(conn, now=at + timedelta(seconds=TTL + 1))
        assert {r.state for r in report.expired} == {"queued"}, worker
        last = {r.run_id: r.retry_at for r in report.expired if r.retry_at is not None}
        gap = abs((last[poison] - last[bystander]).total_seconds())
        if worker != "w1":  # from the second death together on
            assert gap >= outcomes.LAPSE_STAGGER_S - outcomes.INTERRUPTION_DELAY_S
        at += timedelta(seconds=TTL + 5)
    # Apart at last: the first one due is claimed alone. The bystander, if first, settles
    # and succeeds; `poison` then dies alone on w4, and its last three deaths (w4, w3, w2)
    # are no longer all another unfinished run's: it is blamed.
    [first] = await claim(conn, name, now=min(last.values()), worker="w4")
    if first.run_id == bystander:
        done = [outcomes.succeeded(bystander, first.attempt or 0, {"ok": True})]
        assert await runs.finish(conn, worker_id="w4", finishes=done) == {
            (bystander, 4): FinishStatus.APPLIED
        }
        [first] = await claim(conn, name, now=last[poison], worker="w4")
    assert first.run_id == poison
    report = await recovery.run_once(conn, now=last[poison] + timedelta(seconds=TTL + 1))
    assert [(r.run_id, r.state) for r in report.expired] == [(poison, "failed")]
    assert (await runs.get(conn, poison)).error["code"] == "RUN_KILLS_WORKERS"
    assert (await runs.get(conn, bystander)).state in ("queued", "succeeded")


@pytest.mark.parametrize("between", ["a step completed", "the same worker"])
async def test_lapses_of_a_run_that_progresses_or_of_one_worker_are_not_a_poison_run(
    conn: Conn, between: str
) -> None:
    name = await lane(conn, lease_ttl_s=TTL)
    run_id = await submit(conn)
    at = T0
    workers = ("w1", "w1", "w1") if between == "the same worker" else ("w1", "w2", "w3")
    for n, worker in enumerate(workers, start=1):
        [c] = await claim(conn, name, now=at, worker=worker)
        if between == "a step completed" and n == 2:
            # Attempt 2 completes a step before its worker dies: the run moves on.
            assert c.org and c.play and c.attempt
            await receipts.record(
                conn,
                receipts.StepRef(
                    org=c.org,
                    play=c.play,
                    scope=receipts.Scope.of_run(run_id),
                    step_key="charge",
                    fence=Fence(run_id, c.attempt, worker),
                ),
                result=1,
                now=at,
            )
        report = await recovery.run_once(conn, now=at + timedelta(seconds=TTL + 1))
        assert [(r.run_id, r.state) for r in report.expired] == [(run_id, "queued")], n
        at += timedelta(seconds=TTL + 5)


async def test_expired_lease_with_a_cancel_pending_gets_a_cleanup_attempt(conn: Conn) -> None:
    name = await lane(conn, lease_ttl_s=TTL)
    run_id = await submit(conn)
    await claim(conn, name)
    await runs.cancel(conn, run_id, reason="operator")  # the attempt died before it heard
    at = T0 + timedelta(seconds=TTL + 1)

    report = await recovery.run_once(conn, now=at)

    # Not cancelled yet: its cleanup hooks never ran. It is queued for a cleanup-only attempt.
    [rescued] = report.expired
    assert (rescued.run_id, rescued.state) == (run_id, "queued")
    assert rescued.retry_at == at  # at once: a cleanup does not back off
    assert (await runs.get(conn, run_id)).state == "queued"
    # A second cancel does not skip the cleanup; a claim takes the run as a cleanup attempt.
    again = await runs.cancel(conn, run_id, reason="again")
    assert (again.before, again.after, again.changed) == ("queued", "queued", False)
    [cleanup] = await claim(conn, name, now=at)
    assert (cleanup.run_id, cleanup.attempt, cleanup.cleanup) == (run_id, 2, True)
    assert "cleanup_started" in await event_kinds(conn, run_id)
    # Only `cancelled` ends it (every other outcome is refused while the cancel is pending).
    statuses = await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.cancelled(run_id, 2, "operator")]
    )
    assert statuses == {(run_id, 2): FinishStatus.APPLIED}
    assert (await runs.get(conn, run_id)).state == "cancelled"


async def test_a_cleanup_that_keeps_lapsing_is_cancelled_once_the_budget_is_spent(
    conn: Conn,
) -> None:
    name = await lane(conn, lease_ttl_s=TTL, retry_max_attempts=2)
    run_id = await submit(conn)
    await claim(conn, name)
    await runs.cancel(conn, run_id)
    first = await recovery.run_once(conn, now=T0 + timedelta(seconds=TTL + 1))
    assert [r.state for r in first.expired] == ["queued"]
    later = T0 + timedelta(seconds=TTL + 2)
    [cleanup] = await claim(conn, name, now=later)
    assert cleanup.cleanup
    # The cleanup attempt's worker dies too: 2 lapses of 2 allowed, cancel without hooks.
    second = await recovery.run_once(conn, now=later + timedelta(seconds=TTL + 1))
    assert [(r.run_id, r.state) for r in second.expired] == [(run_id, "cancelled")]
    assert (await runs.get(conn, run_id)).state == "cancelled"


# ---- orphans, sleepers, waiters ---------------------------------------------------------


@pytest.mark.parametrize(
    ("lose", "old_status"),
    [
        ("DELETE FROM procrastinate_jobs WHERE id = %(job)s", "missing"),
        ("UPDATE procrastinate_jobs SET status = 'cancelled' WHERE id = %(job)s", "cancelled"),
        ("UPDATE wq_runs SET job_id = NULL WHERE id = %(run)s", "none"),
        # Taken by a claimer that died between its claim and its drop (migration 0022).
        ("UPDATE procrastinate_jobs SET status = 'doing' WHERE id = %(job)s", "doing"),
    ],
    ids=["deleted", "cancelled", "no-job", "delivered-never-dropped"],
)
async def test_orphan_gets_a_new_todo_job(conn: Conn, lose: str, old_status: str) -> None:
    name = await lane(conn)
    run_id = await submit(conn)
    old_job = (await runs.get(conn, run_id)).job_id
    await conn.execute(lose, {"job": old_job, "run": run_id})

    report = await recovery.run_once(conn, now=T0)

    [res] = report.respawned
    assert (res.run_id, res.reason, res.old_job_status) == (run_id, "orphan", old_status)
    run = await runs.get(conn, run_id)
    assert (run.state, run.job_id) == ("queued", res.job_id)
    assert (res.job_id, "todo", name, None) in await run_jobs(conn, run_id)
    assert await event_kinds(conn, run_id) == ["run_created", "respawned"]
    # The new job is the run's live job: the claim accepts it.
    [claimed] = await claim(conn, name)
    assert (claimed.run_id, claimed.job_id) == (run_id, res.job_id)


async def test_healthy_queued_run_is_left_alone(conn: Conn) -> None:
    await lane(conn)
    run_id = await submit(conn)
    report = await recovery.run_once(conn, now=T0)
    assert report.respawned == () and report.expired == ()
    assert len(await run_jobs(conn, run_id)) == 1


async def test_a_force_reclaimed_lane_keeps_its_runs_and_is_never_reopened(conn: Conn) -> None:
    name = await lane(conn, release="old")
    run_id = await submit(conn, release="old")
    job = (await runs.get(conn, run_id)).job_id
    rep = await lanes.reclaim(conn, "old", force=True)
    assert rep.unfinished == 1
    assert (await lanes.get(conn, name)).state == "reclaimed"  # type: ignore[union-attr]
    # The run keeps its waiting job: a worker of the release may still serve it.
    assert await run_jobs(conn, run_id) == [(job, "todo", name, None)]

    # Its job lost: recovery spawns a new one on the run's own lane, and leaves the lane
    # closed to admissions.
    await conn.execute("DELETE FROM procrastinate_jobs WHERE id = %(job)s", {"job": job})
    report = await recovery.run_once(conn, now=T0)

    [res] = report.respawned
    assert (res.run_id, res.lane, res.old_job_status) == (run_id, name, "missing")
    assert report.closed_lanes == (name,)
    assert (await lanes.get(conn, name)).state == "reclaimed"  # type: ignore[union-attr]
    with pytest.raises(LaneReclaimed, match="reopen"):
        await submit(conn, release="old")
    # A worker of the release still claims it (claims do not look at the lane's state).
    [claimed] = await claim(conn, name)
    assert claimed.run_id == run_id


async def test_a_draining_lane_is_served_and_stays_draining(conn: Conn) -> None:
    name = await lane(conn, release="dr")
    run_id = await submit(conn, release="dr")
    await lanes.drain(conn, "dr")
    await conn.execute(
        "DELETE FROM procrastinate_jobs WHERE args ->> 'run_id' = %(id)s", {"id": str(run_id)}
    )
    report = await recovery.run_once(conn, now=T0)
    assert [r.run_id for r in report.respawned] == [run_id]  # its workers still consume it
    assert report.closed_lanes == (name,)
    assert (await lanes.get(conn, name)).state == "draining"  # type: ignore[union-attr]


async def sleeping(
    conn: Conn, name: str, *, available_at: datetime | None, wait_event: str | None = None
) -> uuid.UUID:
    run_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO wq_runs (id, org, play, release, lane, state, attempt, available_at,"
        " wait_event, created_at) VALUES (%(id)s, 'o', %(play)s, 'rec', %(lane)s, 'sleeping', 1,"
        " %(at)s, %(event)s, %(created)s)",
        {
            "id": run_id,
            "play": PLAY,
            "lane": name,
            "at": available_at,
            "event": wait_event,
            "created": T0 - timedelta(hours=1),
        },
    )
    return run_id


async def test_missed_sleeper_is_respawned_when_due(conn: Conn) -> None:
    name = await lane(conn)
    due = await sleeping(conn, name, available_at=T0 - timedelta(minutes=1))
    later = await sleeping(conn, name, available_at=T0 + timedelta(hours=1))

    report = await recovery.run_once(conn, now=T0)

    assert [(r.run_id, r.reason) for r in report.respawned] == [(due, "due_sleeper")]
    run = await runs.get(conn, due)
    assert run.state == "sleeping"
    assert await run_jobs(conn, due) == [(run.job_id, "todo", name, None)]
    assert await run_jobs(conn, later) == []
    [claimed] = await claim(conn, name)
    assert claimed.run_id == due


async def test_woken_waiter_without_a_job_is_respawned(conn: Conn) -> None:
    name = await lane(conn)
    woken = await sleeping(conn, name, available_at=None, wait_event="paid")
    waiting = await sleeping(conn, name, available_at=None, wait_event="never")
    await conn.execute(
        "INSERT INTO wq_emitted_events (org, name, payload, emitted_at)"
        " VALUES ('o', 'paid', %(p)s, %(at)s), ('other-org', 'never', 'null', %(at)s),"
        " ('o', 'never', 'null', %(old)s)",
        {"p": Jsonb({"amount": 3}), "at": T0, "old": T0 - timedelta(days=1)},
    )  # 'paid' emitted in the run's org but its wake-up's job was lost; 'never' only in
    # another org, and in the run's org before the run was admitted: neither wakes it

    report = await recovery.run_once(conn, now=T0)

    assert [(r.run_id, r.reason) for r in report.respawned] == [(woken, "woken_waiter")]
    row = await one(
        conn, "SELECT wake_payload, available_at FROM wq_runs WHERE id = %(id)s", {"id": woken}
    )
    assert row == ({"amount": 3}, None)
    assert await run_jobs(conn, waiting) == []


async def test_a_sleeper_with_a_cancel_pending_is_cancelled_not_respawned(conn: Conn) -> None:
    # No API leaves a sleeper with a cancel pending (a cancel cancels a sleeper at once, and a
    # suspension is refused while a cancel is pending): this is a state left by an older
    # release, written by hand. Recovery must still end it.
    name = await lane(conn)
    run_id = await sleeping(conn, name, available_at=T0 - timedelta(minutes=1))
    await conn.execute(
        "UPDATE wq_runs SET cancel_requested_at = now() WHERE id = %(id)s", {"id": run_id}
    )
    report = await recovery.run_once(conn, now=T0)
    assert report.cancelled == (run_id,) and report.respawned == ()
    assert (await runs.get(conn, run_id)).state == "cancelled"


async def test_a_cleanup_pending_run_that_lost_its_job_is_respawned(conn: Conn) -> None:
    name = await lane(conn, lease_ttl_s=TTL)
    run_id = await submit(conn)
    await claim(conn, name)
    await runs.cancel(conn, run_id)
    at = T0 + timedelta(seconds=TTL + 1)
    await recovery.run_once(conn, now=at)  # queued for its cleanup attempt
    await conn.execute(
        "DELETE FROM procrastinate_jobs WHERE id = (SELECT job_id FROM wq_runs WHERE id = %(id)s)",
        {"id": run_id},
    )
    report = await recovery.run_once(conn, now=at)
    assert [(r.run_id, r.reason) for r in report.respawned] == [(run_id, "cleanup")]
    assert report.cancelled == ()
    [cleanup] = await claim(conn, name, now=at)
    assert cleanup.cleanup


# ---- retention --------------------------------------------------------------------------


async def finished_run(
    conn: Conn, name: str, *, state: str, finished_at: datetime | None
) -> uuid.UUID:
    run_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO wq_runs (id, org, play, release, lane, state, finished_at)"
        " VALUES (%(id)s, 'o', %(play)s, 'rec', %(lane)s, %(state)s, %(at)s)",
        {"id": run_id, "play": PLAY, "lane": name, "state": state, "at": finished_at},
    )
    await conn.execute(
        "INSERT INTO wq_attempts (run_id, attempt) VALUES (%(id)s, 1)", {"id": run_id}
    )
    await conn.execute("INSERT INTO wq_events (run_id, kind) VALUES (%(id)s, 'x')", {"id": run_id})
    await conn.execute(
        "INSERT INTO wq_run_inputs (run_id, page, rows) VALUES (%(id)s, 0, '[]')", {"id": run_id}
    )
    await conn.execute(
        "INSERT INTO wq_receipts (org, play, scope, step_key, status, result)"
        " VALUES ('o', %(play)s, 'run:' || %(id)s, 'step', 'completed', '1'),"
        "        ('o', %(play)s, 'shared', %(id)s::text, 'completed', '1')",
        {"id": run_id, "play": PLAY},
    )
    return run_id


async def job_at(conn: Conn, name: str, status: str, at: datetime, *, task: str = "wq.run") -> int:
    job_id = int(
        await one(
            conn,
            "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
            " VALUES (%(q)s, %(task)s, '{}') RETURNING id",
            {"q": name, "task": task},
        )
    )
    await settle_job(conn, job_id, status, at)
    return job_id


async def settle_job(conn: Conn, job_id: int, status: str, at: datetime) -> None:
    """Give a job this status, all its events dated ``at``."""
    if status != "todo":
        await conn.execute(
            "UPDATE procrastinate_jobs SET status = %(s)s::procrastinate_job_status"
            " WHERE id = %(id)s",
            {"s": status, "id": job_id},
        )
    await conn.execute(
        "UPDATE procrastinate_events SET at = %(at)s WHERE job_id = %(id)s",
        {"at": at, "id": job_id},
    )


async def test_retention_deletes_only_old_terminal_runs_and_jobs(conn: Conn) -> None:
    name = await lane(conn, retention_s=3600)
    old = await finished_run(conn, name, state="succeeded", finished_at=T0 - timedelta(hours=2))
    old_failed = await finished_run(conn, name, state="failed", finished_at=T0 - timedelta(hours=3))
    recent = await finished_run(
        conn, name, state="succeeded", finished_at=T0 - timedelta(minutes=10)
    )
    unfinished = await finished_run(conn, name, state="queued", finished_at=None)
    old_job = await job_at(conn, name, "succeeded", T0 - timedelta(hours=2))
    recent_job = await job_at(conn, name, "failed", T0 - timedelta(minutes=10))
    waiting_job = await job_at(conn, name, "todo", T0 - timedelta(hours=5))

    report = await recovery.run_once(conn, now=T0)

    assert (report.deleted_runs, report.deleted_jobs) == (2, 1)
    cur = await conn.execute(
        "SELECT id FROM wq_runs WHERE id = ANY (%(ids)s)",
        {"ids": [old, old_failed, recent, unfinished]},
    )
    assert {r[0] for r in await cur.fetchall()} == {recent, unfinished}
    for table in ("wq_attempts", "wq_events", "wq_ledger", "wq_run_inputs"):
        left = await one(
            conn,
            f"SELECT count(*) FROM {table} WHERE run_id = ANY (%(ids)s)",
            {"ids": [old, old_failed]},
        )
        assert left == 0, table
    cur = await conn.execute(
        "SELECT id FROM procrastinate_jobs WHERE id = ANY (%(ids)s)",
        {"ids": [old_job, recent_job, waiting_job]},
    )
    assert {r[0] for r in await cur.fetchall()} == {recent_job, waiting_job}
    # A deleted run's own receipts go with it; a named scope's receipts stay (reruns
    # reuse what was paid for).
    cur = await conn.execute(
        "SELECT scope FROM wq_receipts WHERE scope LIKE 'run:%%' ORDER BY scope"
    )
    assert {r[0] for r in await cur.fetchall()} >= {f"run:{recent}", f"run:{unfinished}"}
    for gone in (old, old_failed):
        assert (
            await one(
                conn, "SELECT count(*) FROM wq_receipts WHERE scope = %(s)s", {"s": f"run:{gone}"}
            )
            == 0
        )
        assert (
            await one(
                conn,
                "SELECT count(*) FROM wq_receipts WHERE scope = 'shared' AND step_key = %(k)s",
                {"k": str(gone)},
            )
            == 1
        )


async def test_retention_takes_the_recovery_ticks_finished_jobs_but_the_latest(
    conn: Conn,
) -> None:
    """The recovery pass is a procrastinate periodic task: a job a minute on the
    maintenance queue. Its finished jobs past the shortest lane retention go (migration
    0028), except the one procrastinate's periodic table still names."""
    await lane(conn, retention_s=3600)
    queue, task, old = transport.MAINTENANCE_QUEUE, transport.RECOVERY_TASK, T0 - timedelta(hours=2)
    latest = int(
        await one(
            conn,
            "SELECT procrastinate_defer_periodic_job_v2(%(q)s, NULL, NULL, %(t)s, 0, %(p)s, 1,"
            " '{}')",
            {"q": queue, "t": task, "p": transport.RECOVERY_PERIODIC_ID},
        )
    )
    await settle_job(conn, latest, "succeeded", old)
    ticks = [await job_at(conn, queue, "succeeded", old, task=task) for _ in range(2)]
    ticks.append(await job_at(conn, queue, "failed", old, task=task))
    kept = [
        latest,
        await job_at(conn, queue, "succeeded", T0 - timedelta(minutes=10), task=task),
        await job_at(conn, queue, "doing", old, task=task),
        await job_at(conn, queue, "succeeded", old, task="another.task"),
    ]

    report = await recovery.run_once(conn, now=T0)

    assert report.deleted_jobs == 3
    cur = await conn.execute(
        "SELECT id FROM procrastinate_jobs WHERE id = ANY (%(ids)s)", {"ids": ticks + kept}
    )
    assert sorted(r[0] for r in await cur.fetchall()) == sorted(kept)


async def test_retention_is_bounded_by_the_batch(conn: Conn) -> None:
    name = await lane(conn, retention_s=60)
    for _ in range(5):
        await finished_run(conn, name, state="succeeded", finished_at=T0 - timedelta(hours=1))
    report = await recovery.run_once(conn, now=T0, batch=3)
    assert report.deleted_runs == 3 and report.saturated
    assert (await recovery.run_once(conn, now=T0, batch=3)).deleted_runs == 2


# ---- stranded ---------------------------------------------------------------------------


async def test_stranded_report_lists_lanes_no_live_worker_serves(conn: Conn) -> None:
    served = await lane(conn, release="live", lease_ttl_s=TTL)
    stranded = await lane(conn, release="gone", lease_ttl_s=TTL)
    await submit(conn, release="live")
    for _ in range(2):
        await submit(conn, release="gone")
    await conn.execute("UPDATE wq_runs SET updated_at = %(at)s", {"at": T0 - timedelta(minutes=10)})
    workers = [
        ("w-live", [served], T0 - timedelta(seconds=5), None),
        ("w-stale", [stranded], T0 - timedelta(seconds=TTL + 5), None),  # missed its beats
        ("w-stopped", [stranded], T0, T0),
    ]
    for wid, wlanes, beat, stopped in workers:
        await conn.execute(
            "INSERT INTO wq_workers"
            " (id, lanes, release, host, pid, heartbeat_at, stopped_at, schema_version)"
            " VALUES (%(id)s, %(lanes)s, 'x', 'h', 1, %(beat)s, %(stopped)s, %(schema)s)",
            {
                "id": wid,
                "lanes": wlanes,
                "beat": beat,
                "stopped": stopped,
                "schema": migrations.code_schema().version,
            },
        )

    report = await recovery.run_once(conn, now=T0)

    assert [(s.lane, s.release, s.runs, s.runnable) for s in report.stranded] == [
        (stranded, "gone", 2, 2)
    ]
    assert report.stranded[0].oldest_wait_s == pytest.approx(600)
    # A lane whose runs waited less than stranded_after_s is not reported yet.
    young = await recovery.run_once(conn, now=T0, stranded_after_s=3600)
    assert young.stranded == ()


# ---- adopt ------------------------------------------------------------------------------


async def test_adopt_moves_unfinished_runs_and_their_jobs(conn: Conn) -> None:
    old = await lane(conn, release="v1", lease_ttl_s=TTL)
    new = await lane(conn, release="v2")
    running = await submit(conn, release="v1")
    await claim(conn, old)
    queued = await submit(conn, release="v1")
    asleep = await sleeping(conn, old, available_at=T0 + timedelta(hours=1))
    await conn.execute("UPDATE wq_runs SET release = 'v1' WHERE id = %(id)s", {"id": asleep})
    sleep_job = int(
        await one(
            conn,
            "INSERT INTO procrastinate_jobs (queue_name, task_name, args, scheduled_at)"
            " VALUES (%(q)s, 'wq.run', %(args)s, %(at)s) RETURNING id",
            {"q": old, "args": Jsonb({"run_id": str(asleep)}), "at": T0 + timedelta(hours=1)},
        )
    )
    await conn.execute(
        "UPDATE wq_runs SET job_id = %(j)s WHERE id = %(id)s", {"j": sleep_job, "id": asleep}
    )
    done = await finished_run(conn, old, state="succeeded", finished_at=T0)
    old_queued_job = (await runs.get(conn, queued)).job_id
    running_job = (await runs.get(conn, running)).job_id

    moved = await recovery.adopt(conn, from_release="v1", to_release="v2")

    assert moved == 3
    for run_id in (running, queued, asleep):
        run = await runs.get(conn, run_id)
        assert (run.lane, run.release) == (new, "v2")
        assert "adopted" in await event_kinds(conn, run_id)
    assert (await runs.get(conn, done)).lane == old  # finished runs stay where they were
    q_run = await runs.get(conn, queued)
    assert await run_jobs(conn, queued) == [
        (old_queued_job, "cancelled", old, None),
        (q_run.job_id, "todo", new, None),
    ]
    s_run = await runs.get(conn, asleep)
    assert await run_jobs(conn, asleep) == [
        (sleep_job, "cancelled", old, T0 + timedelta(hours=1)),
        (s_run.job_id, "todo", new, T0 + timedelta(hours=1)),
    ]
    assert (await runs.get(conn, running)).job_id == running_job  # its attempt goes on
    # A worker of v2 now claims the queued run from the new lane.
    [claimed] = await claim(conn, new, now=T0 + timedelta(seconds=TTL))
    assert claimed.run_id == queued
    # The running run's lapsed lease retries on the new lane.
    report = await recovery.run_once(conn, now=T0 + timedelta(seconds=TTL + 1))
    [rescued] = report.expired
    assert (rescued.run_id, rescued.lane) == (running, new)


async def test_adopt_refuses_bad_targets(conn: Conn) -> None:
    await lane(conn, release="v1")
    await lane(conn, release="v0")
    await lanes.reclaim(conn, "v0")
    with pytest.raises(InvalidField, match="into itself"):
        await recovery.adopt(conn, from_release="v1", to_release="v1")
    with pytest.raises(InvalidField, match="did you mean 'v1'"):
        await recovery.adopt(conn, from_release="v11", to_release="v2")
    with pytest.raises(LaneReclaimed):
        await recovery.adopt(conn, from_release="v1", to_release="v0")
    # A target with no lane yet is prepared lazily; nothing to move is not an error.
    assert await recovery.adopt(conn, from_release="v1", to_release="v3") == 0
    assert (await lanes.get(conn, "r-v3")) is not None
