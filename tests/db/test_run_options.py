"""Per-run options (queues/options.py) in one rolled-back transaction: admission stores
them (and a retried key keeps the first run's), the claim reads each over the lane's
policy, a run past its claim deadline is failed at its claim or by the recovery pass and
never run, and the outcome policy follows the run's retry shape."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import admission, fields, lanes, options, outcomes, recovery, runs
from queues.errors import InputError, InvalidField, translate
from queues.lanes import RetryPolicy
from tests import attempts
from tests.attempts import ORG, PLAY, RELEASE, T0

Conn = psycopg.AsyncConnection[Any]


async def _admit(conn: Conn, **option: Any) -> Any:
    await lanes.prepare(conn, RELEASE)
    admitted = await admission.submit(
        conn,
        admission.Submission(play=PLAY, release=RELEASE, org=ORG, **option),
    )
    return admitted


async def test_options_are_stored_with_the_run_and_shown(conn: Conn) -> None:
    admitted = await _admit(
        conn,
        max_attempts=2,
        retry="fixed:30s",
        timeout="90s",
        start_by="2031-01-01T00:00:00+00:00",
        meta={"trace": "abc"},
        idempotency_key="k1",
    )
    shown = await options.shown(conn, admitted.run_id)
    assert shown is not None
    assert shown.as_dict() == {
        "max_attempts": 2,
        "retry": "fixed:base=30s,jitter=0.1",
        "timeout_s": 90.0,
        "start_by": T0.replace(year=2031),
        "meta": {"trace": "abc"},
        "parent_id": None,
        "children": 0,
    }
    # The same key again is the same run: its options stay the first call's.
    again = await _admit(conn, max_attempts=9, idempotency_key="k1")
    assert (again.run_id, again.created) == (admitted.run_id, False)
    assert (await options.shown(conn, admitted.run_id)).max_attempts == 2  # type: ignore[union-attr]


async def test_a_run_without_options_has_none_and_its_lane_decides(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    shown = await options.shown(conn, run_id)
    assert shown is not None and shown.as_dict()["max_attempts"] is None
    claimed = await attempts.claim(conn, run_id=run_id)
    lane = await lanes.get(conn, lanes.lane_name(RELEASE))
    assert lane is not None
    assert claimed.claimed.retry == lane.retry
    assert claimed.claimed.timeout_at is None and claimed.claimed.meta is None


async def test_the_claim_reads_the_runs_options_over_its_lanes(conn: Conn) -> None:
    await lanes.prepare(conn, RELEASE)
    await lanes.set_policy(conn, RELEASE, retry_max_attempts=5, run_timeout_s=600.0)
    admitted = await _admit(
        conn, max_attempts=2, retry="exponential:base=1s,factor=3,cap=1m,jitter=0", timeout=5
    )
    c = (await attempts.claim(conn, run_id=admitted.run_id)).claimed
    assert c.retry == RetryPolicy(
        max_attempts=2, base_s=1.0, cap_s=60.0, jitter=0.0, kind="exponential", factor=3.0
    )
    assert c.claimed_at == T0 and c.timeout_at == T0 + timedelta(seconds=5)
    # The lane's run timeout applies to a run without its own.
    other = await attempts.claim(conn, run_id=await attempts.admit(conn), now=T0)
    assert other.claimed.timeout_at == T0 + timedelta(seconds=600)


async def test_a_run_past_its_claim_deadline_is_failed_by_the_claim_not_run(conn: Conn) -> None:
    late = await _admit(conn, start_by=T0 - timedelta(seconds=1))
    on_time = await _admit(conn, start_by=T0 + timedelta(seconds=1))
    got = await runs.claim(
        conn,
        lanes=[lanes.lane_name(RELEASE)],
        worker_id="w1",
        limit=10,
        plays=[PLAY],
        now=T0,
    )
    assert {c.run_id for c in got if c.claimed} == {on_time.run_id}
    run = await runs.get(conn, late.run_id)
    assert run.state == "failed" and run.error["code"] == "START_DEADLINE_PASSED"
    assert run.started_at is None and await runs.attempts(conn, late.run_id) == []
    kinds = [e.kind for e in await runs.events(conn, late.run_id)]
    assert kinds == ["run_created", "run_failed"]


async def test_the_recovery_pass_fails_a_late_run_no_worker_claimed(conn: Conn) -> None:
    late = await _admit(conn, start_by=T0)
    waiting = await _admit(conn, start_by=T0 + timedelta(hours=1))
    report = await recovery.run_once(conn, now=T0 + timedelta(seconds=1))
    assert report.unstarted_failed == (late.run_id,)
    assert report.counts()["start_deadline_failed"] == 1
    assert (await runs.get(conn, late.run_id)).error["code"] == "START_DEADLINE_PASSED"
    assert (await runs.get(conn, waiting.run_id)).state == "queued"
    cur = await conn.execute(
        "SELECT waiting FROM wq_transport_jobs() WHERE id = %s", (late.job_id,)
    )
    assert await cur.fetchone() == (False,)  # its job was withdrawn


async def test_a_retry_is_never_late_only_a_first_start(conn: Conn) -> None:
    admitted = await _admit(conn, start_by=T0 + timedelta(seconds=5), max_attempts=3)
    first = await attempts.claim(conn, run_id=admitted.run_id)
    final = outcomes.after_exception(
        admitted.run_id,
        1,
        RuntimeError("boom"),
        outcomes.Budget(first.claimed.retry, 0, 0, 20),
        now=T0,
        fatal=False,
        rng=random.Random(1),
    )
    await runs.finish(conn, worker_id="w1", finishes=[final])
    # The retry comes past the deadline, and runs: the run did start in time.
    again = await attempts.claim(conn, run_id=admitted.run_id, now=T0 + timedelta(hours=1))
    assert again.fence.attempt == 2


def test_retry_shapes_decide_the_delay_and_the_budget() -> None:
    none = RetryPolicy(max_attempts=5, kind="none")
    assert none.exhausted(1)
    fixed = RetryPolicy(max_attempts=5, base_s=30, cap_s=30, jitter=0, kind="fixed", factor=1)
    assert [fixed.delay(n) for n in (1, 2, 3)] == [30, 30, 30]
    exp = RetryPolicy(max_attempts=5, base_s=1, cap_s=10, jitter=0, factor=3)
    assert [exp.delay(n) for n in (1, 2, 3, 4)] == [1, 3, 9, 10]
    lane = RetryPolicy(max_attempts=5, base_s=2, cap_s=300, jitter=0)
    assert [lane.delay(n) for n in (1, 2, 3)] == [2, 4, 8]  # the lane's: factor 2


async def test_an_option_the_database_does_not_know_is_refused(conn: Conn) -> None:
    await lanes.prepare(conn, RELEASE)
    with pytest.raises(psycopg.Error) as raised:
        await conn.execute(
            "SELECT * FROM wq_submit_with_options(gen_random_uuid(), 'o', 'p', '{}', %s, %s,"
            " NULL, 0, '{}', NULL, 0, NULL, %s)",
            (RELEASE, lanes.lane_name(RELEASE), Jsonb({"max_attempts": 2, "colour": "red"})),
        )
    assert raised.value.sqlstate == "WQ008"
    mapped = translate(raised.value)
    assert isinstance(mapped, InvalidField) and mapped.field == "colour"


@pytest.mark.parametrize(
    ("option", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"retry": "sometimes"}, "retry"),
        ({"retry": "exponential:base=2s,cap=1s"}, "retry"),
        ({"retry": {"kind": "fixed", "colour": 1}}, "retry"),
        ({"timeout": "nan"}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"start_by": "tomorrow"}, "start_by"),
        ({"start_by": "2030-01-01T00:00:00"}, "start_by"),  # no offset
        ({"meta": ["a"]}, "meta"),
        ({"meta": {"x": "y" * (fields.MAX_META_BYTES + 1)}}, "meta"),
        ({"priority": 10**9}, "priority"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(
    option: dict[str, Any], field: str
) -> None:
    with pytest.raises(InputError) as raised:
        admission.validate(admission.Submission(play=PLAY, **option))
    assert raised.value.field == field


async def test_a_batch_refuses_options_it_would_drop(conn: Conn) -> None:
    with pytest.raises(InvalidField, match="run options"):
        await admission.submit_many(conn, [admission.Submission(play=PLAY, max_attempts=2)])
