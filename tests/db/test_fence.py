"""Every write path of an attempt against the state a real rescue leaves.

Each test makes attempt 1 stale the way production does (the recovery pass closes it when
its lease lapsed, and a second worker claims the run as attempt 2, see tests/attempts.py),
then tries one write of attempt 1 and checks that it is refused, that nothing of it is
visible, and that the refusal is logged. A second family checks the window between the
rescue and the second claim (the run is ``queued``: no attempt may write), and a third
the lease owner (the same attempt number under another worker is not the same attempt).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import outcomes, receipts, runs, sheets
from queues.errors import RunNotFound, SheetSuperseded, StaleAttempt
from queues.fence import Fence
from queues.outcomes import FinishStatus
from queues.receipts import ClaimOutcome, Scope
from tests import attempts
from tests.attempts import ORG, PLAY, Attempt

Conn = psycopg.AsyncConnection[Any]
LEASE = 30.0


def _ref(a: Attempt, key: str, fence: Fence | None = None) -> dict[str, Any]:
    return {
        "org": ORG,
        "play": PLAY,
        "scope": Scope.of_run(a.run_id),
        "step_key": key,
        "fence": fence or a.fence,
    }


async def _count(conn: Conn, sql: str, *params: Any) -> int:
    cur = await conn.execute(sql, params)  # type: ignore[arg-type]
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def _stale_pair(conn: Conn) -> tuple[Attempt, Attempt]:
    old = await attempts.start(conn)
    new = await attempts.supersede(conn, old)
    assert new.fence.attempt == old.fence.attempt + 1
    return old, new


# ---- receipts --------------------------------------------------------------------------


async def test_a_rescued_attempt_cannot_claim_a_step(conn: Conn) -> None:
    old, new = await _stale_pair(conn)
    with pytest.raises(StaleAttempt, match="attempt 2"):
        await receipts.claim(conn, receipts.StepRef(**_ref(old, "fetch")), lease_s=LEASE)
    assert (
        await receipts.get(
            conn, org=ORG, play=PLAY, scope=Scope.of_run(old.run_id), step_key="fetch"
        )
        is None
    )
    assert await attempts.refusals(conn, old.run_id) == [(1, "receipt", 1)]
    claim = await receipts.claim(conn, receipts.StepRef(**_ref(new, "fetch")), lease_s=LEASE)
    assert claim.outcome is ClaimOutcome.EXECUTE


async def test_a_step_claimed_before_the_rescue_cannot_be_completed_after_it(conn: Conn) -> None:
    old = await attempts.start(conn)
    claim = await receipts.claim(
        conn, receipts.StepRef(**_ref(old, "fetch")), lease_s=LEASE, now=old.now
    )
    assert claim.outcome is ClaimOutcome.EXECUTE
    new = await attempts.supersede(conn, old)
    for write in (
        receipts.complete(conn, receipts.StepRef(**_ref(old, "fetch")), result={"paid": 1}),
        receipts.fail(conn, receipts.StepRef(**_ref(old, "fetch")), error={"type": "X"}),
        receipts.skip(conn, receipts.StepRef(**_ref(old, "fetch"))),
    ):
        with pytest.raises(StaleAttempt):
            await write
    # The live attempt takes the step over (its own run's older attempt held it) and pays.
    taken = await receipts.claim(conn, receipts.StepRef(**_ref(new, "fetch")), lease_s=LEASE)
    assert taken.outcome is ClaimOutcome.EXECUTE
    assert await receipts.complete(
        conn, receipts.StepRef(**_ref(new, "fetch")), result={"paid": 2}
    ) == {"paid": 2}
    stored = await receipts.get(
        conn, org=ORG, play=PLAY, scope=Scope.of_run(old.run_id), step_key="fetch"
    )
    assert stored is not None and stored.result == {"paid": 2} and stored.owner_attempt == 2


async def test_a_rescued_attempt_cannot_complete_a_page_of_steps(conn: Conn) -> None:
    old, _new = await _stale_pair(conn)
    with pytest.raises(StaleAttempt):
        await receipts.complete_many(
            conn,
            org=ORG,
            play=PLAY,
            scope=Scope.of_run(old.run_id),
            fence=old.fence,
            results=[("row:a", 1), ("row:b", 2)],
        )
    assert (
        await _count(conn, "SELECT count(*) FROM wq_receipts WHERE owner_run = %s", old.run_id) == 0
    )
    assert await attempts.refusals(conn, old.run_id) == [(1, "receipt", 2)]


async def test_a_rescued_attempt_cannot_extend_step_leases(conn: Conn) -> None:
    old = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**_ref(old, "slow")), lease_s=LEASE, now=old.now)
    await attempts.supersede(conn, old)
    with pytest.raises(StaleAttempt):
        await receipts.extend_leases(conn, fence=old.fence, lease_s=3600)
    before = await receipts.get(
        conn, org=ORG, play=PLAY, scope=Scope.of_run(old.run_id), step_key="slow"
    )
    # The heartbeat's batch form is fenced too: it extends nothing for a stale attempt.
    await receipts.extend_for_attempts(
        conn, owner=old.fence.owner, leases=[(old.run_id, old.fence.attempt)], lease_s=3600
    )
    after = await receipts.get(
        conn, org=ORG, play=PLAY, scope=Scope.of_run(old.run_id), step_key="slow"
    )
    assert before is not None and after is not None
    assert after.lease_expires_at == before.lease_expires_at


# ---- sheets ----------------------------------------------------------------------------


async def test_a_rescued_attempt_cannot_admit_rows_under_a_stable_intent(conn: Conn) -> None:
    old, _new = await _stale_pair(conn)
    with pytest.raises(StaleAttempt):
        await sheets.admit_page(
            conn, org=ORG, sheet="s", fence=old.fence, rows=[("a", {})], stable_intent=True
        )
    assert (
        await _count(conn, "SELECT count(*) FROM wq_write_intents WHERE run_id = %s", old.run_id)
        == 0
    )
    assert (
        await _count(conn, "SELECT count(*) FROM wq_sheet_rows WHERE run_id = %s", old.run_id) == 0
    )
    assert await attempts.refusals(conn, old.run_id) == [(1, "admission", 1)]


async def test_a_rescued_attempt_cannot_mint_a_legacy_version(conn: Conn) -> None:
    old, _new = await _stale_pair(conn)
    with pytest.raises(StaleAttempt):
        await sheets.admit_page(conn, org=ORG, sheet="s", fence=old.fence, rows=[("a", {})])
    assert (
        await _count(conn, "SELECT count(*) FROM wq_sheet_rows WHERE run_id = %s", old.run_id) == 0
    )


async def test_rows_of_a_rescued_attempt_are_refused_as_stale_attempt(conn: Conn) -> None:
    """The zombie case: attempt 1 admitted rows under the run's stable intent, lapsed; the
    rows' version is the same for attempt 2, so only the attempt fence can refuse them."""
    old = await attempts.start(conn)
    admitted = await sheets.admit_page(
        conn,
        org=ORG,
        sheet="s",
        fence=old.fence,
        rows=[("a", {}), ("b", {})],
        stable_intent=True,
    )
    new = await attempts.supersede(conn, old)
    completions = [sheets.RowCompletion("a", {"by": 1}), sheets.RowCompletion("b", {"by": 1})]
    with pytest.raises(SheetSuperseded) as raised:
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet="s",
            fence=old.fence,
            write_version=admitted.write_version,
            completions=completions,
        )
    error = raised.value
    # The reference's fields say a newer owner has the rows; the fence says why, apart.
    assert error.counts == {"newer_write_version": 2} and error.submitted == 2
    assert error.fence_reason == "stale_attempt"
    assert [row[0] for row in error.superseded_rows] == ["a", "b"]
    assert (
        await _count(
            conn,
            "SELECT count(*) FROM wq_sheet_rows WHERE status <> 'pending' AND run_id = %s",
            old.run_id,
        )
        == 0
    )
    assert await attempts.refusals(conn, old.run_id) == [(1, "rows", 2)]
    # Attempt 2 reuses the intent and completes the rows as the only writer.
    again = await sheets.admit_page(
        conn,
        org=ORG,
        sheet="s",
        fence=new.fence,
        rows=[("a", {}), ("b", {})],
        stable_intent=True,
    )
    assert again.write_version == admitted.write_version
    done = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=new.fence,
        write_version=again.write_version,
        completions=[sheets.RowCompletion("a", {"by": 2}), sheets.RowCompletion("b", {"by": 2})],
    )
    assert done.committed == ("a", "b") and not done.stale
    cur = await conn.execute(
        "SELECT row_key, output, attempt FROM wq_sheet_rows WHERE run_id = %s ORDER BY 1",
        (old.run_id,),
    )
    assert await cur.fetchall() == [("a", {"by": 2}, 2), ("b", {"by": 2}, 2)]


