"""Races on a run's ledger seq between real connections that commit (docs/design.md, 11b).

The claim, the finish batch, recovery's lapse rescue and the cancel take the run's next seq
in their update of the run row (``wq_ledger_next_seq``) and write the event with it. An
append numbered by the event trigger (a step, a sheet page, a play event; every append of
the previous release) may commit between that statement's start and its insert. Taken from
the statement's snapshot, the number was then the appended event's, and the trigger refused
the insert with a serialization failure: an operator's `worker cancel` failed, a finish
had to be retried. The number is now taken under the run's ledger lock, after the run row,
with a snapshot of its own: the statement waits for the open append and numbers after it.

Each race is made with locks held on purpose: the appender's transaction stays open while
the statement starts, the statement is seen waiting on a lock (pg_locks, polled with a
deadline), then the appender commits. Nothing sleeps to wait for a state. Every test checks
the statement's answer, that the run's seqs are gapless and distinct, that each event is
either stored in ``wq_events`` or stood for by a state row, and that the state row carries
the seq its event got.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from queues import lanes, ledger, runs
from queues.outcomes import FinishStatus, succeeded
from queues.queries import q
from tests import attempts
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
DEADLINE_S = 10.0
ROW_WAITS = {"transactionid", "tuple"}  # a wait for a row another transaction locked


async def lock_waited_for(observer: Conn, pid: int, task: asyncio.Task[Any]) -> str:
    """Poll pg_locks until backend ``pid`` waits for a lock; the lock's type
    (``advisory``: the run's ledger lock; ``transactionid``/``tuple``: a row lock)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert not task.done(), f"the statement did not wait: {task!r}"
        cur = await observer.execute(
            "SELECT locktype FROM pg_locks WHERE pid = %(pid)s AND NOT granted", {"pid": pid}
        )
        row = await cur.fetchone()
        if row is not None:
            return str(row[0])
        assert time.monotonic() < deadline, f"backend {pid} never waited on a lock"
        await asyncio.sleep(0.01)


async def the_ledger(conn: Conn, run_id: uuid.UUID) -> list[tuple[int, str]]:
    """The run's ledger as (seq, kind), read from the view (what readers read), after
    checking it: gapless and distinct from 1, each event either stored in ``wq_events`` or
    stood for by a state row, never both (migration 0041)."""
    query = "SELECT seq, kind, attempt, data FROM {} WHERE run_id = %s ORDER BY seq, kind"
    found = {}
    for relation in ("wq_ledger", "wq_events", "wq_ledger_state"):
        cur = await conn.execute(query.format(relation), (run_id,))
        found[relation] = await cur.fetchall()
    events = found["wq_ledger"]
    parts = sorted(found["wq_events"] + found["wq_ledger_state"], key=lambda r: int(r[0]))
    assert parts == events
    seqs = [int(row[0]) for row in events]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    return [(int(seq), str(kind)) for seq, kind, _, _ in events]


async def state_seqs(conn: Conn, run_id: uuid.UUID) -> dict[str, Any]:
    """The seqs the run row and its last attempt row carry."""
    cur = await conn.execute(
        "SELECT r.ledger_seq, r.ledger_end_seq, a.start_seq, a.end_seq"
        "  FROM wq_runs r"
        "  LEFT JOIN wq_attempts a ON a.run_id = r.id AND a.attempt = r.attempt"
        " WHERE r.id = %s",
        (run_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return dict(zip(("counter", "run_end", "attempt_start", "attempt_end"), row, strict=True))


async def append_as_this_release(conn: Conn, run_id: uuid.UUID) -> None:
    """``ledger_append`` (a play's event, numbered by the trigger): the run row FOR SHARE,
    then the ledger lock, both held until the caller's transaction ends."""
    event = await ledger.append(conn, run_id, "app.note", {"n": 1})
    assert event.kind == "app.note"


async def append_as_the_previous_release(conn: Conn, run_id: uuid.UUID) -> None:
    """An insert without a seq, numbered by the trigger as the previous release's appends
    are; it locks no run row before it (the foreign key's check takes a KEY SHARE after)."""
    await conn.execute(
        "INSERT INTO wq_events (run_id, kind, data) VALUES (%s, 'app.note', '{}')", (run_id,)
    )


Appender = Callable[[Conn, uuid.UUID], Awaitable[None]]


async def race(
    observer: Conn,
    appender: Conn,
    append: Appender,
    run_id: uuid.UUID,
    actor: Conn,
    statement: Awaitable[Any],
) -> tuple[Any, str]:
    """Append in an open transaction, start ``statement`` on ``actor``, see it wait for a
    lock, commit the append; the statement's answer and the lock it waited for."""
    async with appender.transaction():
        await append(appender, run_id)
        task = asyncio.ensure_future(statement)
        waited = await lock_waited_for(observer, actor.info.backend_pid, task)
    return await asyncio.wait_for(task, DEADLINE_S), waited


# ---- a cancel, a finish and a claim against this release's append -------------------------


@pytest.mark.parametrize("force", [False, True], ids=["requested", "forced"])
async def test_a_cancel_of_a_running_run_waits_for_an_open_append_then_numbers_after_it(
    db_url: str, force: bool
) -> None:
    async with (
        connect(db_url) as setup,
        connect(db_url) as appender,
        connect(db_url) as operator,
        connect(db_url) as observer,
    ):
        a = await attempts.start(setup)
        cancel = runs.cancel(operator, a.run_id, reason="stop", force=force, actor="ops")
        result, waited = await race(
            observer, appender, append_as_this_release, a.run_id, operator, cancel
        )
        assert waited in ROW_WAITS  # the append holds the run FOR SHARE; the cancel FOR UPDATE
        assert result.changed and result.before == "running"
        kind = "run_cancelled" if force else "cancel_requested"
        assert result.after == ("cancelled" if force else "running")
        assert await the_ledger(setup, a.run_id) == [
            (1, "run_created"),
            (2, "attempt_started"),
            (3, "app.note"),
            (4, kind),
        ]
        seqs = await state_seqs(setup, a.run_id)
        assert seqs["counter"] == 4
        assert seqs["run_end"] == (4 if force else None)


async def test_a_finish_batch_waits_for_an_open_append_then_numbers_after_it(db_url: str) -> None:
    async with (
        connect(db_url) as setup,
        connect(db_url) as appender,
        connect(db_url) as finisher,
        connect(db_url) as observer,
    ):
        a = await attempts.start(setup)
        finish = runs.finish(
            finisher,
            worker_id=a.fence.owner,
            finishes=[succeeded(a.run_id, a.fence.attempt, {"ok": 1})],
        )
        statuses, waited = await race(
            observer, appender, append_as_this_release, a.run_id, finisher, finish
        )
        assert waited in ROW_WAITS  # FOR SHARE against the finish's FOR UPDATE
        assert statuses == {(a.run_id, a.fence.attempt): FinishStatus.APPLIED}
        assert await the_ledger(setup, a.run_id) == [
            (1, "run_created"),
            (2, "attempt_started"),
            (3, "app.note"),
            (4, "run_succeeded"),
        ]
        seqs = await state_seqs(setup, a.run_id)
        assert (seqs["counter"], seqs["attempt_start"], seqs["attempt_end"]) == (4, 2, 4)


async def test_a_claim_waits_for_an_open_append_to_its_queued_run_then_numbers_after_it(
    db_url: str,
) -> None:
    # Anyone may append to a queued run (ledger.append); the claim's UPDATE computes its SET
    # before it locks the row, so the number is taken under the row lock and the ledger
    # lock inside wq_ledger_next_seq.
    async with (
        connect(db_url) as setup,
        connect(db_url) as appender,
        connect(db_url) as claimer,
        connect(db_url) as observer,
    ):
        run_id = await attempts.admit(setup)
        claim = attempts.claim(claimer, run_id=run_id)
        claimed, waited = await race(
            observer, appender, append_as_this_release, run_id, claimer, claim
        )
        assert waited in ROW_WAITS  # the function's row lock against the append's FOR SHARE
        assert claimed.fence.attempt == 1
        assert await the_ledger(setup, run_id) == [
            (1, "run_created"),
            (2, "app.note"),
            (3, "attempt_started"),
        ]
        seqs = await state_seqs(setup, run_id)
        assert (seqs["counter"], seqs["attempt_start"]) == (3, 3)


async def test_a_claim_takes_the_run_row_before_the_ledger_lock(db_url: str) -> None:
    # The lock order of every appender: the run row, then the run's ledger lock. An
    # appender holds the row (a receipt's or a sheet's FOR SHARE / NO KEY UPDATE, the
    # first CTE of ledger_append) before its insert asks for the ledger lock. The claim's
    # UPDATE evaluates its SET before it locks the row: were the ledger lock taken there
    # first, the claim would hold it while waiting for the row, the appender would wait
    # for it, and one of them would die in a deadlock.
    async with (
        connect(db_url) as setup,
        connect(db_url) as appender,
        connect(db_url) as claimer,
        connect(db_url) as observer,
    ):
        run_id = await attempts.admit(setup)
        async with appender.transaction():
            await appender.execute("SELECT 1 FROM wq_runs WHERE id = %s FOR SHARE", (run_id,))
            claim = asyncio.ensure_future(attempts.claim(claimer, run_id=run_id))
            waited = await lock_waited_for(observer, claimer.info.backend_pid, claim)
            assert waited in ROW_WAITS, waited
            cur = await observer.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'",
                (claimer.info.backend_pid,),
            )
            assert await cur.fetchone() == (0,), "the claim took the ledger lock first"
            # Its append takes the ledger lock at once (the claim does not hold it).
            await asyncio.wait_for(append_as_the_previous_release(appender, run_id), DEADLINE_S)
        claimed = await asyncio.wait_for(claim, DEADLINE_S)
        assert claimed.fence.attempt == 1
        assert await the_ledger(setup, run_id) == [
            (1, "run_created"),
            (2, "app.note"),
            (3, "attempt_started"),
        ]


# ---- every new statement against the previous release's append ----------------------------


async def _claim(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    run_id = await attempts.admit(setup)
    return run_id, attempts.claim(actor, run_id=run_id)


async def _finish(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    a = await attempts.start(setup)
    f = succeeded(a.run_id, a.fence.attempt, None)
    return a.run_id, runs.finish(actor, worker_id=a.fence.owner, finishes=[f])


async def _cancel(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    a = await attempts.start(setup)
    return a.run_id, runs.cancel(actor, a.run_id, reason="stop", actor="ops")


async def _cancel_queued(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    run_id = await attempts.admit(setup)
    return run_id, runs.cancel(actor, run_id, reason="stop", actor="ops")


async def _drop(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    # A claim that drops a run whose play the release does not have: job_drop fails it.
    run_id = await attempts.admit(setup, play="gone")
    claim = runs.claim(
        actor,
        lanes=[lanes.lane_name(attempts.RELEASE)],
        worker_id="w1",
        limit=10,
        plays=[attempts.PLAY],
        now=attempts.T0,
    )
    return run_id, claim


async def _rescue(setup: Conn, actor: Conn) -> tuple[uuid.UUID, Awaitable[Any]]:
    # The rescue's apply statement as recovery runs it after its pick (which skips a run
    # whose row another transaction holds: it is the apply that can meet an append).
    a = await attempts.start(setup)

    async def apply() -> list[Any]:
        cur = await actor.execute(
            q("recovery_expired_apply"),
            {
                "now": a.lapses_at + timedelta(seconds=1),
                "run_ids": [a.run_id],
                "attempts": [a.fence.attempt],
                "states": ["queued"],
                "spawn": [True],
                "delays": [0.0],
                "codes": ["LEASE_EXPIRED"],
                "whys": [None],
            },
        )
        return await cur.fetchall()

    return a.run_id, apply()


def _claimed(answer: attempts.Attempt, run_id: uuid.UUID) -> None:
    assert (answer.run_id, answer.fence.attempt) == (run_id, 1)


def _applied(answer: dict[tuple[uuid.UUID, int], FinishStatus], run_id: uuid.UUID) -> None:
    assert answer == {(run_id, 1): FinishStatus.APPLIED}


def _requested(answer: runs.CancelResult, run_id: uuid.UUID) -> None:
    assert (answer.run_id, answer.changed, answer.after) == (run_id, True, "running")


def _cancelled(answer: runs.CancelResult, run_id: uuid.UUID) -> None:
    assert (answer.run_id, answer.changed, answer.after) == (run_id, True, "cancelled")


def _dropped(answer: list[runs.Claimed], run_id: uuid.UUID) -> None:
    assert [(c.run_id, c.claimed) for c in answer] == [(run_id, False)]


def _rescued(answer: list[Any], run_id: uuid.UUID) -> None:
    assert [(row[0], row[1], row[3]) for row in answer] == [(run_id, 1, "queued")]


# statement -> (its setup, the ledger's kinds after the append, the state row's seq, the
# check of its answer)
PREVIOUS_RELEASE_RACES: dict[str, tuple[Any, list[str], str, Any]] = {
    "claim": (_claim, ["run_created", "app.note", "attempt_started"], "attempt_start", _claimed),
    "finish": (
        _finish,
        ["run_created", "attempt_started", "app.note", "run_succeeded"],
        "attempt_end",
        _applied,
    ),
    "cancel": (
        _cancel,
        ["run_created", "attempt_started", "app.note", "cancel_requested"],
        "counter",
        _requested,
    ),
    "cancel_queued": (
        _cancel_queued,
        ["run_created", "app.note", "run_cancelled"],
        "run_end",
        _cancelled,
    ),
    "drop": (_drop, ["run_created", "app.note", "run_failed"], "run_end", _dropped),
    "rescue": (
        _rescue,
        ["run_created", "attempt_started", "app.note", "lease_expired"],
        "attempt_end",
        _rescued,
    ),
}


@pytest.mark.parametrize("statement", sorted(PREVIOUS_RELEASE_RACES))
async def test_the_previous_releases_append_racing_a_numbering_statement_is_waited_for(
    db_url: str, statement: str
) -> None:
    make, kinds, seq_on, check = PREVIOUS_RELEASE_RACES[statement]
    async with (
        connect(db_url) as setup,
        connect(db_url) as appender,
        connect(db_url) as actor,
        connect(db_url) as observer,
    ):
        run_id, pending = await make(setup, actor)
        answer, waited = await race(
            observer, appender, append_as_the_previous_release, run_id, actor, pending
        )
        # The claim and the drop lock the row FOR NO KEY UPDATE, which the insert's KEY
        # SHARE allows: they wait for the ledger lock. The others lock the row FOR UPDATE
        # and wait there.
        if statement in ("claim", "drop"):
            assert waited == "advisory", waited
        else:
            assert waited in ROW_WAITS, waited
        check(answer, run_id)
        ledger_rows = await the_ledger(setup, run_id)
        assert [kind for _, kind in ledger_rows] == kinds
        last = len(kinds)
        seqs = await state_seqs(setup, run_id)
        assert seqs["counter"] == last
        assert seqs[seq_on] == last
