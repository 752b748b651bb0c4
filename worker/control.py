"""Control messages, taken as hints: a message on the control channel names a run to look
at, never an order (anyone who can connect can NOTIFY any channel). A run of this worker's
it names is looked up; only a durable cancel request, read from the database, stops its
attempt. Missed or not, the next heartbeat reports the request too.

The lookups are one statement per round: names that come during a round wait for the
next, so a flood of messages costs one small read at a time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import structlog

from queues import runs, transport
from worker.attempt import Connection
from worker.outage import TRANSIENT
from worker.slots import Live, Slots

log = structlog.get_logger("worker.control")


class CancelChecks:
    """Looks up the cancel requests of the runs control messages name (:meth:`heard`), and
    calls ``cancel`` for each live attempt whose run has one; ``checked`` after each
    round's read."""

    def __init__(
        self,
        connection: Connection,
        *,
        worker_id: str,
        slots: Slots,
        stopping: asyncio.Event,
        cancel: Callable[[Live], None],
        checked: Callable[[], None],
    ) -> None:
        self._connection = connection
        self._worker_id = worker_id
        self._slots = slots
        self._stopping = stopping
        self._cancel = cancel
        self._checked = checked
        self._named: set[uuid.UUID] = set()  # runs named, to look up
        self.checking: asyncio.Task[None] | None = None  # the lookup under way

    def heard(self, payload: str) -> None:
        """A control message's payload: look its run up if it is a live attempt of ours."""
        run_id = transport.cancel_request(payload)
        if run_id is None:
            return
        live = self._slots.live.get(run_id)
        if live is None or live.stop_reason is not None or live.finishing:
            return
        self._named.add(run_id)
        if self.checking is None or self.checking.done():
            self.checking = asyncio.create_task(self.check(), name="control")

    async def check(self) -> None:
        """Read the durable cancel requests of the runs named so far, round after round."""
        while self._named and not self._stopping.is_set():
            named, self._named = self._named, set()
            leases = [
                (run_id, live.claimed.attempt)
                for run_id in named
                if (live := self._slots.live.get(run_id)) is not None
                and live.claimed.attempt is not None
            ]
            try:
                async with self._connection() as conn:
                    requested = await runs.cancel_requested(
                        conn, worker_id=self._worker_id, leases=leases
                    )
            except TRANSIENT as exc:
                log.warning("cancel_check_failed", error=repr(exc)[:300])
                return  # the heartbeat reports a real request all the same
            self._checked()
            for run_id, attempt_no in leases:
                live = self._slots.live.get(run_id)
                if live is None or live.claimed.attempt != attempt_no:
                    continue
                if (run_id, attempt_no) in requested:
                    if live.stop_reason is None:
                        self._cancel(live)
                else:
                    log.warning(
                        "control_message_ignored",
                        run_id=str(run_id),
                        reason="its run has no cancel request",
                    )
