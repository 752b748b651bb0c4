"""Chaos: SIGKILLed workers, a Postgres restart and killed backends, with nothing lost.

A workload of runs of the ``paid-rows`` play (sheets, and a side-effect-counting step per
row) runs on three worker processes and one recovery process. Runs share sheets (several
runs admit the same row keys), so their write versions really compete: a later run's
intent takes over the rows an earlier run has not finished. The lane keeps the default
retry policy (5 attempts, exponential backoff); only its lease is short (3 s, heartbeat
1 s), which makes every kill harsher, not gentler. Faults are scheduled by progress (rows
completed so far), not by the clock: a worker is SIGKILLed and restarted at every few
percent, every worker backend is terminated at others, and Postgres is crash-restarted
(immediate shutdown) once, mid-way.

Audit triggers, installed in the run's database, record every write in the writing
transaction: each terminal row write with the writer's attempt and the run's state at that
moment, each completed receipt likewise. At the end the harness checks and prints:

- every run terminal and succeeded;
- every row finished exactly once (no terminal write on an already terminal row);
- zero stale writes applied: no row or receipt written by an attempt that was not its
  run's live attempt when it wrote, and no row output written after its writing attempt
  was closed (compared with the attempt history);
- no step whose receipt was completed ran again (side effects per run and row);
- the time from the last fault to the last run finishing.

Each of those checks fails if its fence is removed from the SQL (see
``scripts/fence_mutants.py``): they compare what was written with who was allowed to write.

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
-- Every write of a row's output, in the writing transaction: the row's status before and
-- after, the writer's run and attempt, and the run's state, attempt and lease owner as the
-- transaction sees them (the fence holds the run's row, so this is the run as it was).
CREATE TABLE chaos_row_writes (
    org text, sheet text, row_key text, old_status text, new_status text,
    run_id uuid, writer_attempt integer, run_state text, run_attempt integer,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_row_writes (org, sheet, row_key, old_status, new_status, run_id,
                                  writer_attempt, run_state, run_attempt)
    SELECT NEW.org, NEW.sheet, NEW.row_key, OLD.status::text, NEW.status::text, NEW.run_id,
           NEW.attempt, r.state::text, r.attempt
      FROM wq_runs r WHERE r.id = NEW.run_id;
    RETURN NEW;
END;
$$;
CREATE TRIGGER chaos_row_audit AFTER UPDATE ON wq_sheet_rows FOR EACH ROW
    WHEN (NEW.status <> 'pending')
    EXECUTE FUNCTION chaos_audit_row();
-- Every completed receipt, with the run as the writing transaction sees it.
CREATE TABLE chaos_receipt_writes (
    scope text, step_key text, owner_run uuid, owner_attempt integer, run_state text,
    run_attempt integer, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_audit_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_receipt_writes (scope, step_key, owner_run, owner_attempt, run_state,
                                      run_attempt)
    SELECT NEW.scope, NEW.step_key, NEW.owner_run, NEW.owner_attempt, r.state::text, r.attempt
      FROM wq_runs r WHERE r.id = NEW.owner_run;
    RETURN NEW;
END;
$$;
CREATE TRIGGER chaos_receipt_audit AFTER INSERT OR UPDATE ON wq_receipts FOR EACH ROW
    WHEN (NEW.status = 'completed')
    EXECUTE FUNCTION chaos_audit_receipt();
-- The lane's retry policy stays at its defaults; only the lease is short.
UPDATE wq_lanes SET lease_ttl_s = 3, heartbeat_s = 1, concurrency = 4 WHERE name = 'r-chaos';
"""


