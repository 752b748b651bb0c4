"""Budgets held across real worker processes (``worker start``, ``tests/apps/costs.py``).

A run that would overspend its budget pauses (``sleeping``, ``BUDGET_EXHAUSTED``) with
its worker slot free, and resumes by itself when the budget is raised. Four workers
spending one org's budget never spend past it (their estimates match their charges), and
SIGKILLs in the middle of steps lose no charge and double none: every completed step
carries exactly one charge, recorded with its receipt.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

from queues import admission, costs, lanes, runs
from tests.apps.costs import COSTS_DDL, URL_ENV
from tests.e2e.test_zombies import REPO, WORKER, Worker, cli_env, eventually, fetch, one, stop

Conn = psycopg.AsyncConnection[Any]
RELEASE = "costs"
APP = "tests.apps.costs:registry"
ORG = "acme"
LEASE_TTL_S = 2.0
HEARTBEAT_S = 0.25
DEADLINE_S = 90.0


async def prepare(conn: Conn) -> None:
    await conn.execute(COSTS_DDL)
    await lanes.prepare(conn, RELEASE)
    await lanes.set_policy(
        conn,
        RELEASE,
        lease_ttl_s=LEASE_TTL_S,
        heartbeat_s=HEARTBEAT_S,
        retry_base_s=0.0,
        retry_jitter=0.0,
    )


async def start_worker(db_url: str, tmp_path: Path, name: str, concurrency: int = 4) -> Worker:
    ready = tmp_path / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log = tmp_path / f"{name}.log"
    args = ["--json-logs", "start", "--release", RELEASE, "--app", APP, "--grace", "1"]
    args += ["--concurrency", str(concurrency), "--ready-file", str(ready)]
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            WORKER,
            *args,
            cwd=REPO,
            env=cli_env(db_url) | {URL_ENV: db_url},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    w = Worker(name, proc, log, ready=ready)
    await w.until_ready()
    return w


@contextlib.asynccontextmanager
async def workers(db_url: str, tmp_path: Path, n: int) -> AsyncIterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for i in range(n):
            started.append(await start_worker(db_url, tmp_path, f"w{i}"))
        yield started
    finally:
        await asyncio.gather(*(stop(w) for w in started))


async def submit(
    conn: Conn, play: str, params: dict[str, Any], inputs: list[tuple[str, Any]] | None = None
) -> uuid.UUID:
    sub = admission.Submission(play=play, params=params, release=RELEASE, org=ORG)
    return (await admission.submit(conn, sub, inputs=inputs)).run_id


async def charged(conn: Conn, run_id: uuid.UUID | None = None) -> Decimal:
    found = await costs.costs(conn, by=["org"], org=ORG, run_id=run_id)
    return sum((c.amount for c in found), Decimal(0))


async def settled(conn: Conn, run_ids: list[uuid.UUID]) -> bool:
    """Every run has stopped moving: succeeded, or paused on its budget."""
    found = [await runs.get(conn, r) for r in run_ids]
    return all(r.state == "succeeded" or r.wait_reason == costs.BUDGET_EXHAUSTED for r in found)


async def test_a_run_pauses_at_its_org_budget_and_a_raise_resumes_it(
    db_url: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await prepare(conn)
        await costs.set_budget(conn, org=ORG, limit=100)
        rows = [(f"{i:03d}", {"i": i}) for i in range(500)]
        async with workers(db_url, tmp_path, 1):
            run_id = await submit(conn, "metered", {}, rows)

            async def paused() -> bool:
                run = await runs.get(conn, run_id)
                return run.wait_reason == costs.BUDGET_EXHAUSTED

            await eventually(paused, "the run to pause on its budget", DEADLINE_S)
            run = await runs.get(conn, run_id)
            assert (run.state, run.lease_owner, run.job_id) == ("sleeping", None, None)
            # Exactly the budget: 100 rows paid, each charged once, with its receipt.
            assert await charged(conn, run_id) == 100
            assert await one(conn, "SELECT count(*) FROM cost_calls") == 100
            assert await one(conn, "SELECT count(DISTINCT key) FROM cost_calls") == 100
            (org_budget,) = await costs.list_budgets(conn, org=ORG)
            assert (org_budget.spent, org_budget.reserved, org_budget.exhausted) == (100, 0, True)

            await costs.set_budget(conn, org=ORG, limit=500)

            async def succeeded() -> bool:
                return (await runs.get(conn, run_id)).state == "succeeded"

            await eventually(succeeded, "the raised run to finish", DEADLINE_S)
        assert await charged(conn, run_id) == 500
        assert await one(conn, "SELECT count(*) FROM cost_calls") == 500
        assert await one(conn, "SELECT count(DISTINCT key) FROM cost_calls") == 500
        result = (await runs.get(conn, run_id)).result
        assert result == {"paid": 400, "replayed": 100}  # the resumed attempt's share
        kinds = [e.kind for e in await runs.events(conn, run_id)]
        assert "budget_changed" in kinds and "run_waiting" in kinds


async def check_once(conn: Conn) -> None:
    """No charge lost, none doubled: each completed step has exactly one charge (of the
    attempt that completed it), and each charge a completed step."""
    rows = await fetch(
        conn,
        "SELECT r.step_key, r.owner_attempt, c.attempt, c.amount"
        " FROM wq_receipts r"
        " FULL JOIN wq_charges c ON c.run_id = r.owner_run AND c.step_key = r.step_key"
        " WHERE r.status = 'completed' OR c.id IS NOT NULL",
    )
    assert rows, "no step completed"
    for key, owner_attempt, attempt, amount in rows:
        assert owner_attempt is not None and attempt == owner_attempt, (key, owner_attempt)
        assert amount == 1, key
    doubles = await fetch(
        conn,
        "SELECT run_id, step_key FROM wq_charges GROUP BY 1, 2 HAVING count(*) > 1",
    )
    assert doubles == []


async def test_four_workers_on_one_org_budget_never_overspend_even_when_killed(
    db_url: str, tmp_path: Path
) -> None:
    steps, n_runs, workers_n = 5, 24, 4
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await prepare(conn)
        await costs.set_budget(conn, org=ORG, limit=60)
        async with workers(db_url, tmp_path, workers_n) as ws:
            run_ids = [
                await submit(conn, "small", {"steps": steps, "delay_s": 0.2}) for _ in range(n_runs)
            ]

            async def all_settled() -> bool:
                return await settled(conn, run_ids)

            await eventually(all_settled, "every run to finish or pause", DEADLINE_S)
            # Estimates match charges: never past the limit (at most one estimate per
            # worker past it, whatever the interleaving, is what the design promises).
            spent = await charged(conn)
            assert 60 - workers_n <= spent <= 60 + workers_n
            assert spent == 60  # with estimates equal to charges, exactly the limit
            await check_once(conn)

            # Raise it, and kill workers in the middle of steps (SIGKILL), twice.
            await costs.set_budget(conn, org=ORG, limit=90)
            rng = random.Random(7)
            for round_ in range(2):
                await asyncio.sleep(0.1 + rng.random() * 0.1)
                victim = ws[round_]
                victim.signal(signal.SIGKILL)
                await victim.proc.wait()
                ws[round_] = await start_worker(db_url, tmp_path, f"w{round_}-{round_ + 1}")
            await eventually(all_settled, "every run to settle after the kills", DEADLINE_S)
            lost = "SELECT count(*) FROM wq_attempts WHERE outcome = 'lease_expired'"
            assert await one(conn, lost) >= 1  # the kills met attempts in flight
            spent = await charged(conn)
            assert spent <= 90 + workers_n
            await check_once(conn)
            (org_budget,) = await costs.list_budgets(conn, org=ORG)
            assert org_budget.spent == spent  # the budget's count is the charges' sum

            await costs.set_budget(conn, org=ORG, limit=1000)

            async def all_succeeded() -> bool:
                found = [await runs.get(conn, r) for r in run_ids]
                return all(r.state == "succeeded" for r in found)

            await eventually(all_succeeded, "every run to succeed", DEADLINE_S)
        assert await charged(conn) == steps * n_runs
        await check_once(conn)
        # A step whose attempt was killed after its paid call and before its receipt ran
        # again (the provider would see its idempotency key twice): charged once all the same.
        calls = await one(conn, "SELECT count(*) FROM cost_calls")
        assert calls >= steps * n_runs
