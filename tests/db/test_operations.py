"""The runtime operation contract through its one dispatch (the in-process path), on a real
Postgres; the same dispatch behind HTTP is tested in tests/integration/test_gateway.py."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from queues import authority, calls, errors, operations, runs, sheets
from queues.authority import LEDGER_PROJECT
from queues.errors import (
    CapabilityScope,
    DeliveryLeaseMismatch,
    InvalidField,
    LifecycleReserved,
    OperationRefused,
    RunScope,
    SheetSuperseded,
)
from queues.sheets import CompletionResult, StaleReason
from tests import attempts
from worker.contract import ConnectionTransport, in_process_claims

Conn = psycopg.AsyncConnection[Any]


async def claims_of(conn: Conn, **kw: Any) -> authority.Claims:
    a = await attempts.start(conn, **kw)
    return authority.claims_of_attempt(
        a.claimed.descriptor, attempt=a.fence.attempt, owner=a.fence.owner
    )


def start(rows: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "action": "runtime_sheet_start_with_intent",
        "input": {"tableNamespace": "s", "rows": [{"key": k, "input": {"k": k}} for k in rows]}
        | extra,
    }


def test_every_action_maps_to_one_capability() -> None:
    expected = {
        "runtime_sheet_start": "sheet.write",
        "runtime_sheet_start_with_intent": "sheet.write",
        "runtime_sheet_complete_map_rows": "sheet.write",
        "runtime_receipt_claim": "receipt.write",
        "runtime_event_emit": "event.emit",
        "runtime_input_page": "run.read",
        "project_run_events": "run.ledger.project",
        "project_run_created": "run.ledger.project",
        "append_run_events": "run.ledger.project",
        "start_run": "run.ledger.project",
    }
    for action, capability in expected.items():
        assert operations.capability_for(action) == capability
    assert operations.capability_for("sheet.delete") is None
    assert {a for a, c in expected.items() if c == LEDGER_PROJECT} == operations.LEDGER_ACTIONS


@pytest.mark.parametrize(
    ("body", "capabilities", "expected"),
    [
        ({"action": "runtime_sheet_start"}, {"sheet.write"}, "sheet.write"),
        ({"action": "runtime_sheet_start"}, {"run.read"}, "sheet.write"),  # held or not: later
        ({"action": "nothing_known"}, {"sheet.write"}, None),
        ({"action": 7}, {"sheet.write"}, None),
        ([], {"sheet.write"}, None),
        (
            {"action": "append_run_events", "idempotencyKey": "k", "deliveryLeaseOwner": "w"},
            {LEDGER_PROJECT},
            LEDGER_PROJECT,
        ),
        ({"action": "append_run_events", "deliveryLeaseOwner": "w"}, {LEDGER_PROJECT}, None),
        ({"action": "append_run_events", "idempotencyKey": "k"}, {LEDGER_PROJECT}, None),
        (
            {"action": "append_run_events", "idempotencyKey": " ", "deliveryLeaseOwner": "w"},
            {LEDGER_PROJECT},
            None,
        ),
        (
            {"action": "runtime_sheet_start", "idempotencyKey": "k", "deliveryLeaseOwner": "w"},
            {LEDGER_PROJECT},
            None,
        ),
        (
            {"action": "start_run", "idempotencyKey": "k", "deliveryLeaseOwner": "w"},
            {LEDGER_PROJECT, "sheet.write"},
            None,
        ),
    ],
)
def test_the_policy(body: object, capabilities: set[str], expected: str | None) -> None:
    assert operations.capability_for_request(body, capabilities) == expected


async def test_dispatch_admits_and_completes_through_named_actions(conn: Conn) -> None:
    claims = await claims_of(conn)
    started = await operations.dispatch(conn, start(["a", "b"]), claims)
    assert isinstance(started, dict)
    assert [r["disposition"] for r in started["rows"]] == ["admitted", "admitted"]
    completed = await operations.dispatch(
        conn,
        {
            "action": "runtime_sheet_complete_map_rows",
            "input": {
                "tableNamespace": "s",
                "writeVersion": started["writeVersion"],
                "rows": [{"key": "a", "output": {"ok": True}}, {"key": "zzz"}],
            },
        },
        claims,
    )
    assert isinstance(completed, dict)
    parsed = CompletionResult.from_wire(completed)
    assert parsed.committed == ("a",)
    assert [(s.key, s.reason) for s in parsed.stale] == [("zzz", StaleReason.OLDER_WRITE_VERSION)]
    assert await sheets.progress(conn, claims.run_id) == (2, 1)


async def test_refusals_in_order_and_nothing_written(conn: Conn) -> None:
    claims = await claims_of(conn)
    with pytest.raises(OperationRefused, match="Unsupported action: runtime_sheet_strat"):
        await operations.dispatch(conn, {"action": "runtime_sheet_strat", "input": {}}, claims)
    receipts_only = authority.Claims(
        **{f: getattr(claims, f) for f in claims.__slots__ if f != "capabilities"},
        capabilities=frozenset({"receipt.write"}),
    )
    with pytest.raises(CapabilityScope):
        await operations.dispatch(conn, start(["a"]), receipts_only)
    older = operations.SERVED_ACTIONS - {"runtime_sheet_start_with_intent"}
    with pytest.raises(OperationRefused, match="Unsupported action: runtime_sheet_start_with"):
        await operations.dispatch(conn, start(["a"]), claims, served=older)
    with pytest.raises(InvalidField, match="did you mean 'stableWriteIntent'") as unknown:
        await operations.dispatch(conn, start(["a"], stableWriteIntnet=True), claims)
    assert unknown.value.field == "runtime_sheet_start_with_intent.input.stableWriteIntnet"
    # The reference's admission options are defined, typed, and agree with the action.
    for bad in ({"stableWriteIntent": "yes"}, {"pendingRerunAdmission": 1}):
        with pytest.raises(InvalidField, match="true or false"):
            await operations.dispatch(conn, start(["a"], **bad), claims)
    with pytest.raises(InvalidField, match="send the page as runtime_sheet_start,") as disagree:
        await operations.dispatch(conn, start(["a"], stableWriteIntent=False), claims)
    assert disagree.value.field == "input.stableWriteIntent"
    legacy = start(["a"], stableWriteIntent=True) | {"action": "runtime_sheet_start"}
    with pytest.raises(InvalidField, match="as runtime_sheet_start_with_intent"):
        await operations.dispatch(conn, legacy, claims)
    nested = start(["a"])
    nested["input"]["rows"][0]["priority"] = 1
    with pytest.raises(InvalidField, match="'priority'"):
        await operations.dispatch(conn, nested, claims)
    with pytest.raises(RunScope):
        await operations.dispatch(
            conn, start(["a"], runId="00000000-0000-0000-0000-000000000000"), claims
        )
    cur = await conn.execute(
        "SELECT count(*) FROM wq_sheet_rows WHERE run_id = %s", (claims.run_id,)
    )
    assert await cur.fetchone() == (0,)


async def test_a_stale_attempts_completion_answers_the_stop_signal_through_dispatch(
    conn: Conn,
) -> None:
    a = await attempts.start(conn)
    claims = authority.claims_of_attempt(a.claimed.descriptor, attempt=1, owner="w1")
    started = await operations.dispatch(conn, start(["a", "b"]), claims)
    assert isinstance(started, dict)
    await attempts.supersede(conn, a)
    answer = await operations.dispatch(
        conn,
        {
            "action": "runtime_sheet_complete_map_rows",
            "input": {
                "tableNamespace": "s",
                "writeVersion": started["writeVersion"],
                "rows": [{"key": "a", "output": 1}, {"key": "b", "output": 2}],
            },
        },
        claims,
    )
    # The reference's fields: a newer owner has the rows, and supersededKeys says stop;
    # the fence's own reason is a field of its own.
    assert answer == {
        "writeVersion": started["writeVersion"],
        "committedKeys": [],
        "replayedKeys": [],
        "staleRows": [
            {"key": "a", "reason": "newer_write_version", "rowVersionStamp": None},
            {"key": "b", "reason": "newer_write_version", "rowVersionStamp": None},
        ],
        "supersededKeys": ["a", "b"],
        "fenceReason": "stale_attempt",
    }
    result = CompletionResult.from_wire(answer)
    assert result.attempt_stale
    with pytest.raises(SheetSuperseded) as raised:
        result.raise_if_stopped(sheet="s", run_id=claims.run_id)
    assert raised.value.counts == {"newer_write_version": 2}
    assert raised.value.fence_reason == "stale_attempt"
    assert await attempts.refusals(conn, a.run_id) == [(1, "rows", 2)]


def test_a_receivers_explicit_superseded_keys_stop_the_writer() -> None:
    """A reference receiver's stop signal, without this project's fenceReason."""
    result = CompletionResult.from_wire(
        {
            "committedKeys": ["a"],
            "staleRows": [{"key": "b", "reason": "newer_write_version", "rowVersionStamp": 8}],
            "supersededKeys": ["b", "c"],
        }
    )
    assert result.superseded_keys == ("b", "c") and not result.attempt_stale
    with pytest.raises(SheetSuperseded) as raised:
        result.raise_if_stopped(sheet="s", run_id="r")
    assert raised.value.superseded_rows == (
        ("b", "newer_write_version", 8),
        ("c", "unreported", None),
    )
    assert raised.value.fence_reason is None and "fenceReason" not in raised.value.as_dict()
    # Without the signal a completion reports its stale rows and stops nothing.
    CompletionResult.from_wire({"committedKeys": ["a"]}).raise_if_stopped(sheet="s", run_id="r")


def test_an_older_receivers_code_is_read_as_the_superseded_error() -> None:
    error = errors.from_wire(
        {
            "code": "SHEET_SUPERSEDED",
            "message": "sheet 's' refused 1 of 1 row completion(s)",
            "sheet": "s",
            "run_id": "r",
            "write_version": 4,
            "submitted": 1,
            "counts": {"stale_attempt": 1},
            "samples": [["a", "stale_attempt", None]],
        }
    )
    assert isinstance(error, SheetSuperseded)
    assert error.code == "RUNTIME_SHEET_ATTEMPT_SUPERSEDED"
    assert (error.sheet, error.run_id, error.write_version, error.submitted) == ("s", "r", 4, 1)
    assert error.superseded_rows == (("a", "stale_attempt", None),)
    wire = error.as_dict()
    again = errors.from_wire(wire)
    assert isinstance(again, SheetSuperseded) and again.as_dict() == wire


def test_an_older_receivers_reasonless_stale_rows_parse_as_unreported() -> None:
    result = CompletionResult.from_wire(
        {
            "committedKeys": ["a"],
            "staleRows": [{"key": "b"}, "c", {"key": "d", "reason": "brand_new"}],
        }
    )
    assert [(s.key, s.reason) for s in result.stale] == [
        ("b", StaleReason.UNREPORTED),
        ("c", StaleReason.UNREPORTED),
        ("d", StaleReason.UNREPORTED),
    ]
    with pytest.raises(SheetSuperseded, match="unreported=3"):
        sheets.raise_if_superseded(result, sheet="s", run_id="r", submitted=4)


def test_the_wire_form_round_trips() -> None:
    result = CompletionResult(
        write_version=5,
        committed=("a",),
        replayed=(),
        stale=(sheets.StaleRow("b", StaleReason.NEWER_WRITE_VERSION, 9),),
    )
    wire = result.to_wire()
    assert wire["staleRows"] == [
        {"key": "b", "reason": "newer_write_version", "rowVersionStamp": 9}
    ]
    assert "supersededKeys" not in wire and "fenceReason" not in wire
    assert CompletionResult.from_wire(wire) == result
    fenced = CompletionResult(
        write_version=5,
        committed=(),
        replayed=(),
        stale=(sheets.StaleRow("b", StaleReason.NEWER_WRITE_VERSION, None),),
        superseded_keys=("b",),
        fence=sheets.FenceReason.STALE_ATTEMPT,
    )
    assert CompletionResult.from_wire(fenced.to_wire()) == fenced


# ---- the run-ledger credential's checks, in process -------------------------------------------


async def play_events(conn: Conn, run_id: Any) -> list[str]:
    return [e.kind for e in await runs.events(conn, run_id) if e.kind.startswith("play.")]


async def test_a_delivery_naming_another_lease_owner_is_refused_in_process(conn: Conn) -> None:
    a = await attempts.start(conn, worker="w1")
    ledger = in_process_claims(a.claimed, a.fence.owner, ledger=True)
    other = calls.AppendRunEvents(key="d-1", owner="projector-9", kinds_data=[("play.x", {})])
    # The receiver's check (the same for the gateway's dispatch) refuses it before any SQL.
    with pytest.raises(DeliveryLeaseMismatch) as refused:
        await operations.perform(conn, other, ledger)
    assert (refused.value.http_status, refused.value.field) == (403, "deliveryLeaseOwner")
    assert refused.value.code == "RUNTIME_DELIVERY_LEASE_MISMATCH"
    # The statement itself, reached without that check, compares the owner with the run's
    # live lease owner again: the database is the last line.
    with pytest.raises(DeliveryLeaseMismatch, match="'projector-9' is not the worker holding"):
        await other.run(conn, ledger)
    assert await play_events(conn, a.run_id) == []
    assert await attempts.refusals(conn, a.run_id) == []  # not a stale attempt's write
    # The live lease's owner delivers.
    done = await operations.perform(conn, replace(other, owner="w1"), ledger)
    assert (done.appended, done.existing) == (1, 0)
    assert await play_events(conn, a.run_id) == ["play.x"]


async def test_a_runs_lifecycle_actions_are_refused_to_an_in_process_play(conn: Conn) -> None:
    a = await attempts.start(conn)
    before = await runs.events(conn, a.run_id)
    transport = ConnectionTransport(conn, functools.partial(in_process_claims, a.claimed, "w1"))
    executor = in_process_claims(a.claimed, "w1", ledger=False)
    for action in sorted(operations.LIFECYCLE_ACTIONS):
        # As a play's context sends it (the ledger's claims, a key and the lease owner) ...
        with pytest.raises(LifecycleReserved) as refused:
            await transport.call(action, {}, idempotency_key=f"{action}-1")
        assert refused.value.http_status == 403
        assert refused.value.message == operations.SCOPE_MESSAGE
        assert action in str(refused.value.rule)
        # ... with the executor's claims, and as a typed call would need its codec.
        with pytest.raises(LifecycleReserved):
            await operations.dispatch(conn, {"action": action, "input": {}}, executor)
        with pytest.raises(LifecycleReserved):
            operations.codec(action)
        # Known, not unserved: an older receiver's subset gives the same answer.
        with pytest.raises(LifecycleReserved):
            await operations.dispatch(
                conn, {"action": action, "input": {}}, executor, served=frozenset()
            )
    assert await runs.events(conn, a.run_id) == before
