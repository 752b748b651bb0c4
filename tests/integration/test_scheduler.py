"""The scheduler against real Postgres: committed admissions, races, fences, a worker in-process.

Each test gets a fresh clone of the migrated template (``db_url``) and opens as many real
connections as it needs. Locks are held on purpose and waiters are seen waiting in
``pg_stat_activity`` (polled with a deadline); time is controlled through the queries'
``now`` parameters; nothing sleeps to wait for a state.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import pq

from queues import admission, lanes, outcomes, recovery, runs
from queues.admission import Admitted, Submission
from queues.errors import (
    IdempotencyConflict,
    LaneBusy,
    LaneNotPrepared,
    LaneReclaimed,
)
from queues.lanes import RetryPolicy
from queues.outcomes import FinishStatus
from worker import runtime
from worker.context import RunContext
from worker.plays import Registry

Conn = psycopg.AsyncConnection[Any]
T = TypeVar("T")
DEADLINE_S = 10.0
T0 = datetime(2030, 1, 1, tzinfo=UTC)


# ---- helpers --------------------------------------------------------------------------


@asynccontextmanager
async def connect(url: str, *, autocommit: bool = True) -> AsyncIterator[Conn]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=autocommit)
    try:
        yield conn
    finally:
        await conn.close()


async def value(conn: Conn, sql: str, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


async def counts(conn: Conn) -> dict[str, int]:
    """Rows of every table an admission writes, and the events readers see (wq_ledger)."""
    return {
        table: int(await value(conn, f"SELECT count(*) FROM {table}"))
        for table in ("wq_runs", "procrastinate_jobs", "wq_ledger")
    }


async def eventually(
    check: Callable[[], Awaitable[T | None]], what: str, timeout: float = DEADLINE_S
) -> T:
    """Poll ``check`` until it returns something truthy, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_until_blocked_on_lock(observer: Conn, pid: int) -> None:
    """Return once backend ``pid`` waits for a heavyweight lock."""

    async def blocked() -> bool:
        return bool(
            await value(
                observer,
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %(pid)s",
                {"pid": pid},
            )
            == "Lock"
        )

    await eventually(blocked, f"backend {pid} to wait on a lock")


async def job_status(conn: Conn, job_id: int) -> str:
    return str(
        await value(
            conn, "SELECT status::text FROM procrastinate_jobs WHERE id = %(id)s", {"id": job_id}
        )
    )


async def submit(conn: Conn, release: str, play: str = "noop", **kw: Any) -> Admitted:
    return await admission.submit(conn, Submission(play=play, release=release, **kw))


async def claim_one(
    conn: Conn, lane: str, worker: str, plays: list[str], **kw: Any
) -> runs.Claimed:
    got = await runs.claim(conn, lanes=[lane], worker_id=worker, limit=10, plays=plays, **kw)
    assert len(got) == 1, got
    return got[0]


@asynccontextmanager
async def running_worker(
    url: str, release: str, registry: Registry, *, grace_s: float = 1.0
) -> AsyncIterator[runtime.Worker]:
    """An in-process Worker that has reported ready; stopped (exit code 0) on the way out."""
    worker = runtime.Worker(
        runtime.Settings(url=url, release=release, registry=registry, grace_s=grace_s)
    )
    task = asyncio.create_task(worker.run(), name="worker")
    ready = asyncio.create_task(worker.ready.wait())
    done, _ = await asyncio.wait(
        {task, ready}, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
    )
    if ready not in done:
        ready.cancel()
        if task in done:
            raise AssertionError(f"worker exited before ready: {task.result()!r}")
        task.cancel()
        raise AssertionError("worker did not report ready in time")
    try:
        yield worker
    finally:
        worker.stop()
        code = await asyncio.wait_for(task, DEADLINE_S)
        assert code == 0, "a worker loop crashed (see the worker_loop_crashed log line)"


# ---- 1. a rolled-back submit ----------------------------------------------------------


