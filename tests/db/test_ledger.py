"""The run ledger, its outbox and the progress projection, on a real Postgres (one
rolled-back transaction per test).

Every run is really admitted and claimed (``tests/attempts.py``); every event comes from
the statement that makes the change. Time is controlled through ``now``: leases and
retries are decided by it, never by waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import lanes, ledger, migrations, outcomes, receipts, recovery, runs, sheets
from queues.errors import InvalidField, PayloadTooLarge, RunNotFound, SheetSuperseded
from queues.receipts import Scope
from queues.sheets import RowCompletion, RowStatus
from tests import attempts
from tests.attempts import ORG, PLAY, T0

Conn = psycopg.AsyncConnection[Any]
LEASE_S = 30.0


@pytest.fixture(autouse=True)
async def _rolled_back(conn: Conn) -> None:
    """Open the fixture's transaction first: every ``conn.transaction()`` of the code under
    test is then a savepoint inside it (an outermost one would commit)."""
    await conn.execute("SELECT 1")


async def kinds(conn: Conn, run_id: uuid.UUID) -> list[str]:
    return [e.kind for e in await runs.events(conn, run_id)]


async def last(conn: Conn, run_id: uuid.UUID, kind: str) -> runs.Event:
    found = [e for e in await runs.events(conn, run_id) if e.kind == kind]
    assert found, f"no {kind} event in {await kinds(conn, run_id)}"
    return found[-1]


async def outbox(conn: Conn, run_id: uuid.UUID) -> list[tuple[int, str, str]]:
    """(seq, sink, status) of every outbox row of a run: a delivery names its event by
    (run_id, seq) (migration 0038), one written before by event_id alone."""
    cur = await conn.execute(
        "SELECT coalesce(o.seq, e.seq) AS seq, o.sink, o.status::text"
        "  FROM wq_outbox o LEFT JOIN wq_events e ON e.id = o.event_id"
        " WHERE coalesce(o.run_id, e.run_id) = %s ORDER BY 1, o.sink",
        (run_id,),
    )
    return [(int(seq), str(sink), str(status)) for seq, sink, status in await cur.fetchall()]


def page(*keys: str) -> list[tuple[str, Any]]:
    return [(key, {"domain": f"{key}.example"}) for key in keys]


# ---- append --------------------------------------------------------------------------------


async def test_the_same_idempotency_key_appended_twice_stores_one_event(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    first = await ledger.append(conn, run_id, "crm_synced", {"n": 1}, idempotency_key="req-1")
    again = await ledger.append(conn, run_id, "crm_synced", {"n": 2}, idempotency_key="req-1")
    other = await ledger.append(conn, run_id, "crm_synced", {"n": 3}, idempotency_key="req-2")
    unkeyed = await ledger.append(conn, run_id, "note")
    assert again == first  # the stored event, with its own data
    assert (first.data, first.idempotency_key) == ({"n": 1}, "req-1")
    events = await runs.events(conn, run_id)
    assert [e.kind for e in events] == ["run_created", "crm_synced", "crm_synced", "note"]
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert (first.seq, other.seq, unkeyed.seq) == (2, 3, 4)
    # The key is per run: another run may use it.
    elsewhere = await attempts.admit(conn)
    assert (await ledger.append(conn, elsewhere, "crm_synced", {}, "req-1")).seq == 2


async def test_append_refuses_reserved_kinds_bad_input_and_unknown_runs(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    with pytest.raises(InvalidField) as reserved:
        await ledger.append(conn, run_id, "run_succeeded", {})
    assert reserved.value.field == "kind" and "reserved" in reserved.value.message
    for kind in ("", "Bad Kind", "1st"):
        with pytest.raises(InvalidField):
            await ledger.append(conn, run_id, kind, {})
    with pytest.raises(InvalidField):
        await ledger.append(conn, run_id, "note", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidField):
        await ledger.append(conn, run_id, "note", {}, idempotency_key=" ")
    with pytest.raises(PayloadTooLarge):
        await ledger.append(conn, run_id, "note", {"blob": "x" * ledger.MAX_DATA_BYTES})
    with pytest.raises(RunNotFound):
        await ledger.append(conn, uuid.uuid4(), "note", {})
    assert await kinds(conn, run_id) == ["run_created"]


# ---- every change appends its event ----------------------------------------------------------


async def test_every_change_appends_its_event_with_a_gapless_seq(conn: Conn) -> None:
    """One run's life, each step by the real statement: the ledger has one event per change,
    numbered 1, 2, 3, ... in order, and each statement folded its events into the progress
    projection (no outbox row: the progress sink is not delivered)."""
    a = await attempts.start(conn, play=PLAY)  # run_created, attempt_started
    run_id = a.run_id
    admitted = await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=a.fence, rows=page("k1", "k2"), stable_intent=True
    )
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=a.fence,
        write_version=admitted.write_version,
        completions=[RowCompletion("k1", {"ok": 1})],
    )
    step = {"org": ORG, "play": PLAY, "scope": Scope.of_run(run_id), "fence": a.fence}
    await receipts.claim(conn, receipts.StepRef(**step, step_key="pay"), lease_s=LEASE_S, now=T0)
    await receipts.fail(
        conn, receipts.StepRef(**step, step_key="pay"), error={"type": "Boom"}, now=T0
    )
    await attempts.rescue(conn, a)  # lease_expired
    b = await attempts.claim(conn, now=a.lapses_at + timedelta(minutes=10), run_id=run_id)
    await runs.cancel(conn, run_id, reason="wrong list")  # cancel_requested
    statuses = await runs.finish(
        conn,
        worker_id="w1",
        finishes=[outcomes.cancelled(run_id, b.fence.attempt, "wrong list")],
    )
    assert statuses[(run_id, b.fence.attempt)] is outcomes.FinishStatus.APPLIED
    events = await runs.events(conn, run_id)
    assert [e.kind for e in events] == [
        "run_created",
        "attempt_started",
        "rows_admitted",
        "rows_completed",
        "step_failed",
        "lease_expired",
        "attempt_started",
        "cancel_requested",
        "run_cancelled",
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert all(e.kind in ledger.SYSTEM_KINDS for e in events)
    by_kind = {e.kind: e for e in events}
    assert by_kind["rows_admitted"].data == {
        "sheet": "s",
        "write_version": admitted.write_version,
        "rows": 2,
        "admitted": 2,
        "readmitted": 0,
        "rows_admitted": 2,
    }
    assert by_kind["rows_admitted"].attempt == 1
    assert by_kind["rows_completed"].data["committed"] == 1
    assert by_kind["rows_completed"].data["rows_done"] == 1
    assert by_kind["step_failed"].data == {
        "step": "pay",
        "scope": f"run:{run_id}",
        "error": {"type": "Boom"},
    }
    assert await outbox(conn, run_id) == []
    seen = await ledger.progress(conn, run_id)
    assert seen is not None
    assert (seen.state, seen.attempt, seen.rows_admitted, seen.rows_done) == (
        "cancelled",
        2,
        2,
        1,
    )
    assert (seen.last_event_seq, seen.ledger_seq, seen.behind) == (len(events), len(events), False)


async def test_rows_completed_counts_match_what_the_writer_is_told(conn: Conn) -> None:
    """The ledger's per-outcome counts are computed in SQL; the writer's result in Python.
    A page with every outcome shows they agree (a drift between the two fails here)."""
    a = await attempts.start(conn)
    sheet = "mixed"
    mine = await sheets.admit_page(
        conn,
        org=ORG,
        sheet=sheet,
        fence=a.fence,
        rows=page("done", "same", "other", "fail", "taken", "older"),
        stable_intent=True,
    )
    v = mine.write_version
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=a.fence,
        write_version=v,
        completions=[RowCompletion("same", {"x": 1}), RowCompletion("other", {"x": 1})],
    )
    # Another run admits "taken" under a newer version (it re-admits a pending row).
    b = await attempts.start(conn, worker="w2")
    await sheets.admit_page(
        conn, org=ORG, sheet=sheet, fence=b.fence, rows=page("taken"), stable_intent=True
    )
    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=a.fence,
        write_version=v,
        completions=[
            RowCompletion("done", {"x": 2}),  # committed
            RowCompletion("fail", {"err": 1}, RowStatus.FAILED),  # committed, as failed
            RowCompletion("same", {"x": 1}),  # replayed: finished with this very result
            RowCompletion("other", {"x": 9}),  # already_terminal: another result
            RowCompletion("taken", {"x": 3}),  # newer_write_version
            RowCompletion("ghost", {"x": 4}),  # older_write_version: never admitted
        ],
    )
    event = await last(conn, a.run_id, "rows_completed")
    stale = Counter(row.reason.value for row in result.stale)
    assert event.data["committed"] == len(result.committed) == 3
    assert event.data["replayed"] == len(result.replayed) == 1
    assert event.data["failed"] == 1
    assert event.data["stale"] == dict(stale)
    assert stale == {"already_terminal": 1, "newer_write_version": 1, "older_write_version": 1}
    assert event.data["rows"] == 6 and event.data["rows_done"] == 4
    # The unversioned writer (fenced by run ownership alone): the same agreement.
    b_rows = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet=sheet,
        fence=b.fence,
        write_version=None,
        completions=[
            RowCompletion("taken", {"x": 5}),  # committed: pending and b's
            RowCompletion("older", {"x": 5}),  # newer_write_version: a's row
            RowCompletion("done", {"x": 5}),  # already_terminal
        ],
    )
    event = await last(conn, b.run_id, "rows_completed")
    assert event.data["committed"] == len(b_rows.committed) == 1
    assert event.data["stale"] == dict(Counter(row.reason.value for row in b_rows.stale))


async def test_nothing_written_appends_nothing(conn: Conn) -> None:
    a = await attempts.start(conn)
    first = await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=a.fence, rows=page("k1"), stable_intent=True
    )
    before = await kinds(conn, a.run_id)
    # A replayed page (already current), a completion with nothing left to write, a
    # completed step: none of them changes the run's rows or fails a step.
    await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=a.fence, rows=page("k1"), stable_intent=True
    )
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=a.fence,
        write_version=first.write_version,
        completions=[RowCompletion("nope", {})],
    )
    step = {"org": ORG, "play": PLAY, "scope": Scope.of_run(a.run_id), "fence": a.fence}
    await receipts.claim(conn, receipts.StepRef(**step, step_key="ok"), lease_s=LEASE_S, now=T0)
    await receipts.complete(
        conn, receipts.StepRef(**step, step_key="ok"), result={"paid": 1}, now=T0
    )
    assert await kinds(conn, a.run_id) == before
    # A stale attempt's writes are refused: no event either.
    live = await attempts.supersede(conn, a)
    after_rescue = await kinds(conn, a.run_id)
    with pytest.raises(SheetSuperseded):
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet="s",
            fence=a.fence,
            write_version=first.write_version,
            completions=[RowCompletion("k1", {})],
        )
    assert await kinds(conn, a.run_id) == after_rescue
    assert after_rescue[-2:] == ["lease_expired", "attempt_started"]
    assert live.fence.attempt == 2


# ---- the outbox ------------------------------------------------------------------------------


async def test_each_event_gets_a_delivery_per_enabled_sink_in_its_transaction(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    await ledger.add_sink(conn, "off", "http://127.0.0.1:9/off")
    await ledger.disable_sink(conn, "off")
    run_id = await attempts.admit(conn)
    note = await ledger.append(conn, run_id, "note", {})
    assert await outbox(conn, run_id) == [(1, "crm", "pending"), (note.seq, "crm", "pending")]
    # The progress sink is folded by the appending statement instead.
    seen = await ledger.progress(conn, run_id)
    assert seen is not None and (seen.state, seen.last_event_seq) == ("queued", note.seq)


async def test_a_sink_given_kinds_gets_deliveries_of_those_kinds_only(conn: Conn) -> None:
    """No outbox row for a kind the sink did not ask for: neither for a stored event nor
    for one a state row stands for (migration 0038)."""
    url = "http://127.0.0.1:9/hook"
    asked = await ledger.add_sink(conn, "done", url, ["run_succeeded", "app.note", "app.note"])
    assert asked.kinds == ["run_succeeded", "app.note"]
    await ledger.add_sink(conn, "all", url)
    a = await attempts.start(conn)
    note = await ledger.append(conn, a.run_id, "app.note", {})
    await ledger.append(conn, a.run_id, "app.other", {})
    status = await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.succeeded(a.run_id, a.fence.attempt, None)]
    )
    assert str(status[(a.run_id, a.fence.attempt)]) == "applied"
    rows = await outbox(conn, a.run_id)
    assert [seq for seq, sink, _ in rows if sink == "done"] == [note.seq, 5]
    assert [seq for seq, sink, _ in rows if sink == "all"] == [1, 2, 3, 4, 5]
    listed = {s.name: s.kinds for s in await ledger.list_sinks(conn)}
    assert listed["done"] == ["run_succeeded", "app.note"] and listed["all"] is None
    # Added again without kinds: every kind.
    assert (await ledger.add_sink(conn, "done", url)).kinds is None
    with pytest.raises(InvalidField, match="is not a lowercase name") as bad:
        await ledger.add_sink(conn, "odd", url, ["Run Succeeded"])
    assert bad.value.field == "--kind"


async def test_leases_and_marks_are_fenced_by_the_lease_owner(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    leased = await ledger.lease_deliveries(conn, "p1", 10, LEASE_S, now=T0)
    assert {(d.sink, d.event.kind, d.attempts) for d in leased} == {("crm", "run_created", 1)}
    crm = next(d for d in leased if d.sink == "crm")
    assert crm.idempotency_key == f"{run_id}:1"
    assert crm.body()["seq"] == 1 and crm.body()["run_id"] == str(run_id)
    # Leased: nobody else gets it, and nobody else may mark it.
    assert await ledger.lease_deliveries(conn, "p2", 10, LEASE_S, now=T0) == []
    assert await ledger.mark_delivered(conn, "p2", [crm.id], now=T0) == []
    assert not await ledger.mark_failed(conn, "p2", crm.id, "nope", T0)
    # p1's lease lapses: p2 takes it over (a second attempt), and p1's marks are refused.
    taken = await ledger.lease_deliveries(
        conn, "p2", 10, LEASE_S, now=T0 + timedelta(seconds=LEASE_S + 1)
    )
    assert sorted(d.id for d in taken) == sorted(d.id for d in leased)
    assert {d.attempts for d in taken} == {2}
    assert await ledger.mark_delivered(conn, "p1", [crm.id], now=T0) == []
    assert not await ledger.mark_failed(conn, "p1", crm.id, "late", T0)
    assert await ledger.mark_delivered(conn, "p2", [crm.id], now=T0) == [crm.id]
    assert await ledger.mark_delivered(conn, "p2", [crm.id], now=T0) == []  # once
    assert await outbox(conn, run_id) == [(1, "crm", "delivered")]


async def test_a_failed_delivery_waits_out_its_backoff(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    await attempts.admit(conn)
    now = T0
    waits = []
    for attempt in range(1, 5):
        [crm] = [
            d
            for d in await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=now)
            if d.sink == "crm"
        ]
        assert crm.attempts == attempt
        retry_at = crm.retry_at()
        assert await ledger.mark_failed(conn, "p", crm.id, f"HTTP 500 #{attempt}", retry_at)
        # Not due a moment before its retry time; due at it.
        early = await ledger.lease_deliveries(
            conn, "p", 10, LEASE_S, now=retry_at - timedelta(milliseconds=1)
        )
        assert all(d.sink != "crm" for d in early)
        waits.append((retry_at - now).total_seconds())
        now = retry_at
    for n, wait in enumerate(waits):
        assert 2**n * 0.9 <= wait <= 2**n * 1.1  # 1 s, 2 s, 4 s, 8 s, +-10% jitter
    [sink] = [s for s in await ledger.list_sinks(conn) if s.name == "crm"]
    assert (sink.pending, sink.failing, sink.last_error) == (1, 1, "HTTP 500 #4")
    # Never given up: a delivery failing for days waits the cap, +-10%, every time.
    for tries in (40, 5000):
        long_failing = dataclasses.replace(crm, attempts=tries)
        wait = (long_failing.retry_at() - long_failing.leased_at).total_seconds()
        assert ledger.DELIVERY_RETRY.cap_s * 0.9 <= wait <= ledger.DELIVERY_RETRY.cap_s * 1.1


async def test_a_disabled_sink_keeps_its_pending_deliveries_for_later(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    await ledger.disable_sink(conn, "crm")
    assert await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0) == []
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/new")  # enabled again
    [crm] = await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0)
    assert (crm.sink, crm.url, crm.event.run_id) == ("crm", "http://127.0.0.1:9/new", run_id)


async def test_delivered_rows_go_with_their_run(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    leased = await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0)
    assert await ledger.mark_delivered(conn, "p", [d.id for d in leased], now=T0)
    await runs.cancel(conn, run_id)  # terminal now; retention deletes it later
    report = await recovery.run_once(conn, now=T0 + timedelta(days=30))
    assert report.deleted_runs >= 1
    with pytest.raises(RunNotFound):
        await runs.get(conn, run_id)
    assert await outbox(conn, run_id) == []
    assert await ledger.progress(conn, run_id) is None


async def test_retention_takes_every_outbox_row_of_its_runs_and_no_other(conn: Conn) -> None:
    """The outbox rows of deleted runs go with them (wq_events_gone, migration 0027, and
    wq_runs_gone, migration 0038): pending and delivered ones, of every sink, also those of
    events a state row stands for, and none of a run that stays."""
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    gone = [await attempts.admit(conn) for _ in range(3)]
    kept = await attempts.admit(conn)
    for run_id in [*gone, kept]:
        await ledger.append(conn, run_id, "note", {})
    leased = await ledger.lease_deliveries(conn, "p", 2, LEASE_S, now=T0)
    assert await ledger.mark_delivered(conn, "p", [d.id for d in leased], now=T0)
    kept_rows = await outbox(conn, kept)
    for run_id in gone:
        await runs.cancel(conn, run_id)
    report = await recovery.run_once(conn, now=T0 + timedelta(days=30))
    assert report.deleted_runs == 3
    for run_id in gone:
        assert await outbox(conn, run_id) == []
    assert kept_rows and await outbox(conn, kept) == kept_rows
    cur = await conn.execute(
        "SELECT count(*) FROM wq_outbox o"
        " WHERE NOT EXISTS (SELECT 1 FROM wq_ledger e"
        "                    WHERE e.run_id = o.run_id AND e.seq = o.seq)"
        "    OR NOT EXISTS (SELECT 1 FROM wq_sinks s WHERE s.name = o.sink)"
    )
    assert await cur.fetchone() == (0,)


@pytest.mark.parametrize(
    ("statement", "verb"),
    [
        ("DELETE FROM wq_sinks WHERE name = %s", "deleted"),
        ("UPDATE wq_sinks SET name = 'renamed' WHERE name = %s", "renamed"),
    ],
)
async def test_a_sink_is_never_deleted_or_renamed(conn: Conn, statement: str, verb: str) -> None:
    """Every outbox row names an existing sink: a sink is disabled, never deleted or
    renamed, and the refusal (a RESTRICT key's SQLSTATE) changes nothing."""
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    before = await outbox(conn, run_id)
    for name in ("crm", "progress"):
        with pytest.raises(psycopg.errors.RestrictViolation) as refused:
            async with conn.transaction():
                await conn.execute(statement, (name,))  # type: ignore[arg-type]
        assert f"sink '{name}' is never {verb}" in str(refused.value)
        assert refused.value.diag.message_hint is not None
        assert "worker sinks disable" in refused.value.diag.message_hint
    assert {s.name for s in await ledger.list_sinks(conn)} == {"crm", "progress"}
    assert await outbox(conn, run_id) == before
    await conn.execute("UPDATE wq_sinks SET enabled = false WHERE name = 'crm'")  # allowed


# ---- the progress projection ---------------------------------------------------------------


async def test_the_projection_commits_with_the_events(
    conn: Conn,
) -> None:
    a = await attempts.start(conn)
    version = (
        await sheets.admit_page(
            conn,
            org=ORG,
            sheet="s",
            fence=a.fence,
            rows=page("k1", "k2", "k3"),
            stable_intent=True,
        )
    ).write_version
    for key in ("k1", "k2"):
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet="s",
            fence=a.fence,
            write_version=version,
            completions=[RowCompletion(key, {})],
        )
    await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.succeeded(a.run_id, a.fence.attempt, {})]
    )
    events = await runs.events(conn, a.run_id)
    assert [e.kind for e in events] == [
        "run_created",
        "attempt_started",
        "rows_admitted",
        "rows_completed",
        "rows_completed",
        "run_succeeded",
    ]
    # No projector ran: every statement folded its own events.
    seen = await ledger.progress(conn, a.run_id)
    assert seen is not None
    assert (seen.state, seen.attempt, seen.rows_admitted, seen.rows_done) == (
        "succeeded",
        1,
        3,
        2,
    )
    assert (seen.last_event_seq, seen.ledger_seq, seen.behind) == (6, 6, False)


