"""Reservations racing on one budget between real connections that commit.

A budget's row lock serializes every reservation and every settlement that adds charges,
and each of them reads what the others committed before it got the lock (the spent on the
locked row, the live reservations counted after it). So racing attempts never reserve
past a budget, and charges that match their estimates never spend past it. Locks are held
on purpose and the waiters seen waiting in pg_stat_activity (polled with a deadline).
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import psycopg

from queues import costs, receipts
from queues.receipts import Scope, StepRef
from tests import attempts
from tests.attempts import ORG, PLAY, Attempt
from tests.integration.test_receipt_races import wait_until_blocked
from tests.workers import connect

Conn = psycopg.AsyncConnection[Any]
ONE = costs.estimate_of(1)


async def reserve(conn: Conn, a: Attempt, key: str, estimate: costs.Estimate) -> int:
    got = await costs.reserve(
        conn, fence=a.fence, scope=str(Scope.of_run(a.run_id)), keys=[key], estimate=estimate
    )
    return got.granted


async def test_racing_reservations_wait_for_the_budget_and_never_pass_it(db_url: str) -> None:
    async with (
        connect(db_url) as holder,
        connect(db_url) as c1,
        connect(db_url) as c2,
        connect(db_url) as c3,
        connect(db_url) as c4,
    ):
        racers = [c1, c2, c3, c4]
        runs = [await attempts.start(holder, worker=f"w{i}") for i in range(4)]
        await costs.set_budget(holder, org=ORG, limit=10)
        three = costs.estimate_of(3)
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM wq_budgets FOR UPDATE")
            tasks = [
                asyncio.create_task(reserve(c, a, "big", three))
                for c, a in zip(racers, runs, strict=True)
            ]
            for c, task in zip(racers, tasks, strict=True):
                await wait_until_blocked(holder, c.info.backend_pid, task)
        granted = await asyncio.gather(*tasks)
        assert sorted(granted) == [0, 1, 1, 1]  # 3 x 3 fit in 10; a fourth would not
        (shown,) = await costs.list_budgets(holder, org=ORG)
        assert shown.reserved == 9


async def spend_until_refused(conn: Conn, a: Attempt, tag: str) -> int:
    """What a play's steps do: reserve 1, charge 1 with the receipt, until refused."""
    done = 0
    while True:
        key = f"{tag}:{done}"
        if not await reserve(conn, a, key, ONE):
            return done
        step = StepRef(ORG, PLAY, Scope.of_run(a.run_id), key, a.fence)
        await receipts.record(conn, step, result=done, charges=[costs.Charge.checked(1)])
        done += 1


async def test_four_attempts_spending_one_budget_spend_exactly_its_limit(db_url: str) -> None:
    async with (
        connect(db_url) as c1,
        connect(db_url) as c2,
        connect(db_url) as c3,
        connect(db_url) as c4,
    ):
        racers = [c1, c2, c3, c4]
        runs = [await attempts.start(c1, worker=f"w{i}") for i in range(4)]
        await costs.set_budget(c1, org=ORG, play=PLAY, limit=200)
        pairs = enumerate(zip(racers, runs, strict=True))
        done = await asyncio.gather(*(spend_until_refused(c, a, f"r{i}") for i, (c, a) in pairs))
        assert sum(done) == 200
        (shown,) = await costs.list_budgets(c1, org=ORG)
        assert (shown.spent, shown.reserved) == (200, 0)
        (total,) = await costs.costs(c1, by=["org"], org=ORG)
        assert (total.amount, total.charges) == (Decimal(200), 200)
