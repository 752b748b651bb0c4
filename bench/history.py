"""Drain throughput as finished history grows, and worker RSS over many runs.

One throwaway embedded Postgres at server defaults (autovacuum on; no server setting is
changed). For each history size H (``--history``, default 0, 10k, 100k and 1M), on a
fresh database:

1. migrate, prepare the ``bench`` lane and set its retention to the longest the policy
   allows (365 days), so recovery's retention pass deletes nothing while we measure;
2. admit and drain ``REFERENCE_RUNS`` (100) trivial runs with the real worker: the rows
   a real finished run leaves;
3. synthesize H more finished runs by set-based SQL (``INSERT ... SELECT FROM
   generate_series`` in chunks of ``--chunk``, as the migration owner): every row of a
   reference run (its ``wq_runs`` row, attempt, ledger events with their stored per-run
   ``seq``, outbox rows if any, progress row, procrastinate's succeeded job and its
   events) is copied with a new run id, job id, event ids and timestamps shifted into the
   past (one run every 2 ms, ending before the reference runs). The chunks run with
   ``session_replication_role = replica`` (the session's, not the server's), so no trigger
   fires: the ledger's seq trigger, the outbox trigger, the NOTIFY triggers and
   procrastinate's status-event trigger are replaced by the rows they would have written,
   and the foreign keys are checked afterwards by anti-joins instead. A count per table
   checks that a synthesized run leaves as many rows as a real one;
4. no explicit VACUUM or ANALYZE: wait (up to ``--settle-timeout``) until autovacuum has
   nothing left to do on the main tables by its own thresholds and no autovacuum worker
   is busy in the database, and record the state it was in (``n_live_tup``,
   ``n_dead_tup``, last auto-vacuum and auto-analyze);
5. admit ``--runs`` trivial runs (``submit_many``, statements of 1,000), then time a worker
   at ``--concurrency`` from the first task start to the last finish (as
   ``bench.baselines`` does), with the server's CPU over that window (the postmaster and
   every backend, autovacuum included) and the tables' scan counters.

Then ``--rss-runs`` (default 100,000): one worker on a fresh database drains that many
trivial runs, admitted in batches as it goes, and the process's ``VmRSS`` is sampled every
``--rss-every`` (10,000) finished runs (the submitter shares the process).

Run: ``v/bin/python -m bench.history`` (about 10 minutes on 2 cores). Results: a table on
stdout, progress on stderr, a results file under ``bench/results/`` (:mod:`bench.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from bench.baselines import FirstStart, drained_at
from bench.common import (
    BenchError,
    add_out,
    connect,
    create_database,
    drop_database,
    run_on_throwaway_server,
    scalar,
    wait_until,
)
from bench.results import metric, summary
from bench.throughput import server_cpu_s
from queues import admission, lanes, migrations, recovery
from worker import embedded
from worker.plays import Registry
from worker.runtime import Settings, Worker

RELEASE = "bench"
REFERENCE_RUNS = 100
RETENTION_S = 365 * 86400.0  # the longest retention the lane policy accepts
SPACING_S = 0.002  # synthesized history: one finished run every 2 ms
SUBMIT_BATCH = 1000
POLL_S = 0.02
MAIN_TABLES = (
    "wq_runs",
    "wq_attempts",
    "wq_events",
    "wq_outbox",
    "wq_progress",
    "procrastinate_jobs",
    "procrastinate_events",
)
# Rows of a worker, not of a run (the reference worker's registration and its periodic job).
WORKER_TABLES = ("wq_workers", "procrastinate_workers", "procrastinate_periodic_defers")
SERVER_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_max_workers",
    "autovacuum_vacuum_cost_limit",
    "max_wal_size",
)
UNFINISHED = "SELECT count(*) FROM wq_runs WHERE state IN ('queued', 'running', 'sleeping')"
PENDING = "SELECT EXISTS (SELECT 1 FROM wq_runs WHERE state IN ('queued', 'running', 'sleeping'))"
# Recovery passes (procrastinate periodic jobs, one a minute) that ran in a window.
RECOVERY_JOBS = (
    "SELECT count(*) FROM procrastinate_jobs"
    " WHERE queue_name = 'wq-maintenance' AND status = 'succeeded'"
)
LAST_FINISH = "SELECT extract(epoch FROM clock_timestamp() - max(finished_at)) FROM wq_runs"

_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def vm_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in KiB."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


# ---- the system under test ------------------------------------------------------------------


class Bench:
    """One database: a registry with a trivial play, a submitter, a worker on demand."""

    def __init__(self, url: str, postmaster: int, args: argparse.Namespace) -> None:
        self.url = url
        self.postmaster = postmaster
        self.args = args
        self.marks = FirstStart()
        self.registry = Registry()
        self.submitted = 0
        marks = self.marks

        @self.registry.play("noop")
        async def noop(ctx: Any, params: dict[str, Any]) -> None:
            marks.mark()  # the first start only: no per-run state kept in the process

    async def setup(self) -> None:
        self.conn = await connect(self.url)
        await migrations.migrate(self.conn)
        async with self.conn.transaction():
            await lanes.prepare(self.conn, RELEASE)
        lane = await lanes.set_policy(self.conn, RELEASE, retention_s=RETENTION_S)
        self.retention_s = lane.retention_s

    async def close(self) -> None:
        await self.conn.close()

    async def submit(self, n: int) -> None:
        for start in range(0, n, SUBMIT_BATCH):
            size = min(SUBMIT_BATCH, n - start)
            await admission.submit_many(
                self.conn,
                [
                    admission.Submission(
                        play="noop", params={"i": self.submitted + i}, release=RELEASE
                    )
                    for i in range(size)
                ],
            )
            self.submitted += size

    def worker(self) -> Worker:
        return Worker(
            Settings(
                url=self.url,
                release=RELEASE,
                registry=self.registry,
                concurrency=self.args.concurrency,
                grace_s=5.0,
                install_signals=False,
            )
        )

    async def unfinished(self) -> int:
        return int(await scalar(self.conn, UNFINISHED))

    async def reference_runs(self, n: int) -> None:
        """n real runs, admitted and drained by the real worker, finished and projected
        (and every outbox row delivered, if there are any): what a real finished run leaves."""
        await self.submit(n)
        worker = self.worker()
        task = asyncio.create_task(worker.run())
        try:

            async def settled() -> bool:
                row = await (
                    await self.conn.execute(
                        "SELECT (SELECT count(*) FROM wq_runs WHERE state = 'succeeded'),"
                        " (SELECT count(*) FROM wq_outbox WHERE status <> 'delivered'),"
                        " (SELECT count(*) FROM wq_progress WHERE state = 'succeeded')"
                    )
                ).fetchone()
                assert row is not None
                return int(row[0]) >= n and int(row[1]) == 0 and int(row[2]) >= n

            await wait_until(settled, 60, "the reference runs to finish and be projected")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)

    async def drain(self, n: int) -> dict[str, Any]:
        """n trivial runs admitted first; a worker drains them; first start to last finish."""
        await self.submit(n)
        passes0 = int(await scalar(self.conn, RECOVERY_JOBS))
        before = await table_stats(self.conn)
        load = os.getloadavg()[0]
        self.marks.reset()
        cpu_server = server_cpu_s(self.postmaster)
        cpu_client = time.process_time()
        worker = self.worker()
        task = asyncio.create_task(worker.run())
        try:
            # Done when nothing is unfinished (the partial unfinished index: the poll itself
            # never reads the history).
            end = await drained_at(self.conn, PENDING, LAST_FINISH, self.args.phase_timeout)
            server_s = server_cpu_s(self.postmaster) - cpu_server
            client_s = time.process_time() - cpu_client
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        assert self.marks.first is not None
        seconds = end - self.marks.first
        await asyncio.sleep(0.6)  # the worker's backends have exited: their stats are flushed
        await self.conn.execute("SELECT pg_stat_clear_snapshot()")
        after = await table_stats(self.conn)
        passes = int(await scalar(self.conn, RECOVERY_JOBS)) - passes0
        return {
            "n": n,
            "seconds": round(seconds, 3),
            "per_s": round(n / seconds, 1),
            "server_cpu_us_per_run": round(server_s / n * 1e6, 1),
            "client_cpu_us_per_run": round(client_s / n * 1e6, 1),
            "loadavg_before": load,
            "recovery_passes": passes,
            "scans": scan_deltas(before, after),
        }


# ---- table statistics -----------------------------------------------------------------------

_STAT_COLUMNS = ("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch", "n_tup_ins", "n_tup_upd")


async def table_stats(conn: psycopg.AsyncConnection[Any]) -> dict[str, dict[str, Any]]:
    cur = await conn.execute(
        "SELECT s.relname, s.n_live_tup, s.n_dead_tup, s.n_mod_since_analyze,"
        " s.n_ins_since_vacuum, greatest(c.reltuples, 0)::float8 AS reltuples,"
        " s.last_autovacuum, s.last_autoanalyze, s.autovacuum_count, s.autoanalyze_count,"
        " coalesce(s.seq_scan, 0), coalesce(s.seq_tup_read, 0), coalesce(s.idx_scan, 0),"
        " coalesce(s.idx_tup_fetch, 0), s.n_tup_ins, s.n_tup_upd,"
        " pg_total_relation_size(s.relid) AS bytes"
        " FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid"
        " WHERE s.relname = ANY(%s) ORDER BY s.relname",
        (list(MAIN_TABLES),),
    )
    names = [d.name for d in cur.description or ()]
    names[10:16] = list(_STAT_COLUMNS)
    return {row[0]: dict(zip(names[1:], row[1:], strict=True)) for row in await cur.fetchall()}


def scan_deltas(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> dict[str, dict[str, int]]:
    return {
        t: {k: int(after[t][k]) - int(before[t][k]) for k in _STAT_COLUMNS}
        for t in MAIN_TABLES
        if t in before and t in after
    }


async def autovacuum_settle(
    conn: psycopg.AsyncConnection[Any], dbname: str, timeout: float
) -> dict[str, Any]:
    """Wait until autovacuum, by its own thresholds, has nothing left to do on the main
    tables and no autovacuum worker is busy in this database; never vacuum ourselves.
    Returns the state it was in (settled or not, what was still pending)."""
    cur = await conn.execute(
        "SELECT current_setting('autovacuum_vacuum_threshold')::float8,"
        " current_setting('autovacuum_vacuum_scale_factor')::float8,"
        " current_setting('autovacuum_analyze_threshold')::float8,"
        " current_setting('autovacuum_analyze_scale_factor')::float8,"
        " current_setting('autovacuum_vacuum_insert_threshold')::float8,"
        " current_setting('autovacuum_vacuum_insert_scale_factor')::float8"
    )
    row = await cur.fetchone()
    assert row is not None
    vt, vs, at, as_, it, is_ = (float(x) for x in row)
    t0 = time.monotonic()
    pending: list[str] = []
    busy: list[str] = []
    while True:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        stats = await table_stats(conn)
        pending = []
        for name, s in stats.items():
            rt = float(s["reltuples"])
            if int(s["n_dead_tup"]) > vt + vs * rt:
                pending.append(f"{name}: vacuum (dead)")
            if int(s["n_ins_since_vacuum"]) > it + is_ * rt:
                pending.append(f"{name}: vacuum (inserts)")
            if int(s["n_mod_since_analyze"]) > at + as_ * rt:
                pending.append(f"{name}: analyze")
        cur = await conn.execute(
            "SELECT coalesce(c.relname, '?') || ' ' || coalesce(p.phase, 'analyze')"
            " FROM pg_stat_activity a"
            " LEFT JOIN pg_stat_progress_vacuum p ON p.pid = a.pid"
            " LEFT JOIN pg_class c ON c.oid = p.relid"
            " WHERE a.backend_type = 'autovacuum worker' AND a.datname = %s",
            (dbname,),
        )
        busy = [r[0] for r in await cur.fetchall()]
        waited = time.monotonic() - t0
        if (not pending and not busy) or waited > timeout:
            break
        await asyncio.sleep(2)
    return {
        "settled": not pending and not busy,
        "waited_s": round(waited, 1),
        "pending": pending,
        "busy": busy,
        "tables": {
            name: {
                k: (v.isoformat(timespec="seconds") if isinstance(v, datetime) else v)
                for k, v in s.items()
                if k
                in (
                    "n_live_tup",
                    "n_dead_tup",
                    "last_autovacuum",
                    "last_autoanalyze",
                    "autovacuum_count",
                    "autoanalyze_count",
                    "bytes",
                )
            }
            for name, s in stats.items()
        },
    }


async def recovery_pass(url: str, slow_ms: float) -> dict[str, Any]:
    """Time one recovery pass (what every worker's maintenance loop runs each minute) with
    auto_explain loaded in this session only: the plans of its statements slower than
    ``slow_ms``, with actual rows, come back as notices."""
    notices: list[str] = []
    async with await connect(url) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        await conn.execute("LOAD 'auto_explain'")
        for setting, value in (
            ("auto_explain.log_min_duration", f"{slow_ms:g}ms"),
            ("auto_explain.log_analyze", "on"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.log_level", "notice"),
        ):
            await conn.execute("SELECT set_config(%s, %s, false)", (setting, value))
        t0 = time.perf_counter()
        report = await recovery.run_once(conn)
        seconds = time.perf_counter() - t0
    slow = [n for n in notices if n.startswith("duration:")]
    return {
        "seconds": round(seconds, 3),
        "deleted_runs": report.deleted_runs,
        "deleted_jobs": report.deleted_jobs,
        "slow_statements": [n.splitlines()[:120] for n in slow],
    }


# ---- synthesized history --------------------------------------------------------------------

# Every column of a template row (a reference run's row, as jsonb) is copied; these are
# replaced: keys, ids and the timestamp columns, shifted by s.shift (the synthesized run's
# creation time minus the reference run's). jsonb_populate_record sits in a LATERAL join:
# ``(f(...)).*`` would call it once per column. A history job's worker_id is NULL: its
# worker's procrastinate row is long pruned (the foreign key sets it NULL then); pointing a
# million jobs at the reference worker would make pruning that worker, during the timed
# drain, rewrite them all.
_SERIES = """
s AS (
    SELECT g.i, g.i - %(a)s AS j, md5(%(seed)s || g.i::text)::uuid AS id,
           %(t_end)s::timestamptz - make_interval(secs => (%(h)s - g.i) * %(spacing)s)
             - %(ref_created)s::timestamptz AS shift
      FROM generate_series(%(a)s, %(b)s - 1) AS g (i)
)"""


def _shifted(*columns: str) -> str:
    return ", ".join(f"'{c}', (t.j ->> '{c}')::timestamptz + s.shift" for c in columns)


_SYNTH: tuple[tuple[str, str], ...] = (
    (
        "wq_runs",
        """
WITH t AS MATERIALIZED (SELECT to_jsonb(r) AS j FROM wq_runs r WHERE r.id = %(ref)s),"""
        + _SERIES
        + """
INSERT INTO wq_runs
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::wq_runs,
       t.j || jsonb_build_object(
        'id', s.id,
        'params', jsonb_build_object('i', s.i),
        'authority', jsonb_set(t.j -> 'authority', '{run}', to_jsonb(s.id::text)),
        'job_id', CASE WHEN t.j -> 'job_id' = 'null' THEN NULL ELSE %(job0)s + s.i + 1 END, """
        + _shifted(
            "created_at",
            "started_at",
            "finished_at",
            "updated_at",
            "available_at",
            "lease_expires_at",
            "cancel_requested_at",
            "start_by",
        )
        + """)) AS x
 ORDER BY s.i""",
    ),
    (
        "wq_attempts",
        """
