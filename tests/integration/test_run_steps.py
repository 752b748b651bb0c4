"""A run's own steps through a real worker: one round trip each, replayed without one.

A step in the run's own scope is not claimed before it runs (worker.context explains why
the run's lease is enough): the attempt asks once which steps settled before it, replays
those without a call, and records each step it runs with one fenced claim-and-complete.
A failure is recorded against a claim; a step in a named scope keeps its claim. The
actions each attempt sends are read from the dispatch the in-process transport calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from queues import admission, lanes, operations, runs
from queues.authority import Claims
from queues.receipts import Scope
from tests import ledgers
from tests.workers import eventually, fetch, running_worker
from worker.context import RunContext
from worker.plays import Registry

RELEASE = "steps"
registry = Registry()
bodies: list[tuple[int, str]] = []  # (attempt, step) each time a step's body ran


def body(attempt: int, name: str) -> str:
    bodies.append((attempt, name))
    if name == "flaky" and attempt == 1:
        raise ValueError("the provider timed out")
    return f"{name}@{attempt}"


@registry.play("paid")
async def paid(ctx: RunContext, params: dict[str, Any]) -> list[str]:
    got = [await ctx.step(name, body, ctx.attempt, name) for name in ("a", "b", "c")]
    got.append(await ctx.step("quote", body, ctx.attempt, "quote", scope="shared"))
    got.append(await ctx.step("flaky", body, ctx.attempt, "flaky"))
    return got


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, str, str | None]]]:
    """Every runtime action an attempt sends: (attempt, action, step key)."""
    calls: list[tuple[int, str, str | None]] = []
    real = operations.perform

    async def recording(conn: Any, call: Any, claims: Claims) -> Any:
        ref = getattr(call, "ref", None)
        calls.append((claims.attempt, call.action, ref.step_key if ref else None))
        return await real(conn, call, claims)

    monkeypatch.setattr(operations, "perform", recording)
    bodies.clear()
    yield calls


async def test_run_steps_cost_one_call_each_and_replay_without_one(
    db_url: str, sent: list[tuple[int, str, str | None]]
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        admitted = await admission.submit(
            conn,
            admission.Submission(play="paid", release=RELEASE, max_attempts=3, retry="fixed:0s"),
        )
    run_id = admitted.run_id

    async def ended() -> runs.Run | None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            run = await runs.get(conn, run_id)
        return run if run.terminal else None

    async with running_worker(db_url, registry, release=RELEASE):
        run = await eventually(ended, timeout=30)
    assert (run.state, run.attempt) == ("succeeded", 2)
    assert run.result == ["a@1", "b@1", "c@1", "quote@1", "flaky@2"]
    # Every step's body ran once to completion; the failed one ran again.
    assert bodies == [(1, "a"), (1, "b"), (1, "c"), (1, "quote"), (1, "flaky"), (2, "flaky")]

    steps = [(a, action, key) for a, action, key in sent if "receipt" in action]
    assert steps == [
        (1, "runtime_receipts_settled", None),
        (1, "runtime_receipt_record", "a"),
        (1, "runtime_receipt_record", "b"),
        (1, "runtime_receipt_record", "c"),
        (1, "runtime_receipt_claim", "quote"),  # a named scope keeps its claim
        (1, "runtime_receipt_complete", "quote"),
        (1, "runtime_receipt_claim", "flaky"),  # a failure is recorded against a claim
        (1, "runtime_receipt_fail", "flaky"),
        (2, "runtime_receipts_settled", None),  # a, b, c and quote replay without a call
        (2, "runtime_receipt_claim", "quote"),
        (2, "runtime_receipt_record", "flaky"),
    ]
    rows = await fetch(
        db_url,
        "SELECT step_key, status::text, owner_attempt, result FROM wq_receipts"
        " WHERE scope = %s ORDER BY step_key",
        (Scope.of_run(run_id).key,),
    )
    assert rows == [
        ("a", "completed", 1, "a@1"),
        ("b", "completed", 1, "b@1"),
        ("c", "completed", 1, "c@1"),
        ("flaky", "completed", 2, "flaky@2"),
    ]
    failed = await ledgers.events(db_url, run_id, "step_failed")
    assert [(e.attempt, e.data["step"]) for e in failed] == [(1, "flaky")]
