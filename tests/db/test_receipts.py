"""Work receipts against real Postgres, each test in one rolled-back transaction.

Every run is a real one (``tests/attempts.py``: admitted, claimed by worker ``w1``), and a
stale attempt is made the way production makes one: the recovery pass rescues it once its
lease lapsed and a second worker claims the run as the next attempt.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import outcomes, receipts, runs
from queues.errors import InvalidField, RunNotFound, StaleAttempt
from queues.fence import Fence
from queues.outcomes import FinishStatus
from queues.receipts import ClaimOutcome, ReceiptStatus, Scope
from tests import attempts
from tests.attempts import ORG, PLAY, T0, Attempt

Conn = psycopg.AsyncConnection[Any]
LEASE = 30.0


async def versions(conn: Conn, scope: Scope) -> dict[str, str]:
    """The physical row version of each receipt in a scope: a write of any kind changes it."""
    cur = await conn.execute(
        "SELECT step_key, ctid::text FROM wq_receipts WHERE scope = %(scope)s",
        {"scope": scope.key},
    )
    return {key: ctid for key, ctid in await cur.fetchall()}


def ref(
    a: Attempt | Fence, key: str, scope: Scope | None = None, play: str = PLAY
) -> dict[str, Any]:
    """The arguments naming one step of an attempt (its fence, its run's scope by default)."""
    fence = a if isinstance(a, Fence) else a.fence
    return {
        "org": ORG,
        "play": play,
        "scope": scope or Scope.of_run(fence.run_id),
        "step_key": key,
        "fence": fence,
    }


def page_ref(a: Attempt, scope: Scope | None = None) -> dict[str, Any]:
    return {"org": ORG, "play": PLAY, "scope": scope or Scope.of_run(a.run_id), "fence": a.fence}


async def receipt(conn: Conn, run_id: uuid.UUID, key: str, scope: Scope | None = None) -> Any:
    found = await receipts.get(
        conn, org=ORG, play=PLAY, scope=scope or Scope.of_run(run_id), step_key=key
    )
    assert found is not None
    return found


# ---- step keys -------------------------------------------------------------------------


def test_step_keys_get_ordinal_suffixes_per_attempt() -> None:
    seen: dict[str, int] = {}
    keys = [receipts.step_key(n, seen) for n in ["fetch", "fetch", "save", "fetch", "save"]]
    assert keys == ["fetch", "fetch#2", "save", "fetch#3", "save#2"]
    assert receipts.step_key("fetch", {}) == "fetch"  # a new attempt maps onto the same keys


@pytest.mark.parametrize("name", ["", "a#b", "x" * 201])
def test_step_names_are_validated(name: str) -> None:
    seen: dict[str, int] = {}
    with pytest.raises(InvalidField) as info:
        receipts.step_key(name, seen)
    assert info.value.field == "step name"
    assert info.value.rule and info.value.fix
    assert seen == {}


def test_scope_names() -> None:
    run_id = uuid.uuid4()
    assert str(Scope.of_run(run_id)) == f"run:{run_id}"
    assert Scope.named("enrich-v1").key == "enrich-v1"
    with pytest.raises(InvalidField, match="reserved"):
        Scope.named(f"run:{run_id}")


# ---- claim, complete, replay -----------------------------------------------------------


async def test_first_claim_executes_and_a_later_attempt_replays(conn: Conn) -> None:
    first = await attempts.start(conn)
    run_id = first.run_id
    claim = await receipts.claim(
        conn, receipts.StepRef(**ref(first, "fetch")), lease_s=LEASE, now=T0
    )
    assert claim.outcome is ClaimOutcome.EXECUTE
    assert claim.lease_expires_at == T0 + timedelta(seconds=LEASE)
    assert (claim.owner_run, claim.owner_attempt) == (run_id, 1)

    stored = await receipts.complete(
        conn, receipts.StepRef(**ref(first, "fetch")), result={"rows": (1, 2), "ok": True}
    )
    assert stored == {"rows": [1, 2], "ok": True}  # what a replay will see

    second = await attempts.supersede(conn, first)
    assert second.fence == Fence(run_id, 2, "w2")
    before = await versions(conn, Scope.of_run(run_id))
    again = await receipts.claim(
        conn, receipts.StepRef(**ref(second, "fetch")), lease_s=LEASE, now=second.now
    )
    assert again.outcome is ClaimOutcome.REPLAY
    assert await versions(conn, Scope.of_run(run_id)) == before  # a replay writes nothing
    assert again.result == {"rows": [1, 2], "ok": True}
    row = await receipt(conn, run_id, "fetch")
    assert row.status is ReceiptStatus.COMPLETED
    assert row.owner_attempt == 1  # the replay took nothing over
    assert row.completed_at is not None


async def test_same_attempt_reclaiming_its_own_step_executes(conn: Conn) -> None:
    a = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**ref(a, "s")), lease_s=LEASE, now=T0)
    later = T0 + timedelta(seconds=5)
    again = await receipts.claim(conn, receipts.StepRef(**ref(a, "s")), lease_s=LEASE, now=later)
    assert again.outcome is ClaimOutcome.EXECUTE
    assert again.lease_expires_at == later + timedelta(seconds=LEASE)
    assert (again.owner_run, again.owner_attempt) == (a.run_id, 1)