WITH t AS MATERIALIZED (
    SELECT to_jsonb(x) AS j, x.attempt FROM wq_attempts x WHERE x.run_id = %(ref)s),"""
        + _SERIES
        + """
INSERT INTO wq_attempts
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::wq_attempts,
       t.j || jsonb_build_object(
        'run_id', s.id, """
        + _shifted("started_at", "finished_at")
        + """)) AS x
 ORDER BY s.i, t.attempt""",
    ),
    (
        "wq_events",
        """
WITH t AS MATERIALIZED (
    SELECT row_number() OVER (ORDER BY x.seq) - 1 AS k, to_jsonb(x) AS j
      FROM wq_events x WHERE x.run_id = %(ref)s),"""
        + _SERIES
        + """
INSERT INTO wq_events OVERRIDING SYSTEM VALUE
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::wq_events,
       t.j || jsonb_build_object(
        'id', %(ev0)s + %(ke)s * %(a)s + t.k * %(n)s + s.j + 1,
        'run_id', s.id, """
        + _shifted("at")
        + """)) AS x
 ORDER BY t.k, s.i""",
    ),
    (
        "wq_outbox",
        """
WITH e AS MATERIALIZED (
    SELECT x.id, row_number() OVER (ORDER BY x.seq) - 1 AS k
      FROM wq_events x WHERE x.run_id = %(ref)s),
