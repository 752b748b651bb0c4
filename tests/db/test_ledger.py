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

from queues import ledger, outcomes, receipts, recovery, runs, sheets
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
    """(seq, sink, status) of every outbox row of a run."""
    cur = await conn.execute(
        "SELECT e.seq, o.sink, o.status::text FROM wq_outbox o"
        " JOIN wq_events e ON e.id = o.event_id WHERE e.run_id = %s ORDER BY e.seq, o.sink",
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
    numbered 1, 2, 3, ... in order, and the outbox one delivery per event."""
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
    await receipts.claim(conn, **step, step_key="pay", lease_s=LEASE_S, now=T0)
    await receipts.fail(conn, **step, step_key="pay", error={"type": "Boom"}, now=T0)
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
    # One progress delivery per event, written with it.
    assert await outbox(conn, run_id) == [(e.seq, "progress", "pending") for e in events]


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
    await receipts.claim(conn, **step, step_key="ok", lease_s=LEASE_S, now=T0)
    await receipts.complete(conn, **step, step_key="ok", result={"paid": 1}, now=T0)
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
    assert await outbox(conn, run_id) == [
        (1, "crm", "pending"),
        (1, "progress", "pending"),
        (note.seq, "crm", "pending"),
        (note.seq, "progress", "pending"),
    ]


async def test_leases_and_marks_are_fenced_by_the_lease_owner(conn: Conn) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    leased = await ledger.lease_deliveries(conn, "p1", 10, LEASE_S, now=T0)
    assert {(d.sink, d.event.kind, d.attempts) for d in leased} == {
        ("crm", "run_created", 1),
        ("progress", "run_created", 1),
    }
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
    statuses = dict((sink, status) for _, sink, status in await outbox(conn, run_id))
    assert statuses == {"crm": "delivered", "progress": "pending"}


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
    assert {d.sink for d in await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0)} == {
        "progress"
    }
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/new")  # enabled again
    [crm] = await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0)
    assert (crm.sink, crm.url, crm.event.run_id) == ("crm", "http://127.0.0.1:9/new", run_id)


async def test_delivered_rows_go_with_their_run(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    leased = await ledger.lease_deliveries(conn, "p", 10, LEASE_S, now=T0)
    assert await ledger.deliver_progress(conn, "p", [d.id for d in leased], now=T0)
    await runs.cancel(conn, run_id)  # terminal now; retention deletes it later
    report = await recovery.run_once(conn, now=T0 + timedelta(days=30))
    assert report.deleted_runs >= 1
    with pytest.raises(RunNotFound):
        await runs.get(conn, run_id)
    assert await outbox(conn, run_id) == []
    assert await ledger.progress(conn, run_id) is None


async def test_retention_takes_every_outbox_row_of_its_runs_and_no_other(conn: Conn) -> None:
    """The outbox rows of deleted events go with them (wq_events_gone, migration 0027):
    pending and delivered ones, of every sink, and none of a run that stays."""
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    gone = [await attempts.admit(conn) for _ in range(3)]
    kept = await attempts.admit(conn)
    for run_id in [*gone, kept]:
        await ledger.append(conn, run_id, "note", {})
    leased = await ledger.lease_deliveries(conn, "p", 2, LEASE_S, now=T0)
    assert await ledger.deliver_progress(conn, "p", [d.id for d in leased], now=T0)
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
        " WHERE NOT EXISTS (SELECT 1 FROM wq_events e WHERE e.id = o.event_id)"
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


async def test_progress_converges_in_any_delivery_order_and_on_replay(conn: Conn) -> None:
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
    leased = await ledger.lease_deliveries(conn, "p", 100, LEASE_S, now=T0)
    assert [d.event.kind for d in leased] == [
        "run_created",
        "attempt_started",
        "rows_admitted",
        "rows_completed",
        "rows_completed",
        "run_succeeded",
    ]
    # Newest first, one at a time: earlier events never move the projection back.
    for delivery in reversed(leased):
        assert await ledger.deliver_progress(conn, "p", [delivery.id], now=T0) == [delivery.id]
    seen = await ledger.progress(conn, a.run_id)
    assert seen is not None
    assert (seen.state, seen.attempt, seen.rows_admitted, seen.rows_done) == (
        "succeeded",
        1,
        3,
        2,
    )
    assert (seen.last_event_seq, seen.ledger_seq, seen.behind) == (6, 6, False)
    # A replay (the rows delivered again under a new lease) changes nothing.
    await conn.execute("UPDATE wq_outbox SET status = 'pending', lease_owner = 'q'")
    assert len(await ledger.deliver_progress(conn, "q", [d.id for d in leased], now=T0)) == 6
    replayed = await ledger.progress(conn, a.run_id)
    assert replayed == dataclasses.replace(seen, updated_at=replayed.updated_at if replayed else 0)


async def test_observe_reads_the_projection_and_a_finished_run_its_own_counters(
    conn: Conn,
) -> None:
    a = await attempts.start(conn, inputs=page("k1", "k2", "k3", "k4"))
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
    # No projection at all (no projector ever ran): the run's own counters.
    assert await ledger.progress_counts(conn, run) == (1, 4)
    leased = await ledger.lease_deliveries(conn, "p", 100, LEASE_S, now=T0)
    early = [d.id for d in leased if d.event.kind != "rows_completed"]
    await ledger.deliver_progress(conn, "p", early, now=T0)
    assert await ledger.progress_counts(conn, run) == (0, 4)  # the projection, behind
    await ledger.deliver_progress(conn, "p", [d.id for d in leased], now=T0)
    assert await ledger.progress_counts(conn, run) == (1, 4)
    # Finished with its last events not projected yet: the run's own final counters.
    await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=a.fence,
        write_version=version,
        completions=[RowCompletion("k2", {})],
    )
    await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.succeeded(a.run_id, a.fence.attempt, {})]
    )
    done = await runs.get(conn, a.run_id)
    assert await ledger.progress_counts(conn, done) == (2, 4)


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


async def test_sinks_take_turns_and_a_lease_can_take_one_kind(conn: Conn) -> None:
    """A sink with a backlog of older deliveries does not crowd out another sink."""
    await ledger.add_sink(conn, "backlog", "http://127.0.0.1:9/a")
    run_id = await attempts.admit(conn)
    for i in range(5):
        await ledger.append(conn, run_id, "note", {"i": i})
    await ledger.add_sink(conn, "fresh", "http://127.0.0.1:9/b")  # gets only the next event
    await ledger.append(conn, run_id, "note", {"i": 5})
    http = await ledger.lease_deliveries(conn, "p", 2, LEASE_S, now=T0, kind=ledger.SinkKind.HTTP)
    assert sorted(d.sink for d in http) == ["backlog", "fresh"]
    assert {d.sink_kind for d in http} == {ledger.SinkKind.HTTP}
    progress = await ledger.lease_deliveries(
        conn, "p", 100, LEASE_S, now=T0, kind=ledger.SinkKind.PROGRESS
    )
    assert [d.event.seq for d in progress] == list(range(1, 8))
    assert {d.sink for d in progress} == {"progress"}


# ---- the progress loop: pick, fold and mark in one statement ------------------------------


async def progress_rows(conn: Conn, run_id: uuid.UUID) -> list[tuple[int, str, int]]:
    """(seq, status, attempts) of a run's progress-sink outbox rows."""
    cur = await conn.execute(
        "SELECT e.seq, o.status::text, o.attempts FROM wq_outbox o"
        " JOIN wq_events e ON e.id = o.event_id"
        " WHERE e.run_id = %s AND o.sink = 'progress' ORDER BY e.seq",
        (run_id,),
    )
    return [(int(seq), str(status), int(n)) for seq, status, n in await cur.fetchall()]


async def test_the_progress_loop_delivers_due_rows_in_one_statement_without_a_lease(
    conn: Conn,
) -> None:
    await ledger.add_sink(conn, "crm", "http://127.0.0.1:9/hook")
    run_id = await attempts.admit(conn)
    note = await ledger.append(conn, run_id, "note", {})
    done = await ledger.project_progress(conn, 10, now=T0)
    assert len(done) == 2
    assert await progress_rows(conn, run_id) == [(1, "delivered", 1), (note.seq, "delivered", 1)]
    statuses = {(seq, sink): status for seq, sink, status in await outbox(conn, run_id)}
    assert statuses[(1, "crm")] == "pending"  # an HTTP sink's rows wait for their loop
    progress = await ledger.progress(conn, run_id)
    assert progress is not None
    assert (progress.state, progress.last_event_seq) == ("queued", note.seq)
    assert await ledger.project_progress(conn, 10, now=T0) == []  # once


async def test_the_progress_loop_leaves_leased_rows_until_their_lease_lapses(conn: Conn) -> None:
    run_id = await attempts.admit(conn)
    [leased] = await ledger.lease_deliveries(
        conn, "p1", 10, LEASE_S, now=T0, kind=ledger.SinkKind.PROGRESS
    )
    assert await ledger.project_progress(conn, 10, now=T0) == []
    later = T0 + timedelta(seconds=LEASE_S + 1)
    assert await ledger.project_progress(conn, 10, now=later) == [leased.id]
    assert await ledger.deliver_progress(conn, "p1", [leased.id], now=later) == []  # lapsed
    assert await progress_rows(conn, run_id) == [(1, "delivered", 2)]


async def test_the_progress_loop_skips_a_disabled_sink_and_bounds_its_batch(conn: Conn) -> None:
    for _ in range(3):
        await attempts.admit(conn)
    assert len(await ledger.project_progress(conn, 2, now=T0)) == 2
    # The API keeps the built-in sink enabled; the statement checks it all the same.
    await conn.execute("UPDATE wq_sinks SET enabled = false WHERE name = 'progress'")
    assert await ledger.project_progress(conn, 10, now=T0) == []
    with pytest.raises(InvalidField, match="limit"):
        await ledger.project_progress(conn, 0)


async def test_two_progress_loops_deliver_each_row_once(db_url: str) -> None:
    """Real connections, committed rows: two loops racing over one backlog split it."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as setup:
        for _ in range(40):
            await attempts.admit(setup)
        cur = await setup.execute("SELECT count(*) FROM wq_outbox WHERE sink = 'progress'")
        row = await cur.fetchone()
        assert row is not None
        backlog = int(row[0])

    async def loop() -> list[int]:
        got: list[int] = []
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            while batch := await ledger.project_progress(c, 3):
                got += batch
                await asyncio.sleep(0)
        return got

    first, second = await asyncio.gather(loop(), loop())
    assert first and second  # both took part
    assert not set(first) & set(second)
    assert len(first) + len(second) == backlog
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as check:
        cur = await check.execute(
            "SELECT count(*) FILTER (WHERE status = 'delivered' AND attempts = 1), count(*)"
            " FROM wq_outbox WHERE sink = 'progress'"
        )
        assert await cur.fetchone() == (backlog, backlog)
