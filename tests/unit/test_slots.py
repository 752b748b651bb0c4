"""What a worker holds and how much its next claim asks for (``worker.slots``), decided
without a database or an event loop."""

from __future__ import annotations

import time
import uuid
from typing import Any

from worker.slots import AHEAD_PER_SLOT, CLAIM_BATCH_MAX, Live, Slots


def live(slots: Slots, *, started: float | None = None, finishing: bool = False) -> None:
    entry = Live(claimed=Any, ctx=Any, task=Any, finishing=finishing)  # type: ignore[arg-type]
    if started is not None:
        entry.started = started
    slots.live[uuid.uuid4()] = entry


def test_a_claim_asks_for_the_free_slots() -> None:
    slots = Slots(concurrency=4, prefetch=0, ahead_under_s=0.0)
    assert (slots.room(), slots.taken(), slots.free()) == (4, 0, True)
    live(slots)
    live(slots)
    assert slots.room() == 2
    slots.ahead.extend([Any, Any])  # claimed, waiting for those two slots
    assert slots.room() == 0
    live(slots)
    live(slots)
    slots.ahead.clear()
    assert (slots.room(), slots.free()) == (0, False)


def test_a_returned_play_frees_its_slot_up_to_a_bound() -> None:
    slots = Slots(concurrency=2, prefetch=0, ahead_under_s=0.0)
    for _ in range(5):
        live(slots, finishing=True)
    slots.returned = 5  # five final writes waiting for their batch
    # Finishing attempts beyond concurrency + prefetch (2) hold slots again.
    assert slots.taken() == 3 and slots.room() == 0
    slots.returned = 2
    for _ in range(3):
        slots.live.popitem()
    assert slots.taken() == 0 and slots.room() == 2


def test_prefetch_keeps_a_local_queue_topped_up_in_batches() -> None:
    slots = Slots(concurrency=2, prefetch=10, ahead_under_s=0.0)
    assert slots.room() == 12  # the free slots and the queue
    slots.ahead.extend([Any] * 12)
    live(slots)
    live(slots)
    assert slots.room() == 0  # more than half the queue left
    for _ in range(7):
        slots.ahead.pop()
    assert len(slots.ahead) == 5 and slots.room() == 5  # down to half: top it up
    big = Slots(concurrency=100, prefetch=1000, ahead_under_s=0.0)
    assert big.room() == CLAIM_BATCH_MAX


def test_short_plays_are_claimed_ahead_until_one_runs_long() -> None:
    slots = Slots(concurrency=3, prefetch=0, ahead_under_s=0.05)
    for _ in range(2):
        slots.played(0.01)
    assert slots.prefetch() == 0  # a streak of fewer than concurrency plays
    slots.played(0.01)
    assert slots.prefetch() == 3 * AHEAD_PER_SLOT
    assert slots.room() == 3 + 3 * AHEAD_PER_SLOT
    live(slots, started=time.perf_counter() - 1.0)  # the oldest play under way runs long
    assert slots.prefetch() == 0
    slots.live.clear()
    slots.played(0.5)  # a long play ends the streak
    assert slots.prefetch() == 0 and slots.short_streak == 0
    never = Slots(concurrency=3, prefetch=0, ahead_under_s=0.0)
    for _ in range(10):
        never.played(0.0)
    assert never.prefetch() == 0
