"""The in-process transport keeps an attempt on one connection (``hold``), against a real
pool and a real claimed attempt.

The pool hands its connections out in turn; an attempt that keeps the one it first took
avoids waking another server process on every call. The connection each call ran on is
read from the dispatch (its server process id).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from queues import authority, operations
from queues.errors import InvalidField
from tests import attempts
from worker.contract import LocalTransport

SIZE = 3


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(
        db_url, min_size=SIZE, max_size=SIZE, open=False, kwargs={"autocommit": True}
    ) as opened:
        await opened.wait()
        yield opened


@pytest.fixture
def pids(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The server process of every dispatched call, in order."""
    seen: list[int] = []
    real = operations.dispatch

    async def spy(conn: Any, body: Any, claims: Any, **kw: Any) -> Any:
        seen.append(conn.info.backend_pid)
        await asyncio.sleep(0)  # let a concurrent call start while this one runs
        return await real(conn, body, claims, **kw)

    monkeypatch.setattr(operations, "dispatch", spy)
    yield seen


async def transport(db_url: str, pool: AsyncConnectionPool[Any], hold: bool) -> LocalTransport:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        a = await attempts.start(conn, now=datetime.now(UTC))
    descriptor = a.claimed.descriptor
    claims = authority.claims_of_attempt(descriptor, attempt=a.fence.attempt, owner="w1")
    return LocalTransport(pool, lambda ledger: claims, hold=hold)


async def test_a_holding_attempt_makes_every_call_on_one_connection(
    db_url: str, pool: AsyncConnectionPool[Any], pids: list[int]
) -> None:
    t = await transport(db_url, pool, hold=True)
    for _ in range(5):
        await t.call("runtime_now", {})
    assert len(set(pids)) == 1
    assert pool.get_stats()["pool_available"] == SIZE - 1  # held between calls
    # A call made while another runs takes a pooled connection of its own.
    pids.clear()
    await asyncio.gather(t.call("runtime_now", {}), t.call("runtime_now", {}))
    assert len(set(pids)) == 2
    # A failed call gives the held connection back; the next call takes one again.
    with pytest.raises(InvalidField):
        await t.call("runtime_now", {"bogus": 1})
    assert pool.get_stats()["pool_available"] == SIZE
    await t.call("runtime_now", {})
    assert pool.get_stats()["pool_available"] == SIZE - 1
    await t.aclose()
    assert pool.get_stats()["pool_available"] == SIZE
    await t.aclose()  # twice is harmless


async def test_without_hold_each_call_takes_the_pools_next_connection(
    db_url: str, pool: AsyncConnectionPool[Any], pids: list[int]
) -> None:
    t = await transport(db_url, pool, hold=False)
    for _ in range(6):
        await t.call("runtime_now", {})
    assert len(set(pids)) == SIZE  # in turn
    assert pool.get_stats()["pool_available"] == SIZE


async def test_a_cancelled_call_still_gives_the_held_connection_back(
    db_url: str, pool: AsyncConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost lease or a hand-back cancels an attempt mid-call: the held connection goes
    back to the pool (shielded, so a further cancel cannot drop it on the way)."""
    t = await transport(db_url, pool, hold=True)
    await t.call("runtime_now", {})
    gate = asyncio.Event()

    async def stuck(conn: Any, body: Any, claims: Any, **kw: Any) -> Any:
        await gate.wait()

    monkeypatch.setattr(operations, "dispatch", stuck)
    call = asyncio.create_task(t.call("runtime_now", {}))
    await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if pool.get_stats()["pool_available"] == SIZE:
            break
        await asyncio.sleep(0.01)
    assert pool.get_stats()["pool_available"] == SIZE


async def test_claims_are_made_at_the_first_call_that_needs_them(
    db_url: str, pool: AsyncConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt that makes no call (most of a trivial play's) makes no claims; each kind
    (the executor's, the ledger projector's) is made once, at its first call, and every
    call is dispatched with its own kind."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        a = await attempts.start(conn, now=datetime.now(UTC))
    made: list[bool] = []

    def claims(ledger: bool) -> authority.Claims:
        made.append(ledger)
        caps = [authority.LEDGER_PROJECT] if ledger else None
        return authority.claims_of_attempt(
            a.claimed.descriptor, attempt=a.fence.attempt, owner="w1", capabilities=caps
        )

    dispatched: list[authority.Claims] = []

    async def spy(conn: Any, body: Any, claims: authority.Claims, **kw: Any) -> Any:
        dispatched.append(claims)

    monkeypatch.setattr(operations, "dispatch", spy)
    t = LocalTransport(pool, claims, hold=True)
    await t.aclose()
    assert made == []
    ledger_action = sorted(operations.LEDGER_ACTIONS)[0]
    for action in ("runtime_now", "runtime_now", ledger_action, "runtime_now", ledger_action):
        await t.call(action, {})
    await t.aclose()
    assert made == [False, True]
    assert [authority.LEDGER_PROJECT in c.capabilities for c in dispatched] == [
        False, False, True, False, True,
    ]  # fmt: skip
