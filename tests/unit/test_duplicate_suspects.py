"""A resumed attempt (the one before was cut short) counts the first steps it executes as
duplicate suspects: the attempt before may have been in their middle. Replays never
count, nor does anything after the first execution (worker.context, worker.instruments)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from worker import instruments
from worker.context import RunContext, RunInfo


class Receiver:
    """The runtime's answers for a run whose step `done` settled before this attempt."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call(
        self, action: str, payload: dict[str, Any], *, idempotency_key: str | None = None
    ) -> Any:
        self.calls.append(action)
        if action == "runtime_receipts_settled":
            return {"complete": True, "receipts": {"done": {"status": "completed", "result": 0}}}
        if action == "runtime_receipt_record":
            return {
                "outcome": "execute",
                "stepKey": payload["stepKey"],
                "result": payload["result"],
            }
        if action == "runtime_receipts_complete":
            keys = [key for key, _ in payload["results"]]
            return {"completed": keys, "already": [], "busy": []}
        raise AssertionError(action)


def context(play: str, *, resumed: bool) -> RunContext:
    info = RunInfo(
        uuid.uuid4(), 2, "org", play, "r-t", "t", "w1", datetime.now(UTC), resumed=resumed
    )
    return RunContext(info, {}, Receiver())


def counted(play: str) -> float:
    return float(instruments.DUPLICATE_SUSPECTS.labels(play)._value.get())


@pytest.mark.parametrize("resumed", [True, False])
async def test_the_first_executed_step_of_a_resumed_attempt_is_a_suspect(resumed: bool) -> None:
    play = f"suspects-{uuid.uuid4().hex[:8]}"
    ctx = context(play, resumed=resumed)

    async def one() -> int:
        return 1

    assert await ctx.step("done", one) == 0  # replayed: never a suspect
    assert await ctx.step("charge", one) == 1  # the first executed
    assert await ctx.step("after", one) == 1
    await ctx.complete_steps([("row:a", 1), ("row:b", 2)])
    expected = 1 if resumed else 0
    assert ctx.duplicate_suspects == expected
    assert counted(play) == expected


async def test_a_resumed_attempt_that_starts_with_a_page_counts_the_page() -> None:
    play = f"suspects-{uuid.uuid4().hex[:8]}"
    ctx = context(play, resumed=True)
    await ctx.complete_steps([("row:a", 1), ("row:b", 2), ("row:c", 3)])
    await ctx.complete_steps([("row:d", 4)])
    assert ctx.duplicate_suspects == 3 and counted(play) == 3


def test_a_sandbox_report_is_counted_within_bounds() -> None:
    play = f"suspects-{uuid.uuid4().hex[:8]}"
    before = instruments.ABSORBED_CALLS.labels("runtime_receipt_record")._value.get()
    instruments.from_sandbox(
        play,
        {
            "absorbed": {"runtime_receipt_record": 2, "not_an_action": 5, "runtime_now": -1},
            "duplicate_suspects": 4,
        },
    )
    instruments.from_sandbox(play, {"duplicate_suspects": 10**9})  # forged: ignored
    instruments.from_sandbox(play, "not a dict")
    after = instruments.ABSORBED_CALLS.labels("runtime_receipt_record")._value.get()
    assert after - before == 2
    assert counted(play) == 4
