"""The worker process: the composition root that builds its services, starts them and
drains them at the stop (docs/design.md, section 7).

procrastinate is the transport (:mod:`queues.transport`): runs are procrastinate jobs on
the lane (a procrastinate queue), inserted by admission. The services, each with its
own inputs and signals:

- :mod:`worker.producer`: every claim (polls, wakes, freed slots, an org cap), in
  batches: the transport takes up to N jobs, then one statement starts N attempts; a wake
  that comes while the claim loop waits is claimed in the LISTEN session's turn;
- :mod:`worker.executor`: one attempt from its start to its ending, in process or in an
  OS sandbox (:mod:`worker.sandbox`), turned into the final write by one rulebook
  (:mod:`worker.endings`);
- :mod:`worker.completer`: the final writes, batched (one fenced statement finishes N
  runs and their jobs) through outages;
- :mod:`worker.notifier`: the one LISTEN session (the lanes' jobs and cancels; a cancel
  message only names a run to look at, :mod:`worker.control`), behind a transaction-mode
  pooler with no ``listen_url`` the worker polls every ``poll_s``;
- the heartbeat thread (:mod:`worker.heartbeat`: a blocked event loop never costs a
  lease) and what its answers mean (:mod:`worker.leases`);
- maintenance: gone peers' leases (:mod:`worker.peers`), the recovery pass
  (:mod:`worker.recovery`), schedules (:mod:`worker.scheduler`), the outbox projector
  (:mod:`worker.projector`, polling inside a worker);
- before serving, :mod:`worker.startup`; at the stop, :mod:`worker.drain`.

Its connections are bounded (:mod:`worker.connections`: a pool, one LISTEN session, the
heartbeat, the projector and the maintenance worker; ``max_connections`` caps the sum).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from typing import Any

import structlog
from psycopg_pool import AsyncConnectionPool

from queues import lanes, outcomes, runs
from queues.errors import DatabaseLost, WorkerError
from queues.outcomes import FinishStatus
from worker import connections, db, files, projector, recovery, scheduler, startup, stopping
from worker.completer import BatchCompleter
from worker.config import pool_mode
from worker.context import STEP_LEASE_S
from worker.contract import PoolCheck
from worker.control import CancelChecks
from worker.drain import StopClock, drain, record_stop
from worker.executor import Executor
from worker.heartbeat import Heartbeat
from worker.leases import Leases
from worker.notifier import Notifier
from worker.outage import TRANSIENT, Downtime
from worker.peers import Peers
from worker.producer import Producer
from worker.settings import (
    CLAIM_AHEAD_UNDER_MAX_S,
    CLAIM_AHEAD_UNDER_S,
    POLL_INTERVAL_S,
    PREFETCH_MAX,
    Settings,
)
from worker.slots import Slots

__all__ = [
    "CLAIM_AHEAD_UNDER_MAX_S",
    "CLAIM_AHEAD_UNDER_S",
    "POLL_INTERVAL_S",
    "PREFETCH_MAX",
    "Settings",
    "Worker",
    "serve",
]

log = structlog.get_logger("worker.runtime")

HEARTBEAT_MAX_PERIOD_S = 2.0


def counters() -> dict[str, int]:
    """A worker's counters (logged at its stop; tests wait on them)."""
    return {
        "claimed": 0,
        "succeeded": 0,
        "failed": 0,
        "interrupted": 0,
        "stale": 0,
        "dropped": 0,
        "claims": 0,  # claim statements
        "claims_empty": 0,  # of them, those that took nothing
        "wakes_passed_on": 0,  # wakes for this worker alone it had no room for
        "claims_on_wake": 0,  # of the claims, those made for a wake (Producer.claim_woken)
        "ahead_expired": 0,  # runs claimed ahead for short plays, handed back unstarted
        "row_invalid": 0,  # claimed runs failed before starting: a row no worker can use
        "control_checks": 0,  # reads of the durable cancel requests control messages named
        "announced": 0,  # started attempts announced after their claim (Producer.announce)
    }