async def test_admission_writes_no_projection_and_the_next_event_starts_it(conn: Conn) -> None:
    """run_created is not folded: a run without a progress row is queued with no rows. The
    row comes with the run's next event, and goes with it when that rolls back."""
    run_id = await attempts.admit(conn)
    assert await ledger.progress(conn, run_id) is None
    run = await runs.get(conn, run_id)
    assert await ledger.progress_counts(conn, run) == (0, 0)
    with pytest.raises(ZeroDivisionError):
        async with conn.transaction():  # a savepoint of the test's transaction
            await ledger.append(conn, run_id, "note", {})
            inside = await ledger.progress(conn, run_id)
            assert inside is not None
            # No state event folded: run_created's state, at its seq.
            assert (inside.state, inside.last_event_seq, inside.behind) == ("queued", 2, False)
            1 / 0  # noqa: B018
    assert await ledger.progress(conn, run_id) is None


async def test_observe_reads_the_projection_and_a_finished_run_its_own_counters(
    conn: Conn,
) -> None:
    a = await attempts.start(conn, inputs=page("k1", "k2", "k3", "k4"))
    await runs.announce(conn, [a.run_id])  # its worker's announcement folds the start
    version = (
        await sheets.admit_page(
            conn, org=ORG, sheet="s", fence=a.fence, rows=page("k1", "k2"), stable_intent=True
        )
    ).write_version
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=a.fence,
        write_version=version,
        completions=[RowCompletion("k1", {})],
    )
    run = await runs.get(conn, a.run_id)
    assert (run.rows_done, run.rows_total) == (1, 4)
    assert await ledger.progress_counts(conn, run) == (1, 4)  # the projection, exact
    # The API keeps the built-in sink enabled; the trigger checks it all the same: events
    # appended while it is disabled are not folded, and the projection falls behind.
    await conn.execute("UPDATE wq_sinks SET enabled = false WHERE name = 'progress'")
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=a.fence,
        write_version=version,
        completions=[RowCompletion("k2", {})],
    )
    assert await ledger.progress_counts(conn, await runs.get(conn, a.run_id)) == (1, 4)
    await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.succeeded(a.run_id, a.fence.attempt, {})]
    )
    behind = await ledger.progress(conn, a.run_id)
    assert behind is not None and behind.behind and behind.state == "running"
    # Finished with its last events not folded: the run's own final counters.
    assert await ledger.progress_counts(conn, await runs.get(conn, a.run_id)) == (2, 4)
    # A run admitted while it is disabled has no projection at all, and no outbox row.
    other = await attempts.admit(conn)
    assert await ledger.progress(conn, other) is None
    assert await outbox(conn, other) == []
    fresh = await runs.get(conn, other)
    assert await ledger.progress_counts(conn, fresh) == (fresh.rows_done, fresh.rows_total)