async def test_failed_step_is_claimed_again_by_a_later_attempt(conn: Conn) -> None:
    first = await attempts.start(conn)
    run_id = first.run_id
    await receipts.claim(conn, receipts.StepRef(**ref(first, "pay")), lease_s=LEASE, now=T0)
    await receipts.fail(
        conn, receipts.StepRef(**ref(first, "pay")), error={"type": "Timeout", "msg": "slow"}
    )
    failed = await receipt(conn, run_id, "pay")
    assert failed.status is ReceiptStatus.FAILED
    assert failed.error == {"type": "Timeout", "msg": "slow"}
    assert failed.lease_expires_at is None

    second = await attempts.supersede(conn, first)
    retry = await receipts.claim(
        conn, receipts.StepRef(**ref(second, "pay")), lease_s=LEASE, now=second.now
    )
    assert retry.outcome is ClaimOutcome.EXECUTE
    claimed = await receipt(conn, run_id, "pay")
    assert (claimed.status, claimed.owner_attempt, claimed.error) == (
        ReceiptStatus.CLAIMED,
        2,
        None,
    )
    await receipts.complete(conn, receipts.StepRef(**ref(second, "pay")), result="paid")
    assert (await receipt(conn, run_id, "pay")).result == "paid"


async def test_skipped_step_replays_as_skipped(conn: Conn) -> None:
    first = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**ref(first, "notify")), lease_s=LEASE, now=T0)
    await receipts.skip(conn, receipts.StepRef(**ref(first, "notify")))
    second = await attempts.supersede(conn, first)
    before = await versions(conn, Scope.of_run(first.run_id))
    again = await receipts.claim(
        conn, receipts.StepRef(**ref(second, "notify")), lease_s=LEASE, now=second.now
    )
    assert again.outcome is ClaimOutcome.SKIPPED
    assert await versions(conn, Scope.of_run(first.run_id)) == before
    row = await receipt(conn, first.run_id, "notify")
    assert (row.status, row.owner_attempt) == (ReceiptStatus.SKIPPED, 1)


async def test_live_claim_is_busy_until_its_lease_lapses_then_taken_over(conn: Conn) -> None:
    scope = Scope.named("shared")
    run_a = await attempts.start(conn)
    run_b = await attempts.start(conn)
    held = await receipts.claim(
        conn, receipts.StepRef(**ref(run_a, "s", scope)), lease_s=LEASE, now=T0
    )
    assert held.outcome is ClaimOutcome.EXECUTE

    early = T0 + timedelta(seconds=LEASE - 1)
    busy = await receipts.claim(
        conn, receipts.StepRef(**ref(run_b, "s", scope)), lease_s=LEASE, now=early
    )
    assert busy.outcome is ClaimOutcome.BUSY
    assert busy.lease_expires_at == T0 + timedelta(seconds=LEASE)
    assert (busy.owner_run, busy.owner_attempt) == (run_a.run_id, 1)

    late = T0 + timedelta(seconds=LEASE)
    taken = await receipts.claim(
        conn, receipts.StepRef(**ref(run_b, "s", scope)), lease_s=LEASE, now=late
    )
    assert taken.outcome is ClaimOutcome.EXECUTE
    assert taken.owner_run == run_b.run_id

    # The lapsed holder's late write is refused (its run is live: the receipt's owner
    # fence refuses it, not the attempt fence); the new owner's stands.
    with pytest.raises(
        StaleAttempt, match=f"run {run_a.run_id} attempt 1 cannot complete step 's'"
    ) as info:
        await receipts.complete(conn, receipts.StepRef(**ref(run_a, "s", scope)), result="a")
    assert f"claimed by run {run_b.run_id} attempt 1" in str(info.value)
    await receipts.complete(conn, receipts.StepRef(**ref(run_b, "s", scope)), result="b")
    row = await receipt(conn, run_a.run_id, "s", scope)
    assert (row.status, row.owner_run, row.result) == (ReceiptStatus.COMPLETED, run_b.run_id, "b")


