"""``worker dashboard``: the operator's web UI (runs, a run, lanes, metrics).

Server-rendered with Starlette and Jinja2 templates (no Node build step), live by polling,
read with the reader role, acting with the worker role, behind a login secret and CSRF
protection. :func:`start` serves it on an event loop (the CLI and the tests use it).

It rides out a lost database (a restart, a failover) with no limit: while nothing answers,
a page answers 503 and its live parts keep polling; the next page after the database is
back reads it on a new connection. The server itself never exits for an outage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from queues import migrations
from worker import db, serving
from worker.dashboard import auth
from worker.dashboard.app import MAX_FORM_BYTES, Dashboard, make_app
from worker.gateway import Served


def limits() -> serving.Limits:
    """The dashboard's server limits (:mod:`worker.serving`): a body is a form."""
    return serving.Limits.from_env(max_body_bytes=MAX_FORM_BYTES)


@dataclass
class Running:
    """A dashboard being served; ``await stop()`` ends it."""

    served: Served
    pool: AsyncConnectionPool[Any]
    url: str

    async def stop(self) -> None:
        await self.served.stop()
        await self.pool.close()


async def start(
    *,
    reader_url: str,
    worker_url: str,
    secret: str,
    host: str = "127.0.0.1",
    port: int = 8086,
) -> Running:
    """Verify the schema contract, open the reader's pool and serve the dashboard."""
    async with db.session(reader_url) as conn:
        await migrations.verify_contract(conn)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        reader_url,
        min_size=1,
        max_size=4,
        open=False,
        timeout=5.0,
        # The process's connection settings (worker.db): a connect timeout, and keepalives
        # so a page on a cut link fails within seconds instead of hanging.
        kwargs={"autocommit": True, **db.connect_kwargs(reader_url, application="wq-dashboard")},
        # A restarted or failed-over database: each connection is checked when taken, and
        # a new one (a multi-host URL finds the new primary) replaces a dead one.
        check=AsyncConnectionPool.check_connection,
    )
    await pool.open(wait=True, timeout=30)
    try:
        dash = Dashboard(reader=pool, worker_url=worker_url, sessions=auth.Sessions(secret))
        served = Served(make_app(dash), host=host, port=port, limits=limits())
        url = await served.start()
    except BaseException:
        await pool.close()
        raise
    return Running(served=served, pool=pool, url=url)


__all__ = ["Dashboard", "Running", "auth", "make_app", "start"]
