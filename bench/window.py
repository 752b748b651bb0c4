"""What the schema window costs each command: statements (round trips) and time.

A process checks the schema once (memoized per database) and an admission-only submit
never does. This bench runs each command as a new process would (a new admitter, a new
check) on one throwaway Postgres at server defaults, in two states of the database:

- **exact**: migrated by this code, so the check reads the database's record and stops
  there;
- **newer**: migrated by a newer release (this code's migrations plus one more expand step,
  ``migrate(code=...)``), so this code is inside the window and its check also reads the
  history once.

Commands: the check itself (``verify_contract``); an admission-only submit
(``Admitter(admission_only=True)``, what a serverless admitter runs: no check); a lazy
submit of a new admitter (the check, the lane's preparation, the insert); the same
admitter's next submit (all memoized: the insert alone). The baseline is one ``SELECT 1``
round trip, measured in the same run. Statements are counted by the client (every
``execute`` of the connection and its cursors), so the count is exact.

Run: ``v/bin/python -m bench.window`` (a few seconds). Results: a table on stdout and a
results file under ``bench/results/`` (:mod:`bench.results`).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    add_out,
    add_rounds,
    create_database,
    drop_database,
    percentile,
    run_on_throwaway_server,
)
from bench.results import metric, summary
from queues import admission, migrations
from worker import embedded

SERVER_SETTINGS = ("max_connections", "shared_buffers", "synchronous_commit")


class CountingCursor(psycopg.AsyncCursor[Any]):
    """A cursor that counts the statements it sends (one round trip each)."""

    sent = 0

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        CountingCursor.sent += 1
        return await super().execute(*args, **kwargs)


async def counting(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        url, autocommit=True, cursor_factory=CountingCursor
    )


def newer_code() -> list[migrations.Migration]:
    """This code's migrations and one more expand step, as the next release would ship."""
    code = migrations.code_migrations()
    number = migrations.code_schema().version + 1
    text = "-- kind: expand\nCREATE TABLE wq_bench_window (id integer PRIMARY KEY);\n"
    return [
        *code,
        migrations.Migration(
            name=f"{number:04d}_bench_window",
            number=number,
            checksum=hashlib.sha256(text.encode()).hexdigest(),
            sql=text,
            kind=migrations.EXPAND,
        ),
    ]


async def measure(
    conn: psycopg.AsyncConnection[Any], rounds: int, command: Callable[[int], Awaitable[None]]
) -> dict[str, Any]:
    """Statements and milliseconds of ``command`` over ``rounds`` runs."""
    times: list[float] = []
    counts: list[int] = []
    for i in range(rounds):
        before = CountingCursor.sent
        started = time.perf_counter()
        await command(i)
        times.append((time.perf_counter() - started) * 1000)
        counts.append(CountingCursor.sent - before)
    assert len(set(counts)) == 1, f"a command sent a varying number of statements: {counts}"
    return {
        "statements": counts[0],
        "p50_ms": round(statistics.median(times), 4),
        "p99_ms": round(percentile(times, 99), 4),
    }


async def one_state(url: str, rounds: int) -> dict[str, Any]:
    conn = await counting(url)
    try:

        async def select_1(_: int) -> None:
            await conn.execute("SELECT 1")

        async def verify(_: int) -> None:
            await migrations.verify_contract(conn)

        def submission(i: int, tag: str) -> admission.Submission:
            return admission.Submission(
                play="echo", params={}, release="bench", idempotency_key=f"{tag}-{i}"
            )

        async def admission_only(i: int) -> None:
            await admission.Admitter(admission_only=True).submit(conn, submission(i, "ao"))

        async def lazy_first(i: int) -> None:
            await admission.Admitter().submit(conn, submission(i, "first"))

        warm = admission.Admitter()
        await warm.submit(conn, submission(-1, "warm"))

        async def lazy_warm(i: int) -> None:
            await warm.submit(conn, submission(i, "warm"))

        commands = {
            "select_1 (baseline)": select_1,
            "schema check": verify,
            "submit, admission-only": admission_only,
            "submit, new admitter (check, prepare, insert)": lazy_first,
            "submit, same admitter (memoized)": lazy_warm,
        }
        out = {name: await measure(conn, rounds, command) for name, command in commands.items()}
        base = out["select_1 (baseline)"]["p50_ms"]
        for row in out.values():
            row["x_round_trip"] = round(row["p50_ms"] / base, 2) if base else None
        return out
    finally:
        await conn.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.window", description=__doc__)
    add_rounds(parser, default=200, help="runs of each command")
    add_out(parser)
    return parser.parse_args(argv)


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each command's statements and p50 in both states, for :mod:`bench.results` (the
    states are the columns; no ratios: ``SELECT 1`` is the yardstick, a row of its own)."""
    names = list(next(iter(results.values()), {}))
    metrics = []
    for i, name in enumerate(names):
        metrics.append(
            metric(f"statements_{i}", f"{name}: statements", "statements", higher_is_better=False)
        )
        metrics.append(metric(f"p50_{i}", f"{name}: p50", "ms", higher_is_better=False))
    figures = {
        state: {
            key: rows[name][field]
            for i, name in enumerate(names)
            for key, field in ((f"statements_{i}", "statements"), (f"p50_{i}", "p50_ms"))
            if name in rows
        }
        for state, rows in results.items()
    }
    return summary(metrics, figures, subject=None, ratios={})


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'state':<7} {'command':<48} {'stmts':>5} {'p50 ms':>8} {'x SELECT 1':>10}")
    for state, rows in results.items():
        for name, row in rows.items():
            print(
                f"{state:<7} {name:<48} {row['statements']:>5} {row['p50_ms']:>8.3f} "
                f"{row['x_round_trip']:>10}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        admin_url = server.url("postgres")
        report["schema_version"] = migrations.code_schema().version
        results: dict[str, Any] = {}
        report["results"] = results
        for state in ("exact", "newer"):
            url = await create_database(admin_url, f"wq_window_{state}")
            try:
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                    code = newer_code() if state == "newer" else None
                    await migrations.migrate(conn, code=code)
                results[state] = await one_state(url, args.rounds)
            finally:
                await drop_database(admin_url, f"wq_window_{state}")
        report["summary"] = summarize(results)
        print_table(results)

    return run_on_throwaway_server("window", args, body, server_settings=SERVER_SETTINGS)


if __name__ == "__main__":
    sys.exit(main())
