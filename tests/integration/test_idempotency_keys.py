"""A paid call retried after its attempt failed is charged once: the play hands the
provider the step's idempotency key (``ctx.step_idempotency_key``), the same in every
attempt of the run and different in every other run.

The provider is a real HTTP server on loopback that honours ``Idempotency-Key`` as Stripe
does (a key it has seen answers the first charge again, charging nothing) and counts
charges and calls. The play calls it inside a step, from a worker thread, and its first
attempt fails after the call returned and before the step's receipt was written: the
window a crash leaves, where the step runs again."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from queues import lanes, receipts
from tests.providers import Provider, charge, serving
from tests.workers import eventually, fetch, running_worker, submit
from worker.context import RunContext, RunInfo
from worker.plays import Registry, load_registry

RELEASE = "idem"
registry = Registry()


@registry.play("pay")
async def pay(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """Charges once in a step; attempt 1 fails after the provider answered (before the
    receipt), as a crash there would leave it. Also names each row's key."""

    def body() -> dict[str, Any]:
        key = ctx.step_idempotency_key
        paid = charge(params["provider"], key, str(ctx.run_id), int(params["amount"]))
        if ctx.attempt == 1:
            raise ConnectionError("lost after the provider answered")
        return paid | {"key": key}

    paid = await ctx.step("charge", body)
    rows = {k: ctx.idempotency_key(f"row:{k}") for k in params.get("rows", [])}
    return {"charge": paid, "rows": rows, "outside": ctx.idempotency_key("charge")}


@pytest.fixture
def provider() -> Iterator[Provider]:
    with serving() as server:
        yield server


async def _result(url: str, run_id: uuid.UUID) -> dict[str, Any] | None:
    rows = await fetch(url, "SELECT state::text, result FROM wq_runs WHERE id = %s", (run_id,))
    state, result = rows[0]
    assert state not in ("failed", "cancelled"), (state, result)
    return result if state == "succeeded" else None


async def test_a_retried_paid_call_is_charged_once(db_url: str, provider: Provider) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, RELEASE)
        await lanes.set_policy(conn, RELEASE, retry_base_s=0.05)
    params = {"provider": provider.url, "amount": 500, "rows": ["a", "b"]}
    async with running_worker(db_url, registry, release=RELEASE):
        first = await submit(db_url, "pay", params, release=RELEASE)
        second = await submit(db_url, "pay", params, release=RELEASE)  # the same params
        one = await eventually(lambda: _result(db_url, first), timeout=30)
        two = await eventually(lambda: _result(db_url, second), timeout=30)

    attempts = await fetch(
        db_url,
        "SELECT run_id, count(*) FROM wq_attempts WHERE run_id = ANY(%s) GROUP BY 1",
        ([first, second],),
    )
    assert {run: n for run, n in attempts} == {first: 2, second: 2}
    # Each run's body ran twice (attempt 1's call, then attempt 2's) under one key...
    calls: dict[str, list[str]] = {}
    for run, key in provider.calls:
        calls.setdefault(run, []).append(key)
    assert sorted(calls) == sorted([str(first), str(second)])
    for run in calls.values():
        assert len(run) == 2 and run[0] == run[1], calls
    # ...so the provider charged each run once, and the retry got the first charge back.
    assert len(provider.charges) == 2
    assert calls[str(first)][0] != calls[str(second)][0]
    assert one["charge"]["id"] == provider.charges[one["charge"]["key"]]["id"]
    assert one["charge"]["key"] == calls[str(first)][0] == one["outside"]
    # A row's key: stable for the run, distinct per row and per run.
    assert len(set(one["rows"].values()) | set(two["rows"].values())) == 4


def test_the_key_follows_the_receipt_not_the_attempt() -> None:
    def ctx(run: uuid.UUID, attempt: int, org: str = "acme", play: str = "pay") -> RunContext:
        info = RunInfo(run, attempt, org, play, "r-x", "x", "w", datetime.now(UTC))
        return RunContext(info, {}, transport=None)  # type: ignore[arg-type]

    run, other = uuid.uuid4(), uuid.uuid4()
    key = ctx(run, 1).idempotency_key("charge")
    assert key == ctx(run, 7).idempotency_key("charge")
    assert key.startswith("wq-") and len(key) == 43 and str(run) not in key
    assert key != ctx(other, 1).idempotency_key("charge")
    assert key != ctx(run, 1, org="globex").idempotency_key("charge")
    assert key != ctx(run, 1, play="refund").idempotency_key("charge")
    assert key != ctx(run, 1).idempotency_key("charge#2")
    # A named scope is shared by the runs of an org and play, as its receipts are.
    shared = ctx(run, 1).idempotency_key("charge", scope="customer-42")
    assert shared == ctx(other, 3).idempotency_key("charge", scope="customer-42")
    assert shared != key
    with pytest.raises(RuntimeError, match="inside a step"):
        _ = ctx(run, 1).step_idempotency_key


async def test_a_sandboxed_play_hands_out_the_same_keys(db_url: str) -> None:
    """A sandboxed play (no database, the gateway only) computes the same keys."""
    sandboxed = load_registry("tests.apps.scheduling_sandboxed:registry")
    run_id = await submit(db_url, "sandboxed-keys", release="sbxkeys", org="acme")
    async with running_worker(db_url, sandboxed, release="sbxkeys", token_secret=b"k" * 48):
        result = await eventually(lambda: _result(db_url, run_id), timeout=60)
    expected = receipts.idempotency_key(
        "acme", "sandboxed-keys", receipts.Scope.of_run(run_id), "charge"
    )
    assert result == {"named": expected, "in_step": expected}
