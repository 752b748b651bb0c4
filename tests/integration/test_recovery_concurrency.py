"""Recovery passes racing each other on real, committing connections.

Each test gets a fresh clone of the migrated template (``db_url``). Time is controlled
through ``now``; locks are held on purpose and nothing sleeps to wait for a state.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from click.testing import CliRunner
from procrastinate import periodic as periodic_mod
from structlog.testing import capture_logs

from queues import admission, fields, lanes, outcomes, recovery, runs
from queues.errors import InvalidField
from worker import recovery as worker_recovery
from worker.cli import processes
from worker.cli.common import State

Conn = psycopg.AsyncConnection[Any]
T0 = datetime.now(UTC).replace(microsecond=0)
TTL = 30.0
PLAY = "p"
DEADLINE_S = 10.0


@asynccontextmanager
async def connect(url: str, *, autocommit: bool = True) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=autocommit)
    try:
        yield conn
    finally:
        await conn.close()


async def rows(conn: Conn, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    cur = await conn.execute(sql, params or {})
    return list(await cur.fetchall())


async def setup(
    conn: Conn, *, expired: int, orphans: int
) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """`expired` runs claimed at T0 by a worker that then died; `orphans` that lost their job."""
    await lanes.prepare(conn, "rec")
    await conn.execute(
        "UPDATE wq_lanes SET lease_ttl_s = %(ttl)s, retry_base_s = 1, retry_jitter = 0"
        " WHERE name = 'r-rec'",
        {"ttl": TTL},
    )
    sub = admission.Submission(play=PLAY, release="rec")
    dying = [(await admission.submit(conn, sub)).run_id for _ in range(expired)]
    got = await runs.claim(
        conn, lanes=["r-rec"], worker_id="dead", limit=expired + 1, plays=[PLAY], now=T0
    )
    assert sorted(c.run_id for c in got if c.claimed) == sorted(dying)
    lost = [(await admission.submit(conn, sub)).run_id for _ in range(orphans)]
    await conn.execute(
        "DELETE FROM procrastinate_jobs WHERE args ->> 'run_id' = ANY (%(ids)s)",
        {"ids": [str(r) for r in lost]},
    )
    return dying, lost


async def drain(url: str, now: datetime, batch: int) -> list[recovery.RecoveryReport]:
    """Run passes on one connection until a pass finds nothing to rescue."""
    reports = []
    async with connect(url) as conn:
        while True:
            report = await recovery.run_once(conn, now=now, batch=batch)
            reports.append(report)
            if not report.expired and not report.respawned:
                return reports


async def test_concurrent_passes_rescue_each_run_exactly_once(db_url: str) -> None:
    async with connect(db_url) as conn:
        dying, lost = await setup(conn, expired=50, orphans=20)
    at = T0 + timedelta(seconds=TTL + 1)

    results = await asyncio.gather(*(drain(db_url, at, batch=5) for _ in range(4)))

    reports = [r for host in results for r in host]
    rescued = [r.run_id for rep in reports for r in rep.expired]
    respawned = [r.run_id for rep in reports for r in rep.respawned]
    assert sorted(rescued) == sorted(dying)  # every one, none twice
    assert sorted(respawned) == sorted(lost)
    # Whether the four passes overlapped is left to the scheduler here; that a pass skips a
    # run another one holds (instead of rescuing it twice) is forced in the next test.
    async with connect(db_url) as conn:
        per_run = await rows(
            conn,
            "SELECT r.id,"
            " (SELECT count(*) FROM procrastinate_jobs j"
            "   WHERE j.args ->> 'run_id' = r.id::text AND j.status = 'todo'),"
            " (SELECT count(*) FROM wq_attempts a"
            "   WHERE a.run_id = r.id AND a.outcome = 'lease_expired'),"
            " (SELECT count(*) FROM wq_ledger e"
            "   WHERE e.run_id = r.id AND e.kind IN ('lease_expired', 'respawned')),"
            " r.state::text, r.attempt"
            " FROM wq_runs r",
        )
        for run_id, todo_jobs, lapsed, rescues, state, attempt in per_run:
            assert (todo_jobs, rescues, state) == (1, 1, "queued"), run_id
            assert (lapsed, attempt) == ((1, 1) if run_id in dying else (0, 0)), run_id
        # Every live run points at its one todo job.
        dangling = await rows(
            conn,
            "SELECT r.id FROM wq_runs r LEFT JOIN procrastinate_jobs j ON j.id = r.job_id"
            " WHERE j.status IS DISTINCT FROM 'todo'",
        )
        assert dangling == []


async def wait_for_lock_waiters(conn: Conn, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = await rows(
            conn,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        if got[0][0] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {n} lock waiter(s) within {DEADLINE_S}s")


async def test_a_run_held_by_another_transaction_is_skipped_not_waited_for(db_url: str) -> None:
    async with connect(db_url) as conn:
        dying, _ = await setup(conn, expired=3, orphans=0)
    held = dying[0]
    at = T0 + timedelta(seconds=TTL + 1)
    async with connect(db_url, autocommit=False) as holder, connect(db_url) as conn:
        # A late heartbeat (or finish) of the dead attempt holds the run's row.
        await holder.execute("SELECT 1 FROM wq_runs WHERE id = %(id)s FOR UPDATE", {"id": held})
        report = await asyncio.wait_for(recovery.run_once(conn, now=at), DEADLINE_S)
        assert sorted(r.run_id for r in report.expired) == sorted(dying[1:])
        await holder.rollback()
        again = await recovery.run_once(conn, now=at)
        assert [r.run_id for r in again.expired] == [held]


async def test_recovery_waits_for_an_in_flight_finish_then_leaves_the_run_alone(
    db_url: str,
) -> None:
    """The dead attempt's finish wins the row first: its write stands, nothing is rescued."""
    async with connect(db_url) as conn:
        [run_id], _ = await setup(conn, expired=1, orphans=0)
    at = T0 + timedelta(seconds=TTL + 1)
    async with connect(db_url, autocommit=False) as late, connect(db_url) as conn:
        applied = await runs.finish(
            late, worker_id="dead", finishes=[outcomes.succeeded(run_id, 1, {"ok": True})]
        )
        # Written, not yet committed: the row is locked.
        assert applied == {(run_id, 1): outcomes.FinishStatus.APPLIED}
        report = await recovery.run_once(conn, now=at)  # SKIP LOCKED: no wait, no rescue
        assert report.expired == ()
        await late.commit()
        assert (await recovery.run_once(conn, now=at)).expired == ()
        assert (await runs.get(conn, run_id)).state == "succeeded"