t AS MATERIALIZED (
    SELECT row_number() OVER (ORDER BY e.k, o.sink) - 1 AS k, e.k AS ek, to_jsonb(o) AS j
      FROM wq_outbox o JOIN e ON e.id = o.event_id),"""
        + _SERIES
        + """
INSERT INTO wq_outbox OVERRIDING SYSTEM VALUE
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::wq_outbox,
       t.j || jsonb_build_object(
        'id', %(ob0)s + %(ko)s * %(a)s + t.k * %(n)s + s.j + 1,
        'event_id', %(ev0)s + %(ke)s * %(a)s + t.ek * %(n)s + s.j + 1, """
        + _shifted("created_at", "next_attempt_at", "delivered_at", "lease_expires_at")
        + """)) AS x
 ORDER BY t.k, s.i""",
    ),
    (
        "wq_progress",
        """
WITH t AS MATERIALIZED (SELECT to_jsonb(x) AS j FROM wq_progress x WHERE x.run_id = %(ref)s),"""
        + _SERIES
        + """
INSERT INTO wq_progress
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::wq_progress,
       t.j || jsonb_build_object(
        'run_id', s.id, """
        + _shifted("updated_at")
        + """)) AS x
 ORDER BY s.i""",
    ),
    (
        "procrastinate_jobs",
        """