async def test_extend_leases_keeps_a_long_step_claimed(conn: Conn) -> None:
    scope = Scope.named("shared")
    run_a = await attempts.start(conn)
    # run_b is claimed later, so the rescue of run_a below leaves it running.
    run_b = await attempts.start(conn, now=T0 + timedelta(hours=1))
    await receipts.claim(conn, receipts.StepRef(**ref(run_a, "s", scope)), lease_s=LEASE, now=T0)
    await receipts.claim(conn, receipts.StepRef(**ref(run_a, "t", scope)), lease_s=LEASE, now=T0)
    beat = T0 + timedelta(seconds=20)
    assert await receipts.extend_leases(conn, fence=run_a.fence, lease_s=LEASE, now=beat) == 2
    after_first_lease = T0 + timedelta(seconds=LEASE + 5)
    busy = await receipts.claim(
        conn, receipts.StepRef(**ref(run_b, "s", scope)), lease_s=LEASE, now=after_first_lease
    )
    assert busy.outcome is ClaimOutcome.BUSY
    assert busy.lease_expires_at == beat + timedelta(seconds=LEASE)

    # Rescued (the run is queued, its attempt number kept), then claimed again by w2.
    await attempts.rescue(conn, run_a)
    with pytest.raises(StaleAttempt, match=r"now at attempt 1 \(queued\)"):
        await receipts.extend_leases(conn, fence=run_a.fence, lease_s=LEASE, now=beat)
    later = await attempts.claim(
        conn, worker="w2", now=run_a.lapses_at + timedelta(minutes=10), run_id=run_a.run_id
    )
    with pytest.raises(StaleAttempt, match=r"now at attempt 2 \(running\)"):
        await receipts.extend_leases(conn, fence=run_a.fence, lease_s=LEASE, now=beat)
    # The stale attempt extended nothing; the live one holds no step yet.
    assert (await receipt(conn, run_a.run_id, "s", scope)).lease_expires_at == beat + timedelta(
        seconds=LEASE
    )
    assert await receipts.extend_leases(conn, fence=later.fence, lease_s=LEASE, now=later.now) == 0
    assert (await attempts.run_row(conn, run_b.run_id))["state"] == "running"  # not rescued


async def test_heartbeat_extends_the_step_leases_of_many_attempts_in_one_call(
    conn: Conn,
) -> None:
    scope = Scope.named("shared")
    run_a, run_b, run_c = [await attempts.start(conn) for _ in range(3)]
    for a, key in ((run_a, "a"), (run_b, "b"), (run_c, "c")):
        await receipts.claim(conn, receipts.StepRef(**ref(a, key, scope)), lease_s=LEASE, now=T0)

    async def leases() -> dict[str, Any]:
        return {
            key: (await receipt(conn, a.run_id, key, scope)).lease_expires_at
            for a, key in ((run_a, "a"), (run_b, "b"), (run_c, "c"))
        }

    first = T0 + timedelta(seconds=LEASE)
    assert await leases() == {"a": first, "b": first, "c": first}
    beat = T0 + timedelta(seconds=20)
    # Another worker's heartbeat extends nothing: the leases are fenced by their owner.
    await receipts.extend_for_attempts(
        conn,
        owner="w-other",
        leases=[(run_a.run_id, 1), (run_b.run_id, 1)],
        lease_s=LEASE,
        now=beat,
    )
    assert await leases() == {"a": first, "b": first, "c": first}
    # run_c's attempt is not among the renewed leases: its step lease is left to lapse.
    await receipts.extend_for_attempts(
        conn, owner="w1", leases=[(run_a.run_id, 1), (run_b.run_id, 1)], lease_s=LEASE, now=beat
    )
    renewed = beat + timedelta(seconds=LEASE)
    assert await leases() == {"a": renewed, "b": renewed, "c": first}