async def finished_jobs(conn: Conn, n: int, finished_at: datetime) -> list[int]:
    """n finished run jobs of the lane, each with its terminal event at ``finished_at``."""
    await lanes.prepare(conn, "rec")
    await conn.execute("UPDATE wq_lanes SET retention_s = 3600 WHERE name = 'r-rec'")
    got = await rows(
        conn,
        "WITH jobs AS (INSERT INTO procrastinate_jobs (queue_name, task_name, args, status)"
        "              SELECT 'r-rec', 'wq.run', '{}', 'succeeded' FROM generate_series(1, %(n)s)"
        "              RETURNING id),"
        " events AS (INSERT INTO procrastinate_events (job_id, type, at)"
        "            SELECT id, 'succeeded', %(at)s FROM jobs)"
        " SELECT id FROM jobs",
        {"n": n, "at": finished_at},
    )
    return sorted(job_id for (job_id,) in got)


async def prune_all(url: str, now: datetime, batch: int) -> list[int]:
    """Retention passes on one connection until one deletes no job; the counts deleted."""
    deleted = []
    async with connect(url) as conn:
        while True:
            _, jobs, _ = await recovery.apply_retention(conn, now=now, batch=batch)
            if not jobs:
                return deleted
            deleted.append(jobs)


async def test_concurrent_job_prunes_delete_each_finished_job_once(db_url: str) -> None:
    """Four hosts' retention passes over the same expired jobs (migration 0028's walk of
    the terminal events): every job goes, each counted by exactly one pass."""
    async with connect(db_url) as conn:
        doomed = await finished_jobs(conn, 120, T0 - timedelta(hours=2))
    results = await asyncio.gather(*(prune_all(db_url, T0, batch=7) for _ in range(4)))
    assert sum(n for host in results for n in host) == len(doomed)
    async with connect(db_url) as conn:
        left = await rows(
            conn,
            "SELECT count(*) FROM procrastinate_jobs WHERE id = ANY (%(ids)s)",
            {"ids": doomed},
        )
        assert left == [(0,)]


async def test_a_job_held_by_another_transaction_is_skipped_by_the_prune(db_url: str) -> None:
    async with connect(db_url) as conn:
        held, *rest = await finished_jobs(conn, 5, T0 - timedelta(hours=2))
    async with connect(db_url, autocommit=False) as holder, connect(db_url) as conn:
        await holder.execute(
            "SELECT 1 FROM procrastinate_jobs WHERE id = %(id)s FOR UPDATE", {"id": held}
        )
        _, deleted, _ = await asyncio.wait_for(
            recovery.apply_retention(conn, now=T0, batch=10), DEADLINE_S
        )
        assert deleted == len(rest)
        await holder.rollback()
        assert (await recovery.apply_retention(conn, now=T0, batch=10))[1] == 1


# ---- the CLI and the periodic task ------------------------------------------------------


