"""Chaos: SIGKILLed and SIGSTOPped workers, a Postgres restart and killed backends, with
nothing lost and no late write applied.

A workload of runs of the ``paid-rows`` play (sheets, and a side-effect-counting step per
row) runs on three worker processes and one recovery process. Runs share sheets (several
runs admit the same row keys), so their write versions really compete: a later run's
intent takes over the rows an earlier run has not finished. The lane keeps the default
retry policy (5 attempts, exponential backoff); only its lease is short (3 s, heartbeat
1 s), which makes every fault harsher, not gentler. Faults are scheduled by progress (rows
completed so far), not by the clock: a worker is SIGKILLed and restarted at every few
percent, every worker backend is terminated at others, Postgres is crash-restarted
(immediate shutdown) once, and a worker is made a zombie at a few points.

A killed worker writes nothing more, and a cut connection takes its statement with it:
neither leaves a writer alive past its lease. A zombie does. The harness SIGSTOPs a worker
whose live attempts all began a while ago, the last cut of connections a while ago too,
preferring the one holding the most telling attempts: a chunk in hand (rows paid, not yet
completed, so a row completion comes next) of a run with the newest write intent on its
sheet (no other run takes those rows over while it sleeps: only the fence stands between
its late completion and the rows). It stops it once none of its backends is inside a
transaction (that would hold its runs' rows locked, and the rescue skips a locked run),
and keeps it stopped until the database says its leases are gone: every attempt it held
closed ``lease_expired`` by the recovery process, at least one of its runs claimed again
by another worker, no run leased to it. It polls for that, with a deadline; it never
sleeps a fixed time. Then it sends SIGCONT. Woken, the worker's watchdog finds its leases
gone and stops the attempts at once, before their next writes; so the plays run
``through_stops`` (``tests/apps/durable.py``): like code that notices neither the stop nor
a refusal, each goes on from where it stood to its end, and every write it makes reaches
the database late, from an attempt that is no longer its run's live attempt, for the fence
to refuse (it pays nothing once it knows it was stopped; a paid call already past
that check goes out when it wakes). Around a zombie the kills and the terminations
go on, sparing it; the restart waits until it has woken (the restart would cut its
connections, and its late writes would never arrive), and a zombie due holds the other
faults back until it is out (each of them restarts attempts).

Audit triggers, installed in the run's database, record every write in the writing
transaction: each terminal row write with the writer's attempt and the run's state at that
moment, each row admission and each completed receipt likewise. At the end the harness
checks and prints:

- every run terminal and succeeded, although attempts lost their leases
  (``lease_expired``: the kills and the zombies; every attempt a zombie held ended so);
  the terminated backends and the restart are absorbed inside the attempts (a call that
  lost its connection is sent again on a new one), and need not end any; the attempts
  per run (max, mean);
- the writes the fence refused, counted by kind from ``wq_refusals``, and among them the
  late writes of the zombies' attempts: at least one when a zombie ran;
- every row finished exactly once (no terminal write on an already terminal row);
- zero stale writes applied: no row output, row admission or receipt written by an
  attempt that was not its run's live attempt when it wrote, and no row output written
  after its writing attempt was closed (compared with the attempt history);
- no step whose receipt was completed ran again in a live attempt (side effects per run
  and row); a zombie stopped inside its paying window pays when woken, however late
  (counted apart as ``zombie_late_payments``: the provider's key makes it free, and the
  harness can only prefer stopping a worker with a chunk in hand, not guarantee it);
- the step executions that repeated an earlier one (a row paid again), split by what
  ended the attempt of the execution before: a zombie's (``zombie``), its worker
  SIGKILLed while it was open (``worker_killed``), its lease lapsed across the restart
  (``restart``) or otherwise with its worker alive (``lease_lapsed``: an outage longer
  than the 3 s lease ends an attempt, as designed), or the attempt ended on a database
  fault: met by the play's own paid call (``paid_call``: a payment committed whose answer
  the fault took; the play's connection is its own, not the worker's to absorb), or by
  the worker's calls (``database``: a problem, absorption should have ridden it);
- the time from the last fault to the last run finishing.

The stale-write checks compare what was written with who was allowed to write, so a
zombie's late write that gets through fails them. ``scripts/fence_mutants.py`` runs this
suite against the fence mutants it kills: a row completion's fence removed whole. One
predicate removed from a fence is still caught by the other here, since a zombie's run is
leased to another worker by then (or to none): a stale attempt under the same worker id
is ``tests/e2e/test_zombie_same_worker.py``'s.

    python -m bench.chaos                             # the CI size
    python -m bench.chaos --runs 100 --rows 1000      # larger

The same function runs at the CI size in ``tests/integration/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import results
from bench.common import add_out, throwaway_home, write_results
from bench.results import metric, summary
from queues import admission
from tests import providers
from worker import embedded

ROOT = Path(__file__).resolve().parent.parent
WORKER_BIN = str(Path(sys.executable).parent / "worker")
APP = "tests.apps.durable:registry"
RELEASE = "chaos"
POLL_S = 0.1

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
-- Every admission of a row (inserted, or re-admitted under a newer version), likewise:
-- the writer's run and attempt, and its run as the admitting transaction sees it.
CREATE TABLE chaos_admissions (
    org text, sheet text, row_key text, run_id uuid, writer_attempt integer,
    run_state text, run_attempt integer, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_audit_admission() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_admissions (org, sheet, row_key, run_id, writer_attempt, run_state,
                                  run_attempt)
    SELECT NEW.org, NEW.sheet, NEW.row_key, NEW.run_id, NEW.attempt, r.state::text,
           r.attempt
      FROM wq_runs r WHERE r.id = NEW.run_id;
    RETURN NEW;
END;
$$;
CREATE TRIGGER chaos_admission_audit AFTER INSERT OR UPDATE ON wq_sheet_rows FOR EACH ROW
    WHEN (NEW.status = 'pending')
    EXECUTE FUNCTION chaos_audit_admission();
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

# A worker's backends carry its id in their application name (``wq-<part> <worker id>``,
# cut at 63 characters): its backends in a statement, and inside a transaction between two.
BACKENDS_SQL = """
SELECT count(*) FILTER (WHERE state = 'active'),
       count(*) FILTER (WHERE state LIKE 'idle in transaction%%')
  FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'client backend'
   AND split_part(application_name, ' ', 2) <> ''
   AND starts_with(%(worker)s, split_part(application_name, ' ', 2))