WITH t AS MATERIALIZED (
    SELECT to_jsonb(x) AS j FROM procrastinate_jobs x WHERE x.id = %(ref_job)s),"""
        + _SERIES
        + """
INSERT INTO procrastinate_jobs
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::procrastinate_jobs,
       t.j || jsonb_build_object(
        'id', %(job0)s + s.i + 1,
        'args', (t.j -> 'args') || jsonb_build_object('run_id', s.id::text),
        'worker_id', NULL, """
        + _shifted("scheduled_at")
        + """)) AS x
 ORDER BY s.i""",
    ),
    (
        "procrastinate_events",
        """
WITH t AS MATERIALIZED (
    SELECT row_number() OVER (ORDER BY x.id) - 1 AS k, to_jsonb(x) AS j
      FROM procrastinate_events x WHERE x.job_id = %(ref_job)s),"""
        + _SERIES
        + """
INSERT INTO procrastinate_events
SELECT x.*
  FROM s CROSS JOIN t
 CROSS JOIN LATERAL jsonb_populate_record(NULL::procrastinate_events,
       t.j || jsonb_build_object(
        'id', %(pe0)s + %(kp)s * %(a)s + t.k * %(n)s + s.j + 1,
        'job_id', %(job0)s + s.i + 1, """
        + _shifted("at")
        + """)) AS x
 ORDER BY t.k, s.i""",
    ),
)

_SEQUENCES = (
    ("wq_events", "id"),
    ("wq_outbox", "id"),
    ("procrastinate_jobs", "id"),
    ("procrastinate_events", "id"),
)

# Every row must point at an existing parent (the foreign keys, checked here because no
# trigger fired), and every synthesized run must have its job.
_ORPHANS: tuple[tuple[str, LiteralString], ...] = (
    (
        "wq_attempts without run",
        "SELECT count(*) FROM wq_attempts x WHERE NOT EXISTS"
        " (SELECT FROM wq_runs r WHERE r.id = x.run_id)",
    ),
    (
        "wq_events without run",
        "SELECT count(*) FROM wq_events x WHERE NOT EXISTS"
        " (SELECT FROM wq_runs r WHERE r.id = x.run_id)",
    ),
    (
        "wq_progress without run",
        "SELECT count(*) FROM wq_progress x WHERE NOT EXISTS"
        " (SELECT FROM wq_runs r WHERE r.id = x.run_id)",
    ),
    (
        "wq_outbox without event",
        "SELECT count(*) FROM wq_outbox x WHERE NOT EXISTS"
        " (SELECT FROM wq_events e WHERE e.id = x.event_id)",
    ),
    (
        "procrastinate_events without job",
        "SELECT count(*) FROM procrastinate_events x WHERE NOT EXISTS"
        " (SELECT FROM procrastinate_jobs p WHERE p.id = x.job_id)",
    ),
    (
        "wq_runs without job",
        "SELECT count(*) FROM wq_runs r WHERE NOT EXISTS"
        " (SELECT FROM procrastinate_jobs p WHERE p.args ->> 'run_id' = r.id::text)",
    ),
)


async def row_counts(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Rows per table; procrastinate's tables count only run jobs (not the recovery job)."""
    cur = await conn.execute("SELECT relname FROM pg_stat_user_tables ORDER BY relname")
    tables = [r[0] for r in await cur.fetchall()]
    out: dict[str, int] = {}
    for table in tables:
        if table == "procrastinate_jobs":
            sql = "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'wq.run'"
        elif table == "procrastinate_events":
            sql = (
                "SELECT count(*) FROM procrastinate_events e JOIN procrastinate_jobs p"
                " ON p.id = e.job_id WHERE p.task_name = 'wq.run'"
            )
        else:
            sql = f'SELECT count(*) FROM "{table}"'
        out[table] = int(await scalar(conn, sql))
    return out