# ---- fences ----------------------------------------------------------------------------


async def test_stale_attempt_cannot_claim_or_complete_and_the_newer_write_stands(
    conn: Conn,
) -> None:
    old = await attempts.start(conn)
    run_id = old.run_id
    await receipts.claim(conn, receipts.StepRef(**ref(old, "charge")), lease_s=LEASE, now=T0)
    new = await attempts.supersede(conn, old)

    with pytest.raises(StaleAttempt) as info:
        await receipts.complete(conn, receipts.StepRef(**ref(old, "charge")), result="old")
    message = str(info.value)
    assert str(run_id) in message and "attempt 1" in message and "'charge'" in message
    assert "now at attempt 2" in message
    with pytest.raises(StaleAttempt, match="cannot claim step 'other'"):
        await receipts.claim(conn, receipts.StepRef(**ref(old, "other")), lease_s=LEASE, now=T0)
    assert (
        await receipts.get(conn, org=ORG, play=PLAY, scope=Scope.of_run(run_id), step_key="other")
        is None
    )

    # The new attempt takes over its run's older claim (live lease or not) and completes.
    taken = await receipts.claim(
        conn, receipts.StepRef(**ref(new, "charge")), lease_s=LEASE, now=T0
    )
    assert taken.outcome is ClaimOutcome.EXECUTE
    await receipts.complete(conn, receipts.StepRef(**ref(new, "charge")), result="new")
    with pytest.raises(StaleAttempt):
        await receipts.complete(conn, receipts.StepRef(**ref(old, "charge")), result="old")
    with pytest.raises(StaleAttempt):
        await receipts.fail(conn, receipts.StepRef(**ref(old, "charge")), error={"e": 1})
    row = await receipt(conn, run_id, "charge")
    assert (row.status, row.owner_attempt, row.result) == (ReceiptStatus.COMPLETED, 2, "new")
    assert await attempts.refusals(conn, run_id) == [(1, "receipt", 1)] * 4


async def test_writes_need_a_running_run_and_a_held_claim(conn: Conn) -> None:
    done = await attempts.start(conn)
    finished = await runs.finish(
        conn, worker_id="w1", finishes=[outcomes.succeeded(done.run_id, 1, {"ok": True})]
    )
    assert finished == {(done.run_id, 1): FinishStatus.APPLIED}
    with pytest.raises(StaleAttempt, match=r"attempt 1 \(succeeded\)"):
        await receipts.claim(conn, receipts.StepRef(**ref(done, "s")), lease_s=LEASE, now=T0)
    with pytest.raises(RunNotFound):
        await receipts.claim(
            conn, receipts.StepRef(**ref(Fence(uuid.uuid4(), 1, "w1"), "s")), lease_s=LEASE, now=T0
        )
    a = await attempts.start(conn)
    with pytest.raises(StaleAttempt, match="holds no receipt"):
        await receipts.complete(conn, receipts.StepRef(**ref(a, "never-claimed")), result=1)
    await receipts.claim(conn, receipts.StepRef(**ref(a, "once")), lease_s=LEASE, now=T0)
    await receipts.complete(conn, receipts.StepRef(**ref(a, "once")), result=1)
    with pytest.raises(StaleAttempt, match="is completed by run"):
        await receipts.complete(conn, receipts.StepRef(**ref(a, "once")), result=2)
    assert (await receipt(conn, a.run_id, "once")).result == 1
    # Only the attempt fence logs refusals; a write refused by the receipt does not.
    assert await attempts.refusals(conn, done.run_id) == [(1, "receipt", 1)]
    assert await attempts.refusals(conn, a.run_id) == []


@pytest.mark.parametrize("bad", [object(), float("nan"), {"k": {1, 2}}, "nul\x00"])
async def test_unserialisable_result_is_refused_naming_the_step(conn: Conn, bad: object) -> None:
    a = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**ref(a, "render#2")), lease_s=LEASE, now=T0)
    with pytest.raises(InvalidField, match="step 'render#2'") as info:
        await receipts.complete(conn, receipts.StepRef(**ref(a, "render#2")), result=bad)  # type: ignore[arg-type]
    assert info.value.field == "result"
    assert (await receipt(conn, a.run_id, "render#2")).status is ReceiptStatus.CLAIMED