"""
# The live attempts of some workers, as candidates for a zombie's (see _Lease).
LEASES_SQL = """
SELECT r.lease_owner, r.id::text, r.attempt,
       greatest(a.started_at, %(cut)s) < now() - make_interval(secs => %(zombie_min_age_s)s),
       EXISTS (SELECT 1 FROM wq_write_intents i
                WHERE i.run_id = r.id
                  AND NOT EXISTS (SELECT 1 FROM wq_write_intents o
                                   WHERE o.org = i.org AND o.sheet = i.sheet
                                     AND o.write_version > i.write_version)),
       EXISTS (SELECT 1 FROM wq_receipts c
                 JOIN wq_write_intents i ON i.run_id = c.owner_run
                 JOIN wq_sheet_rows s ON s.org = i.org AND s.sheet = i.sheet
                                     AND s.row_key = substr(c.step_key, length('row:') + 1)
                WHERE c.owner_run = r.id AND c.owner_attempt = r.attempt
                  AND c.status = 'completed' AND s.status = 'pending' AND s.run_id = r.id)
  FROM wq_runs r JOIN wq_attempts a ON a.run_id = r.id AND a.attempt = r.attempt
 WHERE r.state = 'running' AND r.lease_owner = ANY(%(workers)s)
 ORDER BY r.id
"""
# Whether a zombie's leases are gone: each attempt it held is closed, by the rescue (the
# worker is stopped: nothing else closes it); runs claimed again since; runs leased to it.
LAPSED_SQL = """
SELECT count(*), count(*) FILTER (WHERE a.outcome <> 'running'),
       count(*) FILTER (WHERE r.attempt > h.attempt),
       (SELECT count(*) FROM wq_runs WHERE lease_owner = %(worker)s)
  FROM unnest(%(runs)s::uuid[], %(attempts)s::int[]) AS h (run_id, attempt)
  JOIN wq_attempts a ON a.run_id = h.run_id AND a.attempt = h.attempt
  JOIN wq_runs r ON r.id = h.run_id
"""


@dataclass
class ChaosConfig:
    """The workload and its faults. The defaults are the CI size."""

    runs: int = 10
    rows: int = 500
    sheets: int = 5  # runs share sheets: runs r, r + sheets, ... admit the same row keys
    workers: int = 3
    concurrency: int = 4
    chunk: int = 15
    # A chunk's two waits pace a run (a real play waits on APIs), so faults land mid-run:
    # the long one between its receipts and its rows' completion (a chunk already finished
    # skips it, so a resumed attempt is soon back where it was), a short one after it.
    complete_delay_s: float = 0.2
    chunk_delay_s: float = 0.02
    kill_every: float = 0.2  # SIGKILL a worker each time this fraction of rows is done
    terminate_every: float = 0.3  # terminate every worker backend at these steps
    restart_at: float = 0.5  # the one Postgres crash-restart, at this fraction of rows done
    zombies_at: tuple[float, ...] = (0.05, 0.3)  # SIGSTOP a worker at these fractions done
    # Only a worker whose attempts all began this long ago: each is chunks ahead of where
    # its run's next attempt starts, which keeps that attempt from paying a zombie's chunk
    # in hand before the zombie wakes (and finds, before paying, that it was stopped).
    zombie_min_age_s: float = 1.5
    # A zombie due waits this long for a worker holding a telling attempt (its run's
    # newest intent, a chunk in hand: see _Lease), then takes any.
    zombie_telling_s: float = 5.0
    zombie_deadline_s: float = 60.0  # a zombie whose leases are not gone by then is a problem
    zombie_settle_s: float = 1.0  # no restart this long after a zombie's SIGCONT
    faults_until: float = 0.9  # no new faults past this fraction: let the tail finish
    deadline_s: float = 300.0
    seed: int = 7

    @property
    def total_rows(self) -> int:
        """Distinct rows: each sheet holds ``rows`` keys, shared by its runs."""
        return min(self.sheets, self.runs) * self.rows


@dataclass
class Zombie:
    """A worker stopped past its lease: the attempts it held, and how long it slept."""

    worker_id: str
    pid: int
    held: list[tuple[str, int]]  # (run id, attempt) leased to it when it stopped
    stopped_at: float  # time.monotonic()
    resumed_at: float | None = None
    lapsed: bool = False  # its leases were gone when it woke (else: the deadline passed)
    reclaimed: int = 0  # runs of ``held`` claimed again by another worker before it woke
    wake: str = ""  # what the database said when it was woken
    telling: int = 0  # attempts of ``held`` that were telling (``_Lease.telling``)


@dataclass(frozen=True)
class _Lease:
    """A live attempt, as a candidate for a zombie's."""

    run_id: str
    attempt: int
    # Begun over ``zombie_min_age_s`` ago, and the last cut of connections too: an attempt
    # a cut was to end has found its connection gone by then. (A cut absorbed inside the
    # attempt ends none: an attempt from before it is as good as one begun since.)
    old: bool
    # Its run holds the newest write intent on its sheet: no other run takes over the
    # rows of its chunk in hand while it sleeps, so its late completion would find them
    # still its own, pending: only the attempt fence stands in its way.
    newest: bool
    # It holds a chunk in hand: rows it paid (their receipts completed) not yet completed,
    # so its next write is their completion.
    in_hand: bool

    @property
    def telling(self) -> bool:
        """Its next write, a row completion, would land if the fence let it."""
        return self.newest and self.in_hand


