"""``worker.testing.run_play``: a play run by the real executor against a real database, in
a transaction rolled back before it returns, with what it did to inspect."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from queues.errors import UnknownPlay
from queues.outcomes import FinishStatus
from worker import Fatal, Registry, RowCompletion
from worker.context import RunContext
from worker.testing import run_play

registry = Registry()
CALLS: list[str] = []  # the paid provider's calls, by idempotency key


def lookup(domain: str, key: str) -> dict[str, Any]:
    CALLS.append(key)
    return {"domain": domain, "size": len(domain)}


@registry.play("enrich")
async def enrich(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    sheet = ctx.sheet(f"leads-{ctx.run_id}")
    enriched = 0
    async for page in ctx.input_pages():
        await sheet.admit(page, stable_intent=True)
        done = []
        for key, row in page:
            step = f"lookup:{key}"
            found = await ctx.step(step, lookup, row["domain"], ctx.idempotency_key(step))
            done.append(RowCompletion(key, found))
            if params.get("fail_after") == key and ctx.attempt == 1:
                raise RuntimeError("the provider went away")
        await sheet.complete(done)
        enriched += len(done)
    return {"enriched": enriched}


@registry.play("refuses")
async def refuses(ctx: RunContext, params: dict[str, Any]) -> None:
    raise Fatal("bad params")


ROWS = [(str(i), {"domain": f"d{i}.example"}) for i in range(1, 4)]


@pytest.fixture(autouse=True)
def fresh_calls() -> None:
    CALLS.clear()


async def test_a_play_runs_with_its_steps_and_sheet_and_nothing_is_kept(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        played = await run_play(conn, registry, "enrich", inputs=ROWS)
        assert played.state == "succeeded", played.error
        assert played.result == {"enriched": 3}
        assert played.kinds[0] == "run_created" and played.kinds[-1] == "run_succeeded"
        assert sorted(s.step_key for s in played.steps) == ["lookup:1", "lookup:2", "lookup:3"]
        assert {s.status for s in played.steps} == {"completed"}
        assert [(s.admitted, s.committed) for s in played.sheets] == [(3, 3)]
        assert played.final_writes == [FinishStatus.APPLIED]
        assert len(CALLS) == 3
        # Rolled back: the run, its lane and its receipts are gone.
        cur = await conn.execute(
            "SELECT (SELECT count(*) FROM wq_runs), (SELECT count(*) FROM wq_lanes),"
            " (SELECT count(*) FROM wq_receipts)"
        )
        assert await cur.fetchone() == (0, 0, 0)


async def test_a_retry_replays_the_steps_the_first_attempt_paid_for(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        played = await run_play(
            conn, registry, "enrich", {"fail_after": "2"}, inputs=ROWS, attempts=3
        )
    assert played.state == "succeeded", played.error
    assert [a.outcome for a in played.attempts] == ["failed", "succeeded"]
    assert played.final_writes == [FinishStatus.APPLIED, FinishStatus.APPLIED]
    assert "retry_scheduled" in played.kinds
    # Rows 1 and 2 were paid by attempt 1 and replayed from their receipts by attempt 2.
    assert sorted(CALLS) == sorted(set(CALLS)) and len(CALLS) == 3


async def test_one_attempt_by_default_and_a_fatal_error_fails_the_run(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        retried = await run_play(conn, registry, "enrich", {"fail_after": "1"}, inputs=ROWS)
        assert retried.state == "queued" and len(retried.attempts) == 1
        failed = await run_play(conn, registry, "refuses", attempts=3)
    assert failed.state == "failed" and len(failed.attempts) == 1
    assert failed.error["type"] == "Fatal" and "bad params" in failed.error["message"]


async def test_a_play_the_registry_lacks_is_refused_before_anything_is_written(
    db_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        with pytest.raises(UnknownPlay) as refused:
            await run_play(conn, registry, "enrihc")
        assert refused.value.code == "PLAY_UNKNOWN" and "enrich" in refused.value.message
        cur = await conn.execute("SELECT count(*) FROM wq_lanes")
        assert await cur.fetchone() == (0,)


async def test_inside_a_callers_transaction_only_the_plays_writes_are_undone(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url) as conn, conn.transaction():
        await conn.execute("CREATE TABLE mine (n int)")
        await conn.execute("INSERT INTO mine VALUES (1)")
        played = await run_play(conn, registry, "enrich", inputs=ROWS[:1])
        assert played.state == "succeeded"
        cur = await conn.execute("SELECT (SELECT count(*) FROM mine), count(*) FROM wq_runs")
        assert await cur.fetchone() == (1, 0)
