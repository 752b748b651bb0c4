"""Each predicate of the attempt fence, alone, in every statement that writes.

``test_fence.py`` makes a stale attempt the way production does, which changes several
things at once (a rescue and another worker's claim change the attempt *and* the lease
owner). Here each scenario changes exactly one thing, so a statement that lost any one of
its predicates lets that scenario's write through and the test fails:

- ``attempt``: the same worker reclaims the run after a rescue (attempt 2, same owner) and
  its attempt 1 writes: only the attempt number is stale;
- ``owner``: an impostor sends the live attempt's number as another worker: only the lease
  owner differs;
- ``org``: the live attempt writes into another org's scope (for receipts, also another
  play's): only the scope differs.

A state-only scenario cannot exist: the database requires a lease owner exactly while a run
is running (``wq_runs_lease_iff_running``), so the owner check implies the state check, as
``test_a_lease_owner_outside_running_is_refused_by_the_database`` shows.

Every refusal must also be logged in ``wq_refusals`` with its kind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import outcomes, receipts, runs, sheets
from queues.errors import RunNotFound, SheetSuperseded, StaleAttempt
from queues.fence import Fence
from queues.outcomes import FinishStatus
from queues.queries import q
from queues.receipts import ClaimOutcome, Scope
from tests import attempts
from tests.attempts import ORG, PLAY, Attempt

Conn = psycopg.AsyncConnection[Any]
LEASE = 30.0
REFUSED = (StaleAttempt, SheetSuperseded, RunNotFound)


@dataclass(frozen=True)
class Writer:
    """Who writes: the fence, and the org and play it writes as."""

    fence: Fence
    org: str = ORG
    play: str = PLAY


@dataclass
class Scene:
    live: Attempt  # the run's live attempt
    writer: Writer  # the stale or foreign writer
    kind: str  # the refusal kind the write must log


async def stale_attempt(conn: Conn) -> tuple[Attempt, Fence]:
    """Attempt 1 of w1, rescued; w1 itself claims the run again as attempt 2."""
    old = await attempts.start(conn, worker="w1")
    new = await attempts.supersede(conn, old, worker="w1")
    assert (new.fence.owner, new.fence.attempt) == ("w1", 2)
    return new, old.fence


# ---- the write paths: each prepares what it needs with the live attempt, then writes as
# the writer; it returns normally only if the write was (wrongly) applied ---------------------


async def receipt_claim(conn: Conn, live: Attempt, w: Writer) -> None:
    await receipts.claim(conn, receipts.StepRef(**_ref(live, w, "k")), lease_s=LEASE)


async def _claimed_by_live(conn: Conn, live: Attempt) -> None:
    got = await receipts.claim(
        conn, receipts.StepRef(**_ref(live, Writer(live.fence), "k")), lease_s=LEASE
    )
    assert got.outcome is ClaimOutcome.EXECUTE


async def receipt_complete(conn: Conn, live: Attempt, w: Writer) -> None:
    await _claimed_by_live(conn, live)
    await receipts.complete(conn, receipts.StepRef(**_ref(live, w, "k")), result=1)


async def receipt_fail(conn: Conn, live: Attempt, w: Writer) -> None:
    await _claimed_by_live(conn, live)
    await receipts.fail(conn, receipts.StepRef(**_ref(live, w, "k")), error={"type": "X"})


async def receipt_skip(conn: Conn, live: Attempt, w: Writer) -> None:
    await _claimed_by_live(conn, live)
    await receipts.skip(conn, receipts.StepRef(**_ref(live, w, "k")))


async def receipts_complete_many(conn: Conn, live: Attempt, w: Writer) -> None:
    await receipts.complete_many(
        conn,
        org=w.org,
        play=w.play,
        scope=Scope.of_run(live.run_id),
        fence=w.fence,
        results=[("a", 1)],
    )


async def receipts_extend(conn: Conn, live: Attempt, w: Writer) -> None:
    await receipts.extend_leases(conn, fence=w.fence, lease_s=3600)


async def sheet_legacy(conn: Conn, live: Attempt, w: Writer) -> None:
    await sheets.admit_page(conn, org=w.org, sheet="s", fence=w.fence, rows=[("a", {})])


async def sheet_intent(conn: Conn, live: Attempt, w: Writer) -> None:
    await sheets.admit_page(
        conn, org=w.org, sheet="s", fence=w.fence, rows=[("a", {})], stable_intent=True
    )


async def sheet_rows_direct(conn: Conn, live: Attempt, w: Writer) -> None:
    """The row statement's own fence, without the version statement before it (which holds
    the fence in an admission's transaction): it must refuse on its own."""
    cur = await conn.execute(
        q("sheet_admit_rows"),
        {
            "org": w.org,
            "sheet": "s",
            "write_version": 1,
            "keys": ["a"],
            "inputs": [Jsonb({})],
            "readmit_pending": True,
            **w.fence.params(),
        },
    )
    fenced, key, _inserted = (await cur.fetchall())[0]
    if not fenced:
        assert key is None  # and nothing was written
        raise StaleAttempt("refused by sheet_admit_rows", fix="-")