async def test_migration_0030_folds_the_progress_deliveries_left_pending(conn: Conn) -> None:
    """A database upgraded with progress-sink rows still pending (the projector's backlog
    before 0030): the migration folds them and marks them delivered, and leaves the other
    sinks' rows alone."""
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    a = await attempts.start(conn)
    # What a database before 0030 held: its events stored (no state row stands for them),
    # a pending progress row per event named by its id, no projection.
    await conn.execute(
        "UPDATE wq_runs SET created_lane = NULL, ledger_seq = NULL WHERE id = %s", (a.run_id,)
    )
    await conn.execute("UPDATE wq_attempts SET start_seq = NULL WHERE run_id = %s", (a.run_id,))
    await conn.execute("DELETE FROM wq_outbox WHERE run_id = %s", (a.run_id,))
    await conn.execute(
        "INSERT INTO wq_events (run_id, attempt, kind, data)"
        " VALUES (%(r)s, NULL, 'run_created', '{}'), (%(r)s, 1, 'attempt_started', '{}')",
        {"r": a.run_id},
    )
    await conn.execute(
        "UPDATE wq_outbox o SET run_id = NULL, seq = NULL FROM wq_events e"
        " WHERE e.id = o.event_id AND e.run_id = %s",
        (a.run_id,),
    )
    await conn.execute("DELETE FROM wq_progress WHERE run_id = %s", (a.run_id,))
    await conn.execute(
        "INSERT INTO wq_outbox (event_id, sink)"
        " SELECT id, 'progress' FROM wq_events WHERE run_id = %s",
        (a.run_id,),
    )
    [migration] = [m for m in migrations.code_migrations() if m.number == 30]
    head, tail = migration.sql.split("\nSELECT wq_progress_fold", 1)
    assert "CREATE OR REPLACE FUNCTION wq_events_outbox" in head
    # The fold as 0030 made it (0031 folds in the trigger and drops the function): made in
    # this rolled-back transaction, then 0030's backlog step.
    start = head.index("CREATE FUNCTION wq_progress_fold")
    await conn.execute(head[start : head.index("\n$$;", start) + 4].encode())
    await conn.execute(("SELECT wq_progress_fold" + tail).encode())
    seen = await ledger.progress(conn, a.run_id)
    assert seen is not None
    assert (seen.state, seen.attempt, seen.last_event_seq, seen.behind) == ("running", 1, 2, False)
    assert await outbox(conn, a.run_id) == [
        (1, "crm", "pending"),
        (1, "progress", "delivered"),
        (2, "crm", "pending"),
        (2, "progress", "delivered"),
    ]


