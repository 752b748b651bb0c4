"""The herd: K idle workers on one lane, one NOTIFY waking one claimer against a broadcast.

Migration 0032 keeps a line of the workers waiting for work (``wq_workers.waiting_since``)
and a spawn wakes as many of them as it gave the lane jobs, each on its own channel,
broadcasting on the lane's channel only when no live worker waits. Before it every spawn
woke every idle worker of the lane, and each ran a claim statement that found nothing but
one. This bench measures both on one throwaway Postgres at server defaults:

- for each K of ``--workers``: a fresh database, migrated, its lane prepared, and K
  ``worker.runtime.Worker`` instances in this process (concurrency 10 each, one trivial
  play), all idle on the one release's lane;
- **wake-one**: the system as built; ``--runs`` single submits ``--spacing-ms`` apart, one
  at a time on an autocommit connection (``Admitter(admission_only=True).submit``, as
  ``bench.baselines``' pickup);
- **broadcast** (the baseline, the old behaviour, produced by the system's own fallback):
  the same, but before each submit, outside the timed part, ``UPDATE wq_workers SET
  waiting_since = NULL`` on a separate connection, so the spawn finds nobody waiting and
  broadcasts to every worker of the lane.

Per mode: claim statements and empty claims per admitted run (the sum over the workers of
their ``stats`` counters' deltas across the mode: the mode's runs all succeeded and the
workers settled before the second reading), the broadcasts on the lane's channel per run
(a listener of the bench counts them: about 0 in wake-one, about 1 in broadcast), pickup
latency p50 / p99 (from the submit call's return to the play's start, this process's
clock, as ``bench.baselines``), and the Postgres server's CPU per run over the mode's
window (the postmaster and all its processes, ``/proc``: ``bench.throughput``'s helper).

A worker claims again when one of its attempts ends only on a lane that caps the runs per
org (none here), and every idle worker polls with a claim every ``poll_s`` (1 s) it is not
woken: so wake-one is about 1 claim per run, broadcast about K, plus the polls (none at
these K: wake-one wakes the workers in turn, each well within its poll period).

The broadcast mode's server CPU is an upper bound on the old behaviour's: its ``UPDATE``
(K rows, a commit) runs once per run, and each woken worker's empty claim then writes its
row back into the line, which the old claim (no line) did not. At K = 1 the two modes run
the same claims, so that row's CPU difference is what the emulation itself costs; the claim
counts and the pickup latency carry no such bias.

Run: ``v/bin/python -m bench.wake`` (about a minute on 2 cores). Results: a table on stdout
and a results file under ``bench/results/`` (:mod:`bench.results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench.baselines import FirstStart, latency_summary
from bench.common import (
    BenchError,
    add_out,
    connect,
    create_database,
    drop_database,
    run_on_throwaway_server,
    wait_until,
)
from bench.results import metric, summary
from bench.throughput import server_cpu_s
from queues import admission, lanes, migrations, transport
from worker import embedded
from worker.plays import Registry
from worker.runtime import Settings, Worker

RELEASE = "bench"
MODES = ("wake-one", "broadcast")
CONCURRENCY = 10
GRACE_S = 5.0
SETTLE_S = 0.3  # after a mode's last run succeeded: its last attempt's claim lands
WARMUP = 10  # unmeasured runs per mode first: pools, plans, the line formed
COUNTERS = ("claims", "claims_empty", "wakes_passed_on", "claimed", "succeeded")
UNFINISHED = "SELECT count(*) FROM wq_runs WHERE state IN ('queued', 'running', 'sleeping')"
SUCCEEDED = "SELECT count(*) FROM wq_runs WHERE state = 'succeeded'"
WAITING = "SELECT count(*) FROM wq_workers WHERE waiting_since IS NOT NULL AND stopped_at IS NULL"


class Herd:
    """One database: K idle workers on one lane, a submitter, a broadcast counter."""

    def __init__(self, url: str, postmaster: int, k: int, args: argparse.Namespace) -> None:
        self.url = url
        self.postmaster = postmaster
        self.k = k
        self.args = args
        self.marks = FirstStart()
        self.registry = Registry()
        self.workers: list[Worker] = []
        self.tasks: list[asyncio.Task[int]] = []
        self.conns: list[psycopg.AsyncConnection[Any]] = []
        self.counting: asyncio.Task[None] | None = None
        self.broadcasts = 0
        self.submitted = 0  # runs admitted so far, warm-up included
        marks = self.marks

        @self.registry.play("noop")
        async def noop(ctx: Any, params: dict[str, Any]) -> None:
            marks.mark(params.get("i"))

    async def setup(self) -> None:
        async with await connect(self.url) as conn:
            await migrations.migrate(conn)
            async with conn.transaction():
                await lanes.prepare(conn, RELEASE)
        self.admitter = admission.Admitter(admission_only=True)
        self.conn = await connect(self.url)  # the submits
        self.conns.append(self.conn)
        self.side = await connect(self.url)  # the broadcast mode's UPDATE, the checks
        self.conns.append(self.side)
        self.listener = await connect(self.url)  # counts the broadcasts on the lane channel
        self.conns.append(self.listener)
        channel = transport.lane_channel(lanes.lane_name(RELEASE))
        await self.listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self.counting = asyncio.create_task(self._count_broadcasts())

    async def _count_broadcasts(self) -> None:
        async for _ in self.listener.notifies():
            self.broadcasts += 1

    async def start_workers(self) -> None:
        for _ in range(self.k):
            worker = Worker(
                Settings(
                    url=self.url,
                    release=RELEASE,
                    registry=self.registry,
                    concurrency=CONCURRENCY,
                    grace_s=GRACE_S,
                    install_signals=False,
                )
            )
            serving = asyncio.create_task(worker.run())
            self.workers.append(worker)
            self.tasks.append(serving)
            ready = asyncio.create_task(worker.ready.wait())
            await asyncio.wait([serving, ready], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                raise BenchError(f"worker {len(self.workers)} of {self.k} not ready")

        async def all_waiting() -> bool:
            return int(await self._scalar(WAITING)) >= self.k

        await wait_until(all_waiting, 30, f"{self.k} workers in the line of waiting workers")
        await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Stop every worker (and wait for each to end), then the bench's connections."""
        for worker in self.workers:
            worker.stop()
        if self.tasks:
            await asyncio.wait_for(
                asyncio.gather(*self.tasks, return_exceptions=True), GRACE_S + 30
            )
        if self.counting is not None:
            self.counting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.counting
        for conn in self.conns:
            await conn.close()

    async def _scalar(self, sql: str) -> Any:
        cur = await self.side.execute(sql)
        row = await cur.fetchone()
        assert row is not None
        return row[0]

    def _counters(self) -> dict[str, int]:
        return {c: sum(w.stats[c] for w in self.workers) for c in COUNTERS}

    async def mode(self, mode: str, runs: int) -> dict[str, Any]:
        """``runs`` single submits of ``mode``, then every one succeeded and the workers
        settled: the counters' deltas, broadcasts, pickup latency and server CPU."""
        spacing = self.args.spacing_ms / 1000
        await asyncio.sleep(SETTLE_S)
        counters = self._counters()
        broadcasts = self.broadcasts
        cpu = server_cpu_s(self.postmaster)
        t0 = time.perf_counter()
        self.marks.reset()
        returned: dict[int, float] = {}
        for _ in range(runs):
            key = self.submitted
            if mode == "broadcast":
                await self.side.execute("UPDATE wq_workers SET waiting_since = NULL")
            await self.admitter.submit(
                self.conn, admission.Submission(play="noop", params={"i": key}, release=RELEASE)
            )
            returned[key] = time.perf_counter()
            self.submitted += 1
            await asyncio.sleep(spacing)

        async def finished() -> bool:
            return len(self.marks.started) >= runs and int(await self._scalar(UNFINISHED)) == 0

        await wait_until(finished, 60, f"the {mode} runs to finish")
        succeeded = int(await self._scalar(SUCCEEDED))
        if succeeded != self.submitted:
            raise BenchError(f"{mode}: {succeeded} of {self.submitted} runs succeeded")
        await asyncio.sleep(SETTLE_S)
        cpu = server_cpu_s(self.postmaster) - cpu
        seconds = time.perf_counter() - t0
        delta = {c: v - counters[c] for c, v in self._counters().items()}
        if delta["claimed"] != runs or delta["succeeded"] != runs:
            raise BenchError(f"{mode}: the workers' counters saw {delta}, not {runs} runs")
        latency = [self.marks.started[k] - t for k, t in returned.items()]
        return {
            "runs": runs,
            "seconds": round(seconds, 3),
            "counters": delta,
            "broadcasts": self.broadcasts - broadcasts,
            "claims_per_run": round(delta["claims"] / runs, 3),
            "empty_per_run": round(delta["claims_empty"] / runs, 3),
            "broadcasts_per_run": round((self.broadcasts - broadcasts) / runs, 3),
            "pickup": latency_summary(latency),
            "server_cpu_us_per_run": round(cpu / runs * 1e6, 1),
        }