@dataclass
class ChaosReport:
    runs: int
    rows_per_run: int
    states: dict[str, int]
    kills: int
    postgres_restarts: int
    backend_terminations: int
    zombies: int  # workers stopped past their lease, then continued
    zombie_attempts: int  # the attempts they held when stopped
    zombie_runs_reclaimed: int  # ... whose runs another worker claimed before they woke
    zombie_telling_attempts: int  # ... that were telling (a row completion next, see _Lease)
    zombie_stopped_s: list[float]
    zombie_attempt_outcomes: dict[str, int]
    zombie_refusals: dict[str, int]  # late writes of the zombies' attempts refused, by kind
    refusals: dict[str, int]  # every write the fence refused (wq_refusals rows), by kind
    refused_rows: dict[str, int]  # the rows (or steps) those writes carried, by kind
    rows_done: int
    rows_with_one_terminal_write: int
    rows_with_more_terminal_writes: int
    side_effects: int
    extra_side_effects: int  # side effects of a (run, step) that already had one
    # ... by what ended the attempt that executed the step before (see _duplicates_by_cause)
    duplicate_executions_by_cause: dict[str, int]
    # The paid provider (tests/providers.py, keyed by ctx.idempotency_key): every call, the
    # charges it made (one per key), and the distinct (run, step) pairs that called it.
    provider_calls: int
    provider_charges: int
    paid_steps: int
    reexecuted_completed_steps: int  # by live attempts
    zombie_late_payments: int  # by zombies woken inside their paying window
    stale_rows: int
    stale_admissions: int
    stale_receipts: int
    rows_written_after_close: int
    rows_taken_over: int  # rows finished by another run than the one that first admitted them
    attempts: int
    attempts_per_run: dict[str, float]  # max and mean
    attempt_outcomes: dict[str, int]
    most_failures_of_a_run: int  # its attempts that failed or lapsed (the policy allows 4)
    last_fault_to_done_s: float
    total_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _env(url: str, provider: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["WORKER_DATABASE_URL"] = url
    env["TEST_SIDE_EFFECTS_URL"] = url  # the test play's own database
    if provider is not None:
        env["TEST_PROVIDER"] = provider  # the paid provider the plays charge each row at
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DATABASE_URL", None)
    return env


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
                        "complete_delay_s": cfg.complete_delay_s,
                        "chunk_delay_s": cfg.chunk_delay_s,
                        "sheet": sheet,
                        # A zombie's plays go on through the watchdog's stop, so their
                        # late writes reach the fence (tests/apps/durable.py, Stops).
                        "through_stops": True,
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
        return conn.execute(sql, params).fetchall()


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


class _Processes:
    """The worker and recovery processes of one chaos run, each the leader of a process
    group of its own, and the faults done to them. Every process started is kept in
    ``started``, so :meth:`stop_all` ends each one however the run ends."""

    def __init__(self, cfg: ChaosConfig, url: str, logs: Path, echo: Any) -> None:
        self.cfg = cfg
        self.url = url
        self.logs = logs
        self.echo = echo
        self.provider: str | None = None  # the paid provider's address, for the plays
        self.rng = random.Random(cfg.seed)
        self.started: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.ready: list[Path] = []  # each worker's ready file: its worker id
        self.zombies: list[Zombie] = []
        self.zombie: Zombie | None = None  # stopped now, or just woken
        # The workers SIGKILLed, each with the time of its kill: an attempt of one still
        # open then lost its lease to the kill.
        self.killed: dict[str, datetime] = {}
        # The last time (the database's clock) the workers' connections were cut: by the
        # restart, or by terminated backends.
        self.cut_at = datetime.min.replace(tzinfo=UTC)
        # The restart's window: from its shutdown to the server answering again.
        self.restarted: tuple[datetime, datetime] | None = None

    def restart_postgres(self, home: Path) -> None:
        """Crash-restart Postgres (immediate shutdown): every connection is cut."""
        began = datetime.now(UTC)
        embedded.stop(home, mode="immediate")
        embedded.ensure_running(home)
        ((self.cut_at,),) = _query(self.url, "SELECT now()")
        self.restarted = (began, self.cut_at)

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with (self.logs / log_name).open("ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [WORKER_BIN, "--json-logs", *args],
                env=_env(self.url, self.provider),
                stdout=log,
                stderr=log,
                cwd=ROOT,
                start_new_session=True,  # a group of its own: a signal reaches all of it
            )
        self.started.append(proc)
        return proc

    def start_worker(self, i: int) -> None:
        ready = self.logs / f"worker-{i}.{len(self.started)}.ready"
        args = ["start", "--release", RELEASE, "--app", APP, "--grace", "1"]
        args += ["--concurrency", str(self.cfg.concurrency), "--ready-file", str(ready)]
        proc = self.spawn(args, f"worker-{i}.log")
        if i < len(self.workers):
            self.workers[i], self.ready[i] = proc, ready
        else:
            self.workers.append(proc)
            self.ready.append(ready)

    def signal(self, proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        """Signal ``proc``'s process group, while ``proc`` has not been reaped (its group
        id cannot have been reused then)."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def kill_worker(self) -> str:
        """SIGKILL a worker (the seeded choice; never the zombie) and start another in its
        place."""
        spared = self.zombie.pid if self.zombie is not None else None
        i = self.rng.choice([i for i, p in enumerate(self.workers) if p.pid != spared])
        worker_id = self.worker_id(i)  # (no ready file yet: it has claimed nothing)
        if worker_id is not None:
            self.killed[worker_id] = datetime.now(UTC)
        self.signal(self.workers[i], signal.SIGKILL)
        self.workers[i].wait()
        self.start_worker(i)
        return worker_id or f"worker {i}"

    def terminate_backends(self) -> int:
        """Terminate every client backend of the database but the zombie's (a cut
        connection would take its late writes with it)."""
        spared = self.zombie.worker_id if self.zombie is not None else ""
        ((terminated, self.cut_at),) = _query(
            self.url,
            "SELECT count(pg_terminate_backend(pid)), now() FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            "   AND backend_type = 'client backend'"
            "   AND NOT (%(spared)s <> '' AND split_part(application_name, ' ', 2) <> ''"
            "            AND starts_with(%(spared)s, split_part(application_name, ' ', 2)))",
            {"spared": spared},
        )
        return int(terminated)

    def restart_exited(self) -> None:
        """Workers that exited (a lost database makes them exit non-zero) are restarted,
        as a supervisor would."""
        for i, proc in enumerate(self.workers):
            if proc.poll() is not None:
                self.start_worker(i)

    def stop_all(self) -> None:
        """SIGKILL every process still running (a stopped one too), and reap it."""
        for proc in self.started:
            self.signal(proc, signal.SIGKILL)
            proc.wait()

    # ---- zombies ------------------------------------------------------------------------

    def worker_id(self, i: int) -> str | None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return str(json.loads(self.ready[i].read_text())["worker_id"])
        return None

    def _leases(self, worker_ids: list[str]) -> dict[str, list[_Lease]]:
        """The live attempts leased to each of ``worker_ids``."""
        rows = _query(
            self.url,
            LEASES_SQL,
            {
                "zombie_min_age_s": self.cfg.zombie_min_age_s,
                "cut": self.cut_at,
                "workers": worker_ids,
            },
        )
        leases: dict[str, list[_Lease]] = {}
        for owner, run_id, attempt, old, newest, in_hand in rows:
            leases.setdefault(str(owner), []).append(
                _Lease(str(run_id), int(attempt), bool(old), bool(newest), bool(in_hand))
            )
        return leases

    def _out_of_transactions(self, worker_id: str) -> bool:
        """Wait (a bounded while) until no backend of the stopped worker runs a statement
        (what it sent before it stopped has finished); then whether none is left inside a
        transaction. One that is would hold its run's row locked: the rescue skips a
        locked run, so the worker's leases would never be taken from it."""
        deadline = time.monotonic() + 5.0
        while True:
            ((active, in_transaction),) = _query(self.url, BACKENDS_SQL, {"worker": worker_id})
            if not active:
                return not in_transaction
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S / 2)

    def stop_zombie(self, *, telling: bool) -> bool:
        """SIGSTOP a worker whose live attempts are all old enough (``_Lease.old``): the
        one holding the most telling attempts, then the most of runs with the newest write
        intent on their sheet, then the most attempts (ties: the seeded choice); with
        ``telling``, only one holding a telling attempt. Returns whether a zombie is out:
        not when no worker qualifies, nor when the one picked is found, once stopped,
        inside a transaction or with an attempt not old enough (it is continued at once,
        and a later call tries again)."""
        ids = {i: wid for i in range(len(self.workers)) if (wid := self.worker_id(i))}
        leases = self._leases(list(ids.values()))
        ready = {
            i: (
                sum(lease.telling for lease in leases[wid]),
                sum(lease.newest for lease in leases[wid]),
                len(leases[wid]),
            )
            for i, wid in ids.items()
            if _old(leases.get(wid, []))
        }
        if telling:
            ready = {i: score for i, score in ready.items() if score[0]}
        if not ready:
            return False
        best = max(ready.values())
        i = self.rng.choice(sorted(i for i, score in ready.items() if score == best))
        proc, worker_id = self.workers[i], ids[i]
        self.signal(proc, signal.SIGSTOP)
        held: list[_Lease] = []
        try:
            if self._out_of_transactions(worker_id):
                held = self._leases([worker_id]).get(worker_id, [])
        finally:
            if not _old(held):
                self.signal(proc, signal.SIGCONT)
        if not _old(held):
            return False
        attempts = [(lease.run_id, lease.attempt) for lease in held]
        self.zombie = Zombie(worker_id, proc.pid, attempts, time.monotonic())
        self.zombie.telling = sum(lease.telling for lease in held)
        self.zombies.append(self.zombie)
        return True

    def tend_zombie(self) -> bool:
        """Wake the stopped zombie once its leases are gone (or at the deadline); returns
        whether a zombie still holds the other faults back (stopped, or just woken)."""
        z = self.zombie
        if z is None:
            return False
        now = time.monotonic()
        if z.resumed_at is None:
            try:
                ((held, closed, reclaimed, leased),) = _query(
                    self.url,
                    LAPSED_SQL,
                    {
                        "worker": z.worker_id,
                        "runs": [r for r, _ in z.held],
                        "attempts": [a for _, a in z.held],
                    },
                )
            except psycopg.OperationalError:
                held = closed = reclaimed = leased = 0
            z.lapsed = bool(held) and closed == held and reclaimed > 0 and leased == 0
            if z.lapsed or now - z.stopped_at > self.cfg.zombie_deadline_s:
                z.reclaimed = int(reclaimed)
                z.wake = (
                    f"{closed} of {held} attempts closed, {reclaimed} runs claimed again, "
                    f"{leased} still leased to it"
                )
                self.signal(next(p for p in self.started if p.pid == z.pid), signal.SIGCONT)
                z.resumed_at = time.monotonic()
                self.echo(
                    f"zombie {z.worker_id} woken after {z.resumed_at - z.stopped_at:.1f}s: "
                    + z.wake
                )
            return True
        if now - z.resumed_at < self.cfg.zombie_settle_s:
            return True
        self.zombie = None
        return False


