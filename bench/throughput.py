"""Throughput and pickup latency of this system and of bare procrastinate, side by side.

One run, one throwaway Postgres (the embedded server in a fresh temporary home), one fresh
database per system. Both systems run a trivial job at the same concurrency, in this
process, against the same server, phase by phase (interleaved, alternating which system
goes first):

1. submit+drain, cold statistics: a concurrent submitter admits N runs while the worker
   drains them; timed from the first submit to the last run finished.
2. drain alone, cold statistics: N runs admitted first (worker stopped); timed from the
   worker start to the last run finished.
3. submit+drain again after ``ANALYZE`` (the tables now hold the earlier runs).
4. drain alone again: N runs admitted, ``ANALYZE``, then the drain.
5. pickup latency: single submits ~20 ms apart to an idle worker; the server timestamps
   of admission and start give the submit-to-start latency.

The throwaway server keeps Postgres' defaults (autovacuum on): "cold" means no explicit
``ANALYZE`` yet (autovacuum may analyze a table during a phase, as in production), and
"analyzed" one explicit ``ANALYZE``. The submitters run in this
process too (a few connections each), so submit+drain measures admission and execution
sharing one machine. Each throughput phase also records the CPU time of this process and of
the server per job: on a busy host, wall-clock ratios are noisy, CPU per job is steadier.
``--rounds N`` repeats everything on fresh databases and reports the median round.

``--prefetch N`` runs ours in its high-throughput mode (``worker start --prefetch N``: N runs
claimed ahead into a local queue); ``--phases`` runs only some phases, e.g. the drain of
that mode alone, with the CPU our worker and the server spend per run:
``--systems ours --prefetch 300 --concurrency 10 --runs 20000 --phases drain_alone_analyzed``.

Run: ``.venv/bin/python -m bench.throughput [--runs 5000] [--latency-samples 300]
[--concurrency 16]``. Results: a table on stdout and a results file under ``bench/results/``
(:mod:`bench.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import procrastinate
import psycopg

from bench.common import (
    BenchError,
    add_out,
    add_rounds,
    add_systems,
    connect,
    create_database,
    drop_database,
    ms_percentiles,
    names_of,
    percentile,
    quiet_logging,
    run_on_throwaway_server,
    scalar,
)
from bench.results import metric, summary
from queues import admission, lanes, migrations
from worker import embedded
from worker.demo import demo_plays
from worker.runtime import POLL_INTERVAL_S, PREFETCH_MAX, Settings, Worker

RELEASE = "bench"
PROCRASTINATE_QUEUE = "bench"
SYSTEMS = ("ours", "procrastinate")
POLL_S = 0.05  # completion polling period
LATENCY_SPACING_S = 0.02

PHASES = (
    ("submit_drain_cold", "submit+drain, cold stats"),
    ("drain_alone_cold", "drain alone, cold stats"),
    ("submit_drain_analyzed", "submit+drain, analyzed"),
    ("drain_alone_analyzed", "drain alone, analyzed"),
)


def ms_summary(seconds: list[float]) -> dict[str, float]:
    return ms_percentiles(seconds, (50, 95, 99)) | {
        "max_ms": round(max(seconds) * 1000, 3) if seconds else float("nan")
    }


async def _gather_cancelling(coros: list[Awaitable[Any]]) -> list[Any]:
    """gather() that cancels the siblings when one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the two systems ------------------------------------------------------------------