async def sheet_complete(conn: Conn, live: Attempt, w: Writer) -> None:
    admitted = await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=live.fence, rows=[("a", {})], stable_intent=True
    )
    await sheets.complete_rows(
        conn,
        org=w.org,
        sheet="s",
        fence=w.fence,
        write_version=admitted.write_version,
        completions=[sheets.RowCompletion("a", {"by": "writer"})],
    )


async def emit(conn: Conn, live: Attempt, w: Writer) -> None:
    await runs.emit(conn, org=w.org, name="e", payload=1, fence=w.fence)


async def finish(conn: Conn, live: Attempt, w: Writer) -> None:
    final = outcomes.succeeded(w.fence.run_id, w.fence.attempt, {"by": "writer"})
    statuses = await runs.finish(conn, worker_id=w.fence.owner, finishes=[final])
    if statuses[(final.run_id, final.attempt)] is FinishStatus.REFUSED:
        raise StaleAttempt("refused by run_finish_batch", fix="-")


async def ledger_delivery(
    conn: Conn, live: Attempt, w: Writer, *, delivery_owner: str | None = None
) -> tuple[bool, bool, int]:
    """A keyed ledger delivery (the run-ledger token's actions go through this statement),
    naming the writer's own lease unless ``delivery_owner`` says otherwise: (fenced,
    delivering, appended)."""
    cur = await conn.execute(
        q("ledger_append_delivered"),
        {
            "kinds": ["play.x"],
            "datas": [Jsonb({})],
            "keys": ["k#0"],
            "delivery_owner": w.fence.owner if delivery_owner is None else delivery_owner,
            **w.fence.params(count=1),
        },
    )
    row = await cur.fetchone()
    assert row is not None
    fenced, delivering, appended, _attempt, _state = row
    if not fenced:
        assert appended == 0
        raise StaleAttempt("refused by ledger_append_delivered", fix="-")
    return bool(fenced), bool(delivering), int(appended)


def _ref(live: Attempt, w: Writer, key: str) -> dict[str, Any]:
    return {
        "org": w.org,
        "play": w.play,
        "scope": Scope.of_run(live.run_id),
        "step_key": key,
        "fence": w.fence,
    }


