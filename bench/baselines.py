"""This system beside plain SQL, procrastinate, Absurd, Graphile Worker and the design's
floor, in one run.

One throwaway Postgres at server defaults (autovacuum on), one fresh database per system,
the same scenario shapes for every system, each figure printed beside its baselines' with
the ratio ours / baseline:

- **submit one at a time**: N submits, one after the other, on one connection. Ours in
  admission-only mode (one ``wq_submit`` statement, autocommit: one round trip);
  procrastinate ``defer_async``; Absurd ``spawn``; Graphile Worker ``addJob``; plain SQL
  one autocommit ``INSERT`` of a row (the floor of one durable commit per round trip).
- **batch submit**: N runs in statements of ``--batch``: ours ``submit_many``;
  procrastinate ``batch_defer_async``; Graphile Worker ``addJobs``; plain SQL an
  ``INSERT ... SELECT FROM unnest``. Absurd has no batch spawn.
- **drain at a concurrency**, cold (never explicitly analyzed) and after ``ANALYZE``: N
  trivial runs admitted first, then a worker drains them; timed from the first task start
  to the last finish. Ours: ``worker.runtime.Worker``; procrastinate: its worker (LISTEN,
  jobs kept); Absurd: ``AsyncAbsurd.start_worker``; Graphile Worker: ``run()``.
- **drain, tuned**: each system's own high-throughput settings, where it has them
  (Graphile Worker: a local queue of 500 and batched completion; ours: ``prefetch``, runs
  claimed ahead into a local queue, ``--tuned-prefetch``, with its batched finish).
- **pickup latency**: an idle worker; single submits ``--spacing`` ms apart; latency is
  from the submit call's return to the task's start, both on this process's clock (each
  system's submitter and worker share a process).
- **steps**: one run that calls its step function ``--steps`` times (ours ``ctx.step``,
  Absurd ``ctx.step``), timed inside the run.

**The design's floor** (``floor``, :mod:`bench.floor`) does in every scenario but the steps
exactly the writes docs/design.md (sections 6 and 7) requires of a run, one plain
statement each on minimal tables: ours is compared with it like with any baseline, and it
is compared with the others (not with ours), printed below the table. A target the floor
misses cannot be met while the design holds.

Graphile Worker runs in Node (``bench/graphile``, installed there with npm on first use);
without Node or npm its rows say so. Absurd's SDK and schema tool come from the ``bench``
extra (``pip install -e '.[bench]'``).

Run: ``v/bin/python -m bench.baselines`` (about 3 minutes on 2 cores). Results: a table on
stdout and a results file under ``bench/results/`` (:mod:`bench.results`; the pickup's
samples included). ``--rounds K`` runs the whole sequence K times (figures: medians;
ratios: the median of each round's own, with their range), since one run's ratio moves
with the host's load; ``--groups`` runs only some scenario groups (submit, drain, pickup,
steps).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import procrastinate
import psycopg
from psycopg.conninfo import conninfo_to_dict

from bench.common import (
    BenchError,
    add_out,
    add_pg_bin,
    add_rounds,
    add_systems,
    connect,
    create_database,
    drop_database,
    ms_percentiles,
    names_of,
    percentile,
    run_on_throwaway_server,
    scalar,
    wait_until,
)
from bench.floor import Floor
from bench.results import metric, summary
from queues import admission, lanes, migrations
from worker import embedded
from worker.plays import Registry
from worker.runtime import CLAIM_AHEAD_UNDER_S, Settings, Worker

RELEASE = "bench"
QUEUE = "bench"
GRAPHILE_DIR = Path(__file__).resolve().parent / "graphile"
SYSTEMS = ("ours", "plain", "procrastinate", "absurd", "graphile", "floor")


def latency_summary(seconds: list[float]) -> dict[str, Any]:
    """p50 and p99 in ms, and every sample (``samples_ms``: the distribution)."""
    return ms_percentiles(seconds, (50, 99)) | {"samples_ms": [round(s * 1000, 3) for s in seconds]}


def rate(n: int, seconds: float) -> dict[str, float]:
    return {"n": n, "seconds": round(seconds, 4), "per_s": round(n / seconds, 1)}


class FirstStart:
    """The first task start of a drain, and each keyed task's start (pickup)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.started: dict[Any, float] = {}

    def mark(self, key: Any = None) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if key is not None:
            self.started[key] = now

    def reset(self) -> None:
        self.first = None
        self.started = {}


