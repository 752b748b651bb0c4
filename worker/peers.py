"""A worker's watch over its peers: between recovery passes, every heartbeat period, the
leases of workers that are gone (their LISTEN session ended: killed, crashed, exited) are
rescued, so a killed worker's runs, and the runs it claimed ahead, go back to their lanes
within seconds instead of when their leases lapse and a recovery pass comes
(:func:`queues.recovery.rescue_gone`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from queues import recovery
from worker.attempt import Connection
from worker.outage import TRANSIENT, Downtime

log = structlog.get_logger("worker.peers")


class Peers:
    """Rescues the leases of gone workers every ``period_s`` until ``stopping`` is set;
    ``rescued`` is called after a pass that rescued any (the runtime claims again). A
    failed pass counts in ``downtime`` (a worker whose slots are all busy claims nothing,
    and without a LISTEN session this may be the first to notice an outage)."""

    def __init__(
        self,
        connection: Connection,
        *,
        period_s: float,
        stopping: asyncio.Event,
        downtime: Downtime,
        rescued: Callable[[], None],
    ) -> None:
        self._connection = connection
        self.period_s = period_s
        self._stopping = stopping
        self._downtime = downtime
        self._rescued = rescued
        self.passes = 0  # passes made (each answered by the database)

    async def run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.period_s)
            if self._stopping.is_set():
                return
            await self.run_once()

    async def run_once(self) -> list[recovery.Rescued]:
        """One pass; the leases it rescued (none when the database did not answer)."""
        try:
            async with self._connection() as conn:
                rescued = await recovery.rescue_gone(conn)
        except TRANSIENT as exc:
            self._downtime.failed("peers", exc)
            return []
        self._downtime.ok()
        self.passes += 1
        for r in rescued:
            log.warning(
                "lease_rescued_owner_gone",
                run_id=str(r.run_id),
                attempt=r.attempt,
                next_state=r.state,
            )
        if rescued:
            self._rescued()
        return rescued
