"""A worker's stop, bounded so a supervisor's stop window holds (docs/deploy.md).

Running attempts get the grace (none once the database is lost: nothing they wrote would
land); the stop's own writes (the wake passed on, the hand-backs, the final writes, the
worker's stop record) get until the grace ends, and ``HANDBACK_S`` more while the database
answers. In an outage nothing waits for the database past the grace: what was not written
is left to the leases (the worker's end is seen by its peers, and each lease lapses at the
latest), and those runs are retried without spending a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from queues import runs
from queues.outcomes import FinishStatus
from worker.completer import BatchCompleter
from worker.contract import LocalTransport
from worker.outage import Downtime
from worker.producer import Producer, retrieved
from worker.slots import Slots

log = structlog.get_logger("worker.drain")

# After the grace, while the database answers: the hand-backs, the last final writes and
# the worker's own stop record (they take milliseconds then; docs/deploy.md counts a
# second). In an outage nothing waits for the database past the grace.
HANDBACK_S = 1.0

HandBack = Callable[[list[runs.Claimed], str], list[asyncio.Future[FinishStatus]]]


class StopClock:
    """How long the stop may still wait for the database."""

    def __init__(self, grace_s: float, downtime: Downtime) -> None:
        self.grace_s = grace_s
        self.downtime = downtime
        self.grace_end = 0.0

    def start(self) -> None:
        """The stop begins: the grace runs from now (none once the database is lost)."""
        lost = self.downtime.lost is not None
        self.grace_end = time.monotonic() + (0.0 if lost else self.grace_s)

    def left(self) -> float:
        """Seconds until the grace ends, plus HANDBACK_S unless an outage is under way."""
        end = self.grace_end + (0.0 if self.downtime.failing else HANDBACK_S)
        return max(0.0, end - time.monotonic())


async def drain(
    clock: StopClock,
    *,
    claiming: asyncio.Task[None] | None,
    producer: Producer,
    slots: Slots,
    hand_back: HandBack,
    transports: set[LocalTransport],
    completer: BatchCompleter,
) -> None:
    """Let running attempts finish within the grace, then hand the rest back."""
    clock.start()
    if claiming is not None and not claiming.done():
        # A claim under way when the stop came lands in the local queue: let it land,
        # then hand back everything claimed ahead.
        await asyncio.wait([claiming], timeout=clock.left())
    # And so does one the LISTEN loop made for a wake (no claim starts now), within the
    # same bound.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(clock.left()), producer.claim_lock:
            pass
    # Out of the set of waiting workers: spawns wake the others from now on.
    await settle([asyncio.ensure_future(producer.pass_on(leaving=True))], clock.left())
    ahead, slots.ahead = list(slots.ahead), deque()
    await settle(hand_back(ahead, "claimed_ahead_handed_back"), clock.left())
    while slots.live and time.monotonic() < clock.grace_end:
        await asyncio.sleep(0.05)
    for live in list(slots.live.values()):
        if not live.finishing and live.stop_reason is None:
            live.stop_reason = "handback"
            live.task.cancel()
    tasks = [live.task for live in slots.live.values()]
    if tasks:
        # Hand-backs and final writes need the database: within the stop's bound (the
        # leases lapse and recovery takes over for what was not written).
        _, pending = await asyncio.wait(tasks, timeout=clock.left())
        if pending:
            log.error(
                "shutdown_abandoned_attempts",
                count=len(pending),
                detail="their final writes did not land; their leases lapse and their "
                "runs are retried without spending a retry",
            )
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
    # Whatever way an attempt ended, its held connection is back before the pool closes.
    for held in list(transports):
        with contextlib.suppress(Exception):
            await held.aclose()
    transports.clear()
    await settle([asyncio.ensure_future(completer.flush())], clock.left())


async def record_stop(
    clock: StopClock,
    pool: AsyncConnectionPool[Any],
    worker_id: str,
    pending: Iterable[asyncio.Future[Any]],
) -> None:
    """The stop's last waits (``pending``: wakes being passed on, a cancel lookup), then the
    worker's own stop record, while the stop's bound allows."""
    await settle(pending, clock.left())
    left = clock.left()
    if left > 0:
        with contextlib.suppress(psycopg.Error, PoolTimeout, TimeoutError):
            async with asyncio.timeout(left), pool.connection(timeout=left) as conn:
                await runs.worker_stopped(conn, worker_id)


async def settle(futures: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Wait for ``futures`` at most ``timeout`` seconds; cancel those still pending (the
    stop does not wait for them), and mark every outcome seen."""
    futures = list(futures)
    if not futures:
        return
    pending = {f for f in futures if not f.done()}
    if pending and timeout > 0:
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for future in pending:
        future.cancel()
    if pending:
        await asyncio.wait(pending, timeout=1.0)
    for future in futures:
        if future.done():
            retrieved(future)