Write = Callable[[Conn, Attempt, Writer], Awaitable[None]]
WRITES: dict[str, tuple[Write, str]] = {
    "receipt_claim": (receipt_claim, "receipt"),
    "receipt_complete": (receipt_complete, "receipt"),
    "receipt_fail": (receipt_fail, "receipt"),
    "receipt_skip": (receipt_skip, "receipt"),
    "receipt_complete_many": (receipts_complete_many, "receipt"),
    "receipt_extend_leases": (receipts_extend, "receipt"),
    "sheet_version_mint": (sheet_legacy, "admission"),
    "sheet_intent_claim": (sheet_intent, "admission"),
    "sheet_admit_rows": (sheet_rows_direct, "admission"),
    "sheet_complete_rows": (sheet_complete, "rows"),
    "event_emit": (emit, "emit"),
    "run_finish_batch": (finish, "final"),
    "ledger_append_delivered": (ledger_delivery, "ledger"),
}
# Which writes carry an org (and a play) of their own to check.
ORG_CHECKED = {
    "receipt_claim",
    "receipt_complete",
    "receipt_fail",
    "receipt_skip",
    "receipt_complete_many",
    "sheet_version_mint",
    "sheet_intent_claim",
    "sheet_admit_rows",
    "sheet_complete_rows",
    "event_emit",
}
PLAY_CHECKED = {
    "receipt_claim",
    "receipt_complete",
    "receipt_fail",
    "receipt_skip",
    "receipt_complete_many",
}


async def scene(conn: Conn, predicate: str) -> tuple[Attempt, Writer]:
    if predicate == "attempt":
        live, stale = await stale_attempt(conn)
        return live, Writer(stale)
    live = await attempts.start(conn, worker="w1")
    if predicate == "owner":
        return live, Writer(replace(live.fence, owner="w-impostor"))
    if predicate == "org":
        return live, Writer(live.fence, org="other-org")
    assert predicate == "play"
    return live, Writer(live.fence, play="other-play")


CASES = [
    pytest.param(name, predicate, id=f"{name}-{predicate}")
    for name in WRITES
    for predicate in ("attempt", "owner", "org", "play")
    if (predicate != "org" or name in ORG_CHECKED)
    and (predicate != "play" or name in PLAY_CHECKED)
    and not (name == "run_finish_batch" and predicate == "owner")  # see the next test
    and not (name == "receipt_extend_leases" and predicate in ("org", "play"))
]


@pytest.mark.parametrize(("name", "predicate"), CASES)
async def test_one_stale_predicate_refuses_the_write(conn: Conn, name: str, predicate: str) -> None:
    write, kind = WRITES[name]
    live, writer = await scene(conn, predicate)
    before = await attempts.refusals(conn, live.run_id)
    with pytest.raises(REFUSED):
        await write(conn, live, writer)
    after = await attempts.refusals(conn, live.run_id)
    logged = after[len(before) :]
    assert [k for _, k, _ in logged] == [kind], logged
    row = await attempts.run_row(conn, live.run_id)
    assert (row["state"], row["attempt"], row["lease_owner"]) == (
        "running",
        live.fence.attempt,
        live.fence.owner,
    )


async def test_a_live_attempts_delivery_naming_another_lease_is_refused_by_its_statement(
    conn: Conn,
) -> None:
    """The fence holds (the live attempt, its own worker), and only the delivery lease the
    request names differs: the statement compares it with the run's lease owner itself,
    appends nothing, and logs no stale write (the attempt is not stale)."""
    live = await attempts.start(conn, worker="w1")
    writer = Writer(live.fence)
    assert await ledger_delivery(conn, live, writer, delivery_owner="w-other") == (
        True,
        False,
        0,
    )
    cur = await conn.execute("SELECT count(*) FROM wq_events WHERE run_id = %s", (live.run_id,))
    assert await cur.fetchone() == (0,)
    assert await attempts.refusals(conn, live.run_id) == []
    assert await ledger_delivery(conn, live, writer) == (True, True, 1)


async def test_an_impostors_final_write_is_refused_and_leaves_the_live_attempt_open(
    conn: Conn,
) -> None:
    live = await attempts.start(conn, worker="w1")
    with pytest.raises(StaleAttempt):
        await finish(conn, live, Writer(replace(live.fence, owner="w-impostor")))
    cur = await conn.execute(
        "SELECT outcome::text FROM wq_attempts WHERE run_id = %s", (live.run_id,)
    )
    assert await cur.fetchall() == [("running",)]  # not marked superseded by the impostor
    assert [k for _, k, _ in await attempts.refusals(conn, live.run_id)] == ["final"]


