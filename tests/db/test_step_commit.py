"""When a step claim may commit without waiting for its WAL flush (receipt_claim's
``lazy_commit``), each case in one rolled-back transaction.

The setting is transaction-local, so the statement is run here the way the claim runs it
on an autocommit connection (``own_commit``), inside the test's transaction, and
``synchronous_commit`` is read back afterwards: ``off`` only for a fenced claim in the run's
own scope, or a fenced replay; ``on`` for a claim in a named scope (it keeps other runs
out, so it stays durable), for a refused claim (its refusal row stays durable), and for any
claim made inside a caller's transaction (the setting would reach the caller's writes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queues import receipts
from queues.queries import q
from queues.receipts import Scope
from tests import attempts
from tests.attempts import ORG, PLAY, T0, Attempt

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
async def tx(conn: Conn) -> AsyncIterator[Conn]:
    await conn.execute("SELECT 1")
    yield conn


async def synchronous_commit(conn: Conn) -> str:
    cur = await conn.execute("SHOW synchronous_commit")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def claim_as_own_transaction(conn: Conn, a: Attempt, key: str, scope: Scope) -> str:
    """The claim statement with own_commit set, in a savepoint; the setting it leaves."""
    async with conn.transaction(force_rollback=True):
        await conn.execute(
            q("receipt_claim"),
            {
                "org": ORG,
                "play": PLAY,
                "scope": scope.key,
                "step_key": key,
                "lease_s": 30.0,
                "now": T0,
                "own_commit": True,
                **a.fence.params(),
            },
        )
        return await synchronous_commit(conn)


async def test_only_claims_whose_loss_is_harmless_skip_the_flush(tx: Conn) -> None:
    a = await attempts.start(tx)
    assert await synchronous_commit(tx) == "on"
    assert await claim_as_own_transaction(tx, a, "s", Scope.of_run(a.run_id)) == "off"
    assert await claim_as_own_transaction(tx, a, "s", Scope.named("shared")) == "on"
    # A replay in a named scope writes nothing but its share lock.
    shared = {"org": ORG, "play": PLAY, "scope": Scope.named("shared"), "fence": a.fence}
    await receipts.claim(tx, receipts.StepRef(**shared, step_key="done"), lease_s=30.0, now=T0)
    await receipts.complete(tx, receipts.StepRef(**shared, step_key="done"), result=1)
    assert await claim_as_own_transaction(tx, a, "done", Scope.named("shared")) == "off"
    assert await synchronous_commit(tx) == "on"


async def test_a_refused_claim_keeps_its_refusal_durable(tx: Conn) -> None:
    old = await attempts.start(tx)
    await attempts.supersede(tx, old)
    assert await claim_as_own_transaction(tx, old, "s", Scope.of_run(old.run_id)) == "on"
    assert await attempts.refusals(tx, old.run_id) == []  # rolled back with the savepoint


async def test_a_claim_in_the_callers_transaction_never_changes_its_commit(tx: Conn) -> None:
    a = await attempts.start(tx)
    claim = await receipts.claim(
        tx,
        receipts.StepRef(
            org=ORG, play=PLAY, scope=Scope.of_run(a.run_id), step_key="s", fence=a.fence
        ),
        lease_s=30.0,
        now=T0,
    )
    assert claim.outcome is receipts.ClaimOutcome.EXECUTE
    assert await synchronous_commit(tx) == "on"


async def test_a_run_claim_in_the_callers_transaction_never_changes_its_commit(
    tx: Conn,
) -> None:
    """runs.claim commits lazily only a transaction it opens itself."""
    a = await attempts.start(tx)
    assert a.claimed.claimed
    assert await synchronous_commit(tx) == "on"
