"""Chaos: SIGKILLed workers, a Postgres restart and killed backends, with nothing lost.

A workload of runs of the ``paid-rows`` play (sheets, and a side-effect-counting step per
row) runs on three worker processes and one recovery process, while the harness
SIGKILLs a random worker every few seconds and restarts it, restarts Postgres once
mid-way (immediate shutdown: a crash), and terminates every worker backend with
pg_terminate_backend. At the end it checks and prints:

- every run terminal and succeeded;
- every row has exactly one accepted terminal write (counted by a trigger);
- no step whose receipt was completed ran again; side effects per row are one, plus the
  steps in flight at the kills (reported);
- zero stale writes applied (every row carries its run's write intent version);
- the time from the last fault to the last run finishing.

    python -m bench.chaos --runs 100 --rows 1000      # larger than the CI size

The same function runs at a small size in ``tests/integration/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from queues import admission
from worker import embedded

ROOT = Path(__file__).resolve().parent.parent
WORKER_BIN = str(Path(sys.executable).parent / "worker")
APP = "tests.apps.durable:registry"
RELEASE = "chaos"

SETUP_SQL = """
CREATE TABLE IF NOT EXISTS test_side_effects (
    run_id  uuid NOT NULL,
    key     text NOT NULL,
    attempt integer NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_terminal_writes (
    org text, sheet text, row_key text, write_version bigint,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_count_terminal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_terminal_writes (org, sheet, row_key, write_version)
    VALUES (NEW.org, NEW.sheet, NEW.row_key, NEW.write_version);
    RETURN NEW;
END;
$$;
CREATE TRIGGER chaos_terminal AFTER UPDATE ON wq_sheet_rows FOR EACH ROW
    WHEN (OLD.status = 'pending' AND NEW.status <> 'pending')
    EXECUTE FUNCTION chaos_count_terminal();
UPDATE wq_lanes
   SET lease_ttl_s = 3, heartbeat_s = 1, retry_max_attempts = 1000,
       retry_base_s = 0.2, retry_cap_s = 1, retry_jitter = 0.1, concurrency = 4
 WHERE name = 'r-chaos';
"""


@dataclass
class ChaosConfig:
    runs: int = 20
    rows: int = 500
    workers: int = 3
    concurrency: int = 4
    chunk: int = 25
    chunk_delay_s: float = 0.2  # paces a run (a real play waits on APIs) so faults land mid-run
    kill_every_s: float = 2.0
    terminate_every_s: float = 3.0
    restart_after_s: float = 4.0  # the one Postgres crash-restart, after the first kills
    fault_window_s: float = 15.0
    deadline_s: float = 300.0
    seed: int = 7


@dataclass
class ChaosReport:
    runs: int
    rows_per_run: int
    states: dict[str, int]
    kills: int
    postgres_restarts: int
    backend_terminations: int
    rows_done: int
    rows_with_one_terminal_write: int
    rows_with_more_terminal_writes: int
    side_effects: int
    extra_side_effects: int
    reexecuted_completed_steps: int
    stale_rows: int
    attempts: int
    last_fault_to_done_s: float
    total_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["WORKER_DATABASE_URL"] = url
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DATABASE_URL", None)
    return env


def _spawn(args: list[str], url: str, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [WORKER_BIN, "--json-logs", *args], env=_env(url), stdout=log, stderr=log, cwd=ROOT
        )


def _run(args: list[str], url: str) -> None:
    subprocess.run([WORKER_BIN, *args], env=_env(url), check=True, capture_output=True, cwd=ROOT)


async def _submit_all(url: str, cfg: ChaosConfig) -> list[str]:
    ids: list[str] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for r in range(cfg.runs):
            rows = [(f"k{i:05d}", {"n": i}) for i in range(cfg.rows)]
            admitted = await admission.submit(
                conn,
                admission.Submission(
                    play="paid-rows",
                    params={"chunk": cfg.chunk, "chunk_delay_s": cfg.chunk_delay_s},
                    release=RELEASE,
                    idempotency_key=f"chaos-{r}",
                ),
                inputs=rows,
            )
            ids.append(str(admitted.run_id))
    return ids


def _query(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


def _unfinished(url: str) -> int:
    try:
        rows = _query(
            url,
            "SELECT count(*) FROM wq_runs WHERE state NOT IN ('succeeded', 'failed', 'cancelled')",
        )
    except psycopg.OperationalError:
        return -1
    return int(rows[0][0])


def run_chaos(cfg: ChaosConfig, *, echo: Any = print) -> ChaosReport:
    rng = random.Random(cfg.seed)
    home = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    home.chmod(0o755)
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        server = embedded.ensure_running(home)
        with psycopg.connect(server.url("postgres"), autocommit=True) as admin:
            admin.execute("CREATE DATABASE chaos")
        url = server.url("chaos")
        _run(["migrate"], url)
        _run(["queues", "prepare", RELEASE], url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SETUP_SQL)
        run_ids = asyncio.run(_submit_all(url, cfg))
        echo(f"submitted {len(run_ids)} runs x {cfg.rows} rows")

        logs = home / "logs"
        logs.mkdir()

        def start_worker(i: int) -> subprocess.Popen[bytes]:
            args = [
                "start",
                "--release",
                RELEASE,
                "--app",
                APP,
                "--grace",
                "1",
                "--concurrency",
                str(cfg.concurrency),
            ]
            return _spawn(args, url, logs / f"worker-{i}.log")

        workers = [start_worker(i) for i in range(cfg.workers)]
        recovery = _spawn(["recover", "--every", "1s"], url, logs / "recovery.log")
        procs.extend([*workers, recovery])

        kills = restarts = terminations = 0
        last_fault = time.monotonic()
        fault_end = time.monotonic() + cfg.fault_window_s
        restart_at = time.monotonic() + cfg.restart_after_s
        next_kill = time.monotonic() + cfg.kill_every_s
        next_term = time.monotonic() + cfg.terminate_every_s
        deadline = time.monotonic() + cfg.deadline_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            if _unfinished(url) == 0:
                break
            if now < fault_end:
                if now >= next_kill:
                    i = rng.randrange(len(workers))
                    workers[i].send_signal(signal.SIGKILL)
                    workers[i].wait()
                    workers[i] = start_worker(i)
                    procs.append(workers[i])
                    kills += 1
                    last_fault = now
                    next_kill = now + cfg.kill_every_s
                if restarts == 0 and now >= restart_at:
                    embedded.stop(home, mode="immediate")
                    embedded.ensure_running(home)
                    restarts += 1
                    last_fault = time.monotonic()
                    echo("postgres restarted")
                if now >= next_term:
                    try:
                        rows = _query(
                            url,
                            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                            "AND backend_type = 'client backend'",
                        )
                        terminations += int(rows[0][0])
                        last_fault = now
                    except psycopg.OperationalError:
                        pass
                    next_term = now + cfg.terminate_every_s
            # Workers that exited (a lost database makes them exit non-zero) are restarted,
            # as a supervisor would.
            for i, proc in enumerate(workers):
                if proc.poll() is not None:
                    workers[i] = start_worker(i)
                    procs.append(workers[i])
            time.sleep(0.1)
        done_at = time.monotonic()
        return _report(
            url,
            cfg,
            run_ids,
            kills,
            restarts,
            terminations,
            done_at - last_fault,
            done_at - started,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        embedded.stop(home, mode="immediate")
        if os.environ.get("CHAOS_KEEP") != "1":
            shutil.rmtree(home, ignore_errors=True)


def _report(
    url: str,
    cfg: ChaosConfig,
    run_ids: list[str],
    kills: int,
    restarts: int,
    terminations: int,
    last_fault_to_done_s: float,
    total_s: float,
) -> ChaosReport:
    states = dict(_query(url, "SELECT state::text, count(*) FROM wq_runs GROUP BY 1"))
    ((rows_done,),) = _query(url, "SELECT count(*) FROM wq_sheet_rows WHERE status = 'done'")
    ((one, more),) = _query(
        url,
        "SELECT count(*) FILTER (WHERE n = 1), count(*) FILTER (WHERE n > 1) FROM "
        "(SELECT count(*) AS n FROM chaos_terminal_writes GROUP BY org, sheet, row_key) t",
    )
    ((effects, extra),) = _query(
        url,
        "SELECT coalesce(sum(n), 0), coalesce(sum(n - 1), 0) FROM "
        "(SELECT count(*) AS n FROM test_side_effects GROUP BY run_id, key) t",
    )
    # A side effect that happened after its step's receipt was completed: a paid step
    # executed again. Must be zero.
    ((reexecuted,),) = _query(
        url,
        "SELECT count(*) FROM test_side_effects s JOIN wq_receipts r "
        "  ON r.scope = 'run:' || s.run_id AND r.step_key = s.key "
        " WHERE r.status = 'completed' AND r.completed_at < s.at",
    )
    # Stale writes applied: a row whose terminal write carries a version other than its
    # run's durable write intent.
    ((stale,),) = _query(
        url,
        "SELECT count(*) FROM wq_sheet_rows r JOIN wq_write_intents i "
        "  ON i.run_id = r.run_id AND i.sheet = r.sheet "
        " WHERE r.status <> 'pending' AND r.write_version <> i.write_version",
    )
    ((attempts,),) = _query(url, "SELECT count(*) FROM wq_attempts")
    expected_rows = cfg.runs * cfg.rows
    problems = []
    if states.get("succeeded", 0) != cfg.runs:
        problems.append(f"not every run succeeded: {states}")
    if rows_done != expected_rows:
        problems.append(f"{rows_done} rows done of {expected_rows}")
    if one != expected_rows or more:
        problems.append(f"terminal writes: {one} rows with one, {more} with more")
    if reexecuted:
        problems.append(f"{reexecuted} completed steps executed again")
    if stale:
        problems.append(f"{stale} stale writes applied")
    if effects < expected_rows:
        problems.append(f"only {effects} side effects for {expected_rows} rows")
    return ChaosReport(
        runs=len(run_ids),
        rows_per_run=cfg.rows,
        states={str(k): int(v) for k, v in states.items()},
        kills=kills,
        postgres_restarts=restarts,
        backend_terminations=terminations,
        rows_done=int(rows_done),
        rows_with_one_terminal_write=int(one),
        rows_with_more_terminal_writes=int(more),
        side_effects=int(effects),
        extra_side_effects=int(extra),
        reexecuted_completed_steps=int(reexecuted),
        stale_rows=int(stale),
        attempts=int(attempts),
        last_fault_to_done_s=round(last_fault_to_done_s, 2),
        total_s=round(total_s, 2),
        problems=problems,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--fault-window", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    cfg = ChaosConfig(
        runs=args.runs, rows=args.rows, fault_window_s=args.fault_window, seed=args.seed
    )
    report = run_chaos(cfg)
    print(json.dumps(asdict(report), indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{cfg.runs}x{cfg.rows}.json").write_text(json.dumps(asdict(report), indent=2))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
