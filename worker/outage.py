"""Database outages: how a long-lived process rides out a lost database, and when it stops.

A restart, a failover to a standby, a pooler's reconnect or an administrator's
``pg_terminate_backend`` cuts every connection of a process at once. A long-lived process
(a worker's loops, ``worker recover --every``, the projector, ``worker result --wait``,
``worker observe``, ``worker events --follow``) reconnects and goes on; one whose database
does not answer again within its ``--max-outage`` ends with ``DATABASE_LOST`` (exit 6), at
that time, so a supervisor restarts it or a caller retries (docs/design.md, section 11c).

- :class:`Downtime` is the process's one account of an outage: since when nothing has
  answered (the first failure no success followed, whichever part of the process saw
  them). At ``limit_s`` it declares the database lost, once, on a timer, so the end comes
  on time even while every part is stuck in a connect; ``on_lost`` tells its owner.
  Several clocks that each restarted with their own loop's failure, and each gave the
  last write of a stop another full limit, once kept a worker alive for more than twice
  its limit.
- :class:`Outage` is one loop's side: its backoff (0.1 s doubling to 2 s, never sleeping
  past the limit), its log lines (``database_unavailable``, ``database_reconnected``),
  and :meth:`Outage.bounded`, which ends a reconnect that would outlast the limit.
- :func:`riding` runs a client's work on a session of its own and runs it again on a new
  session when the connection is lost (what :func:`worker.blips.is_blip` calls a
  blip), until the outage passes its limit. Its first connection is not retried: a URL
  that never answered is reported at once.

With a multi-host URL (``host=a,b ... target_session_attrs=read-write``) every new
connection finds the server that now takes writes, so a failover is an outage as long as
the promotion takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg_pool import PoolTimeout

from queues.errors import DatabaseLost
from worker import db
from worker.blips import is_blip

log = structlog.get_logger("worker.outage")

T = TypeVar("T")

MAX_OUTAGE_S = 60.0  # the default --max-outage of every long-lived command
# What a worker's loops retry through an outage: the database, or a pooled connection to
# it, did not answer.
TRANSIENT = (psycopg.OperationalError, PoolTimeout)
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0


class Downtime:
    """Since when the database has not answered this process, and whether it is lost."""

    def __init__(
        self, limit_s: float, *, on_lost: Callable[[DatabaseLost], None] | None = None
    ) -> None:
        self.limit_s = limit_s
        self.since: float | None = None
        self.lost: DatabaseLost | None = None
        self._on_lost = on_lost
        self._timer: asyncio.TimerHandle | None = None
        self._first: tuple[str, str] = ("", "")  # the part that failed first, and its error

    @property
    def failing(self) -> bool:
        """Whether an outage is under way (the last word of the database was a failure)."""
        return self.since is not None

    def down_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def left(self) -> float:
        """Seconds until the outage reaches the limit (infinite while none is under way)."""
        if self.since is None:
            return math.inf
        return max(0.0, self.since + self.limit_s - time.monotonic())

    def failed(self, part: str, exc: BaseException) -> None:
        """``part`` met a failure of the database: the outage starts now unless one is under
        way. Past the limit the database is lost (from then on nothing resets it)."""
        if self.lost is not None:
            return
        if self.since is None:
            self.since = time.monotonic()
            lines = str(exc).strip().splitlines()
            self._first = (part, lines[0][:300] if lines else type(exc).__name__)
            with contextlib.suppress(RuntimeError):  # no running loop: checked at each failure
                self._timer = asyncio.get_running_loop().call_later(self.limit_s, self._expire)
        elif self.left() <= 0:
            self._expire()

    def ok(self) -> None:
        """The database answered: the outage, if any, is over (unless it was declared lost)."""
        if self.lost is not None or self.since is None:
            return
        self.since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        if self.lost is not None or self.since is None:
            return
        part, error = self._first
        self.lost = DatabaseLost(
            f"the database did not answer for {self.down_s():.1f}s, past the outage limit "
            f"of {self.limit_s:g}s (--max-outage); {part} lost it first: {error}",
            field="--max-outage",
            rule="an outage shorter than this is ridden out; a longer one ends the process",
            fix="bring Postgres back (or finish its failover); a supervisor restarts this "
            "process; raise --max-outage to ride out longer outages",
        )
        if self._on_lost is not None:
            self._on_lost(self.lost)


class Outage:
    """One loop's side of an outage: its backoff and log lines; the account is ``downtime``
    (the process's; one of its own when none is given). ``stop``: a sleep between tries
    ends when it is set."""

    def __init__(
        self,
        name: str,
        downtime: Downtime | None = None,
        *,
        limit_s: float = MAX_OUTAGE_S,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self.downtime = downtime if downtime is not None else Downtime(limit_s)
        self.stop = stop
        self.delay = FIRST_DELAY_S
        self.since: float | None = None  # this loop's own failures

    def ok(self) -> None:
        if self.since is not None:
            log.info(
                "database_reconnected",
                loop=self.name,
                outage_s=round(time.monotonic() - self.since, 2),
            )
        self.since = None
        self.delay = FIRST_DELAY_S
        self.downtime.ok()

    async def failed(self, exc: BaseException, *, until: float | None = None) -> None:
        """Account for a failure, then wait before the next try; raises
        :class:`~queues.errors.DatabaseLost` once the outage has passed its limit. The
        wait ends at the limit, at ``stop``, and at ``until`` (a monotonic time)."""
        self.downtime.failed(self.name, exc)
        if self.downtime.lost is not None:
            raise self.downtime.lost from exc
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        log.warning(
            "database_unavailable",
            loop=self.name,
            error=str(exc).strip()[:300],
            down_s=round(self.downtime.down_s(), 2),
            limit_s=self.downtime.limit_s,
        )
        wait = min(self.delay, self.downtime.left())
        if until is not None:
            wait = min(wait, max(0.0, until - now))
        self.delay = min(self.delay * 2, MAX_DELAY_S)
        if self.stop is None:
            await asyncio.sleep(wait)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), wait)
        if self.downtime.left() <= 0:
            self.downtime.failed(self.name, exc)
            if self.downtime.lost is not None:
                raise self.downtime.lost from exc

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """While an outage is under way, end the block at its limit (a reconnect to a host
        that does not answer waits for its connect timeout, once per host of the URL) and
        raise :class:`~queues.errors.DatabaseLost` instead."""
        left = self.downtime.left()
        if math.isinf(left):
            yield
            return
        timeout = asyncio.timeout(left)
        try:
            async with timeout:
                yield
        except TimeoutError as exc:
            if not timeout.expired():
                raise
            self.downtime.failed(self.name, exc)
            lost = self.downtime.lost
            if lost is None:  # the timer has not run yet: the limit is reached all the same
                self.downtime._expire()
                lost = self.downtime.lost
            assert lost is not None
            raise lost from exc


async def riding(
    url: str,
    work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]],
    outage: Outage,
    *,
    until: float | None = None,
    application: str | None = None,
) -> T | None:
    """``work(conn)`` on an autocommit session of its own; when the connection is lost,
    ``work`` runs again on a new one (it keeps its own progress, and calls
    ``outage.ok()`` once the database answered), until the outage passes its limit
    (:class:`~queues.errors.DatabaseLost`). None when the monotonic time ``until`` passes
    while the database is away. An error that is not a lost connection is raised as it is;
    so is a failure of the first connection."""
    connected = False
    while True:
        try:
            async with outage.bounded():
                conn = await db.connect(url, autocommit=True, application=application)
            connected = True
            try:
                return await work(conn)
            finally:
                await conn.close()
        except DatabaseLost:
            raise
        except Exception as exc:
            if not connected or not is_blip(exc):
                raise
            await outage.failed(exc, until=until)
            if until is not None and time.monotonic() >= until:
                return None