def _old(leases: list[_Lease]) -> bool:
    """Some attempts, and every one of them old enough to be a zombie's."""
    return bool(leases) and all(lease.old for lease in leases)


def run_chaos(cfg: ChaosConfig, *, echo: Any = print) -> ChaosReport:
    with throwaway_home("chaos-", keep_env="CHAOS_KEEP") as home:
        return _run_chaos(cfg, home, echo)


def _run_chaos(cfg: ChaosConfig, home: Path, echo: Any) -> ChaosReport:
    logs = home / "logs"
    logs.mkdir()
    procs: _Processes | None = None
    started = time.monotonic()
    provider = providers.Provider()  # the plays pay each row here, keyed
    serving = threading.Thread(target=provider.serve_forever, daemon=True)
    serving.start()
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

        def say(done: float, what: str) -> None:
            echo(f"{time.monotonic() - started:6.1f}s {done:4.0%} {what}")

        done = 0.0  # the fraction of rows done, as last read
        procs = _Processes(cfg, url, logs, lambda what: say(done, what))
        procs.provider = provider.url
        for i in range(cfg.workers):
            procs.start_worker(i)
        procs.spawn(["recover", "--every", "1s"], "recovery.log")

        kills = restarts = terminations = 0
        last_fault = time.monotonic()
        total = cfg.total_rows
        next_kill, next_term = cfg.kill_every, cfg.terminate_every / 2
        zombies_at = sorted(cfg.zombies_at)
        due_since: float | None = None  # since when the next zombie is due
        deadline = time.monotonic() + cfg.deadline_s

        while time.monotonic() < deadline:
            now = time.monotonic()
            zombie = procs.zombie if procs.tend_zombie() else None
            if zombie is not None and zombie.resumed_at is not None:
                last_fault = max(last_fault, zombie.resumed_at)
            progress = _progress(url)
            if progress is not None and progress[0] == 0 and zombie is None:
                break  # (a zombie's late writes land first)
            done = (progress[1] / total) if progress is not None else done
            # The restart cuts every connection, a zombie's too: it waits while a zombie is
            # out, and goes before the next one. It is not cut off by faults_until: a zombie
            # out past it (a slow machine) leaves the restart for the rows still to do.
            if progress is not None and restarts == 0 and done >= cfg.restart_at and zombie is None:
                procs.restart_postgres(home)
                restarts += 1
                last_fault = time.monotonic()
                say(done, "postgres restarted")
                continue
            if progress is not None and done < cfg.faults_until:
                if zombie is None and zombies_at and done >= zombies_at[0]:
                    # A zombie due holds the other faults back until it is out: each of
                    # them restarts attempts, and a zombie needs a worker whose attempts
                    # have all been running a while. It waits a while for a telling one.
                    due_since = due_since or now
                    telling = now - due_since < cfg.zombie_telling_s
                    with contextlib.suppress(psycopg.OperationalError):
                        if procs.stop_zombie(telling=telling):
                            zombies_at.pop(0)
                            due_since = None
                            zombie = procs.zombies[-1]
                            held = f"{len(zombie.held)} held, {zombie.telling} telling"
                            say(done, f"zombie {zombie.worker_id} stopped, {held}")
                    procs.restart_exited()
                    time.sleep(POLL_S)
                    continue
                # Around a zombie the kills and the terminations go on, sparing it.
                if done >= next_kill:
                    say(done, f"kill {procs.kill_worker()}")
                    kills += 1
                    last_fault = now
                    next_kill += cfg.kill_every
                if done >= next_term:
                    with contextlib.suppress(psycopg.OperationalError):
                        terminated = procs.terminate_backends()
                        terminations += terminated
                        last_fault = now
                        say(done, f"terminated {terminated} backends")
                    next_term += cfg.terminate_every
            procs.restart_exited()
            # While a zombie sleeps, look often: it is woken soon after its run is claimed
            # again.
            time.sleep(POLL_S / 4 if zombie is not None and zombie.resumed_at is None else POLL_S)
        done_at = time.monotonic()
        return _report(
            url,
            cfg,
            run_ids,
            procs.zombies,
            procs.killed,
            procs.restarted,
            kills,
            restarts,
            terminations,
            done_at - last_fault,
            done_at - started,
            provider,
        )
    finally:
        provider.shutdown()
        provider.server_close()
        serving.join()
        if procs is not None:
            procs.stop_all()