async def test_a_stale_completion_raises_even_when_the_writer_asked_not_to(conn: Conn) -> None:
    old = await attempts.start(conn)
    admitted = await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=old.fence, rows=[("a", {})], stable_intent=True
    )
    await attempts.supersede(conn, old)
    with pytest.raises(SheetSuperseded, match="must stop") as raised:
        await sheets.complete_rows(
            conn,
            org=ORG,
            sheet="s",
            fence=old.fence,
            write_version=admitted.write_version,
            completions=[sheets.RowCompletion("a", 1)],
            raise_on_superseded=False,
        )
    assert raised.value.fence_reason == "stale_attempt"


# ---- the window between the rescue and the next claim ----------------------------------


async def test_between_rescue_and_reclaim_no_attempt_writes(conn: Conn) -> None:
    old = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**_ref(old, "held")), lease_s=LEASE, now=old.now)
    await attempts.rescue(conn, old)
    assert (await attempts.run_row(conn, old.run_id))["state"] == "queued"
    with pytest.raises(StaleAttempt, match="queued"):
        await receipts.complete(conn, receipts.StepRef(**_ref(old, "held")), result=1)
    with pytest.raises(StaleAttempt):
        await sheets.admit_page(
            conn, org=ORG, sheet="s", fence=old.fence, rows=[("a", {})], stable_intent=True
        )
    with pytest.raises(StaleAttempt):
        await runs.emit(conn, org=ORG, name="e", payload=1, fence=old.fence)
    renewed = await runs.heartbeat(
        conn, worker_id=old.fence.owner, leases=[(old.run_id, old.fence.attempt)]
    )
    assert renewed == []
    statuses = await runs.finish(
        conn,
        worker_id=old.fence.owner,
        finishes=[outcomes.succeeded(old.run_id, old.fence.attempt, {"late": True})],
    )
    assert statuses == {(old.run_id, 1): FinishStatus.REFUSED}
    row = await attempts.run_row(conn, old.run_id)
    assert row["state"] == "queued"
    assert [k for _, k, _ in await attempts.refusals(conn, old.run_id)] == [
        "receipt",
        "admission",
        "emit",
        "final",
    ]


