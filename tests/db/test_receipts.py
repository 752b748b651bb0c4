"""Work receipts against real Postgres, each test in one rolled-back transaction."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from queues import receipts
from queues.errors import InvalidField, RunNotFound, StaleAttempt
from queues.receipts import ClaimOutcome, ReceiptStatus, Scope

Conn = psycopg.AsyncConnection[Any]
T0 = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = 30.0


async def make_run(
    conn: Conn, *, org: str = "org", play: str = "play", attempt: int = 1, state: str = "running"
) -> uuid.UUID:
    run_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO wq_lanes (name, release) VALUES ('r-test', 'test') ON CONFLICT DO NOTHING"
    )
    await conn.execute(
        "INSERT INTO wq_runs (id, org, play, release, lane, state, attempt, lease_owner,"
        " lease_expires_at) VALUES (%(id)s, %(org)s, %(play)s, 'test', 'r-test', %(state)s,"
        " %(attempt)s, 'w1', now() + interval '30 seconds')",
        {"id": run_id, "org": org, "play": play, "state": state, "attempt": attempt},
    )
    return run_id


async def bump(conn: Conn, run_id: uuid.UUID) -> int:
    """What a lease rescue does to the fence: the run moves on to a new attempt."""
    cur = await conn.execute(
        "UPDATE wq_runs SET attempt = attempt + 1 WHERE id = %(id)s RETURNING attempt",
        {"id": run_id},
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def versions(conn: Conn, scope: Scope) -> dict[str, str]:
    """The physical row version of each receipt in a scope: a write of any kind changes it."""
    cur = await conn.execute(
        "SELECT step_key, ctid::text FROM wq_receipts WHERE scope = %(scope)s",
        {"scope": scope.key},
    )
    return {key: ctid for key, ctid in await cur.fetchall()}


def ref(
    run_id: uuid.UUID, attempt: int, key: str, scope: Scope | None = None, play: str = "play"
) -> dict[str, Any]:
    return {
        "org": "org",
        "play": play,
        "scope": scope or Scope.of_run(run_id),
        "step_key": key,
        "run_id": run_id,
        "attempt": attempt,
    }


async def receipt(conn: Conn, run_id: uuid.UUID, key: str, scope: Scope | None = None) -> Any:
    found = await receipts.get(
        conn, org="org", play="play", scope=scope or Scope.of_run(run_id), step_key=key
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
    run_id = await make_run(conn)
    first = await receipts.claim(conn, **ref(run_id, 1, "fetch"), lease_s=LEASE, now=T0)
    assert first.outcome is ClaimOutcome.EXECUTE
    assert first.lease_expires_at == T0 + timedelta(seconds=LEASE)
    assert (first.owner_run, first.owner_attempt) == (run_id, 1)

    stored = await receipts.complete(
        conn, **ref(run_id, 1, "fetch"), result={"rows": (1, 2), "ok": True}
    )
    assert stored == {"rows": [1, 2], "ok": True}  # what a replay will see

    assert await bump(conn, run_id) == 2
    before = await versions(conn, Scope.of_run(run_id))
    again = await receipts.claim(conn, **ref(run_id, 2, "fetch"), lease_s=LEASE, now=T0)
    assert again.outcome is ClaimOutcome.REPLAY
    assert await versions(conn, Scope.of_run(run_id)) == before  # a replay writes nothing
    assert again.result == {"rows": [1, 2], "ok": True}
    row = await receipt(conn, run_id, "fetch")
    assert row.status is ReceiptStatus.COMPLETED
    assert row.owner_attempt == 1  # the replay took nothing over
    assert row.completed_at is not None


async def test_same_attempt_reclaiming_its_own_step_executes(conn: Conn) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "s"), lease_s=LEASE, now=T0)
    later = T0 + timedelta(seconds=5)
    again = await receipts.claim(conn, **ref(run_id, 1, "s"), lease_s=LEASE, now=later)
    assert again.outcome is ClaimOutcome.EXECUTE
    assert again.lease_expires_at == later + timedelta(seconds=LEASE)


async def test_failed_step_is_claimed_again_by_a_later_attempt(conn: Conn) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "pay"), lease_s=LEASE, now=T0)
    await receipts.fail(conn, **ref(run_id, 1, "pay"), error={"type": "Timeout", "msg": "slow"})
    failed = await receipt(conn, run_id, "pay")
    assert failed.status is ReceiptStatus.FAILED
    assert failed.error == {"type": "Timeout", "msg": "slow"}
    assert failed.lease_expires_at is None

    await bump(conn, run_id)
    second = await receipts.claim(conn, **ref(run_id, 2, "pay"), lease_s=LEASE, now=T0)
    assert second.outcome is ClaimOutcome.EXECUTE
    claimed = await receipt(conn, run_id, "pay")
    assert (claimed.status, claimed.owner_attempt, claimed.error) == (
        ReceiptStatus.CLAIMED,
        2,
        None,
    )
    await receipts.complete(conn, **ref(run_id, 2, "pay"), result="paid")
    assert (await receipt(conn, run_id, "pay")).result == "paid"


async def test_skipped_step_replays_as_skipped(conn: Conn) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "notify"), lease_s=LEASE, now=T0)
    await receipts.skip(conn, **ref(run_id, 1, "notify"))
    await bump(conn, run_id)
    again = await receipts.claim(conn, **ref(run_id, 2, "notify"), lease_s=LEASE, now=T0)
    assert again.outcome is ClaimOutcome.SKIPPED
    assert (await receipt(conn, run_id, "notify")).status is ReceiptStatus.SKIPPED


async def test_live_claim_is_busy_until_its_lease_lapses_then_taken_over(conn: Conn) -> None:
    scope = Scope.named("shared")
    run_a = await make_run(conn)
    run_b = await make_run(conn)
    held = await receipts.claim(conn, **ref(run_a, 1, "s", scope), lease_s=LEASE, now=T0)
    assert held.outcome is ClaimOutcome.EXECUTE

    early = T0 + timedelta(seconds=LEASE - 1)
    busy = await receipts.claim(conn, **ref(run_b, 1, "s", scope), lease_s=LEASE, now=early)
    assert busy.outcome is ClaimOutcome.BUSY
    assert busy.lease_expires_at == T0 + timedelta(seconds=LEASE)
    assert (busy.owner_run, busy.owner_attempt) == (run_a, 1)

    late = T0 + timedelta(seconds=LEASE)
    taken = await receipts.claim(conn, **ref(run_b, 1, "s", scope), lease_s=LEASE, now=late)
    assert taken.outcome is ClaimOutcome.EXECUTE
    assert taken.owner_run == run_b

    # The lapsed holder's late write is refused; the new owner's stands.
    with pytest.raises(StaleAttempt, match=f"run {run_a} attempt 1 cannot complete step 's'"):
        await receipts.complete(conn, **ref(run_a, 1, "s", scope), result="a")
    await receipts.complete(conn, **ref(run_b, 1, "s", scope), result="b")
    row = await receipt(conn, run_a, "s", scope)
    assert (row.status, row.owner_run, row.result) == (ReceiptStatus.COMPLETED, run_b, "b")


async def test_extend_leases_keeps_a_long_step_claimed(conn: Conn) -> None:
    scope = Scope.named("shared")
    run_a = await make_run(conn)
    run_b = await make_run(conn)
    await receipts.claim(conn, **ref(run_a, 1, "s", scope), lease_s=LEASE, now=T0)
    await receipts.claim(conn, **ref(run_a, 1, "t", scope), lease_s=LEASE, now=T0)
    beat = T0 + timedelta(seconds=20)
    assert await receipts.extend_leases(conn, run_id=run_a, attempt=1, lease_s=LEASE, now=beat) == 2
    after_first_lease = T0 + timedelta(seconds=LEASE + 5)
    busy = await receipts.claim(
        conn, **ref(run_b, 1, "s", scope), lease_s=LEASE, now=after_first_lease
    )
    assert busy.outcome is ClaimOutcome.BUSY
    assert busy.lease_expires_at == beat + timedelta(seconds=LEASE)

    await bump(conn, run_a)
    with pytest.raises(StaleAttempt, match="now at attempt 2"):
        await receipts.extend_leases(conn, run_id=run_a, attempt=1, lease_s=LEASE, now=beat)


async def test_heartbeat_extends_the_step_leases_of_many_attempts_in_one_call(
    conn: Conn,
) -> None:
    scope = Scope.named("shared")
    run_a, run_b, run_c = [await make_run(conn) for _ in range(3)]
    for run_id, key in ((run_a, "a"), (run_b, "b"), (run_c, "c")):
        await receipts.claim(conn, **ref(run_id, 1, key, scope), lease_s=LEASE, now=T0)
    beat = T0 + timedelta(seconds=20)
    # run_c's attempt is not among the renewed leases: its step lease is left to lapse.
    await receipts.extend_for_attempts(
        conn, leases=[(run_a, 1), (run_b, 1)], lease_s=LEASE, now=beat
    )
    leases = {
        key: (await receipt(conn, run_id, key, scope)).lease_expires_at
        for run_id, key in ((run_a, "a"), (run_b, "b"), (run_c, "c"))
    }
    assert leases["a"] == leases["b"] == beat + timedelta(seconds=LEASE)
    assert leases["c"] == T0 + timedelta(seconds=LEASE)


# ---- fences ----------------------------------------------------------------------------


async def test_stale_attempt_cannot_claim_or_complete_and_the_newer_write_stands(
    conn: Conn,
) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "charge"), lease_s=LEASE, now=T0)
    await bump(conn, run_id)

    with pytest.raises(StaleAttempt) as info:
        await receipts.complete(conn, **ref(run_id, 1, "charge"), result="old")
    message = str(info.value)
    assert str(run_id) in message and "attempt 1" in message and "'charge'" in message
    assert "now at attempt 2" in message
    with pytest.raises(StaleAttempt, match="cannot claim step 'other'"):
        await receipts.claim(conn, **ref(run_id, 1, "other"), lease_s=LEASE, now=T0)
    assert (
        await receipts.get(
            conn, org="org", play="play", scope=Scope.of_run(run_id), step_key="other"
        )
        is None
    )

    # The new attempt takes over its run's older claim (live lease or not) and completes.
    taken = await receipts.claim(conn, **ref(run_id, 2, "charge"), lease_s=LEASE, now=T0)
    assert taken.outcome is ClaimOutcome.EXECUTE
    await receipts.complete(conn, **ref(run_id, 2, "charge"), result="new")
    with pytest.raises(StaleAttempt):
        await receipts.complete(conn, **ref(run_id, 1, "charge"), result="old")
    with pytest.raises(StaleAttempt):
        await receipts.fail(conn, **ref(run_id, 1, "charge"), error={"e": 1})
    row = await receipt(conn, run_id, "charge")
    assert (row.status, row.owner_attempt, row.result) == (ReceiptStatus.COMPLETED, 2, "new")


async def test_writes_need_a_running_run_and_a_held_claim(conn: Conn) -> None:
    done = await make_run(conn, state="succeeded")
    with pytest.raises(StaleAttempt, match=r"attempt 1 \(succeeded\)"):
        await receipts.claim(conn, **ref(done, 1, "s"), lease_s=LEASE, now=T0)
    with pytest.raises(RunNotFound):
        await receipts.claim(conn, **ref(uuid.uuid4(), 1, "s"), lease_s=LEASE, now=T0)
    run_id = await make_run(conn)
    with pytest.raises(StaleAttempt, match="holds no receipt"):
        await receipts.complete(conn, **ref(run_id, 1, "never-claimed"), result=1)
    await receipts.claim(conn, **ref(run_id, 1, "once"), lease_s=LEASE, now=T0)
    await receipts.complete(conn, **ref(run_id, 1, "once"), result=1)
    with pytest.raises(StaleAttempt, match="is completed by run"):
        await receipts.complete(conn, **ref(run_id, 1, "once"), result=2)
    assert (await receipt(conn, run_id, "once")).result == 1


@pytest.mark.parametrize("bad", [object(), float("nan"), {"k": {1, 2}}, "nul\x00"])
async def test_unserialisable_result_is_refused_naming_the_step(conn: Conn, bad: object) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "render#2"), lease_s=LEASE, now=T0)
    with pytest.raises(InvalidField, match="step 'render#2'") as info:
        await receipts.complete(conn, **ref(run_id, 1, "render#2"), result=bad)  # type: ignore[arg-type]
    assert info.value.field == "result"
    assert (await receipt(conn, run_id, "render#2")).status is ReceiptStatus.CLAIMED


async def test_backslash_u0000_text_is_a_valid_result(conn: Conn) -> None:
    run_id = await make_run(conn)
    await receipts.claim(conn, **ref(run_id, 1, "s"), lease_s=LEASE, now=T0)
    await receipts.complete(conn, **ref(run_id, 1, "s"), result="C:\\u0000")
    assert (await receipt(conn, run_id, "s")).result == "C:\\u0000"


# ---- scopes ----------------------------------------------------------------------------


async def test_wider_scope_lets_a_rerun_replay_paid_results(conn: Conn) -> None:
    scope = Scope.named("enrich-v1")
    first = await make_run(conn)
    await receipts.claim(conn, **ref(first, 1, "lookup", scope), lease_s=LEASE, now=T0)
    await receipts.complete(conn, **ref(first, 1, "lookup", scope), result={"paid": 42})

    rerun = await make_run(conn)
    replay = await receipts.claim(conn, **ref(rerun, 1, "lookup", scope), lease_s=LEASE, now=T0)
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.result == {"paid": 42}

    # The default scope is the run: the rerun's own scope has not paid for it.
    own = await receipts.claim(conn, **ref(rerun, 1, "lookup"), lease_s=LEASE, now=T0)
    assert own.outcome is ClaimOutcome.EXECUTE
    # A scope is shared within one org and play only.
    other_play = await make_run(conn, play="other")
    elsewhere = await receipts.claim(
        conn, **ref(other_play, 1, "lookup", scope, play="other"), lease_s=LEASE, now=T0
    )
    assert elsewhere.outcome is ClaimOutcome.EXECUTE


# ---- pages -----------------------------------------------------------------------------


async def test_complete_many_records_a_page_in_one_call_and_a_recall_keeps_it(
    conn: Conn,
) -> None:
    run_id = await make_run(conn)
    scope = Scope.of_run(run_id)
    page = [(f"row:{i:04d}", {"i": i}) for i in range(500)]
    keys = [key for key, _ in page]

    done = await receipts.complete_many(
        conn, org="org", play="play", scope=scope, run_id=run_id, attempt=1, results=page
    )
    assert done.completed == keys
    assert done.already == [] and done.busy == []

    before = await versions(conn, scope)
    assert len(before) == 500
    again = await receipts.complete_many(
        conn,
        org="org",
        play="play",
        scope=scope,
        run_id=run_id,
        attempt=1,
        results=[(key, "overwritten?") for key in keys],
    )
    assert again.completed == [] and again.busy == []
    assert again.already == keys
    assert await versions(conn, scope) == before  # settled rows are not rewritten

    found = await receipts.lookup_many(
        conn, org="org", play="play", scope=scope, keys=[*keys, "row:missing"]
    )
    assert found == {key: value for key, value in page}  # first results stand


async def test_complete_many_sorts_keys_by_their_receipt_state(conn: Conn) -> None:
    scope = Scope.named("rows")
    mine = await make_run(conn)
    other = await make_run(conn)

    async def hold(run_id: uuid.UUID, key: str) -> None:
        claimed = await receipts.claim(conn, **ref(run_id, 1, key, scope), lease_s=LEASE, now=T0)
        assert claimed.outcome is ClaimOutcome.EXECUTE

    await hold(other, "done")
    await receipts.complete(conn, **ref(other, 1, "done", scope), result="theirs")
    await hold(other, "skipped")
    await receipts.skip(conn, **ref(other, 1, "skipped", scope))
    await hold(other, "failed")
    await receipts.fail(conn, **ref(other, 1, "failed", scope), error={"e": "x"})
    await hold(other, "busy")
    await hold(other, "lapsed")
    await hold(mine, "held")

    results = [
        (k, f"v-{k}") for k in ["new", "done", "skipped", "failed", "busy", "lapsed", "held"]
    ]
    # "lapsed" and "busy" were claimed at T0; only the lease of "lapsed" is over at `now`
    # because "busy" is re-claimed by its owner just before.
    later = T0 + timedelta(seconds=LEASE + 1)
    refreshed = await receipts.claim(conn, **ref(other, 1, "busy", scope), lease_s=LEASE, now=later)
    assert refreshed.outcome is ClaimOutcome.EXECUTE
    page = await receipts.complete_many(
        conn,
        org="org",
        play="play",
        scope=scope,
        run_id=mine,
        attempt=1,
        results=results,
        now=later,
    )
    assert page.completed == ["failed", "held", "lapsed", "new"]
    assert page.already == ["done", "skipped"]
    assert page.busy == ["busy"]
    found = await receipts.lookup_many(
        conn, org="org", play="play", scope=scope, keys=[k for k, _ in results]
    )
    assert found == {
        "done": "theirs",
        "failed": "v-failed",
        "held": "v-held",
        "lapsed": "v-lapsed",
        "new": "v-new",
    }
    busy = await receipts.get(conn, org="org", play="play", scope=scope, step_key="busy")
    assert busy is not None and (busy.status, busy.owner_run) == (ReceiptStatus.CLAIMED, other)


async def test_complete_many_is_fenced(conn: Conn) -> None:
    run_id = await make_run(conn)
    scope = Scope.of_run(run_id)
    await bump(conn, run_id)
    page = [(f"row:{i}", i) for i in range(10)]
    with pytest.raises(StaleAttempt, match=r"cannot complete a page of 10 steps \(first 'row:0'\)"):
        await receipts.complete_many(
            conn, org="org", play="play", scope=scope, run_id=run_id, attempt=1, results=page
        )
    assert (
        await receipts.lookup_many(
            conn, org="org", play="play", scope=scope, keys=[k for k, _ in page]
        )
        == {}
    )
    done = await receipts.complete_many(
        conn, org="org", play="play", scope=scope, run_id=run_id, attempt=2, results=page
    )
    assert len(done.completed) == 10


async def test_pages_are_bounded_and_keys_unique(conn: Conn) -> None:
    run_id = await make_run(conn)
    scope = Scope.of_run(run_id)
    common: dict[str, Any] = {
        "org": "org",
        "play": "play",
        "scope": scope,
        "run_id": run_id,
        "attempt": 1,
    }
    with pytest.raises(InvalidField, match="appears twice"):
        await receipts.complete_many(conn, **common, results=[("a", 1), ("a", 2)])
    too_many = [(f"k{i}", i) for i in range(receipts.MAX_PAGE + 1)]
    with pytest.raises(InvalidField, match="too large"):
        await receipts.complete_many(conn, **common, results=too_many)
    with pytest.raises(InvalidField, match="too large"):
        await receipts.lookup_many(
            conn, org="org", play="play", scope=scope, keys=[k for k, _ in too_many]
        )
    empty = await receipts.complete_many(conn, **common, results=[])
    assert empty.completed == [] and empty.already == [] and empty.busy == []