async def test_backslash_u0000_text_is_a_valid_result(conn: Conn) -> None:
    a = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**ref(a, "s")), lease_s=LEASE, now=T0)
    await receipts.complete(conn, receipts.StepRef(**ref(a, "s")), result="C:\\u0000")
    assert (await receipt(conn, a.run_id, "s")).result == "C:\\u0000"


# ---- scopes ----------------------------------------------------------------------------


async def test_wider_scope_lets_a_rerun_replay_paid_results(conn: Conn) -> None:
    scope = Scope.named("enrich-v1")
    first = await attempts.start(conn)
    await receipts.claim(
        conn, receipts.StepRef(**ref(first, "lookup", scope)), lease_s=LEASE, now=T0
    )
    await receipts.complete(
        conn, receipts.StepRef(**ref(first, "lookup", scope)), result={"paid": 42}
    )

    rerun = await attempts.start(conn)
    replay = await receipts.claim(
        conn, receipts.StepRef(**ref(rerun, "lookup", scope)), lease_s=LEASE, now=T0
    )
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.result == {"paid": 42}

    # The default scope is the run: the rerun's own scope has not paid for it.
    own = await receipts.claim(
        conn, receipts.StepRef(**ref(rerun, "lookup")), lease_s=LEASE, now=T0
    )
    assert own.outcome is ClaimOutcome.EXECUTE
    # A scope is shared within one org and play only.
    other_play = await attempts.start(conn, play="other")
    elsewhere = await receipts.claim(
        conn,
        receipts.StepRef(**ref(other_play, "lookup", scope, play="other")),
        lease_s=LEASE,
        now=T0,
    )
    assert elsewhere.outcome is ClaimOutcome.EXECUTE
    # A run cannot write into another play's scope: the fence checks the run's play.
    with pytest.raises(StaleAttempt):
        await receipts.claim(
            conn, receipts.StepRef(**ref(other_play, "lookup", scope)), lease_s=LEASE, now=T0
        )


# ---- pages -----------------------------------------------------------------------------


async def test_complete_many_records_a_page_in_one_call_and_a_recall_keeps_it(
    conn: Conn,
) -> None:
    a = await attempts.start(conn)
    scope = Scope.of_run(a.run_id)
    page = [(f"row:{i:04d}", {"i": i}) for i in range(500)]
    keys = [key for key, _ in page]

    done = await receipts.complete_many(conn, **page_ref(a), results=page)
    assert done.completed == keys
    assert done.already == [] and done.busy == []

    before = await versions(conn, scope)
    assert len(before) == 500
    again = await receipts.complete_many(
        conn, **page_ref(a), results=[(key, "overwritten?") for key in keys]
    )
    assert again.completed == [] and again.busy == []
    assert again.already == keys
    assert await versions(conn, scope) == before  # settled rows are not rewritten

    found = await receipts.lookup_many(
        conn, org=ORG, play=PLAY, scope=scope, keys=[*keys, "row:missing"]
    )
    assert found == {key: value for key, value in page}  # first results stand


async def test_complete_many_sorts_keys_by_their_receipt_state(conn: Conn) -> None:
    scope = Scope.named("rows")
    mine = await attempts.start(conn)
    other = await attempts.start(conn)

    async def hold(a: Attempt, key: str) -> None:
        claimed = await receipts.claim(
            conn, receipts.StepRef(**ref(a, key, scope)), lease_s=LEASE, now=T0
        )
        assert claimed.outcome is ClaimOutcome.EXECUTE

    await hold(other, "done")
    await receipts.complete(conn, receipts.StepRef(**ref(other, "done", scope)), result="theirs")
    await hold(other, "skipped")
    await receipts.skip(conn, receipts.StepRef(**ref(other, "skipped", scope)))
    await hold(other, "failed")
    await receipts.fail(conn, receipts.StepRef(**ref(other, "failed", scope)), error={"e": "x"})
    await hold(other, "busy")
    await hold(other, "lapsed")
    await hold(mine, "held")

    results = [
        (k, f"v-{k}") for k in ["new", "done", "skipped", "failed", "busy", "lapsed", "held"]
    ]
    # "lapsed" and "busy" were claimed at T0; only the lease of "lapsed" is over at `now`
    # because "busy" is re-claimed by its owner just before.
    later = T0 + timedelta(seconds=LEASE + 1)
    refreshed = await receipts.claim(
        conn, receipts.StepRef(**ref(other, "busy", scope)), lease_s=LEASE, now=later
    )
    assert refreshed.outcome is ClaimOutcome.EXECUTE
    page = await receipts.complete_many(conn, **page_ref(mine, scope), results=results, now=later)
    assert page.completed == ["failed", "held", "lapsed", "new"]
    assert page.already == ["done", "skipped"]
    assert page.busy == ["busy"]
    found = await receipts.lookup_many(
        conn, org=ORG, play=PLAY, scope=scope, keys=[k for k, _ in results]
    )
    assert found == {
        "done": "theirs",
        "failed": "v-failed",
        "held": "v-held",
        "lapsed": "v-lapsed",
        "new": "v-new",
    }
    busy = await receipts.get(conn, org=ORG, play=PLAY, scope=scope, step_key="busy")
    assert busy is not None
    assert (busy.status, busy.owner_run) == (ReceiptStatus.CLAIMED, other.run_id)