# ---- the lease owner -------------------------------------------------------------------


async def test_the_same_attempt_number_under_another_worker_is_refused(conn: Conn) -> None:
    live = await attempts.start(conn, worker="w1")
    impostor = Fence(live.run_id, live.fence.attempt, "w-other")
    with pytest.raises(StaleAttempt, match="lease is no longer held"):
        await receipts.claim(conn, receipts.StepRef(**_ref(live, "x", impostor)), lease_s=LEASE)
    with pytest.raises(StaleAttempt):
        await sheets.admit_page(
            conn, org=ORG, sheet="s", fence=impostor, rows=[("a", {})], stable_intent=True
        )
    with pytest.raises(StaleAttempt):
        await runs.emit(conn, org=ORG, name="e", fence=impostor)
    statuses = await runs.finish(
        conn,
        worker_id="w-other",
        finishes=[outcomes.succeeded(live.run_id, live.fence.attempt, None)],
    )
    assert statuses[(live.run_id, 1)] is FinishStatus.REFUSED
    assert (await attempts.run_row(conn, live.run_id))["state"] == "running"


async def test_another_org_cannot_write_through_a_run(conn: Conn) -> None:
    live = await attempts.start(conn)
    with pytest.raises(StaleAttempt):
        await receipts.claim(
            conn, receipts.StepRef(**{**_ref(live, "x"), "org": "someone-else"}), lease_s=LEASE
        )
    with pytest.raises(RunNotFound, match="someone-else"):
        await sheets.admit_page(
            conn,
            org="someone-else",
            sheet="s",
            fence=live.fence,
            rows=[("a", {})],
            stable_intent=True,
        )


