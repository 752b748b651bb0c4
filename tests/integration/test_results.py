"""A play's result the database cannot store fails that run alone: the finish batch it
shares with other runs is written, and nothing is retried (the same code returns the same)."""

from __future__ import annotations

import uuid

import pytest

from tests.apps.plays import registry
from tests.workers import eventually, fetch, run_state, running_worker, submit

TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.mark.parametrize("kind", ["nul", "surrogate", "nan"])
async def test_an_unstorable_result_fails_its_run_not_the_batch(db_url: str, kind: str) -> None:
    bad = await submit(db_url, "unstorable", {"kind": kind}, release="res")
    good = [await submit(db_url, "echo", {"n": n}, release="res") for n in range(3)]
    async with running_worker(db_url, registry, release="res"):
        for run_id in (bad, *good):
            await eventually(lambda r=run_id: _terminal(db_url, r), timeout=30)
    [(state, attempt, error_type)] = await fetch(
        db_url, "SELECT state::text, attempt, error->>'type' FROM wq_runs WHERE id = %s", (bad,)
    )
    assert (state, attempt, error_type) == ("failed", 1, "ResultNotJSON")
    for run_id in good:
        assert await run_state(db_url, run_id) == "succeeded"


async def _terminal(url: str, run_id: uuid.UUID) -> bool:
    return await run_state(url, run_id) in TERMINAL