@pytest.mark.parametrize("predicate", ["attempt", "owner"])
async def test_the_heartbeat_and_its_step_leases_renew_only_the_live_attempt(
    conn: Conn, predicate: str
) -> None:
    live, writer = await scene(conn, predicate)
    await _claimed_by_live(conn, live)
    before = await receipts.get(
        conn, org=ORG, play=PLAY, scope=Scope.of_run(live.run_id), step_key="k"
    )
    renewed = await runs.heartbeat(
        conn,
        worker_id=writer.fence.owner,
        leases=[(live.run_id, writer.fence.attempt)],
        now=live.now + timedelta(seconds=5),
    )
    assert renewed == []
    await receipts.extend_for_attempts(
        conn,
        owner=writer.fence.owner,
        leases=[(live.run_id, writer.fence.attempt)],
        lease_s=3600,
    )
    after = await receipts.get(
        conn, org=ORG, play=PLAY, scope=Scope.of_run(live.run_id), step_key="k"
    )
    assert before is not None and after is not None
    assert after.lease_expires_at == before.lease_expires_at
    # The live attempt itself renews.
    assert await runs.heartbeat(
        conn, worker_id=live.fence.owner, leases=[(live.run_id, live.fence.attempt)]
    )


async def test_a_stale_attempts_own_step_lease_is_not_renewed_by_its_worker(conn: Conn) -> None:
    """Attempt 1 of w1 holds a step; w1 reclaims the run as attempt 2. A heartbeat that
    still lists attempt 1 (its loop had not caught up) must not keep attempt 1's step
    locked against attempt 2: only the attempt number differs."""
    old = await attempts.start(conn, worker="w1")
    got = await receipts.claim(
        conn, receipts.StepRef(**_ref(old, Writer(old.fence), "old")), lease_s=LEASE
    )
    assert got.outcome is ClaimOutcome.EXECUTE
    live = await attempts.supersede(conn, old, worker="w1")
    assert (live.fence.owner, live.fence.attempt) == ("w1", 2)
    key = {"org": ORG, "play": PLAY, "scope": Scope.of_run(live.run_id), "step_key": "old"}
    before = await receipts.get(conn, **key)
    await receipts.extend_for_attempts(
        conn, owner="w1", leases=[(live.run_id, old.fence.attempt)], lease_s=3600
    )
    after = await receipts.get(conn, **key)
    assert before is not None and after is not None
    assert (after.owner_attempt, after.lease_expires_at) == (1, before.lease_expires_at)


async def test_a_lease_owner_outside_running_is_refused_by_the_database(conn: Conn) -> None:
    live = await attempts.start(conn)
    with pytest.raises(psycopg.errors.CheckViolation, match="wq_runs_lease_iff_running"):
        async with conn.transaction():
            await conn.execute("UPDATE wq_runs SET state = 'queued' WHERE id = %s", (live.run_id,))
    with pytest.raises(psycopg.errors.CheckViolation):
        async with conn.transaction():
            await conn.execute(
                "UPDATE wq_runs SET lease_owner = NULL WHERE id = %s", (live.run_id,)
            )


async def test_another_orgs_rows_cannot_be_completed_with_their_version(conn: Conn) -> None:
    theirs = await attempts.start(conn, org="globex")
    admitted = await sheets.admit_page(
        conn, org="globex", sheet="s", fence=theirs.fence, rows=[("a", {})], stable_intent=True
    )
    ours = await attempts.start(conn, org="acme")
    with pytest.raises(REFUSED):
        await sheets.complete_rows(
            conn,
            org="globex",
            sheet="s",
            fence=ours.fence,
            write_version=admitted.write_version,
            completions=[sheets.RowCompletion("a", {"stolen": True})],
        )
    cur = await conn.execute(
        "SELECT status::text, output FROM wq_sheet_rows WHERE org = 'globex' AND row_key = 'a'"
    )
    assert await cur.fetchone() == ("pending", None)


