"""The producer: every claim of a worker goes through it, and it starts what it claims.

A claim asks for what there is room for (:meth:`worker.slots.Slots.room`), one at a time
(``claim_lock``). Three things make a claim: the claim loop (:meth:`run`: a slot freed, a
poll every ``poll_s``, a wake for anything else), and a job's wake heard by the LISTEN
session (:meth:`on_wake`), claimed in the session's turn that read it when the loop waits
for work (:meth:`claim_woken`: the claim goes out before anything else the event loop has
ready). A wake meant for this worker alone that comes with no room is passed on to the
lanes' other claimers (:meth:`pass_on`, migration 0032). Claimed runs start while slots
are free (:meth:`fill`, through ``start``, the executor's); the rest wait claimed ahead,
and those claimed ahead for short plays that still wait after a hold are handed back
(:meth:`expire_ahead`). The claim's statement neither notifies ``wq_run_events`` nor
folds the starts into the progress sink; the runs it took are announced
:data:`ANNOUNCE_AFTER_S` later, in one statement, but those whose final write (which
notifies and folds) is already under way by then, and a run claimed ahead once it
plays (:meth:`announce`).

Its signals: ``wake`` (look for work now), ``capacity`` (a slot freed), ``targeted`` (a
wake for this worker alone came since its last claim), ``idle`` (the loop waits for work)
and ``poll`` (the end of that wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import psycopg
import structlog

from queues import runs, transport
from queues.outcomes import FinishStatus
from worker.attempt import Connection
from worker.outage import TRANSIENT, Downtime, Outage
from worker.slots import Slots

log = structlog.get_logger("worker.producer")

# A run claimed ahead for short plays waits for a slot at most this many times the bound.
AHEAD_HOLD_FACTOR = 20
# A listening worker's first claim waits this long at most for its liveness lock.
FIRST_CLAIM_WAIT_S = 5.0
# The runs a claim took are announced (wq_run_events' listeners, the progress sink) this
# long after it: off the way to the play's first line, and never for a run that ended by
# then.
ANNOUNCE_AFTER_S = 0.1


def retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a hand-back's outcome seen: nobody waits for it, and a refusal or a lost
    database is already the fence's and the outage's business."""
    if not future.cancelled():
        future.exception()