async def drained_at(
    conn: psycopg.AsyncConnection[Any], pending_sql: str, since_sql: str, timeout: float
) -> float:
    """perf_counter time of the last finish: poll whether any work is left, then subtract
    how long ago (server time) the last finish was, so the polling period does not blur
    it. ``pending_sql`` asks for one unfinished row by the system's own index of
    unfinished work: counting the finished ones instead reads the whole history at every
    poll, a cost that grows with the runs and is charged to the systems that keep them."""

    async def done() -> bool:
        return not bool(await scalar(conn, pending_sql))

    await wait_until(done, timeout, "every run to finish")
    seen = time.perf_counter()
    ago = float(await scalar(conn, since_sql) or 0.0)
    return seen - max(0.0, ago)


# ---- ours ---------------------------------------------------------------------------------


class Ours:
    name = "ours"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.marks = FirstStart()
        self.registry = Registry()
        marks = self.marks

        @self.registry.play("noop")
        async def noop(ctx: Any, params: dict[str, Any]) -> None:
            marks.mark(params.get("i"))

        steps_n = args.steps
        self.step_seconds: float | None = None

        @self.registry.play("steps")
        async def steps(ctx: Any, params: dict[str, Any]) -> None:
            async def one() -> int:
                return 1

            t0 = time.perf_counter()
            for i in range(steps_n):
                await ctx.step(f"s{i}", one)
            self.step_seconds = time.perf_counter() - t0

    async def setup(self) -> None:
        async with await connect(self.url) as conn:
            await migrations.migrate(conn)
            async with conn.transaction():
                await lanes.prepare(conn, RELEASE)
        self.admitter = admission.Admitter(admission_only=True)
        self.conn = await connect(self.url)

    async def close(self) -> None:
        await self.conn.close()

    def _sub(self, i: int, play: str = "noop") -> admission.Submission:
        return admission.Submission(play=play, params={"i": i}, release=RELEASE)

    async def submit_one(self, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await self.admitter.submit(self.conn, self._sub(i))
        return time.perf_counter() - t0

    async def submit_batch(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            await admission.submit_many(
                self.conn, [self._sub(i) for i in range(start, min(n, start + batch))]
            )
        return time.perf_counter() - t0

    async def clear(self) -> None:
        # Keep history (as a user would): only wait for nothing to be queued.
        return None

    def _worker(self, concurrency: int, prefetch: int = 0, *, ahead: bool = True) -> Worker:
        settings = Settings(
            url=self.url,
            release=RELEASE,
            registry=self.registry,
            concurrency=concurrency,
            grace_s=5.0,
            install_signals=False,
            prefetch=prefetch,
            claim_ahead_under_s=CLAIM_AHEAD_UNDER_S if ahead else 0.0,
        )
        return Worker(settings)

    async def drain(
        self, n: int, concurrency: int, *, analyze: bool, tuned: bool, ahead: bool = True
    ) -> float:
        """``ahead``: the default claiming ahead for short plays (False: only for free
        slots, ``--claim-ahead-under 0``)."""
        await self.submit_batch(n, 1000)
        if analyze:
            await self.conn.execute("ANALYZE")
        self.marks.reset()
        worker = self._worker(concurrency, self.args.tuned_prefetch if tuned else 0, ahead=ahead)
        task = asyncio.create_task(worker.run())
        try:
            end = await drained_at(
                self.conn,
                "SELECT EXISTS (SELECT 1 FROM wq_runs WHERE state IN ('queued', 'running'))",
                "SELECT extract(epoch FROM clock_timestamp() - max(finished_at)) FROM wq_runs",
                self.args.phase_timeout,
            )
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        assert self.marks.first is not None
        return end - self.marks.first

    async def pickup(self, samples: int, spacing_s: float, concurrency: int) -> list[float]:
        self.marks.reset()
        worker = self._worker(concurrency)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            await asyncio.sleep(0.5)
            returned: dict[int, float] = {}
            for i in range(samples):
                await self.admitter.submit(self.conn, self._sub(10_000_000 + i))
                returned[10_000_000 + i] = time.perf_counter()
                await asyncio.sleep(spacing_s)

            async def all_started() -> bool:
                return len(self.marks.started) >= samples

            await wait_until(all_started, 10, "pickups")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        return [self.marks.started[k] - t for k, t in returned.items() if k in self.marks.started]

    async def steps(self, concurrency: int) -> float:
        await self.admitter.submit(self.conn, self._sub(0, "steps"))
        worker = self._worker(concurrency)
        task = asyncio.create_task(worker.run())
        try:

            async def done() -> bool:
                return self.step_seconds is not None

            await wait_until(done, self.args.phase_timeout, "the steps run")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        assert self.step_seconds is not None
        return self.step_seconds


# ---- plain SQL ------------------------------------------------------------------------------


class Plain:
    """The floor: the same durable writes with no queue (one row per submit)."""

    name = "plain"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url

    async def setup(self) -> None:
        self.conn = await connect(self.url)
        await self.conn.execute(
            "CREATE TABLE jobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
        )

    async def close(self) -> None:
        await self.conn.close()

    async def submit_one(self, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await self.conn.execute(
                "INSERT INTO jobs (payload) VALUES (%s::jsonb)", (json.dumps({"i": i}),)
            )
        return time.perf_counter() - t0

    async def submit_batch(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            payloads = [json.dumps({"i": i}) for i in range(start, min(n, start + batch))]
            await self.conn.execute(
                "INSERT INTO jobs (payload) SELECT p::jsonb FROM unnest(%s::text[]) AS p",
                (payloads,),
            )
        return time.perf_counter() - t0


# ---- procrastinate --------------------------------------------------------------------------


class Procrastinate:
    name = "procrastinate"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.marks = FirstStart()

    def _app(self, max_size: int) -> procrastinate.App:
        connector = procrastinate.PsycopgConnector(conninfo=self.url, min_size=1, max_size=max_size)
        app = procrastinate.App(connector=connector)
        marks = self.marks

        @app.task(name="bench.noop", queue=QUEUE)
        async def noop(i: int) -> None:
            marks.mark(i)

        return app

    async def setup(self) -> None:
        async with self._app(1).open_async() as app:
            await app.schema_manager.apply_schema_async()
        self.app = self._app(2)
        self.noop = self.app.tasks["bench.noop"]  # the submitter's app defers
        await self.app.open_async()
        self.conn = await connect(self.url)

    async def close(self) -> None:
        await self.app.close_async()
        await self.conn.close()

    async def submit_one(self, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await self.noop.defer_async(i=i)
        return time.perf_counter() - t0

    async def submit_batch(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            await self.noop.batch_defer_async(
                *({"i": i} for i in range(start, min(n, start + batch)))
            )
        return time.perf_counter() - t0

    async def _run_worker(self, concurrency: int) -> tuple[procrastinate.App, asyncio.Task[None]]:
        app = self._app(concurrency + 5)

        async def go() -> None:
            async with app.open_async():
                await app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=concurrency,
                    wait=True,
                    listen_notify=True,
                    fetch_job_polling_interval=1.0,
                    delete_jobs="never",
                    install_signal_handlers=False,
                )

        return app, asyncio.create_task(go())

    async def _stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30)

    async def drain(self, n: int, concurrency: int, *, analyze: bool, tuned: bool) -> float:
        await self.submit_batch(n, 1000)
        if analyze:
            await self.conn.execute("ANALYZE")
        self.marks.reset()
        _, task = await self._run_worker(concurrency)
        try:
            end = await drained_at(
                self.conn,
                "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs"
                " WHERE status IN ('todo', 'doing'))",
                "SELECT extract(epoch FROM clock_timestamp() - max(at)) FROM procrastinate_events"
                " WHERE type = 'succeeded'",
                self.args.phase_timeout,
            )
        finally:
            await self._stop(task)
        assert self.marks.first is not None
        return end - self.marks.first

    async def pickup(self, samples: int, spacing_s: float, concurrency: int) -> list[float]:
        self.marks.reset()
        _, task = await self._run_worker(concurrency)
        try:

            async def listening() -> bool:
                return bool(
                    await scalar(
                        self.conn,
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND query LIKE 'LISTEN %%'",
                    )
                )

            await wait_until(listening, 30, "procrastinate's LISTEN")
            await asyncio.sleep(0.5)
            returned: dict[int, float] = {}
            for i in range(samples):
                await self.noop.defer_async(i=10_000_000 + i)
                returned[10_000_000 + i] = time.perf_counter()
                await asyncio.sleep(spacing_s)

            async def all_started() -> bool:
                return len(self.marks.started) >= samples

            await wait_until(all_started, 10, "pickups")
        finally:
            await self._stop(task)
        return [self.marks.started[k] - t for k, t in returned.items() if k in self.marks.started]


# ---- Absurd ---------------------------------------------------------------------------------


class Absurd:
    name = "absurd"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.marks = FirstStart()
        self.step_seconds: float | None = None

    def _client(self) -> Any:
        from absurd_sdk import AsyncAbsurd

        client = AsyncAbsurd(self.url, queue_name=QUEUE)
        marks = self.marks
        steps_n = self.args.steps

        @client.register_task("noop")
        async def noop(params: Any, ctx: Any) -> None:
            marks.mark(params.get("i"))

        @client.register_task("steps")
        async def steps(params: Any, ctx: Any) -> None:
            async def one() -> int:
                return 1

            t0 = time.perf_counter()
            for i in range(steps_n):
                await ctx.step(f"s{i}", one)
            self.step_seconds = time.perf_counter() - t0

        return client

    async def setup(self) -> None:
        env = {**os.environ, "ABSURD_DATABASE_URL": self.url}
        absurdctl = str(Path(sys.executable).parent / "absurdctl")
        for cmd in (["init"], ["create-queue", QUEUE]):
            res = subprocess.run(
                [absurdctl, *cmd], env=env, capture_output=True, text=True, timeout=120, check=False
            )
            if res.returncode != 0:
                raise BenchError(f"absurdctl {' '.join(cmd)} failed: {res.stderr[-500:]}")
        self.client = self._client()
        self.conn = await connect(self.url)

    async def close(self) -> None:
        await self.client.close()
        await self.conn.close()

    async def submit_one(self, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            await self.client.spawn("noop", {"i": i})
        return time.perf_counter() - t0

    async def _run_worker(self, concurrency: int) -> tuple[Any, asyncio.Task[None]]:
        worker = self._client()
        task = asyncio.create_task(worker.start_worker(concurrency=concurrency, poll_interval=0.25))
        return worker, task

    async def _stop(self, worker: Any, task: asyncio.Task[None]) -> None:
        worker.stop_worker()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        await worker.close()

    async def drain(self, n: int, concurrency: int, *, analyze: bool, tuned: bool) -> float:
        for i in range(n):
            await self.client.spawn("noop", {"i": i})
        if analyze:
            await self.conn.execute("ANALYZE")
        self.marks.reset()
        worker, task = await self._run_worker(concurrency)
        try:
            end = await drained_at(
                self.conn,
                f"SELECT EXISTS (SELECT 1 FROM absurd.r_{QUEUE}"
                " WHERE state IN ('pending', 'running', 'sleeping'))",
                "SELECT extract(epoch FROM clock_timestamp() - max(completed_at))"
                f" FROM absurd.r_{QUEUE}",
                self.args.phase_timeout,
            )
        finally:
            await self._stop(worker, task)
        assert self.marks.first is not None
        return end - self.marks.first

    async def pickup(self, samples: int, spacing_s: float, concurrency: int) -> list[float]:
        self.marks.reset()
        worker, task = await self._run_worker(concurrency)
        try:
            await asyncio.sleep(0.5)
            returned: dict[int, float] = {}
            for i in range(samples):
                await self.client.spawn("noop", {"i": 10_000_000 + i})
                returned[10_000_000 + i] = time.perf_counter()
                await asyncio.sleep(spacing_s)

            async def all_started() -> bool:
                return len(self.marks.started) >= samples

            await wait_until(all_started, 10, "pickups")
        finally:
            await self._stop(worker, task)
        return [self.marks.started[k] - t for k, t in returned.items() if k in self.marks.started]

    async def steps(self, concurrency: int) -> float:
        await self.client.spawn("steps", {})
        worker, task = await self._run_worker(concurrency)
        try:

            async def done() -> bool:
                return self.step_seconds is not None

            await wait_until(done, self.args.phase_timeout, "the steps task")
        finally:
            await self._stop(worker, task)
        assert self.step_seconds is not None
        return self.step_seconds


# ---- Graphile Worker (Node) -----------------------------------------------------------------


def graphile_ready() -> str | None:
    """Install Graphile Worker with npm on first use; the reason it cannot run, or None."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "Node.js and npm are not installed: Graphile Worker not measured"
    if not (GRAPHILE_DIR / "node_modules" / "graphile-worker").exists():
        print("installing Graphile Worker with npm into bench/graphile ...", file=sys.stderr)
        res = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--silent"],
            cwd=GRAPHILE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if res.returncode != 0:
            return f"npm install failed: {res.stderr.strip()[-300:]}"
    return None


class Graphile:
    name = "graphile"

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args

    def _node(self, *argv: str) -> dict[str, Any]:
        c = conninfo_to_dict(self.url)
        uri = (
            f"postgresql://{c.get('user', 'postgres')}:{c.get('password', '')}"
            f"@{c.get('host', '127.0.0.1')}:{c.get('port', 5432)}/{c['dbname']}"
        )
        res = subprocess.run(
            ["node", str(GRAPHILE_DIR / "bench.mjs"), uri, *argv],
            capture_output=True,
            text=True,
            timeout=self.args.phase_timeout,
            check=False,
        )
        if res.returncode != 0:
            raise BenchError(f"graphile {argv[0]} failed: {res.stderr.strip()[-500:]}")
        result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
        return result

    async def setup(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def submit_one(self, n: int) -> float:
        return float((await asyncio.to_thread(self._node, "submit_one", str(n)))["seconds"])

    async def submit_batch(self, n: int, batch: int) -> float:
        out = await asyncio.to_thread(self._node, "submit_batch", str(n), str(batch))
        return float(out["seconds"])

    async def drain(self, n: int, concurrency: int, *, analyze: bool, tuned: bool) -> float:
        out = await asyncio.to_thread(
            self._node,
            "drain",
            str(n),
            str(concurrency),
            "tuned" if tuned else "plain",
            "analyze" if analyze else "cold",
        )
        return float(out["seconds"])

    async def pickup(self, samples: int, spacing_s: float, concurrency: int) -> list[float]:
        out = await asyncio.to_thread(
            self._node, "pickup", str(samples), str(int(spacing_s * 1000)), str(concurrency)
        )
        return [float(x) for x in out["latency_s"]]


# ---- the run --------------------------------------------------------------------------------

SCENARIOS = (
    ("submit_one", "submit N, one at a time (runs/s)"),
    ("submit_batch", "batch submit N, statements of BATCH (runs/s)"),
    ("drain_cold", "drain N at concurrency C, cold (runs/s)"),
    ("drain_analyzed", "drain N at concurrency C, after ANALYZE (runs/s)"),
    (
        "drain_free_slots",
        "drain N at concurrency C, after ANALYZE, ours claiming only for free slots (runs/s)",
    ),
    ("drain_tuned", "drain N, each system's high-throughput mode (runs/s)"),
    ("pickup", "pickup latency p50 / p99 (ms)"),
    ("steps", "one run, S step calls (steps/s)"),
)


GROUPS = ("submit", "drain", "pickup", "steps")


async def run_group(system: Any, group: str, args: argparse.Namespace) -> dict[str, Any]:
    """One group of scenarios of one system, on a database of its own."""
    out: dict[str, Any] = {}
    n, c = args.runs, args.concurrency

    async def phase(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        t0 = time.perf_counter()
        try:
            out[name] = await fn()
        except BenchError as exc:
            out[name] = {"error": str(exc)}
        print(f"  {system.name:<13} {name:<15} {time.perf_counter() - t0:6.1f} s", file=sys.stderr)

    await system.setup()
    try:
        if group == "submit":
            await phase("submit_one", lambda: _rate(system.submit_one(n), n))
            if hasattr(system, "submit_batch"):
                await phase("submit_batch", lambda: _rate(system.submit_batch(n, args.batch), n))
        elif group == "drain" and hasattr(system, "drain"):
            await phase(
                "drain_cold", lambda: _rate(system.drain(n, c, analyze=False, tuned=False), n)
            )
            await phase(
                "drain_analyzed", lambda: _rate(system.drain(n, c, analyze=True, tuned=False), n)
            )
            if system.name == "ours":
                await phase(
                    "drain_free_slots",
                    lambda: _rate(system.drain(n, c, analyze=True, tuned=False, ahead=False), n),
                )
            if system.name in ("graphile", "ours", "floor"):
                await phase(
                    "drain_tuned",
                    lambda: _rate(
                        system.drain(args.tuned_runs, c, analyze=True, tuned=True), args.tuned_runs
                    ),
                )
        elif group == "pickup" and hasattr(system, "pickup"):

            async def pickup() -> dict[str, float]:
                return latency_summary(
                    await system.pickup(args.latency_samples, args.spacing_ms / 1000, c)
                )

            await phase("pickup", pickup)
        elif group == "steps" and hasattr(system, "steps"):
            await phase("steps", lambda: _rate(system.steps(c), args.steps))
    finally:
        await system.close()
    return out


async def _rate(seconds: Awaitable[float], n: int) -> dict[str, float]:
    return rate(n, await seconds)


async def run_bench(admin_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Scenario groups in turn, every system in each (so a load spike on the shared host
    hits every system of a scenario alike), each on a fresh database; the whole sequence
    ``--rounds`` times. One results mapping per round."""
    classes = {
        "ours": Ours,
        "plain": Plain,
        "procrastinate": Procrastinate,
        "absurd": Absurd,
        "graphile": Graphile,
        "floor": Floor,
    }
    skipped: dict[str, str] = {}
    names = []
    for name in args.systems:
        reason = None
        if name == "graphile":
            reason = graphile_ready()
        if name == "absurd":
            try:
                import absurd_sdk  # noqa: F401
            except ImportError:
                reason = "absurd-sdk not installed (pip install -e '.[bench]')"
        if reason is not None:
            skipped[name] = reason
            print(f"  {name}: {reason}", file=sys.stderr)
        else:
            names.append(name)
    rounds = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"round {number} of {args.rounds}", file=sys.stderr)
        results: dict[str, Any] = {name: {"skipped": why} for name, why in skipped.items()}
        results |= {name: {} for name in names}
        for group in args.groups:
            for name in names:
                db = f"bench_{name}_{group}"
                url = await create_database(admin_url, db)
                try:
                    results[name] |= await run_group(classes[name](url, args), group, args)
                finally:
                    await drop_database(admin_url, db)
        rounds.append(results)
    return rounds


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds as one report: each system's figure per scenario is its median over the
    rounds (the per-round figures beside it); each ratio is the median of the rounds' own
    ratios (ours and the baseline from the same round, so a round's load hits both), with
    their range. A scenario that failed in any round shows that round's error."""
    results: dict[str, Any] = {}
    for name, first in rounds[0].items():
        if "skipped" in first:
            results[name] = first
            continue
        results[name] = {}
        for scenario, _ in SCENARIOS:
            cells = [r.get(name, {}).get(scenario) for r in rounds]
            if all(c is None for c in cells):
                continue
            failed = [c for c in cells if not isinstance(c, dict) or "error" in c]
            if failed:
                results[name][scenario] = failed[0] or {"error": "missing in a round"}
                continue
            if scenario == "pickup":
                results[name][scenario] = {
                    "n": sum(c["n"] for c in cells),
                    "p50_ms": round(_median([c["p50_ms"] for c in cells]), 3),
                    "p99_ms": round(_median([c["p99_ms"] for c in cells]), 3),
                    "rounds_p50_ms": [c["p50_ms"] for c in cells],
                }
                samples = [x for c in cells for x in c.get("samples_ms", ())]
                if samples:
                    results[name][scenario]["samples_ms"] = samples
            else:
                results[name][scenario] = {
                    "n": cells[0]["n"],
                    "per_s": round(_median([c["per_s"] for c in cells]), 1),
                    "rounds_per_s": [c["per_s"] for c in cells],
                }
    report: dict[str, Any] = {"results": results}
    for of, key, ranges_key in (
        ("ours", "ratios", "ratio_ranges"),
        ("floor", "floor_ratios", "floor_ratio_ranges"),
    ):
        each = [ratios(r, of) for r in rounds]
        ratio: dict[str, dict[str, float]] = {}
        spread: dict[str, dict[str, list[float]]] = {}
        for scenario, _ in SCENARIOS:
            for name in baselines_of(of):
                values = [r[scenario][name] for r in each if name in r.get(scenario, {})]
                if len(values) < len(rounds):
                    continue  # a round without the pair: no ratio of the rounds
                ratio.setdefault(scenario, {})[name] = round(_median(values), 2)
                spread.setdefault(scenario, {})[name] = [min(values), max(values)]
        report[key] = ratio
        report[ranges_key] = spread
    return report


def figure(cell: Any, scenario: str) -> str:
    if not isinstance(cell, dict):
        return "-"
    if "error" in cell:
        return "error"
    if scenario == "pickup":
        return f"{cell['p50_ms']:.1f} / {cell['p99_ms']:.1f}"
    return f"{cell['per_s']:,.0f}"


# Rows of ours alone, compared with the baselines' row of the same workload.
BASIS = {"drain_free_slots": "drain_analyzed"}


def baselines_of(of: str) -> tuple[str, ...]:
    """What a system is compared with: ours with every other system; the design's floor
    with the others (not with ours, which it is the floor of)."""
    return tuple(n for n in SYSTEMS if n not in (of, "ours"))


def ratios(results: dict[str, Any], of: str = "ours") -> dict[str, dict[str, float]]:
    """``of`` / baseline per scenario (for pickup: baseline p50 / its p50, above 1 =
    sooner)."""
    own = results.get(of, {})
    out: dict[str, dict[str, float]] = {}
    for scenario, _ in SCENARIOS:
        mine = own.get(scenario)
        if not isinstance(mine, dict) or "error" in mine:
            continue
        for name in baselines_of(of):
            theirs = results.get(name, {}).get(BASIS.get(scenario, scenario))
            if not isinstance(theirs, dict) or "error" in theirs:
                continue
            if scenario == "pickup":
                value = theirs["p50_ms"] / mine["p50_ms"] if mine["p50_ms"] else float("nan")
            else:
                value = mine["per_s"] / theirs["per_s"]
            out.setdefault(scenario, {})[name] = round(value, 2)
    return out


def print_table(
    results: dict[str, Any],
    ratio: dict[str, dict[str, float]],
    args: argparse.Namespace,
    spread: dict[str, dict[str, list[float]]] | None = None,
) -> None:
    """The table; with more than one round, each ratio is followed by the rounds' range."""
    names = [n for n in SYSTEMS if n in results]
    header = ["workload", *names, "ours / baseline"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for scenario, template in SCENARIOS:
        label = scenario_label(scenario, template, args)
        cells = [figure(results.get(n, {}).get(scenario), scenario) for n in names]
        if all(c == "-" for c in cells):
            continue
        shown = shown_ratios(scenario, ratio, args, spread)
        print("| " + " | ".join([label, *cells, shown]) + " |")
    for name in names:
        if "skipped" in results[name]:
            print(f"\n{name}: {results[name]['skipped']}")


def scenario_label(scenario: str, template: str, args: argparse.Namespace) -> str:
    """A scenario's row label with this run's sizes."""
    tuned = f"drain {args.tuned_runs:,}" if scenario == "drain_tuned" else "drain N"
    return (
        template.replace("drain N", tuned)
        .replace("BATCH", f"{args.batch:,}")
        .replace(" N", f" {args.runs:,}")
        .replace(" C", f" {args.concurrency}")
        .replace(" S ", f" {args.steps:,} ")
    )


LABELS = {
    "ours": "ours",
    "plain": "plain SQL",
    "procrastinate": "procrastinate",
    "absurd": "Absurd",
    "graphile": "Graphile Worker",
    "floor": "the design's floor",
}


def summarize(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every system's figures for :mod:`bench.results`: a rate per scenario, the pickup's
    p50 and p99 (and its samples), and ours against each baseline (the median of the
    rounds' own ratios, with their range)."""
    metrics = []
    for scenario, template in SCENARIOS:
        label = scenario_label(scenario, template, args)
        if scenario == "pickup":
            metrics.append(metric("pickup_p50", "pickup latency p50", "ms", higher_is_better=False))
            metrics.append(metric("pickup_p99", "pickup latency p99", "ms", higher_is_better=False))
        else:
            unit = label[label.rindex("(") + 1 : -1]
            metrics.append(metric(scenario, label[: label.rindex("(")].strip(), unit))
    figures: dict[str, dict[str, float | None]] = {}
    samples: dict[str, list[float]] = {}
    for name, cells in report["results"].items():
        if "skipped" in cells:
            continue
        mine: dict[str, float | None] = {}
        for scenario, cell in cells.items():
            if not isinstance(cell, dict) or "error" in cell:
                continue
            if scenario == "pickup":
                mine["pickup_p50"], mine["pickup_p99"] = cell["p50_ms"], cell["p99_ms"]
                if cell.get("samples_ms"):
                    samples[name] = cell["samples_ms"]
            else:
                mine[scenario] = cell["per_s"]
        figures[name] = mine

    def keyed(table: dict[str, Any]) -> dict[str, Any]:
        return {("pickup_p50" if k == "pickup" else k): v for k, v in table.items()}

    return summary(
        metrics,
        figures,
        labels=LABELS,
        ratios=keyed(report["ratios"]),
        ratio_ranges=keyed(report["ratio_ranges"]),
        distributions=[
            {"key": "pickup", "label": "pickup latency", "unit": "ms", "samples": samples}
        ],
    )


def shown_ratios(
    scenario: str,
    ratio: dict[str, dict[str, float]],
    args: argparse.Namespace,
    spread: dict[str, dict[str, list[float]]] | None,
) -> str:
    """A scenario's ratios, each followed by the rounds' range when there were rounds."""
    ranges = (spread or {}).get(scenario, {}) if args.rounds > 1 else {}
    shown = ", ".join(
        f"{v}x {k}" + (f" ({ranges[k][0]}-{ranges[k][1]})" if k in ranges else "")
        for k, v in ratio.get(scenario, {}).items()
    )
    return shown or "-"


def print_floor(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The design's floor against the baselines (bench/floor.py): a target the floor misses
    cannot be met while the design holds."""
    ratio = report.get("floor_ratios") or {}
    if not ratio:
        return
    spread = report.get("floor_ratio_ranges")
    print("\nthe design's floor (bench/floor.py) / baseline:")
    for scenario, template in SCENARIOS:
        if scenario in ratio:
            print(f"- {template}: {shown_ratios(scenario, ratio, args, spread)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.baselines", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--runs", type=int, default=5000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--tuned-runs", type=int, default=20000)
    p.add_argument("--tuned-prefetch", type=int, default=300)
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--spacing-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=5000)
    add_systems(p, SYSTEMS)
    p.add_argument(
        "--groups",
        type=names_of(GROUPS, "groups", ordered=True),  # always in the same order
        default=list(GROUPS),
        help=f"scenario groups to run, of {', '.join(GROUPS)} (all by default)",
    )
    p.add_argument("--phase-timeout", type=float, default=300.0)
    add_rounds(
        p,
        default=1,
        help="run every group of every system this many times; figures are medians, "
        "ratios the median of each round's own (with their range)",
    )
    add_out(p)
    add_pg_bin(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        rounds = await run_bench(server.url("postgres"), args)
        report |= combine(rounds)
        if args.rounds > 1:
            report["rounds"] = rounds
        report["summary"] = summarize(report, args)
        print_table(report["results"], report["ratios"], args, report["ratio_ranges"])
        print_floor(report, args)

    return run_on_throwaway_server("baselines", args, body)


if __name__ == "__main__":
    sys.exit(main())