async def test_recover_command_prints_one_pass_and_refuses_bad_durations(db_url: str) -> None:
    async with connect(db_url) as conn:
        _, [lost] = await setup(conn, expired=0, orphans=1)
    runner = CliRunner()
    obj = State(db_url, None)

    with capture_logs() as logged:
        result = await asyncio.to_thread(
            runner.invoke, processes.recover_command, ["--once", "--json"], obj=obj
        )

    assert result.exit_code == 0, result.output
    [line] = [e for e in logged if e["event"] == "recovery_pass"]
    assert (line["orphans"], line["lease_expired"]) == (1, 0)
    data = json.loads(result.output)
    assert data["counts"]["orphans"] == 1
    assert data["respawned"][0]["run_id"] == str(lost)
    bad = await asyncio.to_thread(
        runner.invoke, processes.recover_command, ["--every", "soon"], obj=obj
    )
    assert isinstance(bad.exception, InvalidField)
    assert (bad.exception.field, bad.exception.exit_code) == ("--every", 2)


def test_one_duration_rule() -> None:
    def parse(text: str) -> float:
        return fields.duration(text, field="--every")

    assert [parse(t) for t in ("60s", "5m", "1h", "500ms", "90", " 2.5m ", "7d")] == [
        60,
        300,
        3600,
        0.5,
        90,
        150,
        604800,
    ]
    for bad in ("", "0s", "-5s", "5w", "m", "1h30m", "nan", "inf", "1e3"):
        try:
            parse(bad)
        except InvalidField as exc:
            assert exc.code == "FIELD_INVALID"
        else:
            raise AssertionError(f"{bad!r} was accepted")


async def test_recover_forever_runs_passes_until_stopped(db_url: str) -> None:
    async with connect(db_url) as conn:
        _, lost = await setup(conn, expired=0, orphans=3)
    stop = asyncio.Event()
    seen: list[recovery.RecoveryReport] = []

    def on_pass(report: recovery.RecoveryReport) -> None:
        seen.append(report)
        if len(seen) == 3:
            stop.set()

    # batch=2 fills the first pass, so the second follows at once; the third comes after
    # the (short) interval, finds nothing and stops the loop.
    passes = await asyncio.wait_for(
        worker_recovery.recover_forever(db_url, 0.05, stop, batch=2, on_pass=on_pass), DEADLINE_S
    )
    assert passes == 3
    assert [len(rep.respawned) for rep in seen] == [2, 1, 0]
    assert seen[0].saturated and not seen[1].saturated
    assert sorted(r.run_id for rep in seen for r in rep.respawned) == sorted(lost)


async def test_periodic_task_is_deferred_once_per_tick_and_runs_a_pass(db_url: str) -> None:
    async with connect(db_url) as conn:
        _, [lost] = await setup(conn, expired=0, orphans=1)
    app_a = worker_recovery.make_procrastinate_app(db_url)
    app_b = worker_recovery.make_procrastinate_app(db_url)
    [periodic] = app_a.periodic_registry.periodic_tasks.values()
    assert (periodic.task.name, periodic.periodic_id, periodic.task.queue, periodic.cron) == (
        worker_recovery.TASK_NAME,
        "wq-recovery",
        "wq-maintenance",
        "* * * * *",
    )
    tick = int(time.time()) // 60 * 60

    async with app_a.open_async(), app_b.open_async():
        # Two workers defer the same tick at once: procrastinate keeps one job.
        await asyncio.gather(
            *(
                periodic_mod.PeriodicDeferrer(registry=app.periodic_registry).defer_jobs(
                    [(next(iter(app.periodic_registry.periodic_tasks.values())), tick)]
                )
                for app in (app_a, app_b)
            )
        )
        async with connect(db_url) as conn:
            jobs = await rows(
                conn, "SELECT id FROM procrastinate_jobs WHERE queue_name = 'wq-maintenance'"
            )
        assert len(jobs) == 1
        await asyncio.wait_for(
            app_a.run_worker_async(
                queues=["wq-maintenance"], wait=False, install_signal_handlers=False
            ),
            DEADLINE_S,
        )
    async with connect(db_url) as conn:
        statuses = await rows(
            conn, "SELECT status::text FROM procrastinate_jobs WHERE queue_name = 'wq-maintenance'"
        )
        assert statuses and {s for (s,) in statuses} == {"succeeded"}
        kinds = [e.kind for e in await runs.events(conn, lost)]
        assert kinds.count("respawned") == 1


async def test_periodic_worker_defers_and_runs_the_tick_until_stopped(db_url: str) -> None:
    """The wiring a worker process uses: serve wq-maintenance in-process, stop on an event."""
    async with connect(db_url) as conn:
        _, [lost] = await setup(conn, expired=0, orphans=1)
    stop = asyncio.Event()
    task = asyncio.create_task(worker_recovery.run_periodic_worker(db_url, stop))
    try:
        deadline = time.monotonic() + DEADLINE_S
        async with connect(db_url) as conn:
            while time.monotonic() < deadline:
                done = await rows(
                    conn,
                    "SELECT count(*) FROM procrastinate_jobs"
                    " WHERE queue_name = 'wq-maintenance' AND status = 'succeeded'",
                )
                if done[0][0]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the periodic recovery tick never ran")
            kinds = [e.kind for e in await runs.events(conn, lost)]
            assert kinds.count("respawned") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
    assert task.result() is None