def shape_check(
    empty: dict[str, int], real: dict[str, int], synth: dict[str, int], h: int
) -> list[dict[str, Any]]:
    """Rows per run in each table: a real run (the reference runs) vs a synthesized one."""
    rows = []
    for table in sorted(set(real) | set(synth)):
        per_real = (real.get(table, 0) - empty.get(table, 0)) / REFERENCE_RUNS
        per_synth = (synth.get(table, 0) - real.get(table, 0)) / h
        if per_real == 0 and per_synth == 0:
            continue
        worker_rows = table in WORKER_TABLES
        rows.append(
            {
                "table": table,
                "real_per_run": per_real,
                "synthesized_per_run": per_synth,
                "ok": worker_rows or abs(per_real - per_synth) < 1e-9,
                "note": "worker rows, not per run" if worker_rows else "",
            }
        )
    return rows


async def synthesize(conn: psycopg.AsyncConnection[Any], h: int, chunk: int) -> dict[str, Any]:
    """H finished runs copied from a reference run, in chunks, no trigger firing."""
    cur = await conn.execute(
        "SELECT r.id, r.created_at, p.id FROM wq_runs r"
        " JOIN procrastinate_jobs p ON p.args ->> 'run_id' = r.id::text"
        " WHERE r.state = 'succeeded' ORDER BY r.created_at, r.id LIMIT 1"
    )
    row = await cur.fetchone()
    if row is None:
        raise BenchError("no reference run to copy")
    ref, ref_created, ref_job = row
    first_created = await scalar(conn, "SELECT min(created_at) FROM wq_runs")

    async def one(sql: LiteralString) -> int:
        return int(await scalar(conn, sql))

    params: dict[str, Any] = {
        "ref": ref,
        "ref_job": ref_job,
        "ref_created": ref_created,
        "t_end": first_created - timedelta(seconds=1),
        "h": h,
        "spacing": SPACING_S,
        "seed": f"history-{uuid.uuid4()}-",
        "ev0": await one("SELECT coalesce(max(id), 0) FROM wq_events"),
        "ob0": await one("SELECT coalesce(max(id), 0) FROM wq_outbox"),
        "job0": await one("SELECT coalesce(max(id), 0) FROM procrastinate_jobs"),
        "pe0": await one("SELECT coalesce(max(id), 0) FROM procrastinate_events"),
        "ke": int(await scalar(conn, "SELECT count(*) FROM wq_events WHERE run_id = %s", (ref,))),
        "ko": int(
            await scalar(
                conn,
                "SELECT count(*) FROM wq_outbox o JOIN wq_events e ON e.id = o.event_id"
                " WHERE e.run_id = %s",
                (ref,),
            )
        ),
        "kp": int(
            await scalar(
                conn, "SELECT count(*) FROM procrastinate_events WHERE job_id = %s", (ref_job,)
            )
        ),
    }
    seconds: dict[str, float] = {t: 0.0 for t, _ in _SYNTH}
    t0 = time.perf_counter()
    for a in range(0, h, chunk):
        b = min(h, a + chunk)
        p = params | {"a": a, "b": b, "n": b - a}
        async with conn.transaction():
            # This session's triggers and FK triggers are off: we write what they would.
            await conn.execute("SET LOCAL session_replication_role = replica")
            for table, sql in _SYNTH:
                ts = time.perf_counter()
                await conn.execute(sql, p)
                seconds[table] += time.perf_counter() - ts
        say(f"  synthesized {b:,} / {h:,} runs ({time.perf_counter() - t0:.0f} s)")
    for table, column in _SEQUENCES:
        await conn.execute(
            "SELECT setval(pg_get_serial_sequence(%s, %s),"
            f' (SELECT max("{column}") FROM "{table}"))',
            (table, column),
        )
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "seconds_per_table": {k: round(v, 1) for k, v in seconds.items()},
        "reference_run": str(ref),
    }


