"""Row throughput of one big ``enrich`` run, against a plain-SQL floor and bare procrastinate.

One throwaway Postgres (the embedded server in a fresh temporary home, stopped and removed
at the end, even on error), one fresh database per system:

1. ours: ``--rows`` rows through ONE run of the ``enrich`` play. The rows are submitted as
   the run's inputs (timed on its own), then a worker starts as a subprocess
   (``worker start --release bench --concurrency 4``) and the bench polls ``wq_runs`` every
   100 ms until the run succeeded. rows/s = rows / execution time, where execution is the
   run's ``started_at`` .. ``finished_at`` (server clock); the wall clock from spawning the
   worker to seeing the run succeeded is reported too, and so is the rate including the
   submit. The worker's peak RSS (``VmHWM``) is read just before it is stopped (SIGTERM).
   The same is done at ``--small-rows`` rows to show the peak RSS does not grow with rows.
   Checked: the run succeeded, ``rows_done`` = rows, every sheet row is done with the
   play's output, one receipt per row.
2. floor: the same writes with no queue, one process, one connection, autocommit, per page:
   insert the page into a sheet-like table, insert its receipts, one fenced UPDATE of the
   page's outputs. Variants at server defaults: ``INSERT ... SELECT FROM unnest`` and
   ``COPY``; and a separate, named tuned row: unnest with ``enable_nestloop = off`` in its
   session (without it the planner may run the UPDATE on the never-analyzed table as a
   page x page nested loop). Statements are never server-side prepared.
3. procrastinate, as a competent user would batch: one job per page (``--rows`` rows in
   jobs of ``--page``); the task computes the page's outputs and writes them with one
   set-based ``UPDATE ... FROM unnest``. And, for scale, one job per row
   (``--procrastinate-rows``), each UPDATEing its row. Jobs are deferred in batches, then
   ``ANALYZE``, then an in-process worker (concurrency 4, ``wait=False``: it returns once
   the queue is empty) drains them.

Run: ``.venv/bin/python -m bench.rows [--rows 100000] [--page 1000]``. Results: a table on
stdout and a results file under ``bench/results/`` (:mod:`bench.results`). See
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import procrastinate
import psycopg
from psycopg.types.json import Jsonb

from bench.common import (
    BenchError,
    add_out,
    add_pg_bin,
    add_systems,
    connect,
    create_database,
    run_on_throwaway_server,
    scalar,
)
from bench.results import metric, summary
from queues import admission, lanes, migrations, receipts
from queues.inputs import InputPages
from worker import embedded
from worker.demo import score

RELEASE = "bench"
SERVER_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "wal_level",
    "max_wal_size",
    "autovacuum",
)
SHEET = "bench-rows"
ORG = "default"
PROCRASTINATE_QUEUE = "rows"
SYSTEMS = ("ours", "floor", "procrastinate")
POLL_S = 0.1
TARGET_FLOOR_RATIO = 0.7  # ours / the floor at server defaults (INSERT ... FROM unnest)
TARGET_PROCRASTINATE_RATIO = 20.0
TARGET_RSS_MB = 150.0
COUNTRIES = ("US", "BR", "DE", "FR", "IN", "JP", "GB", "CA")

_children: list[subprocess.Popen[bytes]] = []  # worker subprocesses to end on any exit


# ---- helpers ----------------------------------------------------------------------------


def make_rows(n: int) -> list[tuple[str, dict[str, Any]]]:
    """Deterministic company-like rows, shaped like the bundled sample (key, domain, ...)."""
    rows = []
    for i in range(n):
        key = f"r{i:07d}"
        rows.append(
            (
                key,
                {
                    "key": key,
                    "name": f"Company {i}",
                    "domain": f"company-{i}.example",
                    "employees": (i * 7919) % 20000,
                    "country": COUNTRIES[i % len(COUNTRIES)],
                },
            )
        )
    return rows


def pages_of(rows: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def proc_memory_mb(pid: int) -> dict[str, float]:
    """VmHWM (peak RSS) and VmRSS of a process, in MiB."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                out[name] = round(int(value.split()[0]) / 1024, 1)
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate(n: int, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("nan")


def phase_timeout(n: int) -> float:
    return max(120.0, n / 40)  # slower than 40 rows/s is a stuck phase


def worker_command() -> list[str]:
    script = Path(sys.executable).parent / "worker"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from worker.cli import main; main()"]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---- 1. ours: one enrich run ------------------------------------------------------------


async def bench_ours(
    admin_url: str, home: Path, n: int, page: int, concurrency: int
) -> dict[str, Any]:
    url = await create_database(admin_url, f"rows_ours_{n}_{os.getpid()}")
    async with await connect(url) as conn:
        await migrations.migrate(conn)
        async with conn.transaction():
            await lanes.prepare(conn, RELEASE)
    rows = make_rows(n)
    # The stored input page (what ctx.input_pages() yields) is `page` rows here.
    pages = InputPages.of(rows, page_size=page)
    sub = admission.Submission(play="enrich", params={"sheet": SHEET}, release=RELEASE)
    async with await connect(url) as conn:
        t0 = time.perf_counter()
        admitted = await admission.submit(conn, sub, inputs=pages)
        submit_s = time.perf_counter() - t0
    run_id = admitted.run_id

    ready_file = home / f"worker-{n}.ready"
    log_path = home / f"worker-{n}.log"
    env = dict(os.environ, WORKER_DATABASE_URL=url)
    cmd = [
        *worker_command(),
        "start",
        "--release",
        RELEASE,
        "--concurrency",
        str(concurrency),
        "--ready-file",
        str(ready_file),
    ]
    with open(log_path, "wb") as log_file:
        t_spawn = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    _children.append(proc)
    try:
        t_ready: float | None = None
        rss_ready: dict[str, float] = {}
        cpu_ready = 0.0
        deadline = t_spawn + phase_timeout(n)
        async with await connect(url) as conn:
            while True:
                now = time.perf_counter()
                if t_ready is None and ready_file.exists():
                    t_ready = now
                    rss_ready = proc_memory_mb(proc.pid)
                    cpu_ready = proc_cpu_s(proc.pid)
                state = await scalar(
                    conn, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,)
                )
                if state == "succeeded":
                    break
                if state in ("failed", "cancelled", "dead"):
                    raise BenchError(f"ours ({n} rows): the run ended {state}\n{_tail(log_path)}")
                if proc.poll() is not None:
                    raise BenchError(
                        f"ours ({n} rows): the worker exited with {proc.returncode}"
                        f"\n{_tail(log_path)}"
                    )
                if now > deadline:
                    raise BenchError(
                        f"ours ({n} rows): run still {state} after "
                        f"{now - t_spawn:.0f} s\n{_tail(log_path)}"
                    )
                await asyncio.sleep(POLL_S)
        observed_s = time.perf_counter() - t_spawn
        memory = proc_memory_mb(proc.pid)  # just before stopping it
        cpu_s = proc_cpu_s(proc.pid) - cpu_ready
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)
        _children.remove(proc)

    async with await connect(url) as conn:
        cur = await conn.execute(
            "SELECT extract(epoch FROM finished_at - started_at)::float8,"
            " extract(epoch FROM started_at - created_at)::float8,"
            " rows_admitted, rows_done, attempt, result FROM wq_runs WHERE id = %s",
            (run_id,),
        )
        got = await cur.fetchone()
        assert got is not None
        exec_s, queued_s, rows_admitted, rows_done, attempt, result = got
        sheet_done = await scalar(
            conn,
            "SELECT count(*) FROM wq_sheet_rows WHERE org = %s AND sheet = %s"
            " AND status = 'done' AND run_id = %s",
            (ORG, SHEET, run_id),
        )
        receipt_count = await scalar(
            conn,
            "SELECT count(*) FROM wq_receipts WHERE scope = %s AND status = 'completed'",
            (str(receipts.Scope.of_run(run_id)),),
        )
        sample = [rows[i] for i in sorted({0, n // 2, n - 1})]
        cur = await conn.execute(
            "SELECT row_key, output FROM wq_sheet_rows WHERE org = %s AND sheet = %s"
            " AND row_key = ANY(%s)",
            (ORG, SHEET, [k for k, _ in sample]),
        )
        outputs = dict(await cur.fetchall())
        sizes = await table_sizes(conn, ["wq_run_inputs", "wq_sheet_rows", "wq_receipts"])
        cur = await conn.execute(
            "SELECT relname, n_live_tup, n_dead_tup, seq_scan, idx_scan, analyze_count,"
            " autoanalyze_count FROM pg_stat_user_tables"
            " WHERE relname IN ('wq_sheet_rows', 'wq_receipts') ORDER BY relname"
        )
        cols = [d.name for d in cur.description or []]
        stats = {r[0]: dict(zip(cols[1:], r[1:], strict=True)) for r in await cur.fetchall()}
    checks = {
        "run_succeeded": True,
        "rows_done_eq_rows": rows_done == n,
        "rows_admitted_eq_rows": rows_admitted == n,
        "sheet_rows_done_eq_rows": sheet_done == n,
        "one_receipt_per_row": receipt_count == n,
        "single_attempt": attempt == 1,
        "sample_outputs_match": all(outputs.get(k) == score(r) for k, r in sample),
        "result_enriched_eq_rows": (result or {}).get("enriched") == n,
    }
    if not all(checks.values()):
        bad = [k for k, ok in checks.items() if not ok]
        raise BenchError(
            f"ours ({n} rows): correctness checks failed: {bad} "
            f"(rows_done={rows_done}, sheet_done={sheet_done}, "
            f"receipts={receipt_count}, result={result})"
        )
    return {
        "rows": n,
        "page": page,
        "concurrency": concurrency,
        "submit_s": round(submit_s, 4),
        "submit_rows_per_s": rate(n, submit_s),
        "exec_s": round(exec_s, 4),
        "rows_per_s": rate(n, exec_s),
        "rows_per_s_incl_submit": rate(n, submit_s + exec_s),
        "queued_s": round(queued_s, 4),
        "worker_startup_s": None if t_ready is None else round(t_ready - t_spawn, 3),
        "spawn_to_observed_s": round(observed_s, 3),
        "rows_per_s_wall": rate(n, observed_s),
        "worker_peak_rss_mb": memory.get("VmHWM"),
        "worker_rss_mb": memory.get("VmRSS"),
        "worker_rss_at_ready_mb": rss_ready.get("VmRSS"),
        "worker_cpu_s_after_ready": round(cpu_s, 3),
        "run_result": result,
        "table_sizes": sizes,
        "table_stats": stats,
        "checks": checks,
    }


async def table_sizes(conn: psycopg.AsyncConnection[Any], tables: list[str]) -> dict[str, str]:
    cur = await conn.execute(
        "SELECT relname, pg_size_pretty(pg_total_relation_size(oid)) FROM pg_class"
        " WHERE relname = ANY(%s) ORDER BY relname",
        (tables,),
    )
    return dict(await cur.fetchall())


# ---- 2. the plain-SQL floor -------------------------------------------------------------

FLOOR_SCHEMA = """
CREATE TABLE floor_rows_{v} (
    org text NOT NULL, sheet text NOT NULL, row_key text NOT NULL, run_id uuid,
    write_version bigint, status text NOT NULL DEFAULT 'pending',
    input jsonb NOT NULL DEFAULT '{{}}', output jsonb,
    admitted_at timestamptz NOT NULL DEFAULT now(), finished_at timestamptz,
    PRIMARY KEY (org, sheet, row_key)
);
CREATE INDEX ON floor_rows_{v} (run_id, status);
CREATE TABLE floor_receipts_{v} (
    org text NOT NULL, play text NOT NULL, scope text NOT NULL, step_key text NOT NULL,
    status text NOT NULL, owner_run uuid, owner_attempt integer, result jsonb,
    created_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz,
    PRIMARY KEY (org, play, scope, step_key)
);
CREATE INDEX ON floor_receipts_{v} (owner_run);
"""


async def bench_floor(admin_url: str, n: int, page: int) -> dict[str, Any]:
    url = await create_database(admin_url, f"rows_floor_{os.getpid()}")
    rows = make_rows(n)
    out: dict[str, Any] = {}
    async with await connect(url) as conn:
        for variant in FLOOR_VARIANTS:
            # The tuned row only: on never-analyzed tables the planner may put the unnest
            # inside a nested loop (page x page comparisons); a hash join is what a tuned
            # loader gets. The default rows keep the server's planner settings.
            tuned = variant == "unnest_tuned"
            await conn.execute(f"SET enable_nestloop = {'off' if tuned else 'on'}")
            await conn.execute(FLOOR_SCHEMA.format(v=variant))
            run_id, version, scope = uuid.uuid4(), 1, f"run:{uuid.uuid4()}"
            phases = dict.fromkeys(("admit_s", "receipts_s", "complete_s"), 0.0)
            t0 = time.perf_counter()
            for chunk in pages_of(rows, page):
                await floor_page(conn, variant, chunk, run_id, version, scope, phases)
            elapsed = time.perf_counter() - t0
            done = await scalar(
                conn, f"SELECT count(*) FROM floor_rows_{variant} WHERE status = 'done'"
            )
            paid = await scalar(conn, f"SELECT count(*) FROM floor_receipts_{variant}")
            if done != n or paid != n:
                raise BenchError(f"floor {variant}: {done} rows done, {paid} receipts of {n}")
            out[variant] = {
                "rows": n,
                "page": page,
                "seconds": round(elapsed, 4),
                "rows_per_s": rate(n, elapsed),
                "phases": {k: round(v, 3) for k, v in phases.items()},
            }
    return out


async def floor_page(
    conn: psycopg.AsyncConnection[Any],
    variant: str,
    chunk: list[tuple[str, dict[str, Any]]],
    run_id: uuid.UUID,
    version: int,
    scope: str,
    phases: dict[str, float],
) -> None:
    """One page of the floor's writes. Statements are never server-side prepared
    (``prepare=False``): each is planned with its real arrays, as a careful hand-written
    loader would, so a generic plan cannot slow the floor down."""
    keys = [key for key, _ in chunk]
    t0 = time.perf_counter()
    rows_t, receipts_t = f"floor_rows_{variant}", f"floor_receipts_{variant}"
    # 1. admit: insert the page's rows under the write version.
    if variant == "copy":
        async with (
            conn.cursor() as cur,
            cur.copy(
                f"COPY {rows_t} (org, sheet, row_key, run_id, write_version, input) FROM STDIN"
            ) as copy,
        ):
            for key, row in chunk:
                await copy.write_row((ORG, SHEET, key, run_id, version, json.dumps(row)))
    else:
        await conn.execute(
            f"INSERT INTO {rows_t} (org, sheet, row_key, run_id, write_version, input)"
            " SELECT %s, %s, k, %s, %s, i FROM unnest(%s::text[], %s::jsonb[]) AS p (k, i)",
            (ORG, SHEET, run_id, version, keys, [Jsonb(row) for _, row in chunk]),
            prepare=False,
        )
    t1 = time.perf_counter()
    # 2. pay: one receipt per row, with the row's output.
    outputs = [json.dumps(score(row)) for _, row in chunk]
    step_keys = [f"enrich:{key}" for key in keys]
    if variant == "copy":
        async with (
            conn.cursor() as cur,
            cur.copy(
                f"COPY {receipts_t} (org, play, scope, step_key, status, owner_run, owner_attempt,"
                " result, completed_at) FROM STDIN"
            ) as copy,
        ):
            now = datetime.now(UTC)
            for step_key, output in zip(step_keys, outputs, strict=True):
                await copy.write_row(
                    (ORG, "enrich", scope, step_key, "completed", run_id, 1, output, now)
                )
    else:
        await conn.execute(
            f"INSERT INTO {receipts_t} (org, play, scope, step_key, status, owner_run,"
            " owner_attempt, result, completed_at)"
            " SELECT %s, 'enrich', %s, k, 'completed', %s, 1, r, now()"
            " FROM unnest(%s::text[], %s::jsonb[]) AS p (k, r)",
            (ORG, scope, run_id, step_keys, outputs),
            prepare=False,
        )
    t2 = time.perf_counter()
    # 3. complete: one fenced UPDATE of the page's outputs.
    await conn.execute(
        f"UPDATE {rows_t} r SET status = 'done', output = p.o, finished_at = now()"
        " FROM unnest(%s::text[], %s::jsonb[]) AS p (k, o)"
        " WHERE r.org = %s AND r.sheet = %s AND r.row_key = p.k"
        " AND r.row_key = ANY(%s) AND r.write_version = %s AND r.status = 'pending'",
        (keys, outputs, ORG, SHEET, keys, version),
        prepare=False,
    )
    t3 = time.perf_counter()
    phases["admit_s"] += t1 - t0
    phases["receipts_s"] += t2 - t1
    phases["complete_s"] += t3 - t2


# ---- 3. bare procrastinate, one job per row ---------------------------------------------


def _procrastinate_app(url: str, max_size: int) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=max_size)
    app = procrastinate.App(connector=connector)

    @app.task(name="bench.enrich_row", queue=PROCRASTINATE_QUEUE, pass_context=True)
    async def enrich_row(context: procrastinate.JobContext, key: str, row: dict[str, Any]) -> None:
        await context.app.connector.execute_query_async(
            "UPDATE proc_rows SET status = 'done', output = %(output)s WHERE key = %(key)s",
            output=score(row),
            key=key,
        )

    return app


FLOOR_VARIANTS = ("unnest", "copy", "unnest_tuned")


def _procrastinate_page_app(url: str, max_size: int) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=max_size)
    app = procrastinate.App(connector=connector)

    @app.task(name="bench.enrich_page", queue=PROCRASTINATE_QUEUE, pass_context=True)
    async def enrich_page(
        context: procrastinate.JobContext, keys: list[str], rows: list[dict[str, Any]]
    ) -> None:
        # One set-based statement a page, as a competent user batches.
        outputs = [json.dumps(score(row)) for row in rows]
        await context.app.connector.execute_query_async(
            "UPDATE proc_rows r SET status = 'done', output = p.o"
            " FROM unnest(%(keys)s::text[], %(outputs)s::jsonb[]) AS p (k, o)"
            " WHERE r.key = p.k AND r.status = 'pending'",
            keys=keys,
            outputs=outputs,
        )

    return app


async def bench_procrastinate_pages(
    admin_url: str, n: int, page: int, concurrency: int
) -> dict[str, Any]:
    """procrastinate with one job per page and one set-based UPDATE per job."""
    url = await create_database(admin_url, f"rows_procrastinate_pages_{os.getpid()}")
    rows = make_rows(n)
    app = _procrastinate_page_app(url, max_size=concurrency + 2)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        async with await connect(url) as conn:
            await conn.execute(
                "CREATE TABLE proc_rows (key text PRIMARY KEY,"
                " status text NOT NULL DEFAULT 'pending', output jsonb)"
            )
            await conn.execute(
                "INSERT INTO proc_rows (key) SELECT unnest(%s::text[])", ([k for k, _ in rows],)
            )
        task = app.tasks["bench.enrich_page"]
        t0 = time.perf_counter()
        await task.batch_defer_async(
            *(
                {"keys": [k for k, _ in chunk], "rows": [r for _, r in chunk]}
                for chunk in pages_of(rows, page)
            )
        )
        defer_s = time.perf_counter() - t0
        async with await connect(url) as conn:
            await conn.execute("ANALYZE")
        t1 = time.perf_counter()
        try:
            await asyncio.wait_for(
                app.run_worker_async(
                    queues=[PROCRASTINATE_QUEUE],
                    concurrency=concurrency,
                    wait=False,
                    listen_notify=False,
                    delete_jobs="never",
                    install_signal_handlers=False,
                ),
                phase_timeout(n),
            )
        except TimeoutError as exc:
            raise BenchError(
                f"procrastinate pages: not drained in {phase_timeout(n):.0f} s"
            ) from exc
        wall_s = time.perf_counter() - t1
    async with await connect(url) as conn:
        done = await scalar(conn, "SELECT count(*) FROM proc_rows WHERE status = 'done'")
        server_s = await scalar(
            conn,
            "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
            " - min(at) FILTER (WHERE type = 'started'))::float8 FROM procrastinate_events",
        )
    if done != n:
        raise BenchError(f"procrastinate pages: {done} rows done of {n}")
    return {
        "rows": n,
        "page": page,
        "concurrency": concurrency,
        "defer_s": round(defer_s, 4),
        "wall_s": round(wall_s, 4),
        "server_s": round(server_s, 4),
        "rows_per_s": rate(n, server_s),
    }


async def bench_procrastinate(admin_url: str, n: int, concurrency: int) -> dict[str, Any]:
    url = await create_database(admin_url, f"rows_procrastinate_{os.getpid()}")
    rows = make_rows(n)
    app = _procrastinate_app(url, max_size=concurrency + 2)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        async with await connect(url) as conn:
            await conn.execute(
                "CREATE TABLE proc_rows (key text PRIMARY KEY,"
                " status text NOT NULL DEFAULT 'pending', output jsonb)"
            )
            await conn.execute(
                "INSERT INTO proc_rows (key) SELECT unnest(%s::text[])", ([k for k, _ in rows],)
            )
        task = app.tasks["bench.enrich_row"]
        t0 = time.perf_counter()
        for chunk in pages_of(rows, 1000):
            await task.batch_defer_async(*({"key": k, "row": r} for k, r in chunk))
        defer_s = time.perf_counter() - t0
        async with await connect(url) as conn:
            await conn.execute("ANALYZE")
        t1 = time.perf_counter()
        drain = asyncio.wait_for(
            app.run_worker_async(
                queues=[PROCRASTINATE_QUEUE],
                concurrency=concurrency,
                wait=False,  # return once the queue is empty
                listen_notify=False,
                delete_jobs="never",
                install_signal_handlers=False,
            ),
            phase_timeout(n),
        )
        try:
            await drain
        except TimeoutError as exc:
            raise BenchError(
                f"procrastinate: {n} jobs not drained within {phase_timeout(n):.0f} s"
            ) from exc
        wall_s = time.perf_counter() - t1
    async with await connect(url) as conn:
        succeeded = await scalar(
            conn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        done = await scalar(conn, "SELECT count(*) FROM proc_rows WHERE status = 'done'")
        server_s = await scalar(
            conn,
            "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
            " - min(at) FILTER (WHERE type = 'started'))::float8 FROM procrastinate_events",
        )
    if succeeded != n or done != n:
        raise BenchError(f"procrastinate: {succeeded} jobs succeeded, {done} rows done of {n}")
    return {
        "rows": n,
        "concurrency": concurrency,
        "defer_s": round(defer_s, 4),
        "wall_s": round(wall_s, 4),
        "server_s": round(server_s, 4),
        "jobs_per_s": rate(n, server_s),
        "jobs_per_s_wall": rate(n, wall_s),
    }


# ---- orchestration ----------------------------------------------------------------------


async def run_bench(
    admin_url: str, home: Path, args: argparse.Namespace, results: dict[str, Any]
) -> None:
    """Run the phases, filling ``results`` as each one ends (a later failure keeps them).

    Each phase starts with a ``CHECKPOINT``, so that it does not pay for the previous
    phase's dirty buffers (and starts a checkpoint cycle of its own).
    """

    async def checkpoint() -> None:
        async with await connect(admin_url) as conn:
            await conn.execute("CHECKPOINT")

    if "ours" in args.systems:
        if args.small_rows:
            print(f"  ours enrich, {args.small_rows} rows ...", flush=True)
            await checkpoint()
            results["ours_small"] = await bench_ours(
                admin_url, home, args.small_rows, args.page, args.concurrency
            )
        print(f"  ours enrich, {args.rows} rows ...", flush=True)
        await checkpoint()
        results["ours"] = await bench_ours(admin_url, home, args.rows, args.page, args.concurrency)
    if "floor" in args.systems:
        print(f"  plain-SQL floor, {args.rows} rows ...", flush=True)
        await checkpoint()
        results["floor"] = await bench_floor(admin_url, args.rows, args.page)
    if "procrastinate" in args.systems:
        print(f"  bare procrastinate, {args.procrastinate_rows} jobs ...", flush=True)
        await checkpoint()
        results["procrastinate"] = await bench_procrastinate(
            admin_url, args.procrastinate_rows, args.concurrency
        )
        print(f"  procrastinate, one job per page of {args.page}, {args.rows} rows ...", flush=True)
        await checkpoint()
        results["procrastinate_pages"] = await bench_procrastinate_pages(
            admin_url, args.rows, args.page, args.concurrency
        )


def ratios(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    ours = results.get("ours")
    if not ours:
        return out
    for variant in FLOOR_VARIANTS:
        floor = results.get("floor", {}).get(variant)
        if floor:
            out[f"ours_over_floor_{variant}"] = round(ours["rows_per_s"] / floor["rows_per_s"], 3)
    if "procrastinate_pages" in results:
        out["ours_over_procrastinate_pages"] = round(
            ours["rows_per_s"] / results["procrastinate_pages"]["rows_per_s"], 2
        )
    if "procrastinate" in results:
        out["ours_over_procrastinate"] = round(
            ours["rows_per_s"] / results["procrastinate"]["jobs_per_s"], 1
        )
    return out


LABELS = {
    "ours": "ours",
    "floor_unnest": "floor: unnest",
    "floor_copy": "floor: COPY",
    "floor_unnest_tuned": "floor, tuned (enable_nestloop = off)",
    "procrastinate_pages": "procrastinate, 1 job per page",
    "procrastinate": "procrastinate, 1 job per row",
}


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every system's rows per second for :mod:`bench.results` (bare procrastinate's jobs
    per second: one job a row, on ``--procrastinate-rows``), and ours' peak RSS at both
    sizes."""
    metrics = [
        metric("rows_per_s", f"rows of one run, {args.rows:,}", "rows/s"),
        metric("peak_rss", f"worker peak RSS, {args.rows:,} rows", "MB", higher_is_better=False),
    ]
    figures: dict[str, dict[str, float | None]] = {}
    ours = results.get("ours")
    if ours:
        figures["ours"] = {
            "rows_per_s": ours["rows_per_s"],
            "peak_rss": ours["worker_peak_rss_mb"],
        }
    small = results.get("ours_small")
    if small:
        metrics.append(
            metric(
                "peak_rss_small",
                f"worker peak RSS, {small['rows']:,} rows",
                "MB",
                higher_is_better=False,
            )
        )
        figures.setdefault("ours", {})["peak_rss_small"] = small["worker_peak_rss_mb"]
    for variant, cell in results.get("floor", {}).items():
        figures[f"floor_{variant}"] = {"rows_per_s": cell["rows_per_s"]}
    if "procrastinate_pages" in results:
        figures["procrastinate_pages"] = {
            "rows_per_s": results["procrastinate_pages"]["rows_per_s"]
        }
    if "procrastinate" in results:
        figures["procrastinate"] = {"rows_per_s": results["procrastinate"]["jobs_per_s"]}
    per_row = f"{LABELS['procrastinate']} ({args.procrastinate_rows:,} rows)"
    return summary(metrics, figures, labels=LABELS | {"procrastinate": per_row})


def print_table(results: dict[str, Any], ratio: dict[str, float]) -> None:
    print()
    print(f"{'system':<44}{'rows':>8}{'seconds':>10}{'rows/s':>10}")

    def line(label: str, n: int, seconds: float, per_s: float) -> None:
        print(f"{label:<44}{n:>8}{seconds:>10.2f}{per_s:>10.0f}")

    for name in ("ours_small", "ours"):
        r = results.get(name)
        if r:
            line(
                "ours enrich, execution (run start..finish)",
                r["rows"],
                r["exec_s"],
                r["rows_per_s"],
            )
            line("  submit alone", r["rows"], r["submit_s"], r["submit_rows_per_s"])
            line(
                "  submit + execution",
                r["rows"],
                r["submit_s"] + r["exec_s"],
                r["rows_per_s_incl_submit"],
            )
            line(
                "  wall: spawn worker .. seen succeeded",
                r["rows"],
                r["spawn_to_observed_s"],
                r["rows_per_s_wall"],
            )
    floor = results.get("floor", {})
    for variant, label in (
        ("unnest", "floor: INSERT ... FROM unnest"),
        ("copy", "floor: COPY"),
        ("unnest_tuned", "floor, tuned: unnest, enable_nestloop off"),
    ):
        if variant in floor:
            f = floor[variant]
            line(label, f["rows"], f["seconds"], f["rows_per_s"])
    if "procrastinate_pages" in results:
        p = results["procrastinate_pages"]
        line("procrastinate, 1 job/page, set-based", p["rows"], p["server_s"], p["rows_per_s"])
    if "procrastinate" in results:
        p = results["procrastinate"]
        line(
            "procrastinate, 1 job/row, analyzed (jobs/s)", p["rows"], p["server_s"], p["jobs_per_s"]
        )
    print()
    checks = [
        ("ours / floor (unnest)", ratio.get("ours_over_floor_unnest"), TARGET_FLOOR_RATIO),
        ("ours / floor (COPY)", ratio.get("ours_over_floor_copy"), TARGET_FLOOR_RATIO),
        ("ours / floor, tuned", ratio.get("ours_over_floor_unnest_tuned"), TARGET_FLOOR_RATIO),
        ("ours / procrastinate, 1 job/page", ratio.get("ours_over_procrastinate_pages"), 1.0),
        ("ours / procrastinate", ratio.get("ours_over_procrastinate"), TARGET_PROCRASTINATE_RATIO),
    ]
    for label, value, target in checks:
        if value is not None:
            verdict = "ok" if value >= target else "BELOW TARGET"
            print(f"{label:<44}{value:>9.2f}x  (target >= {target}x: {verdict})")
    for name in ("ours_small", "ours"):
        r = results.get(name)
        if r:
            verdict = "ok" if r["worker_peak_rss_mb"] < TARGET_RSS_MB else "ABOVE TARGET"
            print(
                f"{'worker peak RSS at ' + str(r['rows']) + ' rows':<44}"
                f"{r['worker_peak_rss_mb']:>8.1f} MB (at ready {r['worker_rss_at_ready_mb']}"
                f" MB; target < {TARGET_RSS_MB:.0f} MB: {verdict})"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the big run")
    parser.add_argument(
        "--small-rows",
        type=int,
        default=20_000,
        help="rows of the second run of ours (RSS flatness); 0 skips it",
    )
    parser.add_argument(
        "--page",
        type=int,
        default=1000,
        help=f"rows per page (ours: the stored input page, at most {receipts.MAX_PAGE})",
    )
    parser.add_argument(
        "--procrastinate-rows",
        type=int,
        default=20_000,
        help="jobs (one per row) for bare procrastinate",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    add_systems(parser, SYSTEMS)
    add_out(parser)
    parser.add_argument("--timeout", type=float, default=1800, help="overall limit in seconds")
    add_pg_bin(parser)
    args = parser.parse_args(argv)
    if (
        min(args.rows, args.procrastinate_rows, args.concurrency, args.page) < 1
        or args.small_rows < 0
    ):
        parser.error("counts must be positive")
    if args.page > receipts.MAX_PAGE:
        parser.error(
            f"--page is at most {receipts.MAX_PAGE} (receipts.MAX_PAGE: the enrich "
            "play records a whole page of steps in one complete_many call)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {
        "rows": args.rows,
        "small_rows": args.small_rows,
        "page": args.page,
        "procrastinate_rows": args.procrastinate_rows,
        "concurrency": args.concurrency,
        "systems": args.systems,
        "poll_s": POLL_S,
        "pg_bin": None if args.pg_bin is None else str(args.pg_bin),
    }

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        report["targets"] = {
            "ours_over_floor": TARGET_FLOOR_RATIO,
            "ours_over_procrastinate": TARGET_PROCRASTINATE_RATIO,
            "worker_peak_rss_mb": TARGET_RSS_MB,
        }
        results: dict[str, Any] = {}
        report["results"] = results
        try:
            await run_bench(server.url("postgres"), home, args, results)
        finally:
            if results:  # partial on failure: the phases that ended
                report["ratios"] = ratios(results)
                report["summary"] = summarize(results, args)
                print_table(results, report["ratios"])

    return run_on_throwaway_server(
        "rows",
        args,
        body,
        config=config,
        server_settings=SERVER_SETTINGS,
        timeout=args.timeout,
        cleanup=kill_children,
    )


def kill_children() -> None:
    """End the worker subprocesses still running (the bench failed or was interrupted)."""
    for proc in list(_children):
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
