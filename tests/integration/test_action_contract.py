"""Every runtime action means the same on both paths to it: the in-process typed call
(:func:`queues.operations.perform`) and the gateway's wire dict decoded by the action's
codec (:func:`queues.operations.dispatch`). One script calls every action a play may make
(:data:`queues.operations.SERVED_ACTIONS`) on one claimed attempt, once per path, each time in a
savepoint of the same transaction that is rolled back after it (so both see the same
database, the same ``now()`` and the same attempt); the answers, as the wire carries them,
and the rows each run wrote must be equal. Each wire answer also decodes back into the
typed answer the client gets, and encodes to the same wire again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from queues import authority, calls, costs, limits, operations, receipts, sheets
from queues.authority import LEDGER_PROJECT, Claims
from queues.errors import RunScope
from queues.options import RunOptions
from tests import attempts

Conn = psycopg.AsyncConnection[Any]
Run = Callable[[calls.Call[Any]], Awaitable[Any]]
LIMIT = "contract-limit"


async def script(run: Run, claims: Claims) -> None:
    """Every action at least once, in an order that gives each something to do."""

    def ref(key: str, scope: str | None = None) -> receipts.StepRef:
        where = (
            receipts.Scope.of_run(claims.run_id) if scope is None else receipts.Scope.named(scope)
        )
        return receipts.StepRef(claims.org, claims.play, where, key, claims.fence)

    own = receipts.Scope.of_run(claims.run_id)
    paid = (costs.Charge.checked(1, provider="clearbit"), costs.Charge.checked("0.25", "usd"))
    await run(calls.Now())
    await run(calls.InputPage(0))
    await run(calls.ReceiptsSettled(own))
    await run(calls.BudgetReserve(own, ["a", "b", "c", "row:1", "row:2"], costs.estimate_of(3)))
    await run(calls.BudgetReserve(own, ["y"], costs.estimate_of({"usd": 1})))  # stays held
    await run(calls.ReceiptClaim(ref("a")))
    await run(calls.ReceiptComplete(ref("a"), {"x": [1, 2]}, paid))
    await run(calls.ReceiptRecord(ref("b"), 2, paid[:1]))
    await run(calls.ReceiptClaim(ref("c"), lease_s=45.0))
    await run(calls.ReceiptFail(ref("c"), {"type": "X", "message": "m"}, paid[1:]))
    await run(calls.ReceiptClaim(ref("d", "shared")))
    await run(calls.ReceiptSkip(ref("d", "shared")))
    await run(calls.BudgetReserve(own, ["row:1", "row:2"], costs.estimate_of({"credits": 2})))
    rows_paid = {"row:1": list(paid), "row:2": [costs.Charge.checked(7)]}
    await run(calls.ReceiptsComplete(own, [("row:1", 1), ("row:2", {"two": 2})], rows_paid))
    await run(calls.BudgetReserve(own, ["e"], costs.estimate_of(1)))  # spent: refused
    await run(calls.ReceiptsLookup(own, ["row:1", "row:2", "row:3"]))
    await run(calls.ReceiptsSettled(receipts.Scope.named("shared")))
    page = [("k1", {"v": 1}), ("k2", {"v": 2})]
    legacy: sheets.AdmitResult = await run(calls.SheetStart("legacy", page))
    await run(calls.SheetStart("legacy", [("k3", None)], legacy.write_version, False))
    stable: sheets.AdmitResult = await run(calls.SheetStartWithIntent("stable", page))
    done = [
        sheets.RowCompletion("k1", {"out": 1}),
        sheets.RowCompletion("k2", {"why": "x"}, sheets.RowStatus.FAILED),
    ]
    await run(calls.SheetComplete("stable", done, stable.write_version))
    await run(calls.SheetComplete("stable", done[:1], stable.write_version))  # a replay
    await run(calls.EventEmit("paid", {"amount": 3}))
    await run(calls.EventGet("paid"))
    await run(calls.EventGet("never"))
    await run(calls.LimitAcquire(LIMIT, "h1"))
    await run(calls.LimitAcquire(LIMIT, "h2"))  # at its cap: busy
    await run(calls.LimitRelease("h1"))
    options = RunOptions.checked(
        max_attempts=2,
        retry="fixed:1s",
        timeout=30,
        meta={"m": 1},
        budget={"limit": 5, "unit": "usd"},
    )
    spawned = await run(calls.RunSpawn("$spawn:child", "child", {"p": 1}, options, 3))
    await run(calls.RunSpawn("$spawn:child", "child", {"p": 1}, options, 3))  # a replay
    await run(calls.RunGet(spawned.run_id))


async def ledger_script(run: Run, claims: Claims) -> None:
    owner = claims.owner
    events = [("play.one", {"a": 1}), ("play.two", None)]
    await run(calls.AppendRunEvents(key=f"{claims.run_id}:k1", owner=owner, kinds_data=events))
    await run(calls.AppendRunEvents(key=f"{claims.run_id}:k1", owner=owner, kinds_data=events))
    await run(calls.ProjectRunEvents(key="p1", owner=owner, kinds_data=[("play.three", {})]))


class Path:
    """One way to the actions; records every call and its answer as the wire carries it."""

    def __init__(self, conn: Conn, claims: Claims, wire: bool) -> None:
        self.conn, self.claims, self.wire = conn, claims, wire
        self.seen: list[tuple[str, Any]] = []

    async def run(self, call: calls.Call[Any]) -> Any:
        codec = operations.codec(call.action)
        if not self.wire:
            answer = await operations.perform(self.conn, call, self.claims)
            self.seen.append((call.action, codec.encode(answer)))
            return answer
        body: dict[str, Any] = {"action": call.action, "input": codec.wire(call)}
        if isinstance(call, calls.LedgerDelivery):
            body |= {"idempotencyKey": call.key, "deliveryLeaseOwner": call.owner}
        # What a client sends and gets: JSON on the way there and back.
        answer = await operations.dispatch(self.conn, json.loads(json.dumps(body)), self.claims)
        assert isinstance(answer, dict)
        wire_answer = json.loads(json.dumps(answer))
        typed = codec.answer(wire_answer)
        assert codec.encode(typed) == wire_answer, call.action  # the client's decoding
        self.seen.append((call.action, wire_answer))
        return typed


async def rows(conn: Conn, run_id: uuid.UUID, org: str) -> dict[str, Any]:
    """What the run wrote, with the columns that differ by path only (a child's id) left out."""

    async def fetch(sql: str, *args: Any) -> list[tuple[Any, ...]]:
        cur = await conn.execute(sql, args)
        return [tuple(row) for row in await cur.fetchall()]

    scope = f"run:{run_id}"
    return {
        "receipts": await fetch(
            "SELECT scope, step_key, status::text, owner_run, owner_attempt, result, error, "
            "lease_expires_at, completed_at FROM wq_receipts "
            "WHERE org = %s AND scope IN (%s, 'shared') ORDER BY scope, step_key",
            org,
            scope,
        ),
        "sheet_rows": await fetch(
            "SELECT sheet, row_key, status::text, write_version, input, output, attempt "
            "FROM wq_sheet_rows WHERE run_id = %s ORDER BY sheet, row_key",
            run_id,
        ),
        "events": await fetch(
            "SELECT seq, kind, data - 'run_id' - 'child_id', idempotency_key FROM wq_events "
            "WHERE run_id = %s ORDER BY seq",
            run_id,
        ),
        "emitted": await fetch(
            "SELECT name, payload FROM wq_emitted_events WHERE org = %s ORDER BY name", org
        ),
        "holds": await fetch(
            "SELECT hold, key, org, attempt, owner FROM wq_limit_holds "
            "WHERE run_id = %s ORDER BY hold",
            run_id,
        ),
        "children": await fetch(
            "SELECT play, state::text, params, meta FROM wq_runs "
            "WHERE parent_id = %s ORDER BY play",
            run_id,
        ),
        "charges": await fetch(
            "SELECT attempt, scope, step_key, outcome, unit, provider, amount, charged_at "
            "FROM wq_charges WHERE run_id = %s ORDER BY step_key, outcome, unit, provider",
            run_id,
        ),
        "reservations": await fetch(
            "SELECT scope, step_key, unit, attempt, amount FROM wq_reservations "
            "WHERE run_id = %s ORDER BY step_key, unit",
            run_id,
        ),
        "budgets": await fetch(
            "SELECT unit, limit_amount, spent, run_id IS NULL FROM wq_budgets WHERE org = %s "
            "ORDER BY unit",
            org,
        ),
    }


VERSIONED = ("writeVersion", "rowVersionStamp", "write_version")


def versions(seen: list[tuple[str, Any]]) -> dict[int, int]:
    """Each write version a path saw, by the order it first appeared in: versions come from
    a sequence, which a rolled-back savepoint does not give back, so the second path's are
    later numbers for the same admissions."""
    found: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in VERSIONED and isinstance(item, int):
                    found.setdefault(item, len(found))
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk([answer for _, answer in seen])
    return found


def normalized(seen: list[tuple[str, Any]], written: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The answers and rows with what differs by path only renamed: a child's id (a random
    UUID) and the write versions (:func:`versions`)."""
    order = versions(seen)

    def rename(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: order.get(v, v) if k in VERSIONED and isinstance(v, int) else rename(v)
                for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return [rename(item) for item in value]
        return value

    def clock(action: str, answer: Any) -> Any:
        # A permit's time is the database's clock at the decision, not the transaction's.
        if action == "runtime_limit_acquire" and answer["at"] is not None:
            return answer | {"at": "<clock>"}
        return answer

    def unchild(text: str) -> str:
        for child in child_ids(seen):
            text = text.replace(child, "<child>")
        return text

    text = json.dumps(rename([(a, clock(a, answer)) for a, answer in seen]), sort_keys=True)
    sheet_rows = [(*row[:3], order.get(row[3], row[3]), *row[4:]) for row in written["sheet_rows"]]
    tables = written | {"sheet_rows": sheet_rows}
    return unchild(text), {table: unchild(repr(rename(found))) for table, found in tables.items()}


async def both_paths(
    conn: Conn, claims: Claims, play: Callable[[Run, Claims], Awaitable[None]]
) -> list[tuple[list[tuple[str, Any]], dict[str, Any]]]:
    got: list[tuple[list[tuple[str, Any]], dict[str, Any]]] = []
    for wire in (False, True):
        path = Path(conn, claims, wire)
        written: dict[str, Any] = {}
        async with conn.transaction():  # a savepoint, rolled back after each path
            await play(path.run, claims)
            written = await rows(conn, claims.run_id, claims.org)
            raise psycopg.Rollback()
        got.append((path.seen, written))
    return got


def child_ids(seen: list[tuple[str, Any]]) -> set[str]:
    return {a["runId"] for action, a in seen if action in ("runtime_run_spawn", "runtime_run_get")}


@pytest.fixture
async def attempt(conn: Conn) -> attempts.Attempt:
    await limits.set_limit(conn, LIMIT, concurrency=1)
    await costs.set_budget(conn, org=attempts.ORG, limit=10)
    return await attempts.start(conn)


def claims_of(a: attempts.Attempt, capabilities: list[str] | None = None) -> Claims:
    return authority.claims_of_attempt(
        a.claimed.descriptor,
        attempt=a.fence.attempt,
        owner=a.fence.owner,
        capabilities=capabilities,
    )


async def test_every_action_answers_and_writes_the_same_on_both_paths(
    conn: Conn, attempt: attempts.Attempt
) -> None:
    claims = claims_of(attempt)
    (typed, typed_rows), (wire, wire_rows) = await both_paths(conn, claims, script)
    assert [action for action, _ in typed] == [action for action, _ in wire]
    typed_text, typed_rows = normalized(typed, typed_rows)
    wire_text, wire_rows = normalized(wire, wire_rows)
    assert typed_text == wire_text
    for table in typed_rows:
        assert typed_rows[table] == wire_rows[table], table
    tables = ("receipts", "sheet_rows", "children", "charges", "reservations", "budgets")
    assert all(typed_rows[table] != "[]" for table in tables)
    assert "'usd'" in typed_rows["budgets"]  # the child's own budget, from its spawn options

    ledger = claims_of(attempt, [LEDGER_PROJECT])
    (typed_ledger, ledger_rows), (wire_ledger, wire_ledger_rows) = await both_paths(
        conn, ledger, ledger_script
    )
    assert typed_ledger == wire_ledger
    assert ledger_rows == wire_ledger_rows
    assert [a["appended"] for _, a in typed_ledger] == [2, 0, 1]

    called = {action for action, _ in typed} | {action for action, _ in typed_ledger}
    assert called == operations.SERVED_ACTIONS  # the scripts reach every action a play may make
    # The others are a run's lifecycle events, which no play makes: no codec, no typed call.
    assert {"start_run", "project_run_created"} == operations.LIFECYCLE_ACTIONS
    assert not operations.LIFECYCLE_ACTIONS & set(calls.BY_ACTION)


async def test_a_typed_call_for_another_runs_step_is_refused_in_process(
    conn: Conn, attempt: attempts.Attempt
) -> None:
    claims = claims_of(attempt)
    other = receipts.Scope.of_run(uuid.uuid4())
    stranger = receipts.StepRef(claims.org, claims.play, other, "a", claims.fence)
    with pytest.raises(RunScope, match="another run's"):
        await operations.perform(conn, calls.ReceiptClaim(stranger), claims)
    foreign = receipts.StepRef("other-org", claims.play, other, "a", claims.fence)
    with pytest.raises(RunScope, match="another run's attempt"):
        await operations.perform(conn, calls.ReceiptClaim(foreign), claims)
