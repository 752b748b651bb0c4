"""Every repeatable runtime action is safe to send again after its answer was lost (a
connection that broke after the commit): the same call, sent twice by the same attempt,
is answered as the first time, or as a replay of it, and writes nothing twice. This is
what lets the runtime absorb a blip by sending the call again (worker.contract.Absorbing,
docs/design.md section 11c). The one action that is not repeatable (an emit) is said to be.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from queues import costs, limits, operations, runs
from queues.errors import StaleAttempt
from tests.db.test_operations import claims_of

Conn = psycopg.AsyncConnection[Any]


async def twice(conn: Conn, claims: Any, action: str, payload: dict[str, Any]) -> tuple[Any, Any]:
    assert operations.repeatable(action), action
    body = {"action": action, "input": payload}
    first = await operations.dispatch(conn, body, claims)
    again = await operations.dispatch(conn, body, claims)
    return first, again


async def count(conn: Conn, sql: str, *args: Any) -> int:
    cur = await conn.execute(sql, args)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_receipt_completed_or_failed_again_is_answered_as_the_first_time(
    conn: Conn,
) -> None:
    claims = await claims_of(conn)
    await twice(conn, claims, "runtime_receipt_claim", {"stepKey": "c"})
    first, again = await twice(
        conn, claims, "runtime_receipt_complete", {"stepKey": "c", "result": [1, "a"]}
    )
    assert first == again == {"result": [1, "a"]}
    await operations.dispatch(
        conn, {"action": "runtime_receipt_claim", "input": {"stepKey": "f"}}, claims
    )
    error = {"type": "X", "message": "m"}
    assert await twice(conn, claims, "runtime_receipt_fail", {"stepKey": "f", "error": error}) == (
        {},
        {},
    )
    # One step_failed in the ledger, not two.
    ledger = await runs.events(conn, claims.run_id)
    assert [e.kind for e in ledger].count("step_failed") == 1


async def test_a_completion_with_another_result_is_still_refused(conn: Conn) -> None:
    claims = await claims_of(conn)
    call = {"action": "runtime_receipt_claim", "input": {"stepKey": "c"}}
    await operations.dispatch(conn, call, claims)
    done = {"action": "runtime_receipt_complete", "input": {"stepKey": "c", "result": 1}}
    await operations.dispatch(conn, done, claims)
    other = {"action": "runtime_receipt_complete", "input": {"stepKey": "c", "result": 2}}
    with pytest.raises(StaleAttempt, match="is completed by run"):
        await operations.dispatch(conn, other, claims)


async def test_a_recorded_step_sent_again_replays(conn: Conn) -> None:
    claims = await claims_of(conn)
    first, again = await twice(
        conn, claims, "runtime_receipt_record", {"stepKey": "r", "result": {"v": 2}}
    )
    assert first["outcome"] == "execute" and again["outcome"] == "replay"
    assert first["result"] == again["result"] == {"v": 2}


async def test_a_page_of_receipts_sent_again_is_already_there(conn: Conn) -> None:
    claims = await claims_of(conn)
    first, again = await twice(
        conn, claims, "runtime_receipts_complete", {"results": [["row:a", 1], ["row:b", 2]]}
    )
    assert first == {"completed": ["row:a", "row:b"], "already": [], "busy": []}
    assert again == {"completed": [], "already": ["row:a", "row:b"], "busy": []}


async def test_charges_sent_again_are_recorded_once(conn: Conn) -> None:
    claims = await claims_of(conn)
    await costs.set_budget(conn, org=claims.org, limit=100)
    charge = [{"amount": 2, "unit": "credits", "provider": "clearbit"}]
    await twice(
        conn, claims, "runtime_receipt_record", {"stepKey": "r", "result": 1, "charges": charge}
    )
    await twice(conn, claims, "runtime_receipt_claim", {"stepKey": "c"})
    await twice(
        conn, claims, "runtime_receipt_complete", {"stepKey": "c", "result": 1, "charges": charge}
    )
    await twice(conn, claims, "runtime_receipt_claim", {"stepKey": "f"})
    failed = {"stepKey": "f", "error": {"type": "X"}, "charges": charge}
    await twice(conn, claims, "runtime_receipt_fail", failed)
    page = {"results": [["row:a", 1]], "charges": [{"stepKey": "row:a", "amount": 2}]}
    await twice(conn, claims, "runtime_receipts_complete", page)
    sql = "SELECT count(*) FROM wq_charges WHERE run_id = %s"
    assert await count(conn, sql, claims.run_id) == 4
    (shown,) = await costs.list_budgets(conn, org=claims.org)
    assert shown.spent == 8  # each charge counted once against the budget too


async def test_a_reservation_asked_again_holds_the_estimate_once(conn: Conn) -> None:
    claims = await claims_of(conn)
    await costs.set_budget(conn, org=claims.org, limit=10)
    asked = {"keys": ["k1", "k2"], "estimate": {"credits": 4}}
    first, again = await twice(conn, claims, "runtime_budget_reserve", asked)
    assert first == again and first["granted"] == 2
    (shown,) = await costs.list_budgets(conn, org=claims.org)
    assert shown.reserved == 8


async def test_a_child_spawned_again_is_the_same_child(conn: Conn) -> None:
    claims = await claims_of(conn)
    first, again = await twice(conn, claims, "runtime_run_spawn", {"stepKey": "sp", "play": "p"})
    assert first["runId"] == again["runId"] and (first["created"], again["created"]) == (
        True,
        False,
    )
    assert (
        await count(conn, "SELECT count(*) FROM wq_runs WHERE parent_id = %s", claims.run_id) == 1
    )


async def test_a_permit_asked_again_by_its_hold_is_the_same_permit(conn: Conn) -> None:
    await limits.set_limit(conn, "api", rate="1/s", burst=1, concurrency=1)
    claims = await claims_of(conn)
    first, again = await twice(conn, claims, "runtime_limit_acquire", {"key": "api", "hold": "h1"})
    # Granted both times, without a second token: at 1/s with a burst of 1, a second
    # permit would have had to wait, and at a concurrency of 1 it would have been busy.
    assert first["granted"] and again["granted"] and not again["busy"]
    assert again["waitSeconds"] is None
    assert (
        await count(conn, "SELECT count(*) FROM wq_limit_holds WHERE run_id = %s", claims.run_id)
        == 1
    )
    # Another hold of the same attempt is a second permit: it waits.
    other = await operations.dispatch(
        conn, {"action": "runtime_limit_acquire", "input": {"key": "api", "hold": "h2"}}, claims
    )
    assert not other["granted"]
    released = await twice(conn, claims, "runtime_limit_release", {"hold": "h1"})
    assert released == ({"released": True}, {"released": False})


@pytest.mark.parametrize("action", ["runtime_sheet_start", "runtime_sheet_start_with_intent"])
async def test_a_page_of_rows_admitted_or_completed_again_is_current(
    conn: Conn, action: str
) -> None:
    claims = await claims_of(conn)
    page = {"tableNamespace": "s", "rows": [{"key": "a", "input": {"k": 1}}]}
    first, again = await twice(conn, claims, action, page)
    assert first["writeVersion"] == again["writeVersion"]
    assert [r["disposition"] for r in first["rows"]] == ["admitted"]
    assert [r["disposition"] for r in again["rows"]] == ["already_current"]
    done = {
        "tableNamespace": "s",
        "writeVersion": first["writeVersion"],
        "rows": [{"key": "a", "output": {"ok": True}}],
    }
    first, again = await twice(conn, claims, "runtime_sheet_complete_map_rows", done)
    assert first["committedKeys"] == again["committedKeys"] == ["a"]
    assert again["replayedKeys"] == ["a"] and again["staleRows"] == []


async def test_an_emit_is_not_repeatable() -> None:
    # Sent again it would emit a second event: it has no key to know a repeat by.
    assert not operations.repeatable("runtime_event_emit")