async def test_submit_in_rolled_back_transaction_leaves_no_run_and_no_job(db_url: str) -> None:
    async with connect(db_url) as admin, connect(db_url, autocommit=False) as app:
        await lanes.prepare(admin, "rb1")
        before = await counts(admin)
        async with app.transaction(force_rollback=True):
            admitted = await submit(app, "rb1")
            # Inside the caller's transaction the run and its job exist...
            assert (
                await value(
                    app,
                    "SELECT state::text FROM wq_runs WHERE id = %(id)s",
                    {"id": admitted.run_id},
                )
                == "queued"
            )
            assert admitted.job_id is not None
            assert await job_status(app, admitted.job_id) == "todo"
        # ...and the caller's rollback takes all of them with it.
        assert await counts(admin) == before
        assert await counts(app) == before
        with pytest.raises(Exception, match="no run"):
            await runs.get(admin, admitted.run_id)


# ---- 3. reclaim racing submit ---------------------------------------------------------


async def test_a_submit_queued_behind_a_reclaim_is_refused_and_writes_nothing(
    db_url: str,
) -> None:
    """The reclaim has the lane row (FOR UPDATE, in an open transaction); a submit queues
    behind it, and once the reclaim commits the submit sees `reclaimed` and writes nothing."""
    async with (
        connect(db_url) as admin,
        connect(db_url, autocommit=False) as rc,
        connect(db_url) as sc,
    ):
        await lanes.prepare(admin, "hold0")
        before = await counts(admin)
        async with rc.transaction():
            report = await lanes.reclaim(rc, "hold0", force=True)
            pending = asyncio.create_task(submit(sc, "hold0"))
            await wait_until_blocked_on_lock(admin, sc.info.backend_pid)
            assert not pending.done()
        assert (report.unfinished, report.was) == (0, "prepared")
        with pytest.raises(LaneReclaimed):
            await asyncio.wait_for(pending, DEADLINE_S)
        assert await counts(admin) == before


async def test_reclaim_waits_for_an_open_submit_then_counts_its_run(db_url: str) -> None:
    """The submit has the lane row (FOR SHARE, until its commit); a forced reclaim waits,
    then sees the admitted run, which stays on the lane with its job (served by a worker of
    the release, or reported stranded): a reclaim never strands a run silently."""
    async with (
        connect(db_url) as admin,
        connect(db_url, autocommit=False) as app,
        connect(db_url) as rc,
    ):
        await lanes.prepare(admin, "hold1")
        async with app.transaction():
            admitted = await submit(app, "hold1")  # holds the lane row FOR SHARE until commit
            reclaim = asyncio.create_task(lanes.reclaim(rc, "hold1", force=True))
            await wait_until_blocked_on_lock(admin, rc.info.backend_pid)
            assert not reclaim.done()
            assert (
                await value(admin, "SELECT state::text FROM wq_lanes WHERE name = 'r-hold1'")
                == "prepared"
            )
        report = await asyncio.wait_for(reclaim, DEADLINE_S)
        assert report.unfinished == 1
        assert admitted.job_id is not None
        assert await job_status(admin, admitted.job_id) == "todo"
        assert (await lanes.get(admin, "r-hold1")).state == "reclaimed"  # type: ignore[union-attr]
        with pytest.raises(LaneReclaimed):
            await submit(admin, "hold1")


async def test_unforced_reclaim_refuses_a_run_admitted_while_it_waited(db_url: str) -> None:
    """The unfinished-run check must see a submit that committed while reclaim waited.

    Reclaim without --force refuses a lane with unfinished runs. The submit commits while the
    reclaim waits for the lane row; the run it admitted is unfinished, so the reclaim must
    refuse (LaneBusy) and leave the run's job waiting.
    """
    async with (
        connect(db_url) as admin,
        connect(db_url, autocommit=False) as app,
        connect(db_url) as rc,
    ):
        await lanes.prepare(admin, "hold2")
        async with app.transaction():
            admitted = await submit(app, "hold2")
            reclaim = asyncio.create_task(lanes.reclaim(rc, "hold2", force=False))
            await wait_until_blocked_on_lock(admin, rc.info.backend_pid)
        outcome: BaseException | lanes.ReclaimReport
        try:
            outcome = await asyncio.wait_for(reclaim, DEADLINE_S)
        except LaneBusy as exc:
            outcome = exc
        assert admitted.job_id is not None
        job = await job_status(admin, admitted.job_id)
        lane = await lanes.get(admin, "r-hold2")
        assert lane is not None
        assert isinstance(outcome, LaneBusy), (
            f"reclaim without force retired a lane with an unfinished run: {outcome!r}; "
            f"lane is {lane.state}, the run's job is {job}"
        )
        assert lane.state == "prepared"
        assert job == "todo"