@dataclass
class System(ABC):
    """What a phase needs from a system: a worker, a submitter, counters, timestamps."""

    name: str
    url: str
    concurrency: int
    submitters: int
    prefetch: int = 0  # ours: runs claimed ahead (its high-throughput mode); 0: its default
    stats: dict[str, Any] = field(default_factory=dict)

    @abstractmethod
    async def setup(self) -> None: ...

    async def close(self) -> None:
        return None

    @abstractmethod
    async def start_worker(self) -> None: ...

    @abstractmethod
    async def worker_ready(self) -> None: ...

    @abstractmethod
    async def stop_worker(self) -> None: ...

    @abstractmethod
    async def submit_many(self, n: int) -> None: ...

    @abstractmethod
    async def submit_one(self) -> Any: ...

    @abstractmethod
    async def done(self, conn: psycopg.AsyncConnection[Any]) -> int: ...

    @abstractmethod
    async def since_last_finish(self, conn: psycopg.AsyncConnection[Any]) -> float:
        """Seconds between the last run's finish (server time) and now (server time)."""
        ...

    @abstractmethod
    async def pickups(self, conn: psycopg.AsyncConnection[Any], ids: list[Any]) -> list[float]:
        """Submit-to-start seconds of the given runs/jobs, from server timestamps."""
        ...

    @abstractmethod
    async def check_alive(self) -> None: ...


