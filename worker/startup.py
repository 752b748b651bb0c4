"""What a worker does before it serves: check the database, prepare its lanes, register,
open its pool, and, with sandboxed plays, reach a gateway and probe the sandbox.

Each step refuses what the worker cannot serve with a clear error before it reports
ready: an unsupported Postgres, a schema outside the compatibility window
(:func:`queues.migrations.verify_contract`), sandboxed plays without a token secret or an
importable app, a gateway a sandbox cannot reach.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import structlog
from psycopg_pool import AsyncConnectionPool

from queues import lanes, migrations, runs, server
from queues.errors import WorkerError
from worker import connections, db, gateway, sandbox, scheduler
from worker.config import PoolMode
from worker.gateway import Served
from worker.settings import Settings

log = structlog.get_logger("worker.startup")


@dataclass(frozen=True)
class Prepared:
    lane: lanes.Lane  # the worker's own release's lane
    procrastinate_id: int  # the worker's row in procrastinate's workers


def connect_kwargs(s: Settings, mode: PoolMode, part: str) -> dict[str, Any]:
    """Every connection's settings (worker.db), named after the part that holds it."""
    return db.connect_kwargs(s.url, mode=mode, application=f"wq-{part} {s.worker_id}")


async def prepare(s: Settings, mode: PoolMode, lane_names: list[str]) -> Prepared:
    """Refuse an unsupported Postgres, verify the contract, prepare the lanes (before
    reporting ready), declare the app's schedules, register."""
    async with db.session(s.url, mode=mode, application=f"wq-start {s.worker_id}") as conn:
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
        for release in (s.release, *s.adopt):
            async with conn.transaction():
                await lanes.prepare(conn, release, own=release == s.release)
            lane = await lanes.get(conn, lanes.lane_name(release))
            if lane is not None and lane.state != lanes.LaneState.PREPARED:
                log.warning(
                    "lane_closed_to_admissions",
                    lane=lane.name,
                    lane_state=lane.state,
                    detail="serving the runs it holds; it takes no new ones until an "
                    "operator runs `worker queues reopen`",
                )
        own = await lanes.get(conn, lanes.lane_name(s.release))
        assert own is not None
        await scheduler.declare(conn, s.registry)  # the app's periodic plays
        procrastinate_id = await runs.register_worker(
            conn,
            worker_id=s.worker_id,
            lanes=lane_names,
            release=s.release,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
    return Prepared(own, procrastinate_id)


async def open_pool(
    s: Settings, mode: PoolMode, budget: connections.Budget
) -> AsyncConnectionPool[Any]:
    """The attempts' and loops' pool, sized by the connection budget."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        s.url,
        min_size=min(2, budget.pool),
        # Every running attempt may run a statement at once, plus the claim, finish and
        # suspension loops; under a cap, attempts queue briefly for a connection.
        max_size=budget.pool,
        open=False,
        kwargs={"autocommit": True, **connect_kwargs(s, mode, "pool")},
        # A getconn that cannot be served soon is an outage, not a queue: fail fast so the
        # loops' outage accounting (and max_outage_s) sees it.
        timeout=min(5.0, s.max_outage_s / 2),
    )
    await pool.open(wait=True, timeout=30)
    return pool


@dataclass
class Sandboxing:
    """How this worker runs sandboxed plays: the gateway it serves (None: one is given,
    or no play is sandboxed), the URL sandboxes call, the mechanism's launcher."""

    served: Served | None = None
    url: str | None = None
    launcher: sandbox.Launcher | None = None

    async def stop(self) -> None:
        if self.served is not None:
            await self.served.stop()


async def sandboxing(s: Settings, pool: AsyncConnectionPool[Any]) -> Sandboxing:
    """Sandboxed plays reach the runtime through a gateway: serve one on a private Unix
    socket unless one is configured; probe (and log) the sandbox mechanism."""
    sandboxed = s.registry.sandboxed()
    if not sandboxed:
        return Sandboxing(url=s.gateway_url)
    if s.token_secret is None or s.registry.spec is None:
        raise WorkerError(
            f"plays {', '.join(sandboxed)} are sandboxed, but this worker has no token "
            "secret or no importable app to run them with",
            field="sandboxed",
            rule="a sandboxed play needs WORKER_TOKEN_SECRET (or the embedded database) "
            "and an app given as module:attribute",
            fix="set WORKER_TOKEN_SECRET and start the worker with --app",
        )
    if s.gateway_url is not None and gateway.socket_path(s.gateway_url) is None:
        raise WorkerError(
            f"the gateway {s.gateway_url} is not a Unix socket, and a sandbox has no network",
            field="--gateway-url",
            rule="unix:/path/to/gateway.sock",
            fix="serve `worker gateway --socket PATH` and pass --gateway-url unix:PATH, "
            "or drop --gateway-url to serve one in this worker",
        )
    out = Sandboxing(url=s.gateway_url)
    if out.url is None:
        out.served = Served.private(gateway.make_app(pool, secret=s.token_secret))
        out.url = await out.served.start()
        log.info("gateway_serving", url=out.url, sandboxed=sandboxed)
    out.launcher = sandbox.Launcher(s.registry.spec, hidden=s.sandbox_hidden)
    await out.launcher.probe()
    return out