async def test_concurrent_appends_to_one_run_leave_an_exact_projection(db_url: str) -> None:
    """Real connections, committed rows: four connections append to one run at once; the
    projection ends at the ledger's last event, whatever order they committed in."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as setup:
        run_id = await attempts.admit(setup)

    async def appender(n: int) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            for i in range(25):
                await ledger.append(c, run_id, "note", {"n": n, "i": i})

    await asyncio.gather(*(appender(n) for n in range(4)))
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as check:
        seen = await ledger.progress(check, run_id)
    assert seen is not None
    assert (seen.last_event_seq, seen.ledger_seq, seen.behind) == (101, 101, False)


async def test_concurrent_announcements_fold_their_runs_without_waiting_on_each_other(
    db_url: str,
) -> None:
    """Real connections, committed rows: four workers claim one lane's 40 runs in batches
    of 7 at once, each announcing its batch as it goes (the folds, in run id order, while
    the others claim); every run is claimed once and its projection says running, at its
    attempt_started event."""
    release = f"progress-race-{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as setup:
        admitted = {await attempts.admit(setup, release=release) for _ in range(40)}

    async def worker(n: int) -> list[uuid.UUID]:
        got: list[uuid.UUID] = []
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            while claimed := await runs.claim(
                c,
                lanes=[lanes.lane_name(release)],
                worker_id=f"w{n}",
                limit=7,
                plays=[PLAY],
            ):
                mine = [r.run_id for r in claimed if r.claimed]
                await runs.announce(c, mine)
                got += mine
        return got

    taken = [
        run_id for got in await asyncio.gather(*(worker(n) for n in range(4))) for run_id in got
    ]
    assert sorted(taken) == sorted(admitted)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as check:
        for run_id in admitted:
            seen = await ledger.progress(check, run_id)
            assert seen is not None
            assert (seen.state, seen.attempt, seen.last_event_seq) == ("running", 1, 2)


# ---- sinks ---------------------------------------------------------------------------------


async def test_sinks_are_added_updated_listed_and_disabled(conn: Conn) -> None:
    added = await ledger.add_sink(conn, "crm-hook", "https://user:secret@example.com/h")
    assert (added.created, added.kind, added.enabled) == (True, "http", True)
    moved = await ledger.add_sink(conn, "crm-hook", "https://example.com/v2")
    assert (moved.created, moved.url) == (False, "https://example.com/v2")
    await ledger.disable_sink(conn, "crm-hook")
    listed = {s.name: s for s in await ledger.list_sinks(conn)}
    assert listed["progress"].kind == "progress" and listed["progress"].enabled
    assert not listed["crm-hook"].enabled
    assert (
        ledger.redact_url("https://user:secret@example.com/h") == "https://user:***@example.com/h"
    )
    with pytest.raises(InvalidField) as unknown:
        await ledger.disable_sink(conn, "crm-hoook")
    assert unknown.value.fix is not None and "crm-hook" in unknown.value.fix
    for builtin in (
        ledger.add_sink(conn, "progress", "https://example.com"),
        ledger.disable_sink(conn, "progress"),
    ):
        with pytest.raises(InvalidField, match="built-in"):
            await builtin
    for name, url in (("Bad Name", "https://example.com"), ("ok", "ftp://example.com")):
        with pytest.raises(InvalidField):
            await ledger.add_sink(conn, name, url)


async def test_sinks_take_turns(conn: Conn) -> None:
    """A sink with a backlog of older deliveries does not crowd out another sink."""
    await ledger.add_sink(conn, "backlog", "http://127.0.0.1:9/a")
    run_id = await attempts.admit(conn)
    for i in range(5):
        await ledger.append(conn, run_id, "note", {"i": i})
    await ledger.add_sink(conn, "fresh", "http://127.0.0.1:9/b")  # gets only the next event
    await ledger.append(conn, run_id, "note", {"i": 5})
    turns = await ledger.lease_deliveries(conn, "p", 2, LEASE_S, now=T0)
    assert sorted(d.sink for d in turns) == ["backlog", "fresh"]
    rest = await ledger.lease_deliveries(conn, "p", 100, LEASE_S, now=T0)
    assert [d.event.seq for d in rest] == list(range(2, 8))
    assert {d.sink for d in rest} == {"backlog"}