# ---- the run --------------------------------------------------------------------------------


async def one_history(
    admin_url: str, postmaster: int, h: int, args: argparse.Namespace
) -> dict[str, Any]:
    db = f"bench_history_{h}"
    url = await create_database(admin_url, db)
    out: dict[str, Any] = {"history": h}
    bench = Bench(url, postmaster, args)
    try:
        await bench.setup()
        out["retention_s"] = bench.retention_s
        empty = await row_counts(bench.conn)
        say(f"history {h:,}: {REFERENCE_RUNS} reference runs with the real worker")
        await bench.reference_runs(REFERENCE_RUNS)
        real = await row_counts(bench.conn)
        if h:
            say(f"history {h:,}: synthesizing")
            out["synthesis"] = await synthesize(bench.conn, h, args.chunk)
            synth = await row_counts(bench.conn)
            out["shape_check"] = shape_check(empty, real, synth, h)
            out["orphans"] = {name: int(await scalar(bench.conn, sql)) for name, sql in _ORPHANS}
            if not all(r["ok"] for r in out["shape_check"]) or any(out["orphans"].values()):
                raise BenchError(
                    f"synthesized history differs from real runs: {out['shape_check']}"
                    f" {out['orphans']}"
                )
        say(f"history {h:,}: waiting for autovacuum (at most {args.settle_timeout:.0f} s)")
        out["autovacuum"] = await autovacuum_settle(bench.conn, db, args.settle_timeout)
        av = out["autovacuum"]
        say(
            f"history {h:,}: autovacuum {'settled' if av['settled'] else 'NOT settled'}"
            f" after {av['waited_s']} s {av['pending'] or ''} {av['busy'] or ''}"
        )
        out["history_runs"] = int(await scalar(bench.conn, "SELECT count(*) FROM wq_runs"))
        say(f"history {h:,}: draining {args.runs:,} runs at concurrency {args.concurrency}")
        out["drain"] = await bench.drain(args.runs)
        say(f"history {h:,}: {out['drain']['per_s']:,.0f} runs/s")
        row = await (
            await bench.conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE state = 'succeeded') FROM wq_runs"
            )
        ).fetchone()
        assert row is not None
        expected = out["history_runs"] + args.runs
        out["runs_after"] = {"total": int(row[0]), "succeeded": int(row[1])}
        if int(row[0]) != expected or int(row[1]) != expected:
            raise BenchError(
                f"history {h}: {row[0]} runs ({row[1]} succeeded) after the drain,"
                f" expected {expected}: retention deleted history or a run failed"
            )
        out["recovery_pass"] = await recovery_pass(url, args.slow_ms)
        say(f"history {h:,}: one recovery pass {out['recovery_pass']['seconds']:.2f} s")
        out["tables"] = {
            name: {k: s[k] for k in ("n_live_tup", "n_dead_tup", "bytes")}
            for name, s in (await table_stats(bench.conn)).items()
        }
        out["database_bytes"] = int(
            await scalar(bench.conn, "SELECT pg_database_size(current_database())")
        )
    finally:
        with contextlib.suppress(Exception):
            await bench.close()
        await drop_database(admin_url, db)
    return out