async def test_complete_many_is_fenced(conn: Conn) -> None:
    old = await attempts.start(conn)
    scope = Scope.of_run(old.run_id)
    new = await attempts.supersede(conn, old)
    page = [(f"row:{i}", i) for i in range(10)]
    with pytest.raises(StaleAttempt, match=r"cannot complete a page of 10 steps \(first 'row:0'\)"):
        await receipts.complete_many(conn, **page_ref(old), results=page)
    assert (
        await receipts.lookup_many(conn, org=ORG, play=PLAY, scope=scope, keys=[k for k, _ in page])
        == {}
    )
    assert await attempts.refusals(conn, old.run_id) == [(1, "receipt", 10)]
    done = await receipts.complete_many(conn, **page_ref(new), results=page)
    assert done.completed == sorted(k for k, _ in page)
    stored = await receipt(conn, old.run_id, "row:3")
    assert (stored.status, stored.owner_attempt, stored.result) == (ReceiptStatus.COMPLETED, 2, 3)


async def test_pages_are_bounded_and_keys_unique(conn: Conn) -> None:
    a = await attempts.start(conn)
    common = page_ref(a)
    with pytest.raises(InvalidField, match="appears twice"):
        await receipts.complete_many(conn, **common, results=[("a", 1), ("a", 2)])
    too_many = [(f"k{i}", i) for i in range(receipts.MAX_PAGE + 1)]
    with pytest.raises(InvalidField, match="too large"):
        await receipts.complete_many(conn, **common, results=too_many)
    with pytest.raises(InvalidField, match="too large"):
        await receipts.lookup_many(
            conn, org=ORG, play=PLAY, scope=common["scope"], keys=[k for k, _ in too_many]
        )
    empty = await receipts.complete_many(conn, **common, results=[])
    assert empty.completed == [] and empty.already == [] and empty.busy == []
    # Nothing was written by the refused pages.
    assert await versions(conn, common["scope"]) == {}


async def test_record_claims_and_completes_a_step_in_one_statement(conn: Conn) -> None:
    first = await attempts.start(conn)
    run_id = first.run_id
    done = await receipts.record(
        conn, receipts.StepRef(**ref(first, "fetch")), result={"rows": (1, 2)}
    )
    assert (done.outcome, done.result) == (ClaimOutcome.EXECUTE, {"rows": [1, 2]})  # as stored
    row = await receipt(conn, run_id, "fetch")
    assert (row.status, row.owner_attempt, row.result) == (
        ReceiptStatus.COMPLETED,
        1,
        {"rows": [1, 2]},
    )
    # A step that settled meanwhile keeps its recorded result: the record replays it.
    await receipts.claim(conn, receipts.StepRef(**ref(first, "note")), lease_s=LEASE, now=T0)
    await receipts.skip(conn, receipts.StepRef(**ref(first, "note")))
    second = await attempts.supersede(conn, first)
    before = await versions(conn, Scope.of_run(run_id))
    again = await receipts.record(
        conn, receipts.StepRef(**ref(second, "fetch")), result="paid twice"
    )
    assert (again.outcome, again.result) == (ClaimOutcome.REPLAY, {"rows": [1, 2]})
    skipped = await receipts.record(conn, receipts.StepRef(**ref(second, "note")), result="x")
    assert skipped.outcome is ClaimOutcome.SKIPPED
    assert await versions(conn, Scope.of_run(run_id)) == before  # nothing was rewritten