class Ours(System):
    async def setup(self) -> None:
        async with await connect(self.url) as conn:
            await migrations.migrate(conn)
            async with conn.transaction():
                await lanes.prepare(conn, RELEASE)
        self.admitter = admission.Admitter(max_concurrent=max(16, self.submitters))
        self.conns = [await connect(self.url) for _ in range(self.submitters)]
        self.task: asyncio.Task[int] | None = None
        self.worker: Worker | None = None

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()

    async def start_worker(self) -> None:
        self.worker = Worker(
            Settings(
                url=self.url,
                release=RELEASE,
                registry=demo_plays,
                concurrency=self.concurrency,
                prefetch=self.prefetch,
                grace_s=10.0,
                install_signals=False,
            )
        )
        self.task = asyncio.create_task(self.worker.run(), name="ours-worker")

    async def worker_ready(self) -> None:
        assert self.worker is not None and self.task is not None
        ready = asyncio.create_task(self.worker.ready.wait())
        await asyncio.wait([ready, self.task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await self.check_alive()
            raise BenchError("our worker did not report ready within 30 s")

    async def check_alive(self) -> None:
        if self.task is not None and self.task.done():
            exc = self.task.exception()
            raise BenchError(
                f"our worker exited: {exc!r}"
                if exc
                else f"our worker exited with {self.task.result()}"
            )

    async def stop_worker(self) -> None:
        assert self.worker is not None and self.task is not None
        self.worker.stop()
        code = await asyncio.wait_for(self.task, 30)
        for key, value in self.worker.stats.items():
            self.stats[key] = self.stats.get(key, 0) + value
        self.worker = self.task = None
        if code != 0:
            raise BenchError(f"our worker exited with {code}")

    def _sub(self) -> admission.Submission:
        return admission.Submission(play="noop", params={}, release=RELEASE)

    async def submit_many(self, n: int) -> None:
        async def submitter(conn: psycopg.AsyncConnection[Any], count: int) -> None:
            for _ in range(count):
                await self.admitter.submit(conn, self._sub())

        shares = [n // self.submitters + (i < n % self.submitters) for i in range(self.submitters)]
        await _gather_cancelling([submitter(c, k) for c, k in zip(self.conns, shares, strict=True)])

    async def submit_one(self) -> Any:
        admitted = await self.admitter.submit(self.conns[0], self._sub())
        return admitted.run_id

    async def done(self, conn: psycopg.AsyncConnection[Any]) -> int:
        return int(await scalar(conn, "SELECT count(*) FROM wq_runs WHERE state = 'succeeded'"))

    async def since_last_finish(self, conn: psycopg.AsyncConnection[Any]) -> float:
        return float(
            await scalar(conn, "SELECT extract(epoch FROM now() - max(finished_at)) FROM wq_runs")
        )

    async def pickups(self, conn: psycopg.AsyncConnection[Any], ids: list[Any]) -> list[float]:
        cur = await conn.execute(
            "SELECT extract(epoch FROM started_at - created_at)::float8 FROM wq_runs"
            " WHERE id = ANY(%s) AND started_at IS NOT NULL",
            (ids,),
        )
        return [float(r[0]) for r in await cur.fetchall()]


def _procrastinate_app(url: str, *, min_size: int, max_size: int) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(conninfo=url, min_size=min_size, max_size=max_size)
    app = procrastinate.App(connector=connector)

    @app.task(name="bench.noop", queue=PROCRASTINATE_QUEUE)
    async def noop() -> None:
        return None

    return app


class Bare(System):
    async def setup(self) -> None:
        # Schema only, through procrastinate's own schema manager.
        async with _procrastinate_app(self.url, min_size=1, max_size=1).open_async() as app:
            await app.schema_manager.apply_schema_async()
        # The app process that defers: a pool of `submitters` connections. The worker gets
        # its own app and pool: concurrency + 4 (as ours) + 1 for procrastinate's listener,
        # which it takes from the pool (ours has a dedicated listener connection).
        self.defer_app = _procrastinate_app(
            self.url, min_size=self.submitters, max_size=self.submitters
        )
        await self.defer_app.open_async()
        self.task_: asyncio.Task[None] | None = None
        self.worker_app: procrastinate.App | None = None

    async def close(self) -> None:
        await self.defer_app.close_async()

    async def start_worker(self) -> None:
        self.worker_app = _procrastinate_app(self.url, min_size=2, max_size=self.concurrency + 5)
        app = self.worker_app

        async def run() -> None:
            async with app.open_async():
                await app.run_worker_async(
                    queues=[PROCRASTINATE_QUEUE],
                    concurrency=self.concurrency,
                    wait=True,
                    listen_notify=True,
                    fetch_job_polling_interval=POLL_INTERVAL_S,  # ours polls at this period
                    delete_jobs="never",
                    install_signal_handlers=False,
                )

        self.task_ = asyncio.create_task(run(), name="procrastinate-worker")

    async def worker_ready(self) -> None:
        # No ready event: wait for its worker row and then for its listener to be up.
        async with await connect(self.url) as conn:
            deadline = time.monotonic() + 30
            while not await scalar(conn, "SELECT count(*) FROM procrastinate_workers"):
                await self.check_alive()
                if time.monotonic() > deadline:
                    raise BenchError("procrastinate's worker did not register within 30 s")
                await asyncio.sleep(0.01)
            while not await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query LIKE 'LISTEN %%'",
            ):
                await self.check_alive()
                if time.monotonic() > deadline:
                    raise BenchError("procrastinate's worker did not LISTEN within 30 s")
                await asyncio.sleep(0.01)

    async def check_alive(self) -> None:
        if self.task_ is not None and self.task_.done():
            exc = self.task_.exception()
            raise BenchError(f"procrastinate's worker exited: {exc!r}")

    async def stop_worker(self) -> None:
        task = self.task_
        assert task is not None
        task.cancel()  # procrastinate stops gracefully on cancel
        await asyncio.wait([task], timeout=30)  # (never swallows our own cancellation)
        self.task_ = self.worker_app = None
        if not task.done():
            raise BenchError("procrastinate's worker did not stop within 30 s")
        if not task.cancelled() and task.exception() is not None:
            raise BenchError(f"procrastinate's worker failed: {task.exception()!r}")

    async def submit_many(self, n: int) -> None:
        task = self.defer_app.tasks["bench.noop"]

        async def submitter(count: int) -> None:
            for _ in range(count):
                await task.defer_async()

        shares = [n // self.submitters + (i < n % self.submitters) for i in range(self.submitters)]
        await _gather_cancelling([submitter(k) for k in shares])

    async def submit_one(self) -> Any:
        return await self.defer_app.tasks["bench.noop"].defer_async()

    async def done(self, conn: psycopg.AsyncConnection[Any]) -> int:
        return int(
            await scalar(conn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
        )

    async def since_last_finish(self, conn: psycopg.AsyncConnection[Any]) -> float:
        return float(
            await scalar(
                conn,
                "SELECT extract(epoch FROM now() - max(at)) FROM procrastinate_events"
                " WHERE type = 'succeeded'",
            )
        )

    async def pickups(self, conn: psycopg.AsyncConnection[Any], ids: list[Any]) -> list[float]:
        cur = await conn.execute(
            """
            SELECT extract(epoch FROM s.at - d.at)::float8
              FROM procrastinate_events d
              JOIN procrastinate_events s ON s.job_id = d.job_id AND s.type = 'started'
             WHERE d.type = 'deferred' AND d.job_id = ANY(%s)
            """,
            (ids,),
        )
        return [float(r[0]) for r in await cur.fetchall()]


# ---- measuring --------------------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int | str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on


def server_cpu_s(postmaster: int) -> float:
    """CPU seconds of the throwaway server: the postmaster, its reaped and live children.

    A consistent snapshot: if the postmaster reaped a child while we listed its children
    (its CPU moved from "live child" to the postmaster's cutime), list again; otherwise a
    backend of the previous phase exiting at the window's start is counted in full.
    """
    for _ in range(20):
        before = _proc_stat(postmaster)
        if before is None:
            return float("nan")
        live = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            child = _proc_stat(entry.name)
            if child is not None and child[1] == str(postmaster):  # ppid
                live += int(child[11]) + int(child[12])  # utime, stime
        after = _proc_stat(postmaster)
        # utime, stime, cutime, cstime: fields 14-17, index 11-14 from the state field
        if after is not None and after[11:15] == before[11:15]:
            return (sum(int(f) for f in after[11:15]) + live) / _TICK
    return float("nan")


@dataclass
class Meter:
    """Wall time, and CPU time of this process (client) and of the server, over a window."""

    postmaster: int
    wall: float = field(default_factory=time.perf_counter)
    client: float = field(default_factory=time.process_time)
    server: float = 0.0

    def __post_init__(self) -> None:
        self.server = server_cpu_s(self.postmaster)

    def cpu(self, jobs: int) -> dict[str, float]:
        client = time.process_time() - self.client
        server = server_cpu_s(self.postmaster) - self.server
        return {
            "client_s": round(client, 3),
            "server_s": round(server, 3),
            "client_us_per_job": round(client / jobs * 1e6, 1),
            "server_us_per_job": round(server / jobs * 1e6, 1),
        }


def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---- phases -----------------------------------------------------------------------------


@dataclass
class Ctx:
    system: System
    poll: psycopg.AsyncConnection[Any]  # the completion poller's connection
    postmaster: int


async def wait_done(ctx: Ctx, target: int, t0: float, timeout: float) -> tuple[float, float]:
    """Poll until ``target`` runs succeeded; (elapsed to the last finish, elapsed polled)."""
    deadline = t0 + timeout
    system = ctx.system
    while True:
        now = time.perf_counter()
        count = await system.done(ctx.poll)
        if count >= target:
            lag = await system.since_last_finish(ctx.poll)
            return max(0.0, (now - t0) - max(0.0, lag)), now - t0
        await system.check_alive()
        if now > deadline:
            raise BenchError(f"{system.name}: {count}/{target} runs done after {timeout:.0f} s")
        await asyncio.sleep(POLL_S)


async def analyze(system: System) -> None:
    async with await connect(system.url) as conn:
        await conn.execute("ANALYZE")


def phase_timeout(n: int) -> float:
    return max(60.0, n / 25)  # a floor of 25 runs/s before we call it stuck


async def submit_then_drain(ctx: Ctx, n: int, *, analyzed: bool) -> dict[str, Any]:
    system = ctx.system
    if analyzed:
        await analyze(system)
    base = await system.done(ctx.poll)
    await system.start_worker()
    await system.worker_ready()
    try:
        meter = Meter(ctx.postmaster)
        submit_s: list[float] = []

        async def submit() -> None:
            await system.submit_many(n)
            submit_s.append(time.perf_counter() - meter.wall)

        submitting = asyncio.create_task(submit())
        try:
            elapsed, polled = await wait_done(ctx, base + n, meter.wall, phase_timeout(n))
        finally:
            if not submitting.done():
                submitting.cancel()
            await asyncio.wait([submitting])
            if not submitting.cancelled() and submitting.exception() is not None:
                raise BenchError(f"{system.name}: submitter failed: {submitting.exception()!r}")
        cpu = meter.cpu(n)
    finally:
        await system.stop_worker()
    return {
        "runs": n,
        "elapsed_s": round(elapsed, 4),
        "elapsed_polled_s": round(polled, 4),
        "jobs_per_s": round(n / elapsed, 1),
        "submit_s": round(submit_s[0], 4),
        "submits_per_s": round(n / submit_s[0], 1),
        "cpu": cpu,
    }


async def drain_alone(ctx: Ctx, n: int, *, analyzed: bool) -> dict[str, Any]:
    system = ctx.system
    base = await system.done(ctx.poll)
    burst = Meter(ctx.postmaster)
    await system.submit_many(n)
    submit_s = time.perf_counter() - burst.wall
    burst_cpu = burst.cpu(n)
    if analyzed:
        await analyze(system)
    meter = Meter(ctx.postmaster)
    await system.start_worker()
    try:
        elapsed, polled = await wait_done(ctx, base + n, meter.wall, phase_timeout(n))
        cpu = meter.cpu(n)
    finally:
        await system.stop_worker()
    return {
        "runs": n,
        "elapsed_s": round(elapsed, 4),
        "elapsed_polled_s": round(polled, 4),
        "jobs_per_s": round(n / elapsed, 1),
        "cpu": cpu,
        "burst_submit_s": round(submit_s, 4),
        "burst_submits_per_s": round(n / submit_s, 1),
        "burst_cpu": burst_cpu,
    }


async def pickup_latency(ctx: Ctx, samples: int) -> dict[str, Any]:
    system = ctx.system
    base = await system.done(ctx.poll)
    await system.start_worker()
    await system.worker_ready()
    try:
        await asyncio.sleep(0.5)  # idle
        ids: list[Any] = []
        calls: list[float] = []
        t0 = time.perf_counter()
        for _ in range(samples):
            started = time.perf_counter()
            ids.append(await system.submit_one())
            calls.append(time.perf_counter() - started)
            await asyncio.sleep(max(0.0, LATENCY_SPACING_S - (time.perf_counter() - started)))
        await wait_done(ctx, base + samples, t0, 60)
        pickups = await system.pickups(ctx.poll, ids)
    finally:
        await system.stop_worker()
    if len(pickups) != samples:
        raise BenchError(f"{system.name}: {len(pickups)}/{samples} pickups recorded")
    return {"pickup_s": pickups, "submit_call_s": calls}


async def stat_counts(url: str) -> dict[str, Any]:
    async with await connect(url) as conn:
        cur = await conn.execute(
            "SELECT relname, n_live_tup, n_dead_tup, analyze_count, autoanalyze_count"
            " FROM pg_stat_user_tables WHERE relname IN ('procrastinate_jobs',"
            " 'procrastinate_events', 'wq_runs', 'wq_events', 'wq_attempts') ORDER BY relname"
        )
        cols = [d.name for d in cur.description or []]
        return {row[0]: dict(zip(cols[1:], row[1:], strict=True)) for row in await cur.fetchall()}


# ---- orchestration ----------------------------------------------------------------------

Step = Callable[[Ctx], Awaitable[dict[str, Any]]]


STEPS = (*(phase for phase, _ in PHASES), "latency")


def steps(args: argparse.Namespace) -> list[tuple[str, Step]]:
    """The phases of a round, those of ``--phases`` only, in their order."""
    n = args.runs
    every: list[tuple[str, Step]] = [
        ("submit_drain_cold", lambda c: submit_then_drain(c, n, analyzed=False)),
        ("drain_alone_cold", lambda c: drain_alone(c, n, analyzed=False)),
        ("submit_drain_analyzed", lambda c: submit_then_drain(c, n, analyzed=True)),
        ("drain_alone_analyzed", lambda c: drain_alone(c, n, analyzed=True)),
        ("latency", lambda c: pickup_latency(c, args.latency_samples)),
    ]
    return [(phase, step) for phase, step in every if phase in args.phases]


async def run_round(
    admin_url: str, postmaster: int, args: argparse.Namespace, round_no: int
) -> dict[str, Any]:
    """One round: a fresh database per system, every phase, systems interleaved."""
    systems: dict[str, System] = {}
    names: list[str] = []
    results: dict[str, Any] = {}
    polls: dict[str, psycopg.AsyncConnection[Any]] = {}
    try:
        for name, cls in (("ours", Ours), ("procrastinate", Bare)):
            if name not in args.systems:
                continue
            db = f"bench_{name}_{os.getpid()}_{round_no}"
            names.append(db)
            url = await create_database(admin_url, db)
            prefetch = args.prefetch if name == "ours" else 0
            systems[name] = cls(name, url, args.concurrency, args.submitters, prefetch)
            await systems[name].setup()
            polls[name] = await connect(url)
            results[name] = {}
        for index, (phase, step) in enumerate(steps(args)):
            order = list(systems.values())
            if (index + round_no) % 2:
                order.reverse()
            for system in order:
                print(f"  round {round_no + 1} {phase:<23} {system.name:<14}", end="", flush=True)
                result = await step(Ctx(system, polls[system.name], postmaster))
                results[system.name][phase] = result
                if "jobs_per_s" in result:
                    cpu = result["cpu"]
                    print(
                        f"{result['jobs_per_s']:>9.1f} jobs/s  cpu/job client "
                        f"{cpu['client_us_per_job']:.0f} us, server "
                        f"{cpu['server_us_per_job']:.0f} us",
                        flush=True,
                    )
                else:
                    p50 = percentile(result["pickup_s"], 50) * 1000
                    print(f"  pickup p50 {p50:.2f} ms", flush=True)
        for name, system in systems.items():
            results[name]["table_stats"] = await stat_counts(system.url)
            if system.stats:
                results[name]["worker_stats"] = dict(system.stats)
    finally:
        for conn in polls.values():
            await conn.close()
        for system in systems.values():
            await system.close()
        for db in names:
            with contextlib.suppress(psycopg.Error):
                await drop_database(admin_url, db)
    return results


def aggregate(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds for throughput phases; pooled samples for latency."""
    out: dict[str, Any] = {}
    for name in rounds[0]:
        out[name] = {}
        for phase, _ in PHASES:
            runs_ = [r[name][phase] for r in rounds if phase in r[name]]
            if not runs_:
                continue
            ordered = sorted(runs_, key=lambda r: r["jobs_per_s"])
            median = dict(ordered[(len(ordered) - 1) // 2])  # the median round (lower)
            median["rounds_jobs_per_s"] = [r["jobs_per_s"] for r in runs_]
            out[name][phase] = median
        lat = [r[name]["latency"] for r in rounds if "latency" in r[name]]
        if lat:
            pickups = [s for r in lat for s in r["pickup_s"]]
            out[name]["latency"] = {
                "pickup": ms_summary(pickups)
                | {"samples_ms": [round(s * 1000, 3) for s in pickups]},
                "submit_call": ms_summary([s for r in lat for s in r["submit_call_s"]]),
            }
        out[name]["per_round"] = [
            {k: v for k, v in r[name].items() if k != "latency"} for r in rounds
        ]
    return out


async def run_bench(admin_url: str, postmaster: int, args: argparse.Namespace) -> dict[str, Any]:
    # Server defaults, autovacuum on: what a user runs. "cold" means no explicit ANALYZE yet
    # (autovacuum may analyze a table mid-phase, as it would in production).
    rounds = [await run_round(admin_url, postmaster, args, i) for i in range(args.rounds)]
    return aggregate(rounds)


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    ours, bare = results.get("ours", {}), results.get("procrastinate", {})
    out: dict[str, Any] = {}
    for phase, _ in PHASES:
        if phase in ours and phase in bare:
            out[phase] = round(ours[phase]["jobs_per_s"] / bare[phase]["jobs_per_s"], 3)
            cpu_o, cpu_b = ours[phase]["cpu"], bare[phase]["cpu"]
            out[f"{phase}_cpu_per_job"] = round(
                (cpu_o["client_us_per_job"] + cpu_o["server_us_per_job"])
                / (cpu_b["client_us_per_job"] + cpu_b["server_us_per_job"]),
                3,
            )
    if "latency" in ours and "latency" in bare:
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            out[f"pickup_{key}"] = round(
                ours["latency"]["pickup"][key] / bare["latency"]["pickup"][key], 3
            )
    return out


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Both systems' figures for :mod:`bench.results`: jobs/s and CPU per job of each
    phase, the pickup's percentiles and samples, the submit call's p50."""
    metrics = []
    for phase, label in PHASES:
        metrics.append(metric(phase, label, "jobs/s"))
    for phase, label in PHASES:
        metrics.append(
            metric(
                f"{phase}_cpu",
                f"{label}, CPU per job (client + server)",
                "us",
                higher_is_better=False,
            )
        )
    for key in ("p50", "p95", "p99"):
        metrics.append(
            metric(f"pickup_{key}", f"pickup latency {key}", "ms", higher_is_better=False)
        )
    metrics.append(metric("submit_call_p50", "submit call p50", "ms", higher_is_better=False))
    figures: dict[str, dict[str, float | None]] = {}
    samples: dict[str, list[float]] = {}
    for name, side in results.items():
        mine: dict[str, float | None] = {}
        for phase, _ in PHASES:
            if phase in side:
                cpu = side[phase]["cpu"]
                mine[phase] = side[phase]["jobs_per_s"]
                mine[f"{phase}_cpu"] = round(cpu["client_us_per_job"] + cpu["server_us_per_job"], 1)
        if "latency" in side:
            pickup = side["latency"]["pickup"]
            for key in ("p50", "p95", "p99"):
                mine[f"pickup_{key}"] = pickup[f"{key}_ms"]
            mine["submit_call_p50"] = side["latency"]["submit_call"]["p50_ms"]
            samples[name] = pickup.get("samples_ms", [])
        figures[name] = mine
    return summary(
        metrics,
        figures,
        distributions=[
            {"key": "pickup", "label": "pickup latency", "unit": "ms", "samples": samples}
        ],
    )


def print_table(results: dict[str, Any], ratio: dict[str, Any]) -> None:
    ours, bare = results.get("ours", {}), results.get("procrastinate", {})

    def get(side: dict[str, Any], *keys: str) -> Any:
        value: Any = side
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def cpu(side: dict[str, Any], phase: str) -> str:
        c = get(side, phase, "cpu")
        return "-" if c is None else f"{c['client_us_per_job']:.0f}+{c['server_us_per_job']:.0f}"

    def rat(key: str) -> str:
        return "-" if ratio.get(key) is None else f"{ratio[key]:.2f}x"

    head = f"{'':<26}{'ours':>10}{'procr.':>10}{'ours/procr':>12}"
    print(f"\n{'throughput (jobs/s)':<26}{head[26:]}")
    for phase, label in PHASES:
        print(
            f"{label:<26}{fmt(get(ours, phase, 'jobs_per_s'), '.1f'):>10}"
            f"{fmt(get(bare, phase, 'jobs_per_s'), '.1f'):>10}{rat(phase):>12}"
        )
    print(f"\n{'cpu/job (us, client+srv)':<26}{head[26:]}")
    for phase, label in PHASES:
        print(
            f"{label:<26}{cpu(ours, phase):>10}{cpu(bare, phase):>10}"
            f"{rat(phase + '_cpu_per_job'):>12}"
        )
    print(f"\n{'pickup latency (ms)':<26}{head[26:]}")
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        print(
            f"{'submit->start ' + key[:3]:<26}"
            f"{fmt(get(ours, 'latency', 'pickup', key), '.2f'):>10}"
            f"{fmt(get(bare, 'latency', 'pickup', key), '.2f'):>10}{rat('pickup_' + key):>12}"
        )
    print(
        f"{'submit call p50':<26}{fmt(get(ours, 'latency', 'submit_call', 'p50_ms'), '.2f'):>10}"
        f"{fmt(get(bare, 'latency', 'submit_call', 'p50_ms'), '.2f'):>10}"
    )
    print(
        "\nthroughput ratio > 1: ours is faster; cpu and latency ratios < 1: ours is cheaper"
        " / picks up sooner."
    )


def configure_logging(mode: str) -> None:
    """quiet: WARNING and up (both systems); info: every INFO line rendered, to /dev/null."""
    if mode == "info":
        from worker import logs

        logs.configure(level="INFO", json=True)
        root = logging.getLogger()
        for handler in root.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - for the process
        for name in ("procrastinate", "psycopg", "psycopg.pool"):
            logging.getLogger(name).setLevel(logging.INFO)
        return
    quiet_logging()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=5000, help="runs per throughput phase")
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--submitters", type=int, default=4, help="concurrent submitting connections"
    )
    add_rounds(
        parser, default=1, help="repeat everything on fresh databases; report the median round"
    )
    parser.add_argument(
        "--logs",
        choices=("quiet", "info"),
        default="quiet",
        help="quiet: WARNING+; info: render every INFO line to /dev/null",
    )
    add_systems(parser, SYSTEMS)
    parser.add_argument(
        "--prefetch",
        type=int,
        default=0,
        help="ours in its high-throughput mode: runs claimed ahead (worker start --prefetch)",
    )
    parser.add_argument(
        "--phases",
        type=names_of(STEPS, "phases", ordered=True),
        default=list(STEPS),
        help=f"comma-separated subset of {','.join(STEPS)} (all by default)",
    )
    add_out(parser)
    parser.add_argument("--timeout", type=float, default=900, help="overall limit in seconds")
    args = parser.parse_args(argv)
    if min(args.runs, args.latency_samples, args.concurrency, args.submitters) < 1:
        parser.error("counts must be positive")
    if not 0 <= args.prefetch <= PREFETCH_MAX:
        parser.error(f"--prefetch must be from 0 to {PREFETCH_MAX}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {
        "runs": args.runs,
        "latency_samples": args.latency_samples,
        "concurrency": args.concurrency,
        "submitters": args.submitters,
        "rounds": args.rounds,
        "logs": args.logs,
        "systems": args.systems,
        "prefetch": args.prefetch,
        "phases": args.phases,
        "completion_poll_s": POLL_S,
        "latency_spacing_s": LATENCY_SPACING_S,
        "worker_poll_interval_s": POLL_INTERVAL_S,
    }
    cpus = os.cpu_count() or 1
    if (load := loadavg()) is not None and load > cpus / 2:
        print(
            f"warning: load average {load} on {cpus} CPUs: wall-clock numbers will be noisy;"
            " the cpu/job columns are steadier",
            file=sys.stderr,
        )

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        assert me is not None
        for sig in (signal.SIGINT, signal.SIGTERM):  # stop the bench, then clean up
            loop.add_signal_handler(sig, me.cancel)
        report["results"] = await run_bench(server.url("postgres"), server.pid, args)
        report["ratios"] = ratios(report["results"])
        report["summary"] = summarize(report["results"])
        print_table(report["results"], report["ratios"])

    return run_on_throwaway_server(
        "throughput",
        args,
        body,
        config=config,
        timeout=args.timeout,
        setup_logging=lambda: configure_logging(args.logs),
    )


if __name__ == "__main__":
    sys.exit(main())