async def one_k(
    admin_url: str, postmaster: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Both modes with K workers, on a database of their own."""
    db = f"bench_wake_{k}"
    url = await create_database(admin_url, db)
    herd = Herd(url, postmaster, k, args)
    out: dict[str, Any] = {}
    try:
        await herd.setup()
        try:
            await herd.start_workers()
            for mode in MODES:
                await herd.mode(mode, WARMUP)
            for mode in MODES:
                t0 = time.perf_counter()
                out[mode] = await herd.mode(mode, args.runs)
                print(f"  K={k:<3} {mode:<10} {time.perf_counter() - t0:6.1f} s", file=sys.stderr)
        finally:
            await herd.close()
    finally:
        await drop_database(admin_url, db)
    out["ratios"] = ratios(out)
    return out


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """wake-one / broadcast: below 1, wake-one costs less (or picks up sooner)."""
    one, all_ = out["wake-one"], out["broadcast"]

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("nan")

    return {
        "claims_per_run": ratio(one["claims_per_run"], all_["claims_per_run"]),
        "pickup_p50": ratio(one["pickup"]["p50_ms"], all_["pickup"]["p50_ms"]),
        "server_cpu_per_run": ratio(one["server_cpu_us_per_run"], all_["server_cpu_us_per_run"]),
    }


def summarize(results: dict[int, Any]) -> dict[str, Any]:
    """Both modes' figures per worker count for :mod:`bench.results`: claims and empty
    claims per run, the pickup's p50 and p99 (and its samples), the server's CPU per
    run; wake-one is the subject, the broadcast its baseline."""
    metrics: list[dict[str, Any]] = []
    figures: dict[str, dict[str, float | None]] = {mode: {} for mode in MODES}
    distributions = []
    for k, out in results.items():
        at = f"{k} idle worker{'s' if k > 1 else ''}"
        metrics += [
            metric(f"claims_{k}", f"claims per run, {at}", "claims", higher_is_better=False),
            metric(f"empty_{k}", f"empty claims per run, {at}", "claims", higher_is_better=False),
            metric(f"pickup_p50_{k}", f"pickup p50, {at}", "ms", higher_is_better=False),
            metric(f"pickup_p99_{k}", f"pickup p99, {at}", "ms", higher_is_better=False),
            metric(f"server_cpu_{k}", f"server CPU per run, {at}", "us", higher_is_better=False),
        ]
        for mode in MODES:
            m = out[mode]
            figures[mode] |= {
                f"claims_{k}": m["claims_per_run"],
                f"empty_{k}": m["empty_per_run"],
                f"pickup_p50_{k}": m["pickup"]["p50_ms"],
                f"pickup_p99_{k}": m["pickup"]["p99_ms"],
                f"server_cpu_{k}": m["server_cpu_us_per_run"],
            }
        distributions.append(
            {
                "key": f"pickup_{k}",
                "label": f"pickup latency, {at}",
                "unit": "ms",
                "samples": {mode: out[mode]["pickup"].get("samples_ms", []) for mode in MODES},
            }
        )
    return summary(metrics, figures, subject="wake-one", distributions=distributions)


def print_table(results: dict[int, Any]) -> None:
    header = [
        "workers",
        "mode",
        "claims / run",
        "empty claims / run",
        "broadcasts / run",
        "pickup p50 / p99 (ms)",
        "server CPU / run (us)",
        "wake-one / broadcast",
    ]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for k, out in results.items():
        for mode in MODES:
            m = out[mode]
            r = out["ratios"]
            shown = (
                f"claims {r['claims_per_run']}x, p50 {r['pickup_p50']}x,"
                f" CPU {r['server_cpu_per_run']}x"
                if mode == "wake-one"
                else "-"
            )
            cells = [
                str(k),
                mode,
                f"{m['claims_per_run']:.2f}",
                f"{m['empty_per_run']:.2f}",
                f"{m['broadcasts_per_run']:.2f}",
                f"{m['pickup']['p50_ms']:.1f} / {m['pickup']['p99_ms']:.1f}",
                f"{m['server_cpu_us_per_run']:,.0f}",
                shown,
            ]
            print("| " + " | ".join(cells) + " |")


def worker_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of worker counts, each >= 1")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.wake", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=worker_counts, default=[1, 4, 8])
    p.add_argument("--runs", type=int, default=200, help="single submits per mode and K")
    p.add_argument("--spacing-ms", type=float, default=20.0)
    add_out(p)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def body(server: embedded.EmbeddedServer, home: Path, report: dict[str, Any]) -> None:
        admin_url = server.url("postgres")
        results: dict[int, Any] = {}
        report["results"] = results
        try:
            for k in args.workers:
                results[k] = await one_k(admin_url, server.pid, k, args)
        finally:  # the worker counts measured, also when a later one failed
            report["summary"] = summarize(results)
        print_table(results)

    return run_on_throwaway_server("wake", args, body)


if __name__ == "__main__":
    sys.exit(main())
