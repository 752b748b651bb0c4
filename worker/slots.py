"""What a worker holds: its live attempts, the runs it claimed ahead and not started, and
how many runs its next claim may ask for. One record, no I/O: the runtime's loops change it
and read from it what to do.

A slot is held by an attempt whose play has not returned. An attempt whose play returned
waits for its batched final write without its slot (batched completion), up to a bound:
finishing attempts beyond ``concurrency + prefetch`` of them hold slots again, so a slow
database cannot make them pile up while new runs are claimed.

Claiming ahead (runs claimed beyond the free slots, started as slots free): ``prefetch``
runs when the worker was started with ``--prefetch``; else, while plays are short (the
last ``concurrency`` of them each returned within ``ahead_under_s``), four runs per slot.
Why that costs the lane nothing: a run waits ahead only while every slot is busy, and
slots whose plays return within the bound free one each within it, so a run claimed ahead
starts sooner than a fresh claim's round trip would let any worker start it, and the next
claim overlaps the running plays instead of following them. A play that takes longer ends
the streak at once (and no run is claimed ahead while the oldest play under way has
already taken longer); the runtime hands back the runs still waiting after a hold. Four
per slot: claims of a useful size (a claim's fixed cost is most of it at ten runs), each
run still started within about four plays.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from queues import runs

if TYPE_CHECKING:
    from worker.context import RunContext

CLAIM_BATCH_MAX = 64  # runs one claim asks for at most
AHEAD_PER_SLOT = 4  # runs claimed ahead for short plays, per slot


@dataclass(eq=False)
class Live:
    """An attempt under way on this worker."""

    claimed: runs.Claimed
    ctx: RunContext
    task: asyncio.Task[None]
    stop_reason: str | None = None  # cancel | lease_lost | handback | timeout
    finishing: bool = False  # the play is done; its final write (or cleanup) is under way
    timer: asyncio.TimerHandle | None = None  # stops the attempt at the run's timeout
    started: float = field(default_factory=time.perf_counter)  # when its task was made


class Slots:
    """A worker's slots: ``live`` attempts (in start order), runs claimed ``ahead``, how
    many live attempts have ``returned`` (finishing), and the ``short_streak`` of plays in a
    row that returned within ``ahead_under_s``."""

    def __init__(self, *, concurrency: int, prefetch: int, ahead_under_s: float) -> None:
        self.concurrency = concurrency
        self.prefetch_setting = prefetch  # --prefetch (0: claim ahead for short plays only)
        self.ahead_under_s = ahead_under_s  # 0: never claim ahead for short plays
        self.live: dict[uuid.UUID, Live] = {}
        self.ahead: deque[runs.Claimed] = deque()
        self.returned = 0
        self.short_streak = 0

    def taken(self, prefetch: int | None = None) -> int:
        """Attempts holding a slot: those whose play has not returned, and those finishing
        beyond ``concurrency + prefetch`` of them (``prefetch``: :meth:`prefetch`, when the
        caller has it already)."""
        if prefetch is None:
            prefetch = self.prefetch()
        return len(self.live) - min(self.returned, self.concurrency + prefetch)

    def free(self) -> bool:
        """Whether a run claimed ahead may start now."""
        return self.taken() < self.concurrency

    def prefetch(self) -> int:
        """How many runs to claim beyond the free slots now (the module's docstring)."""
        if self.prefetch_setting:
            return self.prefetch_setting
        if self.ahead_under_s <= 0 or self.short_streak < self.concurrency:
            return 0
        # A long play under way (the oldest live attempt's play, still running past the
        # bound) holds its slot: claim only for free slots until it returns.
        oldest = next(iter(self.live.values()), None)
        if (
            oldest is not None
            and not oldest.finishing
            and time.perf_counter() - oldest.started >= self.ahead_under_s
        ):
            return 0
        return self.concurrency * AHEAD_PER_SLOT

    def room(self) -> int:
        """How many runs the next claim asks for (0: none is due). Enough for the free
        slots; when claiming ahead, also the local queue's room, topped up in batches once
        it is down to half (not one claim per finished run)."""
        prefetch = self.prefetch()
        free = self.concurrency - self.taken(prefetch)
        queued = len(self.ahead)
        if free > queued or (prefetch and queued <= prefetch // 2):
            return min(free + prefetch - queued, CLAIM_BATCH_MAX)
        return 0

    def played(self, seconds: float) -> None:
        """A play returned after ``seconds``: it extends the streak of short plays, or, a
        long one, ends it (claim only for free slots from now on)."""
        self.short_streak = self.short_streak + 1 if seconds < self.ahead_under_s else 0