async def rss_series(admin_url: str, postmaster: int, args: argparse.Namespace) -> dict[str, Any]:
    """One worker drains --rss-runs runs admitted as it goes; VmRSS every --rss-every."""
    db = "bench_history_rss"
    url = await create_database(admin_url, db)
    bench = Bench(url, postmaster, args)
    total, every = args.rss_runs, args.rss_every
    samples: list[dict[str, Any]] = []
    try:
        await bench.setup()
        worker = bench.worker()
        task = asyncio.create_task(worker.run())
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            samples.append({"runs": 0, "seconds": 0.0, **vm_status()})
            say(f"rss: worker ready, VmRSS {samples[0]['VmRSS'] / 1024:.1f} MiB")
            backlog = max(2 * SUBMIT_BATCH, 4 * args.concurrency)
            next_sample = every
            deadline = time.monotonic() + args.rss_timeout
            while True:
                unfinished = await bench.unfinished()
                done = bench.submitted - unfinished
                while done >= next_sample and next_sample <= total:
                    samples.append(
                        {
                            "runs": next_sample,
                            "seconds": round(time.perf_counter() - t0, 1),
                            **vm_status(),
                        }
                    )
                    say(f"rss: {next_sample:,} runs, VmRSS {samples[-1]['VmRSS'] / 1024:.1f} MiB")
                    next_sample += every
                if done >= total:
                    break
                if bench.submitted < total and unfinished < backlog:
                    await bench.submit(min(SUBMIT_BATCH, total - bench.submitted))
                    continue
                if time.monotonic() > deadline:
                    raise BenchError(f"rss: {done} of {total} runs after {args.rss_timeout} s")
                await asyncio.sleep(0.05)
            seconds = time.perf_counter() - t0
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        failed = int(
            await scalar(bench.conn, "SELECT count(*) FROM wq_runs WHERE state <> 'succeeded'")
        )
        if failed:
            raise BenchError(f"rss: {failed} runs did not succeed")
    finally:
        with contextlib.suppress(Exception):
            await bench.close()
        await drop_database(admin_url, db)
    after = [s["VmRSS"] for s in samples if s["runs"] >= every]
    every_sample = [s["VmRSS"] for s in samples]
    return {
        "runs": total,
        "seconds": round(seconds, 1),
        "per_s": round(total / seconds, 1),
        "samples": samples,
        "max_over_min": round(max(after) / min(after), 3) if after else None,
        "max_over_min_from_ready": round(max(every_sample) / min(every_sample), 3),
        "vm_hwm_kib": vm_status()["VmHWM"],
    }


async def run_bench(
    admin_url: str, postmaster: int, args: argparse.Namespace, results: dict[str, Any]
) -> None:
    """Fills ``results`` as it goes (a failed phase leaves the earlier ones)."""
    results["histories"] = []
    for h in args.history:
        results["histories"].append(await one_history(admin_url, postmaster, h, args))
    base = next((r for r in results["histories"] if r["history"] == 0), None)
    for r in results["histories"]:
        if base is not None:
            r["ratio_to_empty"] = round(r["drain"]["per_s"] / base["drain"]["per_s"], 3)
    if args.rss_runs:
        results["rss"] = await rss_series(admin_url, postmaster, args)


def _mb(n: Any) -> str:
    return f"{int(n) / 1048576:,.0f}"


def whole_history_reads(r: dict[str, Any]) -> list[str]:
    """Tables whose rows read by sequential scans during the drain reach the history size."""
    h = r["history_runs"]
    out = []
    for table, d in r["drain"]["scans"].items():
        if h >= 1000 and d["seq_tup_read"] >= h:
            out.append(f"{table}: {d['seq_scan']} seq scans, {d['seq_tup_read']:,} rows read")
    return out


def plan_summary(lines: list[str], nodes: int = 10) -> list[str]:
    """An auto_explain notice, short: its duration, the statement's first SQL line, and
    its first plan nodes with their actual rows."""
    out = [lines[0]] if lines else []
    sql = [ln.strip().removeprefix("Query Text:").strip() for ln in lines[1:]]
    sql = [ln for ln in sql if ln and not ln.startswith("--") and "actual time" not in ln]
    if sql:
        out.append(f"statement: {sql[0]} ...")
    out += [ln.rstrip() for ln in lines if "actual time" in ln][:nodes]
    return out


