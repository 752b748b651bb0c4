"""Admission against real Postgres, each test in one rolled-back transaction.

The ``tx`` fixture opens the outer transaction with a first statement, so every
``conn.transaction()`` inside the code under test is a savepoint and nothing commits.
Every release name is unique to its test: the process memoizes prepared lanes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import structlog

from queues import admission, lanes, runs
from queues.admission import Submission
from queues.errors import (
    IdempotencyConflict,
    InvalidField,
    LaneDraining,
    LaneNotPrepared,
    LaneReclaimed,
    PayloadTooLarge,
    UnknownPlay,
)

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
async def tx(conn: Conn) -> AsyncIterator[Conn]:
    await conn.execute("SELECT 1")  # open the outer (rolled-back) transaction
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    yield conn


async def counts(conn: Conn) -> dict[str, int]:
    found = {}
    # wq_ledger: the events readers see, wq_events' rows and those the run row stands for.
    for table in ("wq_runs", "procrastinate_jobs", "wq_ledger", "wq_lanes", "wq_run_inputs"):
        cur = await conn.execute(f"SELECT count(*) FROM {table}")
        row = await cur.fetchone()
        assert row is not None
        found[table] = int(row[0])
    return found


def release() -> str:
    return "t" + uuid.uuid4().hex[:10]


async def test_submit_in_a_rolled_back_savepoint_leaves_no_run_and_no_job(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    before = await counts(tx)
    async with tx.transaction(force_rollback=True):
        admitted = await admission.submit(
            tx, Submission(play="noop", release=rel), inputs=[("k1", {"a": 1})]
        )
        assert (await runs.get(tx, admitted.run_id)).state == "queued"
        assert (await counts(tx))["procrastinate_jobs"] == before["procrastinate_jobs"] + 1
    assert await counts(tx) == before
    cur = await tx.execute(
        "SELECT count(*) FROM procrastinate_jobs WHERE args ->> 'run_id' = %(id)s",
        {"id": str(admitted.run_id)},
    )
    assert await cur.fetchone() == (0,)


async def test_unprepared_lane_refuses_loudly_writes_nothing_then_succeeds_after_prepare(
    tx: Conn,
) -> None:
    rel = release()
    sub = Submission(play="noop", release=rel, params={"limit": 3}, idempotency_key="webhook-1")
    before = await counts(tx)
    with pytest.raises(LaneNotPrepared) as err:
        await admission.submit(tx, sub, inputs=[("k1", {"a": 1})])
    exc = err.value
    assert exc.code == "LANE_NOT_PREPARED"
    assert f"r-{rel}" in exc.message and repr(rel) in exc.message
    assert exc.fix is not None and f"worker start --release {rel}" in exc.fix
    assert f"worker queues prepare {rel}" in exc.fix
    assert await counts(tx) == before

    # The webhook retries after the worker prepared the lane: the same key is free.
    await lanes.prepare(tx, rel)
    admitted = await admission.submit(tx, sub, inputs=[("k1", {"a": 1})])
    assert admitted.created and admitted.lane == f"r-{rel}" and admitted.job_id is not None
    after = await counts(tx)
    assert after["wq_runs"] == before["wq_runs"] + 1
    assert after["procrastinate_jobs"] == before["procrastinate_jobs"] + 1
    assert after["wq_run_inputs"] == before["wq_run_inputs"] + 1
    kinds = [e.kind for e in await runs.events(tx, admitted.run_id)]
    assert kinds == ["run_created"]
    cur = await tx.execute(
        "SELECT queue_name, task_name, status::text, args FROM procrastinate_jobs"
        " WHERE id = %(id)s",
        {"id": admitted.job_id},
    )
    assert await cur.fetchone() == (
        f"r-{rel}",
        "wq.run",
        "todo",
        {"run_id": str(admitted.run_id), "org": "default"},  # the org: the claim's fair order
    )


async def test_draining_and_reclaimed_lanes_refuse_admission(tx: Conn) -> None:
    draining, reclaimed = release(), release()
    await lanes.prepare(tx, draining)
    await lanes.drain(tx, draining)
    await lanes.prepare(tx, reclaimed)
    await lanes.reclaim(tx, reclaimed)
    before = await counts(tx)
    with pytest.raises(LaneDraining, match="is draining") as drained:
        await admission.submit(tx, Submission(play="noop", release=draining))
    assert drained.value.code == "LANE_DRAINING"
    assert f"worker queues reopen {draining}" in (drained.value.fix or "")
    with pytest.raises(LaneReclaimed) as err:
        await admission.submit(tx, Submission(play="noop", release=reclaimed))
    assert err.value.code == "LANE_RECLAIMED" and f"r-{reclaimed}" in err.value.message
    assert await counts(tx) == before
    # Lazy preparation never reopens them; only the operator's reopen does (and then works).
    for closed in (draining, reclaimed):
        assert (await lanes.prepare(tx, closed)).state != "prepared"
    with pytest.raises(LaneReclaimed):
        await admission.submit(tx, Submission(play="noop", release=reclaimed))
    await lanes.reopen(tx, reclaimed)
    assert (await admission.submit(tx, Submission(play="noop", release=reclaimed))).created


@pytest.mark.parametrize(
    ("statement", "verb"),
    [
        ("DELETE FROM wq_lanes WHERE name = %s", "deleted"),
        ("UPDATE wq_lanes SET name = name || '-x' WHERE name = %s", "renamed"),
    ],
)
@pytest.mark.parametrize("with_runs", [True, False], ids=["with-runs", "empty"])
async def test_a_lane_is_never_deleted_or_renamed(
    tx: Conn, statement: str, verb: str, with_runs: bool
) -> None:
    """Every run's lane exists (migration 0027 holds it instead of a foreign key): a lane
    is reclaimed, never deleted or renamed, and the refusal changes nothing."""
    rel = release()
    await lanes.prepare(tx, rel)
    if with_runs:
        await admission.submit(tx, Submission(play="noop", release=rel))
        await admission.submit_many(tx, [Submission(play="noop", release=rel)] * 2)
    await lanes.drain(tx, rel)
    await lanes.reclaim(tx, rel, force=True)
    before = await counts(tx)
    with pytest.raises(psycopg.errors.RestrictViolation) as refused:
        async with tx.transaction():
            await tx.execute(statement, (f"r-{rel}",))  # type: ignore[arg-type]
    assert f"lane 'r-{rel}' is never {verb}" in str(refused.value)
    assert f"worker queues reclaim {rel}" in (refused.value.diag.message_hint or "")
    assert await counts(tx) == before
    cur = await tx.execute(
        "SELECT count(*) FROM wq_runs r"
        " WHERE NOT EXISTS (SELECT 1 FROM wq_lanes l WHERE l.name = r.lane)"
    )
    assert await cur.fetchone() == (0,)
    await tx.execute("UPDATE wq_lanes SET concurrency = 3 WHERE name = %s", (f"r-{rel}",))


async def test_same_key_returns_the_run_and_other_request_conflicts(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    sub = Submission(
        play="noop", release=rel, params={"b": [1, 2], "a": 1.5}, idempotency_key="req-7"
    )
    first = await admission.submit(tx, sub)
    again = await admission.submit(
        tx,
        Submission(
            play="noop", release=rel, params={"a": 1.5, "b": [1, 2]}, idempotency_key="req-7"
        ),
    )
    assert first.created and not again.created
    assert again.run_id == first.run_id and again.job_id is None
    before = await counts(tx)
    with pytest.raises(IdempotencyConflict, match="other params"):
        await admission.submit(
            tx, Submission(play="noop", release=rel, params={"a": 2}, idempotency_key="req-7")
        )
    with pytest.raises(IdempotencyConflict, match="play 'noop'"):
        await admission.submit(
            tx,
            Submission(
                play="enrich", release=rel, params={"b": [1, 2], "a": 1.5}, idempotency_key="req-7"
            ),
        )
    # The key is per org: another org's identical key is a new run.
    other = await admission.submit(
        tx,
        Submission(
            play="noop", release=rel, org="acme", params=sub.params, idempotency_key="req-7"
        ),
    )
    assert other.created and other.run_id != first.run_id
    assert (await counts(tx))["wq_runs"] == before["wq_runs"] + 1


async def test_resubmit_of_an_admitted_key_returns_the_run_after_the_lane_drained(
    tx: Conn,
) -> None:
    """A webhook retried after a cutover must learn that its run exists.

    The first submit committed but its response was lost; meanwhile the lane was drained.
    The retry with the same key must answer ``created=False`` with the run, not
    LANE_NOT_PREPARED ("nothing was written"), which would lead the caller to admit the
    same request again elsewhere.
    """
    rel = release()
    await lanes.prepare(tx, rel)
    sub = Submission(play="noop", release=rel, idempotency_key="delivery-9")
    first = await admission.submit(tx, sub)
    await lanes.drain(tx, rel)
    again = await admission.submit(tx, sub)
    assert (again.run_id, again.created) == (first.run_id, False)


@pytest.mark.parametrize(
    "bad",
    [
        "v1'; DROP TABLE wq_runs; --",
        'v1"',
        "v1;",
        "x" * 500,
        "",
        "-leading-dash",
        "v1 with space",
        "ümlaut",
    ],
)
async def test_unsafe_release_names_are_refused_before_any_sql(tx: Conn, bad: str) -> None:
    before = await counts(tx)
    with pytest.raises(InvalidField) as err:
        await admission.Admitter().submit(
            tx,
            Submission(play="noop", release=bad),
            known_plays=frozenset({"noop"}),
        )
    assert err.value.code == "FIELD_INVALID" and err.value.field == "release"
    assert err.value.fix and len(err.value.render()) < 600
    assert await counts(tx) == before


async def test_unknown_play_is_refused_with_a_suggestion(tx: Conn) -> None:
    before = await counts(tx)
    with pytest.raises(UnknownPlay) as err:
        await admission.Admitter().submit(
            tx,
            Submission(play="enrihc", release=release()),
            known_plays=frozenset({"enrich", "noop"}),
        )
    assert err.value.code == "PLAY_UNKNOWN"
    assert "did you mean 'enrich'?" in err.value.message
    assert await counts(tx) == before


async def test_oversized_params_are_refused(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    before = await counts(tx)
    with pytest.raises(PayloadTooLarge):
        await admission.submit(
            tx, Submission(play="noop", release=rel, params={"blob": "x" * (300 * 1024)})
        )
    with pytest.raises(InvalidField, match=r"params is not JSON"):
        await admission.submit(tx, Submission(play="noop", release=rel, params={"x": float("nan")}))
    assert await counts(tx) == before


async def test_lazy_preparation_and_one_log_line_naming_the_lane(tx: Conn) -> None:
    """An ordinary (not admission-only) caller prepares the lane on its first submit."""
    rel = release()
    admitter = admission.Admitter(max_concurrent=2)
    with structlog.testing.capture_logs() as logs:
        admitted = await admitter.submit(
            tx, Submission(play="noop", release=rel), known_plays=frozenset({"noop"})
        )
    assert admitted.created
    lane = await lanes.get(tx, f"r-{rel}")
    assert lane is not None and lane.state == "prepared"
    lines = [entry for entry in logs if entry["event"] == "run_submitted"]
    assert len(lines) == 1
    line = lines[0]
    assert line["lane"] == f"r-{rel}" and line["run_id"] == str(admitted.run_id)
    for key in ("permit_wait_ms", "queue_depth", "prepare_ms", "insert_ms", "total_ms"):
        assert key in line, key
    assert line["admission_only"] is False


async def test_input_rows_are_stored_in_pages_with_the_launch_row_and_counted(tx: Conn) -> None:
    rel = release()
    await lanes.prepare(tx, rel)
    rows = [(f"k{i}", {"i": i}) for i in range(2500)]
    admitted = await admission.submit(tx, Submission(play="enrich", release=rel), inputs=rows)
    run = await runs.get(tx, admitted.run_id)
    assert (run.input_rows, run.rows_admitted, run.rows_total) == (2500, 0, 2500)
    pages = [await runs.input_page(tx, admitted.run_id, page) for page in range(4)]
    assert [len(p) for p in pages[:3] if p is not None] == [1000, 1000, 500]
    assert pages[3] is None
    assert pages[2] is not None and pages[2][-1] == ("k2499", {"i": 2499})
