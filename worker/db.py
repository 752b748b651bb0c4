"""Connections for the process layer: one place that turns a failed connect into an error,
the keyword arguments every connection of the process gets (:func:`connect_kwargs`), and
the wait for the migration gate (``--wait-for-schema``).

Every connection the process opens gets the same arguments, so the pooler setting and the
dead-peer detection hold everywhere:

- behind a transaction-mode pooler (``WORKER_POOL_MODE=transaction``, :class:`PoolMode`),
  no server-side prepared statements (``prepare_threshold=None``): PgBouncer before 1.21
  cannot route them (Debian 12 ships 1.18), and later ones only with
  ``max_prepared_statements`` set and a libpq 17 client;
- TCP keepalives and ``tcp_user_timeout`` (:data:`TCP_SETTINGS`), unless the URL sets
  them: a host cut off from the database (a pulled link, not a refused connection) gets
  an error within about 20 s instead of a statement that hangs for the kernel's 15
  minutes of retransmissions, so the loops' outage accounting (``--max-outage``) sees it;
- an ``application_name`` naming the part of the worker that holds it, so
  ``pg_stat_activity`` shows whose connections they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

from queues import migrations
from queues.errors import ProcrastinateTooOld, SchemaContractMismatch
from worker import embedded
from worker.config import PoolMode, pool_mode, unreachable

log = structlog.get_logger("worker.db")

CONNECT_TIMEOUT_S = 5
SCHEMA_POLL_S = 0.5
# libpq settings every connection gets unless its URL sets them: probe an idle connection
# after 10 s, every 5 s, and give up on a peer that has not acknowledged what was sent
# (a probe or a statement) for 20 s. Ignored on unix sockets.
TCP_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "20000",
}
APPLICATION_NAME_MAX = 63  # NAMEDATALEN - 1: Postgres truncates longer names


def connect_kwargs(
    url: str, *, mode: PoolMode | None = None, application: str | None = None
) -> dict[str, Any]:
    """The keyword arguments of every connection to ``url`` (psycopg's and libpq's).

    ``mode`` None: the process's ``WORKER_POOL_MODE``. A setting the URL gives wins, and
    so does an application name the environment gives libpq (``PGAPPNAME``).
    """
    given = conninfo_to_dict(url)
    kwargs: dict[str, Any] = {k: v for k, v in TCP_SETTINGS.items() if k not in given}
    if "connect_timeout" not in given:
        kwargs["connect_timeout"] = CONNECT_TIMEOUT_S
    if application and "application_name" not in given and not os.environ.get("PGAPPNAME"):
        kwargs["application_name"] = application[:APPLICATION_NAME_MAX]
    if (mode or pool_mode()) is PoolMode.TRANSACTION:
        kwargs["prepare_threshold"] = None  # no server-side prepared statements
    return kwargs


def listens(mode: PoolMode | None = None) -> bool:
    """Whether this process may LISTEN on its database URL (not through a transaction
    pooler: a notification would reach whichever client holds that server connection)."""
    return (mode or pool_mode()) is PoolMode.SESSION


async def connect(
    url: str,
    *,
    autocommit: bool = False,
    mode: PoolMode | None = None,
    application: str | None = None,
) -> psycopg.AsyncConnection[TupleRow]:
    try:
        return await psycopg.AsyncConnection.connect(
            url, autocommit=autocommit, **connect_kwargs(url, mode=mode, application=application)
        )
    except psycopg.OperationalError as exc:
        # An embedded role whose password a session of it changed: said at once, with
        # the fix (the superuser looks; only on a refused login of such a role).
        changed = None
        if embedded.made_here(url):
            changed = await asyncio.to_thread(embedded.login_refused, url, exc)
        raise (changed or unreachable(url, exc)) from exc


@contextlib.asynccontextmanager
async def session(
    url: str, *, mode: PoolMode | None = None, application: str | None = None
) -> AsyncIterator[psycopg.AsyncConnection[TupleRow]]:
    """An autocommit connection of its own, closed however the block ends.

    Not psycopg's ``async with conn``: that commits (or rolls back) before it closes, and
    the commit may yield to the event loop even with nothing to send (psycopg yields when
    the loop has been busy for a few milliseconds). A loop that saw its stop event and was
    committing on its way out took the shutdown's cancel there and skipped the close; the
    connection stayed open until garbage collection. Closing needs no round trip, so it
    cannot be interrupted; an autocommit connection has nothing to commit.
    """
    conn = await connect(url, autocommit=True, mode=mode, application=application)
    try:
        yield conn
    finally:
        await conn.close()


async def wait_for_contract(url: str, *, timeout_s: float) -> None:
    """Return once the database is at this code's schema contract (memoized as verified).

    For processes that start next to the migration gate instead of after it (honcho starts
    every Procfile line at once; a Kubernetes rollout may start pods before its migration
    job ends): while the database is behind, poll until ``timeout_s``, then raise the
    mismatch. A database ahead of this code (a newer contract version, or a newer
    procrastinate schema) is raised at once: no migration of this release can fix it.
    """
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        async with session(url) as conn:
            try:
                await migrations.verify_contract(conn)
            except ProcrastinateTooOld:
                raise
            except SchemaContractMismatch as exc:
                found = await migrations.read_contract(conn)
                ahead = found is not None and found.version > migrations.code_contract().version
                if ahead or time.monotonic() >= deadline:
                    raise
                if not waited:
                    log.info("schema_waiting", reason=exc.message, timeout_s=timeout_s)
                    waited = True
            else:
                if waited:
                    log.info("schema_ready", contract=migrations.code_contract().version)
                return
        await asyncio.sleep(SCHEMA_POLL_S)
