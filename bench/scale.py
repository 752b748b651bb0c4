"""Scale-out: N worker hosts on one Postgres, directly or through PgBouncer.

Each worker "host" is a ``worker start`` process in a network namespace of its own, linked
to the database host's namespace (this one) by a veth pair (``bench.hosts``); without root
or ``ip netns`` the hosts are plain processes on loopback, and the output says so. For
each host count (1, 2, 4, 8 by default) the hosts serve one lane and the bench measures:

- **trivial runs/s**: a play that returns at once. A batch is admitted in one transaction
  while the hosts are idle and ready; throughput = runs / (last finish - commit), both
  server timestamps. CPU-bound: the hosts, Postgres and PgBouncer share the machine's
  cores, so on a small machine this does not grow with hosts.
- **IO-bound runs/s**: a play that awaits 50 ms (an API call), ``io_rounds`` x hosts x
  concurrency runs, measured the same way. Each host runs ``--concurrency`` (2) attempts
  at once, so one host does at most 2 / 50 ms = 40 runs/s: latency-bound, a small
  fraction of a core. This is what adding hosts scales.
- **pickup p50/p99**: single submits 25 ms apart to idle hosts; from the admission's
  return (committed) to the play's first line, one clock (LISTEN wakes a host at once;
  polling costs up to the poll interval).
- **connections**: the most Postgres client backends seen on the bench database
  (sampled every 100 ms; the bench's own monitor excluded). Through PgBouncer this is
  its server pool plus the hosts' LISTEN sessions, whatever the hosts' count.
- **CPU busy**: the machine's busy share over the IO phase, all cores (from /proc/stat).

It starts its own Postgres (the embedded server, at server defaults, listening on the
links' addresses too, SCRAM only) and removes everything at the end, also on Ctrl-C.

    python -m bench.scale                       # direct, hosts 1 2 4 8
    python -m bench.scale --pgbouncer           # through PgBouncer (transaction mode)
    python -m bench.scale --pgbouncer --no-listen   # ... and no LISTEN: polling
    python -m bench.scale --json                # the last line is {"rows": [...]}

Results: a table on stdout (stderr with ``--json``) and a results file under
``bench/results/`` (:mod:`bench.results`).
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import psycopg

from bench import hosts as hostlib
from bench import results
from bench.common import (
    add_out,
    percentile,
    quiet_logging,
    scalar,
    sigterm_exits,
    start_server,
    throwaway_home,
    write_results,
)
from bench.results import metric, summary
from bench.throughput import server_cpu_s
from queues import admission, lanes, migrations, roles
from worker import embedded
from worker.context import RunContext
from worker.plays import Registry

ROOT = Path(__file__).resolve().parent.parent
WORKER_BIN = str(Path(sys.executable).parent / "worker")
DBNAME = "scale"
IO_SLEEP_S = 0.05

registry = Registry()


@registry.play("trivial")
async def trivial(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"started": time.time()}  # one clock: every host is a namespace of this machine


@registry.play("io")
async def io(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(IO_SLEEP_S)  # an API call: the worker waits, the CPU does not
    return {}


@dataclass
class Row:
    network: str  # namespaces (a veth link per host) or loopback (the fallback)
    hosts: int
    worker_processes: int
    via: str
    wakeups: str
    connections: int
    trivial_runs: int
    trivial_runs_per_s: float
    io_runs: int
    io_runs_per_s: float
    pickup_p50_ms: float
    pickup_p99_ms: float
    cpu_busy_trivial: float
    cpu_busy_io: float
    worker_cpu_ms_per_io_run: float  # the hosts' processes, over the IO phase
    postgres_cpu_ms_per_io_run: float  # the server's processes, over the IO phase


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0.0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


class Monitor:
    """Samples the bench database's client backends (the monitor's own excluded)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            while True:
                n = await scalar(
                    conn,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                )
                self.peak = max(self.peak, int(n))
                await asyncio.sleep(0.1)

    def start(self) -> None:
        self.peak = 0
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def bulk_submit(url: str, release: str, play: str, n: int) -> tuple[list[uuid.UUID], Any]:
    """Admit ``n`` runs in one transaction; return their ids and the commit's server time."""
    ids: list[uuid.UUID] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        async with conn.transaction():
            for _ in range(n):
                admitted = await admission.submit(
                    conn, admission.Submission(play=play, release=release)
                )
                ids.append(admitted.run_id)
        committed = await scalar(conn, "SELECT clock_timestamp()")
    return ids, committed