@dataclass
class ChaosConfig:
    runs: int = 20
    rows: int = 500
    sheets: int = 5  # runs share sheets: runs r, r + sheets, ... admit the same row keys
    workers: int = 3
    concurrency: int = 4
    chunk: int = 25
    chunk_delay_s: float = 0.2  # paces a run (a real play waits on APIs) so faults land mid-run
    kill_every: float = 0.08  # SIGKILL a worker each time this fraction of rows is done
    terminate_every: float = 0.12  # terminate every worker backend at these steps
    restart_at: float = 0.4  # the one Postgres crash-restart, at this fraction of rows done
    faults_until: float = 0.9  # no new faults past this fraction: let the tail finish
    deadline_s: float = 300.0
    seed: int = 7

    @property
    def total_rows(self) -> int:
        """Distinct rows: each sheet holds ``rows`` keys, shared by its runs."""
        return min(self.sheets, self.runs) * self.rows


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
    stale_receipts: int
    rows_written_after_close: int
    rows_taken_over: int  # rows finished by another run than the one that first admitted them
    attempts: int
    attempt_outcomes: dict[str, int]
    last_fault_to_done_s: float
    total_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["WORKER_DATABASE_URL"] = url
    env["TEST_SIDE_EFFECTS_URL"] = url  # the test play's own database
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
            sheet = f"shared-{r % cfg.sheets}"
            admitted = await admission.submit(
                conn,
                admission.Submission(
                    play="paid-rows",
                    params={
                        "chunk": cfg.chunk,
                        "chunk_delay_s": cfg.chunk_delay_s,
                        "sheet": sheet,
                    },
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


def _progress(url: str) -> tuple[int, int] | None:
    """(unfinished runs, rows finished), or None while the database is away."""
    try:
        rows = _query(
            url,
            "SELECT count(*) FILTER (WHERE state NOT IN ('succeeded', 'failed', 'cancelled')),"
            " (SELECT count(*) FROM wq_sheet_rows WHERE status <> 'pending') FROM wq_runs",
        )
    except psycopg.OperationalError:
        return None
    return int(rows[0][0]), int(rows[0][1])


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
        total = cfg.total_rows
        next_kill, next_term = cfg.kill_every, cfg.terminate_every / 2
        deadline = time.monotonic() + cfg.deadline_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            progress = _progress(url)
            if progress is not None and progress[0] == 0:
                break
            done = (progress[1] / total) if progress is not None else 0.0
            if progress is not None and done < cfg.faults_until:
                if done >= next_kill:
                    i = rng.randrange(len(workers))
                    workers[i].send_signal(signal.SIGKILL)
                    workers[i].wait()
                    workers[i] = start_worker(i)
                    procs.append(workers[i])
                    kills += 1
                    last_fault = now
                    next_kill += cfg.kill_every
                if restarts == 0 and done >= cfg.restart_at:
                    embedded.stop(home, mode="immediate")
                    embedded.ensure_running(home)
                    restarts += 1
                    last_fault = time.monotonic()
                    echo(f"postgres restarted at {done:.0%} of rows")
                if done >= next_term:
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
                    next_term += cfg.terminate_every
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
    outcomes = dict(_query(url, "SELECT outcome::text, count(*) FROM wq_attempts GROUP BY 1"))
    ((rows_done,),) = _query(url, "SELECT count(*) FROM wq_sheet_rows WHERE status = 'done'")
    # A terminal write on a row that was already terminal: a row finished twice.
    ((one, more),) = _query(
        url,
        "SELECT count(*) FILTER (WHERE n = 1), count(*) FILTER (WHERE n > 1) FROM "
        "(SELECT count(*) AS n FROM chaos_row_writes GROUP BY org, sheet, row_key) t",
    )
    # Stale writes applied: a row output or a receipt written by an attempt that was not
    # its run's live attempt in the writing transaction.
    ((stale,),) = _query(
        url,
        "SELECT count(*) FROM chaos_row_writes"
        " WHERE run_state <> 'running' OR run_attempt IS DISTINCT FROM writer_attempt"
        "    OR old_status <> 'pending'",
    )
    ((stale_receipts,),) = _query(
        url,
        "SELECT count(*) FROM chaos_receipt_writes"
        " WHERE run_state <> 'running' OR run_attempt IS DISTINCT FROM owner_attempt",
    )
    # The attempt history: no row output carries a writer attempt that had been closed
    # before the output was written.
    ((after_close,),) = _query(
        url,
        "SELECT count(*) FROM wq_sheet_rows r JOIN wq_attempts a"
        "  ON a.run_id = r.run_id AND a.attempt = r.attempt"
        " WHERE r.status <> 'pending' AND a.finished_at IS NOT NULL"
        "   AND r.finished_at > a.finished_at",
    )
    ((taken_over,),) = _query(
        url,
        "SELECT count(*) FROM wq_sheet_rows r JOIN wq_write_intents i ON i.run_id = r.run_id"
        "  AND i.sheet = r.sheet WHERE r.status = 'done' AND i.write_version > ("
        "    SELECT min(i2.write_version) FROM wq_write_intents i2 WHERE i2.sheet = r.sheet)",
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
    ((attempts,),) = _query(url, "SELECT count(*) FROM wq_attempts")
    expected_rows = cfg.total_rows
    problems = []
    if states.get("succeeded", 0) != cfg.runs:
        problems.append(f"not every run succeeded: {states}")
    if rows_done != expected_rows:
        problems.append(f"{rows_done} rows done of {expected_rows}")
    if one != expected_rows or more:
        problems.append(f"terminal writes: {one} rows with one, {more} with more")
    if stale or stale_receipts or after_close:
        problems.append(
            f"stale writes applied: {stale} row writes, {stale_receipts} receipts, "
            f"{after_close} outputs written after their attempt was closed"
        )
    if reexecuted:
        problems.append(f"{reexecuted} completed steps executed again")
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
        stale_receipts=int(stale_receipts),
        rows_written_after_close=int(after_close),
        rows_taken_over=int(taken_over),
        attempts=int(attempts),
        attempt_outcomes={str(k): int(v) for k, v in outcomes.items()},
        last_fault_to_done_s=round(last_fault_to_done_s, 2),
        total_s=round(total_s, 2),
        problems=problems,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--sheets", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    cfg = ChaosConfig(runs=args.runs, rows=args.rows, sheets=args.sheets, seed=args.seed)
    report = run_chaos(cfg)
    print(json.dumps(asdict(report), indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{cfg.runs}x{cfg.rows}.json").write_text(json.dumps(asdict(report), indent=2))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
