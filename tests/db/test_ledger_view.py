"""The ledger view (``wq_ledger``) on both sides of its contract step (docs/design.md,
section 11b).

Before the step (migration 0041) every lifecycle event is written twice: on its state row
(the attempt row, or the run row) and in ``wq_events``; that is the expand release's
ledger, and the previous release reads ``wq_events`` alone. After it, an event a state
row stands for is no longer stored. These tests run the lifecycle's scenarios with the
real statements under the expand release's event trigger (0037's, put back in the test's
transaction) and under the contract step's, and check, per run, that

- before the step, the ledger read from the view (what ``worker events``, ``--follow``,
  the dashboard read) is the ledger read from ``wq_events`` alone, and every event a state
  row stands for is the ``wq_events`` row of its (run_id, seq);
- after it, the view shows the same ledger (kinds, seqs, attempts, data, order, gapless
  from 1) while ``wq_events`` holds none of the events a state row stands for; and
- the step itself, applied to a database the expand release wrote, keeps every ledger as
  it was.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg

from queues import admission, children, lanes, migrations, operator, options, recovery, runs
from queues.options import RunOptions
from queues.outcomes import cancelled, failed, succeeded, suspended
from tests import attempts
from tests.attempts import ORG, PLAY, T0

Conn = psycopg.AsyncConnection[Any]
Row = tuple[int, str, int | None, Any]  # seq, kind, attempt, data
SECOND = timedelta(seconds=1)

# The kinds the state rows stand for (design 11b); the scenarios below write each of them.
STATE_KINDS = {
    "run_created",
    "attempt_started",
    "cleanup_started",
    "retry_scheduled",
    "run_sleeping",
    "run_waiting",
    "lease_expired",
    "run_succeeded",
    "run_failed",
    "run_cancelled",
}


async def _finish(conn: Conn, a: attempts.Attempt, f: Any) -> None:
    status = await runs.finish(conn, worker_id=a.fence.owner, finishes=[f])
    assert str(status[(a.run_id, a.fence.attempt)]) == "applied", status


async def _claim(conn: Conn, run_id: uuid.UUID, *, minutes: int, play: str = PLAY) -> Any:
    return await attempts.claim(
        conn, now=T0 + timedelta(minutes=minutes), run_id=run_id, plays=(play,)
    )


async def _scenarios(conn: Conn) -> dict[str, uuid.UUID]:
    """Every scenario of the issue, through the real statements; their runs by name."""
    made: dict[str, uuid.UUID] = {}

    # First, while no run is finished (the recovery pass's retention would delete those
    # its far-future clock finds expired): a lapsed lease rescued by recovery, claimed
    # again and finished; and a cleanup-only attempt (a cancel was requested of an attempt
    # whose lease then lapsed). One rescue takes both.
    lapsed = await attempts.start(conn)
    doomed = await attempts.start(conn)
    await runs.cancel(conn, doomed.run_id, reason="stop", actor="ops")
    await attempts.rescue(conn, lapsed)
    # Both due again: one claim takes both (which job comes first is the rescue's order).
    later = lapsed.lapses_at + timedelta(minutes=10)
    got = await runs.claim(
        conn,
        lanes=[lanes.lane_name(attempts.RELEASE)],
        worker_id="w2",
        limit=2,
        plays=[PLAY],
        now=later,
    )
    again = {x.run_id: attempts.Attempt(x.fence("w2"), x, later) for x in got if x.claimed}
    b, c = again[lapsed.run_id], again[doomed.run_id]
    assert c.claimed.cleanup
    await _finish(conn, b, succeeded(b.run_id, b.fence.attempt, None))
    await _finish(conn, c, cancelled(c.run_id, c.fence.attempt, "stop"))
    made["lapse"] = lapsed.run_id
    made["cleanup"] = doomed.run_id
    # Success.
    a = await attempts.start(conn)
    await _finish(conn, a, succeeded(a.run_id, a.fence.attempt, {"ok": 1}))
    made["success"] = a.run_id

    # A failure retried, then a success.
    a = await attempts.start(conn)
    retry = failed(
        a.run_id,
        a.fence.attempt,
        {"code": "BOOM", "message": "boom", "traceback": "tb"},
        a.claimed.retry,
        now=T0,
        failure=1,
    )
    assert retry.kind == "retry_scheduled"
    await _finish(conn, a, retry)
    b = await _claim(conn, a.run_id, minutes=30)
    await _finish(conn, b, succeeded(b.run_id, b.fence.attempt, None))
    made["retry"] = a.run_id

    # A cancel of a running attempt, its hooks, its cancelled outcome.
    a = await attempts.start(conn)
    await runs.cancel(conn, a.run_id, reason="stop", actor="ops")
    await _finish(conn, a, cancelled(a.run_id, a.fence.attempt, "stop"))
    made["cancel_running"] = a.run_id

    # A cancel of a queued run: the run row stands for its run_cancelled.
    run_id = await attempts.admit(conn)
    await runs.cancel(conn, run_id, reason="not needed", actor="ops")
    made["cancel_queued"] = run_id
    # Its job is stopped; nothing for a claim to take.

    # A forced cancel of a running attempt.
    a = await attempts.start(conn)
    await runs.cancel(conn, a.run_id, reason="now", force=True, actor="ops")
    made["cancel_forced"] = a.run_id

    # Sleep and wake.
    a = await attempts.start(conn)
    wake = T0 + timedelta(minutes=1)
    await _finish(conn, a, suspended(a.run_id, a.fence.attempt, wake_at=wake, wait_event=None))
    b = await _claim(conn, a.run_id, minutes=40)
    await _finish(conn, b, succeeded(b.run_id, b.fence.attempt, None))
    made["sleep"] = a.run_id

    # An event wait, woken by an emit.
    a = await attempts.start(conn)
    await _finish(conn, a, suspended(a.run_id, a.fence.attempt, wake_at=None, wait_event="paid"))
    await runs.emit(conn, org=ORG, name="paid", payload={"n": 1})
    b = await _claim(conn, a.run_id, minutes=50)
    await _finish(conn, b, succeeded(b.run_id, b.fence.attempt, None))
    made["wait"] = a.run_id

    # A failure for good, retried by an operator, then a success.
    a = await attempts.start(conn)
    await _finish(
        conn,
        a,
        failed(
            a.run_id,
            a.fence.attempt,
            {"code": "BAD", "message": "bad"},
            a.claimed.retry,
            now=T0,
            failure=1,
            retryable=False,
        ),
    )
    await operator.retry(conn, a.run_id, actor="ops", reason="fixed")
    b = await _claim(conn, a.run_id, minutes=60)
    await _finish(conn, b, succeeded(b.run_id, b.fence.attempt, None))
    made["operator_retry"] = a.run_id

    # A run ended without an attempt, retried by an operator, and ended that way again: the
    # run row has room for one finishing event, so the retry keeps the first one stored.
    run_id = await attempts.admit(conn)
    await runs.cancel(conn, run_id, reason="first", actor="ops")
    await operator.retry(conn, run_id, actor="ops", reason="again")
    await runs.cancel(conn, run_id, reason="second", actor="ops")
    made["cancel_retried"] = run_id

    # A child run, spawned by a running attempt, run to success.
    parent = await attempts.start(conn)
    spawned = await children.spawn(
        conn,
        fence=parent.fence,
        org=ORG,
        parent_play=PLAY,
        release=attempts.RELEASE,
        step_key="$spawn:child",
        play="child",
        params={"n": 1},
        options=RunOptions(max_attempts=2),
        priority=-1,
    )
    await _finish(conn, parent, succeeded(parent.run_id, parent.fence.attempt, None))
    c = await _claim(conn, spawned.run_id, minutes=70, play="child")
    await _finish(conn, c, succeeded(c.run_id, c.fence.attempt, None))
    made["parent"] = parent.run_id
    made["child"] = spawned.run_id

    # Runs ended without an attempt by the claim's drop and by recovery, each on a lane of
    # its own (a claim of the lane above would take their jobs): a play the release does not
    # have and a passed claim deadline (job_drop), a deadline passed with no claim at all
    # (options_expire_unstarted), and a sleeper whose cancel was requested and whose job is
    # gone (recovery_cancel_orphans).
    for release in ("ledger-drop", "ledger-late", "ledger-orphan"):
        await lanes.prepare(conn, release)
    gone = await admission.submit(conn, admission.Submission(play="gone", release="ledger-drop"))
    late = await admission.submit(
        conn, admission.Submission(play=PLAY, release="ledger-drop", start_by=T0 - SECOND)
    )
    got = await runs.claim(
        conn, lanes=[lanes.lane_name("ledger-drop")], worker_id="w1", limit=10, plays=[PLAY], now=T0
    )
    assert not [c for c in got if c.claimed]
    made["drop_unknown_play"] = gone.run_id
    made["drop_late"] = late.run_id
    unclaimed = await admission.submit(
        conn, admission.Submission(play=PLAY, release="ledger-late", start_by=T0 - SECOND)
    )
    assert await options.expire_unstarted(conn, now=T0) == [unclaimed.run_id]
    made["expire_unstarted"] = unclaimed.run_id
    await attempts.admit(conn, release="ledger-orphan")
    a = await attempts.claim(conn, release="ledger-orphan")
    wake = T0 + timedelta(days=1)
    await _finish(conn, a, suspended(a.run_id, a.fence.attempt, wake_at=wake, wait_event=None))
    await conn.execute(
        "UPDATE wq_runs SET cancel_requested_at = now(), cancel_reason = 'stop' WHERE id = %s",
        (a.run_id,),
    )
    await conn.execute(
        "SELECT wq_transport_stop(ARRAY[job_id]) FROM wq_runs WHERE id = %s", (a.run_id,)
    )
    _, orphans_cancelled, _, _ = await recovery.respawn_orphans(conn, now=wake + SECOND)
    assert orphans_cancelled == [a.run_id]
    made["orphan_cancelled"] = a.run_id

    return made


def _migration(number: int) -> str:
    [found] = [m.sql for m in migrations.code_migrations() if m.number == number]
    return found


def _function(number: int, head: str) -> bytes:
    sql = _migration(number)
    start = sql.index(head)
    body = sql[start : sql.index("\n$$;", start) + 4]
    return body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1).encode()


async def _expand_era(conn: Conn) -> None:
    """The database as the expand release left it, in the test's transaction: its event
    trigger (migration 0037's) and its wq_ledger_lifecycle (0038's, and the claim's form
    of it, 0040's) store every lifecycle event in wq_events as well."""
    await conn.execute(_function(37, "CREATE OR REPLACE FUNCTION wq_events_sequence()"))
    await conn.execute(_function(38, "CREATE FUNCTION wq_ledger_lifecycle("))
    await conn.execute(_function(40, "CREATE FUNCTION wq_ledger_lifecycle("))


async def _ledgers(conn: Conn, made: dict[str, uuid.UUID], relation: str) -> dict[str, Any]:
    """Each scenario's ledger from ``relation``, its run ids, job ids and retry times named
    apart, so the same scenario run twice gives the same ledger."""
    names = {str(run_id): name for name, run_id in made.items()}
    # A job's id (a sequence's) and a retry's time (jittered) differ from run to run.
    apart = {"job_id": "job", "old_job_id": "job", "retry_at": "time", "spawn_at": "time"}

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: apart.get(k, plain(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return names.get(value, value) if isinstance(value, str) else value

    return {
        name: [(s, k, a, plain(d)) for s, k, a, d in await _rows(conn, relation, run_id)]
        for name, run_id in made.items()
    }


async def _rows(conn: Conn, relation: str, run_id: uuid.UUID) -> list[Row]:
    cur = await conn.execute(
        f"SELECT seq, kind, attempt, data FROM {relation} WHERE run_id = %s ORDER BY seq",
        (run_id,),
    )
    return [(int(s), k, a, d) for s, k, a, d in await cur.fetchall()]


async def test_before_the_contract_the_view_shows_each_runs_ledger_as_wq_events_does(
    conn: Conn,
) -> None:
    await _expand_era(conn)
    made = await _scenarios(conn)
    for name, run_id in made.items():
        from_events = await _rows(conn, "wq_events", run_id)
        from_view = await _rows(conn, "wq_ledger", run_id)
        read = await runs.events(conn, run_id)  # what `worker events` and --follow read
        assert from_view == from_events, name
        assert [(e.seq, e.kind, e.attempt, e.data) for e in read] == from_events, name
        assert [r[0] for r in from_events] == list(range(1, len(from_events) + 1)), name
    # The scenarios' shapes, so a scenario that wrote nothing cannot pass.
    kinds = {n: [k for _, k, _, _ in await _rows(conn, "wq_ledger", r)] for n, r in made.items()}
    assert kinds["success"] == ["run_created", "attempt_started", "run_succeeded"]
    assert kinds["retry"] == [
        "run_created",
        "attempt_started",
        "retry_scheduled",
        "attempt_started",
        "run_succeeded",
    ]
    assert kinds["cancel_queued"] == ["run_created", "run_cancelled"]
    assert kinds["cancel_running"] == [
        "run_created",
        "attempt_started",
        "cancel_requested",
        "run_cancelled",
    ]
    assert "event_received" in kinds["wait"] and "run_waiting" in kinds["wait"]
    assert "run_sleeping" in kinds["sleep"]
    assert "run_retried" in kinds["operator_retry"]
    assert "child_spawned" in kinds["parent"]
    assert "lease_expired" in kinds["lapse"]
    assert "cleanup_started" in kinds["cleanup"]
    for name in ("drop_unknown_play", "drop_late", "expire_unstarted"):
        assert kinds[name] == ["run_created", "run_failed"], name
    assert kinds["cancel_retried"] == [
        "run_created",
        "run_cancelled",
        "run_retried",
        "run_cancelled",
    ]
    assert kinds["orphan_cancelled"] == [
        "run_created",
        "attempt_started",
        "run_sleeping",
        "run_cancelled",
    ]


async def test_each_event_a_state_row_stands_for_is_the_row_wq_events_holds(conn: Conn) -> None:
    await _expand_era(conn)
    made = await _scenarios(conn)
    seen: set[str] = set()
    for name, run_id in made.items():
        events = {r[0]: r for r in await _rows(conn, "wq_events", run_id)}
        synthesized = await _rows(conn, "wq_ledger_state", run_id)
        seqs = [s for s, _, _, _ in synthesized]
        assert len(seqs) == len(set(seqs)), f"{name}: two state rows claim one seq: {seqs}"
        for row in synthesized:
            assert row == events.get(row[0]), f"{name}: state row {row} vs wq_events"
            seen.add(row[1])
        # Every lifecycle event of wq_events has its state row (what the contract stops
        # inserting), except those that only the previous release's statements write and
        # a finishing event the run row gave up to an operator's retry (seq 2 of
        # cancel_retried: the retry stores it, from the contract step on).
        standing = {s for s, k, _, _ in events.values() if k in STATE_KINDS}
        kept = {2} if name == "cancel_retried" else set()
        assert standing - set(seqs) == kept, f"{name}: no state row for {standing - set(seqs)}"
    assert seen == STATE_KINDS


async def test_a_run_numbered_before_the_counter_is_seeded_from_its_last_event(
    conn: Conn,
) -> None:
    # A run admitted by the previous release's code path has no counter: the first
    # statement that numbers an event starts after its last one.
    await _expand_era(conn)
    run_id = await attempts.admit(conn)
    await conn.execute(
        "UPDATE wq_runs SET ledger_seq = NULL, created_lane = NULL WHERE id = %s", (run_id,)
    )
    await conn.execute(
        "INSERT INTO wq_events (run_id, kind, data) VALUES (%s, 'app.note', '{}')", (run_id,)
    )
    a = await attempts.claim(conn, run_id=run_id)
    await _finish(conn, a, succeeded(a.run_id, a.fence.attempt, None))
    view = await _rows(conn, "wq_ledger", run_id)
    assert [(s, k) for s, k, _, _ in view] == [
        (1, "run_created"),
        (2, "app.note"),
        (3, "attempt_started"),
        (4, "run_succeeded"),
    ]
    assert view == await _rows(conn, "wq_events", run_id)
    cur = await conn.execute("SELECT ledger_seq FROM wq_runs WHERE id = %s", (run_id,))
    assert await cur.fetchone() == (4,)


async def test_an_event_given_a_taken_seq_is_refused_as_a_serialization_failure(
    conn: Conn,
) -> None:
    # The race the expand release's trigger guards: a writer took seq n from the counter
    # while an older release's append (numbered without it) took n first.
    await _expand_era(conn)
    a = await attempts.start(conn)
    await conn.execute(
        "INSERT INTO wq_events (run_id, kind, data) VALUES (%s, 'app.note', '{}')", (a.run_id,)
    )
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO wq_events (run_id, kind, data, seq) VALUES (%s, 'x.y', '{}', 3)",
                (a.run_id,),
            )
    except psycopg.errors.SerializationFailure as exc:
        assert "next seq is 4" in str(exc)
    else:
        raise AssertionError("a taken seq was stored")


async def _expand_ledgers(conn: Conn) -> dict[str, Any]:
    """The scenarios' ledgers as the expand release stores them (wq_events alone), in a
    savepoint rolled back after: the database as it was before."""
    try:
        async with conn.transaction():
            await _expand_era(conn)
            expected = await _ledgers(conn, await _scenarios(conn), "wq_events")
            raise _Undo
    except _Undo:
        return expected


class _Undo(Exception):
    pass


async def _held_in_wq_events(conn: Conn, made: dict[str, uuid.UUID]) -> list[Any]:
    cur = await conn.execute(
        "SELECT e.run_id, e.seq, e.kind FROM wq_events e"
        "  JOIN wq_ledger_state s ON s.run_id = e.run_id AND s.seq = e.seq"
        " WHERE e.run_id = ANY(%s)",
        (list(made.values()),),
    )
    return await cur.fetchall()


async def test_after_the_contract_the_view_shows_the_same_ledgers_and_wq_events_none_twice(
    conn: Conn,
) -> None:
    expected = await _expand_ledgers(conn)
    made = await _scenarios(conn)
    got = await _ledgers(conn, made, "wq_ledger")
    for name, ledger in expected.items():
        assert got[name] == ledger, name
    assert got.keys() == expected.keys()
    assert await _held_in_wq_events(conn, made) == []
    # What is stored is what no state row holds: the first of two finishing events of a
    # run ended twice without an attempt (kept by the operator's retry), steps, operator
    # and play events; the lifecycle's own are gone from the table.
    stored = {n: [k for _, k, _, _ in await _rows(conn, "wq_events", r)] for n, r in made.items()}
    assert stored["success"] == []
    assert stored["cancel_retried"] == ["run_cancelled", "run_retried"]
    assert stored["cancel_running"] == ["cancel_requested"]
    for name, run_id in made.items():
        read = await runs.events(conn, run_id)
        assert [e.seq for e in read] == list(range(1, len(read) + 1)), name


async def test_the_contract_step_keeps_every_ledger_the_expand_release_wrote(
    conn: Conn,
) -> None:
    await conn.execute(
        "INSERT INTO wq_sinks (name, kind, url) VALUES ('crm', 'http', 'http://127.0.0.1:9/')"
    )
    await _expand_era(conn)
    made = await _scenarios(conn)
    before = await _ledgers(conn, made, "wq_ledger")
    assert await _held_in_wq_events(conn, made) != []
    await conn.execute(_migration(41).encode())
    assert await _ledgers(conn, made, "wq_ledger") == before
    assert await _held_in_wq_events(conn, made) == []
    # Each delivery still names its event, by (run_id, seq), the event as the view shows it.
    cur = await conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS ("
        "    SELECT 1 FROM wq_ledger v WHERE v.run_id = o.run_id AND v.seq = o.seq))"
        "  FROM wq_outbox o WHERE o.run_id = ANY(%s)",
        (list(made.values()),),
    )
    total, lost = await cur.fetchone() or (0, 0)
    assert total > 0 and lost == 0