async def drain(url: str, ids: list[uuid.UUID], since: Any, timeout_s: float) -> float:
    """Wait until every run succeeded; runs/s from the commit to the last finish."""
    deadline = time.monotonic() + timeout_s
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FILTER (WHERE state = 'succeeded'),"
                " count(*) FILTER (WHERE state IN ('failed', 'cancelled')),"
                " extract(epoch FROM max(finished_at) - %s::timestamptz)"
                " FROM wq_runs WHERE id = ANY(%s)",
                (since, ids),
            )
            row = await cur.fetchone()
            assert row is not None
            done, bad, span = int(row[0]), int(row[1]), row[2]
            if bad:
                raise RuntimeError(f"{bad} run(s) did not succeed")
            if done == len(ids):
                return len(ids) / max(float(span or 0), 1e-6)
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {done}/{len(ids)} runs finished in {timeout_s:.0f}s")
            await asyncio.sleep(0.05)


async def pickups(url: str, release: str, samples: int) -> list[float]:
    """Milliseconds from an admission's return (committed) to its play's first line."""
    admitted_at: dict[uuid.UUID, float] = {}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for _ in range(samples):
            admitted = await admission.submit(
                conn, admission.Submission(play="trivial", release=release)
            )
            admitted_at[admitted.run_id] = time.time()
            await asyncio.sleep(0.025)
    await drain(url, list(admitted_at), None, 60)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT id, (result->>'started')::float8 FROM wq_runs WHERE id = ANY(%s)",
            (list(admitted_at),),
        )
        return [(started - admitted_at[run_id]) * 1000 for run_id, started in await cur.fetchall()]


@dataclass
class Setup:
    admin_url: str  # the bench database, as superuser, on loopback
    worker_url: str  # the worker role's URL, on loopback (rehosted per host)
    net: hostlib.Hosts | None
    bouncer: hostlib.PgBouncer | None
    listen: bool
    concurrency: int
    max_connections: int | None
    logs: Path
    postmaster: int


def _host_urls(s: Setup, i: int) -> tuple[str, str | None]:
    address = s.net.hosts[i].address if s.net is not None else "127.0.0.1"
    if s.bouncer is not None:
        url = s.bouncer.url(s.worker_url, host=address)
        return url, s.bouncer.url(s.worker_url, host=address, session=True) if s.listen else None
    return hostlib.rehost(s.worker_url, address), None