async def test_an_unversioned_writer_cannot_complete_another_runs_rows(conn: Conn) -> None:
    other = await attempts.start(conn)
    await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=other.fence, rows=[("a", {})], stable_intent=True
    )
    mine = await attempts.start(conn)
    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=mine.fence,
        write_version=None,
        completions=[sheets.RowCompletion("a", {"mine": True})],
    )
    assert result.committed == ()
    assert [(s.key, s.reason) for s in result.stale] == [
        ("a", sheets.StaleReason.NEWER_WRITE_VERSION)
    ]
    cur = await conn.execute("SELECT status::text FROM wq_sheet_rows WHERE row_key = 'a'")
    assert await cur.fetchone() == ("pending",)


@pytest.mark.parametrize("other_state", ["running", "cancelled"])
async def test_a_versioned_writer_cannot_complete_another_runs_rows(
    conn: Conn, other_state: str
) -> None:
    """Versions are a sequence, easy to name: sending another run's version must not let a
    live attempt complete that run's rows (found by the model test, tests/integration/
    test_fence_model.py), whether that run still runs or was cancelled."""
    other = await attempts.start(conn)
    theirs = await sheets.admit_page(
        conn, org=ORG, sheet="s", fence=other.fence, rows=[("a", {})], stable_intent=True
    )
    if other_state == "cancelled":
        await runs.cancel(conn, other.run_id, force=True)
    mine = await attempts.start(conn)
    result = await sheets.complete_rows(
        conn,
        org=ORG,
        sheet="s",
        fence=mine.fence,
        write_version=theirs.write_version,
        completions=[sheets.RowCompletion("a", {"mine": True})],
    )
    assert result.committed == ()
    assert [(s.key, s.reason) for s in result.stale] == [
        ("a", sheets.StaleReason.OLDER_WRITE_VERSION)
    ]
    cur = await conn.execute(
        "SELECT status::text, run_id, output FROM wq_sheet_rows WHERE row_key = 'a'"
    )
    assert await cur.fetchone() == ("pending", other.run_id, None)
    assert (await runs.get(conn, mine.run_id)).rows_done == 0


async def test_a_repeated_cancel_of_a_sleeper_with_a_cancel_pending_ends_it(conn: Conn) -> None:
    # Only an older release leaves a sleeper with a cancel pending (a cancel ends a sleeper
    # at once now); written by hand. A repeated cancel must end it, not be a no-op.
    live = await attempts.start(conn)
    final = outcomes.suspended(
        live.run_id, 1, wake_at=live.now + timedelta(hours=1), wait_event=None
    )
    await runs.finish(conn, worker_id="w1", finishes=[final])
    await conn.execute(
        "UPDATE wq_runs SET cancel_requested_at = now() WHERE id = %s", (live.run_id,)
    )
    again = await runs.cancel(conn, live.run_id)
    assert (again.before, again.after) == ("sleeping", "cancelled")


async def test_a_stray_delivery_for_a_sleeping_run_is_dropped_not_claimed(conn: Conn) -> None:
    live = await attempts.start(conn)
    final = outcomes.suspended(
        live.run_id, 1, wake_at=live.now + timedelta(hours=1), wait_event=None
    )
    await runs.finish(conn, worker_id="w1", finishes=[final])
    # A second job for the run that is not its job (a duplicate, late delivery).
    cur = await conn.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
        " VALUES (%s, 'wq.run', jsonb_build_object('run_id', %s::uuid)) RETURNING id",
        (live.claimed.lane, live.run_id),
    )
    stray = (await cur.fetchone() or (0,))[0]
    got = await runs.claim(
        conn,
        lanes=[live.claimed.lane or ""],
        worker_id="w2",
        limit=5,
        plays=[PLAY],
        now=live.now + timedelta(minutes=1),
    )
    assert [(c.claimed, c.job_id) for c in got] == [(False, stray)]
    assert (await attempts.run_row(conn, live.run_id))["state"] == "sleeping"
