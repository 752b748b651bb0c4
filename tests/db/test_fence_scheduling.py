"""The write paths of issue 14 against the state a real rescue leaves: child spawns,
rate-limit permits and budget reservations (queues/fence.py's table).

Each test makes attempt 1 stale the way production does (the recovery pass closes it after
its lease lapsed, a second worker claims the run as attempt 2: tests/attempts.py), then
tries the write with attempt 1's fence: it is refused (StaleAttempt), nothing of it is
visible, and the refusal is logged in wq_refusals. The live attempt's same write succeeds.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg.types.json import Jsonb

from queues import children, costs, limits
from queues.errors import StaleAttempt
from queues.fence import Fence
from queues.options import RunOptions
from queues.queries import q
from tests import attempts
from tests.attempts import ORG, PLAY, Attempt

Conn = psycopg.AsyncConnection[Any]


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


async def _spawn(conn: Conn, fence: Fence, step: str = "$spawn:child") -> children.Spawned:
    # The child waits behind its parent on the lane (priority -1): the tests' claims take
    # the parent's retry, as tests/attempts.py expects.
    return await children.spawn(
        conn,
        fence=fence,
        org=ORG,
        parent_play=PLAY,
        release=attempts.RELEASE,
        step_key=step,
        play="child",
        params={"n": 1},
        options=RunOptions(max_attempts=2),
        priority=-1,
    )


# ---- child runs -------------------------------------------------------------------------------


async def test_a_rescued_attempt_cannot_spawn_a_child(conn: Conn) -> None:
    old, new = await _stale_pair(conn)
    with pytest.raises(StaleAttempt, match="attempt 2"):
        await _spawn(conn, old.fence)
    assert await _count(conn, "SELECT count(*) FROM wq_runs WHERE parent_id = %s", old.run_id) == 0
    # The step's receipt claim refused it first (one refusal, kind receipt): nothing of the
    # spawn ran. The spawn statement's own fence is shown below, with the receipt held.
    assert await attempts.refusals(conn, old.run_id) == [(1, "receipt", 1)]
    spawned = await _spawn(conn, new.fence)
    assert spawned.created


async def test_the_spawn_statement_refuses_a_stale_attempt_by_itself(conn: Conn) -> None:
    """The child insert carries the fence in its own statement: a stale attempt that got
    past the receipt (claimed before the rescue) still cannot admit a child."""
    old = await attempts.start(conn)
    await attempts.supersede(conn, old)
    cur = await conn.execute(
        q("child_spawn"),
        {
            "child_id": uuid4(),
            "play": "child",
            "params": "{}",
            "key": children.child_key(old.run_id, "$spawn:child"),
            "priority": 0,
            "step": "$spawn:child",
            "authority": Jsonb({}),
            "meta": None,
            **RunOptions().columns(),
            **old.fence.params(),
        },
    )
    row = await cur.fetchone()
    assert row is not None and row[0] is False and row[1] is None
    assert await _count(conn, "SELECT count(*) FROM wq_runs WHERE parent_id = %s", old.run_id) == 0
    assert await attempts.refusals(conn, old.run_id) == [(1, "spawn", 1)]


async def test_a_retried_parent_replays_its_spawn_and_admits_one_child(conn: Conn) -> None:
    first = await attempts.start(conn)
    spawned = await _spawn(conn, first.fence)
    assert spawned.created
    second = await attempts.supersede(conn, first)
    again = await _spawn(conn, second.fence)
    assert again.run_id == spawned.run_id and not again.created
    cur = await conn.execute(
        "SELECT id, parent_id, play, retry_max_attempts, lane, org FROM wq_runs"
        " WHERE parent_id = %s",
        (first.run_id,),
    )
    assert await cur.fetchall() == [
        (spawned.run_id, first.run_id, "child", 2, "r-" + attempts.RELEASE, ORG)
    ]


# ---- rate-limit permits -----------------------------------------------------------------------


async def test_a_rescued_attempt_cannot_take_a_permit(conn: Conn) -> None:
    await limits.set_limit(conn, "api", rate="10/s", concurrency=2)
    old, new = await _stale_pair(conn)
    now = new.now + timedelta(seconds=1)
    with pytest.raises(StaleAttempt, match="attempt 2"):
        await limits.acquire(conn, key="api", hold="h1", fence=old.fence, now=now)
    assert await _count(conn, "SELECT count(*) FROM wq_limit_holds") == 0
    assert await _count(conn, "SELECT count(*) FROM wq_limit_buckets") == 0
    assert await attempts.refusals(conn, old.run_id) == [(1, "limit", 1)]
    permit = await limits.acquire(conn, key="api", hold="h1", fence=new.fence, now=now)
    assert permit.granted and permit.held


async def test_a_rescued_attempt_cannot_release_the_live_attempts_permit(conn: Conn) -> None:
    await limits.set_limit(conn, "api", concurrency=1)
    old = await attempts.start(conn)
    taken = await limits.acquire(conn, key="api", hold="h1", fence=old.fence, now=old.now)
    assert taken.granted and taken.held
    new = await attempts.supersede(conn, old)
    now = new.now + timedelta(seconds=1)
    # Attempt 1's permit stopped counting with its attempt: attempt 2 takes the one slot.
    mine = await limits.acquire(conn, key="api", hold="h2", fence=new.fence, now=now)
    assert mine.granted
    with pytest.raises(StaleAttempt):
        await limits.release(conn, hold="h2", fence=old.fence)
    with pytest.raises(StaleAttempt):
        await limits.release(conn, hold="h1", fence=old.fence)
    assert await _count(conn, "SELECT count(*) FROM wq_limit_holds WHERE hold = 'h2'") == 1
    assert await attempts.refusals(conn, old.run_id) == [(1, "limit", 1), (1, "limit", 1)]
    assert await limits.release(conn, hold="h2", fence=new.fence)


# ---- each predicate alone (as tests/db/test_fence_predicates.py does for the older writes) -----


async def _scene(conn: Conn, predicate: str) -> tuple[Attempt, Fence]:
    """The live attempt, and a writer that differs from it in exactly one predicate:
    ``attempt`` (w1's attempt 1, after w1 itself reclaimed the run as attempt 2) or
    ``owner`` (an impostor sending the live attempt's number)."""
    if predicate == "attempt":
        old = await attempts.start(conn, worker="w1")
        new = await attempts.supersede(conn, old, worker="w1")
        assert (new.fence.owner, new.fence.attempt) == ("w1", 2)
        return new, old.fence
    live = await attempts.start(conn, worker="w1")
    return live, replace(live.fence, owner="w-impostor")


async def spawn_direct(conn: Conn, live: Attempt, fence: Fence) -> None:
    """The spawn statement's own fence (without the step receipt's before it)."""
    cur = await conn.execute(
        q("child_spawn"),
        {
            "child_id": uuid4(),
            "play": "child",
            "params": "{}",
            "key": children.child_key(live.run_id, "k"),
            "priority": 0,
            "step": "k",
            "authority": Jsonb({}),
            "meta": None,
            **RunOptions().columns(),
            **fence.params(),
        },
    )
    row = await cur.fetchone()
    assert row is not None
    if not row[0]:
        assert row[1] is None  # and no child was admitted
        raise StaleAttempt("refused by child_spawn", fix="-")


async def acquire(conn: Conn, live: Attempt, fence: Fence) -> None:
    await limits.set_limit(conn, "k", rate="100/s", concurrency=5)
    await limits.acquire(conn, key="k", hold="h", fence=fence, now=live.now)


async def release(conn: Conn, live: Attempt, fence: Fence) -> None:
    await limits.set_limit(conn, "k", concurrency=5)
    held = await limits.acquire(conn, key="k", hold="h", fence=live.fence, now=live.now)
    assert held.held
    if not await limits.release(conn, hold="h", fence=fence):
        raise AssertionError("fenced, but released nothing: the fence let it through")


async def reserve(conn: Conn, live: Attempt, fence: Fence) -> None:
    await costs.set_budget(conn, org=ORG, limit=10)
    await costs.reserve(
        conn, fence=fence, scope=f"run:{live.run_id}", keys=["k"], estimate={"credits": 1}
    )


PREDICATE_WRITES = {"child_spawn": (spawn_direct, "spawn"), "limit_acquire": (acquire, "limit")}
PREDICATE_WRITES["limit_release"] = (release, "limit")
PREDICATE_WRITES["budget_reserve"] = (reserve, "budget")


@pytest.mark.parametrize("predicate", ["attempt", "owner"])
@pytest.mark.parametrize("name", sorted(PREDICATE_WRITES))
async def test_one_stale_predicate_refuses_the_write(conn: Conn, name: str, predicate: str) -> None:
    write, kind = PREDICATE_WRITES[name]
    live, fence = await _scene(conn, predicate)
    before = await attempts.refusals(conn, live.run_id)
    with pytest.raises(StaleAttempt):
        await write(conn, live, fence)
    logged = (await attempts.refusals(conn, live.run_id))[len(before) :]
    assert [k for _, k, _ in logged] == [kind], logged
    row = await attempts.run_row(conn, live.run_id)
    assert (row["state"], row["attempt"], row["lease_owner"]) == (
        "running",
        live.fence.attempt,
        live.fence.owner,
    )
    assert await _count(conn, "SELECT count(*) FROM wq_runs WHERE parent_id = %s", live.run_id) == 0
    assert await _count(conn, "SELECT count(*) FROM wq_reservations") == 0


@pytest.mark.parametrize("predicate", ["attempt", "owner"])
async def test_a_stale_attempt_makes_no_bucket_for_its_permit(conn: Conn, predicate: str) -> None:
    """The bucket a permit needs is made after the attempt's first fenced acquire found
    none, in a statement of its own (limit_bucket_ensure): a rescue can come in between, so
    that statement checks the fence too. Run directly with a stale writer, it makes none."""
    live, fence = await _scene(conn, predicate)
    await limits.set_limit(conn, "k", rate="100/s")
    await conn.execute(q("limit_bucket_ensure"), {"key": "k", **fence.params()})
    cur = await conn.execute("SELECT count(*) FROM wq_limit_buckets WHERE key = 'k'")
    assert await cur.fetchone() == (0,)
    await conn.execute(q("limit_bucket_ensure"), {"key": "k", **live.fence.params()})
    cur = await conn.execute("SELECT count(*) FROM wq_limit_buckets WHERE key = 'k'")
    assert await cur.fetchone() == (1,)  # the live attempt's makes it