class Worker:
    """The composition root: builds the services from :class:`Settings`, starts them,
    and drains them at the stop. It holds no policy: each service owns its own
    (docs/design.md, section 7)."""

    def __init__(self, settings: Settings) -> None:
        settings.check()
        self.s = settings
        self.lane_names = [lanes.lane_name(r) for r in (settings.release, *settings.adopt)]
        # What the worker holds (live attempts, runs claimed ahead); its concurrency is the
        # lane's when not given, known at start.
        self.slots = Slots(
            concurrency=settings.concurrency or 0,
            prefetch=settings.prefetch,
            ahead_under_s=settings.claim_ahead_under_s,
        )
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self._claiming: asyncio.Task[None] | None = None  # the claim loop
        self._signals = 0
        self.lane: lanes.Lane | None = None
        self.pool: AsyncConnectionPool[Any] | None = None
        self.heartbeat: Heartbeat | None = None
        self.sandboxing = startup.Sandboxing(url=settings.gateway_url)
        self.mode = settings.pool_mode or pool_mode()
        # One LISTEN session: the listen URL, else the database URL when it is a session.
        self.listen_url = settings.listen_url or (settings.url if db.listens(self.mode) else None)
        self.budget: connections.Budget | None = None
        self.executor: Executor | None = None  # made in _serve: it needs the pool and gateway
        self.stats = counters()
        self.leases = Leases(self.slots)  # the heartbeat's answers
        # Control messages name runs to look at; a durable cancel request stops them.
        self.control = CancelChecks(
            self._connection,
            worker_id=settings.worker_id,
            slots=self.slots,
            stopping=self.stopping,
            cancel=lambda live: self.leases.stop(live, "cancel"),
            checked=functools.partial(_count, self.stats, "control_checks"),
        )
        # The worker's one account of a database outage, fed by its services: past
        # max_outage_s the worker stops at once (worker.outage).
        self.downtime = Downtime(settings.max_outage_s, on_lost=self._database_lost)
        self.clock = StopClock(settings.grace_s, self.downtime)
        # Where every attempt's final write is made: batched, fenced, through outages.
        self.completer = BatchCompleter(self._connection, settings.worker_id, self.downtime)
        # Every claim goes through the producer; it starts what it claims (_start).
        self.producer = Producer(
            self._connection,
            slots=self.slots,
            lanes=self.lane_names,
            worker_id=settings.worker_id,
            plays=settings.registry.names(),
            poll_s=settings.poll_s,
            stopping=self.stopping,
            downtime=self.downtime,
            stats=self.stats,
            track=self.leases.track,
            start=self._start,
            hand_back=self._hand_back,
        )
        self.wake = self.producer.wake  # look for work now
        self.capacity = self.producer.capacity  # a slot freed

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        listening = self.listen_url is not None
        connections.check_cap(self.s.max_connections, listening=listening)
        prepared = await startup.prepare(self.s, self.mode, self.lane_names)
        self.lane, self.producer.procrastinate_id = prepared.lane, prepared.procrastinate_id
        if self.s.concurrency is None:
            self.s.concurrency = self.lane.concurrency
        self.slots.concurrency = self.s.concurrency
        structlog.contextvars.bind_contextvars(worker_id=self.s.worker_id)
        self.budget = connections.plan(
            self.s.concurrency, listening=listening, cap=self.s.max_connections
        )
        self.pool = await startup.open_pool(self.s, self.mode, self.budget)
        self.heartbeat = self.leases.heartbeat = Heartbeat(
            url=self.s.url,
            worker_id=self.s.worker_id,
            period_s=min(self.lane.heartbeat_s, HEARTBEAT_MAX_PERIOD_S),
            ttl_s=self.lane.lease_ttl_s,
            step_lease_s=STEP_LEASE_S,
            loop=asyncio.get_running_loop(),
            on_beat=self.leases.on_beat,
            on_silence=self.leases.on_silence,
            describe=self.leases.describe,
            connect_kwargs=startup.connect_kwargs(self.s, self.mode, "heartbeat"),
        )
        self.heartbeat.start()
        try:
            self.sandboxing = await startup.sandboxing(self.s, self.pool)
            return await self._serve()
        finally:
            await self.sandboxing.stop()
            await asyncio.to_thread(self.heartbeat.stop)
            await self.pool.close()

    def _services(self, listened: asyncio.Event | None) -> list[asyncio.Task[Any]]:
        """Build the executor and start every service: the claims, the final writes,
        maintenance, peers, schedules, the projector and (listening) the notifier."""
        s, pool, heartbeat, budget = self.s, self.pool, self.heartbeat, self.budget
        assert pool is not None and heartbeat is not None and budget is not None
        self.executor = Executor(
            pool=pool,
            pool_check=PoolCheck(pool),  # after a blip (worker.contract)
            # An attempt keeps its connection between calls when the pool has one for every
            # attempt besides the worker's loops (not under a tighter max_connections).
            hold=budget.pool >= (s.concurrency or 0) + connections.POOL_EXTRA,
            heartbeat=heartbeat,
            completer=self.completer,
            slots=self.slots,
            stats=self.stats,
            registry=s.registry,
            worker_id=s.worker_id,
            max_outage_s=s.max_outage_s,
            token_secret=s.token_secret,
            token_ttl_s=s.token_ttl_s,
            gateway_url=self.sandboxing.url,
            sandboxes=self.sandboxing.launcher,
            freed=self._freed,
            org_capped=self.wake.set,
        )
        peers = Peers(
            self._connection,
            period_s=heartbeat.period_s,
            stopping=self.stopping,
            downtime=self.downtime,
            rescued=self.wake.set,
        )
        self._claiming = asyncio.create_task(self.producer.run(after=listened), name="claim")
        tasks = [
            self._claiming,
            asyncio.create_task(self.completer.run(), name="finish"),
            asyncio.create_task(
                recovery.maintain(
                    s.url, self.stopping, mode=self.mode, owner=s.worker_id, grace_s=s.grace_s
                ),
                name="maintenance",
            ),
            asyncio.create_task(peers.run(), name="peers"),
            asyncio.create_task(
                scheduler.run(
                    pool, release=s.release, plays=s.registry.names(), stopping=self.stopping
                ),
                name="schedules",
            ),
            projector.start(
                s.url,
                self.stopping,
                owner=s.worker_id,
                listen=False,  # polls: see worker.projector
                mode=self.mode,
                downtime=self.downtime,
            ),
        ]
        if listened is not None:
            assert self.listen_url is not None
            notifier = Notifier(
                self.listen_url,
                lanes=self.lane_names,
                worker_id=s.worker_id,
                downtime=self.downtime,
                on_listening=functools.partial(_listening, listened, self.wake),
                on_control=self.control.heard,
                on_wake=self.producer.on_wake,
            )
            tasks.append(asyncio.create_task(notifier.run(), name="listen"))
        return tasks

    async def _serve(self) -> int:
        if self.s.install_signals:
            stopping.on_stop_signals(self.request_stop)
        listening = self.listen_url is not None
        # A listening worker claims once its session holds the liveness lock.
        tasks = self._services(asyncio.Event() if listening else None)
        if self.s.ready_file is not None:
            files.replace_atomically(
                self.s.ready_file,
                json.dumps({"worker_id": self.s.worker_id, "lanes": self.lane_names}),
            )
        assert self.budget is not None and self.pool is not None
        log.info(
            "worker_ready",
            lanes=self.lane_names,
            release=self.s.release,
            concurrency=self.s.concurrency,
            prefetch=self.s.prefetch,
            claim_ahead_under_s=self.s.claim_ahead_under_s,
            connections=self.budget.as_dict(),
            pool_mode=str(self.mode),
            wakeups="listen" if listening else f"poll every {self.s.poll_s:g}s",
        )
        self.ready.set()
        exit_code = 0
        stop_wait = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stop_wait or isinstance(task.exception(), DatabaseLost):
                continue  # a service that met the outage's end: the worker stops for it
            if task.exception() is not None:
                log.error("worker_loop_crashed", loop=task.get_name(), error=repr(task.exception()))
                exit_code = 1
        self._stop_signalled()
        assert self.executor is not None
        await drain(
            self.clock,
            claiming=self._claiming,
            producer=self.producer,
            slots=self.slots,
            hand_back=self._hand_back,
            transports=self.executor.transports,
            completer=self.completer,
        )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Wakes being passed on, announcements and a cancel lookup: within the stop's
        # bound, then dropped.
        self.producer.stop_announcing()
        checking = self.control.checking
        pending = [*self.producer.background, *([checking] if checking is not None else [])]
        await record_stop(self.clock, self.pool, self.s.worker_id, pending)
        log.info("worker_stopped", **self.stats)
        if self.downtime.lost is not None:
            raise self.downtime.lost
        return exit_code

    def _stop_signalled(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.capacity.set()  # a claim loop waiting for a slot sees the stop at once

    def _database_lost(self, lost: DatabaseLost) -> None:
        """The outage outlasted max_outage_s (worker.outage): stop now, without a grace (no
        write of a running attempt would land), so a supervisor restarts the worker."""
        log.error(
            "worker_database_lost",
            error=lost.message,
            max_outage_s=self.s.max_outage_s,
            running=len(self.slots.live),
        )
        self._stop_signalled()

    def request_stop(self) -> None:
        """The signal handler: the first signal stops gracefully, a second exits at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("worker_exit_now", reason="second signal")
            os._exit(1)
        self.stop()

    def stop(self) -> None:
        """Stop claiming; running attempts get the grace period, then are handed back
        (:func:`worker.drain.drain`)."""
        log.info("worker_stopping", grace_s=self.s.grace_s, running=len(self.slots.live))
        self._stop_signalled()

    # ---- what the services call back ----------------------------------------------------

    def _start(self, c: runs.Claimed) -> None:
        assert self.executor is not None
        self.executor.start(c)

    def _freed(self) -> None:
        """A slot is free: the next run claimed ahead takes it, and the claim loop looks."""
        self.producer.fill()
        self.capacity.set()

    def _hand_back(
        self, ahead: list[runs.Claimed], event: str
    ) -> list[asyncio.Future[FinishStatus]]:
        """Queue the hand-back of runs claimed ahead and never started (batched with the
        other final writes, fenced, no retry spent); their futures."""
        if not ahead:
            return []
        self.leases.untrack(ahead)
        log.info(event, count=len(ahead))
        return [self.completer.queue(outcomes.handed_back(c.run_id, c.attempt or 0)) for c in ahead]

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        assert self.pool is not None
        return self.pool.connection()


def _count(stats: dict[str, int], name: str) -> None:
    stats[name] += 1


def _listening(listened: asyncio.Event, wake: asyncio.Event) -> None:
    """The LISTEN session holds the liveness lock and listens: claims may begin, and
    anything spawned while it was not listening is looked for now."""
    listened.set()
    wake.set()


async def serve(settings: Settings) -> int:
    """Run a worker until it stops; its exit code. An outage past ``max_outage_s`` raises
    :class:`~queues.errors.DatabaseLost` (exit 6) once the worker has stopped."""
    try:
        return await Worker(settings).run()
    except WorkerError:
        raise
    except TRANSIENT as exc:
        log.error("worker_database_lost", error=str(exc))
        return 1