def print_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print()
    print(
        f"Drain {args.runs:,} trivial runs at concurrency {args.concurrency}, by finished"
        " runs in history (one database each, autovacuum at server defaults):"
    )
    print()
    header = (
        "| history | runs/s | vs empty | server CPU us/run | load | autovacuum before |"
        " recovery pass s (in drain) |"
        " wq_runs MB | wq_events MB | wq_outbox MB | procrastinate_jobs MB |"
        " procrastinate_events MB | database MB |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in results["histories"]:
        d = r["drain"]
        t = r["tables"]
        av = r["autovacuum"]
        ratio = r.get("ratio_to_empty")
        print(
            f"| {r['history']:,} | {d['per_s']:,.0f} | {f'{ratio:.2f}x' if ratio else '-'} |"
            f" {d['server_cpu_us_per_run']:,.0f} | {d['loadavg_before']:.1f} |"
            f" {'settled' if av['settled'] else 'busy'} ({av['waited_s']:.0f} s) |"
            f" {r['recovery_pass']['seconds']:.2f} ({d['recovery_passes']}) |"
            f" {_mb(t['wq_runs']['bytes'])} | {_mb(t['wq_events']['bytes'])} |"
            f" {_mb(t['wq_outbox']['bytes'])} | {_mb(t['procrastinate_jobs']['bytes'])} |"
            f" {_mb(t['procrastinate_events']['bytes'])} | {_mb(r['database_bytes'])} |"
        )
    for r in results["histories"]:
        if "shape_check" in r:
            print(f"\nHistory {r['history']:,}, rows per run, real vs synthesized:")
            for c in r["shape_check"]:
                mark = "ok" if c["ok"] else "MISMATCH"
                note = f" ({c['note']})" if c["note"] else ""
                print(
                    f"  {c['table']:<30} {c['real_per_run']:>5.2f} {c['synthesized_per_run']:>5.2f}"
                    f"  {mark}{note}"
                )
            break
    for r in results["histories"]:
        for plan in r["recovery_pass"]["slow_statements"]:
            print(f"\nHistory {r['history']:,}, recovery pass, a slow statement:")
            for line in plan_summary(plan):
                print(f"  {line}")
    for r in results["histories"]:
        reads = whole_history_reads(r)
        if reads:
            print(f"\nHistory {r['history']:,}: sequential reads during the drain:")
            for line in reads:
                print(f"  {line}")
    rss = results.get("rss")
    if rss:
        print(f"\nWorker RSS over {rss['runs']:,} runs ({rss['per_s']:,.0f} runs/s):")
        print(
            "  "
            + ", ".join(f"{s['runs'] // 1000}k: {s['VmRSS'] / 1024:.1f}" for s in rss["samples"])
        )
        print(
            f"  MiB; max/min from {args.rss_every:,} runs on: {rss['max_over_min']},"
            f" from ready: {rss['max_over_min_from_ready']};"
            f" VmHWM {rss['vm_hwm_kib'] / 1024:.1f} MiB"
        )


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Ours per history size for :mod:`bench.results`: the drain, the server's CPU per
    run, one recovery pass and the database's size; each drain against the empty
    history's; and the worker's RSS over the series."""
    metrics: list[dict[str, Any]] = []
    figures: dict[str, float | None] = {}
    ratios: dict[str, dict[str, float]] = {}
    for r in results.get("histories", []):
        if "drain" not in r or "recovery_pass" not in r:
            continue
        h, d = r["history"], r["drain"]
        at = f"history {h:,}"
        rows = [
            (
                f"drain_{h}",
                f"drain {args.runs:,} at concurrency {args.concurrency}, {at}",
                "runs/s",
                True,
                d["per_s"],
            ),
            (
                f"server_cpu_{h}",
                f"server CPU per run, {at}",
                "us",
                False,
                d["server_cpu_us_per_run"],
            ),
            (
                f"recovery_pass_{h}",
                f"one recovery pass, {at}",
                "s",
                False,
                r["recovery_pass"]["seconds"],
            ),
            (
                f"database_mb_{h}",
                f"database, {at}",
                "MB",
                False,
                round(r["database_bytes"] / 1048576, 1),
            ),
        ]
        for key, label, unit, higher, value in rows:
            metrics.append(metric(key, label, unit, higher_is_better=higher))
            figures[key] = value
        if h and r.get("ratio_to_empty"):
            ratios[f"drain_{h}"] = {"empty history": round(r["ratio_to_empty"], 2)}
    rss = results.get("rss")
    if rss:
        samples = rss["samples"]
        metrics += [
            metric("rss_ready", "worker RSS at ready", "MiB", higher_is_better=False),
            metric(
                "rss_end", f"worker RSS after {rss['runs']:,} runs", "MiB", higher_is_better=False
            ),
            metric(
                "rss_growth",
                f"worker RSS max / min from {args.rss_every:,} runs on",
                "x",
                higher_is_better=False,
            ),
        ]
        figures["rss_ready"] = round(samples[0]["VmRSS"] / 1024, 1)
        figures["rss_end"] = round(samples[-1]["VmRSS"] / 1024, 1)
        figures["rss_growth"] = rss["max_over_min"]
    return summary(metrics, {"ours": figures}, ratios=ratios)


def _sizes(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.history", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--history", type=_sizes, default=[0, 10_000, 100_000, 1_000_000])
    p.add_argument("--runs", type=int, default=5000, help="runs drained per history size")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--chunk", type=int, default=100_000, help="runs synthesized per statement")
    p.add_argument("--settle-timeout", type=float, default=180.0)
    p.add_argument("--rss-runs", type=int, default=100_000, help="0: skip the RSS series")
    p.add_argument("--rss-every", type=int, default=10_000)
    p.add_argument("--rss-timeout", type=float, default=900.0)
    p.add_argument("--phase-timeout", type=float, default=300.0)
    p.add_argument(
        "--slow-ms", type=float, default=50.0, help="recovery statements slower than this: plans"
    )
    add_out(p)
    args = p.parse_args(argv)
    if args.runs < 1 or args.concurrency < 1 or args.chunk < 1 or args.rss_every < 1:
        p.error("counts must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        report["results"] = {}
        try:
            await run_bench(server.url("postgres"), server.pid, args, report["results"])
        finally:  # the sizes measured, also when a later one failed
            report["summary"] = summarize(report["results"], args)
        print_report(report["results"], args)

    return run_on_throwaway_server("history", args, body, server_settings=SERVER_SETTINGS)


if __name__ == "__main__":
    sys.exit(main())
