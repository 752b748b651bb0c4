"""The worker process: claim, execute, finish; heartbeat; shut down gracefully.

procrastinate is the transport (:mod:`queues.transport`): runs are procrastinate jobs on
the lane (a procrastinate queue), inserted by admission. A worker whose last claim came
back short waits for work: a new job wakes one such worker on its own channel, in turns,
or, with nobody waiting, every worker on the lane's channel (migration 0032); a wake that
comes while the claim loop waits is claimed by the LISTEN loop in the turn that read it
(:mod:`worker.producer`). The worker claims jobs in batches (the transport takes up to N
jobs, then one statement starts N attempts) and writes finished attempts in batches
(one fenced statement finishes N runs and their jobs), which is where it gains on
one-job-at-a-time fetching.

Loops here own the when; :mod:`worker.attempt` owns what one attempt's end means, and
``queues`` owns the what. The heartbeat runs in a thread of its own
(:mod:`worker.heartbeat`), so a blocked event loop never costs a lease.

Its connections are bounded (:mod:`worker.connections`: a pool, one LISTEN session, the
heartbeat, the projector and the maintenance worker; ``max_connections`` caps the sum).
The one LISTEN session hears the lanes' jobs and cancels (not the ledger's events: the
projector inside a worker polls, :mod:`worker.projector`); a cancel message only names a
run to look at, and its durable request, read from the database, decides
(:mod:`worker.control`). It goes to ``listen_url`` when
one is given, since behind a transaction-mode pooler
(``pool_mode``) a LISTEN needs a direct or session-mode connection. Behind such a pooler
with no listen URL the worker polls: an idle worker picks up a new run within
``poll_s`` (1 s), cancels arrive with the next heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from queues import lanes, migrations, outcomes, runs, server
from queues.errors import DatabaseLost, WorkerError
from queues.outcomes import FinishStatus
from worker import (
    connections,
    db,
    executor,
    files,
    gateway,
    projector,
    recovery,
    sandbox,
    scheduler,
    stopping,
)
from worker.completer import BatchCompleter
from worker.config import PoolMode, pool_mode
from worker.context import STEP_LEASE_S
from worker.contract import PoolCheck
from worker.control import CancelChecks
from worker.executor import Executor
from worker.gateway import Served
from worker.heartbeat import Beat, Heartbeat
from worker.notifier import Notifier
from worker.outage import TRANSIENT, Downtime
from worker.peers import Peers
from worker.plays import Registry
from worker.producer import Producer, retrieved
from worker.slots import Live, Slots

log = structlog.get_logger("worker.runtime")

POLL_INTERVAL_S = 1.0
PREFETCH_MAX = 1000  # runs claimed ahead: leased while they wait, so bounded
CLAIM_AHEAD_UNDER_S = 0.05  # plays this short are claimed ahead by default (see Settings)
CLAIM_AHEAD_UNDER_MAX_S = 1.0
HEARTBEAT_MAX_PERIOD_S = 2.0


@dataclass
class Settings:
    url: str
    release: str
    registry: Registry
    concurrency: int | None = None  # None: the lane's policy
    adopt: tuple[str, ...] = ()  # extra releases whose lanes this worker also consumes
    ready_file: Path | None = None
    grace_s: float = 4.0  # under honcho's 5 s stop window (docs/deploy.md: per supervisor)
    max_outage_s: float = 60.0  # exit non-zero when the database is gone for this long
    install_signals: bool = True  # False when embedded in another program (tests, demo)
    token_secret: bytes | None = None  # signs sandboxed attempts' tokens (sandboxed plays)
    gateway_url: str | None = None  # the gateway sandboxes call (None: serve one in-process)
    token_ttl_s: float = 6 * 3600.0
    sandbox_hidden: tuple[Path, ...] = ()  # more paths a sandbox must not see (its --home)
    # The connection budget and the pooler (worker.connections, worker.db): a cap on this
    # process's connections (None: the pool is concurrency + 3); where it LISTENs (None:
    # on url, unless url is a transaction pooler, then it polls every poll_s).
    max_connections: int | None = None
    listen_url: str | None = None
    pool_mode: PoolMode | None = None  # None: WORKER_POOL_MODE (default session)
    poll_s: float = POLL_INTERVAL_S
    # The high-throughput mode: runs claimed ahead into a local queue beyond the free
    # slots (0: claim only for free slots). A freed slot starts the next run at once, and
    # the next claim overlaps the running attempts and their final writes. A run claimed
    # ahead is leased (and renewed) from its claim, so its timeout counts from then. In
    # every mode a slot is freed when its play returns (batched completion), not when its
    # final write is answered.
    prefetch: int = 0
    # Claiming ahead for short plays, the default mode's own (prefetch 0): while the last
    # `concurrency` plays each returned within this many seconds, the worker also claims
    # up to 4 x `concurrency` runs ahead, so a freed slot does not wait for a claim's
    # round trip. Such a run waits at most AHEAD_HOLD_FACTOR times this for a slot (1 s at
    # the default), then is handed back (no retry spent). 0: claim only for free slots.
    claim_ahead_under_s: float = CLAIM_AHEAD_UNDER_S
    worker_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    )


# After the grace, while the database answers: the hand-backs, the last final writes and
# the worker's own stop record (they take milliseconds then; docs/deploy.md counts a
# second). In an outage nothing waits for the database past the grace (Worker._drain).
HANDBACK_S = 1.0


class Worker:
    def __init__(self, settings: Settings) -> None:
        if not 0 <= settings.prefetch <= PREFETCH_MAX:
            raise WorkerError(
                f"prefetch {settings.prefetch} is out of range",
                field="prefetch",
                rule=f"from 0 (claim only for free slots) to {PREFETCH_MAX} runs claimed ahead",
                fix="pass 0 for long runs, a few times the concurrency for short ones",
            )
        if not 0 <= settings.claim_ahead_under_s <= CLAIM_AHEAD_UNDER_MAX_S:
            raise WorkerError(
                f"claim_ahead_under_s {settings.claim_ahead_under_s} is out of range",
                field="claim_ahead_under_s",
                rule=f"from 0 (never) to {CLAIM_AHEAD_UNDER_MAX_S:g} seconds",
                fix="plays that take longer gain nothing from a claim saved; pass 0 to turn "
                "claiming ahead for short plays off",
            )
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
        self.pool_check: PoolCheck | None = None  # after a blip (worker.contract)
        self.heartbeat: Heartbeat | None = None
        self.peers: Peers | None = None  # made with the heartbeat (its period)
        self.gateway: Served | None = None
        self.gateway_url: str | None = settings.gateway_url
        self.sandboxes: sandbox.Launcher | None = None  # with sandboxed plays
        self.mode = settings.pool_mode or pool_mode()
        # One LISTEN session: the listen URL, else the database URL when it is a session.
        self.listen_url = settings.listen_url or (settings.url if db.listens(self.mode) else None)
        self.budget: connections.Budget | None = None
        self.executor: Executor | None = None  # made in _serve: it needs the pool and gateway
        self.stats = {
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
        }
        # Control messages name runs to look at; a durable cancel request stops them.
        self.control = CancelChecks(
            self._connection,
            worker_id=settings.worker_id,
            slots=self.slots,
            stopping=self.stopping,
            cancel=lambda live: self.stop_attempt(live, "cancel"),
            checked=self._count_control_check,
        )
        self._grace_end = 0.0  # when a stop's grace ends (_drain)
        # The worker's one account of a database outage, fed by its loops: past
        # max_outage_s the worker stops at once (worker.outage).
        self.downtime = Downtime(settings.max_outage_s, on_lost=self._database_lost)
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
            track=self._track,
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
        await self._startup()
        assert self.s.concurrency is not None and self.lane is not None
        self.budget = connections.plan(
            self.s.concurrency, listening=listening, cap=self.s.max_connections
        )
        self.pool = AsyncConnectionPool(
            self.s.url,
            min_size=min(2, self.budget.pool),
            # Every running attempt may run a statement at once, plus the claim, finish
            # and suspension loops; under a cap, attempts queue briefly for a connection.
            max_size=self.budget.pool,
            open=False,
            kwargs={"autocommit": True, **self._connect_kwargs("pool")},
            # A getconn that cannot be served soon is an outage, not a queue: fail fast so
            # the loops' outage accounting (and max_outage_s) sees it.
            timeout=min(5.0, self.s.max_outage_s / 2),
        )
        await self.pool.open(wait=True, timeout=30)
        self.pool_check = PoolCheck(self.pool)
        self.heartbeat = Heartbeat(
            url=self.s.url,
            worker_id=self.s.worker_id,
            period_s=min(self.lane.heartbeat_s, HEARTBEAT_MAX_PERIOD_S),
            ttl_s=self.lane.lease_ttl_s,
            step_lease_s=STEP_LEASE_S,
            loop=asyncio.get_running_loop(),
            on_beat=self.on_beat,
            on_silence=self.on_silence,
            describe=self._describe,
            connect_kwargs=self._connect_kwargs("heartbeat"),
        )
        self.heartbeat.start()
        self.peers = Peers(
            self._connection,
            period_s=self.heartbeat.period_s,
            stopping=self.stopping,
            downtime=self.downtime,
            rescued=self.wake.set,
        )
        try:
            await self._start_gateway()
            return await self._serve()
        finally:
            if self.gateway is not None:
                await self.gateway.stop()
            await asyncio.to_thread(self.heartbeat.stop)
            await self.pool.close()

    def _connect_kwargs(self, part: str, url: str | None = None) -> dict[str, Any]:
        """Every connection's settings (worker.db), named after the part that holds it."""
        return db.connect_kwargs(
            url or self.s.url, mode=self.mode, application=f"wq-{part} {self.s.worker_id}"
        )

    async def _start_gateway(self) -> None:
        """Sandboxed plays reach the runtime through a gateway: serve one on a private Unix
        socket unless one is configured; probe (and log) the sandbox mechanism."""
        sandboxed = self.s.registry.sandboxed()
        if not sandboxed:
            return
        if self.s.token_secret is None or self.s.registry.spec is None:
            raise WorkerError(
                f"plays {', '.join(sandboxed)} are sandboxed, but this worker has no token "
                "secret or no importable app to run them with",
                field="sandboxed",
                rule="a sandboxed play needs WORKER_TOKEN_SECRET (or the embedded database) "
                "and an app given as module:attribute",
                fix="set WORKER_TOKEN_SECRET and start the worker with --app",
            )
        if self.gateway_url is not None and gateway.socket_path(self.gateway_url) is None:
            raise WorkerError(
                f"the gateway {self.gateway_url} is not a Unix socket, and a sandbox has no "
                "network",
                field="--gateway-url",
                rule="unix:/path/to/gateway.sock",
                fix="serve `worker gateway --socket PATH` and pass --gateway-url unix:PATH, "
                "or drop --gateway-url to serve one in this worker",
            )
        if self.gateway_url is None:
            assert self.pool is not None
            app = gateway.make_app(self.pool, secret=self.s.token_secret)
            self.gateway = Served.private(app)
            self.gateway_url = await self.gateway.start()
            log.info("gateway_serving", url=self.gateway_url, sandboxed=sandboxed)
        self.sandboxes = sandbox.Launcher(self.s.registry.spec, hidden=self.s.sandbox_hidden)
        await self.sandboxes.probe()

    async def _startup(self) -> None:
        """Refuse an unsupported Postgres, verify the contract, prepare the lanes (before
        reporting ready), register."""
        async with db.session(
            self.s.url, mode=self.mode, application=f"wq-start {self.s.worker_id}"
        ) as conn:
            await server.require_supported(conn)
            await migrations.verify_contract(conn)
            commits = await server.synchronous_commit(conn)
            if commits in server.UNDURABLE_COMMITS:
                log.warning(
                    "synchronous_commit_off",
                    code="SYNCHRONOUS_COMMIT_OFF",
                    synchronous_commit=commits,
                    detail="the database acknowledges commits before they are durable: a "
                    "crash or a failover loses the last acknowledged submits, step receipts "
                    "and results, and runs may execute steps again; set synchronous_commit "
                    "to on (docs/how-to/high-availability.md)",
                )
            # The worker owns preparation: its lane is prepared before it reports ready.
            # Preparing never reopens a closed lane: the worker serves it all the same.
            for release in (self.s.release, *self.s.adopt):
                async with conn.transaction():
                    await lanes.prepare(conn, release, own=release == self.s.release)
                lane = await lanes.get(conn, lanes.lane_name(release))
                if lane is not None and lane.state != lanes.LaneState.PREPARED:
                    log.warning(
                        "lane_closed_to_admissions",
                        lane=lane.name,
                        lane_state=lane.state,
                        detail="serving the runs it holds; it takes no new ones until an "
                        "operator runs `worker queues reopen`",
                    )
            self.lane = await lanes.get(conn, lanes.lane_name(self.s.release))
            assert self.lane is not None
            await scheduler.declare(conn, self.s.registry)  # the app's periodic plays
            self.producer.procrastinate_id = await runs.register_worker(
                conn,
                worker_id=self.s.worker_id,
                lanes=self.lane_names,
                release=self.s.release,
                host=socket.gethostname(),
                pid=os.getpid(),
            )
        if self.s.concurrency is None:
            self.s.concurrency = self.lane.concurrency
        self.slots.concurrency = self.s.concurrency
        structlog.contextvars.bind_contextvars(worker_id=self.s.worker_id)

    async def _serve(self) -> int:
        if self.s.install_signals:
            stopping.on_stop_signals(self.request_stop)
        listening = self.listen_url is not None
        assert self.pool is not None and self.peers is not None
        peers = self.peers
        assert self.heartbeat is not None and self.budget is not None
        self.executor = Executor(
            pool=self.pool,
            pool_check=self.pool_check,
            # An attempt keeps its connection between calls when the pool has one for every
            # attempt besides the worker's loops (not under a tighter max_connections).
            hold=self.budget.pool >= (self.s.concurrency or 0) + connections.POOL_EXTRA,
            heartbeat=self.heartbeat,
            completer=self.completer,
            slots=self.slots,
            stats=self.stats,
            registry=self.s.registry,
            worker_id=self.s.worker_id,
            max_outage_s=self.s.max_outage_s,
            token_secret=self.s.token_secret,
            token_ttl_s=self.s.token_ttl_s,
            gateway_url=self.gateway_url,
            sandboxes=self.sandboxes,
            freed=self._freed,
            org_capped=self.wake.set,
        )
        listened = asyncio.Event() if listening else None  # the liveness lock is held
        self._claiming = asyncio.create_task(self.producer.run(after=listened), name="claim")
        tasks = [
            self._claiming,
            asyncio.create_task(self.completer.run(), name="finish"),
            asyncio.create_task(self._maintenance_loop(), name="maintenance"),
            asyncio.create_task(peers.run(), name="peers"),
            asyncio.create_task(
                scheduler.run(
                    self.pool,
                    release=self.s.release,
                    plays=self.s.registry.names(),
                    stopping=self.stopping,
                ),
                name="schedules",
            ),
            projector.start(
                self.s.url,
                self.stopping,
                owner=self.s.worker_id,
                listen=False,  # polls: see worker.projector
                mode=self.mode,
                downtime=self.downtime,
            ),
        ]
        if listening:
            assert self.listen_url is not None and listened is not None
            notifier = Notifier(
                self.listen_url,
                lanes=self.lane_names,
                worker_id=self.s.worker_id,
                downtime=self.downtime,
                on_listening=functools.partial(_listening, listened, self.wake),
                on_control=self.control.heard,
                on_wake=self.producer.on_wake,
            )
            tasks.append(asyncio.create_task(notifier.run(), name="listen"))
        if self.s.ready_file is not None:
            files.replace_atomically(
                self.s.ready_file,
                json.dumps({"worker_id": self.s.worker_id, "lanes": self.lane_names}),
            )
        assert self.budget is not None
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
                continue  # a loop that met the outage's end: the worker stops for it
            if task.exception() is not None:
                log.error("worker_loop_crashed", loop=task.get_name(), error=repr(task.exception()))
                exit_code = 1
        self.stopping.set()
        self.wake.set()
        self.capacity.set()
        await self._drain()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Wakes being passed on and a cancel lookup: within the stop's bound, then dropped.
        checking = self.control.checking
        pending = [*self.producer.passing, *([checking] if checking is not None else [])]
        await _settle(pending, self._stop_left())
        assert self.pool is not None
        left = self._stop_left()
        if left > 0:
            with contextlib.suppress(psycopg.Error, PoolTimeout, TimeoutError):
                async with asyncio.timeout(left), self.pool.connection(timeout=left) as conn:
                    await runs.worker_stopped(conn, self.s.worker_id)
        log.info("worker_stopped", **self.stats)
        if self.downtime.lost is not None:
            raise self.downtime.lost
        return exit_code

    def _database_lost(self, lost: DatabaseLost) -> None:
        """The outage outlasted max_outage_s (worker.outage): stop now, without a grace (no
        write of a running attempt would land), so a supervisor restarts the worker."""
        log.error(
            "worker_database_lost",
            error=lost.message,
            max_outage_s=self.s.max_outage_s,
            running=len(self.slots.live),
        )
        self.stopping.set()
        self.wake.set()
        self.capacity.set()

    def request_stop(self) -> None:
        """The signal handler: the first signal stops gracefully, a second exits at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("worker_exit_now", reason="second signal")
            os._exit(1)
        self.stop()

    def stop(self) -> None:
        """Stop claiming; running attempts get the grace period, then are handed back."""
        log.info("worker_stopping", grace_s=self.s.grace_s, running=len(self.slots.live))
        self.stopping.set()
        self.wake.set()
        self.capacity.set()  # a claim loop waiting for a slot sees the stop at once

    async def _drain(self) -> None:
        """Let running attempts finish within the grace period, then hand the rest back.

        Bounded, so a supervisor's stop window holds (docs/deploy.md): running attempts
        get the grace (none once the database is lost: nothing they wrote would land);
        the stop's own writes (the wake passed on, the hand-backs, the final writes) get
        until the grace ends, and ``HANDBACK_S`` more while the database answers. In an
        outage nothing waits for the database past the grace: what was not written is
        left to the leases (the worker's end is seen by its peers, and each lease lapses
        at the latest), and those runs are retried without spending a retry."""
        lost = self.downtime.lost is not None
        self._grace_end = time.monotonic() + (0.0 if lost else self.s.grace_s)
        if self._claiming is not None and not self._claiming.done():
            # A claim under way when the stop came lands in the local queue: let it land,
            # then hand back everything claimed ahead.
            await asyncio.wait([self._claiming], timeout=self._stop_left())
        # And so does one the LISTEN loop made for a wake (no claim starts now), within
        # the same bound.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._stop_left()), self.producer.claim_lock:
                pass
        # Out of the set of waiting workers: spawns wake the others from now on.
        await _settle(
            [asyncio.ensure_future(self.producer.pass_on(leaving=True))], self._stop_left()
        )
        ahead, self.slots.ahead = list(self.slots.ahead), deque()
        await _settle(self._hand_back(ahead, "claimed_ahead_handed_back"), self._stop_left())
        while self.slots.live and time.monotonic() < self._grace_end:
            await asyncio.sleep(0.05)
        for live in list(self.slots.live.values()):
            if not live.finishing and live.stop_reason is None:
                live.stop_reason = "handback"
                live.task.cancel()
        tasks = [live.task for live in self.slots.live.values()]
        if tasks:
            # Hand-backs and final writes need the database: within the stop's bound (the
            # leases lapse and recovery takes over for what was not written).
            _, pending = await asyncio.wait(tasks, timeout=self._stop_left())
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
        transports = self.executor.transports if self.executor is not None else set()
        for held in list(transports):
            with contextlib.suppress(Exception):
                await held.aclose()
        transports.clear()
        await _settle([asyncio.ensure_future(self.completer.flush())], self._stop_left())

    def _stop_left(self) -> float:
        """Seconds the stop may still wait for the database: until the grace ends, plus
        HANDBACK_S unless an outage is under way."""
        end = self._grace_end + (0.0 if self.downtime.failing else HANDBACK_S)
        return max(0.0, end - time.monotonic())

    # ---- loops --------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        """Serve the recovery pass as procrastinate's periodic task (one per tick however
        many workers run); restarted after a failure, never fatal to the worker."""
        while not self.stopping.is_set():
            try:
                await recovery.run_periodic_worker(
                    self.s.url,
                    self.stopping,
                    mode=self.mode,
                    owner=self.s.worker_id,
                    # Its stop (procrastinate unregisters its worker) waits for a pooled
                    # connection at most this long: within the grace, in an outage too.
                    pool_timeout_s=min(recovery.POOL_TIMEOUT_S, max(0.5, self.s.grace_s / 2)),
                )
            except Exception as exc:  # a maintenance failure must not stop execution
                log.warning("maintenance_failed", error=repr(exc)[:300])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 5.0)

    def _track(self, run_id: uuid.UUID, attempt: int) -> None:
        """Renew this lease from now on (a claimed run is leased from its claim)."""
        assert self.heartbeat is not None
        self.heartbeat.track(run_id, attempt)

    def _count_control_check(self) -> None:
        self.stats["control_checks"] += 1

    def stop_attempt(self, live: Live, reason: str) -> None:
        """Stop a live attempt (``cancel``, ``timeout``, ``lease_lost``, ``handback``):
        :func:`worker.executor.stop`."""
        untrack = self.heartbeat.untrack if self.heartbeat is not None else None
        executor.stop(live, reason, untrack=untrack)

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
        assert self.heartbeat is not None
        for c in ahead:
            self.heartbeat.untrack(c.run_id)
        log.info(event, count=len(ahead))
        return [self.completer.queue(outcomes.handed_back(c.run_id, c.attempt or 0)) for c in ahead]

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        assert self.pool is not None
        return self.pool.connection()

    # ---- heartbeat callbacks (run on this loop, posted by the heartbeat thread) -----------

    def on_beat(self, beat: Beat) -> None:
        """The heartbeat's answer (posted to this loop by its thread): the leases renewed of
        those it sent. A live attempt whose lease was not renewed is lost, one whose run has
        a cancel request is stopped for it; a run claimed ahead whose lease lapsed is
        dropped."""
        kept = {r.run_id: r for r in beat.renewed}
        lapsed_ahead = {run_id for run_id, attempt_no in beat.sent if run_id not in kept} & {
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
                self.stop_attempt(live, "cancel")

    def on_silence(self, silent_s: float) -> None:
        # The watchdog: without renewals past the TTL our leases are gone.
        log.warning("heartbeat_silent_past_ttl", silent_s=round(silent_s, 1))
        self._drop_ahead({c.run_id for c in self.slots.ahead})
        self._lose(self.slots.live.values())

    def _drop_ahead(self, run_ids: set[uuid.UUID]) -> None:
        """Forget runs claimed ahead whose lease is gone: another attempt owns them now."""
        for c in [c for c in self.slots.ahead if c.run_id in run_ids]:
            self.slots.ahead.remove(c)
            if self.heartbeat is not None:
                self.heartbeat.untrack(c.run_id)
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
            self.stop_attempt(live, "lease_lost")

    def _describe(self) -> list[dict[str, Any]]:
        """The attempts running now (read from the heartbeat thread for lag reports)."""
        return [
            {"run_id": str(run_id), "play": live.claimed.play, "step": live.ctx.current_step}
            for run_id, live in list(self.slots.live.items())
        ]


def _listening(listened: asyncio.Event, wake: asyncio.Event) -> None:
    """The LISTEN session holds the liveness lock and listens: claims may begin, and
    anything spawned while it was not listening is looked for now."""
    listened.set()
    wake.set()


async def _settle(futures: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Wait for ``futures`` at most ``timeout`` seconds; cancel those still pending (the
    stop does not wait for them: worker.Worker._drain), and mark every outcome seen."""
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