async def test_record_takes_over_a_failed_step_and_its_runs_older_claims(conn: Conn) -> None:
    first = await attempts.start(conn)
    run_id = first.run_id
    await receipts.claim(conn, receipts.StepRef(**ref(first, "pay")), lease_s=LEASE, now=T0)
    await receipts.fail(conn, receipts.StepRef(**ref(first, "pay")), error={"type": "Timeout"})
    await receipts.claim(
        conn, receipts.StepRef(**ref(first, "ship")), lease_s=LEASE, now=T0
    )  # never finished
    second = await attempts.supersede(conn, first)
    for key in ("pay", "ship"):
        done = await receipts.record(conn, receipts.StepRef(**ref(second, key)), result=key)
        assert done.outcome is ClaimOutcome.EXECUTE
        row = await receipt(conn, run_id, key)
        assert (row.status, row.owner_attempt, row.result, row.error) == (
            ReceiptStatus.COMPLETED,
            2,
            key,
            None,
        )


async def test_record_is_fenced_and_a_zombies_record_writes_nothing(conn: Conn) -> None:
    old = await attempts.start(conn)
    run_id = old.run_id
    new = await attempts.supersede(conn, old)
    with pytest.raises(StaleAttempt, match="cannot complete step 'charge'"):
        await receipts.record(conn, receipts.StepRef(**ref(old, "charge")), result="old")
    assert (
        await receipts.get(conn, org=ORG, play=PLAY, scope=Scope.of_run(run_id), step_key="charge")
        is None
    )
    await receipts.record(conn, receipts.StepRef(**ref(new, "charge")), result="new")
    with pytest.raises(StaleAttempt):
        await receipts.record(conn, receipts.StepRef(**ref(old, "charge")), result="old")
    row = await receipt(conn, run_id, "charge")
    assert (row.owner_attempt, row.result) == (2, "new")
    assert await attempts.refusals(conn, run_id) == [(1, "receipt", 1)] * 2


async def test_record_leaves_another_runs_live_claim_alone(conn: Conn) -> None:
    shared = Scope.named("shared")
    holder = await attempts.start(conn)
    other = await attempts.start(conn)
    await receipts.claim(conn, receipts.StepRef(**ref(holder, "quote", shared)), lease_s=LEASE)
    busy = await receipts.record(
        conn, receipts.StepRef(**ref(other, "quote", shared)), result="mine"
    )
    assert busy.outcome is ClaimOutcome.BUSY
    row = await receipt(conn, holder.run_id, "quote", shared)
    assert (row.status, row.owner_run) == (ReceiptStatus.CLAIMED, holder.run_id)


async def test_settled_lists_completed_and_skipped_steps_up_to_a_limit(conn: Conn) -> None:
    a = await attempts.start(conn)
    scope = Scope.of_run(a.run_id)
    where = {"org": ORG, "play": PLAY, "scope": scope}
    assert await receipts.settled(conn, **where) == receipts.Settled({}, complete=True)
    await receipts.record(conn, receipts.StepRef(**ref(a, "done")), result=[1])
    await receipts.claim(conn, receipts.StepRef(**ref(a, "skip")), lease_s=LEASE, now=T0)
    await receipts.skip(conn, receipts.StepRef(**ref(a, "skip")))
    await receipts.claim(conn, receipts.StepRef(**ref(a, "held")), lease_s=LEASE, now=T0)
    await receipts.claim(conn, receipts.StepRef(**ref(a, "broke")), lease_s=LEASE, now=T0)
    await receipts.fail(conn, receipts.StepRef(**ref(a, "broke")), error={"type": "E"})
    found = await receipts.settled(conn, **where)
    assert found == receipts.Settled(
        {"done": (ReceiptStatus.COMPLETED, [1]), "skip": (ReceiptStatus.SKIPPED, None)},
        complete=True,
    )
    assert await receipts.settled(conn, **where, limit=2) == found
    assert await receipts.settled(conn, **where, limit=1) == receipts.Settled({}, complete=False)
    # Results past the byte budget are not loaded at once: the attempt claims step by step.
    big = [uuid.uuid4().hex for _ in range(200)]  # about 7 KB that do not compress
    await receipts.record(conn, receipts.StepRef(**ref(a, "big")), result=big)
    assert (await receipts.settled(conn, **where)).receipts["big"] == (ReceiptStatus.COMPLETED, big)
    assert await receipts.settled(conn, **where, max_bytes=3000) == receipts.Settled(
        {}, complete=False
    )