# ---- 4. idempotency under concurrency -------------------------------------------------


async def test_twenty_concurrent_submits_with_one_key_make_one_run(db_url: str) -> None:
    async with connect(db_url) as admin:
        await lanes.prepare(admin, "idem1")
        conns = [await psycopg.AsyncConnection.connect(db_url, autocommit=True) for _ in range(20)]
        try:
            sub = Submission(
                play="noop", params={"n": 1}, release="idem1", idempotency_key="delivery-42"
            )
            results = await asyncio.gather(*(admission.submit(c, sub) for c in conns))
        finally:
            for c in conns:
                await c.close()
        created = [r for r in results if r.created]
        assert len(created) == 1
        assert sum(not r.created for r in results) == 19
        assert {r.run_id for r in results} == {created[0].run_id}
        assert await value(admin, "SELECT count(*) FROM wq_runs") == 1
        assert await value(admin, "SELECT count(*) FROM procrastinate_jobs") == 1
        assert await value(admin, "SELECT count(*) FROM wq_ledger WHERE kind = 'run_created'") == 1

        before = await counts(admin)
        with pytest.raises(IdempotencyConflict) as err:
            await admission.submit(
                admin,
                Submission(
                    play="noop", params={"n": 2}, release="idem1", idempotency_key="delivery-42"
                ),
            )
        assert err.value.code == "IDEMPOTENCY_CONFLICT"
        assert str(created[0].run_id) in err.value.message
        with pytest.raises(IdempotencyConflict):
            await admission.submit(
                admin,
                Submission(
                    play="enrich", params={"n": 1}, release="idem1", idempotency_key="delivery-42"
                ),
            )
        assert await counts(admin) == before


# ---- 5. admission-only submit ---------------------------------------------------------


@asynccontextmanager
async def client_messages(conn: Conn, path: Path) -> AsyncIterator[list[str]]:
    """The statements the client sends on ``conn``, read from libpq's protocol trace.

    libpq writes every frontend message to the trace file (``PQtrace``), whatever issued it:
    ``conn.execute`` (extended protocol: one ``Parse`` per statement) as well as the
    ``BEGIN``/``COMMIT`` that psycopg's ``conn.transaction()`` sends as simple ``Query``
    messages. The yielded list is filled on exit with one entry per ``Query`` or ``Parse``
    message: the SQL text. That is exactly what reached the wire, with nothing of ours in
    between.
    """
    found: list[str] = []
    with path.open("w") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield found
        finally:
            conn.pgconn.untrace()
    messages: list[str] = []
    for line in path.read_text().splitlines():
        if re.match(r"^[FB]\t\d+\t", line):
            messages.append(line)
        elif messages:  # a newline inside the SQL text: the message goes on
            messages[-1] += "\n" + line
    for message in messages:
        direction, _length, rest = message.split("\t", 2)
        if direction != "F":
            continue
        if rest.startswith("Query"):  # Query "<sql>"
            found.append(rest.split('"', 1)[1].rsplit('"', 1)[0])
        elif rest.startswith("Parse"):  # Parse "<statement name>" "<sql>" <n> <oids>...
            found.append(rest.split('"', 3)[3].rsplit('"', 1)[0])
    assert found, f"no frontend messages traced in {path}"


def _is_run_submit(sql: str) -> bool:
    return "FROM wq_submit(" in sql