def start_hosts(s: Setup, n: int, release: str) -> list[tuple[subprocess.Popen[bytes], Path]]:
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    for i in range(n):
        url, listen = _host_urls(s, i)
        env = {k: v for k, v in os.environ.items() if not k.endswith("DATABASE_URL")}
        env |= {
            "WORKER_DATABASE_URL": url,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        if s.bouncer is not None:
            env["WORKER_POOL_MODE"] = "transaction"
        if listen is not None:
            env["WORKER_LISTEN_URL"] = listen
        ready = s.logs / f"ready-{release}-{i}"
        args = [
            WORKER_BIN,
            "--json-logs",
            "--log-level",
            "WARNING",
            "start",
            "--release",
            release,
            "--app",
            "bench.scale:registry",
            "--concurrency",
            str(s.concurrency),
            "--grace",
            "2s",
            "--ready-file",
            str(ready),
        ]
        if s.max_connections is not None:
            args += ["--max-connections", str(s.max_connections)]
        log: IO[bytes] = (s.logs / f"{release}-{i}.log").open("ab")
        if s.net is not None:
            proc = s.net.spawn(s.net.hosts[i], args, env=env, log=log, cwd=ROOT)
        else:
            proc = subprocess.Popen(
                args,
                env=env,
                stdout=log,
                stderr=log,
                cwd=ROOT,
                preexec_fn=hostlib.die_with_parent,  # noqa: PLW1509
            )
        log.close()
        started.append((proc, ready))
    deadline = time.monotonic() + 90
    while not all(ready.exists() for _, ready in started):
        for i, (proc, _) in enumerate(started):
            if proc.poll() is not None:
                log = (s.logs / f"{release}-{i}.log").read_text(errors="replace")
                tail = "\n".join(log.splitlines()[-5:])
                raise RuntimeError(f"worker host {i} exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker hosts not ready within 90 s (logs: {s.logs})")
        time.sleep(0.1)
    return started


def stop_hosts(started: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    for proc, _ in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in started:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def measure(s: Setup, n: int, *, trivial_runs: int, io_rounds: int) -> Row:
    release = f"scale{n}"
    async with await psycopg.AsyncConnection.connect(s.admin_url, autocommit=True) as conn:
        await lanes.prepare(conn, release)
    started = start_hosts(s, n, release)
    monitor = Monitor(s.admin_url)
    try:
        monitor.start()
        busy0, total0 = cpu_times()
        ids, since = await bulk_submit(s.admin_url, release, "trivial", trivial_runs)
        trivial_rate = await drain(s.admin_url, ids, since, 300)
        busy1, total1 = cpu_times()
        pids = [proc.pid for proc, _ in started]
        worker_cpu0, server_cpu0 = process_cpu_s(pids), server_cpu_s(s.postmaster)
        io_runs = io_rounds * n * s.concurrency
        ids, since = await bulk_submit(s.admin_url, release, "io", io_runs)
        io_rate = await drain(s.admin_url, ids, since, 300)
        busy2, total2 = cpu_times()
        worker_cpu = process_cpu_s(pids) - worker_cpu0
        server_cpu = server_cpu_s(s.postmaster) - server_cpu0
        await monitor.stop()
        latencies = await pickups(s.admin_url, release, 40)
    finally:
        await monitor.stop()
        stop_hosts(started)
    return Row(
        network="namespaces" if s.net is not None else "loopback",
        hosts=n,
        worker_processes=n,
        via="pgbouncer" if s.bouncer is not None else "direct",
        wakeups="listen" if (s.bouncer is None or s.listen) else "poll 1s",
        connections=monitor.peak,
        trivial_runs=trivial_runs,
        trivial_runs_per_s=round(trivial_rate, 1),
        io_runs=io_runs,
        io_runs_per_s=round(io_rate, 1),
        pickup_p50_ms=round(percentile(latencies, 50), 2),
        pickup_p99_ms=round(percentile(latencies, 99), 2),
        cpu_busy_trivial=round((busy1 - busy0) / max(total1 - total0, 1), 3),
        cpu_busy_io=round((busy2 - busy1) / max(total2 - total1, 1), 3),
        worker_cpu_ms_per_io_run=round(worker_cpu * 1000 / io_runs, 3),
        postgres_cpu_ms_per_io_run=round(server_cpu * 1000 / io_runs, 3),
    )


def _listen_on(home: Path, addresses: list[str]) -> embedded.EmbeddedServer:
    """Restart the bench's server listening on the links' addresses too, with one more
    pg_hba line for their subnet (SCRAM, like every other line)."""
    server = start_server(home, {"listen_addresses": ",".join(["127.0.0.1", *addresses])})
    hba = server.datadir / "pg_hba.conf"
    with hba.open("a") as f:
        f.write(f"host    all          all   {hostlib.SUBNET}.0.0/16  {embedded.AUTH}\n")
    with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    # The reload is asynchronous: wait until a link's address is let in.
    deadline = time.monotonic() + 15
    while True:
        try:
            with psycopg.connect(
                hostlib.rehost(server.url("postgres"), addresses[0]), connect_timeout=2
            ):
                return server
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def _prepare_database(server: embedded.EmbeddedServer) -> tuple[str, str]:
    async with await psycopg.AsyncConnection.connect(
        server.url("postgres"), autocommit=True
    ) as conn:
        await conn.execute(f"CREATE DATABASE {DBNAME}")
    admin = server.url(DBNAME)
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await migrations.migrate(conn)
    server.enable_role_logins([roles.Role.WORKER.value])
    return admin, server.url(DBNAME, role=roles.Role.WORKER.value)


def run(args: argparse.Namespace, echo: Any) -> list[Row]:
    with throwaway_home("wq-scale-", keep_env="SCALE_KEEP") as home:
        return _run(args, echo, home)


def _run(args: argparse.Namespace, echo: Any, home: Path) -> list[Row]:
    counts = sorted({int(x) for x in args.hosts.split(",")})
    reason = "--loopback given" if args.loopback else hostlib.namespaces_available()
    logs = home / "logs"
    logs.mkdir()
    net: hostlib.Hosts | None = None
    bouncer: hostlib.PgBouncer | None = None
    rows: list[Row] = []
    try:
        if reason is None:
            net = hostlib.Hosts(max(counts)).__enter__()
            server = _listen_on(home, net.addresses)
            echo(f"hosts: network namespaces, one veth link each ({', '.join(net.addresses)})")
        else:
            server = embedded.ensure_running(home)
            echo(f"hosts: separate processes on loopback (no namespaces: {reason})")
        admin_url, worker_url = asyncio.run(_prepare_database(server))
        if args.pgbouncer:
            bouncer = hostlib.start_pgbouncer(
                admin_url,
                users={
                    roles.Role.WORKER.value: embedded.role_password(
                        server.password, roles.Role.WORKER.value
                    )
                },
                listen=net.addresses if net is not None else ("127.0.0.1",),
                pool_size=args.pool_size,
            )
        setup = Setup(
            admin_url=admin_url,
            worker_url=worker_url,
            net=net,
            bouncer=bouncer,
            listen=not args.no_listen,
            concurrency=args.concurrency,
            max_connections=args.max_connections,
            logs=logs,
            postmaster=server.pid,
        )
        for n in counts:
            row = asyncio.run(
                measure(setup, n, trivial_runs=args.trivial_runs, io_rounds=args.io_rounds)
            )
            rows.append(row)
            echo(
                f"  {n} host(s): io {row.io_runs_per_s:.0f}/s, trivial "
                f"{row.trivial_runs_per_s:.0f}/s, {row.connections} connections"
            )
    finally:
        if bouncer is not None:
            bouncer.stop()
        if net is not None:
            net.close()
    return rows


def table(rows: list[Row], args: argparse.Namespace) -> str:
    head = (
        "| hosts | worker processes | via | wake-ups | Postgres connections "
        "| trivial runs/s | IO-bound runs/s (50 ms) | IO vs 1 host | pickup p50 / p99 (ms) "
        "| CPU busy (trivial / IO) | CPU ms per IO run (workers / Postgres) |"
    )
    lines = [head, "|" + "---|" * 11]
    base = rows[0].io_runs_per_s if rows else 0.0
    for r in rows:
        lines.append(
            f"| {r.hosts} | {r.worker_processes} | {r.via} | {r.wakeups} | {r.connections} "
            f"| {r.trivial_runs_per_s:,.0f} | {r.io_runs_per_s:,.0f} "
            f"| {r.io_runs_per_s / base if base else 0:.1f}x "
            f"| {r.pickup_p50_ms:.1f} / {r.pickup_p99_ms:.1f} "
            f"| {r.cpu_busy_trivial:.0%} / {r.cpu_busy_io:.0%} "
            f"| {r.worker_cpu_ms_per_io_run:.2f} / {r.postgres_cpu_ms_per_io_run:.2f} |"
        )
    lines.append("")
    network = rows[0].network if rows else "?"
    lines.append(
        f"hosts: {network}"
        + (" (the fallback: separate processes on loopback)" if network == "loopback" else "")
        + f". Concurrency {args.concurrency} per host: an IO-bound host is latency-bound at "
        f"{args.concurrency} / {IO_SLEEP_S * 1000:.0f} ms = "
        f"{args.concurrency / IO_SLEEP_S:.0f} runs/s, a small share of a core, so IO "
        f"throughput grows with hosts until the {os.cpu_count()} cores (shared by every "
        "host and Postgres) are busy; trivial runs are CPU-bound from one host on, so "
        "they do not grow here."
    )
    return "\n".join(lines)


def summarize(rows: list[Row]) -> dict[str, Any]:
    """Per host count, for :mod:`bench.results`: the run's mode (how the hosts reach
    Postgres and are woken) is the column; each host count's IO-bound rate is also set
    against one host's."""
    metrics: list[dict[str, Any]] = []
    figures: dict[str, float | None] = {}
    ratios: dict[str, dict[str, float]] = {}
    base = rows[0].io_runs_per_s if rows and rows[0].hosts == 1 else None
    for r in rows:
        at = f"{r.hosts} host{'s' if r.hosts > 1 else ''}"
        for key, label, unit, higher, value in (
            ("connections", "Postgres connections", "connections", False, r.connections),
            ("trivial", "trivial runs", "runs/s", True, r.trivial_runs_per_s),
            ("io", f"IO-bound runs ({IO_SLEEP_S * 1000:.0f} ms)", "runs/s", True, r.io_runs_per_s),
            ("pickup_p50", "pickup p50", "ms", False, r.pickup_p50_ms),
            ("pickup_p99", "pickup p99", "ms", False, r.pickup_p99_ms),
            ("worker_cpu", "worker CPU per IO run", "ms", False, r.worker_cpu_ms_per_io_run),
            ("postgres_cpu", "Postgres CPU per IO run", "ms", False, r.postgres_cpu_ms_per_io_run),
        ):
            metrics.append(
                metric(f"{key}_{r.hosts}", f"{label}, {at}", unit, higher_is_better=higher)
            )
            figures[f"{key}_{r.hosts}"] = value
        if base and r.hosts > 1:
            ratios[f"io_{r.hosts}"] = {"1 host": round(r.io_runs_per_s / base, 2)}
    mode = f"{rows[0].via}, {rows[0].wakeups}" if rows else "-"
    return summary(metrics, {mode: figures}, subject=mode, ratios=ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--hosts", default="1,2,4,8", help="host counts (default 1,2,4,8)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="attempts per host (default 2: 4 hosts' IO load stays well inside 2 cores)",
    )
    parser.add_argument("--trivial-runs", type=int, default=2000)
    parser.add_argument("--io-rounds", type=int, default=60, help="IO runs per slot")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=10,
        help="each host's connection cap (default 10: 8 hosts fit Postgres' default 100)",
    )
    parser.add_argument("--pgbouncer", action="store_true", help="through PgBouncer")
    parser.add_argument("--pool-size", type=int, default=20, help="PgBouncer's pool")
    parser.add_argument("--no-listen", action="store_true", help="PgBouncer and no LISTEN")
    parser.add_argument("--loopback", action="store_true", help="no namespaces")
    parser.add_argument("--json", action="store_true", help="last line: {'rows': [...]}")
    add_out(parser)
    args = parser.parse_args(argv)
    quiet_logging()
    signal.signal(signal.SIGTERM, sigterm_exits)

    def echo(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    started = time.perf_counter()
    report = results.start("scale", args)
    rows = run(args, echo)
    report["results"] = {"rows": [asdict(r) for r in rows]}
    report["summary"] = summarize(rows)
    print(table(rows, args), file=sys.stderr if args.json else sys.stdout, flush=True)
    write_results(report, args.out, started, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