class Producer:
    def __init__(
        self,
        connection: Connection,
        *,
        slots: Slots,
        lanes: Sequence[str],
        worker_id: str,
        plays: Iterable[str],
        poll_s: float,
        stopping: asyncio.Event,
        downtime: Downtime,
        stats: dict[str, int],
        track: Callable[[uuid.UUID, int], None],
        start: Callable[[runs.Claimed], None],
        hand_back: Callable[[list[runs.Claimed], str], list[asyncio.Future[FinishStatus]]],
    ) -> None:
        self._connection = connection
        self.slots = slots
        self._lanes = list(lanes)
        self._worker_id = worker_id
        self._plays = sorted(plays)
        self._poll_s = poll_s
        self._stopping = stopping
        self._downtime = downtime
        self.stats = stats
        self._track = track
        self._start = start
        self._hand_back = hand_back
        self.wake = asyncio.Event()
        self.capacity = asyncio.Event()
        self.targeted = False  # a wake for this worker alone came since its last claim
        self.claim_lock = asyncio.Lock()  # one claim at a time (claim)
        self.idle = False  # the claim loop waits for a wake (claim_woken)
        self.poll: asyncio.Timeout | None = None  # the end of that wait (its poll)
        # Wakes being passed on and announcements under way (the stop waits for them).
        self.background: set[asyncio.Task[None]] = set()
        self.unannounced: dict[uuid.UUID, int] = {}  # claimed, not announced: run -> attempt
        self._announcement: asyncio.TimerHandle | None = None  # the next one
        self.procrastinate_id: int | None = None  # the worker's row in procrastinate's table

    async def on_wake(self, targeted: bool) -> None:
        """A job's wake, heard by the LISTEN session (``targeted``: on this worker's own
        channel, chosen as a waiting worker): claimed here when the claim loop waits for
        work (:meth:`_claim_woken`), else the claim loop is woken. A targeted wake with no
        room is passed on (also when the claim under way fills the slots: _claim_loop)."""
        if targeted:
            self.targeted = True
            if self._stopping.is_set() or self.slots.room() <= 0:
                self._in_background(self.pass_on())
        if not await self.claim_woken():
            self.wake.set()

    async def claim_woken(self) -> bool:
        """Claim for a wake right here, in the LISTEN loop's turn that read it, when the
        claim loop is waiting for work: the claim goes out before anything else the
        event loop has ready (a hop to the claim loop's task queued it behind them).
        False: the claim loop is busy or there is no room; it is woken instead."""
        if not self.idle or self.claim_lock.locked() or self.slots.room() <= 0:
            return False
        try:
            got, want = await self.claim()
        except TRANSIENT as exc:
            log.warning("claim_on_wake_failed", error=repr(exc)[:300])
            return False  # the claim loop claims, and accounts for the outage
        self.stats["claims_on_wake"] += bool(want)
        if want and got >= want:
            self.wake.set()  # it took all it asked for: the claim loop looks for more
        elif self.poll is not None and not self.poll.expired():
            # A claim has just looked: the claim loop's next poll is a period from now, as
            # after a claim of its own (else an idle worker woken in turns polled in vain).
            # A poll that came due during this claim is already cancelling the claim loop's
            # wait and can no longer be moved (asyncio raises): that loop claims next.
            self.poll.reschedule(asyncio.get_running_loop().time() + self._poll_s)
        return True

    async def run(self, *, after: asyncio.Event | None = None) -> None:
        """The claim loop, until the worker stops. With ``after`` (the worker listens: its
        LISTEN session holds its liveness lock), the first claim waits for it, at most
        :data:`FIRST_CLAIM_WAIT_S`: a worker killed right after its first claim is then
        known gone at once and its runs rescued within seconds (worker.peers), not when
        their leases lapse. Past the bound (a LISTEN session that cannot start) it claims
        on polls all the same."""
        if after is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_CLAIM_WAIT_S):
                    await after.wait()
        outage = Outage("claim", self._downtime)
        while not self._stopping.is_set():
            # Cleared before the slots are counted, so a slot freed from here on (also
            # during the pass-on's round trip) is seen by the wait below, never lost.
            self.capacity.clear()
            want = self.slots.room()
            if want <= 0:
                # Woken as a waiting worker after the claim that filled the slots began:
                # another worker takes the job (migration 0032).
                await self.pass_on()
                await self.capacity.wait()
                continue
            try:
                got, want = await self.claim()
            except TRANSIENT as exc:
                await outage.failed(exc)
                continue
            outage.ok()
            if got < want and not self._stopping.is_set():
                # Waiting for work. A wake that comes now is claimed in the LISTEN
                # session's turn that read it (_on_wake); this loop claims again at the
                # next poll, or when woken for anything else.
                self.idle = True
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._poll_s) as self.poll:
                            await self.wake.wait()
                finally:
                    self.idle = False
                    self.poll = None

    async def claim(self) -> tuple[int, int]:
        """One claim of what there is room for (:meth:`Slots.room`, counted once the claim
        before it has landed); starts what fits in the free slots and keeps the rest
        claimed ahead. Claims are one at a time: the claim loop's, or the LISTEN loop's
        for a wake that came while the claim loop was waiting (:meth:`_claim_woken`).
        Returns how many runs it took and how many it asked for."""
        async with self.claim_lock:
            want = self.slots.room()
            if want <= 0 or self._stopping.is_set():
                return 0, 0
            self.wake.clear()
            self.targeted = False  # this claim sees every job whose wake came before it
            async with self._connection() as conn:
                claimed = await runs.claim(
                    conn,
                    lanes=self._lanes,
                    worker_id=self._worker_id,
                    limit=want,
                    plays=self._plays,
                    procrastinate_worker=self.procrastinate_id,
                )
            self.stats["claims"] += 1
            self.stats["claims_empty"] += not claimed
            got = 0
            for c in claimed:
                if c.claimed:
                    assert c.attempt is not None
                    self._track(c.run_id, c.attempt)  # leased from its claim
                    self.slots.ahead.append(c)
                    self.unannounced[c.run_id] = c.attempt
                    got += 1
                else:
                    self.stats["dropped"] += 1
                    log.info("delivery_dropped", run_id=str(c.run_id), job_id=c.job_id)
            self.fill()
            if got:
                self._plan_announcement()
            if self.slots.ahead and not self.slots.prefetch_setting:
                # Claimed ahead for short plays: those still waiting when the hold ends go
                # back to the lane, where another worker may take them.
                asyncio.get_running_loop().call_later(
                    self.slots.ahead_under_s * AHEAD_HOLD_FACTOR,
                    self.expire_ahead,
                    {c.run_id for c in self.slots.ahead},
                )
            return got, want

    async def pass_on(self, *, leaving: bool = False) -> None:
        """Pass a wake meant for this worker alone on to the lanes' other claimers, when it
        came with no room left (or while stopping): the spawn woke no one else. The worker
        leaves the set of waiting workers first (also when ``leaving``: it is stopping), so
        the wake cannot come back to it."""
        targeted, self.targeted = self.targeted, False
        if not (targeted or leaving):
            return
        try:
            async with self._connection() as conn:
                await runs.stop_waiting(conn, self._worker_id)
                if targeted:
                    self.stats["wakes_passed_on"] += 1
                    await transport.wake(conn, self._lanes)
        except TRANSIENT as exc:  # the others' polls take the job
            log.warning("wake_pass_on_failed", error=repr(exc)[:300])

    def _plan_announcement(self) -> None:
        if self._announcement is None and not self._stopping.is_set():
            self._announcement = asyncio.get_running_loop().call_later(
                ANNOUNCE_AFTER_S, self.announce
            )

    def announce(self) -> None:
        """Announce the runs claimed since the last announcement that this worker still
        plays, their final writes not begun: one statement that NOTIFYs
        ``wq_run_events`` for their started attempts and folds the starts into the
        progress sink (:func:`queues.runs.announce`). A run that ended or began its final
        write is left out: that write notifies and folds. A run still claimed ahead is
        looked at again at the next announcement: announced once it plays, never if it is
        handed back first (the hand-back's write notifies). Best effort: an announcement
        lost to an outage or a stop leaves the listeners their poll, and the progress row
        its last state until the run's next state event (the final write, a lapse's)."""
        self._announcement = None
        claimed, self.unannounced = self.unannounced, {}
        ahead = {c.run_id: c.attempt for c in self.slots.ahead}
        due = []
        for run_id, attempt_no in claimed.items():
            live = self.slots.live.get(run_id)
            if live is not None and live.claimed.attempt == attempt_no and not live.finishing:
                due.append(run_id)
            elif ahead.get(run_id) == attempt_no:
                self.unannounced[run_id] = attempt_no
        if self.unannounced:
            self._plan_announcement()
        if due and not self._stopping.is_set():
            self._in_background(self._announce(due))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _announce(self, run_ids: list[uuid.UUID]) -> None:
        try:
            async with self._connection() as conn:
                await runs.announce(conn, run_ids)
            self.stats["announced"] += len(run_ids)
        except (*TRANSIENT, psycopg.Error) as exc:  # a hint: the listeners' poll covers it
            log.warning("announce_failed", runs=len(run_ids), error=repr(exc)[:300])

    def stop_announcing(self) -> None:
        """At the stop: no announcement any more (the final writes notify and fold)."""
        if self._announcement is not None:
            self._announcement.cancel()
            self._announcement = None
        self.unannounced.clear()

    def expire_ahead(self, run_ids: set[uuid.UUID]) -> None:
        """Hand back the runs claimed ahead for short plays that still wait for a slot after
        the hold: plays turned long, and another worker may start them now. Their final
        writes are queued here, synchronously, so the drain's last flush carries any that
        a stop overtakes."""
        stale = [c for c in self.slots.ahead if c.run_id in run_ids]
        if not stale or self._stopping.is_set():
            return  # started, dropped, or the drain hands them back
        for c in stale:
            self.slots.ahead.remove(c)
        self.slots.short_streak = 0  # the slots stopped turning over: claim only for free ones
        self.stats["ahead_expired"] += len(stale)
        for future in self._hand_back(stale, "claimed_ahead_expired"):
            future.add_done_callback(retrieved)

    def fill(self) -> None:
        """Start runs claimed ahead while slots are free; once stopping, none (they are
        handed back)."""
        while self.slots.ahead and not self._stopping.is_set() and self.slots.free():
            self._start(self.slots.ahead.popleft())
