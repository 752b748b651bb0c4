"""What the benchmarks share: throwaway databases, small query helpers, quiet logging."""

from __future__ import annotations

import logging
import sys
from typing import Any

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo


class BenchError(RuntimeError):
    """A phase failed: a timeout, a worker that died, a failed correctness check."""


def with_dbname(url: str, dbname: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


async def connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)


async def scalar(conn: psycopg.AsyncConnection[Any], sql: Any, params: Any = None) -> Any:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


async def create_database(admin_url: str, name: str) -> str:
    async with await connect(admin_url) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    return with_dbname(admin_url, name)


async def drop_database(admin_url: str, name: str) -> None:
    async with await connect(admin_url) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def server_info(admin_url: str, settings: tuple[str, ...]) -> dict[str, Any]:
    """The server version and the settings that decide what a benchmark measures."""
    async with await connect(admin_url) as conn:
        info: dict[str, Any] = {"version": await scalar(conn, "SHOW server_version")}
        for setting in settings:
            info[setting] = await scalar(conn, f"SHOW {setting}")
    return info


def quiet_logging() -> None:
    """Warnings and errors only, as JSON on stderr, for every library in the process."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # "App is instantiated in the main Python module": true under `-m`, and harmless here.
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def sigterm_exits(_signum: int, _frame: Any) -> None:
    """A SIGTERM handler that unwinds (so the throwaway server is stopped and removed)."""
    raise SystemExit(143)