# ---- the final write -------------------------------------------------------------------


async def test_a_late_success_of_a_rescued_attempt_is_refused(conn: Conn) -> None:
    old, new = await _stale_pair(conn)
    statuses = await runs.finish(
        conn,
        worker_id=old.fence.owner,
        finishes=[outcomes.succeeded(old.run_id, old.fence.attempt, {"zombie": True})],
    )
    assert statuses[(old.run_id, 1)] is FinishStatus.REFUSED
    row = await attempts.run_row(conn, old.run_id)
    assert row == {"state": "running", "attempt": 2, "lease_owner": "w2", "cancel": False}
    cur = await conn.execute(
        "SELECT attempt, outcome::text FROM wq_attempts WHERE run_id = %s ORDER BY 1",
        (old.run_id,),
    )
    assert await cur.fetchall() == [(1, "lease_expired"), (2, "running")]
    assert new.fence.owner == "w2"


async def test_a_suspension_of_a_rescued_attempt_is_refused(conn: Conn) -> None:
    old, _new = await _stale_pair(conn)
    statuses = await runs.finish(
        conn,
        worker_id=old.fence.owner,
        finishes=[
            outcomes.suspended(old.run_id, 1, wake_at=old.now + timedelta(hours=1), wait_event=None)
        ],
    )
    assert statuses[(old.run_id, 1)] is FinishStatus.REFUSED
    assert (await attempts.run_row(conn, old.run_id))["state"] == "running"


async def test_a_final_write_whose_reply_was_lost_is_replayed_not_refused(conn: Conn) -> None:
    live = await attempts.start(conn)
    final = outcomes.succeeded(live.run_id, 1, {"ok": True})
    first = await runs.finish(conn, worker_id="w1", finishes=[final])
    again = await runs.finish(conn, worker_id="w1", finishes=[final])
    assert first[(live.run_id, 1)] is FinishStatus.APPLIED
    assert again[(live.run_id, 1)] is FinishStatus.REPLAYED
    assert await attempts.refusals(conn, live.run_id) == []
    assert (await attempts.run_row(conn, live.run_id))["state"] == "succeeded"


async def test_cancel_is_final_for_every_other_outcome(conn: Conn) -> None:
    for final_of in (
        lambda a: outcomes.succeeded(a.run_id, 1, {"late": True}),
        lambda a: outcomes.handed_back(a.run_id, 1),
        lambda a: outcomes.suspended(a.run_id, 1, wake_at=None, wait_event="never"),
    ):
        live = await attempts.start(conn)
        result = await runs.cancel(conn, live.run_id, reason="stop")
        assert result.after == "running" and result.notified
        statuses = await runs.finish(conn, worker_id="w1", finishes=[final_of(live)])
        assert statuses[(live.run_id, 1)] is FinishStatus.CANCEL_PENDING
        assert (await attempts.run_row(conn, live.run_id))["state"] == "running"
        statuses = await runs.finish(
            conn, worker_id="w1", finishes=[outcomes.cancelled(live.run_id, 1, "stop")]
        )
        assert statuses[(live.run_id, 1)] is FinishStatus.APPLIED
        assert (await attempts.run_row(conn, live.run_id))["state"] == "cancelled"
