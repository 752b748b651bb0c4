"""The worker's side of its leases: what the heartbeat's answers mean for what it holds.

The heartbeat thread (:mod:`worker.heartbeat`) renews the leases of the runs it tracks and
posts each answer to the event loop. Here, on the loop: a live attempt whose lease was not
renewed is lost (stopped; its fenced final write can no longer land), one whose run has a
durable cancel request is stopped for it, and a run claimed ahead whose lease lapsed is
forgotten (another attempt owns it now). Past the lease's TTL without an answer, every
lease is gone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import structlog

from queues import runs
from worker import executor
from worker.heartbeat import Beat, Heartbeat
from worker.slots import Live, Slots

log = structlog.get_logger("worker.leases")


class Leases:
    """The heartbeat's answers applied to ``slots``; ``heartbeat`` is set once it runs."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.heartbeat: Heartbeat | None = None

    def track(self, run_id: uuid.UUID, attempt: int) -> None:
        """Renew this lease from now on (a claimed run is leased from its claim)."""
        assert self.heartbeat is not None
        self.heartbeat.track(run_id, attempt)

    def untrack(self, claimed: Iterable[runs.Claimed]) -> None:
        """No longer renew these runs' leases (handed back, or never started)."""
        if self.heartbeat is not None:
            for c in claimed:
                self.heartbeat.untrack(c.run_id)

    def stop(self, live: Live, reason: str) -> None:
        """Stop a live attempt (``cancel``, ``timeout``, ``lease_lost``, ``handback``):
        :func:`worker.executor.stop`."""
        untrack = self.heartbeat.untrack if self.heartbeat is not None else None
        executor.stop(live, reason, untrack=untrack)

    def on_beat(self, beat: Beat) -> None:
        """The leases renewed of those sent. A live attempt whose lease was not renewed is
        lost, one whose run has a cancel request is stopped for it; a run claimed ahead
        whose lease lapsed is dropped."""
        kept = {r.run_id: r for r in beat.renewed}
        lapsed_ahead = {run_id for run_id, _ in beat.sent if run_id not in kept} & {
            c.run_id for c in self.slots.ahead
        }
        if lapsed_ahead:
            self._drop_ahead(lapsed_ahead)
        for run_id, attempt_no in beat.sent:
            live = self.slots.live.get(run_id)
            if live is None or live.claimed.attempt != attempt_no:
                continue
            renewal = kept.get(run_id)
            if renewal is None:
                self._lose([live])
            elif renewal.cancel and live.stop_reason is None:
                self.stop(live, "cancel")

    def on_silence(self, silent_s: float) -> None:
        """The watchdog: without renewals past the TTL every lease is gone."""
        log.warning("heartbeat_silent_past_ttl", silent_s=round(silent_s, 1))
        self._drop_ahead({c.run_id for c in self.slots.ahead})
        self._lose(self.slots.live.values())

    def describe(self) -> list[dict[str, Any]]:
        """The attempts running now (read from the heartbeat thread for lag reports)."""
        return [
            {"run_id": str(run_id), "play": live.claimed.play, "step": live.ctx.current_step}
            for run_id, live in list(self.slots.live.items())
        ]

    def _drop_ahead(self, run_ids: set[uuid.UUID]) -> None:
        """Forget runs claimed ahead whose lease is gone: another attempt owns them now."""
        for c in [c for c in self.slots.ahead if c.run_id in run_ids]:
            self.slots.ahead.remove(c)
            self.untrack([c])
            log.warning("lease_lost", run_id=str(c.run_id), attempt=c.attempt, started=False)

    def _lose(self, lost: Iterable[Live]) -> None:
        for live in list(lost):
            if live.stop_reason == "lease_lost":
                continue
            # A finishing attempt's fenced final write is under way, and its commit is
            # usually what ended the lease (a renewal sent just before its answer came
            # back); that write's own answer reports a lease really taken (``refused``).
            if not live.finishing:
                log.warning(
                    "lease_lost", run_id=str(live.claimed.run_id), attempt=live.claimed.attempt
                )
            self.stop(live, "lease_lost")