async def test_admission_only_submit_is_one_statement_and_nothing_else(
    db_url: str, tmp_path: Path
) -> None:
    noop_registry = Registry()

    @noop_registry.play("noop")
    async def noop(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    admitter = admission.Admitter(admission_only=True)
    sub = Submission(play="noop", release="ao1", params={"x": 1})
    async with connect(db_url) as admin, connect(db_url) as app:
        before = await counts(admin)
        # An unprepared lane: fails loudly, and the whole attempt was one statement (autocommit:
        # no BEGIN, no COMMIT or ROLLBACK), raised where the truth is (WQ001).
        async with client_messages(app, tmp_path / "fail.trace") as sent:
            with pytest.raises(LaneNotPrepared) as err:
                await admitter.submit(app, sub, known_plays=None)
        assert err.value.code == "LANE_NOT_PREPARED"
        assert "r-ao1" in err.value.message and "worker start --release ao1" in (
            err.value.fix or ""
        )
        assert err.value.field == "release"
        assert len(sent) == 1 and _is_run_submit(sent[0]), sent
        assert await counts(admin) == before
        assert await lanes.get(admin, "r-ao1") is None  # admission-only never prepares

        # A worker of that release starts: it prepares the lane before it reports ready.
        async with running_worker(db_url, "ao1", noop_registry):
            async with client_messages(app, tmp_path / "ok.trace") as sent:
                admitted = await admitter.submit(app, sub, known_plays=None)
            assert admitted.created
            assert len(sent) == 1 and _is_run_submit(sent[0]), sent  # one round trip

            async def done() -> runs.Run | None:
                run = await runs.get(admin, admitted.run_id)
                return run if run.terminal else None

            run = await eventually(done, "the worker to execute the admitted run")
            assert run.state == "succeeded" and run.result == {"ok": True}


# ---- 6. a stale attempt's final write ---------------------------------------------------


async def rescue(conn: Conn, lapsed: runs.Claimed) -> int:
    """The real recovery pass after ``lapsed``'s lease expired: it closes the attempt as
    ``lease_expired`` and re-queues the run on a new job; returns that job's id."""
    assert lapsed.lease_expires_at is not None
    report = await recovery.run_once(conn, now=lapsed.lease_expires_at + timedelta(seconds=1))
    [rescued] = [r for r in report.expired if r.run_id == lapsed.run_id]
    assert rescued.state == "queued" and rescued.job_id is not None
    return rescued.job_id


async def test_stale_attempt_final_write_is_refused_and_the_newer_one_stands(db_url: str) -> None:
    async with connect(db_url) as admin, connect(db_url) as a, connect(db_url) as b:
        await lanes.prepare(admin, "fence1")
        admitted = await submit(admin, "fence1", play="echo")
        first = await claim_one(a, "r-fence1", "worker-a", ["echo"], now=T0)
        assert first.claimed and first.attempt == 1

        # A's lease lapses (in the queries' time), recovery re-queues the run, B claims it.
        new_job = await rescue(admin, first)
        later = T0 + timedelta(minutes=10)  # past the retry's backoff
        second = await claim_one(b, "r-fence1", "worker-b", ["echo"], now=later)
        assert second.claimed and second.attempt == 2 and second.job_id == new_job

        # A comes back: its heartbeat is refused and its final write is not applied.
        assert (
            await runs.heartbeat(a, worker_id="worker-a", leases=[(admitted.run_id, 1)], now=later)
            == []
        )
        jobs_before = await value(admin, "SELECT count(*) FROM procrastinate_jobs")
        assert await runs.finish(
            a, worker_id="worker-a", finishes=[outcomes.succeeded(admitted.run_id, 1, {"by": "a"})]
        ) == {(admitted.run_id, 1): FinishStatus.REFUSED}
        assert await runs.finish(
            a,
            worker_id="worker-a",
            finishes=[
                outcomes.failed(
                    admitted.run_id,
                    1,
                    {"type": "X", "message": "late"},
                    RetryPolicy(),
                    now=later,
                    failure=1,
                )
            ],
        ) == {(admitted.run_id, 1): FinishStatus.REFUSED}
        run = await runs.get(admin, admitted.run_id)
        assert (run.state, run.attempt, run.lease_owner, run.result) == (
            "running",
            2,
            "worker-b",
            None,
        )
        # The run's last error is the rescue's, not A's late one.
        assert run.error is not None and run.error["code"] == "LEASE_EXPIRED"
        assert await value(admin, "SELECT count(*) FROM procrastinate_jobs") == jobs_before
        assert await job_status(admin, new_job) == "doing"

        # B's write applies, and its result is the run's.
        assert await runs.finish(
            b, worker_id="worker-b", finishes=[outcomes.succeeded(admitted.run_id, 2, {"by": "b"})]
        ) == {(admitted.run_id, 2): FinishStatus.APPLIED}
        run = await runs.get(admin, admitted.run_id)
        assert (run.state, run.result, run.attempt) == ("succeeded", {"by": "b"}, 2)
        assert await job_status(admin, new_job) == "succeeded"
        ended = {t.attempt: t.outcome for t in await runs.attempts(admin, admitted.run_id)}
        assert ended == {1: "lease_expired", 2: "succeeded"}  # closed by the rescue
        refused = await value(
            admin,
            "SELECT count(*) FROM wq_refusals WHERE run_id = %(id)s AND kind = 'final'",
            {"id": admitted.run_id},
        )
        assert refused == 2

        # After the run finished, A's write is still refused and still changes nothing.
        assert await runs.finish(
            a, worker_id="worker-a", finishes=[outcomes.succeeded(admitted.run_id, 1, {"by": "a"})]
        ) == {(admitted.run_id, 1): FinishStatus.REFUSED}
        assert (await runs.get(admin, admitted.run_id)).result == {"by": "b"}


async def test_fence_is_the_attempt_number_not_only_the_worker(db_url: str) -> None:
    """The same worker id with an older attempt number is stale too."""
    async with connect(db_url) as conn:
        await lanes.prepare(conn, "fence2")
        admitted = await submit(conn, "fence2", play="echo")
        first = await claim_one(conn, "r-fence2", "w", ["echo"], now=T0)
        await rescue(conn, first)
        again = await claim_one(conn, "r-fence2", "w", ["echo"], now=T0 + timedelta(minutes=10))
        assert again.attempt == 2
        assert await runs.finish(
            conn, worker_id="w", finishes=[outcomes.succeeded(admitted.run_id, 1, "old")]
        ) == {(admitted.run_id, 1): FinishStatus.REFUSED}
        assert (await runs.get(conn, admitted.run_id)).state == "running"


# ---- 7. duplicate delivery ----------------------------------------------------------------


async def deliver_again(conn: Conn, run_id: uuid.UUID, lane: str) -> int:
    """A second procrastinate job for a run (a duplicate or late delivery)."""
    return int(
        await value(
            conn,
            "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
            " VALUES (%(lane)s, 'wq.run', jsonb_build_object('run_id', %(id)s::uuid)) RETURNING id",
            {"lane": lane, "id": run_id},
        )
    )


async def test_duplicate_delivery_is_acknowledged_and_dropped(db_url: str) -> None:
    async with connect(db_url) as conn:
        await lanes.prepare(conn, "dup1")
        admitted = await submit(conn, "dup1", play="echo")
        first = await claim_one(conn, "r-dup1", "worker-a", ["echo"], now=T0)
        assert first.claimed

        # While the run is running under A.
        dup = await deliver_again(conn, admitted.run_id, "r-dup1")
        before = await runs.get(conn, admitted.run_id)
        events_before = len(await runs.events(conn, admitted.run_id))
        dropped = await claim_one(conn, "r-dup1", "worker-b", ["echo"], now=T0)
        assert (dropped.claimed, dropped.run_id, dropped.job_id, dropped.attempt) == (
            False,
            admitted.run_id,
            dup,
            None,
        )
        assert await job_status(conn, dup) == "succeeded"
        assert await runs.get(conn, admitted.run_id) == before
        assert len(await runs.attempts(conn, admitted.run_id)) == 1
        assert len(await runs.events(conn, admitted.run_id)) == events_before

        # After the run finished.
        assert await runs.finish(
            conn,
            worker_id="worker-a",
            finishes=[outcomes.succeeded(admitted.run_id, 1, {"done": True})],
        ) == {(admitted.run_id, 1): FinishStatus.APPLIED}
        late = await deliver_again(conn, admitted.run_id, "r-dup1")
        finished = await runs.get(conn, admitted.run_id)
        dropped = await claim_one(conn, "r-dup1", "worker-b", ["echo"], now=T0)
        assert not dropped.claimed and dropped.job_id == late
        assert await job_status(conn, late) == "succeeded"
        assert await runs.get(conn, admitted.run_id) == finished


# ---- 8. retry schedule --------------------------------------------------------------------


def test_retry_policy_delay_backoff_cap_and_jitter_bounds() -> None:
    policy = RetryPolicy(max_attempts=3, base_s=2.0, cap_s=5.0, jitter=0.0)
    assert [policy.delay(n) for n in (1, 2, 3, 10)] == [2.0, 4.0, 5.0, 5.0]
    assert not policy.exhausted(2) and policy.exhausted(3)

    jittery = RetryPolicy(max_attempts=5, base_s=2.0, cap_s=300.0, jitter=0.25)
    rng = random.Random(7)
    for attempt, raw in ((1, 2.0), (2, 4.0), (3, 8.0), (20, 300.0)):
        seen = [jittery.delay(attempt, rng=rng) for _ in range(500)]
        assert all(raw * 0.75 <= d <= raw * 1.25 for d in seen), (attempt, min(seen), max(seen))
        assert max(seen) - min(seen) > raw * 0.25  # the jitter is actually applied
    assert RetryPolicy(base_s=0.0, jitter=1.0).delay(1) == 0.0


async def test_retry_schedule_follows_the_lane_policy(db_url: str) -> None:
    async with connect(db_url) as conn:
        await lanes.prepare(conn, "retry1")
        await lanes.set_policy(
            conn, "retry1", retry_max_attempts=3, retry_base_s=2, retry_cap_s=5, retry_jitter=0
        )
        admitted = await submit(conn, "retry1", play="boom")
        now = T0
        deltas: list[timedelta] = []
        for n in (1, 2, 3):
            c = await claim_one(conn, "r-retry1", "w", ["boom"], now=now)
            assert c.claimed and c.attempt == n
            assert c.retry == RetryPolicy(max_attempts=3, base_s=2.0, cap_s=5.0, jitter=0.0)
            error = {"type": "RuntimeError", "message": f"boom on attempt {n}"}
            final = outcomes.failed(c.run_id, n, error, c.retry, now=now, failure=n)
            assert await runs.finish(conn, worker_id="w", finishes=[final]) == {
                (c.run_id, n): FinishStatus.APPLIED
            }
            run = await runs.get(conn, admitted.run_id)
            if n < 3:
                assert run.state == "queued" and run.job_id is not None
                scheduled = await value(
                    conn,
                    "SELECT scheduled_at FROM procrastinate_jobs WHERE id = %(id)s",
                    {"id": run.job_id},
                )
                assert run.available_at == scheduled
                deltas.append(scheduled - now)
                # Not due a millisecond early...
                early = await runs.claim(
                    conn,
                    lanes=["r-retry1"],
                    worker_id="w",
                    limit=10,
                    plays=["boom"],
                    now=scheduled - timedelta(milliseconds=1),
                )
                assert early == []
                now = scheduled
            else:
                assert run.state == "failed"
                assert run.error == error
                assert run.job_id is None
                assert run.finished_at is not None
        assert deltas == [timedelta(seconds=2), timedelta(seconds=4)]
        assert (
            await value(conn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'") == 0
        )
        assert [t.outcome for t in await runs.attempts(conn, admitted.run_id)] == ["failed"] * 3
        kinds = [e.kind for e in await runs.events(conn, admitted.run_id)]
        assert kinds.count("retry_scheduled") == 2 and kinds[-1] == "run_failed"


async def test_worker_applies_the_lane_retry_policy_to_a_failing_play(db_url: str) -> None:
    """The same policy through an in-process Worker (short delays, same shape)."""
    registry = Registry()

    @registry.play("boom")
    async def boom(ctx: RunContext, params: dict[str, Any]) -> None:
        raise RuntimeError(f"boom on attempt {ctx.attempt}")

    async with connect(db_url) as conn:
        await lanes.prepare(conn, "retry2")
        await lanes.set_policy(
            conn, "retry2", retry_max_attempts=3, retry_base_s=0.1, retry_cap_s=0.15, retry_jitter=0
        )
        admitted = await submit(conn, "retry2", play="boom")
        async with running_worker(db_url, "retry2", registry):

            async def failed() -> runs.Run | None:
                run = await runs.get(conn, admitted.run_id)
                return run if run.terminal else None

            run = await eventually(failed, "the run to exhaust its retries", timeout=15)
        assert run.state == "failed" and run.attempt == 3
        assert run.error is not None and run.error["message"] == "boom on attempt 3"
        tries = await runs.attempts(conn, admitted.run_id)
        assert [t.outcome for t in tries] == ["failed"] * 3
        retries = [
            e for e in await runs.events(conn, admitted.run_id) if e.kind == "retry_scheduled"
        ]
        spawn_at = [datetime.fromisoformat(e.data["spawn_at"]) for e in retries]
        assert len(spawn_at) == 2
        # Each retry was scheduled the lane's backoff after the failure was decided...
        failed_at = [t.finished_at for t in tries[:2]]
        assert all(f is not None for f in failed_at)
        # ...and no attempt started before its retry was due (ordering, not wall-clock speed).
        for due, later_try in zip(spawn_at, tries[1:], strict=True):
            assert later_try.started_at >= due, (due, later_try.started_at)


async def test_suspensions_do_not_use_up_the_retry_budget(db_url: str) -> None:
    """Only failed attempts count against ``retry_max_attempts``.

    A play that sleeps twice (each wake is a new attempt, outcome ``suspended``) and then
    fails must still get its retries: with max 3 attempts the run fails after its third
    *failed* attempt, not at its first failure because the attempt counter reached 3.

    Each sleep is long enough that it cannot elapse while it is being recorded (a sleep
    already over by then returns without suspending, rightly), even on a loaded machine.
    """
    registry = Registry()

    @registry.play("nap-then-boom")
    async def nap_then_boom(ctx: RunContext, params: dict[str, Any]) -> None:
        await ctx.sleep(0.5)
        await ctx.sleep(0.5)
        raise RuntimeError(f"boom on attempt {ctx.attempt}")

    async with connect(db_url) as conn:
        await lanes.prepare(conn, "retry3")
        await lanes.set_policy(
            conn,
            "retry3",
            retry_max_attempts=3,
            retry_base_s=0.05,
            retry_cap_s=0.05,
            retry_jitter=0,
        )
        admitted = await submit(conn, "retry3", play="nap-then-boom")
        async with running_worker(db_url, "retry3", registry):

            async def ended() -> runs.Run | None:
                run = await runs.get(conn, admitted.run_id)
                return run if run.terminal else None

            run = await eventually(ended, "the run to end", timeout=20)
        outcomes = [t.outcome for t in await runs.attempts(conn, admitted.run_id)]
        assert outcomes[:2] == ["suspended", "suspended"], outcomes
        assert run.state == "failed"
        assert outcomes.count("failed") == 3, (
            f"the run failed after {outcomes.count('failed')} failed attempt(s) "
            f"of a budget of 3: {outcomes}"
        )


# ---- 9. cancel ------------------------------------------------------------------------------


async def test_cancel_queued_run_at_once_idempotent_and_finished_run_unchanged(db_url: str) -> None:
    async with connect(db_url) as conn:
        await lanes.prepare(conn, "cx1")
        queued = await submit(conn, "cx1", play="echo")
        res = await runs.cancel(conn, queued.run_id, reason="operator")
        assert (res.before, res.after, res.changed, res.jobs_cancelled) == (
            "queued",
            "cancelled",
            True,
            1,
        )
        run = await runs.get(conn, queued.run_id)
        assert run.state == "cancelled" and run.finished_at is not None
        assert run.cancel_reason == "operator" and run.job_id is None
        assert queued.job_id is not None
        assert await job_status(conn, queued.job_id) == "cancelled"
        assert (
            await runs.claim(conn, lanes=["r-cx1"], worker_id="w", limit=10, plays=["echo"]) == []
        )

        events = len(await runs.events(conn, queued.run_id))
        again = await runs.cancel(conn, queued.run_id)
        assert (again.before, again.after, again.changed, again.jobs_cancelled) == (
            "cancelled",
            "cancelled",
            False,
            0,
        )
        assert await runs.get(conn, queued.run_id) == run
        assert len(await runs.events(conn, queued.run_id)) == events

        done = await submit(conn, "cx1", play="echo")
        await claim_one(conn, "r-cx1", "w", ["echo"])
        await runs.finish(conn, worker_id="w", finishes=[outcomes.succeeded(done.run_id, 1, 42)])
        finished = await runs.get(conn, done.run_id)
        res = await runs.cancel(conn, done.run_id)
        assert (res.before, res.changed) == ("succeeded", False)
        assert await runs.get(conn, done.run_id) == finished


async def test_cancel_running_run_runs_cleanup_before_the_final_write(db_url: str) -> None:
    registry = Registry()
    started = asyncio.Event()

    async def cleanup(ctx: RunContext) -> None:
        async with connect(db_url) as side:
            await side.execute(
                "INSERT INTO cleanup_log (run_id, attempt, at) VALUES (%(id)s, %(a)s,"
                " clock_timestamp())",
                {"id": ctx.run_id, "a": ctx.attempt},
            )

    @registry.play("blocker")
    async def blocker(ctx: RunContext, params: dict[str, Any]) -> None:
        ctx.on_cancel(cleanup)
        started.set()
        await asyncio.Event().wait()  # blocks until cancelled

    async with connect(db_url) as conn:
        await conn.execute(
            "CREATE TABLE cleanup_log (run_id uuid, attempt int, at timestamptz NOT NULL)"
        )
        await lanes.prepare(conn, "cx2")
        admitted = await submit(conn, "cx2", play="blocker")
        async with running_worker(db_url, "cx2", registry):
            await asyncio.wait_for(started.wait(), DEADLINE_S)
            assert (await runs.get(conn, admitted.run_id)).state == "running"
            res = await runs.cancel(conn, admitted.run_id, reason="stop it")
            assert (res.before, res.after, res.changed, res.notified) == (
                "running",
                "running",
                True,
                True,
            )

            async def cancelled() -> runs.Run | None:
                run = await runs.get(conn, admitted.run_id)
                return run if run.state == "cancelled" else None

            run = await eventually(cancelled, "the running attempt to stop")
        cur = await conn.execute("SELECT run_id, attempt, at FROM cleanup_log")
        rows = await cur.fetchall()
        assert len(rows) == 1 and rows[0][:2] == (admitted.run_id, 1)
        assert run.finished_at is not None and rows[0][2] < run.finished_at
        assert [t.outcome for t in await runs.attempts(conn, admitted.run_id)] == ["cancelled"]


# ---- 12. a play the worker does not have ----------------------------------------------


async def test_run_of_an_unknown_play_fails_without_burning_an_attempt(db_url: str) -> None:
    registry = Registry()

    @registry.play("known")
    async def known(ctx: RunContext, params: dict[str, Any]) -> None:
        return None

    async with connect(db_url) as conn:
        admitted = await admission.Admitter().submit(
            conn, Submission(play="ghost", release="unk1"), known_plays=None
        )
        async with running_worker(db_url, "unk1", registry) as worker:

            async def ended() -> runs.Run | None:
                run = await runs.get(conn, admitted.run_id)
                return run if run.terminal else None

            run = await eventually(ended, "the worker to refuse the unknown play")
            assert worker.stats["claimed"] == 0
        assert run.state == "failed" and run.attempt == 0
        assert run.error is not None and run.error["code"] == "PLAY_UNKNOWN"
        assert "ghost" in run.error["message"] and "unk1" in run.error["message"]
        assert await runs.attempts(conn, admitted.run_id) == []
        assert admitted.job_id is not None
        assert await job_status(conn, admitted.job_id) == "succeeded"  # acknowledged, dropped


@pytest.fixture(autouse=True)
def _no_admission_only_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VERCEL", "WORKER_ADMISSION_ONLY"):
        monkeypatch.delenv(name, raising=False)
    assert "VERCEL" not in os.environ
