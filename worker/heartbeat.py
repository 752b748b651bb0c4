"""The heartbeat: lease renewal from a thread of its own, and an event-loop lag watch.

Plays share the worker's event loop. A play that blocks it (synchronous code called from
an ``async def``) must not cost its run the lease: a lease lost because the worker blocked
is a bug, not a policy. So the heartbeat runs in its own thread, with its own event loop
and its own connection, and renews the leases of the worker's live attempts (and their
step leases) whatever the main loop is doing. What it learns is handed to the main loop
(``call_soon_threadsafe``): leases it could not renew (rescued, superseded, cancelled)
and cancel requests. When no renewal succeeded for longer than the lease TTL, it tells the
main loop to stop every attempt (the watchdog): the leases are gone by then.

Each beat it also pings the main loop. A ping not answered within ``lag_warn_s`` means the
loop is blocked: ``event_loop_blocked`` is logged with the plays and steps running then,
and ``event_loop_unblocked`` with the total once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog

from queues import receipts, runs

log = structlog.get_logger("worker.heartbeat")

LAG_WARN_S = 1.0


@dataclass(frozen=True, slots=True)
class Beat:
    """One round of renewals: the leases sent, and those the database renewed."""

    sent: tuple[tuple[uuid.UUID, int], ...]
    renewed: tuple[runs.Renewed, ...]


class Heartbeat:
    def __init__(
        self,
        *,
        url: str,
        worker_id: str,
        period_s: float,
        ttl_s: float,
        step_lease_s: float,
        loop: asyncio.AbstractEventLoop,
        on_beat: Callable[[Beat], None],
        on_silence: Callable[[float], None],
        describe: Callable[[], Sequence[dict[str, Any]]],
        lag_warn_s: float = LAG_WARN_S,
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        # The process's connection settings (worker.db.connect_kwargs): keepalives, the
        # pooler's rules; a connect timeout of its own unless they give one.
        self.connect_kwargs = dict(connect_kwargs or {"connect_timeout": 5})
        self.worker_id = worker_id
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.step_lease_s = step_lease_s
        self.lag_warn_s = lag_warn_s
        self._loop = loop
        self._on_beat = on_beat
        self._on_silence = on_silence
        self._describe = describe
        self._leases: dict[uuid.UUID, int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="wq-heartbeat", daemon=True)
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None  # the thread's one task (_run)
        self._wakeup: asyncio.Event | None = None
        self._ping_sent: float | None = None  # an unanswered ping to the main loop
        self._blocked_since: float | None = None
        self.beats = 0  # successful rounds (for tests and logs)
        self._last_ok = time.monotonic()  # the last successful round
        self._silence_reported = False  # the watchdog reported this silence already

    # ---- the main loop's side -----------------------------------------------------------

    def track(self, run_id: uuid.UUID, attempt: int) -> None:
        with self._lock:
            self._leases[run_id] = attempt

    def untrack(self, run_id: uuid.UUID) -> None:
        with self._lock:
            self._leases.pop(run_id, None)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread: a round under way is cancelled (in an outage it may be waiting
        for a connect or a statement for seconds, and a stop must not)."""
        self._stopping.set()
        own, task = self._own_loop, self._task
        if own is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: the thread ended
                own.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout)

    def _pong(self, sent: float) -> None:
        """Runs on the main loop: the answer to a ping. The end of a blocked stretch is
        reported here, the moment the loop answers, so a worker that stops right after
        still says how long its loop was blocked."""
        with self._lock:
            if self._ping_sent == sent:
                self._ping_sent = None
            blocked_since, self._blocked_since = self._blocked_since, None
        if blocked_since is not None:
            log.warning(
                "event_loop_unblocked", blocked_s=round(time.monotonic() - blocked_since, 2)
            )

    # ---- the thread ---------------------------------------------------------------------

    def _main(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # stopped (see stop)
            asyncio.run(self._run())

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        self._own_loop = asyncio.get_running_loop()
        if self._stopping.is_set():
            return  # stopped before it began
        self._wakeup = asyncio.Event()
        conn: psycopg.AsyncConnection[Any] | None = None
        last_ok = self._last_ok = time.monotonic()
        watchdog = asyncio.create_task(self._watchdog())
        try:
            while not self._stopping.is_set():
                self._watch_lag()
                with self._lock:
                    sent = tuple(self._leases.items())
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self.url, autocommit=True, **self.connect_kwargs
                        )
                    async with asyncio.timeout(max(self.period_s * 2, 2.0)):
                        renewed = await runs.heartbeat(conn, worker_id=self.worker_id, leases=sent)
                        await receipts.extend_for_attempts(
                            conn,
                            owner=self.worker_id,
                            leases=[(r.run_id, r.attempt) for r in renewed],
                            lease_s=self.step_lease_s,
                        )
                        await runs.worker_heartbeat(conn, self.worker_id)
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    if conn is not None:
                        await conn.close()
                    conn = None
                    silent = time.monotonic() - last_ok
                    log.warning(
                        "heartbeat_failed", error=repr(exc)[:300], silent_s=round(silent, 1)
                    )
                    if silent > self.ttl_s and not self._stopping.is_set():
                        self._post(self._on_silence, silent)
                else:
                    last_ok = self._last_ok = time.monotonic()
                    self._silence_reported = False
                    self.beats += 1
                    self._post(self._on_beat, Beat(sent, tuple(renewed)))
                await self._sleep(self.period_s)
        finally:
            watchdog.cancel()
            if conn is not None:
                await conn.close()

    async def _watchdog(self) -> None:
        """Report silence past the TTL also while a beat is stuck: a statement on a link
        that went silent, then psycopg's attempt to cancel it, can hold a beat for 10 s
        and more, and the attempts must stop when their leases lapse, not after."""
        while not self._stopping.is_set():
            await self._sleep(min(self.period_s, 0.5))
            silent = time.monotonic() - self._last_ok
            if silent > self.ttl_s and not self._silence_reported and not self._stopping.is_set():
                self._silence_reported = True
                self._post(self._on_silence, silent)

    async def _sleep(self, seconds: float) -> None:
        assert self._wakeup is not None
        try:
            async with asyncio.timeout(seconds):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the main loop is closed: the worker is gone
            self._stopping.set()

    def _watch_lag(self) -> None:
        now = time.monotonic()
        with self._lock:  # settled against _pong, which clears both under the same lock
            pending = self._ping_sent
            newly_blocked = (
                pending is not None
                and now - pending >= self.lag_warn_s
                and self._blocked_since is None
            )
            if newly_blocked:
                self._blocked_since = pending
            elif pending is None:
                self._ping_sent = now
        if newly_blocked:
            assert pending is not None
            log.warning(
                "event_loop_blocked",
                blocked_s=round(now - pending, 2),
                running=list(self._describe()),
                hint="a play runs blocking code on the event loop; pass it to ctx.step "
                "as a plain function (it then runs in a thread) or use asyncio.to_thread",
            )
        if pending is None:
            self._post(self._pong, now)