def _report(
    url: str,
    cfg: ChaosConfig,
    run_ids: list[str],
    zombies: list[Zombie],
    killed: dict[str, datetime],
    restarted: tuple[datetime, datetime] | None,
    kills: int,
    restarts: int,
    terminations: int,
    last_fault_to_done_s: float,
    total_s: float,
    provider: providers.Provider,
) -> ChaosReport:
    states = dict(_query(url, "SELECT state::text, count(*) FROM wq_runs GROUP BY 1"))
    outcomes = dict(_query(url, "SELECT outcome::text, count(*) FROM wq_attempts GROUP BY 1"))
    # Every write the fence refused, by kind: the writes, and the rows (or steps) they held.
    refused = _query(url, "SELECT kind, count(*), sum(rows) FROM wq_refusals GROUP BY 1")
    # The zombies' attempts: how they ended, and their late writes the fence refused (a
    # refusal names the writer's run, attempt and worker).
    held = {
        "runs": [run_id for z in zombies for run_id, _ in z.held],
        "attempts": [attempt for z in zombies for _, attempt in z.held],
        "workers": [z.worker_id for z in zombies for _ in z.held],
    }
    zombie_outcomes = dict(
        _query(
            url,
            "SELECT a.outcome::text, count(*) FROM wq_attempts a"
            "  JOIN unnest(%(runs)s::uuid[], %(attempts)s::int[]) AS h (run_id, attempt)"
            "    ON a.run_id = h.run_id AND a.attempt = h.attempt GROUP BY 1",
            held,
        )
    )
    zombie_refusals = dict(
        _query(
            url,
            "SELECT f.kind, count(*) FROM wq_refusals f"
            "  JOIN unnest(%(runs)s::uuid[], %(attempts)s::int[], %(workers)s::text[])"
            "       AS h (run_id, attempt, worker_id)"
            "    ON f.run_id = h.run_id AND f.attempt = h.attempt AND f.worker_id = h.worker_id"
            " GROUP BY 1",
            held,
        )
    )
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
    ((stale_admissions,),) = _query(
        url,
        "SELECT count(*) FROM chaos_admissions"
        " WHERE run_state <> 'running' OR run_attempt IS DISTINCT FROM writer_attempt",
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
    # executed again. By a live attempt: must be zero. By a zombie's attempt: a zombie
    # stopped inside its paying window (past its last check that it was stopped, before
    # its paid call and side effect) makes them when woken, however late; nothing in the
    # database can stop a paused process's call in flight, the provider's idempotency key
    # makes it free (provider charges equal paid steps), and it is counted apart.
    ((reexecuted, zombie_late),) = _query(
        url,
        "SELECT count(*) FILTER (WHERE h.run_id IS NULL), count(h.run_id)"
        "  FROM test_side_effects s JOIN wq_receipts r "
        "    ON r.scope = 'run:' || s.run_id AND r.step_key = s.key "
        "  LEFT JOIN unnest(%(runs)s::uuid[], %(attempts)s::int[]) AS h (run_id, attempt)"
        "    ON h.run_id = s.run_id AND h.attempt = s.attempt"
        " WHERE r.status = 'completed' AND r.completed_at < s.at",
        held,
    )
    by_cause = _duplicates_by_cause(url, zombies, killed, restarted)
    ((attempts,),) = _query(url, "SELECT count(*) FROM wq_attempts")
    ((most_attempts, mean_attempts),) = _query(
        url,
        "SELECT coalesce(max(n), 0), coalesce(avg(n), 0) FROM"
        " (SELECT count(*) AS n FROM wq_attempts GROUP BY run_id) t",
    )
    ((most_failures,),) = _query(
        url,
        "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM wq_attempts"
        " WHERE outcome IN ('failed', 'lease_expired') GROUP BY run_id) t",
    )
    expected_rows = cfg.total_rows
    problems = []
    if states.get("succeeded", 0) != cfg.runs:
        problems.append(f"not every run succeeded: {states}")
    if rows_done != expected_rows:
        problems.append(f"{rows_done} rows done of {expected_rows}")
    if one != expected_rows or more:
        problems.append(f"terminal writes: {one} rows with one, {more} with more")
    if stale or stale_admissions or stale_receipts or after_close:
        problems.append(
            f"stale writes applied: {stale} row writes, {stale_admissions} admissions, "
            f"{stale_receipts} receipts, {after_close} outputs written after their attempt "
            "was closed"
        )
    if reexecuted:
        problems.append(f"{reexecuted} completed steps executed again")
    if by_cause.get("database"):
        problems.append(
            f"{by_cause['database']} step executions repeated after database faults alone"
        )
    asleep = [z.worker_id for z in zombies if not z.lapsed]
    if asleep:
        problems.append(f"zombies woken before their leases were gone: {asleep}")
    zombie_attempts = sum(len(z.held) for z in zombies)
    if zombie_outcomes.get("lease_expired", 0) != zombie_attempts:
        problems.append(
            f"the zombies' {zombie_attempts} attempts did not all end lease_expired: "
            f"{zombie_outcomes}"
        )
    if zombies and not zombie_refusals:
        problems.append(f"no late write of {len(zombies)} zombies was refused (none arrived)")
    # The provider charges by key: a key that differed between two attempts of a step would
    # charge it twice. Charges must equal the steps called (each run's, once), and every
    # step a play recorded as paid must have been charged.
    paid = {
        (str(r), str(k))
        for r, k in _query(url, "SELECT DISTINCT run_id, key FROM test_side_effects")
    }
    with provider.lock:
        charges, calls = len(provider.charges), len(provider.calls)
        keyed = {step: len(keys) for step, keys in provider.keys.items()}
    paid_steps = len(keyed)
    twice = sum(1 for n in keyed.values() if n > 1)
    if twice or charges != paid_steps:
        problems.append(
            f"the provider charged {charges} times for {paid_steps} steps ({twice} steps "
            "came with more than one key)"
        )
    if paid - keyed.keys():
        problems.append(f"{len(paid - keyed.keys())} paid steps never reached the provider")
    return ChaosReport(
        runs=len(run_ids),
        rows_per_run=cfg.rows,
        states={str(k): int(v) for k, v in states.items()},
        kills=kills,
        postgres_restarts=restarts,
        backend_terminations=terminations,
        zombies=len(zombies),
        zombie_attempts=zombie_attempts,
        zombie_runs_reclaimed=sum(z.reclaimed for z in zombies),
        zombie_telling_attempts=sum(z.telling for z in zombies),
        zombie_stopped_s=[
            round(z.resumed_at - z.stopped_at, 2) for z in zombies if z.resumed_at is not None
        ],
        zombie_attempt_outcomes={str(k): int(v) for k, v in zombie_outcomes.items()},
        zombie_refusals={str(k): int(v) for k, v in zombie_refusals.items()},
        refusals={str(kind): int(n) for kind, n, _ in refused},
        refused_rows={str(kind): int(rows) for kind, _, rows in refused},
        rows_done=int(rows_done),
        rows_with_one_terminal_write=int(one),
        rows_with_more_terminal_writes=int(more),
        side_effects=int(effects),
        extra_side_effects=int(extra),
        duplicate_executions_by_cause=by_cause,
        provider_calls=calls,
        provider_charges=charges,
        paid_steps=int(paid_steps),
        reexecuted_completed_steps=int(reexecuted),
        zombie_late_payments=int(zombie_late),
        stale_rows=int(stale),
        stale_admissions=int(stale_admissions),
        stale_receipts=int(stale_receipts),
        rows_written_after_close=int(after_close),
        rows_taken_over=int(taken_over),
        attempts=int(attempts),
        attempts_per_run={"max": int(most_attempts), "mean": round(float(mean_attempts), 2)},
        attempt_outcomes={str(k): int(v) for k, v in outcomes.items()},
        most_failures_of_a_run=int(most_failures),
        last_fault_to_done_s=round(last_fault_to_done_s, 2),
        total_s=round(total_s, 2),
        problems=problems,
    )


def _duplicates_by_cause(
    url: str,
    zombies: list[Zombie],
    killed: dict[str, datetime],
    restarted: tuple[datetime, datetime] | None = None,
) -> dict[str, int]:
    """The step executions that repeated an earlier one (a side effect of a run and step
    that already had one), by what made the step run again, as decided by the attempt of
    the execution before: ``zombie`` when it was an attempt a zombie held when stopped (or
    one the zombie's worker claimed meanwhile and lost with its lease), ``worker_killed``
    when its worker was SIGKILLed while it was open; ``restart`` when its lease lapsed
    across the Postgres restart (the outage outlasted the lease, 3 s here: then the
    attempt ends, as designed), ``lease_lapsed`` when it lapsed otherwise (a live worker
    whose heartbeat could not renew it in time through cut connections); else the attempt
    itself ended on a database fault, which absorption should have ridden:
    ``paid_call`` when the play's own
    paid call met it (the play's connection, to the faulted database: the payment
    committed, its answer lost; the worker's absorption does not reach a play's own
    calls), ``database`` otherwise. Only causes with executions are keys."""
    held = {(run_id, attempt) for z in zombies for run_id, attempt in z.held}
    zombie_workers = {z.worker_id for z in zombies}
    rows = _query(
        url,
        "SELECT e.run_id::text, e.before, a.worker_id, a.started_at, a.finished_at,"
        "       a.outcome::text, a.error ->> 'traceback', count(*) FROM"
        " (SELECT run_id, lag(attempt) OVER (PARTITION BY run_id, key ORDER BY at, attempt)"
        "         AS before FROM test_side_effects) e"
        "  LEFT JOIN wq_attempts a ON a.run_id = e.run_id AND a.attempt = e.before"
        " WHERE e.before IS NOT NULL GROUP BY 1, 2, 3, 4, 5, 6, 7",
    )
    causes: dict[str, int] = {}
    for run_id, attempt, worker_id, started_at, finished_at, outcome, traceback, n in rows:
        lapsed = outcome == "lease_expired"
        if (run_id, attempt) in held or (lapsed and worker_id in zombie_workers):
            cause = "zombie"
        elif worker_id in killed and (finished_at is None or finished_at >= killed[worker_id]):
            cause = "worker_killed"
        elif (
            lapsed
            and restarted is not None
            and started_at is not None
            and finished_at is not None
            and started_at <= restarted[1]
            and finished_at >= restarted[0]
        ):
            cause = "restart"
        elif lapsed:
            # A live worker that lost a lease: its heartbeat could not renew within the
            # lease (3 s here) through the cut connections. Bounded by the lease, as the
            # absorption is; what it forbids is a repeat after an attempt it ended.
            cause = "lease_lapsed"
        elif _raised_by_the_play(traceback):
            cause = "paid_call"
        else:
            cause = "database"
        causes[cause] = causes.get(cause, 0) + int(n)
    return causes


def _raised_by_the_play(traceback: str | None) -> bool:
    """Whether an attempt's error was raised by a call of the play's own (the innermost
    frame of this tree's code is the app's or its provider's, under ``tests``), not by a
    call to the worker (``worker``, ``queues``)."""
    own = [
        parts
        for file in re.findall(r'File "([^"]+)"', traceback or "")
        if (path := Path(file)).is_relative_to(ROOT)
        and (parts := path.relative_to(ROOT).parts)[0] in ("worker", "queues", "tests")
    ]
    return bool(own) and own[-1][0] == "tests"


def summarize(report: ChaosReport) -> dict[str, Any]:
    """The faults dealt and what they left, for :mod:`bench.results`: every figure but
    the faults' counts and the times should be zero."""
    stale = (
        report.stale_rows
        + report.stale_admissions
        + report.stale_receipts
        + report.rows_written_after_close
    )
    shown = [
        ("runs", "runs", "runs", report.runs, True),
        ("rows", "rows per run", "rows", report.rows_per_run, True),
        ("kills", "workers SIGKILLed", "faults", report.kills, True),
        ("restarts", "Postgres crash-restarts", "faults", report.postgres_restarts, True),
        ("terminations", "backend terminations", "faults", report.backend_terminations, True),
        ("zombies", "zombies", "faults", report.zombies, True),
        ("refused", "writes the fence refused", "writes", sum(report.refusals.values()), True),
        (
            "unfinished",
            "runs not succeeded",
            "runs",
            report.runs - report.states.get("succeeded", 0),
            False,
        ),
        ("stale", "stale writes applied", "writes", stale, False),
        (
            "twice",
            "rows finished more than once",
            "rows",
            report.rows_with_more_terminal_writes,
            False,
        ),
        (
            "replayed",
            "completed steps run again by a live attempt",
            "steps",
            report.reexecuted_completed_steps,
            False,
        ),
        (
            "zombie_late_payments",
            "completed steps a woken zombie paid again (free: keyed)",
            "steps",
            report.zombie_late_payments,
            False,
        ),
        (
            "recovery_s",
            "last fault to last run done",
            "s",
            round(report.last_fault_to_done_s, 1),
            False,
        ),
        ("problems", "problems", "problems", len(report.problems), False),
    ]
    metrics = [metric(k, label, unit, higher_is_better=h) for k, label, unit, _, h in shown]
    return summary(metrics, {"ours": {k: v for k, _, _, v, _ in shown}}, ratios={})


def main() -> None:
    ci = ChaosConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=ci.runs)
    parser.add_argument("--rows", type=int, default=ci.rows)
    parser.add_argument("--sheets", type=int, default=ci.sheets)
    parser.add_argument("--seed", type=int, default=ci.seed)
    add_out(parser)
    args = parser.parse_args()
    cfg = ChaosConfig(runs=args.runs, rows=args.rows, sheets=args.sheets, seed=args.seed)
    started = time.perf_counter()
    record = results.start("chaos", asdict(cfg))
    report = run_chaos(cfg)
    print(json.dumps(asdict(report), indent=2))
    record["results"] = asdict(report)
    record["summary"] = summarize(report)
    if not report.ok:
        record["error"] = "; ".join(report.problems)
    write_results(record, args.out, started, file=sys.stderr)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
